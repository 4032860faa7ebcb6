"""torch.distributed._tools' own estimation pipeline, run the way its SAC ILP test runs it.

The reference is ``test/distributed/_tools/test_sac_ilp.py`` (``_collect_module_info_with_fake_tensor_mode``):
under one ``FakeTensorMode``

1. ``MemTracker``: ``track_external(model, optimizer)``, then two training steps (the first only
   creates the optimizer state; ``reset_mod_stats()`` after it), snapshot of the second;
2. ``RuntimeEstimator``: one warm-up step outside the estimator, one step inside it
   (``"operator-level-cost-model"``, the roofline);
3. ``SACEstimator``: forward (+ loss) inside the estimator (``"operator-level-cost-model"``),
   backward outside it;
4. ``ilp_utils.aggregate_stats(...)``, which also fits the piecewise-linear trade-off curves (pwlf).

The test builds the model on ``cuda``; here it is built on ``cpu`` under ``FakeTensorMode`` because
fake CUDA tensors cannot be made by a CPU-only torch build. ``MemTracker`` keys its snapshots by
device and needs no CUDA memory statistics: it works unchanged on fake CPU tensors (its CUDA-only
512-byte block rounding is then not applied, which does not change the amount of work it does).

What is patched (only while :func:`run_torch_pipeline` runs, restored afterwards)
---------------------------------------------------------------------------------
The roofline refuses to run without CUDA and asks Triton for the device's peak numbers, so:

* ``torch.utils._runtime_estimation.get_device_tflops(dtype)`` -> the DeviceSpec's peak FLOP/s for
  ``dtype`` in TFLOP/s (``DeviceSpec.flops_per_s(dtype) / 1e12``). The module imported the name from
  ``torch._inductor.utils``; the patch replaces the name it looks up.
* ``torch.utils._runtime_estimation.get_gpu_dram_gbps()`` -> ``DeviceSpec.memory_bandwidth_bytes_per_s / 1e9``.
* ``RuntimeEstimator._roofline_estimate`` (also what ``SACEstimator`` calls) -> a wrapper that runs
  the original unchanged with ``torch.cuda.is_available`` reporting True for the duration of the
  call (its first statement is ``if not torch.cuda.is_available(): raise``), and counts the calls.
  ``RuntimeEstimator``/``SACEstimator`` look the method up when entered, so the wrapper is seen.

Nothing else is changed: the cost model itself (``get_compute_time``/``get_transfer_time``, its 75 %
derating of peak FLOP/s and its MAC = FLOP / 2 convention) is torch's own.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from estimators.runtime.device import DeviceSpec

if TYPE_CHECKING:  # imported lazily at run time: torch.distributed._tools is heavy
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

__all__ = ["TorchPipelineResult", "patched_roofline", "run_torch_pipeline"]

ESTIMATE_MODE = "operator-level-cost-model"

# Builds (model, inputs) on the current device; called inside the pipeline's FakeTensorMode.
ModelBuilder = Callable[[], tuple[nn.Module, tuple]]
# loss_fn(output, inputs) -> scalar, the examples' contract.
LossFn = Callable[[Tensor, tuple], Tensor]


@dataclass(frozen=True, kw_only=True)
class TorchPipelineResult:
    """Wall times of one pipeline run, in seconds, and what it produced."""

    build_s: float
    """Model, inputs and optimizer construction under FakeTensorMode (not part of ``total_s``)."""
    mem_tracker_s: float
    runtime_estimator_s: float
    sac_estimator_s: float
    aggregate_s: float
    """``ilp_utils.aggregate_stats``, including its pwlf curve fits."""
    roofline_calls: int
    """Ops costed by the roofline (RuntimeEstimator step + SACEstimator forward)."""
    n_mod_stats: int
    """Modules in the resulting ModuleInfo."""
    gc_s: float = 0.0
    """Seconds the cyclic garbage collector ran within ``total_s``'s span (0 without a clock)."""
    cpu_s: float = 0.0
    """CPU time of this process over the pipeline proper (``total_s``'s span); on a shared machine
    less sensitive to the other processes than wall time."""
    total_runtime_ms: float
    """RuntimeEstimator's estimate of one step, to sanity-check the patched numbers."""

    @property
    def total_s(self) -> float:
        """The pipeline proper: memory tracking + runtime + SAC estimation + aggregation."""
        return self.mem_tracker_s + self.runtime_estimator_s + self.sac_estimator_s + self.aggregate_s


