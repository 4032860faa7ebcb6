"""Op-level SAC inside one module: which forward ops to save so the saved bytes fit a budget at
the least recompute time (an exact 0/1 knapsack, xformers-style).

    plan = solve_op_milp(stats.ops, keep_ratio=1 - r)
    plan.decisions          # (OpDecision.SAVE, OpDecision.RECOMPUTE, ...) one per op

The ops come as groups that share one decision, by the rules of ``estimators.contract.sac_groups`` (the
same groups the estimator's trade-off curve is made of): in-place chains, all random ops, a
must-save group (an in-place op on a storage from outside the module; kept outside the budget)
and must-recompute groups (views, ops with a cache cost). Of the other groups:

* a group that frees no memory (all ``memory_bytes == 0``) is saved: it is free;
* a group that takes no time to recompute (``runtime_ms == 0``) is recomputed.

Remaining groups are 0/1 variables: maximise the runtime saved s.t. saved bytes <= budget. Ties are
broken deterministically by a 1e-6-relative perturbation that prefers saving fewer groups, then
earlier ones. The row is exact to the byte whenever op sizes share a unit that keeps coefficients
below 2**20 (``OpPlan.exact``); see ``_row_unit`` for the rare case they do not.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from estimators.contract.sac_groups import SACGroup, sac_groups  # torch-free, like ModuleInfo
from solver.milp.backend import run_pulp
from solver.options import SolverOptions, SolveStatus

if TYPE_CHECKING:
    from estimators.contract.module_info import SACOp

__all__ = ["OpDecision", "OpPlan", "solve_op_milp"]

logger = logging.getLogger(__name__)

_TIE = 1e-6
_MAX_COEF = 2**20


class OpDecision(enum.IntEnum):
    """What the selective-checkpoint policy does with one op (torch's SACDecision values)."""

    RECOMPUTE = 0
    SAVE = 1


@dataclass(frozen=True, kw_only=True)
class OpPlan:
    """Save/recompute decision per op of one module call."""

    decisions: tuple[OpDecision, ...]
    saved_bytes: int
    """Bytes of saved ops that could have been recomputed; <= keep_bytes. Forced saves (in-place
    ops on storage from outside the module) are not counted."""
    discarded_bytes: int
    """Bytes freed by recomputing (sum of memory_bytes of recomputed ops)."""
    recompute_ms: float
    """Sum of runtime_ms of recomputed ops."""
    keep_bytes: int
    status: SolveStatus
    unit_bytes: int = 1
    """Granularity of the knapsack row (the gcd of the op sizes, or coarser; see ``exact``)."""
    exact: bool = True
    """Optimal to the byte. False only when op sizes share no unit small enough for a
    floating-point MILP row; sizes were then rounded up to ``unit_bytes`` (plan still fits)."""


def _keep_budget(total: int, keep_bytes: int | None, keep_ratio: float | None) -> int:
    if (keep_bytes is None) == (keep_ratio is None):
        raise ValueError("pass exactly one of keep_bytes (bytes to keep) or keep_ratio (in [0, 1])")
    if keep_bytes is not None:
        if not isinstance(keep_bytes, numbers.Integral) or isinstance(keep_bytes, bool) or keep_bytes < 0:
            raise ValueError(f"keep_bytes must be an int >= 0, got {keep_bytes!r}")
        return int(keep_bytes)
    if not (isinstance(keep_ratio, numbers.Real) and math.isfinite(keep_ratio) and 0 <= keep_ratio <= 1):
        raise ValueError(f"keep_ratio must be a number in [0, 1], got {keep_ratio!r}")
    # Floor: keeping a ratio r' of memory must discard at least 1 - r' of it.
    return math.floor(keep_ratio * total)


def solve_op_milp(
    ops: Sequence[SACOp],
    *,
    keep_bytes: int | None = None,
    keep_ratio: float | None = None,
    options: SolverOptions | None = None,
) -> OpPlan:
    """Least-recompute save/recompute decisions whose saved bytes fit the budget.

    The budget covers the ops that may be recomputed (forced saves are outside it, as they are
    outside the module's ``sac_memory_bytes``): ``keep_bytes``, or ``floor(keep_ratio * their
    bytes)``; a module-level discard ratio r corresponds to ``keep_ratio = 1 - r``."""
    if any(op.memory_bytes < 0 or not (math.isfinite(op.runtime_ms) and op.runtime_ms >= 0) for op in ops):
        raise ValueError("ops need memory_bytes >= 0 and finite runtime_ms >= 0")
    groups = _groups(tuple(ops))
    save = {i: _fixed_decision(g) for i, g in enumerate(groups)}
    open_ = [i for i, d in save.items() if d is None]
    optional = sum(g.memory_bytes for g in groups if not g.must_save)
    keep = _keep_budget(optional, keep_bytes, keep_ratio)
    status, unit, exact = SolveStatus.OPTIMAL, 1, True
    if sum(groups[i].memory_bytes for i in open_) <= keep:
        save.update({i: True for i in open_})  # everything fits: exact without a MILP
    else:
        chosen, status, unit, exact = _knapsack([groups[i] for i in open_], keep, len(ops), options)
        save.update({i: c for i, c in zip(open_, chosen)})
    return _plan(ops, groups, save, keep, status, unit, exact)


@functools.lru_cache(maxsize=256)
def _groups(ops: tuple[SACOp, ...]) -> tuple[SACGroup, ...]:
    """``sac_groups`` once per op table: a search prices every step of a table (one knapsack
    each), and grouping the table again for each was a tenth of its time."""
    return sac_groups(ops)


def _fixed_decision(g: SACGroup) -> bool | None:
    """SAVE (True) / RECOMPUTE (False) forced by the rules, or None for the knapsack."""
    if g.must_save:
        return True
    if g.must_recompute:
        return False
    if g.memory_bytes == 0:  # free to keep
        return True
    if g.runtime_ms == 0:  # free to recompute
        return False
    return None


def _row_unit(sizes: list[int]) -> tuple[int, bool]:
    """Bytes per unit of the knapsack row, and whether the row is exact in it.

    Floating-point backends resolve integer rows reliably only while coefficients stay near
    2**20 or below, so sizes are divided by their gcd (exact for integer x) and, only when that is
    not enough, rounded up to a coarser unit (the plan still fits the byte budget; the rounding
    is below 2**-20 of the largest op)."""
    unit = math.gcd(*sizes)
    biggest = max(sizes)
    if biggest // unit <= _MAX_COEF:
        return unit, True
    k = math.ceil(math.log2(biggest / (unit * _MAX_COEF)))
    return unit * 2**k, all(m % (unit * 2**k) == 0 for m in sizes)


def _knapsack(groups: Sequence[SACGroup], keep: int, n_ops: int, options: SolverOptions | None
              ) -> tuple[list[bool], SolveStatus, int, bool]:
    """0/1 knapsack in row units (see ``_row_unit``); the row gets half a unit of slack so that
    feasible and infeasible integer points are 0.5 apart, the backend runs with tight
    integrality, and every answer is re-checked in integer bytes."""
    import pulp

    from solver.errors import SolverError, SolverTimeoutError

    options = options if options is not None else SolverOptions()
    unit, exact = _row_unit([g.memory_bytes for g in groups])
    prob = pulp.LpProblem("sac_op_milp", pulp.LpMinimize)
    x = [_binary(prob, f"save_op{g.ops[0]}") for g in groups]
    prob += pulp.LpConstraint(
        pulp.LpAffineExpression([(v, float(-(-g.memory_bytes // unit))) for v, g in zip(x, groups)]),
        pulp.LpConstraintLE, "saved_units_within_budget", keep // unit + 0.5,
    )
    scale = max(g.runtime_ms for g in groups) or 1.0
    prob.setObjective(pulp.LpAffineExpression(  # min recompute == max runtime saved
        [(v, -g.runtime_ms + _TIE * scale * (1 + g.ops[0] / max(1, n_ops))) for v, g in zip(x, groups)]))
    for attempt in range(4):
        out = run_pulp(prob, options, rel_gap=0.0, tight=True)
        if not out.has_solution:
            if out.infeasible:  # saving nothing is always feasible: numerical trouble
                raise SolverError("op-level MILP reported a feasible knapsack infeasible; "
                                  "try backend=Backend.HIGHS")
            raise SolverTimeoutError(
                f"op-level MILP found no plan within time_limit_s={options.time_limit_s}")
        chosen = [round(v.varValue or 0.0) == 1 for v in x]
        if sum(g.memory_bytes for g, c in zip(groups, chosen) if c) <= keep:
            return chosen, SolveStatus.OPTIMAL if out.proven else SolveStatus.FEASIBLE, unit, exact
        logger.debug("op MILP answer over budget after rounding; cutting it off (try %d)", attempt)
        prob += pulp.LpConstraint(
            pulp.LpAffineExpression([(v, 1.0 if c else -1.0) for v, c in zip(x, chosen)]),
            pulp.LpConstraintLE, f"exclude_{attempt}", float(sum(chosen) - 1))
    raise SolverError("op-level MILP kept returning over-budget answers; try backend=Backend.HIGHS")


def _binary(prob: Any, name: str) -> Any:
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, 0, 1, cat="Integer")
    import pulp

    return pulp.LpVariable(name, 0, 1, "Integer")


def _plan(ops: Sequence[SACOp], groups: Sequence[SACGroup], save: dict[int, bool], keep: int,
          status: SolveStatus, unit: int, exact: bool) -> OpPlan:
    decisions = [OpDecision.RECOMPUTE] * len(ops)
    for gi, g in enumerate(groups):
        if save[gi]:
            for i in g.ops:
                decisions[i] = OpDecision.SAVE
    saved = sum(g.memory_bytes for gi, g in enumerate(groups) if save[gi] and not g.must_save)
    if saved > keep:  # the knapsack re-checks in integers; a failure here is a bug
        raise AssertionError(f"op plan keeps {saved} bytes > budget {keep}")
    discarded = sum(g.memory_bytes for gi, g in enumerate(groups) if not save[gi])
    rct = sum(op.runtime_ms for op, d in zip(ops, decisions) if d is OpDecision.RECOMPUTE)
    return OpPlan(decisions=tuple(decisions), saved_bytes=saved, discarded_bytes=discarded,
                  recompute_ms=rct, keep_bytes=keep, status=status, unit_bytes=unit,
                  exact=exact)
