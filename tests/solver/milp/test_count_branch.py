"""solver/milp/count_branch.py: branching on per-kind checkpoint counts reaches HiGHS' optimum.

The stacks of identical blocks of ``tests.solver.strategies`` (named ``M.blocks.<i>...``, so every
block kind forms a group) and the random trees with every candidate in one group, or grouped by
depth (the grouping decides speed, never the optimum): count branching and HiGHS' own branch and
bound, both asked for exact optimality, reach the same value within 1e-6 relative.

``SAC_PROPERTY_EXAMPLES=250 python -m pytest -q tests/solver/milp/test_count_branch.py`` runs more.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.sac_milp as sac_milp
from estimators.contract.module_info import ModuleInfo
from solver import SACMilp, SolverOptions, SolveStatus, predict_peak_bytes
from solver.milp import count_branch
from solver.milp.count_branch import CountBrancher, kind_groups
from tests.solver.strategies import module_infos, stacked_infos

DATA = Path(__file__).parents[1] / "data"
EXACT = SolverOptions(rel_gap=0.0, dynamic_program=False)
EXACT_PLAIN = SolverOptions(rel_gap=0.0, count_branching=False, dynamic_program=False)
_N = int(os.environ.get("SAC_PROPERTY_EXAMPLES", "0")) or None
MANY = settings(max_examples=_N or 60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(max_examples=_N or 30, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def count_branching_everywhere(groups=None):
    """SACMilp sends every model with groups to count branching (not only big stacks), grouped
    by ``groups`` (default: by kind)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sac_milp, "COUNT_BRANCHING_CANDIDATES", 0)
        if groups is not None:
            mp.setattr(sac_milp, "kind_groups", groups)
        yield


def test_kind_groups_strip_numeric_path_components() -> None:
    fqns = ["M", "M.layers.0", "M.layers.0.mlp", "M.layers.1", "M.layers.1.mlp", "M.layers.12",
            "M.head", "M.blocks.3.attn.core", "M.blocks.4.attn.core", "M.m0", "M.m1"]
    assert kind_groups(fqns) == [[1, 3, 5], [2, 4], [7, 8]]


def _values(info: ModuleInfo, frac: float, groups=None) -> None:
    """Same optimal MILP value from count branching and from HiGHS alone (both exact); the
    planner's plans by count branching fit, cost no more than HiGHS alone's at the smallest
    reachable peak, and solving again gives the same plan.

    At a budget within 1e-6 of the smallest reachable peak or of the no-AC peak the MILP's
    feasible set is a sliver the backend's tolerances decide (a module discarding 1e-8 of
    itself), so two exact searches may return different objectives there; there the planner's
    plans are compared instead of the raw objectives."""
    plain = SACMilp(info, options=EXACT_PLAIN)
    if not plain.candidates:
        return
    grouping = groups or kind_groups
    kinds = grouping([c.fqn for c in plain.candidates])
    lo, hi = plain.min_reachable_peak_bytes(), plain.no_ac_peak_bytes
    budget = lo + int(frac * (hi - lo))
    inside = lo + 1e-6 * hi < budget < hi - 1e-6 * hi
    whole = plain.milp()
    sols = [whole.solve(budget, EXACT_PLAIN)]
    if kinds:
        counted = SACMilp(info, options=EXACT_PLAIN).milp()
        brancher = CountBrancher(counted.lp, counted.y, kinds)
        counted.set_budget(budget)
        sol = brancher.solve(EXACT_PLAIN, None, None, 0.0)
        if sol is None or sol.outcome.infeasible:  # handed on: the whole model decides
            sol = counted.solve(budget, EXACT_PLAIN)
        sols.append(sol)
    # The plans' objectives, not the backend's: rct columns may carry slack its tolerances allow.
    values = [whole.objective_of(s.values) if s.outcome.has_solution else None for s in sols]
    for s in sols:
        assert s.outcome.proven or not s.outcome.has_solution
    if inside and len(values) == 2:
        assert None not in values, values
        # 1e-6 relative; near 0 ms, 1e-6 ms absolute: plans that recompute nothing differ there
        # only by the tie-break, which rel_gap = 0 cannot split.
        assert abs(values[0] - values[1]) <= 1e-6 * max(abs(values[0]), 1.0), values
    with count_branching_everywhere(groups):
        by_counts = SACMilp(info, options=EXACT)
        ra = by_counts.solve(budget)
        again = by_counts.solve(budget)
    rb = plain.solve(budget)
    for res in (ra, rb):
        assert res.predicted_peak_bytes <= budget
        assert predict_peak_bytes(info, res.discarded_bytes) == res.predicted_peak_bytes
    assert again.decisions == ra.decisions
    if budget - lo <= 1e-6 * hi and ra.milp_objective is not None and rb.milp_objective is not None:
        # Never worse where both made a plan (not the least-peak plan): a fixed-count MILP may
        # prove a plan at the smallest peak where HiGHS alone refuses the whole model.
        assert ra.recompute_ms <= rb.recompute_ms + 1e-6 * max(rb.recompute_ms, 1.0), (ra, rb)
    elif inside and kinds and ra.solved_by == "highs":
        assert ra.status is SolveStatus.OPTIMAL


