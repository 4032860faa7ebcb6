"""Tensor subclasses in a traced step: the program one rank runs, at local shard shapes.

A model parallelized with DTensor (tensor / sequence / context parallel, FSDP2) computes on
wrapper subclasses: a ``DTensor`` holds a rank's local shard, an ``AsyncCollectiveTensor`` the
output of a collective not yet waited for. A rank runs their *local* ops and the collectives
DTensor issues; a dispatch mode that runs a subclass op itself sees only the op at its global
(logical) shape. The rules here make the tracer (and the plan's recording / replay modes) see
what the rank runs, as torch's MemTracker and CommDebugMode do:

1. Defer: an op whose ``types`` hold a wrapper subclass is answered with ``NotImplemented``; the
   subclass desugars it and its local ops and collectives come back through the mode.
2. Storages: a subclass's memory is its inner tensor's (``__tensor_flatten__``, recursively).
3. Sharding propagation is not the step: DTensor derives output metadata by running the op on
   fake global-shape tensors (``ShardingPropagator._propagate_tensor_meta_non_cached``), under the
   active fake mode when there is one, so in a fake trace those ops look like the step's. While it
   runs, :func:`in_sharding_propagation` is true (installed once, by :func:`mark_sharding_propagation`).
4. Waits: ``_c10d_functional.wait_tensor`` returns its input eagerly; its fake kernel makes a new
   tensor, which a fake trace returns as the input itself. Waits (and ``_wrap_tensor_autograd``)
   complete a collective already issued and run where its output is first used, so a recompute may
   run them elsewhere than the forward: selective checkpointing neither logs nor caches them.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers _wrap_tensor_autograd
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "WAIT",
    "SYNC_OPS",
    "defers",
    "local_tensor",
    "storage_of",
    "in_sharding_propagation",
    "mark_sharding_propagation",
    "fake_copy_of",
]

WAIT = torch.ops._c10d_functional.wait_tensor.default
SYNC_OPS = frozenset({WAIT, torch.ops._c10d_functional._wrap_tensor_autograd.default})
"""Ops that complete (or mark for completion) a collective already issued."""


@functools.lru_cache(maxsize=None)
def _is_wrapper_type(cls: type) -> bool:
    if cls is torch.Tensor or not issubclass(cls, torch.Tensor) or issubclass(cls, torch.nn.Parameter):
        return False
    from torch._subclasses.functional_tensor import FunctionalTensor

    # FakeTensor is the trace's own mode's tensor; FunctionalTensor belongs to compile.
    return hasattr(cls, "__tensor_flatten__") and not issubclass(cls, (FakeTensor, FunctionalTensor))


def defers(types: Any) -> bool:
    """True when ``types`` (a dispatch call's) holds a wrapper subclass whose op is to desugar."""
    return any(_is_wrapper_type(t) for t in types)


def local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor inside ``t`` (``t`` itself when plain); None when it wraps several."""
    while is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [v for v in (getattr(t, a) for a in attrs) if isinstance(v, torch.Tensor)]
        if len(inner) != 1:
            return None
        t = inner[0]
    return t


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage holding ``t``'s data on this rank: a DTensor's is its local shard's."""
    if type(t) is not FakeTensor and type(t) is not torch.Tensor:  # those two wrap nothing
        t = local_tensor(t)
    if t is None:
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, nested, functional wrappers
        return None


_PROPAGATING = threading.local()


def in_sharding_propagation() -> bool:
    """DTensor is computing an op's output metadata (fake global-shape ops, not the step's)."""
    return getattr(_PROPAGATING, "depth", 0) > 0


def mark_sharding_propagation() -> None:
    """Wrap DTensor's metadata propagation so :func:`in_sharding_propagation` is true while it
    runs. Idempotent; the wrapper only counts, so DTensor's behaviour is unchanged. Raises a
    RuntimeError naming the method if this torch version has no such method (the trace could not
    then tell DTensor's metadata ops from the step's)."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # torch built without distributed: no DTensor, nothing to mark
        return
    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:
        raise RuntimeError(
            "this torch version has no ShardingPropagator._propagate_tensor_meta_non_cached: the "
            "tracer cannot tell DTensor's metadata ops from the step's; trace DTensor models with "
            "torch 2.13")
    if getattr(original, "_sac_planner_marked", False):
        return

    @functools.wraps(original)
    def marked(self, op_schema):
        _PROPAGATING.depth = getattr(_PROPAGATING, "depth", 0) + 1
        try:
            return original(self, op_schema)
        finally:
            _PROPAGATING.depth -= 1

    marked._sac_planner_marked = True  # type: ignore[attr-defined]
    ShardingPropagator._propagate_tensor_meta_non_cached = marked


def fake_copy_of(t: torch.Tensor, fake_plain) -> torch.Tensor:
    """``t`` rebuilt around fake copies of its inner tensors (``fake_plain(inner)``): a DTensor
    keeps its mesh, placements and global shape, its local shard becomes fake (a shard on the
    meta device too). A plain tensor is ``fake_plain(t)``."""
    if not is_traceable_wrapper_subclass(t):
        return fake_plain(t)
    attrs, ctx = t.__tensor_flatten__()
    inner = {}
    for a in attrs:
        v = getattr(t, a)
        inner[a] = fake_copy_of(v, fake_plain) if isinstance(v, torch.Tensor) else v
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
