"""A module's discard target as concrete op decisions: which ops to save, which to recompute."""

from __future__ import annotations

import functools

from estimators.contract.module_info import ModStats, SACOp
from estimators.contract.sac_groups import cached_if_saved
from estimators.tracing.sac import replay_ms
from planner.errors import PlanningError
from planner.plan import ModulePlan, op_key
from solver import SolverOptions, solve_op_milp
from solver.op_milp import OpDecision

__all__ = ["PlanningError", "module_plan", "recompute_ms_with_saved"]


def module_plan(stats: ModStats, discarded_bytes: int, options: SolverOptions | None = None) -> ModulePlan:
    """Concrete op decisions for discarding at least ``discarded_bytes`` of ``stats``.

    Where the op plan discards everything it can, a plain (full) checkpoint discards as much;
    it is taken when it costs no more than the op plan with its selective policy
    (``ModStats.full_recompute_ms``), as the solver prices a ratio of 1
    (``solver.plan_cost.module_recompute_ms``)."""
    keep = max(0, stats.sac_memory_bytes - discarded_bytes)
    op_plan = _op_plan(stats.ops, keep, options)
    saved, recomputed = [], []
    for op, dec in zip(stats.ops, op_plan.decisions):
        key = (op_key(op.func), op.occurrence)
        # Only ops autograd saves are worth caching: caching any other costs memory.
        if dec is OpDecision.SAVE and cached_if_saved(op):
            saved.append(key)
        elif op.is_saved and op.memory_bytes > 0:
            recomputed.append(key)
    if saved and op_plan.saved_bytes == 0 and 0 < stats.full_recompute_ms <= recompute_ms_with_saved(stats, frozenset(saved)):
        recomputed = [(op_key(op.func), op.occurrence) for op in stats.ops if op.is_saved and op.memory_bytes > 0]
        saved = []
    # The ratio is over the bytes the op plan could discard (every op not forced to be saved).
    # sac_memory_bytes is the trade-off curve's total, which leaves out ops that are recomputed
    # whenever the module is checkpointed (e.g. batch norm's statistics, whose output is not
    # saved): dividing the op plan's discarded bytes, which include those, by it gave ratios > 1.
    optional = op_plan.saved_bytes + op_plan.discarded_bytes
    ratio = op_plan.discarded_bytes / optional if optional else 0.0
    return ModulePlan(
        fqn=stats.fqn,
        discard_ratio=round(ratio, 6),
        full=not saved,
        saved_ops=tuple(saved),
        recomputed_ops=tuple(recomputed),
        discarded_bytes=op_plan.discarded_bytes,
        recompute_ms=recompute_ms_with_saved(stats, frozenset(saved)),
        input_numel=stats.input_numel,
    )


@functools.lru_cache(maxsize=4096)
def _op_plan(ops: tuple[SACOp, ...], keep_bytes: int, options: SolverOptions | None):
    """``solve_op_milp``, once per distinct op table and budget: the blocks of a stack share
    one table (``StepTrace.twin_of``), and their plans at one ratio are one op plan. Sized for a
    pipeline search, whose op-step settling prices every step of each table on every rank (a
    few thousand keys for a 70B model; a smaller cache solved most of them two or three times)."""
    return solve_op_milp(ops, keep_bytes=keep_bytes, options=options)


def recompute_ms_with_saved(stats: ModStats, saved: frozenset) -> float:
    """Recompute time of a checkpoint of ``stats`` that caches the ``saved`` op keys: every other
    op is re-run (``estimators.tracing.sac.replay_ms``), plus the checkpoint's own host cost and,
    where something is cached, the selective policy's (``ModStats.selective_policy_ms``); with
    nothing cached it is a plain checkpoint, which runs no policy."""
    rerun = replay_ms(stats.ops, lambda _, o: (op_key(o.func), o.occurrence) not in saved)
    return rerun + stats.checkpoint_call_ms + (stats.selective_policy_ms if saved else 0.0)