@pytest.mark.slow
@pytest.mark.property
@MANY
@given(stacked_infos(), st.floats(0.0, 1.0))
def test_stacks_of_blocks_reach_the_plain_optimum(info, frac) -> None:
    _values(info, frac)


@pytest.mark.slow
@pytest.mark.property
@FEW
@given(module_infos(), st.floats(0.0, 1.0))
def test_random_trees_in_one_group_reach_the_plain_optimum(info, frac) -> None:
    _values(info, frac, groups=lambda fqns: [list(range(len(fqns)))] if len(fqns) > 1 else [])


@pytest.mark.slow
@pytest.mark.property
@FEW
@given(module_infos(), st.floats(0.0, 1.0))
def test_random_trees_grouped_by_depth_reach_the_plain_optimum(info, frac) -> None:
    def by_depth(fqns):
        groups = {}
        for i, f in enumerate(fqns):
            groups.setdefault(f.count("."), []).append(i)
        return [g for g in groups.values() if len(g) > 1]

    _values(info, frac, groups=by_depth)


def test_the_repair_margin_is_given_back_at_the_smallest_peak() -> None:
    """A stack where count branching's plan left one block 831 bytes short of whole and another
    831 bytes over what it needed (equal slopes, one MILP value): the repair completed the
    first, and what it added beyond the exact need is given back."""
    (case,) = json.loads((DATA / "count_branch_smallest_peak_stack.json").read_text())
    _values(ModuleInfo.from_dict(case["info"]), case["frac"])


def test_big_stacks_of_numbered_blocks_get_count_rows() -> None:
    """Count rows (one per kind) are added for stacks past ``COUNT_BRANCHING_CANDIDATES`` only."""
    from tests.solver.scaling import decoder_info

    info = decoder_info(17, numbered=True)
    counted, plain = SACMilp(info), SACMilp(info, options=SolverOptions(count_branching=False))
    kinds = kind_groups([c.fqn for c in counted.candidates])
    assert len(counted.candidates) > sac_milp.COUNT_BRANCHING_CANDIDATES and kinds
    assert counted.n_constraints == plain.n_constraints + len(kinds)
    small = decoder_info(3, numbered=True)
    assert SACMilp(small).n_constraints == SACMilp(
        small, options=SolverOptions(count_branching=False)).n_constraints


def _chain_model():
    from tests.solver.builders import chain

    return SACMilp(chain(), options=SolverOptions(count_branching=False)).milp()


