"""solver/exact/prefix_dp.py (the MILP as a chain program) against HiGHS on the MILP itself
(solver/exact/pwl.py, its functions, against brute force: tests/solver/exact/test_pwl.py).

The program shares no code with the MILP's backend: agreeing on hundreds of derandomized graphs
(random trees with forced-recompute jumps, fixed costs, transients and held inputs; stacks of
identical blocks with recompute growth and forced discards) checks both.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, TradeoffCurve
import solver.sac_milp as sac_milp
from solver import SACMilp, SolverOptions, predict_peak_bytes
from solver.exact import prefix_dp
from solver.exact.prefix_dp import PrefixDP, ProgramTooLarge
from solver.milp import count_branch
from solver.plan_cost import MemoryModel, module_recompute_ms
from solver.rounding import ExactPlans
from tests.solver.scaling import decoder_info, random_tree_info
from tests.solver.strategies import module_infos, stacked_infos

DATA = Path(__file__).parents[1] / "data"
HIGHS = SolverOptions(dynamic_program=False)
MANY = settings(max_examples=int(os.environ.get("SAC_PROPERTY_EXAMPLES", "0")) or 120, deadline=None,
                derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------- the program
def _check(info: ModuleInfo, frac: float) -> str:
    """The program against ``SACMilp.solve`` with HiGHS alone (``dynamic_program=False``) at
    one budget: the MILP objective HiGHS proves within
    ``rel_gap`` is within ``rel_gap`` of the program's exact one; HiGHS' plan in bytes costs no
    less than the program's optimum; both plans, made exact in bytes, fit and cost the same
    within the gap. Held within 1e-3, the program's bound stays under the optimum and its plan
    fits."""
    m = SACMilp(info, options=HIGHS)
    if not m.candidates:
        return "nothing to plan"
    dp = m.program()
    if isinstance(dp, str):
        return "refused"
    lo, hi = m.min_reachable_peak_bytes(), m.no_ac_peak_bytes
    # The program's smallest budget (bisection on its domains, its plan there): a real plan's
    # exact peak, so never under the true floor, and never above HiGHS' (a plan's too, proven
    # to HiGHS' tolerance: 6 B over the program's 2,097,152 B was seen, 1.1e-6 of the peak).
    by_program = SACMilp(info)
    least = by_program.min_reachable_peak_bytes()
    assert least <= lo, (least, lo)
    at_least = by_program.solve(least)
    assert at_least.predicted_peak_bytes <= least
    assert at_least.predicted_peak_bytes == predict_peak_bytes(info, at_least.discarded_bytes)
    budget = lo + int(frac * (hi - lo))
    if budget - lo <= 1e-6 * hi or budget >= hi:
        return "skipped"  # the smallest peak's sliver is HiGHS' tolerance (test_symmetry.py)
    out = dp.solve(budget)
    assert out is not None, "the program found no plan where HiGHS' smallest peak fits"
    if out.objective > out.lower_bound * (1 + 1e-12) + 1e-12:
        return "undecided"  # a varying growth the two runs do not settle (HiGHS decides)
    res = m.solve(budget)
    gap = m.options.rel_gap
    # The MILP's own arithmetic: a cost row a r + b y is only as exact as its largest term (a
    # curve step of 10 ms over one byte of 215 MB: a = 2e9 ms, off by 1e-7 ms at its end).
    slack = 1e-15 * max(abs(a) + abs(b) for c in m.candidates for a, b in c.segments) + 1e-12
    assert dp.model_peak(out.discarded) <= budget * (1 + 1e-12)
    exact = ExactPlans(MemoryModel(info, 1), {s.fqn: i for i, s in enumerate(info.mod_stats)})
    plan, short = exact.settle({m.candidates[k].fqn: round(d) for k, d in out.discarded.items()},
                               budget, budget)
    assert short == 0 and predict_peak_bytes(info, plan) <= budget
    ms = sum(module_recompute_ms(info.stats(f), d) for f, d in plan.items())
    # The program's optimum is no dearer than HiGHS' plan in exact bytes on the same curves (its
    # MILP value may be: at HiGHS' row tolerance of 1e-8 the ratios it returns undercut the
    # optimum, 0.1467952795 against 0.1467952813 ms on a stack whose bytes cost 0.1467952813).
    pos = {int(k): i for i, k in enumerate(dp.order)}
    index = {c.fqn: k for k, c in enumerate(m.candidates)}
    highs_plan = sum(float(np.interp(d, *dp.curves[pos[index[f]]])) for f, d in res.discarded_bytes.items())
    assert out.objective <= highs_plan * (1 + 1e-9) + slack, (out.objective, highs_plan)
    assert res.milp_objective <= out.objective * (1 + gap) + slack, (out.objective, res.milp_objective)
    # Recompute alone: the objectives differ by the gap and by the two plans' tie-breaks, which
    # are at most all of them (0.890678 against HiGHS' 0.890768 ms passed 1e-6 by 2e-13).
    ties = sum(sum(t) for t in m.tie_break_ms())
    assert abs(ms - res.recompute_ms) <= gap * (max(ms, res.recompute_ms) + ties) + ties + slack, \
        (ms, res.recompute_ms, ties)
    assert dp.solve(budget).discarded == out.discarded  # deterministic
    # Functions held within 1e-3 (SACMilp uses 1e-5): the bound stays under the optimum, the
    # plan read back meets the rows and costs no less than the optimum.
    loose = dp.solve(budget, rel_tol=1e-3)
    assert loose.lower_bound <= out.objective * (1 + 1e-9) + slack, (loose, out)
    assert loose.objective >= out.objective * (1 - 1e-9) - slack, (loose, out)
    assert dp.model_peak(loose.discarded) <= budget * (1 + 1e-12)
    return "equal"


def _outcomes(strategy) -> dict[str, int]:
    """``_check`` on every example of ``strategy`` (a budget fraction each): how many ended how.
    No graph may be refused by the program."""
    outcomes: dict[str, int] = {}

    @MANY
    @given(strategy, st.floats(0.02, 0.98))
    def run(info, frac) -> None:
        kind = _check(info, frac)
        assert kind != "refused"
        outcomes[kind] = outcomes.get(kind, 0) + 1

    run()
    return outcomes


DECIDED = 2 / 3
"""Of a property test's graphs, at least this share must be decided by the program ("equal"), so
that it cannot pass on skips alone (derandomized, 120 each: random trees 90 equal, stacks 106)."""


@pytest.mark.slow
@pytest.mark.property
def test_random_trees_reach_the_milp_optimum() -> None:
    outcomes = _outcomes(module_infos())
    assert outcomes.get("equal", 0) >= DECIDED * sum(outcomes.values()), outcomes


@pytest.mark.slow
@pytest.mark.property
def test_stacks_of_blocks_reach_the_milp_optimum() -> None:
    outcomes = _outcomes(stacked_infos())
    assert outcomes.get("equal", 0) >= DECIDED * sum(outcomes.values()), outcomes


def _two_branches(bw_swapped: bool) -> ModuleInfo:
    """Root with children a, b (each with one leaf); b's backward before a's unless swapped."""
    names = ["M", "M.a", "M.a.x", "M.b", "M.b.y"]
    fw_post = {"M.a.x": 1, "M.a": 2, "M.b.y": 3, "M.b": 4, "M": 5}
    bw_pre = {"M": 7, "M.b": 8, "M.b.y": 9, "M.a": 10, "M.a.x": 11}
    if bw_swapped:
        bw_pre["M.a"], bw_pre["M.b"] = 8, 10
    stats = []
    for f in names:
        leaf = f.endswith((".x", ".y"))
        size = 0 if leaf else (2 if f == "M" else 1) * 2**20
        curve = TradeoffCurve(discarded_bytes=(0, size), recompute_ms=(0.0, 1.0)) if size else TradeoffCurve()
        stats.append(ModStats(fqn=f, is_leaf=leaf, sac_memory_bytes=size, sac_runtime_ms=curve.total_ms,
                              tradeoff=curve, fw_post_op=fw_post[f], bw_pre_op=bw_pre[f]))
    points = [MemoryPoint(op_index=t, phase="fw" if t < 7 else "bw", param_bytes=2**20,
                          activation_bytes=3 * 2**20 - (t - 6) * 2**19 * (t > 6))
              for t in range(1, 12)]
    return ModuleInfo(mod_order=ModOrder(fw_pre_order=tuple(names), fw_post_order=(), bw_pre_order=(),
                                         bw_post_order=()),
                      mod_stats=tuple(stats), memory_points=tuple(points),
                      peak_bytes=max(p.total_bytes for p in points))


def test_a_recompute_point_where_a_child_s_backward_has_begun_is_taken() -> None:
    """Traced residual blocks (GPT-2, a BatchNorm net): the block's last op is an add, and its
    child's backward starts at the same op as the block's, so at the block's recompute point the
    child's discards are back. With the block planned its children discard nothing, so the point
    reads the same row; it was refused ("sees other discards than its block's")."""
    from tests.solver.builders import make_info, mod, pt

    stats = [mod("M"), mod("M.B", size_mib=200, ms=12, fw_post=21, bw_pre=30, transient_mib=40),
             mod("M.B.attn", size_mib=100, ms=10, fw_post=10, bw_pre=40), mod("M.B.attn.q", leaf=True),
             mod("M.B.mlp", size_mib=100, ms=8, fw_post=20, bw_pre=30), mod("M.B.mlp.fc", leaf=True)]
    points = [pt(25, 200, other_mib=150), pt(30, 200, other_mib=10, rec="M.B"),
              pt(31, 200, other_mib=10, rec="M.B.mlp"), pt(35, 100, other_mib=20)]
    info = make_info(stats, points)
    assert isinstance(SACMilp(info).program(), PrefixDP)
    alone = SACMilp(info, options=HIGHS)
    lo, hi = alone.min_reachable_peak_bytes(), alone.no_ac_peak_bytes
    for frac in (0.0, 0.3, 0.7, 0.95):
        budget = lo + int(frac * (hi - lo))
        a, b = SACMilp(info).solve(budget), alone.solve(budget)
        assert a.solved_by == "program" and a.predicted_peak_bytes <= budget
        assert a.recompute_ms == pytest.approx(b.recompute_ms, rel=1e-6, abs=1e-9), frac


def test_a_backward_out_of_reverse_order_is_refused_with_a_reason() -> None:
    assert isinstance(SACMilp(_two_branches(False)).program(), PrefixDP)
    why = SACMilp(_two_branches(True)).program()
    assert isinstance(why, str) and "not the first ones to end their forward" in why


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3)])
def test_benchmark_trees_are_planned_by_the_program_at_the_backend_s_optimum(seed: int, monkeypatch) -> None:
    """Random trees of benchmarks/solver_scaling.py (60-240 modules, no repeated blocks): the
    default solve is the program's (functions held within 1e-5), proven, and costs what HiGHS
    alone proves within rel_gap; the exact program's functions stay small (points collinear but
    for rounding are not breakpoints: counting them, a 60-module tree's functions had 11,858
    points, 30 of them real) and its bound is its plan's cost."""
    info = random_tree_info(60 * (seed + 1), seed=seed)
    m, alone = SACMilp(info), SACMilp(info, options=HIGHS)
    lo = alone.min_reachable_peak_bytes()
    for frac in (0.2, 0.6):
        budget = lo + int(frac * (info.peak_bytes - lo))
        a, b = m.solve(budget), alone.solve(budget)
        assert a.solved_by == "program" and b.solved_by == "highs"
        assert a.status.value == "optimal" and a.gap <= 1e-4
        assert a.predicted_peak_bytes <= budget
        assert abs(a.recompute_ms - b.recompute_ms) <= 1e-4 * max(a.recompute_ms, b.recompute_ms)
        assert a.n_variables == 0  # the MILP was never built
    dp = m.program()
    sizes = []
    monkeypatch.setattr(prefix_dp, "under_within", lambda f, tol: sizes.append(len(f.xs)) or f)
    out = dp.solve(lo + int(0.6 * (info.peak_bytes - lo)), max_work=200_000)
    # Exact but for the read-back's ties (each step may take a branch TIE_REL dearer).
    assert out.objective - out.lower_bound <= prefix_dp.TIE_REL * dp.n * out.objective
    assert max(sizes) <= 100, max(sizes)


