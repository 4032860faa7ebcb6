"""Measure one real training step: the peak memory an independent tracker sees, and the loss.

On CUDA the peak is ``torch.cuda.max_memory_allocated``; on CPU it is torch's own MemTracker
(torch.distributed._tools), which follows every tensor's storage. Neither shares code with the
estimators, so a prediction checked against it is checked against an independent measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from estimators.step import run_step

__all__ = ["MeasuredStep", "measure_step"]


@dataclass(frozen=True)
class MeasuredStep:
    peak_bytes: int
    loss: float | None
    step_time_ms: float
    tracker: str
    """What measured the peak."""
    activation_bytes: int | None = None
    """At the peak: everything but parameters, buffers, gradients and optimizer state (CPU only)."""


def measure_step(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> MeasuredStep:
    """Run one training step (same convention as the estimators) and measure its peak."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss = run_step(model, inputs, loss_fn, optimizer)
        torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        return MeasuredStep(torch.cuda.max_memory_allocated(device), loss, dt * 1e3, "torch.cuda.max_memory_allocated")
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, *([optimizer] if optimizer is not None else []))
    t0 = time.perf_counter()
    with mt:
        loss = run_step(model, inputs, loss_fn, optimizer)
    dt = time.perf_counter() - t0
    snap = mt.get_tracker_snapshot("peak")[device]
    state = sum(v for k, v in snap.items() if getattr(k, "name", "") in ("PARAM", "BUFFER", "GRAD", "OPT"))
    peak = int(snap["Total"])
    return MeasuredStep(peak, loss, dt * 1e3, "torch.distributed._tools.MemTracker", peak - int(state))