def test_out_of_time_keeps_the_incumbent_without_a_proof() -> None:
    """A search stopped before any box was bounded returns the incumbent it was given, not
    proven, gap unknown; with no incumbent it says it has no solution and is not infeasible."""
    model = _chain_model()
    options = SolverOptions(count_branching=False)
    incumbent = model.solve(400 * 2**20, options)
    brancher = CountBrancher(model.lp, model.y, [list(range(len(model.cands)))])
    out = brancher.solve(options, incumbent, time.perf_counter() - 1.0, 0.0)
    assert out.objective == incumbent.objective and not out.outcome.proven
    assert out.outcome.gap is None
    none = brancher.solve(options, None, time.perf_counter() - 1.0, 0.0)
    assert none.values is None and not none.outcome.infeasible
    full = brancher.solve(options, None, None, 0.0)
    assert full.outcome.proven and math.isclose(full.objective, incumbent.objective, rel_tol=1e-9)


def test_count_branching_option_is_validated() -> None:
    with pytest.raises(TypeError, match="count_branching"):
        SolverOptions(count_branching=1)


def test_warm_relaxation_matches_a_cold_one_after_bound_and_cost_changes() -> None:
    """``solve_relaxation`` re-uses one HiGHS instance across calls: after count rows, the
    budget and the objective change, its value equals a relaxation of a fresh model."""
    options = SolverOptions(count_branching=False)
    steps = [(400, (0, 3), True), (300, (1, 3), True), (300, (0, 1), True), (500, (0, 3), False),
             (250, (1, 1), True)]

    def apply(model, brancher, mib, lo, hi, recompute):
        model.set_budget(mib * 2**20)
        model.lp.set_row_bounds(brancher.rows[0], lo, hi)
        if not recompute:
            model.lp.set_cost([(model.peak, 1.0)])

    warm_model = _chain_model()
    warm_brancher = CountBrancher(warm_model.lp, warm_model.y, [list(range(len(warm_model.cands)))])
    for mib, (lo, hi), recompute in steps:
        apply(warm_model, warm_brancher, mib, lo, hi, recompute)
        warm = warm_model.lp.solve_relaxation(options)
        cold_model = _chain_model()
        cold_brancher = CountBrancher(cold_model.lp, cold_model.y, [list(range(len(cold_model.cands)))])
        apply(cold_model, cold_brancher, mib, lo, hi, recompute)
        cold = cold_model.lp.solve_relaxation(options)
        assert warm.outcome.infeasible == cold.outcome.infeasible
        assert (warm.objective is None) == (cold.objective is None)
        if warm.objective is not None:
            assert math.isclose(warm.objective, cold.objective, rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.slow
def test_a_search_too_wide_for_count_branching_is_handed_to_the_whole_model(monkeypatch) -> None:
    """A tiny HF LeViT at its smallest reachable peak: the fixed-count MILPs find no plan to
    prune with, so the search would run thousands of boxes where HiGHS on the whole model takes
    a fraction of a second. After ``MAX_BOXES`` boxes it gives up, and the plan is the plain one."""
    text = gzip.decompress((DATA / "levit_module_info.json.gz").read_bytes()).decode()
    info = ModuleInfo.from_json(text)
    results = []
    real = count_branch.CountBrancher.solve
    monkeypatch.setattr(count_branch.CountBrancher, "solve",
                        lambda self, *a, **k: results.append(real(self, *a, **k)) or results[-1])
    backend = SolverOptions(dynamic_program=False)
    plain = SACMilp(info, options=SolverOptions(count_branching=False, dynamic_program=False))
    low = plain.min_reachable_peak_bytes()
    with count_branching_everywhere():
        counted = SACMilp(info, options=backend)
        assert counted.min_reachable_peak_bytes() == low
        got = counted.solve(low)
    want = plain.solve(low)
    assert results == [None]  # given up, not searched to the end
    assert got.discarded_bytes == want.discarded_bytes and got.status is want.status
    by_program = SACMilp(info).solve(low)
    assert by_program.solved_by == "program" and by_program.predicted_peak_bytes <= low
    assert by_program.recompute_ms <= want.recompute_ms * (1 + 1e-6)