def test_big_stacks_of_numbered_blocks_go_to_count_branching_and_others_to_the_program() -> None:
    """A 17-block synthetic decoder (53 candidates): numbered blocks go to count branching
    (HiGHS), the same blocks named without numbers (equal curves, no kinds by name) to the
    program, which proves them where HiGHS' plain branch and bound runs out of time on bigger
    stacks. Both plans cost the same."""
    results = []
    for numbered in (True, False):
        info = decoder_info(17, numbered=numbered)
        m = SACMilp(info)
        assert len(m.candidates) > sac_milp.COUNT_BRANCHING_CANDIDATES
        res = m.solve(int(0.5 * info.peak_bytes))
        assert res.solved_by == ("highs" if numbered else "program")
        assert res.status.value == "optimal"
        results.append(res)
    assert results[0].recompute_ms == pytest.approx(results[1].recompute_ms, rel=1e-4)


@pytest.mark.slow
def test_a_stack_count_branching_gives_up_on_goes_to_the_program(monkeypatch) -> None:
    """Traced GPT-2, BERT and Whisper stacks wear count branching out (no proof within its box
    cap), and HiGHS on the whole model runs into its time limit there; the program proves them.
    Here the box cap is 1, so count branching gives up on a 17-block decoder; the program's plan
    is HiGHS' optimum."""
    info = decoder_info(17)
    monkeypatch.setattr(count_branch, "MAX_BOXES", 1)
    for frac in (0.3, 0.5, 0.7):
        budget = int(frac * info.peak_bytes)
        res = SACMilp(info).solve(budget)
        assert res.solved_by == "program" and res.status.value == "optimal"
        alone = SACMilp(info, options=SolverOptions(rel_gap=0.0, dynamic_program=False)).solve(budget)
        assert alone.solved_by == "highs"
        assert res.predicted_peak_bytes <= budget
        assert res.recompute_ms == pytest.approx(alone.recompute_ms, rel=1e-6)


