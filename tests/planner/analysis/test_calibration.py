"""planner/analysis/calibration.py: the checkpoint host-cost fit, worked by hand, and a real
calibration of this CPU used as a spec."""

from __future__ import annotations

import pytest
import torch

from estimators.runtime.device import get_device_spec
from planner.analysis.calibration import calibrate_device, fit_checkpoint_costs


def test_fit_recovers_the_costs_the_model_was_built_from():
    """Per block of n ops: full(n) = call + n (kernel + rc), selective(n) = call + sel_call +
    (n - 1) (kernel + rc) + 2 n policy. With call 1, rc 0.05, kernel 0.01, policy 0.1, sel_call
    0.4 ms at n = 9 and 36, the fit gives them back; a negative estimate (noise) is clamped to 0.
    A per-call cost is not a per-op one: fitted from the long block alone it would have read as
    0.4 / 72 ms more per policy op, a sixth of what a 9-op module pays for it."""
    call, rc, kernel, policy, sel_call = 1.0, 0.05, 0.01, 0.1, 0.4

    def full(n):
        return call + n * (kernel + rc)

    def sel(n):
        return call + sel_call + (n - 1) * (kernel + rc) + 2 * n * policy

    fit = fit_checkpoint_costs((9, 36), (full(9), full(36)), (sel(9), sel(36)), 36 * kernel)
    assert fit == pytest.approx((call, rc, policy, sel_call))
    # Noise: selective no dearer than full, cheaper at length. The policy cost clamps to 0 and the
    # per-call one is what the two lengths say with it (not inflated by the negative estimate).
    cheap = fit_checkpoint_costs((9, 36), (full(9), full(36)), (full(9), full(36) - 0.1), 36 * kernel)
    assert cheap[2] == 0.0 and cheap[3] == pytest.approx((0.0 - 0.1) / 2 + (kernel + rc))


@pytest.mark.slow
def test_a_calibrated_spec_plans_and_reports_what_it_measured(one_intra_op_thread):
    """On this CPU: the spec is refitted and named so, its host costs filled (>= 0) from the
    planner's own checkpoints, and it is accepted wherever a device name is."""
    from planner.options import PlanOptions

    cal = calibrate_device("cpu", rounds=1)
    spec = cal.spec
    assert spec.name == "cpu-calibrated" and 0 < spec.compute_efficiency <= 1 and spec.kernel_launch_ms > 0
    assert cal.checkpoint is not None and cal.checkpoint.clock == "thread"
    assert (spec.checkpoint_call_ms, spec.checkpoint_submodule_ms, spec.recompute_op_ms, spec.selective_op_ms,
            spec.selective_call_ms) == (
        cal.checkpoint.checkpoint_call_ms, cal.checkpoint.checkpoint_submodule_ms, cal.checkpoint.recompute_op_ms,
        cal.checkpoint.selective_op_ms, cal.checkpoint.selective_call_ms)
    assert spec.recompute_op_warm_ms == cal.checkpoint.recompute_op_warm_ms <= spec.recompute_op_ms
    assert spec.host_cache_bytes > 0 and "warm" in cal.report()
    report = cal.report()
    assert spec.summary() in report and "mm 512x512x512" in report and "per call" in report and "per submodule" in report
    assert "per selective call" in report
    assert PlanOptions(device=spec).spec is spec
    assert torch.get_num_threads() == 1


def test_every_op_of_a_block_runs_cold_in_the_forward_and_in_the_recompute(one_intra_op_thread):
    """A step's kernels evict the host's caches between two ops of a module, so the calibration
    evicts before every dispatching call of a block: once per call in the unplanned forward, and
    again in a checkpoint's recompute (the same Python runs twice)."""
    import time

    from planner.analysis import calibration as cal
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    per_forward = 2 + 7  # two nested modules, seven calls a step of the chain
    x = torch.rand(4, 8, requires_grad=True)
    for full, passes in ((False, 1), (True, 2)):
        ev = cal._Evictor(time.thread_time_ns)
        m = cal._Blocks(1, 2, ev)
        m.evict = False  # the copies between blocks are another thing
        if full:
            apply_module_plans(m, [ModulePlan(fqn=f"_Blocks.blocks.{i}", discard_ratio=1.0, full=True)
                                   for i in range(cal._BLOCKS)])
        m(x).sum().backward()
        assert ev.calls == cal._BLOCKS * per_forward * passes
        assert ev.spent > 0