@contextlib.contextmanager
def patched_roofline(spec: DeviceSpec) -> Iterator[list[int]]:
    """Let torch's roofline run on a CPU-only build with ``spec``'s numbers; yields a call counter."""
    import torch.utils._runtime_estimation as rt_est
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    calls = [0]
    original = RuntimeEstimator.__dict__["_roofline_estimate"]  # the classmethod object itself
    original_fn = original.__func__

    def _cuda_available() -> bool:
        return True

    def roofline_without_cuda(cls, func, args, kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        saved = torch.cuda.is_available
        torch.cuda.is_available = _cuda_available
        try:
            return original_fn(cls, func, args, kwargs)
        finally:
            torch.cuda.is_available = saved

    saved_tflops, saved_gbps = rt_est.get_device_tflops, rt_est.get_gpu_dram_gbps
    rt_est.get_device_tflops = lambda dtype: spec.flops_per_s(dtype) / 1e12
    rt_est.get_gpu_dram_gbps = lambda: spec.memory_bandwidth_bytes_per_s / 1e9
    RuntimeEstimator._roofline_estimate = classmethod(roofline_without_cuda)
    try:
        yield calls
    finally:
        RuntimeEstimator._roofline_estimate = original
        rt_est.get_device_tflops, rt_est.get_gpu_dram_gbps = saved_tflops, saved_gbps


def _train_step(model: nn.Module, inputs: tuple, loss_fn: LossFn, optimizer: torch.optim.Optimizer) -> None:
    loss_fn(model(*inputs), inputs).backward()
    optimizer.step()
    optimizer.zero_grad()


def _run_mem_tracker(
    model: nn.Module, inputs: tuple, loss_fn: LossFn, optimizer: torch.optim.Optimizer
) -> MemTracker:
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    mem_tracker = MemTracker()
    mem_tracker.track_external(model, optimizer)
    last_snapshot = None
    with mem_tracker as mt:
        for iter_idx in range(2):  # the first step only creates the optimizer state
            loss_fn(model(*inputs), inputs).backward()
            if iter_idx == 1:
                last_snapshot = mt.get_tracker_snapshot("current")
            optimizer.step()
            optimizer.zero_grad()
            if iter_idx == 0:
                mt.reset_mod_stats()
    # As the test does: ModTracker fires no post-backward hook for modules whose inputs need no grad.
    for mod_stats in mem_tracker.memory_tracking.values():
        if _ModState.POST_BW not in mod_stats.snapshots:
            mod_stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last_snapshot))
    return mem_tracker


def _run_runtime_estimator(
    model: nn.Module, inputs: tuple, loss_fn: LossFn, optimizer: torch.optim.Optimizer
) -> RuntimeEstimator:
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    _train_step(model, inputs, loss_fn, optimizer)  # warm-up, outside the estimator (as the test)
    runtime_estimator = RuntimeEstimator()
    with runtime_estimator(estimate_mode_type=ESTIMATE_MODE):
        _train_step(model, inputs, loss_fn, optimizer)
    return runtime_estimator


def _run_sac_estimator(model: nn.Module, inputs: tuple, loss_fn: LossFn) -> SACEstimator:
    from torch.distributed._tools.sac_estimator import SACEstimator

    sac_estimator = SACEstimator()
    with sac_estimator(estimate_mode_type=ESTIMATE_MODE):
        loss = loss_fn(model(*inputs), inputs)
    loss.backward()
    return sac_estimator


def run_torch_pipeline(
    build: ModelBuilder, loss_fn: LossFn, spec: DeviceSpec, gc_clock: Callable[[], float] | None = None,
) -> TorchPipelineResult:
    """Run torch.distributed._tools' pipeline on the model ``build()`` makes; time each stage.

    ``build`` is called under the pipeline's ``FakeTensorMode`` with ``cpu`` as default device.
    The optimizer is Adam(lr=1e-2, foreach=True), as in the test. A full ``gc.collect()`` runs
    between the build and the timed part (as ``benchmarks/estimate_speed.py`` does before our
    side's timed call); ``gc_clock`` (seconds the collector has run so far), where given, is read
    over the timed part (``gc_s``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats

    # RuntimeEstimator prints its total on exit; keep the benchmark's table readable.
    quiet = contextlib.redirect_stdout(io.StringIO())
    with patched_roofline(spec) as calls, FakeTensorMode(), quiet:
        t0 = time.perf_counter()
        with torch.device("cpu"):
            model, inputs = build()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        gc.collect()
        g1 = gc_clock() if gc_clock is not None else 0.0
        t1, c1 = time.perf_counter(), time.process_time()
        mem_tracker = _run_mem_tracker(model, inputs, loss_fn, optimizer)
        t2 = time.perf_counter()
        runtime_estimator = _run_runtime_estimator(model, inputs, loss_fn, optimizer)
        t3 = time.perf_counter()
        sac_estimator = _run_sac_estimator(model, inputs, loss_fn)
        t4 = time.perf_counter()
        module_info = aggregate_stats(
            model, mem_tracker, runtime_estimator, sac_estimator, torch.device("cpu")
        )
        t5, c5 = time.perf_counter(), time.process_time()
        g5 = gc_clock() if gc_clock is not None else 0.0
    return TorchPipelineResult(
        cpu_s=c5 - c1,
        gc_s=g5 - g1,
        build_s=t1 - t0,
        mem_tracker_s=t2 - t1,
        runtime_estimator_s=t3 - t2,
        sac_estimator_s=t4 - t3,
        aggregate_s=t5 - t4,
        roofline_calls=calls[0],
        n_mod_stats=len(module_info["mod_stats"]),
        total_runtime_ms=runtime_estimator.total_runtime,
    )
