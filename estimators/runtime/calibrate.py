"""Fit a DeviceSpec's roofline figures to kernels timed on the device at hand.

    from estimators.runtime.calibrate import fit_device_spec
    fit = fit_device_spec("cpu")          # a few matmuls, copies and a tiny op, timed here
    print(fit.spec.summary())             # the spec, its fitted efficiencies and launch time
    for p in fit.points: print(p)         # each kernel: measured beside the fitted roofline

What is fitted, from kernels timed as ``RuntimeKind.BENCHMARK`` times them (the same
``BenchmarkRuntime``, so the same clock):

* ``kernel_launch_ms``: the time of an op on one-element tensors (dispatch and launch);
* ``compute_efficiency``: the median over a few matmul shapes of achieved FLOP/s over the
  spec's peak, each kernel's time less the launch time;
* ``bandwidth_efficiency``: the same for memory-bound kernels (a copy and an add of 16 MiB
  tensors on a CPU, 1 GiB on a GPU), bytes read and written over the spec's bandwidth.

An efficiency above 1 means the spec's peak is below what this device does (a faster CPU than
the ``cpu`` spec's): the peak is raised to the achieved figure and the efficiency set to 1.
Peaks of other dtypes are scaled with float32's (matmuls are timed in float32). The spec's
memory rules (allocator block, capacity) and links are kept. The checkpoint's host costs
(``DeviceSpec.checkpoint_call_ms`` etc.) are the planner's to measure:
``planner.analysis.calibration.calibrate_device`` does both.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from estimators.runtime.device import DeviceSpec, get_device_spec
from estimators.runtime.kernel_bench import BenchmarkRuntime
from estimators.runtime.roofline import RooflineRuntime

__all__ = ["CalibrationPoint", "DeviceFit", "fit_device_spec"]

aten = torch.ops.aten

_MATMULS = {"cpu": ((512, 512, 512), (1024, 256, 1024), (256, 1024, 256)),
            "cuda": ((4096, 4096, 4096), (8192, 2048, 8192), (2048, 8192, 2048))}
"""(m, k, n) of the timed matmuls: large enough to be compute-bound on the device."""
_STREAM_MIB = {"cpu": 16, "cuda": 1024}
"""Size of each memory-bound kernel's tensors: with its output, past a CPU's last-level cache
(a GPU's many times over); below glibc's largest mmap threshold (32 MiB), so a CPU run reuses its
heap instead of faulting fresh pages in on every call."""


@dataclass(frozen=True, kw_only=True)
class CalibrationPoint:
    """One timed kernel: what it is, its measured time and the fitted spec's roofline time."""

    kernel: str
    measured_ms: float
    fitted_ms: float

    def __str__(self) -> str:
        err = (self.fitted_ms - self.measured_ms) / self.measured_ms if self.measured_ms else 0.0
        return f"{self.kernel:28} measured {self.measured_ms:9.4f} ms  fitted {self.fitted_ms:9.4f} ms  ({err:+.0%})"


@dataclass(frozen=True, kw_only=True)
class DeviceFit:
    """A spec fitted to this device's kernels, and the kernels it was fitted to."""

    spec: DeviceSpec
    """``base`` with the fitted launch time, efficiencies (and peaks, where exceeded); named
    ``"<base>-calibrated"``."""
    base: DeviceSpec
    points: tuple[CalibrationPoint, ...]
    clock: str
    """How the kernels were timed (``BenchmarkRuntime.clock``: "thread", "wall" or "cuda")."""


def _ratio_fit(achieved: Sequence[float], peak: float) -> tuple[float, float]:
    """(efficiency, peak) with efficiency * peak the median achieved figure; peak raised where
    the device beats it."""
    eff = statistics.median(achieved) / peak
    return (1.0, peak * eff) if eff > 1 else (eff, peak)


def fit_device_spec(base: DeviceSpec | str = "cpu", *, device: str | torch.device | None = None,
                    timed_runs: int = 5) -> DeviceFit:
    """Time a tiny op, a few float32 matmuls and memory-bound kernels on ``device`` (default: the
    spec's kind), and return ``base`` refitted to them (see the module docstring). Takes about a
    second on a CPU core."""
    base = get_device_spec(base)
    dev = torch.device(device if device is not None else ("cuda" if base.is_cuda else "cpu"))
    bench = BenchmarkRuntime(device=dev, timed_runs=timed_runs, warmup_runs=2, max_ms_per_op=1e9,
                             stream_floor=False)
    kind = "cuda" if dev.type == "cuda" else "cpu"

    def timed(func, *args) -> float:
        with torch.device("meta"):
            out = func(*args)
        return bench.op_runtime_ms(func, args, {}, out)

    meta = torch.device("meta")
    one = torch.empty(1, device=meta)
    launch_ms = timed(aten.add.Tensor, one, one)
    mms = []
    for m, k, n in _MATMULS[kind]:
        a, b = torch.empty(m, k, device=meta), torch.empty(k, n, device=meta)
        mms.append((f"mm {m}x{k}x{n}", 2 * m * k * n, timed(aten.mm.default, a, b)))
    numel = _STREAM_MIB[kind] * 2**20 // 4
    x, y = torch.empty(numel, device=meta), torch.empty(numel, device=meta)
    streams = [(f"clone {_STREAM_MIB[kind]} MiB", 2 * 4 * numel, timed(aten.clone.default, x)),
               (f"add {_STREAM_MIB[kind]} MiB", 3 * 4 * numel, timed(aten.add.Tensor, x, y))]

    peak32 = base.flops_per_s(torch.float32)
    c_eff, new_peak32 = _ratio_fit([f / max(ms - launch_ms, 1e-9) * 1e3 for _, f, ms in mms], peak32)
    b_eff, bandwidth = _ratio_fit([nb / max(ms - launch_ms, 1e-9) * 1e3 for _, nb, ms in streams],
                                  base.memory_bandwidth_bytes_per_s)
    scale = new_peak32 / peak32
    spec = base.replace(
        name=f"{base.name}-calibrated",
        peak_flops_per_s={d: p * scale for d, p in base.peak_flops_per_s.items()},
        memory_bandwidth_bytes_per_s=bandwidth,
        compute_efficiency=c_eff,
        bandwidth_efficiency=b_eff,
        kernel_launch_ms=launch_ms,
    )
    roof = RooflineRuntime(spec)
    points = [CalibrationPoint(kernel="add 1 element", measured_ms=launch_ms,
                               fitted_ms=roof.price(aten.add.Tensor, (one, one), {}, one))]
    for (name, _, ms), (m, k, n) in zip(mms, _MATMULS[kind]):
        a, b = torch.empty(m, k, device=meta), torch.empty(k, n, device=meta)
        points.append(CalibrationPoint(kernel=name, measured_ms=ms,
                                       fitted_ms=roof.price(aten.mm.default, (a, b), {}, torch.empty(m, n, device=meta))))
    points.append(CalibrationPoint(kernel=streams[0][0], measured_ms=streams[0][2],
                                   fitted_ms=roof.price(aten.clone.default, (x,), {}, x)))
    points.append(CalibrationPoint(kernel=streams[1][0], measured_ms=streams[1][2],
                                   fitted_ms=roof.price(aten.add.Tensor, (x, y), {}, x)))
    return DeviceFit(spec=spec, base=base, points=tuple(points), clock=bench.clock)
