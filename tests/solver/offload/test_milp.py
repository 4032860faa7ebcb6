"""solver/offload/milp.py on the hand-built two-block step of tests/solver/offload/builders.py
(its docstring works the best plans out by hand)."""

from __future__ import annotations

import pytest

from estimators.contract.module_info import ModStats, ModuleInfo, SACOp, TradeoffCurve
from estimators.contract.timeline import step_layout
from solver import InfeasibleBudgetError
from solver.offload.milp import OffloadMilp
from tests.solver.offload.builders import MiB, info, milp


def test_hidden_offload_plus_recompute_beats_recompute_only():
    """Budget 250 MiB: free 50 MiB at op 25. Recompute alone: 50 MiB at 0.1 ms/MiB = 5 ms.
    Three-way: b0 offloads o, b1 recomputes 50 - o (0.1 (50 - o) ms, which also widens b0's
    copy window): hidden while 10 + 2 o <= 40 + 0.1 (50 - o), so o = 35 / 2.1 = 16.667 MiB and
    the step is 60 + 3.333 ms. (b0 cannot do both: a module that offloads recomputes nothing.)"""
    three = milp().solve(250 * MiB)
    o = 35 / 2.1
    assert three.offloaded_bytes["M.b.0"] == pytest.approx(o * MiB, abs=4096)
    assert three.discarded_bytes == {"M.b.1": pytest.approx((50 - o) * MiB, abs=4096)}
    assert three.timeline.exposed_copy_ms == pytest.approx(0.0, abs=1e-3)
    assert three.step_ms == pytest.approx(60 + 0.1 * (50 - o), abs=1e-3)
    assert three.host_peak_bytes == sum(three.offloaded_bytes.values())
    assert three.predicted_peak_bytes <= 250 * MiB
    assert three.milp_step_ms == pytest.approx(three.step_ms, abs=1e-3)
    rec = milp(offload=False).solve(250 * MiB)
    assert rec.offloaded_bytes == {}
    assert rec.step_ms == pytest.approx(65.0, abs=1e-3)


def test_host_budget_caps_the_offload():
    """10 MiB of host memory: b0 offloads 10 MiB (hidden: 30 <= 44), b1 recomputes 40 MiB (4 ms)."""
    res = milp(host_budget_bytes=10 * MiB).solve(250 * MiB)
    assert res.host_peak_bytes <= 10 * MiB
    assert res.offloaded_bytes["M.b.0"] == pytest.approx(10 * MiB, abs=4096)
    assert res.step_ms == pytest.approx(64.0, abs=1e-3)


def test_exposed_copy_is_paid_when_it_is_cheapest():
    """Recompute made expensive (10 ms per MiB): b1 recomputes x MiB, b0 offloads 50 - x. The
    H2D ends at 10 + 2 (50 - x), bw:b0 is ready at 40 + 10 x: step = 60 + 10 x + max(0, 70 - 12 x),
    least at x = 70 / 12 (the recompute runs while the compute stream would wait for the copy
    anyway): 118.333 ms, nothing exposed. Recompute alone: 500 ms; offload alone: 130 ms."""
    i = info()
    slow = tuple(s if s.fqn == "M" else ModStats(**{**s.__dict__, "tradeoff": TradeoffCurve(
        discarded_bytes=(0, 100 * MiB), recompute_ms=(0.0, 1000.0))}) for s in i.mod_stats)
    i = ModuleInfo(**{**i.__dict__, "mod_stats": slow})
    res = milp(i).solve(250 * MiB)
    x = 70 / 12
    assert res.discarded_bytes == {"M.b.1": pytest.approx(x * MiB, abs=4096)}
    assert res.offloaded_bytes["M.b.0"] == pytest.approx((50 - x) * MiB, abs=4096)
    assert res.timeline.exposed_copy_ms == pytest.approx(0.0, abs=1e-2)
    assert res.step_ms == pytest.approx(60 + 10 * x, abs=1e-2)
    host_only = milp(i, host_budget_bytes=50 * MiB)
    assert host_only.solve(250 * MiB).step_ms == pytest.approx(60 + 10 * x, abs=1e-2)


