"""Repeated blocks: symmetry-breaking constraints for the module-level MILP, and why they are exact.

Most models are a stack of identical blocks, and the MILP's choices among them are nearly
symmetric: checkpointing block 7 instead of block 8 costs the same time and changes memory only a
little. Branch and bound then proves the same bound over and over. This module finds pairs of
identical candidates and adds two families of constraints that cut those duplicates off without
cutting off every optimum.

Pairs
-----
Two candidates ``i`` and ``j`` form a pair when everything the MILP knows about them but their
position is equal (``_signature``: discardable bytes, trade-off curve, fixed recompute time,
forced and held bytes, recompute growth or transient) and their windows are nested with ``i``
outside: ``fw_post_i <= fw_post_j <= bw_pre_j < bw_pre_i``. In a stack of blocks, block ``k`` and
block ``k + 1`` form a pair, and so do their attention modules, their MLPs, and so on. Each
candidate is paired with the next identical one in forward order (a chain, so O(n) constraints).

Constraints
-----------
For a pair (i, j), with ``chain(i)`` = i, its candidate ancestors and its candidate descendants:

* ratio order:   ``r_i >= r_j - (1 - y_i)``   (both checkpointed: the outer one discards more)
* touched order: ``y_j <= sum(y_c for c in chain(i))``  (j checkpointed: i, or a module nested
  with i, is too)

Why an optimum satisfies them (exchange argument)
-------------------------------------------------
Let x be any feasible plan and sigma(x) the plan with the decisions (y, r) of i and j exchanged.
Costs are equal (identical curves and fixed costs); the objective's tie-break weighs earlier
modules less, so it does not grow when the larger decision moves to i (i precedes j). Nesting
stays valid in the two cases below (in the first, i and j are both checkpointed, so nothing
nested with either is; in the second, nothing nested with i is, by assumption). Memory: write
``term_c(p)`` for what candidate c subtracts at memory point p, ``D_c = r_c S_c + f_c y_c`` (its
net discard, ``f = forced - held``) if p is in its window, ``-X_c`` at its own recompute point
(``X = g - D``, g its recompute growth), 0 elsewhere. Only the terms of i and j change. Since the
windows are nested, every point is of one of four kinds: in both windows (both terms equal
``D``: the exchange changes nothing), in i's window only (change ``D_i(new) - D_i(old)``),
j's recompute point, inside i's window (change ``g`` of the old minus the new plan at j, seen
through ``D + X = g``), and i's recompute point, outside j's window (change ``X`` of the new plan
at i minus the old one).

1. Ratio order violated: y_i = y_j = 1, r_i < r_j; sigma moves the larger ratio to i. Points in i's
   window only lose ``D(r_j) - D(r_i) >= 0``; at j's recompute point the change is
   ``g(r_i) - g(r_j) <= 0`` (g never decreases with r: a larger ratio recomputes a superset of
   ops). At i's recompute point the change is ``X(r_j) - X(r_i)``, which is <= 0 when X does not
   increase with r (checked on the breakpoints). Otherwise the point is compared with j's
   recompute point q in the unexchanged plan: memory there is ``base_q - gamma_q - D(r_i) +
   X(r_j)``, while i's recompute point after the exchange holds ``base_p - gamma_p + X(r_j)``
   (gamma: every other candidate's terms). ``base_p - base_q + max D <= min(gamma_p - gamma_q)``
   makes the latter no higher; the minimum is bounded candidate by candidate from the ranges of D
   (``_cross_bound``), which depend only on the data.
   A checkpoint's held inputs (``checkpoint_retain_bytes``, alive from its ``bw_pre_op`` to its
   ``bw_post_op``) depend on y alone, which this exchange does not change.
2. Touched order violated: y_j = 1 and all of chain(i) is 0; sigma moves j's plan to i. Points in
   i's window only lose ``D >= 0`` (needs ``f >= 0``, checked); j's recompute point changes by
   ``-g <= 0``; i's recompute point gains ``X`` of the moved plan: fine if ``X <= 0`` for every
   ratio, else compared with j's recompute point as in 1 (without the ``max D`` term). This
   exchange moves the held inputs from j's backward to i's; that is not covered, so candidates
   that hold inputs (``checkpoint_retain_bytes > 0``) get no touched order.

Every exchange keeps the plan feasible at no more cost, and strictly lowers
``(sum_c index_c y_c, sum_c index_c r_c)`` lexicographically (case 2 lowers the first, case 1
keeps it and lowers the second; with y fixed, case 1 is a bubble sort of finitely many values).
So from any optimum, exchanges reach an optimum that violates no constraint: adding them leaves
the optimal value unchanged. A pair whose checks fail gets no constraint; the MILP is then the
plain one for it. Depending on the positions, the plain optimum need not be ordered by block
(a measured synthetic decoder checkpoints the MLP of blocks 3 and 8 and whole blocks around
them); that is why the constraints order corresponding modules and "touched" chains, not plans.

The constraints are checked against the plain MILP on random trees with and without repeated
blocks (tests/solver/test_symmetry.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats

__all__ = ["SymmetryPair", "symmetry_pairs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SymmetryPair:
    """Two identical candidates, ``outer`` (index into the candidate list) enclosing ``inner``."""

    outer: int
    inner: int
    ratio_order: bool
    """Add ``r_outer >= r_inner - (1 - y_outer)``."""
    touched_order: bool
    """Add ``y_inner <= sum(y over chain(outer))``."""


def _signature(s: ModStats) -> tuple:
    """Everything the MILP reads from a candidate except its position."""
    return (
        s.sac_memory_bytes, s.tradeoff.discarded_bytes, s.tradeoff.recompute_ms,
        getattr(s, "recompute_fixed_ms", 0.0), s.checkpoint_retain_bytes,
        getattr(s, "forced_discard_bytes", 0), s.recompute_transient_bytes,
        tuple(getattr(s, "recompute_growth_bytes", ()) or ()),
    )


@dataclass(frozen=True)
class _Terms:
    """Ranges of a candidate's terms over its plans (y = 1), in bytes."""

    d_min: float
    d_max: float
    x_max: float
    x_nonincreasing: bool
    g_nondecreasing: bool
    fixed: int


