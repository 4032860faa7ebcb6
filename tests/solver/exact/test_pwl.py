"""solver/exact/pwl.py against brute force: values, envelopes, the convolution with a convex curve
(both of its ways), simplification and ``under_within``."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from solver.exact import pwl
from solver.exact.pwl import Pwl, envelope, infconv_convex, truncate_left, under_within


def _random_nondecreasing(rng: random.Random, n: int) -> Pwl:
    xs = np.cumsum([rng.choice([0.0, rng.uniform(0.1, 3.0)]) if i else rng.uniform(-2, 2)
                    for i in range(n)])
    ys = np.cumsum([rng.uniform(0.0, 2.0) for _ in range(n)])
    return Pwl(xs, ys)


def _brute(f: Pwl, cx: np.ndarray, cy: np.ndarray, shift: float, x: float) -> float:
    """min over t of c(t) + f(x - t - shift): a PWL in t, least at a vertex of c or where
    x - t - shift is a breakpoint of f (just right of it too, at a jump)."""
    at_c = cy + f.value(x - shift - cx)
    ts = x - shift - f.xs  # f at its own breakpoints exactly (no rounding across a jump)
    ok = (ts >= cx[0]) & (ts <= cx[-1])
    at_f = np.interp(ts[ok], cx, cy) + f.ys[ok]
    return float(np.concatenate([at_c, at_f]).min())


def test_values_jumps_and_domain() -> None:
    f = Pwl(np.array([0.0, 1.0, 1.0, 3.0]), np.array([1.0, 2.0, 5.0, 6.0]))
    assert f.value(np.array([-5.0, 0.0, 0.5, 1.0, 2.0, 3.0, 3.5])).tolist() == [1, 1, 1.5, 2, 5.5, 6, math.inf]
    assert f.right(np.array([-1.0, 1.0, 3.0])).tolist() == [1, 5, math.inf]
    assert truncate_left(f, 1.0).value(np.array([0.0, 1.0, 2.0])).tolist() == [2, 2, 5.5]
    assert truncate_left(f, 4.0).empty


def test_envelope_of_crossing_lines_and_of_ends() -> None:
    a = Pwl(np.array([0.0, 4.0]), np.array([0.0, 4.0]))
    b = Pwl(np.array([0.0, 2.0]), np.array([2.0, 2.0]))
    e = envelope([a, b])
    xs = np.linspace(-1, 5, 61)
    want = np.minimum(a.value(xs), b.value(xs))
    assert np.allclose(e.value(xs), want)


@pytest.mark.parametrize("seed", range(40))
def test_envelope_and_infconv_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    f, g = _random_nondecreasing(rng, rng.randint(1, 7)), _random_nondecreasing(rng, rng.randint(1, 7))
    xs = np.linspace(-4, 25, 700)
    assert np.allclose(envelope([f, g]).value(xs), np.minimum(f.value(xs), g.value(xs)))
    widths = [rng.uniform(0.1, 2.0) for _ in range(rng.randint(1, 5))]
    slopes = sorted(rng.uniform(0.0, 3.0) for _ in widths)
    cx = np.concatenate([[0.0], np.cumsum(widths)])
    cy = rng.uniform(0, 1) + np.concatenate([[0.0], np.cumsum(np.multiply(widths, slopes))])
    shift = rng.uniform(-1.0, 1.0)
    h, _ = infconv_convex(f, cx, cy, shift, cap=math.inf)
    want = np.array([_brute(f, cx, cy, shift, x) for x in xs])
    assert np.allclose(h.value(xs), want, rtol=1e-9, atol=1e-9)


def test_a_concave_kink_of_tiny_slopes_is_not_taken_as_convex() -> None:
    """Slopes are ms per byte: a concave kink of 2e-8 -> 2e-8 - 9e-13 ms/B must split the runs
    (an absolute tolerance of 1e-12 merged them and the convolution came out 3.6e-3 ms low)."""
    w = 4e9
    s1, s2 = 2.0e-8, 2.0e-8 - 9e-13
    f = Pwl(np.array([0.0, w, 2 * w]), np.array([0.0, s1 * w, s1 * w + s2 * w]))
    cx, cy = np.array([0.0, w]), np.array([0.0, 1.0e-8 * w])
    assert len(pwl.convex_runs(f)) == 2
    h, _ = infconv_convex(f, cx, cy, 0.0, cap=math.inf)
    assert float(h.value(2 * w)) == pytest.approx(_brute(f, cx, cy, 0.0, 2 * w), rel=1e-12)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("rel_tol", [1e-6, 1e-3, 0.2])
def test_under_within_stays_under_and_within_the_tolerance(seed: int, rel_tol: float) -> None:
    """At every argument (breakpoints, just right of jumps, and between): never above ``f``,
    never more than ``rel_tol * f`` under it, the same domain; a tolerance of 0.2 must merge."""
    rng = random.Random(seed)
    f = _random_nondecreasing(rng, rng.randint(2, 40))
    g = under_within(f, rel_tol)
    xs = np.concatenate([f.xs, np.linspace(f.xs[0] - 1, f.xs[-1] + 1, 2000)])
    for at in (f.value, f.right):
        a, b = at(xs), (g.value if at == f.value else g.right)(xs)
        inside = np.isfinite(a)
        assert np.array_equal(inside, np.isfinite(b)), "the domain changed"
        assert np.all(b[inside] <= a[inside] + 1e-12 * np.abs(a[inside]))
        assert np.all(a[inside] - b[inside] <= rel_tol * np.abs(a[inside]) + 1e-12)
    assert len(g.xs) <= len(f.xs)
    if rel_tol == 0.2 and len(f.xs) > 10:
        assert len(g.xs) < len(f.xs)
    assert under_within(f, 0.0) is f


def _random_convex(rng: random.Random, n_segments: int) -> tuple[np.ndarray, np.ndarray]:
    widths = [rng.uniform(0.1, 2.0) for _ in range(n_segments)]
    slopes = sorted(rng.uniform(0.0, 3.0) for _ in widths)
    cx = np.concatenate([[0.0], np.cumsum(widths)])
    cy = rng.uniform(0, 1) + np.concatenate([[0.0], np.cumsum(np.multiply(widths, slopes))])
    return cx, cy


@pytest.mark.parametrize("seed", range(60))
def test_both_ways_of_the_convolution_match_brute_force(seed: int) -> None:
    """One pass per segment of the curve (``_slide``) and one per convex run of ``f``
    (``_by_runs``), on functions with many runs, jumps and points repeated three times: both
    equal the brute-force minimum everywhere (breakpoints, just right of them, between)."""
    rng = random.Random(1000 + seed)
    f = _random_nondecreasing(rng, rng.randint(2, 60))
    cx, cy = _random_convex(rng, rng.randint(1, 8))
    shift = rng.uniform(-1.0, 1.0)
    c_w = np.diff(cx)
    c_s = np.diff(cy) / c_w
    slid = f
    for s, w in zip(c_s, c_w):
        slid = pwl.slide(slid, float(s), float(w))
    slid = Pwl(slid.xs + shift, slid.ys + cy[0])
    runs = pwl.by_runs(f, pwl.convex_runs(f), c_s, c_w, shift, float(cy[0]), math.inf)
    # Between breakpoints (at one, the brute force's own rounding picks a side of a jump).
    mids = [((h.xs[1:] + h.xs[:-1]) / 2)[np.diff(h.xs) > 1e-6] for h in (slid, runs)]
    xs = np.concatenate([np.linspace(f.xs[0] - 2, f.xs[-1] + cx[-1] + 2, 1500)] + mids)
    corners = np.concatenate([slid.xs, runs.xs])
    xs = xs[np.abs(xs[:, None] - corners[None, :]).min(axis=1) > 1e-9]
    end = f.xs[-1] + cx[-1] + shift
    want = np.array([_brute(f, cx, cy, shift, x) for x in xs])
    for h in (slid, runs):
        got = h.value(xs)
        assert np.array_equal(np.isfinite(got), np.isfinite(want)), "the domain differs"
        ok = np.isfinite(want)
        assert np.allclose(got[ok], want[ok], rtol=1e-9, atol=1e-9)
        assert h.xs[-1] == pytest.approx(end, rel=1e-12)


def test_a_slide_keeps_the_domain_end_where_x_plus_w_minus_w_rounds() -> None:
    """(4.206 + 2.589) - 2.589 is 4.2059999999999995: the window of the last moved breakpoint
    starts at the breakpoint itself, not past the domain's end (the result lost its last
    stretch)."""
    f = Pwl(np.array([0.1, 4.206]), np.array([1.0, 2.0]))
    assert (4.206 + 2.589) - 2.589 != 4.206
    g = pwl.slide(f, 0.5, 2.589)
    assert g.xs[-1] == 4.206 + 2.589
    assert float(g.value(4.206 + 2.589)) == pytest.approx(2.0 + 0.5 * 2.589, rel=1e-15)


def test_points_collinear_but_for_rounding_are_dropped() -> None:
    """Points a fraction of a byte apart on a line of 1.9e-9 ms/B near 0.05 ms (as a traced
    T5-large's value functions have): their slopes carry 8 digits, so the slope test alone kept
    them, and the exact functions grew by the thousand. They are one segment."""
    x = 2.5e7 + np.cumsum(np.tile([0.317, 2.22, 8.39e6], 200))
    y = 0.0509358367707 + 1.857e-9 * (x - x[0])
    g = pwl.simplified(x, y)
    assert len(g.xs) == 2
    assert np.allclose(g.value(x), y, rtol=4 * np.finfo(float).eps, atol=0)


def test_simplification_drifts_by_rounding_only() -> None:
    """A chain whose every point is within rounding of its neighbours' line, but which curves
    over its length: no two neighbours go in one round, so the result stays within a few ulps
    of every point (dropping them all at once would cut the curve's chord, 5e-11 off)."""
    x = np.arange(0.0, 1e6 + 1, 1e3)
    y = 1.0 + 2e-22 * x * x
    g = pwl.simplified(x, y)
    assert len(g.xs) < len(x)
    assert np.max(np.abs(g.value(x) - y)) <= 16 * np.finfo(float).eps
