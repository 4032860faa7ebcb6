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

``torch.distributed``'s own collectives (the ``c10d`` ops, which return a ``Work``: FSDP2's
all-gathers and reduce-scatters) are run the same way, with more at stake: gloo's reduce-scatter
all-reduces a clone of its whole input and copies this rank's chunk out in ``wait()``; the clone
is held by the all-reduce's work too, so once the caller drops its ``Work`` the worker thread
frees it (a unit's unsharded gradients in size) when it loops round: now and then after the step
has gone on to allocate more, and a reading on that rank counts it. Run on copies, the
collective's own buffers are made and freed where no tracker counts them, as NCCL's are; the
caller's tensors get the results.

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
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["CallerHeldCollectives"]


_COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor",
    "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "broadcast_",
})
"""The ``_c10d_functional`` ops that run a collective on the group's worker thread. Not the others
of the namespace: ``wait_tensor``, ``_wrap_tensor_autograd`` (an alias of its input: a copy here
would be a second buffer the step never has), point-to-point sends and receives."""


_C10D_COLLECTIVES = frozenset({
    "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "broadcast_", "alltoall_", "alltoall_base_",
})
"""The ``c10d`` ops (``torch.distributed``'s collectives, which FSDP2 calls) that run a collective
on the group's worker thread, their outputs in the first argument. Not point-to-point sends and
receives (a pipeline's, whose ``Work`` the caller holds) nor barriers."""


_PYTHON_LEVEL = ("all_reduce",)
"""``torch.distributed._functional_collectives`` functions wrapped while the mode is on (called
below the dispatch modes by DTensor's handlers: loss_parallel's)."""


class CallerHeldCollectives(TorchDispatchMode):
    """Each ``_c10d_functional`` collective runs synchronously on untracked copies of its tensor
    arguments; an in-place one writes its result back into its arguments, an out-of-place one
    returns tensors allocated through the modes below this one (the tracker's), filled from the
    collective's own outputs. ``wait_tensor`` on those finds no pending work and returns. The
    ``c10d`` collectives of ``_C10D_COLLECTIVES`` run the same way and hand back a completed
    ``Work``. The functions of ``_PYTHON_LEVEL`` do the same wherever they are called from."""

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
        if func.namespace == "c10d" and func._opname in _C10D_COLLECTIVES:
            return _c10d_caller_held(func, args, kwargs)
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


def _c10d_caller_held(func: Any, args: tuple, kwargs: dict) -> Any:
    """A ``c10d`` collective run to completion on untracked copies of its tensors (gloo's own
    buffers for it made below no tracker either); its results then written into the caller's
    output tensors (the schema's first argument) through the modes below, so the tracker sees a
    write where it saw the collective. The ``Work`` handed back has completed: the caller's
    ``wait()`` returns at once and runs nothing (gloo's reduce-scatter ``Work`` runs its copy-out
    in ``wait()``: here it ran on the copies)."""
    with _disable_current_modes():
        copy_args, copy_kwargs = tree_map_only(torch.Tensor, torch.Tensor.clone, (args, kwargs))
        out = func(*copy_args, **copy_kwargs)
        (out[-1] if isinstance(out, tuple) else out).wait()
    for copy, orig in zip(tree_flatten(copy_args[0])[0], tree_flatten(args[0])[0]):
        orig.copy_(copy)
    done = torch.futures.Future()
    done.set_result(None)
    work = torch._C._distributed_c10d._create_work_from_future(done).boxed()
    return (args[0], work) if isinstance(out, tuple) else work


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
