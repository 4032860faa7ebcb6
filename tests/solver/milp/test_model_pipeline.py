"""solver/milp/model.py: the pipeline rows (``MemoryPoint.in_flight``, ``recompute_in_window``), on hand-built
tables with the optimal plans worked out by hand (MiB = 2**20 bytes)."""

from __future__ import annotations

import pytest

from estimators.contract.module_info import MemoryPoint
from solver import SACMilp, predict_peak_bytes
from tests.solver.builders import MiB, make_info, mod


def _stage(points) -> tuple:
    """Stage S -> a, b (100 MiB each; full recompute 10 ms for a, 20 ms for b); windows a [10, 40),
    b [20, 30): one micro-batch's memory at t=25 is 200 MiB of activations less the discards."""
    stats = [mod("S"), mod("S.a", size_mib=100, ms=10, fw_post=10, bw_pre=40), mod("S.a.fc", leaf=True),
             mod("S.b", size_mib=100, ms=20, fw_post=20, bw_pre=30), mod("S.b.fc", leaf=True)]
    return make_info(stats, points)


def test_micro_batches_in_flight_discard_with_the_plan():
    """t=25 holds the current micro-batch (200 MiB, both windows open) and 3 more in flight (200
    each, nothing in a window): 800 MiB unplanned. A discard of d lowers it by 4 d. At a budget of
    500 MiB: 300 MiB to free, 75 MiB of discard: all of it from a (10 ms / 100 MiB beats 20):
    a at 0.75, 7.5 ms. Without the copies the same point is only 200 - d."""
    info = _stage([MemoryPoint(op_index=25, phase="bw", activation_bytes=800 * MiB, in_flight=(("S", 3),))])
    assert predict_peak_bytes(info, {}) == 800 * MiB
    assert predict_peak_bytes(info, {"S.a": 75 * MiB}) == 500 * MiB
    res = SACMilp(info).solve(500 * MiB)
    assert res.checkpointed == ("S.a",)
    assert res.discarded_bytes["S.a"] == 75 * MiB and res.recompute_ms == pytest.approx(7.5)


def test_in_flight_counts_only_the_stage_they_name():
    """Two stages under one rank: copies of stage S do not count T's discards."""
    stats = [mod("R"), mod("R.S", size_mib=100, ms=10, fw_post=10, bw_pre=40), mod("R.S.fc", leaf=True),
             mod("R.T", size_mib=100, ms=1, fw_post=50, bw_pre=80), mod("R.T.fc", leaf=True)]
    info = make_info(stats, [MemoryPoint(op_index=45, phase="bw", activation_bytes=500 * MiB,
                                         in_flight=(("R.S", 2),))])
    # S's window [10, 40) is closed at 45: only its 2 copies lower the point; T (cheaper) cannot
    assert predict_peak_bytes(info, {"R.T": 100 * MiB}) == 500 * MiB
    assert predict_peak_bytes(info, {"R.S": 50 * MiB}) == 400 * MiB
    res = SACMilp(info).solve(400 * MiB)
    assert res.checkpointed == ("R.S",) and res.discarded_bytes["R.S"] == 50 * MiB


def test_recompute_inside_an_open_window_adds_its_growth_to_the_discard():
    """A split backward's input half recomputes b at t=28 while b's window [20, 30) is still open
    (it ends at the weight half): memory there = the unplanned 300 less the discard plus the
    recompute's growth (110 MiB for the whole 100, linear between): 300 - 100 + 110 = 310 with all
    of b discarded, 305 with half. t=25 (400 unplanned, no recompute) needs 50 MiB discarded for a
    350 budget; t=28 then holds 305: b at 0.5, 10 ms."""
    import dataclasses

    b = dataclasses.replace(mod("S.b", size_mib=100, ms=20, fw_post=20, bw_pre=30),
                            recompute_growth_bytes=(0, 110 * MiB))
    info = make_info([mod("S"), b, mod("S.b.fc", leaf=True)],
                     [MemoryPoint(op_index=25, phase="bw", activation_bytes=400 * MiB),
                      MemoryPoint(op_index=28, phase="bw", activation_bytes=300 * MiB, recompute_in_window="S.b")])
    assert predict_peak_bytes(info, {"S.b": 100 * MiB}) == 310 * MiB
    res = SACMilp(info).solve(350 * MiB)
    assert res.discarded_bytes == {"S.b": 50 * MiB} and res.recompute_ms == pytest.approx(10.0)
    assert predict_peak_bytes(info, res.discarded_bytes) == 350 * MiB
