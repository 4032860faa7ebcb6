"""Branching on how many modules of each kind are checkpointed: exact, and fast on stacks of blocks.

Why
---
On a stack of nearly identical blocks the MILP is a knapsack with fixed costs: the budget asks for
a number of bytes, each block gives them in a few modes (the whole block, its MLP only, ...) at a
fixed recompute cost plus a slope, and the LP relaxation puts one block in a fractional mode.
Branch and bound on single modules then moves that fraction from block to block without raising
the bound, and runs into its time limit on a traced Llama-3-70B. With the number of checkpointed
modules of each kind fixed (so many whole layers, so many MLPs, ...) the same MILP is proven at
once, and few such boxes need solving. On such stacks this is several times faster than the
chain program (``solver/exact/``), which proves them too (benchmarks/tradeoff_sweep.py).

What
----
Candidates are grouped by kind: their fqn with the numeric path components removed
(``Llama.layers.12.feed_forward`` -> ``Llama.layers.feed_forward``). A count row
``lo_g <= sum(y_k for k in g) <= hi_g`` per group of two or more, non-binding at first, turns
the search space into boxes of count vectors. A box is bounded by its LP relaxation and, where
that bound cannot beat the best plan, dropped; where the LP's counts are fractional the box is
split on one of them; where they are integral (N), the MILP with counts fixed to N is solved
(the fast case above) and the rest of the box is split into disjoint boxes that differ from N
in one group first (group 1 below or above N_1; group 1 at N_1, group 2 below or above; ...).

Exactness: the count of a group is an integer in every plan, so the boxes partition the plans
(the grouping only decides speed, never the optimum); a box is dropped only when its LP bound,
a lower bound on every plan in it, is within ``rel_gap`` of the best plan found; each fixed-
count MILP is proven within ``rel_gap``. The best plan should therefore be within ``rel_gap``
of the optimum of the whole MILP; tests/solver/milp/test_count_branch.py compares both on
random stacks of blocks and on random trees grouped at random. HiGHS at rel_gap 0 calls a
fixed-count MILP optimal with its dual bound a little below (its tolerances): that is taken as
the proof HiGHS says it is, as the plain solve does.
"""

from __future__ import annotations

import heapq
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from solver.milp.linear_model import GE, LinearModel, LpSolution
from solver.milp.backend import BackendOutcome, options_until
from solver.options import SolverOptions

__all__ = ["CountBrancher", "kind_groups", "MAX_BOXES"]

logger = logging.getLogger(__name__)

_INT_EPS = 1e-6
"""A count within this of an integer is integral (y columns are proven to 1e-8 by HiGHS)."""


_LP_INTEGRAL = 1e-8
"""An LP relaxation whose integer columns are this close to integers is a plan (the tolerance
the fixed-count MILP would be solved to)."""


MAX_BOXES = 24
"""Boxes (LP relaxations plus fixed-count MILPs) one search may evaluate before it hands the
budget back (``CountBrancher.solve`` returns None: the chain program, then the whole-model
solve decide). The stacks it suits need a few boxes a budget (the benchmarks' decoders and the
Llama-3-70B sweep fewer than this); blocks that differ too much (traced GPT-2, BERT, Whisper)
or a search with no plan to prune with (a LeViT at its smallest peak) would run on for many
times the program's or the whole model's time. A count, not a clock: the same budget gives the
same plan."""


_PROOF_SLACK = 1e-8
"""Gap left by HiGHS' own tolerances in a solve asked for rel_gap = 0 that still counts as a
proof."""


