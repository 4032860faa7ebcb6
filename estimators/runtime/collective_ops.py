"""The collectives a traced rank issues, priced by the collective model instead of as copies.

Tensor, sequence and context parallelism run torch's functional collectives
(``torch.ops._c10d_functional``) on a rank's local tensors; the step tracer records them like any
op. :func:`collective_call` reads one call: which collective, the whole buffer's bytes (the
convention of ``estimators.runtime.collectives``: an all-gather's output, a reduce-scatter's input)
and the group's size (from the group name every such op carries). :class:`CollectivePricing`
wraps a runtime model: collectives get ``AnalyticCollectiveModel.time_ms`` on the device's default
link, every other op the wrapped model's price.

    runtime = CollectivePricing.for_device(make_runtime_model("roofline", spec), spec)

On a device that names no link (``"cpu"``) collectives are priced as copies of their buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from estimators.runtime.collectives import AnalyticCollectiveModel, Collective
from estimators.runtime.device import DeviceSpec

__all__ = ["CollectiveCall", "collective_call", "is_collective", "CollectivePricing"]

_F = torch.ops._c10d_functional
# op -> (collective, index of the group argument, whether the whole buffer is the output)
_CALLS = {
    _F.all_gather_into_tensor.default: (Collective.ALL_GATHER, 2, True),
    _F.reduce_scatter_tensor.default: (Collective.REDUCE_SCATTER, 3, False),
    _F.all_reduce.default: (Collective.ALL_REDUCE, 2, False),
    _F.all_to_all_single.default: (Collective.ALL_TO_ALL, 3, False),
    _F.broadcast.default: (Collective.BROADCAST, 2, False),
}


def is_collective(func: Any) -> bool:
    """``func`` is a functional collective that moves data (not a wait)."""
    return func in _CALLS


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a rank issued."""

    collective: Collective
    message_bytes: int
    """The whole buffer (see ``estimators.runtime.collectives``)."""
    group_size: int


def _nbytes(t: Any) -> int:
    return int(t.numel()) * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_size(group: Any) -> int:
    """The size of the group a functional collective names (a name, or the group itself)."""
    if not isinstance(group, str) and hasattr(group, "size"):
        return int(group.size())
    from torch.distributed.distributed_c10d import _resolve_process_group

    return int(_resolve_process_group(group).size())


def collective_call(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> CollectiveCall | None:
    """The collective ``func(*args, **kwargs)`` issued (``out``: its result), or None for any
    other op (waits included: they move no data)."""
    entry = _CALLS.get(func)
    if entry is None:
        return None
    collective, name_at, whole_is_output = entry
    group_name = args[name_at] if len(args) > name_at else kwargs.get("group_name")
    buffer = out if whole_is_output else args[0]
    return CollectiveCall(collective, _nbytes(buffer), _group_size(group_name))


class CollectivePricing:
    """A runtime model that prices collectives on a link and every other op as ``inner`` does.

    A device that names no link (the CPU) prices a collective as the roofline prices a copy of
    its buffer: never as ``inner`` might, since a benchmarking runtime would run the collective
    on one rank alone."""

    def __init__(self, inner: Any, collectives: AnalyticCollectiveModel | None, copies: Any = None) -> None:
        if collectives is None and copies is None:
            raise ValueError("CollectivePricing needs a collective model or a runtime that prices copies")
        self.inner = inner
        self.collectives = collectives
        self.copies = copies
        self.name = f"{inner.name}+{collectives.name if collectives is not None else copies.name}"

    @classmethod
    def for_device(cls, inner: Any, spec: DeviceSpec) -> "CollectivePricing":
        """``inner`` with collectives on ``spec``'s default link, or priced as copies without one."""
        try:
            return cls(inner, AnalyticCollectiveModel.from_device(spec))
        except ValueError:
            from estimators.runtime.roofline import RooflineRuntime

            return cls(inner, None, RooflineRuntime(spec))

    def op_runtime_ms(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> float:
        call = collective_call(func, args, kwargs, out)
        if call is None:
            return self.inner.op_runtime_ms(func, args, kwargs, out)
        if self.collectives is None:
            return self.copies.op_runtime_ms(func, args, kwargs, out)
        return self.collectives.time_ms(call.collective, call.message_bytes, call.group_size)

    def __getattr__(self, name: str) -> Any:  # hits / misses / export_cache of a benchmark runtime
        if name in ("inner", "collectives", "copies"):
            raise AttributeError(name)
        return getattr(self.inner, name)
