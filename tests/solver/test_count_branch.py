"""solver/count_branch.py: branching on per-kind checkpoint counts reaches the plain MILP's optimum.

The stacks of identical blocks of test_symmetry.py (named ``M.blocks.<i>...``, so every block kind
forms a group) and the random trees of test_milp_properties.py with every candidate in one group,
or grouped by depth (the grouping decides speed, never the optimum): count branching and HiGHS'
own branch and bound, both asked for exact optimality, reach the same value within 1e-6 relative.

``SAC_PROPERTY_EXAMPLES=250 python -m pytest -q tests/solver/test_count_branch.py`` runs more.
"""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import solver.sac_milp as milp_module
from solver import SACMilp, SolverOptions, SolveStatus, predict_peak_bytes
from solver.count_branch import CountBrancher, kind_groups
from tests.solver.test_sac_milp_properties import module_infos
from tests.solver.test_symmetry import FEW, MANY, stacked_infos

EXACT = SolverOptions(rel_gap=0.0, count_branching=True)
EXACT_PLAIN = SolverOptions(rel_gap=0.0, count_branching=False)


def test_kind_groups_strip_numeric_path_components() -> None:
    fqns = ["M", "M.layers.0", "M.layers.0.mlp", "M.layers.1", "M.layers.1.mlp", "M.layers.12",
            "M.head", "M.blocks.3.attn.core", "M.blocks.4.attn.core", "M.m0", "M.m1"]
    assert kind_groups(fqns) == [[1, 3, 5], [2, 4], [7, 8]]


def _values(info, frac: float, *, monkeypatch=None, groups=None) -> None:
    """Same optimal value from count branching and from HiGHS alone (both exact); the plan
    fits and solving again gives the same plan.

    At a budget within 1e-6 of the smallest reachable peak (or of the no-AC peak) the MILP's
    feasible set is a sliver
    the backend's primal tolerance (1e-7 of a unit) decides, so two exact searches may return
    objectives that differ there (seen: 78.373 vs 78.339 ms at the min-peak budget), so there
    the planner's results are compared instead of the raw objectives."""
    if groups is not None:
        monkeypatch.setattr(milp_module, "kind_groups", groups)
    counted, plain = SACMilp(info, options=EXACT), SACMilp(info, options=EXACT_PLAIN)
    lo, hi = plain.min_reachable_peak_bytes(), plain.no_ac_peak_bytes
    budget = lo + int(frac * (hi - lo))
    if not plain._cands:
        return
    # A budget within 1e-6 of either end is a sliver too: a byte under the no-AC peak (9.5e-7
    # of a MiB unit) needs r ~ 1e-8 of a module, where HiGHS at 1e-8 says "infeasible" (seen at
    # 1 byte under 102,760,448 B, while count branching proves 3.4e-7 ms) and the two searches'
    # "optimal" plans differ by 1e-5 ms; there only the plans' fit is checked.
    inside = lo + 1e-6 * hi < budget < hi - 1e-6 * hi
    values = []
    for m in (counted, plain):
        m._model()
        m._set_budget(m._units(budget))
        m._prob.set_cost(m._recompute_objective)
        t0 = time.perf_counter()
        sol = m._count_search(t0)  # None: too wide for count branching, the whole model then
        sol = sol if sol is not None else m._solve_whole(t0)
        assert sol.outcome.proven or not sol.outcome.has_solution
        # The plan's objective, not the backend's: rct columns may carry slack its tolerances
        # allow (1.46e-6 ms under a segment of slope 9.3e6 ms at r = 1.6e-13, one plan from both).
        values.append(m.objective_of(sol.values) if sol.outcome.has_solution else None)
    za, zb = values
    if inside:
        assert za is not None and zb is not None, (za, zb)
        # 1e-6 relative; near 0 ms, 1e-6 ms absolute: plans that recompute nothing differ
        # there only by the tie-break (1e-7 ms seen: 0 vs 8.3e-8), which rel_gap = 0 cannot split.
        assert abs(za - zb) <= 1e-6 * max(abs(za), 1.0), (za, zb)
    ra, rb = counted.solve(budget), plain.solve(budget)
    for res in (ra, rb):
        assert res.predicted_peak_bytes <= budget
        assert predict_peak_bytes(info, res.discarded_bytes) == res.predicted_peak_bytes
    if budget - lo <= 1e-6 * hi:
        # Never worse. It may be better: at a budget on the smallest reachable peak HiGHS alone
        # may refuse the whole model by tolerance and fall back to the min-peak plan, while a
        # fixed-count MILP proves a plan of the same peak (seen: 0.05 against 3.83 ms). The
        # planner's plans are compared, not MILP values, which tolerances decide in this sliver:
        # HiGHS' 1e-8 on r <= y let one module discard 0.67 bytes past its size in exchange for
        # another's last byte, whose 1 ms a slope of 3.3e7 ms per unit prices at 0.67 ms (MILP
        # values 1.83 against 2.5 ms, one plan of 2.5 ms). The plans are exact once read: the
        # repair completes what rounding left short, _trim gives back what it over-discards and
        # _polish the bytes pushed past a step of a curve (before them: 0.15 against 0.2 ms on a
        # curve whose last byte costs 0.05 ms; 2.0e-5 ms apart after a repair). Where either
        # fell back to its min-peak plan there is nothing to compare: that plan minimises the
        # peak, and its recompute is whichever min-peak plan the backend met first.
        if ra.milp_objective is not None and rb.milp_objective is not None:
            assert ra.recompute_ms <= rb.recompute_ms + 1e-6 * max(rb.recompute_ms, 1.0), (ra, rb)
    elif counted._counter is not None:
        assert ra.status is SolveStatus.OPTIMAL
        assert counted.solve(budget).decisions == ra.decisions