def _terms(s: ModStats, extra_fn) -> _Terms:
    from solver.plan_cost import fixed_discard_bytes, growth_table

    f = fixed_discard_bytes(s)
    xs = s.tradeoff.discarded_bytes
    if growth_table(s):
        g = list(growth_table(s))
        xvals = [extra_fn(s, x) for x in xs]  # X(d) = g(d) - d - f at each breakpoint
    else:  # legacy: X = T, g = D + T
        g = [x + f + s.recompute_transient_bytes for x in xs]
        xvals = [s.recompute_transient_bytes] * len(xs)
    return _Terms(
        d_min=float(f), d_max=float(s.sac_memory_bytes + f), x_max=float(max(xvals)),
        x_nonincreasing=all(b <= a for a, b in zip(xvals, xvals[1:])),
        g_nondecreasing=all(b >= a for a, b in zip(g, g[1:])),
        fixed=f,
    )


def symmetry_pairs(
    stats: Sequence[ModStats],
    ancestors: Sequence[set[int]],
    points_t: np.ndarray,
    points_base: np.ndarray,
    recompute_points: dict[int, list[int]],
) -> list[SymmetryPair]:
    """Pairs of identical candidates and which constraints are proven safe for each.

    ``stats[k]`` is candidate k (in forward pre-order), ``ancestors[k]`` the candidate indices
    nested with k (ancestors and descendants), ``points_t`` / ``points_base`` the op index and
    base bytes of every memory point, ``recompute_points[k]`` the points where k recomputes."""
    from solver.plan_cost import recompute_extra_bytes

    n = len(stats)
    fw = np.array([s.fw_post_op for s in stats], dtype=np.int64)
    bw = np.array([s.bw_pre_op for s in stats], dtype=np.int64)
    terms = [_terms(s, recompute_extra_bytes) for s in stats]
    d_lo = np.array([min(0.0, t.d_min) for t in terms])  # in a window at p, not at q
    d_hi = np.array([max(0.0, t.d_max) for t in terms])  # in a window at q, not at p
    groups: dict[tuple, list[int]] = {}
    for k, s in enumerate(stats):
        if s.bw_pre_op >= 0:
            groups.setdefault(_signature(s), []).append(k)
    out = []
    for members in groups.values():
        members.sort(key=lambda k: (fw[k], k))
        for a, b in zip(members, members[1:]):
            if not (fw[a] <= fw[b] <= bw[b] < bw[a]):
                continue
            t = terms[a]
            ratio = t.g_nondecreasing and (
                t.x_nonincreasing or _cross_ok(a, b, t.d_max, fw, bw, d_lo, d_hi, ancestors,
                                               points_t, points_base, recompute_points))
            # Held inputs (alive through the candidate's own backward, ``held_points``) move
            # with y in the touched exchange and are not covered by its proof: no touched order.
            touched = t.fixed >= 0 and t.g_nondecreasing and not stats[a].checkpoint_retain_bytes and (
                t.x_max <= 0 or _cross_ok(a, b, 0.0, fw, bw, d_lo, d_hi, ancestors,
                                          points_t, points_base, recompute_points))
            if ratio or touched:
                out.append(SymmetryPair(a, b, ratio, touched))
    logger.debug("symmetry: %d pairs among %d candidates", len(out), n)
    return out


def _cross_ok(a: int, b: int, slack: float, fw, bw, d_lo, d_hi, nested, points_t, points_base,
              rec: dict[int, list[int]]) -> bool:
    """``base_p - base_q + slack <= min(gamma_p - gamma_q)`` for every recompute point p of a,
    with q the recompute point of b (see the module docstring, case 1)."""
    ps, qs = rec.get(a, []), rec.get(b, [])
    if not ps:
        return True  # a never recomputes at a point of its own: nothing to compare
    if not qs:
        return False
    q = qs[0]
    skip = nested[a] | nested[b] | {a, b}
    keep = np.ones(len(fw), dtype=bool)
    keep[list(skip)] = False
    tq = points_t[q]
    in_q = (fw <= tq) & ((bw > tq) | (bw < 0))
    for p in ps:
        tp = points_t[p]
        in_p = (fw <= tp) & ((bw > tp) | (bw < 0))
        bound = d_lo[keep & in_p & ~in_q].sum() - d_hi[keep & in_q & ~in_p].sum()
        if points_base[p] - points_base[q] + slack > bound:
            return False
    return True
