"""Piecewise-linear functions of one variable, as the exact dynamic program needs them
(``solver/exact/prefix_dp.py``): lower envelopes, infimal convolution with a convex curve, truncation.

A function is two float arrays ``xs`` (nondecreasing) and ``ys``:

* left of ``xs[0]`` it is ``ys[0]`` (constant);
* between two distinct consecutive ``xs`` it is linear;
* two equal consecutive ``xs`` are an upward jump: the first ``y`` is the value there, the
  second the limit just right of it (the function is lower semicontinuous);
* right of ``xs[-1]`` it is +inf (outside its domain). An empty function is +inf everywhere.

In the dynamic program ``x`` is bytes discarded so far and ``y`` the least recompute time that
discards at least ``x``, so functions are nondecreasing; the operations below do not rely on it
except where they say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimators.contract.module_info import lower_hull_indices

__all__ = ["Pwl", "EMPTY", "point", "envelope", "infconv_convex", "truncate_left", "cap_right",
           "under_within", "simplified", "convex_runs", "by_runs", "slide"]

_REL = 1e-12
"""Relative slack under which two slopes are equal (a concave kink smaller than this is not a
kink) and three points are collinear."""

_SLIDE_RUNS = (2.5, 300.0)
"""A pass of ``slide`` over a function of n breakpoints costs about ``a + n / b`` convex runs'
worth of ``by_runs`` (timed on traced value functions), which ``infconv_convex`` uses to pick
the cheaper way."""

_ULPS = 4 * np.finfo(np.float64).eps
"""A point this close to the line through its neighbours, relative to their values, is on it:
rounding (a few ulps), which no slope test can see between points a fraction of a byte apart."""


@dataclass(frozen=True, eq=False)
class Pwl:
    xs: np.ndarray
    ys: np.ndarray

    @property
    def empty(self) -> bool:
        return len(self.xs) == 0

    @property
    def lowest(self) -> float:
        """The function's least value (``ys[0]`` of a nondecreasing function); +inf if empty."""
        return float(self.ys.min()) if len(self.ys) else float("inf")

    def value(self, q: np.ndarray | float) -> np.ndarray:
        """Values at ``q`` (the lower value at a jump)."""
        return self._at(q, "left")

    def right(self, q: np.ndarray | float) -> np.ndarray:
        """Limits just right of ``q`` (the upper value at a jump; +inf at the domain's end)."""
        return self._at(q, "right")

    def _at(self, q: np.ndarray | float, side: str) -> np.ndarray:
        # "left": i is the first breakpoint >= q, so at a jump the first (lower) y is taken;
        # "right": the first breakpoint > q, so the segment starts after the jump. Either way
        # xs[i - 1] < xs[i] for 0 < i < n: no interpolation across a jump.
        q = np.asarray(q, dtype=np.float64)
        xs, ys, n = self.xs, self.ys, len(self.xs)
        if n == 0:
            return np.full(q.shape, np.inf)
        if n == 1:
            return np.where((q <= xs[0]) if side == "left" else (q < xs[0]), ys[0], np.inf)
        i = np.searchsorted(xs, q, side=side)
        k = np.minimum(np.maximum(i, 1), n - 1)
        x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
        span = np.where(x1 > x0, x1 - x0, 1.0)
        out = np.where(x1 == q, y1, y0 + (y1 - y0) * (q - x0) / span)
        return np.where(i == 0, ys[0], np.where(i == n, np.inf, out))


EMPTY = Pwl(np.zeros(0), np.zeros(0))


def point(x: float, y: float) -> Pwl:
    """``y`` for every argument up to ``x``, +inf beyond."""
    return Pwl(np.array([float(x)]), np.array([float(y)]))


