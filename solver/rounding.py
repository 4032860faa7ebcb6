"""A backend's plan made exact in bytes: repaired where its rounded ratios leave the exact peak
over budget, then given back what the exact peak does not need.

The MILP prices each module's convex cost envelope with ratios exact to about 1e-8 of the
module; the plan that runs discards whole bytes and pays the exact (step) curve. Every step
here is decided by exact peak evaluations (``solver.plan_cost.MemoryModel``), so a plan stays
within its budget and its recompute never grows::

    exact = ExactPlans(memory, order)            # order: fqn -> forward pre-order index
    plan, short = exact.settle(read, budget, target)   # short: bytes still over (0: fits)

Each search is capped at ``_POLISH_EVALS`` evaluations, a count and not a clock, so the same
input gives the same plan.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

from solver.plan_cost import MemoryModel, fixed_discard_bytes, module_recompute_ms

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats

__all__ = ["ExactPlans"]

_POLISH_BYTES, _POLISH_FRACTION = 64, 1e-7
"""Bytes past a step of a module's curve that ``ExactPlans.polish`` treats as the backend's
tolerance (or that fraction of the module, if more), not a decision."""

_POLISH_EVALS = 256
"""Exact peak evaluations ``ExactPlans.trim`` and ``polish`` may each spend on one plan (each
costs milliseconds on big graphs)."""


class ExactPlans:
    """Repair, trim and polish plans ({fqn: discarded bytes}) against one memory model."""

    def __init__(self, memory: MemoryModel, order: Mapping[str, int]) -> None:
        self.memory = memory
        self.order = order
        """fqn -> forward pre-order index: modules are visited in this order (deterministic)."""

    def settle(self, read: dict[str, int], budget: int, target: int) -> tuple[dict[str, int], int]:
        """The plan ``read`` from a backend solved at ``target`` (<= ``budget``), in exact bytes:
        (plan, bytes still over ``budget``). Repaired where rounding left it over; then what the
        repair added, or the tighter target asked for, beyond the exact need is given back."""
        plan, short = self.repair(read, budget)
        if short == 0:
            margin = sum(plan.values()) - sum(read.values()) + budget - target
            plan = self.polish(self.trim(plan, budget, margin), budget)
        return plan, short

    def repair(self, plan: dict[str, int], budget: int) -> tuple[dict[str, int], int]:
        """Discard the bytes the backend's rounding left over budget; (plan, bytes still over)."""
        plan = dict(plan)
        for _ in range(len(self.memory.points) + 1):
            mem = self.memory.point_bytes(plan)
            worst = max(range(len(mem)), key=mem.__getitem__, default=None)
            if worst is None or mem[worst] <= budget:
                return plan, 0
            excess = mem[worst] - budget
            # a discarded byte lowers this point once per copy of it the point is without
            weight = {f: self.memory.discard_weight(f, worst) for f in plan}
            room = [f for f in plan if weight[f] > 0 and plan[f] < self._stats(f).sac_memory_bytes]
            if not room:
                return plan, excess
            room.sort(key=lambda f: (self._marginal_ms(f, plan[f], excess) / weight[f], f))
            for f in room:
                add = min(-(-excess // weight[f]), self._stats(f).sac_memory_bytes - plan[f])
                plan[f] += add
                excess -= add * weight[f]
                if excess <= 0:
                    break
        mem = self.memory.point_bytes(plan)
        return plan, max(0, max(mem, default=0) - budget)

    def polish(self, plan: dict[str, int], budget: int) -> dict[str, int]:
        """Bytes the backend's tolerance pushed just past a step of a module's exact curve, given
        back where the exact peak allows: dropped, or moved to another planned module that has
        room, if that costs less. Only exact evaluations decide, so the plan stays within the
        budget and its recompute never grows.

        Why: the MILP prices the convex envelope, and its ratios are exact to about 1e-8. At the
        smallest reachable peak of two identical blocks a plan can read a byte past the last
        step of one curve (an expensive op) where a byte fewer there and one more in the other
        block fits the same peak (tests/solver/milp/test_linear_model.py)."""
        plan = dict(plan)
        evals = _POLISH_EVALS
        for f in sorted(plan, key=lambda f: self.order[f]):
            if evals <= 0:
                break
            s, d = self._stats(f), plan[f]
            below = max((b for b in s.tradeoff.discarded_bytes if b < d), default=0)
            excess = d - below
            if not 0 < excess <= max(_POLISH_BYTES, math.ceil(_POLISH_FRACTION * s.sac_memory_bytes)):
                continue
            saving = self._plan_ms(f, d) - self._plan_ms(f, below)
            if saving <= 0:
                continue
            trial = {**plan, f: below}
            evals -= 1
            if self.memory.peak(trial) <= budget:
                plan = trial
                continue
            best: tuple[float, dict[str, int]] | None = None
            for g in plan:
                room = self._stats(g).sac_memory_bytes - plan[g]
                if g == f or room < excess:
                    continue
                extra = self._plan_ms(g, plan[g] + excess) - self._plan_ms(g, plan[g])
                if extra < saving and (best is None or extra < best[0]) and evals > 0:
                    moved = {**trial, g: plan[g] + excess}
                    evals -= 1
                    if self.memory.peak(moved) <= budget:
                        best = (extra, moved)
            if best is not None:
                plan = best[1]
        return self.without_empty(plan, budget)

    def trim(self, plan: dict[str, int], budget: int, margin: int) -> dict[str, int]:
        """Where ``margin`` bytes were discarded beyond the backend's plan (the repair of its
        rounding, or a tighter target): each module gives back what of them the exact peak does
        not need (binary search over the last ``margin`` bytes it discards, every step evaluated
        exactly). At the smallest reachable peak of a stack the backend's plan can leave one block
        short of whole and another as much over what it needs (one MILP value, equal slopes):
        the repair completes the first, and this gives the second's excess back
        (tests/solver/milp/test_count_branch.py)."""
        if margin <= 0:
            return plan
        plan = dict(plan)
        evals = _POLISH_EVALS
        for f in sorted(plan, key=lambda f: self.order[f]):
            d = plan[f]
            lo = max(0, d - margin)
            if self._plan_ms(f, lo) >= self._plan_ms(f, d):
                continue
            while lo < d and evals > 0:  # d fits; find the fewest bytes that still fit
                mid = (lo + d) // 2
                evals -= 1
                if self.memory.peak({**plan, f: mid}) <= budget:
                    d = mid
                else:
                    lo = mid + 1
            if self._plan_ms(f, d) < self._plan_ms(f, plan[f]):
                plan[f] = d
        return self.without_empty(plan, budget)

    def without_empty(self, plan: dict[str, int], budget: int) -> dict[str, int]:
        """``plan`` without the modules left discarding nothing (and forced to discard nothing),
        as ``_read_plan`` reads them, where the exact peak still fits."""
        kept = {f: d for f, d in plan.items() if d > 0 or fixed_discard_bytes(self._stats(f)) > 0}
        return kept if len(kept) < len(plan) and self.memory.peak(kept) <= budget else plan

    def _plan_ms(self, fqn: str, discarded: int) -> float:
        return module_recompute_ms(self._stats(fqn), discarded)

    def _stats(self, fqn: str) -> ModStats:
        return self.memory.stats[fqn]

    def _marginal_ms(self, fqn: str, d: int, add: int) -> float:
        s = self._stats(fqn)
        return module_recompute_ms(s, min(s.sac_memory_bytes, d + add)) - module_recompute_ms(s, d)
