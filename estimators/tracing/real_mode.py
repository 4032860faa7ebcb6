"""Real-mode tracing runs the user's own model: what it leaves behind is undone once the trace
is over (a plan ``prepare`` applied, the parameters, buffers, gradients and RNG state)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from estimators.tracing.thread_state import torch_rng_restored

__all__ = ["restored", "undo"]


def undo(applied: Any) -> None:
    """``prepare`` may return something with ``remove()`` (an applied plan): undo it on the
    real model once the trace is over, so real-mode planning leaves the model as it was."""
    remove = getattr(applied, "remove", None)
    if callable(remove):
        remove()


@contextlib.contextmanager
def restored(model: torch.nn.Module):
    """Real mode: parameters, buffers and gradients (the same objects, the same bits) and the RNG
    state as they were before, however the trace ends."""
    saved = []
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None:
                    saved.append((table, name, t, t.detach().clone()))
    grads = {id(p): (p, p.grad) for p in model.parameters()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch_rng_restored(devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for table, name, t, value in saved:
                    table[name] = t
                    t.copy_(value)
            for p, g in grads.values():
                p.grad = g