def kind_groups(fqns: Sequence[str]) -> list[list[int]]:
    """Indices of ``fqns`` grouped by module kind (numeric path components removed); groups of
    two or more only, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, f in enumerate(fqns):
        key = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1#", f)
        groups.setdefault(key, []).append(i)
    return [g for g in groups.values() if len(g) > 1]


@dataclass(frozen=True)
class _Box:
    lo: tuple[int, ...]
    hi: tuple[int, ...]


class CountBrancher:
    """Count rows added to ``prob`` once; ``solve`` runs the search for the current budget and
    objective (``prob``'s bounds and costs as the caller set them)."""

    def __init__(self, prob: LinearModel, y_columns: Sequence[int], groups: list[list[int]]) -> None:
        self.prob = prob
        self.groups = groups
        self.sizes = tuple(len(g) for g in groups)
        self.rows = [prob.add_row([(y_columns[k], 1.0) for k in g], GE, 0.0, f"count_{i}")
                     for i, g in enumerate(groups)]
        self._y = [[y_columns[k] for k in g] for g in groups]
        self._set(_Box(tuple(0 for _ in groups), self.sizes))

    def _set(self, box: _Box) -> None:
        for row, lo, hi in zip(self.rows, box.lo, box.hi):
            self.prob.set_row_bounds(row, lo, hi)

    def _integral(self, values: np.ndarray) -> bool:
        """Every integer column of ``values`` within 1e-8 of an integer and every row within
        1e-9: the LP's own primal tolerance (1e-7) let through plans the MILP refuses (a
        model checkpointing nothing 1e-7 of a unit over the budget)."""
        return self.prob.exact_enough(values, _LP_INTEGRAL)

    def _counts(self, values: np.ndarray) -> list[float]:
        return [float(values[ys].sum()) for ys in self._y]

    def solve(self, options: SolverOptions, incumbent: LpSolution | None, deadline: float | None,
              rel_gap: float, max_boxes: int | None = None) -> LpSolution | None:
        """Best solution over all boxes. ``incumbent``: a solution already known, the bar boxes
        must beat. Stops at ``deadline`` (perf_counter) with the best so far and
        its gap from the lowest bound left open. None where the search would evaluate more
        than ``max_boxes`` boxes (default ``MAX_BOXES``): the model is better solved whole."""
        max_boxes = MAX_BOXES if max_boxes is None else max_boxes
        t0 = time.perf_counter()
        # Warm LPs within this search only: the same budget gives the same plan every time.
        self.prob.reset_relaxation()
        best = incumbent if incumbent is not None and incumbent.values is not None else None
        best_obj = best.objective if best is not None else math.inf
        lower = math.inf  # lowest bound of any part of the search dropped or left open
        root = _Box(tuple(0 for _ in self.groups), self.sizes)
        heap: list[tuple[float, int, _Box]] = [(-math.inf, 0, root)]
        seq, n_lp, n_milp, n_free, stopped = 1, 0, 0, 0, False
        unsettled = False  # a box's MILP stopped without a proof or an infeasibility verdict

        def beaten(bound: float) -> bool:
            return bound >= best_obj - rel_gap * abs(best_obj)

        try:
            while heap:
                if n_lp + n_milp >= max_boxes:
                    logger.debug("count branching: %d boxes evaluated and %d open, no proof: the "
                                 "whole model is solved instead", n_lp + n_milp, len(heap))
                    return None
                if deadline is not None and time.perf_counter() >= deadline:
                    stopped = True
                    lower = min([lower] + [b for b, _, _ in heap])
                    break
                bound, _, box = heapq.heappop(heap)
                if beaten(bound):
                    lower = min(lower, bound)
                    continue
                self._set(box)
                lp = self.prob.solve_relaxation(options_until(options, deadline))
                n_lp += 1
                if lp.values is None and not lp.outcome.infeasible:
                    if deadline is not None and time.perf_counter() >= deadline:
                        heapq.heappush(heap, (bound, seq, box))  # out of time: it stays open
                        seq += 1
                        continue
                    # No bound (HiGHS' LP status "unknown", on some tiny stacks): the
                    # box's own MILP settles it.
                    sol = self.prob.solve(options_until(options, deadline), rel_gap=rel_gap)
                    n_milp += 1
                    best, best_obj, lower = _take(sol, best, best_obj, lower, bound)
                    unsettled |= not (sol.outcome.proven or sol.outcome.infeasible)
                    continue
                if lp.values is None:
                    continue  # infeasible box
                if beaten(lp.objective):
                    lower = min(lower, lp.objective)
                    continue
                counts = self._counts(lp.values)
                frac = next((g for g, c in enumerate(counts) if abs(c - round(c)) > _INT_EPS), None)
                children: list[_Box] = []
                if frac is not None:
                    c = counts[frac]
                    children = [_with(box, frac, box.lo[frac], math.floor(c)),
                                _with(box, frac, math.ceil(c), box.hi[frac])]
                else:
                    n = tuple(int(round(c)) for c in counts)
                    self._set(_Box(n, n))
                    if self._integral(lp.values):
                        # The relaxation's optimum is a plan: optimal in the box, no MILP needed.
                        sol, n_free = lp, n_free + 1
                    else:
                        sol = self.prob.solve(options_until(options, deadline), rel_gap=rel_gap)
                        n_milp += 1
                    best, best_obj, lower = _take(sol, best, best_obj, lower, lp.objective)
                    unsettled |= not (sol.outcome.proven or sol.outcome.infeasible)
                    fixed = box
                    for g in range(len(n)):  # the rest of the box, in disjoint pieces
                        if fixed.lo[g] <= n[g] - 1:
                            children.append(_with(fixed, g, fixed.lo[g], n[g] - 1))
                        if n[g] + 1 <= fixed.hi[g]:
                            children.append(_with(fixed, g, n[g] + 1, fixed.hi[g]))
                        fixed = _with(fixed, g, n[g], n[g])
                for child in children:
                    if all(lo <= hi for lo, hi in zip(child.lo, child.hi)):
                        heapq.heappush(heap, (lp.objective, seq, child))
                        seq += 1
        finally:
            self._set(root)
        seconds = time.perf_counter() - t0
        logger.debug("count branching: %d LPs (%d of them integral), %d fixed-count MILPs, %.2f s",
                     n_lp, n_free, n_milp, seconds)
        if best is None:
            return LpSolution(BackendOutcome(False, False, not stopped, None, seconds), None, None)
        if lower == -math.inf:  # stopped before the root's bound: nothing is known
            gap = None
        else:  # inf: every box was searched to the end and none is left open
            gap = max(0.0, (best_obj - lower) / max(abs(best_obj), 1e-12)) if lower < math.inf else 0.0
        # Every box dropped by its LP bound or settled by HiGHS' own verdict is a proof as good
        # as HiGHS' on the whole model: HiGHS calls a solve at rel_gap 0 optimal with its dual
        # bound a little below (its tolerances).
        proven = gap is not None and (gap <= rel_gap + _PROOF_SLACK or not (stopped or unsettled))
        return LpSolution(BackendOutcome(True, proven, False, gap, seconds), best.values, best.objective)


def _with(box: _Box, g: int, lo: int, hi: int) -> _Box:
    return _Box(box.lo[:g] + (lo,) + box.lo[g + 1:], box.hi[:g] + (hi,) + box.hi[g + 1:])


def _take(sol: LpSolution, best: LpSolution | None, best_obj: float, lower: float,
          bound: float) -> tuple[LpSolution | None, float, float]:
    """Fold a box's MILP result in: the best solution and the lowest bound of what it searched
    (its dual bound where proven, else ``bound``, the box's LP bound)."""
    if sol.values is not None:
        dual = sol.objective - (sol.outcome.gap or 0.0) * abs(sol.objective)
        lower = min(lower, dual if sol.outcome.proven else bound)
        if sol.objective < best_obj:
            best, best_obj = sol, sol.objective
    elif not sol.outcome.infeasible:
        lower = min(lower, bound)
    return best, best_obj, lower