@MANY
@given(stacked_infos(), st.floats(0.0, 1.0))
def test_stacks_of_blocks_keep_the_plain_optimum(info, frac) -> None:
    _values(info, frac)


@FEW
@given(module_infos(), st.floats(0.0, 1.0))
def test_random_trees_in_one_group_keep_the_plain_optimum(info, frac) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _values(info, frac, monkeypatch=mp, groups=lambda fqns: [list(range(len(fqns)))] if len(fqns) > 1 else [])


@FEW
@given(module_infos(), st.floats(0.0, 1.0))
def test_random_trees_grouped_by_depth_keep_the_plain_optimum(info, frac) -> None:
    def by_depth(fqns):
        groups = {}
        for i, f in enumerate(fqns):
            groups.setdefault(f.count("."), []).append(i)
        return [g for g in groups.values() if len(g) > 1]

    with pytest.MonkeyPatch.context() as mp:
        _values(info, frac, monkeypatch=mp, groups=by_depth)


def test_stacks_get_count_rows_and_trees_without_numbered_modules_do_not() -> None:
    @MANY
    @given(stacked_infos())
    def check(info):
        m = SACMilp(info, options=EXACT)
        kinds = kind_groups([c.node.fqn for c in m._cands])
        if m._cands:
            m._model()
        assert (m._counter is not None) == bool(kinds)
        assert m.n_constraints == SACMilp(info, options=EXACT_PLAIN).n_constraints + len(kinds)

    check()


def test_out_of_time_keeps_the_incumbent_without_a_proof() -> None:
    """A search stopped before any box was bounded returns the incumbent it was given, not
    proven, gap unknown; with no incumbent it says it has no solution and is not infeasible."""
    from tests.solver.test_sac_milp import chain

    m = SACMilp(chain(), options=SolverOptions(count_branching=False))
    m._model()
    m._set_budget(m._units(400 * 2**20))
    m._prob.set_cost(m._recompute_objective)
    incumbent = m._prob.solve(m.options)
    brancher = CountBrancher(m._prob, m._y, [list(range(len(m._cands)))])
    out = brancher.solve(m.options, incumbent, time.perf_counter() - 1.0, 0.0)
    assert out.objective == incumbent.objective and not out.outcome.proven
    assert out.outcome.gap is None
    none = brancher.solve(m.options, None, time.perf_counter() - 1.0, 0.0)
    assert none.values is None and not none.outcome.infeasible
    full = brancher.solve(m.options, None, None, 0.0)
    assert full.outcome.proven and math.isclose(full.objective, incumbent.objective, rel_tol=1e-9)


