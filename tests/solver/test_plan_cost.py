"""solver/plan_cost.py: the exact cost of a module-level plan, on hand-built ModuleInfos whose
numbers are worked out by hand (the helpers and the ``chain`` graph are test_milp.py's)."""

from __future__ import annotations

import pytest

from solver.errors import UnknownModuleError
from solver.plan_cost import (
    MemoryModel,
    check_world_size,
    cost_envelope,
    module_recompute_ms,
    predict_peak_bytes,
    recompute_extra_bytes,
)
from tests.solver.test_milp import MiB, chain, make_info, mod, pt


def test_memory_at_every_point_of_the_chain() -> None:
    """chain(): no-AC 400 / 450 / 350 / 250 MiB at t = 35 / 40 / 50 / 60. b0's window is
    [10, 60): 50 MiB discarded lowers the first three points and not t=60 (its backward began)."""
    info = chain()
    model = MemoryModel(info, world_size=1)
    assert model.point_bytes({}) == [400 * MiB, 450 * MiB, 350 * MiB, 250 * MiB]
    assert model.point_bytes({"M.b0": 50 * MiB}) == [350 * MiB, 400 * MiB, 300 * MiB, 250 * MiB]
    assert predict_peak_bytes(info, {"M.b0": 50 * MiB}) == 400 * MiB


def test_a_discard_does_not_help_from_its_own_backward_on() -> None:
    """b2's window is [30, 40): all 100 MiB discarded lower t=35 to 300, but the peak is t=40,
    where b2's backward starts, at 450 still."""
    info = chain()
    assert MemoryModel(info, world_size=1).point_bytes({"M.b2": 100 * MiB})[:2] == [300 * MiB, 450 * MiB]
    assert predict_peak_bytes(info, {"M.b2": 100 * MiB}) == 450 * MiB


def test_recompute_time_on_the_exact_curve_with_its_fixed_cost() -> None:
    """Curve (0,0) (50 MiB, 1 ms) (100 MiB, 11 ms) plus 5 ms fixed: 60 MiB cost 5 + 1 + 10*10/50."""
    s = mod("M.b", size_mib=100, fixed_ms=5.0, curve=((0, 0.0), (50, 1.0), (100, 11.0)))
    assert module_recompute_ms(s, 0) == 5.0  # a checkpoint that discards only its forced bytes
    assert module_recompute_ms(s, 60 * MiB) == 8.0
    assert module_recompute_ms(s, 100 * MiB) == 16.0


def test_cost_envelope_of_a_concave_curve_is_its_chord() -> None:
    """(0,0) (50 MiB, 5 ms) (100 MiB, 6 ms) is concave: the MILP prices it on the chord 6 r."""
    s = mod("M.b", size_mib=100, curve=((0, 0.0), (50, 5.0), (100, 6.0)))
    segs, convex = cost_envelope(s)
    assert (segs, convex) == ([(6.0, 0.0)], False)
    convex_s = mod("M.c", size_mib=100, curve=((0, 0.0), (50, 1.0), (100, 11.0)))
    assert cost_envelope(convex_s) == ([(2.0, 0.0), (20.0, -9.0)], True)


def test_cost_envelope_convexity_agrees_with_testing_every_segment() -> None:
    """The convexity verdict looks up the one segment over each point; on 400 random curves
    (convex by construction or not, with kinks closer than rounding at their crossings) it
    agrees with testing every segment at every point, as it was computed before."""
    import random

    rng = random.Random(7)
    verdicts = set()
    for _ in range(400):
        n = rng.randint(1, 40)
        xs = sorted({rng.randint(1, 99) for _ in range(n)})
        if rng.random() < 0.5:  # slopes sorted ascending: a convex curve, kinks and all
            slopes = sorted(rng.uniform(0.0, 10.0) for _ in xs)
            ys, y, last = [], 0.0, 0
            for x, a in zip(xs, slopes):
                y += a * (x - last)
                ys.append(round(y, 3))
                last = x
        else:
            ys = sorted(round(rng.uniform(0.0, 20.0), 3) for _ in xs)
        points = tuple(zip(xs, ys))
        s = mod("M.b", size_mib=100, curve=((0, 0.0), *points, (100, ys[-1] + 1.0)))
        segs, convex = cost_envelope(s)
        pts = [(0.0, 0.0)] + [(x / 100, y) for x, y in points] + [(1.0, ys[-1] + 1.0)]
        every = all(max(a * x + b for a, b in segs) >= y - 1e-9 * max(1.0, abs(y)) for x, y in pts)
        assert convex == every, (points, segs)
        verdicts.add(convex)
    assert verdicts == {True, False}


def test_cost_envelope_with_two_segments_of_one_slope_warns_nothing() -> None:
    # The hull kept two segments of one slope (a kink rounding left; MobileViT, Zamba2): their
    # crossing was 0/0, a numpy RuntimeWarning in the user's planning run.
    import warnings

    from solver.plan_cost import _all_on_envelope

    segs = [(0.0241152, 0.03566848), (0.0241152, 0.03566848), (1.0, -0.5)]
    on = [(0.0, 0.03566848), (0.5, 0.0241152 * 0.5 + 0.03566848), (1.0, 0.5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _all_on_envelope(segs, on)
        assert not _all_on_envelope(segs, on + [(0.25, 1.0)])  # a point above: not convex
        assert _all_on_envelope(segs[:2], on[:2])


def test_recompute_transient_without_a_growth_table() -> None:
    s = mod("M.b", size_mib=100, ms=1, transient_mib=80)
    assert recompute_extra_bytes(s, 40 * MiB) == 80 * MiB


def test_world_size_shards_the_state_rounding_up() -> None:
    info = make_info([mod("M")], [pt(0, 0, param_mib=1, grad_mib=1, opt_mib=1)])
    assert predict_peak_bytes(info, {}, world_size=4) == -(-3 * MiB // 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size must be an int >= 1"):
            check_world_size(bad)


def test_bad_decisions_are_refused_with_the_module_named() -> None:
    with pytest.raises(UnknownModuleError, match="close names: 'M.b0'"):
        predict_peak_bytes(chain(), {"M.bx0": 1})
    with pytest.raises(ValueError, match=r"M.b0: discarded bytes .* not in \[0, "):
        predict_peak_bytes(chain(), {"M.b0": 101 * MiB})