def test_the_evictions_own_time_is_left_out(one_intra_op_thread, monkeypatch):
    """Each eviction here takes 2 ms of the thread's time; a full checkpoint's recompute runs 7
    of them a block (14 ms), which the per-block cost must not include."""
    import time

    from planner.analysis import calibration as cal

    class Slow(cal._Evictor):
        def _evict(self):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.002:
                pass

    monkeypatch.setattr(cal, "_Evictor", Slow)
    chain = cal._ChainRounds(1, time.thread_time_ns, full_only=True)
    chain.run(record=False)  # warm-up
    chain.run(record=True)
    assert 0 < chain.costs().full_ms < 7.0


def test_a_noisy_warm_chain_gives_a_warm_cost_of_zero_not_a_spec_that_refuses_it():
    """On a busy machine the warm chains' fit can come out below 0 (the long chain's kernels
    timed slower than its whole checkpoint's per-op cost): the warm cost is clamped like the
    others, and the spec accepts it (it refused a negative one and the calibration crashed)."""
    from planner.analysis import calibration as cal

    def chain(k, submodules=0, *, full_only=False, cold=True):
        ops = 15 if k == cal._CHAINS[0] else 90
        if cold:
            return cal._ChainCosts(ops, full_ms=1.0 + ops * 0.05, selective_ms=1.2 + ops * 0.06, kernels_ms=ops * 0.02)
        return cal._ChainCosts(ops, full_ms=ops * 0.02, selective_ms=0.0, kernels_ms=ops * 0.03)  # warm: negative

    c = cal._fit_chain_costs([chain(**config) for config in cal._CONFIGS], "thread")
    assert c.recompute_op_warm_ms == 0.0 and c.recompute_op_ms > 0
    get_device_spec("cpu").replace(recompute_op_ms=c.recompute_op_ms, recompute_op_warm_ms=c.recompute_op_warm_ms)


def test_the_chains_are_timed_in_interleaved_rounds(monkeypatch):
    """Each ``run()`` times one round of every chain, one after another: timed one chain after
    another, the machine's drift between them went into the fit. Costs before any round are
    refused."""
    from planner.analysis import calibration as cal

    order: list[int] = []

    class Fake:
        def __init__(self, k, now, submodules=0, *, full_only=False, cold=True):
            self.i, Fake.made = Fake.made, Fake.made + 1
            self.config = dict(k=k, submodules=submodules, full_only=full_only, cold=cold)

        def run(self, record):
            if record:
                order.append(self.i)

        def costs(self):
            ops = 15 if self.config["k"] == cal._CHAINS[0] else 90
            return cal._ChainCosts(ops, full_ms=1.0 + ops * 0.05, selective_ms=1.2 + ops * 0.06, kernels_ms=ops * 0.02)

    Fake.made = 0
    monkeypatch.setattr(cal, "_ChainRounds", Fake)
    timed = cal.CheckpointCostRounds()
    with pytest.raises(ValueError, match="before any run"):
        timed.costs()
    timed.run()
    timed.run()
    assert order == [0, 1, 2, 3, 4] * 2 and timed.rounds == 2
    costs = timed.costs()
    assert costs.checkpoint_call_ms == pytest.approx(1.0) and costs.recompute_op_ms == pytest.approx(0.03)


def test_scaled_costs_multiply_the_plain_checkpoints_terms_and_the_policys_apart():
    from planner.analysis.calibration import CheckpointHostCosts

    c = CheckpointHostCosts(checkpoint_call_ms=1.0, checkpoint_submodule_ms=0.02, recompute_op_ms=0.04,
                            selective_op_ms=0.01, selective_call_ms=0.3, recompute_op_warm_ms=0.01, clock="thread")
    s = c.scaled(1.5, 2.0)
    assert (s.checkpoint_call_ms, s.checkpoint_submodule_ms, s.recompute_op_ms, s.recompute_op_warm_ms) == \
        pytest.approx((1.5, 0.03, 0.06, 0.015))
    assert (s.selective_op_ms, s.selective_call_ms) == pytest.approx((0.02, 0.6)) and s.clock == "thread"
    assert c.scaled(1.0, 1.0) == c
