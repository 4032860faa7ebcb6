"""planner/planning/op_steps.py: a module-level plan moved onto the steps its op plans take."""

from __future__ import annotations

from planner.planning.op_steps import settle
from solver import SACMilp
from tests.solver.builders import MiB, make_info, mod, pt


def _info():
    """M.a: two 100 MiB steps at 10 ms each; M.b: two 50 MiB steps at 4 ms each (cheaper per
    byte). One point, both in their windows: 1000 MiB unplanned."""
    stats = [mod("M"), mod("M.a", size_mib=200, curve=((0, 0.0), (100, 10.0), (200, 20.0)), fw_post=10, bw_pre=60),
             mod("M.b", size_mib=100, curve=((0, 0.0), (50, 4.0), (100, 8.0)), fw_post=20, bw_pre=50)]
    return make_info(stats, [pt(30, 900, param_mib=100)])


def _op_ms(info):
    """What an op plan of ``d`` bytes recomputes: the whole step at or above ``d``."""
    def ms(f, d):
        curve = info.stats(f).tradeoff
        return next(m for b, m in zip(curve.discarded_bytes, curve.recompute_ms) if b >= d)
    return ms


def test_a_partial_step_is_traded_for_a_whole_one_elsewhere():
    """At 850 MiB the MILP takes all of M.b and half a step of M.a (13 ms on the envelopes); the
    op plans discard M.a's whole step, 18 ms and 50 MiB more than needed. Settled: one step of
    each, 14 ms, at the budget exactly."""
    info = _info()
    milp = SACMilp(info)
    res = milp.solve(850 * MiB)
    assert res.discarded_bytes == {"M.a": 50 * MiB, "M.b": 100 * MiB}
    ms = _op_ms(info)
    plan = settle(milp, res.discarded_bytes, 850 * MiB, ms)
    assert plan == {"M.a": 100 * MiB, "M.b": 50 * MiB}
    assert sum(ms(f, d) for f, d in plan.items()) == 14.0 and milp.memory.peak(plan) == 850 * MiB


def test_a_plan_on_whole_steps_already_is_kept():
    info = _info()
    milp = SACMilp(info)
    res = milp.solve(900 * MiB)  # all of M.b: a whole step
    assert settle(milp, res.discarded_bytes, 900 * MiB, _op_ms(info)) == dict(res.discarded_bytes)
