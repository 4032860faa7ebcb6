"""estimators/runtime/calibrate.py: a spec refitted to kernels timed on this CPU."""

from __future__ import annotations

import pytest

from estimators.runtime.calibrate import fit_device_spec
from estimators.runtime.device import get_device_spec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]


def test_the_fit_prices_the_kernels_it_was_fitted_to():
    """The launch time is the tiny op's; efficiencies in (0, 1] put the median matmul and the
    median memory-bound kernel on the roofline; the spec keeps the base's memory rules."""
    fit = fit_device_spec("cpu", timed_runs=3)
    spec, base = fit.spec, get_device_spec("cpu")
    assert spec.name == "cpu-calibrated" and fit.clock == "thread"
    assert 0 < spec.compute_efficiency <= 1 and 0 < spec.bandwidth_efficiency <= 1
    assert (spec.memory_bytes, spec.allocator_block_bytes) == (base.memory_bytes, base.allocator_block_bytes)
    launch = fit.points[0]
    assert launch.measured_ms == spec.kernel_launch_ms and launch.fitted_ms == pytest.approx(launch.measured_ms, rel=1e-2)
    mms = [p for p in fit.points if p.kernel.startswith("mm ")]
    assert len(mms) == 3 and any(p.fitted_ms == pytest.approx(p.measured_ms) for p in mms)


def test_a_device_faster_than_its_spec_raises_the_peaks():
    """A base spec far below this CPU (1 GFLOP/s, 0.1 GB/s): efficiency 1, the peaks (every
    dtype's in proportion) and the bandwidth raised to what was achieved."""
    slow = get_device_spec("cpu").replace(name="slow", peak_flops_per_s={
        k: v / 200 for k, v in get_device_spec("cpu").peak_flops_per_s.items()}, memory_bandwidth_bytes_per_s=1e8)
    spec = fit_device_spec(slow, timed_runs=2).spec
    assert spec.compute_efficiency == spec.bandwidth_efficiency == 1.0
    assert spec.memory_bandwidth_bytes_per_s > 1e8
    import torch

    ratio = spec.flops_per_s(torch.float32) / slow.flops_per_s(torch.float32)
    assert ratio > 1 and spec.flops_per_s(torch.bfloat16) == pytest.approx(ratio * slow.flops_per_s(torch.bfloat16))