def test_a_module_that_ends_with_its_last_child_is_after_it_in_the_chain() -> None:
    """A T5 block returns its last layer's output: both end at the same op, and the chain
    ordered candidates by (end, index), the block (pre-order index) before its child, so the
    program refused every T5 ("the checkpointable modules under ...block.0 are not the ones
    just before it") and a traced T5-large went to HiGHS: 60 s, unproven. Children first."""
    import dataclasses

    info = decoder_info(3)
    end = {s.fqn: s.fw_post_op for s in info.mod_stats}
    stats = tuple(dataclasses.replace(s, fw_post_op=end[f"{s.fqn}.mlp"])
                  if f"{s.fqn}.mlp" in end else s for s in info.mod_stats)
    info = dataclasses.replace(info, mod_stats=stats)
    m = SACMilp(info)
    assert isinstance(m.program(), PrefixDP)
    lo = m.min_reachable_peak_bytes()
    assert abs(lo - SACMilp(info, options=HIGHS).min_reachable_peak_bytes()) <= 1e-6 * info.peak_bytes
    for frac in (0.2, 0.5, 0.8):
        budget = lo + int(frac * (info.peak_bytes - lo))
        res = SACMilp(info).solve(budget)
        assert res.solved_by == "program"
        alone = SACMilp(info, options=SolverOptions(rel_gap=0.0, dynamic_program=False)).solve(budget)
        assert res.recompute_ms == pytest.approx(alone.recompute_ms, rel=1e-6)


