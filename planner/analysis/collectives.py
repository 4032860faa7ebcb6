"""Collectives measured as the caller's thread holds them.

A gloo collective is run by one of the process group's worker threads, which keeps the work (and
through it the collective's input and output tensors) until it loops round again: a moment
*after* ``wait()`` has returned to the caller. A tensor the caller drops right after the wait (an
all-gather's input, the gathered buffer a ``cat`` copied out of) then lives on for a
thread-scheduling-dependent while, and a MemTracker reading taken in that window counts it. The
estimators (and NCCL, whose allocator semantics they model) free those tensors when the
caller lets go of them.

``CallerHeldCollectives`` removes the race from a measurement: it runs each functional
collective (the ``_c10d_functional`` ops DTensor, tensor and sequence parallelism issue) to
completion on copies no tracker sees, and hands back outputs allocated where the tracker sees
them. Values are those of the collective itself, bit for bit; only which thread holds what
changes. Enter it inside the tracker, so the tracker sees the outputs' allocations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

__all__ = ["CallerHeldCollectives"]


_COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor",
    "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "broadcast_",
})
"""The ``_c10d_functional`` ops that run a collective on the group's worker thread. Not the others
of the namespace: ``wait_tensor``, ``_wrap_tensor_autograd`` (an alias of its input: a copy here
would be a second buffer the step never has), point-to-point sends and receives."""


class CallerHeldCollectives(TorchDispatchMode):
    """Each ``_c10d_functional`` collective runs synchronously on untracked copies of its tensor
    arguments; an in-place one writes its result back into its arguments, an out-of-place one
    returns tensors allocated through the modes below this one (the tracker's), filled from the
    collective's own outputs. ``wait_tensor`` on those finds no pending work and returns."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != "_c10d_functional" or func._opname not in _COLLECTIVES:
            return func(*args, **kwargs)
        originals: dict[int, torch.Tensor] = {}

        def untracked(t: torch.Tensor) -> torch.Tensor:
            c = t.clone()
            originals[id(c)] = t
            return c

        with _disable_current_modes():
            copy_args, copy_kwargs = tree_map_only(torch.Tensor, untracked, (args, kwargs))
            out = func(*copy_args, **copy_kwargs)
            out = tree_map_only(torch.Tensor, torch.ops._c10d_functional.wait_tensor, out)

        def caller_held(t: torch.Tensor) -> torch.Tensor:
            orig = originals.get(id(t))
            if orig is None:  # an output of its own: allocated where the tracker sees it
                orig = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
            with _disable_current_modes():
                orig.copy_(t)
            return orig

        return tree_map_only(torch.Tensor, caller_held, out)
