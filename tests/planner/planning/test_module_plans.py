"""planner/planning/module_plans.py: a module's op decisions and their recompute price, on a
hand-built op table whose costs are worked out by hand."""

from __future__ import annotations

import pytest

from estimators.contract.module_info import ModStats, SACOp
from planner.planning.module_plans import module_plan, recompute_ms_with_saved

MM, TANH, MUL = "aten.mm.default", "aten.tanh.default", "aten.mul.Tensor"


def _stats(*, policy_ms: float) -> ModStats:
    """mm (2 ms, frees 100 B), tanh (1 ms, frees 100 B), mul (0.5 ms, saved but frees nothing:
    saving it is free in memory). 1 ms per checkpoint call; a full checkpoint re-runs all three."""
    ops = (SACOp(func=MM, occurrence=0, runtime_ms=2.0, memory_bytes=100, is_saved=True),
           SACOp(func=TANH, occurrence=0, runtime_ms=1.0, memory_bytes=100, is_saved=True),
           SACOp(func=MUL, occurrence=0, runtime_ms=0.5, memory_bytes=0, is_saved=True))
    return ModStats(fqn="M.b", is_leaf=False, ops=ops, sac_memory_bytes=200, checkpoint_call_ms=1.0,
                    selective_policy_ms=policy_ms, full_recompute_ms=2.0 + 1.0 + 0.5 + 1.0)


def test_recompute_price_pays_the_policy_only_where_something_is_cached():
    s = _stats(policy_ms=3.0)
    assert recompute_ms_with_saved(s, frozenset()) == pytest.approx(4.5)  # all three + the call
    assert recompute_ms_with_saved(s, frozenset({(TANH, 0)})) == pytest.approx(2.0 + 0.5 + 1.0 + 3.0)


def test_discarding_everything_is_a_full_checkpoint_where_the_policy_costs_more():
    """At a ratio of 1 the op plan caches the free mul (saves 0.5 ms of re-run) and pays the
    policy (3 ms): 7 ms, where a full checkpoint costs 4.5 ms: the plan is the full checkpoint.
    With a cheap policy (0.1 ms) the selective plan (4.1 ms) stays."""
    full = module_plan(_stats(policy_ms=3.0), 200)
    assert full.full and full.saved_ops == () and full.recompute_ms == pytest.approx(4.5)
    assert set(full.recomputed_ops) == {(MM, 0), (TANH, 0)}
    selective = module_plan(_stats(policy_ms=0.1), 200)
    assert not selective.full and selective.saved_ops == ((MUL, 0),)
    assert selective.recompute_ms == pytest.approx(2.0 + 1.0 + 1.0 + 0.1)
    part = module_plan(_stats(policy_ms=3.0), 100)  # mm cached: selective, whatever its policy costs
    assert not part.full and (MM, 0) in part.saved_ops