def test_the_last_block_in_forward_order_keeps_its_activations():
    m = milp(info(small_op_bytes=1000))
    assert m.offload_blocks == ("M.b.0",)  # the last block in forward order keeps its own


def _small_ops_info(n_ops: int):
    """b0 saves n_ops outputs of 1 MiB each (100 MiB in all), b1 as before."""
    i = info()
    ops = tuple(SACOp(func="aten.mm.default", occurrence=k, runtime_ms=10.0 / n_ops,
                      memory_bytes=100 * MiB // n_ops, is_saved=True) for k in range(n_ops))
    stats = tuple(ModStats(**{**s.__dict__, "ops": ops}) if s.fqn == "M.b.0" else s for s in i.mod_stats)
    return ModuleInfo(**{**i.__dict__, "mod_stats": stats})


@pytest.mark.parametrize("latency_ms", [0.0, 1.0])
def test_copy_latency_prices_many_small_copies(latency_ms):
    """b0's 100 MiB in 100 copies of 1 MiB, each with latency L: one direction takes (1 + L) ms
    per MiB. As in the first test, hidden while 10 + 2 (1 + L) o <= 40 + 0.1 (50 - o):
    o = 35 / (2.1 + 2 L) MiB -- 16.667 MiB with no latency, 8.537 MiB at L = 1 ms; b1 recomputes
    the rest, and the step is 60 + 0.1 (50 - o). (The MILP's o is on the envelope; the copy
    time is exact at whole ops.)"""
    i = _small_ops_info(100)
    res = milp(i, copy_latency_s=latency_ms / 1e3).solve(250 * MiB)
    o = 35 / (2.1 + 2 * latency_ms)
    assert res.offloaded_bytes["M.b.0"] == pytest.approx(o * MiB, abs=4096)
    assert res.milp_step_ms == pytest.approx(60 + 0.1 * (50 - o), abs=1e-3)
    assert res.predicted_peak_bytes <= 250 * MiB


def test_budgets_below_the_floor_and_a_missing_host_link_are_refused():
    i = info()
    with pytest.raises(InfeasibleBudgetError):
        milp().solve(50 * MiB)
    with pytest.raises(ValueError, match="host link"):
        OffloadMilp(i, step_layout(i, ["M.b.0", "M.b.1"]), copy_bytes_per_s=0.0)


def test_an_overshooting_plan_is_repaired_with_its_binaries_fixed(monkeypatch):
    """Where the exact peak of the backend's plan is above the budget (on real graphs: recompute
    growth between curve breakpoints above its envelope), the fractions are re-solved for a
    tighter target with the binaries kept. Here the exact model is made to report 5 MiB more
    than the MILP's for the first plan: the repaired plan frees 5 MiB more (b1 recomputes
    50 - o + 5 MiB) and keeps b0 offloading."""
    m = milp()
    calls = []
    exact = OffloadMilp.peak_bytes

    def peak(self, disc, off):
        calls.append(1)
        return exact(self, disc, off) + (5 * MiB if len(calls) == 1 else 0)

    monkeypatch.setattr(OffloadMilp, "peak_bytes", peak)
    res = m.solve(250 * MiB)
    assert len(calls) >= 2 and res.status.value == "feasible"
    assert "M.b.0" in res.offloaded_bytes and "M.b.1" in res.discarded_bytes
    assert res.predicted_peak_bytes <= 250 * MiB - 5 * MiB
    monkeypatch.setattr(OffloadMilp, "peak_bytes", exact)
    # The binaries are free again: at 150 MiB b0 recomputes what it would have offloaded.
    again, fresh = m.solve(150 * MiB), milp().solve(150 * MiB)
    assert again.step_ms == pytest.approx(fresh.step_ms, rel=1e-9)
    assert again.discarded_bytes == fresh.discarded_bytes


@pytest.mark.multiproc
def test_the_first_highs_of_a_process_prints_nothing_on_stdout():
    # PuLP's own HiGHS instance printed HiGHS' banner on stdout: `--offload --json` output was
    # not JSON. A fresh process: the banner comes with the first instance only.
    import subprocess
    import sys

    code = ("from tests.solver.offload.builders import MiB, milp\n"
            "res = milp().solve(250 * MiB)\n"
            "print('ok', res.predicted_peak_bytes <= 250 * MiB)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ok True\n"
