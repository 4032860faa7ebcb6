"""DTensor's elementwise ``_foreach_`` ops run straight on the local shards while a step is traced.

An optimizer's foreach step on DTensor parameters (AdamW over a tensor-parallel model) sends every
``_foreach_`` op through DTensor's sharding propagation, element by element of its lists, and
torch does not cache it for lists: in a tensor-parallel trace that is most of the step's cost. Where
every list holds DTensors and each position's DTensors share one mesh, one set of placements with
no ``Partial`` among them and one global shape, an elementwise op runs on each rank as the same op
on the local shards and its outputs keep those placements (no redistribution, no collective): the
handler here calls exactly that op on the local tensors and wraps the outputs. Any other call (a
``Partial`` gradient, a plain tensor beside DTensors, a tensor operand outside a list) goes through
DTensor's own dispatch, unchanged. The traced ops, storages and bytes are therefore the ones
DTensor's dispatch makes (tests/estimators/tracing/test_dtensor_foreach.py compares the two
traces record by record).

    with local_foreach():
        optimizer.step()
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["local_foreach"]

_ELEMENTWISE = ("add", "sub", "mul", "div", "addcdiv", "addcmul", "lerp", "sqrt", "neg", "pow", "maximum",
                "minimum", "reciprocal", "zero", "copy", "abs", "sign", "clamp_min", "clamp_max", "exp", "log")
"""``_foreach_<name>`` / ``_foreach_<name>_``: elementwise on every list position (no reduction)."""


def _ops() -> list:
    aten, out = torch.ops.aten, []
    for name in _ELEMENTWISE:
        for packet_name in (f"_foreach_{name}", f"_foreach_{name}_"):
            packet = getattr(aten, packet_name, None)
            if packet is None:
                continue
            out += [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    return out


def _local_call(fallback, op, args: tuple, kwargs: dict) -> Any:
    """``op`` on the local shards where that is what DTensor's dispatch runs, else ``fallback``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.distributed.tensor.placement_types import Partial

    lists = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return fallback(op, args, kwargs)  # a tensor operand outside a list
        if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            if not all(isinstance(x, DTensor) for x in a):
                return fallback(op, args, kwargs)
            lists.append(a)
    if not lists or kwargs and any(isinstance(v, (list, tuple)) and v and isinstance(v[0], DTensor)
                                   for v in kwargs.values()):
        return fallback(op, args, kwargs)
    first = [x._spec for x in lists[0]]
    if any(isinstance(p, Partial) for spec in first for p in spec.placements):
        return fallback(op, args, kwargs)
    in_place = op._schema.name.endswith("_")
    for other in lists[1:]:
        for x, spec in zip(other, first):
            if x._spec.mesh != spec.mesh or tuple(x.shape) != tuple(spec.shape):
                return fallback(op, args, kwargs)
            if x._spec.placements != spec.placements and not in_place:
                return fallback(op, args, kwargs)  # an out-of-place op may reshard either side

    def local(a):
        if not (isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensor)):
            return a
        if a is lists[0]:
            return [x._local_tensor for x in a]
        # An in-place op keeps self's placements: DTensor reshards the other operands to them, in
        # this order (its flattened arguments), with this call.
        return [x._local_tensor if x._spec.placements == spec.placements else
                redistribute_local_tensor(x._local_tensor, x._spec,
                                          DTensorSpec(spec.mesh, spec.placements, tensor_meta=x._spec.tensor_meta))
                for x, spec in zip(a, first)]

    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    out = op(*[local(a) for a in args], **kwargs)  # kwargs hold no DTensor list (checked above)
    if in_place or not out:  # the DTensors' local tensors were updated
        return out
    return [_wrap(t, like) for t, like in zip(out, lists[0])]


def _wrap(local: torch.Tensor, like) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = like._spec
    meta = TensorMeta(shape=spec.tensor_meta.shape, stride=spec.tensor_meta.stride, dtype=local.dtype)
    return DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)


@contextlib.contextmanager
def local_foreach() -> Iterator[None]:
    """Within the block, DTensor's elementwise ``_foreach_`` ops run on the local shards where
    DTensor's dispatch would run the same op there (see the module docstring); as it was after."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # no torch.distributed: no DTensor to dispatch
        yield
        return
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ours = [op for op in _ops() if op not in handlers]

    def handler(op, args, kwargs):
        return _local_call(fallback, op, args, kwargs)

    def fallback(op, args, kwargs):  # DTensor's own dispatch: the op without this handler
        saved = handlers.pop(op)
        try:
            return op(*args, **kwargs)
        finally:
            handlers[op] = saved

    for op in ours:
        handlers[op] = handler
    try:
        yield
    finally:
        for op in ours:
            if handlers.get(op) is handler:
                del handlers[op]
