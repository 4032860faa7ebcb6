"""A module-level plan moved onto the steps its ops can take.

The MILP prices each module's convex cost envelope, so it may discard part of a step: half of a
module whose saved tensors are two equal outputs. The op plan that runs keeps whole outputs, so it
discards the whole step, and the bytes past the MILP's figure are recomputed for nothing. Under a
pipeline schedule each of them counts once per micro-batch in flight (four on stage 0 of a
4-stage 1F1B): a GPT-2-style stage verified 8 % under its budget. ``settle`` trades such partial
steps for whole steps of other modules where the memory model says the budget still holds and
the op plans recompute less::

    plan = settle(milp, res.discarded_bytes, target, recompute_ms=lambda f, d: ...)
"""

from __future__ import annotations

from typing import Callable, Mapping

from solver import SACMilp
from solver.graph import is_submodule

__all__ = ["settle"]

_EVALS = 2000
"""Exact peak evaluations one settle may spend (a count, not a clock: the same input gives the
same plan)."""


def settle(milp: SACMilp, plan: Mapping[str, int], target: int,
           recompute_ms: Callable[[str, int], float]) -> dict[str, int]:
    """``plan`` ({fqn: discarded bytes}, within ``target`` in ``milp``'s exact memory model), or
    one that recomputes less (``recompute_ms(fqn, bytes)``: what the op plan of that discard
    recomputes) and is within ``target`` too: a module moved down to the step of its curve below
    its discard, alone or with another moved up to a step of its own, or a module in place of the
    planned ones it nests with. Moves are tried cheapest first, the first that fits is taken,
    until none does."""
    memory = milp.memory
    allowed = [c.fqn for c in milp.candidates]
    steps = {f: sorted(set(memory.stats[f].tradeoff.discarded_bytes) | {0}) for f in allowed}
    given = {f: d for f, d in plan.items() if d > 0}
    # The op plans discard whole steps: start from the steps they reach, where the memory model
    # sees the bytes a partial step frees beyond what the MILP credited.
    current = {f: min((b for b in steps[f] if b >= d), default=d) for f, d in given.items()}
    cost = sum(recompute_ms(f, d) for f, d in current.items())
    settled = _descend(memory, current, cost, steps, allowed, target, recompute_ms)
    if sum(recompute_ms(f, d) for f, d in settled.items()) < sum(recompute_ms(f, d) for f, d in given.items()):
        return settled
    return given


def _descend(memory, current: dict[str, int], cost: float, steps: dict[str, list[int]], allowed: list[str],
             target: int, recompute_ms: Callable[[str, int], float]) -> dict[str, int]:
    """The cheapest move that fits, taken until none does (``_EVALS`` peak evaluations at most)."""
    evals = _EVALS
    while evals > 0:
        moves = sorted(_moves(current, steps, allowed, recompute_ms), key=lambda m: m[0])
        for delta, trial in moves:
            if delta >= -1e-9 * max(cost, 1e-9) or evals <= 0:
                return current
            evals -= 1
            if memory.peak(trial) <= target:
                current, cost = trial, cost + delta
                break
        else:
            return current
    return current


def _moves(plan: dict[str, int], steps: dict[str, list[int]], allowed: list[str],
           recompute_ms: Callable[[str, int], float]):
    """(change of recompute, plan) for each move: one planned module down a step, alone or with
    one module up to a higher step (a module not planned yet only where no planned module nests
    with it); or a module at one of its steps in place of the planned modules it nests with."""
    for f, d in plan.items():
        below = max((b for b in steps.get(f, ()) if b < d), default=None)
        if below is None:
            continue
        lower = {**plan, f: below} if below else {g: e for g, e in plan.items() if g != f}
        saved = recompute_ms(f, below) - recompute_ms(f, d) if below else -recompute_ms(f, d)
        yield saved, lower
        for g in allowed:
            now = lower.get(g, 0)
            if g == f or (g not in lower and any(is_submodule(g, h) or is_submodule(h, g) for h in lower)):
                continue
            was = recompute_ms(g, now) if g in lower else 0.0
            for above in (b for b in steps[g] if b > now):
                yield saved + recompute_ms(g, above) - was, {**lower, g: above}
    for g in allowed:  # a module in place of the planned ones it nests with (a block for its parts)
        nested = [h for h in plan if is_submodule(g, h) or is_submodule(h, g)]
        if g in plan or not nested:
            continue
        rest = {h: e for h, e in plan.items() if h not in nested}
        freed = -sum(recompute_ms(h, plan[h]) for h in nested)
        for b in steps[g][1:]:
            yield freed + recompute_ms(g, b), {**rest, g: b}