def test_count_branching_option_is_validated() -> None:
    with pytest.raises(TypeError, match="count_branching"):
        SolverOptions(count_branching=1)


def test_warm_relaxation_matches_a_cold_one_after_bound_and_cost_changes() -> None:
    """solve_relaxation re-uses one HiGHS instance across calls: after count rows, the budget
    and the objective change, its value equals a relaxation solved from scratch."""
    from tests.solver.test_sac_milp import chain

    m = SACMilp(chain(), options=SolverOptions(count_branching=False))
    prob = m._model()
    brancher = CountBrancher(prob, m._y, [list(range(len(m._cands)))])
    n = len(m._cands)
    steps = [(400, (0, n), True), (300, (1, n), True), (300, (0, 1), True), (500, (0, n), False),
             (250, (1, 1), True)]
    for mib, (lo, hi), recompute in steps:
        m._set_budget(m._units(mib * 2**20))
        prob.set_row_bounds(brancher.rows[0], lo, hi)
        prob.set_cost(m._recompute_objective if recompute else [(m._peak, 1.0)])
        warm = prob.solve_relaxation(m.options)
        kept = prob._relax
        prob.reset_relaxation()
        cold = prob.solve_relaxation(m.options)  # a fresh HiGHS instance, the model passed anew
        prob._relax = kept
        assert warm.outcome.infeasible == cold.outcome.infeasible
        assert (warm.objective is None) == (cold.objective is None)
        if warm.objective is not None:
            assert math.isclose(warm.objective, cold.objective, rel_tol=1e-9, abs_tol=1e-9)



def test_the_repair_margin_is_given_back_at_the_smallest_peak() -> None:
    # A stack from a 1,000-example run: count branching's plan left one block 831 bytes short
    # of whole and another 831 bytes over what it needed (equal slopes, one MILP value); the
    # repair completed the first and the plan cost 2.0e-5 ms more than HiGHS alone's.
    import json
    from pathlib import Path

    from estimators.contract.module_info import ModuleInfo

    path = Path(__file__).parent / "data" / "count_branch_smallest_peak_stack.json"
    (case,) = json.loads(path.read_text())
    _values(ModuleInfo.from_dict(case["info"]), case["frac"])


def test_a_search_too_wide_for_count_branching_is_handed_to_the_whole_model(monkeypatch) -> None:
    # A tiny HF LeViT at its smallest reachable peak: the fixed-count MILPs found no plan to
    # prune with, and the search ran 1,803 LPs and 1,174 MILPs (18 s) where HiGHS on the whole
    # model took 0.03 s. After _MAX_BOXES boxes it now gives up, and the plan is the plain one.
    import gzip
    from pathlib import Path

    from estimators.contract.module_info import ModuleInfo
    from solver import count_branch

    text = gzip.decompress((Path(__file__).parent / "data" / "levit_module_info.json.gz").read_bytes()).decode()
    info = ModuleInfo.from_json(text)
    results = []
    real = count_branch.CountBrancher.solve
    monkeypatch.setattr(count_branch.CountBrancher, "solve",
                        lambda self, *a, **k: results.append(real(self, *a, **k)) or results[-1])
    # The program takes this model (35 candidates) since it orders a module after the child it
    # ends with: it is switched off here, so the backend's search is what is tested.
    backend = SolverOptions(dynamic_program=False)
    counted = SACMilp(info, options=backend)
    plain = SACMilp(info, options=SolverOptions(count_branching=False, dynamic_program=False))
    low = plain.min_reachable_peak_bytes()
    assert counted.min_reachable_peak_bytes() == low
    got, want = counted.solve(low), plain.solve(low)
    assert results == [None]  # given up, not searched to the end
    assert got.discarded_bytes == want.discarded_bytes and got.status is want.status
    by_program = SACMilp(info).solve(low)
    assert by_program.solved_by == "program" and by_program.predicted_peak_bytes <= low
    assert by_program.recompute_ms <= want.recompute_ms * (1 + 1e-6)
