"""ExactPlans: a backend's plan made exact in bytes (solver/rounding.py), checked against exact
peak evaluations, on hand-made graphs and on the random graphs of test_milp_properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimators.contract.module_info import ModuleInfo
from solver.graph import Graph
from solver.plan_cost import MemoryModel, has_window, module_recompute_ms
from solver.rounding import ExactPlans
from tests.solver.builders import MiB, chain, make_info, mod, pt
from tests.solver.strategies import PROPS, module_infos


def _exact(info) -> ExactPlans:
    return ExactPlans(MemoryModel(info, 1), {n.fqn: n.index for n in Graph.from_module_info(info)})


def _ms(exact: ExactPlans, plan: dict[str, int]) -> float:
    return sum(module_recompute_ms(exact.memory.stats[f], d) for f, d in plan.items())


def _stepped() -> ModuleInfo:
    """One module of 100 MiB: its first 60 MiB cost 1 ms, the last 40 MiB 9 ms (a step at 60 MiB).
    Its window holds the activation peak: 300 MiB with nothing discarded."""
    curve = ((0, 0.0), (60, 1.0), (100, 10.0))
    stats = [mod("M"), mod("M.b", size_mib=100, fw_post=10, bw_pre=30, curve=curve), mod("M.b.fc", leaf=True)]
    return make_info(stats, [pt(20, 300), pt(40, 100)])


def test_polish_gives_back_bytes_pushed_past_a_step_of_the_curve() -> None:
    exact = _exact(_stepped())
    budget = 240 * MiB  # 60 MiB discarded fit it exactly
    plan = {"M.b": 60 * MiB + 3}  # the backend's tolerance: 3 bytes into the 9 ms segment
    assert exact.memory.peak(plan) <= budget
    polished = exact.polish(plan, budget)
    assert polished == {"M.b": 60 * MiB}
    assert _ms(exact, polished) == 1.0 < _ms(exact, plan)
    # Where the budget needs those bytes, they stay.
    assert exact.polish(plan, budget - 3) == plan


def test_polish_moves_the_bytes_to_a_module_with_room_where_that_costs_less() -> None:
    stats = [mod("M"), mod("M.a", size_mib=100, fw_post=10, bw_pre=30, curve=((0, 0.0), (60, 1.0), (100, 10.0))),
             mod("M.a.fc", leaf=True), mod("M.c", size_mib=100, ms=1.0, fw_post=11, bw_pre=29),
             mod("M.c.fc", leaf=True)]
    exact = _exact(make_info(stats, [pt(20, 300), pt(40, 100)]))
    plan = {"M.a": 60 * MiB + 5, "M.c": 10 * MiB}
    budget = exact.memory.peak(plan)  # every byte is needed
    polished = exact.polish(plan, budget)
    assert polished == {"M.a": 60 * MiB, "M.c": 10 * MiB + 5}
    assert exact.memory.peak(polished) <= budget and _ms(exact, polished) < _ms(exact, plan)


def test_repair_discards_what_rounding_left_over_budget_and_settle_gives_back_the_rest() -> None:
    exact = _exact(chain())
    read = {"M.b1": 20 * MiB}
    budget = exact.memory.peak(read) - 1000  # rounding left the plan 1,000 bytes over
    plan, short = exact.repair(read, budget)
    assert short == 0 and exact.memory.peak(plan) <= budget
    assert all(plan.get(f, 0) >= d for f, d in read.items())
    # Solved at a target 1 MiB under the budget: settle keeps only what the budget needs.
    settled, short = exact.settle({"M.b1": 21 * MiB}, budget, budget - MiB)
    assert short == 0 and exact.memory.peak(settled) <= budget
    assert _ms(exact, settled) <= _ms(exact, {"M.b1": 21 * MiB})
    assert sum(settled.values()) <= 20 * MiB + 1000


def test_repair_says_how_many_bytes_the_plan_s_modules_cannot_free() -> None:
    exact = _exact(_stepped())
    budget = exact.memory.peak({"M.b": 100 * MiB}) - 7  # the module whole is not enough
    assert exact.repair({"M.b": 50 * MiB}, budget) == ({"M.b": 100 * MiB}, 7)
    # A point no planned module covers: nothing to add.
    exact = _exact(chain())
    budget = exact.memory.peak({}) - 7  # the peak is at t=40, where b2's backward has begun
    assert exact.repair({"M.b2": 50 * MiB}, budget) == ({"M.b2": 50 * MiB}, 7)


@pytest.mark.property
@PROPS
@given(info=module_infos(), data=st.data())
def test_each_step_keeps_the_budget_and_never_adds_recompute(info, data) -> None:
    exact = _exact(info)
    graph = Graph.from_module_info(info)
    # A plan of non-nested modules with room to discard, at random ratios.
    plan: dict[str, int] = {}
    for node in graph:
        s = node.stats
        if s.is_leaf or s.sac_memory_bytes <= 0 or not has_window(s):
            continue
        if any(a.fqn in plan for a in graph.ancestors(node.fqn)) or not data.draw(st.booleans()):
            continue
        plan[node.fqn] = data.draw(st.integers(0, s.sac_memory_bytes))
    peak = exact.memory.peak(plan)
    slack = data.draw(st.integers(0, 4 * MiB))
    budget = peak + slack
    for out in (exact.polish(plan, budget), exact.trim(plan, budget, data.draw(st.integers(0, 8 * MiB)))):
        assert set(out) <= set(plan)
        assert exact.memory.peak(out) <= budget
        assert _ms(exact, out) <= _ms(exact, plan) + 1e-12
        assert exact.polish(plan, budget) == exact.polish(plan, budget)  # deterministic
    over = max(1, peak - data.draw(st.integers(1, 2 * MiB)))
    repaired, short = exact.repair(plan, over)
    assert all(repaired.get(f, 0) >= d for f, d in plan.items())
    assert exact.memory.peak(repaired) == over + short if short else exact.memory.peak(repaired) <= over
