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
from tests.solver.builders import MiB, chain, make_info, mod, pt


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


def test_discarding_everything_takes_the_full_checkpoint_where_it_is_cheaper() -> None:
    """A selective checkpoint pays its policy (in the fixed cost, 5 ms here); a full one, at a
    ratio of 1, does not: 14 ms, not 5 + 11 = 16. The envelope takes that vertex, and the curve
    still counts as convex (the full checkpoint is not part of the selective curve). Without a
    full price (0: some op must be saved) the selective one stands."""
    import dataclasses

    s = dataclasses.replace(mod("M.b", size_mib=100, fixed_ms=5.0, curve=((0, 0.0), (50, 1.0), (100, 11.0))),
                            full_recompute_ms=14.0)
    assert module_recompute_ms(s, 60 * MiB) == 8.0
    assert module_recompute_ms(s, 100 * MiB) == 14.0
    segs, convex = cost_envelope(s)
    assert convex and max(a + b for a, b in segs) == pytest.approx(14.0)
    assert module_recompute_ms(dataclasses.replace(s, full_recompute_ms=20.0), 100 * MiB) == 16.0
    assert module_recompute_ms(dataclasses.replace(s, full_recompute_ms=0.0), 100 * MiB) == 16.0


def test_cost_envelope_of_a_concave_curve_is_its_chord() -> None:
    """(0,0) (50 MiB, 5 ms) (100 MiB, 6 ms) is concave: the MILP prices it on the chord 6 r."""
    s = mod("M.b", size_mib=100, curve=((0, 0.0), (50, 5.0), (100, 6.0)))
    segs, convex = cost_envelope(s)
    assert (segs, convex) == ([(6.0, 0.0)], False)
    convex_s = mod("M.c", size_mib=100, curve=((0, 0.0), (50, 1.0), (100, 11.0)))
    assert cost_envelope(convex_s) == ([(2.0, 0.0), (20.0, -9.0)], True)


def test_cost_envelope_convexity_agrees_with_testing_every_segment() -> None:
    """The vectorised convexity verdict agrees with testing every segment at every point in
    Python, as it was computed before, on 400 random curves (convex by construction or not,
    some with vertical steps: a lookup of the one segment over each point got those wrong and
    called 32 modules of the new-user trial's HF models not convex)."""
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
        if rng.random() < 0.3:  # a vertical step: two points at one x (a zero-byte op's cost)
            k = rng.randrange(len(xs))
            xs.insert(k, xs[k])
            ys.insert(k, max(0.0, ys[k] - rng.uniform(0.0, 1.0)))
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



def test_cost_envelope_of_a_clip_text_model_is_convex() -> None:
    # CLIPModel.text_model's curve (new-user trial): nearly equal slopes (0.056210499999999976,
    # 0.05621050000000015) cross anywhere under rounding, and a lookup of the one segment over
    # each point by their crossings called it not convex (a warning on 32 modules of 14 HF
    # families). Every segment at every point calls it convex, as before.
    from solver.plan_cost import _all_on_envelope

    segs = [
        (0.02489600000000061, 0.025241600000000003), (0.04376250000000001, 0.025236750000000002),
        (0.04869364705882355, 0.02458644705882353), (0.04979199999999995, 0.02428800000000002),
        (0.05290400000000003, 0.02303279999999999), (0.056210499999999976, 0.021481550000000012),
        (0.05621050000000015, 0.021481549999999912), (0.07468799999999996, 0.009164800000000035),
        (0.07468800000000003, 0.009164799999999987), (0.07468800000000007, 0.009164799999999945),
        (0.09519058823529414, -0.00989891764705883), (0.22406399999995308, -0.13873919999995307),
    ]
    pts = [
        (0.0, 0.025241600000000003), (0.0002570694087403599, 0.025248000000000003),
        (0.13187660668380463, 0.031008000000000004), (0.20179948586118251, 0.03441280000000001),
        (0.2717223650385604, 0.03781760000000001), (0.40334190231362466, 0.0443712),
        (0.4691516709511568, 0.0478528), (0.5349614395886889, 0.051552),
        (0.6007712082262211, 0.0552512), (0.6665809768637532, 0.05895040000000001),
        (0.7323907455012854, 0.06386560000000001), (0.8640102827763496, 0.07369600000000001),
        (0.9298200514138818, 0.07861120000000002), (0.9997429305912596, 0.08526720000000002),
        (1.0, 0.0853248),
    ]
    assert _all_on_envelope(segs, pts)


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