def simplified(xs: np.ndarray, ys: np.ndarray) -> Pwl:
    """Drop repeated points and points on the line through their neighbours: the same slope
    within ``_REL``, or off the line by no more than rounding (``_ULPS`` of the values)."""
    if len(xs) == 0:
        return EMPTY
    keep = np.ones(len(xs), dtype=bool)
    keep[1:] = (xs[1:] != xs[:-1]) | (ys[1:] != ys[:-1])
    xs, ys = xs[keep], ys[keep]
    while len(xs) > 2:
        dx0, dy0 = xs[1:-1] - xs[:-2], ys[1:-1] - ys[:-2]
        dx1, dy1 = xs[2:] - xs[1:-1], ys[2:] - ys[1:-1]
        cross = np.abs(dx0 * dy1 - dy0 * dx1)
        # Slopes within _REL, or the point off its neighbours' line (cross / (dx0 + dx1)) by
        # rounding: points a fraction of a byte apart carry slopes with a few digits only (dy is
        # a 1e-8 sliver of y), so the slope test alone kept collinear points by the thousand.
        tol = np.maximum(_REL * (np.abs(dx0 * dy1) + np.abs(dy0 * dx1)),
                         _ULPS * np.abs(ys[1:-1]) * (dx0 + dx1))
        straight = (dx0 > 0) & (dx1 > 0) & (cross <= tol)
        if not straight.any():
            break
        # Never two neighbours at once: each point is judged against points that stay, so the
        # drift is at most one tolerance per round (a round halves every stretch).
        i = np.arange(len(straight))
        starts = straight & ~np.concatenate([[False], straight[:-1]])
        first = np.maximum.accumulate(np.where(starts, i, 0))
        drop = straight & ((i - first) % 2 == 0)
        keep = np.ones(len(xs), dtype=bool)
        keep[1:-1] = ~drop
        xs, ys = xs[keep], ys[keep]
        if np.array_equal(drop, straight):
            break  # no two neighbours: one round took them all
    return Pwl(xs, ys)


def truncate_left(f: Pwl, n: float) -> Pwl:
    """``x -> f(max(x, n))``: at least ``n`` must be reached (EMPTY where ``f`` cannot)."""
    if f.empty or n <= f.xs[0]:
        return f
    if n > f.xs[-1]:
        return EMPTY
    at, right = float(f.value(n)), float(f.right(n))
    rest = f.xs > n
    head_x = [n, n] if right != at and np.isfinite(right) else [n]
    head_y = [at, right] if len(head_x) == 2 else [at]
    return simplified(np.concatenate([head_x, f.xs[rest]]), np.concatenate([head_y, f.ys[rest]]))


def cap_right(f: Pwl, cap: float) -> Pwl:
    """``f`` restricted to arguments up to ``cap`` (+inf beyond)."""
    if f.empty or cap >= f.xs[-1]:
        return f
    if cap < f.xs[0]:
        return point(cap, f.ys[0])
    below = f.xs < cap
    return Pwl(np.append(f.xs[below], cap), np.append(f.ys[below], float(f.value(cap))))


def envelope(fs: list[Pwl]) -> Pwl:
    """The lower envelope of ``fs`` (pairwise, in a balanced tree)."""
    fs = [f for f in fs if not f.empty]
    if not fs:
        return EMPTY
    while len(fs) > 1:
        fs = [_envelope2(fs[i], fs[i + 1]) if i + 1 < len(fs) else fs[i] for i in range(0, len(fs), 2)]
    return fs[0]


def _envelope2(f: Pwl, g: Pwl) -> Pwl:
    """The lower envelope of two functions (the common case, with integer sort keys: at most one
    crossing an interval)."""
    xs = np.union1d(f.xs, g.xs)
    vf, vg = f.value(xs), g.value(xs)
    rf, rg = f.right(xs), g.right(xs)
    val, rgt = np.minimum(vf, vg), np.minimum(rf, rg)
    k, t, cy = _crossings(rf[:-1], vf[1:], rg[:-1], vg[1:])
    cx = xs[k] + t * (xs[k + 1] - xs[k])
    inside = (cx > xs[k]) & (cx < xs[k + 1])
    k, cx, cy = k[inside], cx[inside], cy[inside]
    n = len(xs)
    jump = np.isfinite(rgt) & (rgt != val)
    px = np.concatenate([xs, xs[jump], cx])
    py = np.concatenate([val, rgt[jump], cy])
    key = np.concatenate([3 * np.arange(n), 3 * np.flatnonzero(jump) + 1, 3 * k + 2])
    order = np.argsort(key, kind="stable")
    px, py = px[order], py[order]
    finite_y = np.isfinite(py)
    return simplified(px[finite_y], py[finite_y])


