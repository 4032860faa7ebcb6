"""planner/analysis/calibration.py: the checkpoint host-cost fit, worked by hand, and a real
calibration of this CPU used as a spec."""

from __future__ import annotations

import pytest
import torch

from planner.analysis.calibration import calibrate_device, fit_checkpoint_costs


def test_fit_recovers_the_costs_the_model_was_built_from():
    """Per block of n ops: full(n) = call + n (kernel + rc), selective(n) = call + (n - 1)
    (kernel + rc) + 2 n policy. With call 1, rc 0.05, kernel 0.01, policy 0.1 ms at n = 9 and
    36, the fit gives them back; a negative estimate (noise) is clamped to 0."""
    call, rc, kernel, policy = 1.0, 0.05, 0.01, 0.1

    def full(n):
        return call + n * (kernel + rc)

    sel36 = call + 35 * (kernel + rc) + 2 * 36 * policy
    fit = fit_checkpoint_costs((9, 36), (full(9), full(36)), sel36, 36 * kernel)
    assert fit == pytest.approx((call, rc, policy))
    assert fit_checkpoint_costs((9, 36), (full(9), full(36)), full(36) - 5.0, 36 * kernel)[2] == 0.0


@pytest.mark.slow
def test_a_calibrated_spec_plans_and_reports_what_it_measured(one_intra_op_thread):
    """On this CPU: the spec is refitted and named so, its host costs filled (>= 0) from the
    planner's own checkpoints, and it is accepted wherever a device name is."""
    from planner.options import PlanOptions

    cal = calibrate_device("cpu", rounds=3)
    spec = cal.spec
    assert spec.name == "cpu-calibrated" and 0 < spec.compute_efficiency <= 1 and spec.kernel_launch_ms > 0
    assert cal.checkpoint is not None and cal.checkpoint.clock == "thread"
    assert (spec.checkpoint_call_ms, spec.checkpoint_submodule_ms, spec.recompute_op_ms, spec.selective_op_ms) == (
        cal.checkpoint.checkpoint_call_ms, cal.checkpoint.checkpoint_submodule_ms, cal.checkpoint.recompute_op_ms,
        cal.checkpoint.selective_op_ms)
    report = cal.report()
    assert spec.summary() in report and "mm 512x512x512" in report and "per call" in report and "per submodule" in report
    assert PlanOptions(device=spec).spec is spec
    assert torch.get_num_threads() == 1