def test_the_program_decides_at_rel_gap_zero() -> None:
    """Its plan's cost and its bound are summed apart, 1e-16 off on an exact program
    (2.123137584924017 against 2.1231375849240166): at rel_gap 0 that was no proof, and about
    30 % of small models went to HiGHS, the backend the program is there to check."""
    info = ModuleInfo.from_json(DATA / "program_rel_gap_zero.json")
    for options in (SolverOptions(), SolverOptions(rel_gap=0.0)):
        res = SACMilp(info, options=options).solve(158_866_925)
        assert res.solved_by == "program", options


@pytest.mark.slow
def test_a_plan_at_the_smallest_reachable_peak_follows_the_domain_ends() -> None:
    """At the smallest reachable peak the plan runs along the ends of the value functions'
    domains, where sums of byte counts near 1e10 differ by 1e-6 with their order: every branch
    of the read-back was +inf on this 300-module tree and the plan came out 34 GB over (caught
    in exact bytes; HiGHS then took the budget). Now the program plans it, and it fits."""
    m = SACMilp(random_tree_info(300, seed=0))
    lo = m.min_reachable_peak_bytes()
    res = m.solve(lo)
    assert res.solved_by == "program" and res.status.value == "optimal"
    assert res.predicted_peak_bytes <= lo