def _crossings(r_p: np.ndarray, v_p: np.ndarray, r_q: np.ndarray, v_q: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where two functions, linear on each interval of a grid (from their right limits ``r`` at
    its left end to their values ``v`` at its right end), cross inside one: (interval, fraction
    of it, value there)."""
    with np.errstate(invalid="ignore"):  # inf - inf: nan, which compares false
        d0, d1 = r_p - r_q, v_p - v_q
    k = np.flatnonzero(((d0 < 0) & (d1 > 0)) | ((d0 > 0) & (d1 < 0)))
    d0, d1 = d0[k], d1[k]  # -inf against a value: a function +inf there, no crossing
    # Equal but for rounding at an end is not a crossing: two functions that meet at a grid
    # point (a line from a breakpoint and the function through it) gave crossings 1e-16 of an
    # interval inside, whose points no simplification could merge.
    real = ((np.abs(d0) > _REL * np.maximum(np.abs(r_p[k]), np.abs(r_q[k])))
            & (np.abs(d1) > _REL * np.maximum(np.abs(v_p[k]), np.abs(v_q[k])))
            & np.isfinite(d0) & np.isfinite(d1))
    k, d0, d1 = k[real], d0[real], d1[real]
    t = d0 / (d0 - d1)
    return k, t, r_p[k] + t * (v_p[k] - r_p[k])


def _envelope_on(xs: np.ndarray, vals: np.ndarray, rights: np.ndarray) -> Pwl:
    """The lower envelope of K functions known on the grid ``xs`` (increasing, every breakpoint
    of every function on it) by their values and right limits there (K x n): on each open
    interval a function is linear, from its right limit at one end to its value at the other,
    or +inf where either is."""
    val, rgt = vals.min(axis=0), rights.min(axis=0)
    a0, a1 = rights[:, :-1], vals[:, 1:]
    # Between consecutive crossings of any two, one function is least.
    pairs = [_crossings(a0[p], a1[p], a0[q], a1[q])
             for p in range(len(vals)) for q in range(p + 1, len(vals))]
    k = np.concatenate([c[0] for c in pairs])
    t = np.concatenate([c[1] for c in pairs])
    with np.errstate(invalid="ignore"):  # inf - inf where a function is +inf there: set below
        lines = a0[:, k] + t * (a1[:, k] - a0[:, k])
    lines[~(np.isfinite(a0[:, k]) & np.isfinite(a1[:, k]))] = np.inf
    cy = lines.min(axis=0) if len(k) else np.zeros(0)
    cx = xs[k] + t * (xs[k + 1] - xs[k])
    inside = (cx > xs[k]) & (cx < xs[k + 1])
    k, t, cx, cy = k[inside], t[inside], cx[inside], cy[inside]
    n = len(xs)
    j = np.flatnonzero(np.isfinite(rgt) & (rgt != val))
    px = np.concatenate([xs, xs[j], cx])
    py = np.concatenate([val, rgt[j], cy])
    kind = np.concatenate([np.zeros(n), np.ones(len(j)), np.full(len(k), 2.0)])
    at = np.concatenate([np.arange(n), j, k])
    order = np.lexsort((np.concatenate([np.zeros(n + len(j)), t]), kind, at))
    px, py = px[order], py[order]
    finite_y = np.isfinite(py)
    return simplified(px[finite_y], py[finite_y])


def convex_runs(f: Pwl) -> list[tuple[int, int]]:
    """Index ranges [i, j] of ``f``'s points over which it is convex (split at jumps and at
    concave kinks)."""
    n = len(f.xs)
    if n == 1:
        return [(0, 0)]
    dx, dy = np.diff(f.xs), np.diff(f.ys)
    jump = dx == 0
    slope = np.where(jump, 0.0, dy / np.where(jump, 1.0, dx))
    bend = np.zeros(n - 1, dtype=bool)
    # Relative only: slopes are ms per byte (1e-10..1e-7), so an absolute floor of even 1e-12
    # merges real concave kinks into one "convex" run, and the convolution undershoots the true
    # minimum (tests/solver/exact/test_pwl.py).
    bend[1:] = ~jump[1:] & ~jump[:-1] & (slope[1:] < slope[:-1] - _REL * np.abs(slope[:-1]))
    runs, start = [], 0
    for s in np.flatnonzero(jump | bend):
        if jump[s]:  # segment s is a jump: a run ends at point s, the next starts at s + 1
            runs.append((start, s))
            start = s + 1
        else:  # a concave kink at point s: runs share it
            runs.append((start, s))
            start = s
    runs.append((start, n - 1))
    return runs


def infconv_convex(f: Pwl, cx: np.ndarray, cy: np.ndarray, shift: float, cap: float
                   ) -> tuple[Pwl, float]:
    """``x -> min over t in [cx[0], cx[-1]] of cy(t) + f(x - t - shift)`` for a nondecreasing ``f``
    and a convex curve (``cx`` increasing from 0, ``cy`` convex: slopes nondecreasing), capped at
    ``cap``; and what the call cost, in convex runs' worth (see ``_SLIDE_RUNS``).

    Two exact ways, the cheaper taken: one pass per convex run of ``f`` (:func:`by_runs`) or
    one per segment of the curve (:func:`slide`: the curve is the convolution of its
    segments). Traced stacks have value functions of hundreds of convex runs and curves of a
    few segments, where the second way is several times cheaper."""
    if f.empty:
        return EMPTY, 0.0
    c_w = np.diff(cx)
    c_s = np.diff(cy) / np.where(c_w > 0, c_w, 1.0)
    c_s, c_w = c_s[c_w > 0], c_w[c_w > 0]
    runs = convex_runs(f)
    by_segments = len(c_s) * (_SLIDE_RUNS[0] + len(f.xs) / _SLIDE_RUNS[1])
    if by_segments >= len(runs) or (len(c_s) and c_s[0] < 0):
        out = by_runs(f, runs, c_s, c_w, float(cx[0]) + shift, float(cy[0]), cap)
        return out, float(len(runs))
    # A segment moves every argument right, so nothing past the cap matters on the way.
    g, reach = f, cap - float(cx[0]) - shift
    for slope, width in zip(c_s, c_w):
        g = cap_right(slide(g, float(slope), float(width)), reach)
    return Pwl(g.xs + (float(cx[0]) + shift), g.ys + float(cy[0])), by_segments


def by_runs(f: Pwl, runs: list[tuple[int, int]], c_s: np.ndarray, c_w: np.ndarray, x_shift: float,
             y_shift: float, cap: float) -> Pwl:
    """Each convex run of ``f`` adds to the curve as a Minkowski sum of epigraphs (their segments
    merged by slope); the result is the envelope of those sums. Extending each run left as a
    constant keeps the envelope exact for nondecreasing ``f``."""
    parts = []
    for i, j in runs:
        fx, fy = f.xs[i:j + 1], f.ys[i:j + 1]
        w = np.diff(fx)
        s = np.diff(fy) / np.where(w > 0, w, 1.0)
        widths = np.concatenate([w, c_w])
        slopes = np.concatenate([s, c_s])
        order = np.argsort(slopes, kind="stable")
        widths, slopes = widths[order], slopes[order]
        x0, y0 = fx[0] + x_shift, fy[0] + y_shift
        xs = np.concatenate([[x0], x0 + np.cumsum(widths)])
        ys = np.concatenate([[y0], y0 + np.cumsum(widths * slopes)])
        parts.append(cap_right(simplified(xs, ys), cap))
    return envelope(parts)


def slide(f: Pwl, slope: float, width: float) -> Pwl:
    """``x -> min over t in [0, width] of f(x - t) + slope * t`` for a nondecreasing ``f`` and
    ``slope >= 0``. The least of ``f(y) + slope * (x - y)`` over the window ``y in [x - width, x]``
    lies at one of the window's ends or at a breakpoint inside it, so this is the envelope of
    three functions on the grid of the breakpoints and the breakpoints moved by ``width``: ``f``
    (t = 0), ``f`` moved (t = width), and the line of slope ``slope`` from the best breakpoint in
    the window (found by range-minimum queries of ``f - slope * x``). Left of its domain ``f`` is
    constant, so with ``slope >= 0`` the window never needs to reach left of ``f.xs[0]``.

    Every value is taken from ``f``'s own points (``f(v) + slope * (x - v)``, not ``h + slope *
    x``): the round trip through ``h`` leaves points that are collinear but for rounding, which
    no simplification merges, and the functions grow without bound."""
    xs, ys = f.xs, f.ys
    moved = xs + width
    grid = np.union1d(xs, moved)
    left = grid - width
    # A moved breakpoint's window starts at that breakpoint exactly: (x + w) - w rounds off it,
    # past the domain's end at the last one.
    i = np.minimum(np.searchsorted(moved, grid), len(xs) - 1)
    hit = moved[i] == grid
    left[hit] = xs[i[hit]]
    v_left, r_left = f.value(left) + slope * width, f.right(left) + slope * width
    outside = left < xs[0]  # the window is clipped there, and xs[0] is inside it (the third term)
    v_left[outside], r_left[outside] = np.inf, np.inf
    # The third term is a line between grid points, so its value at x is its limit from the
    # left: the breakpoints in [x - width, x) (one at x itself is f at x, the first term). Just
    # right of x the window holds those in (x - width, x].
    # Both windows in one query (one sparse table).
    best = _range_argmin(
        ys - slope * xs,
        np.concatenate([np.searchsorted(xs, left, "left"), np.searchsorted(xs, left, "right")]),
        np.concatenate([np.searchsorted(xs, grid, "left"), np.searchsorted(xs, grid, "right")]) - 1)
    v_in = _best_line(xs, ys, slope, grid, best[:len(grid)])
    r_in = _best_line(xs, ys, slope, grid, best[len(grid):])
    return _envelope_on(grid, np.array([f.value(grid), v_left, v_in]),
                        np.array([f.right(grid), r_left, r_in]))


def _best_line(xs: np.ndarray, ys: np.ndarray, slope: float, at: np.ndarray, best: np.ndarray
               ) -> np.ndarray:
    """``ys[v] + slope * (at - xs[v])`` for the breakpoint ``v = best`` (+inf where -1)."""
    ok = best >= 0
    out = np.full(len(at), np.inf)
    out[ok] = ys[best[ok]] + slope * (at[ok] - xs[best[ok]])
    return out


def _range_argmin(a: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """An index of the least of ``a[lo:hi + 1]`` for each pair (-1 where empty), by a sparse
    table: level ``j`` holds the best index of each run of ``2**j``, a range is two overlapping
    runs."""
    out = np.full(len(lo), -1, dtype=np.int64)
    ok = hi >= lo
    if not ok.any():
        return out
    levels, span = [np.arange(len(a))], 1
    while 2 * span <= len(a):
        prev = levels[-1]
        p, q = prev[:-span], prev[span:]
        levels.append(np.where(a[q] < a[p], q, p))
        span *= 2
    table = np.zeros((len(levels), len(a)), dtype=np.int64)
    for j, level in enumerate(levels):
        table[j, :len(level)] = level
    lo, hi = lo[ok], hi[ok]
    length = hi - lo + 1
    k = np.floor(np.log2(length)).astype(np.int64)
    k -= (np.left_shift(1, k) > length).astype(np.int64)  # float log2 one off at a power of two
    k += (np.left_shift(1, k + 1) <= length).astype(np.int64)
    p, q = table[k, lo], table[k, hi - np.left_shift(1, k) + 1]
    out[ok] = np.where(a[q] < a[p], q, p)
    return out


def under_within(f: Pwl, rel_tol: float) -> Pwl:
    """A function with fewer convex runs that is nowhere above ``f`` and nowhere more than
    ``rel_tol * |f|`` under it (at ``f``'s breakpoints, jumps' upper values included), on the same
    domain. ``rel_tol`` 0: ``f`` itself.

    Greedy: from its first point, ``f`` is cut into the longest stretches whose points' lower
    convex hull is within the tolerance of every one of them (and always at a jump taller than
    the tolerance, between its two values), and each stretch is replaced by that hull. The hull
    of a stretch's points lies under the stretch, so the result is under ``f`` everywhere; joined
    at shared points it is continuous except at the jumps kept.

    Why: the lower envelopes of the dynamic program gather pieces that differ by next to nothing
    (combinations of choices of almost equal cost); merging them below keeps every value a lower
    bound with fewer convex runs to convolve."""
    n = len(f.xs)
    if n <= 2 or rel_tol <= 0:
        return f
    xs, ys = f.xs.tolist(), f.ys.tolist()
    tol = rel_tol * np.abs(f.ys)

    def hull_within(i: int, j: int) -> list[int] | None:
        hull = lower_hull_indices(xs, ys, i, j)
        err = f.ys[i:j + 1] - np.interp(f.xs[i:j + 1], f.xs[hull], f.ys[hull])
        return hull if bool(np.all(err <= tol[i:j + 1])) else None

    # A jump taller than the tolerance at its upper value is never bridged (the hull at its x
    # is at most its lower value): the stretches end there, between its two values.
    tall = np.flatnonzero((f.xs[1:] == f.xs[:-1]) & (f.ys[1:] - f.ys[:-1] > tol[1:])) + 1
    bounds = [0] + tall.tolist() + [n]
    keep: list[int] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        i, b = a, b - 1
        while i < b:
            # The longest stretch from i whose hull is within the tolerance: adding a point only
            # lowers the hull, so "within" holds up to some end and fails after it (galloping,
            # then bisection: O(n log n), where splitting at the farthest point is quadratic).
            # Two points are always within (a jump that is not tall).
            hull, j, step = hull_within(i, i + 1), i + 1, 1
            while j < b:
                nxt = min(b, j + step)
                h = hull_within(i, nxt)
                if h is None:
                    lo, hi = j, nxt  # within at lo, not at hi
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        h = hull_within(i, mid)
                        lo, hi, hull = (mid, hi, h) if h is not None else (lo, mid, hull)
                    j = lo
                    break
                hull, j, step = h, nxt, 2 * step
            keep += hull
            i = j
        keep.append(b)
    idx = np.unique(np.array(keep, dtype=np.int64))
    return Pwl(f.xs[idx], f.ys[idx])
