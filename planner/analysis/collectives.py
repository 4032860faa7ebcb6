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

Some collectives never reach a dispatch mode: DTensor's own handlers run below them, and
loss_parallel's log-softmax and NLL call ``funcol.all_reduce`` from Python there (each rank's
per-token maxima and sums, (tokens, 1) float32). While the mode is on, that Python function is
wrapped too, to the same effect: a TP rank measured 1,008 B (252 tokens x 4 B) over its
prediction on a random rank and step, as often as not.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
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


_PYTHON_LEVEL = ("all_reduce",)
"""``torch.distributed._functional_collectives`` functions wrapped while the mode is on (called
below the dispatch modes by DTensor's handlers: loss_parallel's)."""


class CallerHeldCollectives(TorchDispatchMode):
    """Each ``_c10d_functional`` collective runs synchronously on untracked copies of its tensor
    arguments; an in-place one writes its result back into its arguments, an out-of-place one
    returns tensors allocated through the modes below this one (the tracker's), filled from the
    collective's own outputs. ``wait_tensor`` on those finds no pending work and returns. The
    functions of ``_PYTHON_LEVEL`` do the same wherever they are called from."""

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        self._wrapped = {name: getattr(funcol, name) for name in _PYTHON_LEVEL}
        for name, fn in self._wrapped.items():
            setattr(funcol, name, _caller_held_call(fn))
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed._functional_collectives as funcol

        try:
            return super().__exit__(*exc)
        finally:
            for name, fn in self._wrapped.items():
                setattr(funcol, name, fn)

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


def _caller_held_call(fn: Callable) -> Callable:
    """``fn(tensor, ...)`` run to completion on an untracked copy of a plain ``tensor``; its
    result copied into a tensor allocated where the caller's modes are (none below DTensor's
    handlers: the caller holds it as it would hold the collective's own)."""
    import torch.distributed._functional_collectives as funcol

    @functools.wraps(fn)
    def run(tensor, *args, **kwargs):
        if type(tensor) is not torch.Tensor or any(
                isinstance(m, CallerHeldCollectives) for m in _get_current_dispatch_mode_stack()):
            return fn(tensor, *args, **kwargs)  # the mode sees its op (a call above DTensor's handlers)
        with _disable_current_modes():
            out = fn(tensor.clone(), *args, **kwargs)
            out = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else funcol.wait_tensor(out)
        held = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)
        with _disable_current_modes():
            held.copy_(out)
        return held

    return run