def test_the_read_back_never_leaves_the_domains(caplog) -> None:
    """What is left to discard before the first candidate, 0 exactly, came out 1e-7 B on this
    80-module tree (a slack relative to that 1e-7 was no slack): the read-back warned and handed
    the budget to its second pass. Its slack is now relative to the step's peak."""
    import logging

    info = random_tree_info(80, seed=122)
    m = SACMilp(info)
    lo = m.min_reachable_peak_bytes()
    with caplog.at_level(logging.WARNING, logger="solver.exact.prefix_dp"):
        for frac in (0.0, 0.0298, 0.3):
            res = m.solve(lo + int(frac * (info.peak_bytes - lo)))
            assert res.solved_by == "program"
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_value_functions_past_the_cap_raise() -> None:
    info = random_tree_info(100)
    dp = SACMilp(info).program()
    assert isinstance(dp, PrefixDP)
    with pytest.raises(ProgramTooLarge):
        dp.solve(int(0.6 * info.peak_bytes), max_work=500)


def test_a_stack_highs_called_optimal_at_nine_percent_over() -> None:
    """Four blocks at 47,185,920 B: HiGHS at 1e-8 called a count box "infeasible" (light presolve
    too) while the 1e-6 solve proved 9.1875 ms there with rows 3e-8 off (float64's rounding of
    terms near 1e8), and 10.0 ms was returned as optimal. The program finds 9.1875 ms; HiGHS alone
    now does too (the 1e-6 plan's integers re-solved at 1e-8, ``LinearModel._with_integers_of``)."""
    info = ModuleInfo.from_json(DATA / "highs_above_the_optimum_stack.json")
    budget = 47_185_920
    dp = SACMilp(info).program()
    assert isinstance(dp, PrefixDP)
    out = dp.solve(budget)
    assert out.objective == pytest.approx(9.1875, abs=1e-4)
    for options in (SolverOptions(), SolverOptions(dynamic_program=False)):
        res = SACMilp(info, options=options).solve(budget)
        assert res.predicted_peak_bytes <= budget
        assert res.recompute_ms == pytest.approx(9.1875, abs=1e-4), options


def test_three_blocks_with_slopes_near_1e_10_ms_per_byte() -> None:
    """Review of round 14: three sibling 4 GB blocks whose curves rise 1e-10 ms/B; discarding
    1e9 B costs 0.1005 ms through M.a, 0.10055 ms through M.c. With the slopes compared to an
    absolute 1e-12, the program called M.c's plan optimal and stated 0.100328 ms, under the
    optimum."""
    g = 4 * 10**9

    def mod(f, curve=None, fw=-1, bw=-1):
        if curve is None:
            return ModStats(fqn=f, is_leaf=True, fw_post_op=fw, bw_pre_op=bw)
        xs, ys = zip(*curve)
        tc = TradeoffCurve(discarded_bytes=xs, recompute_ms=ys)
        return ModStats(fqn=f, is_leaf=False, sac_memory_bytes=g, sac_runtime_ms=tc.total_ms,
                        tradeoff=tc, fw_post_op=fw, bw_pre_op=bw)

    sa, sb, sc = 1e-10, 1e-10 + 9.9e-13, 1e-10 + 4.5e-13
    stats = [mod("M"),
             mod("M.a", ((0, 0.0), (0, 0.0005), (g, 0.0005 + sa * g)), 10, 60), mod("M.a.x"),
             mod("M.b", ((0, 0.0), (g, sb * g)), 20, 50), mod("M.b.x"),
             mod("M.c", ((0, 0.0), (0, 0.0001), (g, 0.0001 + sc * g)), 30, 40), mod("M.c.x")]
    pts = [MemoryPoint(op_index=35, phase="fw", activation_bytes=3 * g + 10**9),
           MemoryPoint(op_index=40, phase="bw", activation_bytes=3 * g),
           MemoryPoint(op_index=50, phase="bw", activation_bytes=2 * g),
           MemoryPoint(op_index=60, phase="bw", activation_bytes=g)]
    names = tuple(s.fqn for s in stats)
    info = ModuleInfo(mod_order=ModOrder(fw_pre_order=names, fw_post_order=(), bw_pre_order=(),
                                         bw_post_order=()),
                      mod_stats=tuple(stats), memory_points=tuple(pts), peak_bytes=3 * g + 10**9)
    for options in (SolverOptions(), SolverOptions(rel_gap=0.0)):
        res = SACMilp(info, options=options).solve(3 * g)
        assert res.discarded_bytes == {"M.a": 10**9}
        assert res.recompute_ms == pytest.approx(0.1005, rel=1e-9)
        assert res.milp_objective >= 0.1005 * (1 - 1e-9)
