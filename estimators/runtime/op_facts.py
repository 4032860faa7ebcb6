"""What one aten op is and what one call of it touches: derived once, read by every estimator.

Per overload (:func:`op_facts`, computed on first sight and kept): whether the op is a metadata
query (the step tracer does not record it), whether it launches no kernel (the roofline prices it
0), whether it draws random numbers, which arguments its schema marks as written and which of
those it does not read. The schema is scanned here and nowhere else.

Per call: the hashable key a runtime caches a price under (:func:`cache_key`), the tensors it
reads and writes, and their bytes.

"View" has one meaning in this project, the trace's: an op that made no new storage and mutated
none (``OpRecord.is_view``, observed per call; what selective checkpointing needs to know). The
schema's view ops are one part of :attr:`OpFacts.free` here, next to metadata queries and
allocation-only ops: ops that run no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

__all__ = ["OpFacts", "op_facts", "cache_key", "timed_key", "hint", "tensor_bytes", "is_empty"]

aten = torch.ops.aten
Args = Sequence[Any]
Kwargs = Mapping[str, Any]


def _packets(namespace: Any, names: str) -> frozenset[Any]:
    # getattr with a default: some names exist only in some torch versions of the supported range.
    found = (getattr(namespace, n, None) for n in names.split())
    return frozenset(p for p in found if p is not None)


# Questions about a tensor's metadata: no data is touched, the trace does not record them.
_QUERY_PACKETS = _packets(
    aten,
    "sym_size sym_stride sym_numel sym_storage_offset size stride numel dim is_same_size "
    "is_contiguous is_strides_like_format is_non_overlapping_and_dense sym_is_contiguous",
)
_QUERY_NAMESPACES = frozenset({"prim"})  # prim.device, prim.layout...: TorchScript metadata
# Recorded by the trace (they run in the step) but launch no kernel: a host read of a scalar (a
# device sync is not modelled) and runtime assertions.
_HOST_SIDE = _packets(
    aten,
    "_local_scalar_dense _assert_async _assert_scalar _assert_tensor_metadata sym_constrain_range "
    "sym_constrain_range_for_size _functional_sym_constrain_range",
)
# View-like ops whose schema does not mark them as views (is_view) yet launch no kernel.
_VIEW_LIKE = _packets(aten, "_unsafe_view unsafe_split unsafe_split_with_sizes unsafe_chunk lift")
# Allocation without initialisation: the caching allocator hands out memory, no kernel runs.
_ALLOCATION = _packets(
    aten, "empty empty_like empty_strided empty_permuted new_empty new_empty_strided resize_ set_"
)
_NO_KERNEL_NAMESPACES = frozenset({"prim", "profiler"})
# In-place ops that overwrite ``self`` without reading it: its bytes are written, not read.
_WRITE_ONLY_SELF = _packets(
    aten,
    "copy_ fill_ zero_ normal_ uniform_ random_ bernoulli_ exponential_ geometric_ "
    "log_normal_ cauchy_ _foreach_copy_ _foreach_zero_",
)


@dataclass(frozen=True)
class OpFacts:
    """What one OpOverload is, computed once per overload so the per-call paths stay cheap."""

    is_query: bool = False
    """A metadata query (``sym_size``, ``prim.device``...): not an op of the step."""
    free: bool = False
    """Launches no kernel: views, queries, host-side scalars and asserts, allocation-only ops."""
    is_random: bool = False
    """Draws random numbers (``nondeterministic_seeded``)."""
    dynamic_output: bool = False
    """Output shape depends on data: the output joins the cache key."""
    written: tuple[int, ...] = ()
    """Positions of the arguments the schema marks as written (in-place ``self``, ``out=``)."""
    written_names: tuple[str, ...] = ()
    """Their names, for arguments passed as kwargs."""
    returns_nothing: bool = False
    """The schema returns nothing (``_foreach_add_``): its written arguments are its outputs."""
    unread: frozenset[int] = frozenset()
    """Argument positions written but not read (``out=``, ``self`` of ``copy_``)."""
    unread_names: frozenset[str] = frozenset()
    """The same arguments by name, for when they come as kwargs."""


_FACTS: dict[Any, OpFacts] = {}


def op_facts(func: Any) -> OpFacts:
    """The facts of ``func`` (an OpOverload), from its schema and tags, cached."""
    facts = _FACTS.get(func)
    if facts is None:
        facts = _FACTS[func] = _derive(func)
    return facts


def _derive(func: Any) -> OpFacts:
    packet = getattr(func, "_overloadpacket", func)
    namespace = getattr(func, "namespace", None)
    schema = getattr(func, "_schema", None)
    tags = getattr(func, "tags", ())
    is_query = packet in _QUERY_PACKETS or namespace in _QUERY_NAMESPACES
    free = (
        is_query
        or getattr(func, "is_view", False)
        or torch.Tag.inplace_view in tags
        or packet in _VIEW_LIKE | _HOST_SIDE | _ALLOCATION
        or namespace in _NO_KERNEL_NAMESPACES
    )
    args = schema.arguments if schema is not None else ()
    written = [
        (i, a.name, a.kwarg_only)
        for i, a in enumerate(args)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    unread = {(i, n) for i, n, kwarg_only in written if kwarg_only}  # out= buffers
    if packet in _WRITE_ONLY_SELF and written and written[0][0] == 0:
        unread.add(written[0][:2])
    return OpFacts(
        is_query=is_query,
        free=free,
        is_random=torch.Tag.nondeterministic_seeded in tags,
        dynamic_output=torch.Tag.dynamic_output_shape in tags,
        written=tuple(i for i, _, _ in written),
        written_names=tuple(n for _, n, _ in written),
        returns_nothing=schema is not None and not schema.returns,
        unread=frozenset(i for i, _ in unread),
        unread_names=frozenset(n for _, n in unread),
    )


def written_args(facts: OpFacts, args: Args, kwargs: Kwargs) -> list[Any]:
    """The values of the arguments ``facts`` says are written (positional or by name)."""
    return [
        args[pos] if pos < len(args) else kwargs.get(name)
        for pos, name in zip(facts.written, facts.written_names)
    ]


# ----------------------------------------------------------------------------- per call


def hint(x: Any, unknown: int = 0) -> Any:
    """A concrete int for a SymInt (its hint), so symbolic shapes still key and price.

    Unbacked SymInts (sizes of data-dependent outputs) have no hint and count as ``unknown``.
    """
    if isinstance(x, torch.SymInt):
        node = x.node
        return node.hint if node.has_hint() else unknown
    if isinstance(x, torch.SymFloat):
        node = x.node
        return node.hint if node.has_hint() else 0.0
    if isinstance(x, torch.SymBool):
        node = x.node
        return node.hint if node.has_hint() else False
    return x


def _signature(values: Any) -> tuple[Any, ...]:
    """Hashable description of args: tensors by (shape, stride, dtype), the rest by value.

    The hot path of every call: plain loops instead of pytree, torch.Size kept as is (hashable).
    """
    sig = []
    for v in values:
        if isinstance(v, torch.Tensor):
            sig.append((v.shape, v.stride(), v.dtype))
        elif isinstance(v, (list, tuple)):
            sig.append(_signature(v))
        else:
            sig.append(v)
    return tuple(sig)


def _safe_signature(values: Any) -> tuple[Any, ...]:
    """Slow path of :func:`_signature` for symbolic shapes and non-strided tensors."""
    sig = []
    for v in values:
        if isinstance(v, torch.Tensor):
            stride = tuple(map(hint, v.stride())) if v.layout == torch.strided else str(v.layout)
            sig.append((tuple(map(hint, v.shape)), stride, v.dtype))
        elif isinstance(v, (list, tuple)):
            sig.append(_safe_signature(v))
        else:
            v = hint(v)
            sig.append(v if _hashable(v) else repr(v))
    return tuple(sig)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def cache_key(func: Any, facts: OpFacts, args: Args, kwargs: Kwargs, out: Any, safe: bool) -> tuple:
    """What a runtime caches one call's price under: the overload, its arguments' layouts and
    values, and the output's layout when the output shape depends on data. ``safe``: the slower
    form that also takes symbolic shapes and non-strided tensors (and is stable across
    processes as ``repr``); the fast form raises on those."""
    sign = _safe_signature if safe else _signature
    key: tuple = (func, sign(args))
    if kwargs:
        key += (tuple(kwargs), sign(kwargs.values()))
    if facts.dynamic_output:
        key += (sign(out if isinstance(out, (list, tuple)) else (out,)),)
    return key


def timed_key(func: Any, args: Args, kwargs: Kwargs, out: Any) -> tuple[tuple, str] | None:
    """The key a benchmark times one call under and its ``repr`` (how timings are named across
    processes and in cache files); None for an op that launches no kernel (nothing to time)."""
    facts = op_facts(func)
    if facts.free:
        return None
    key = cache_key(func, facts, args, kwargs, out, safe=True)
    return key, repr(key)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in this view; a stride-0 (broadcast) dim is read once."""
    try:
        strides = t.stride()
    except (RuntimeError, NotImplementedError):  # sparse and other non-strided layouts
        return hint(t.numel()) * t.element_size()
    n = 1
    for size, stride in zip(t.shape, strides):
        if type(size) is not int or type(stride) is not int:
            size, stride = hint(size), hint(stride)
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def is_empty(t: torch.Tensor) -> bool:
    """Known to hold no element; a data-dependent size is not known to be 0."""
    return any(hint(s, unknown=-1) == 0 for s in t.shape)


def tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in ``values``, nested lists and tuples included, in order."""
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(tensors(v))
    return found


def read_tensors(facts: OpFacts, args: Args, kwargs: Kwargs) -> list[torch.Tensor]:
    """Tensor arguments the op reads (all but the written-only ones)."""
    if not facts.unread:
        return tensors(args) + tensors(kwargs.values())
    read = tensors(a for i, a in enumerate(args) if i not in facts.unread)
    read += tensors(v for k, v in kwargs.items() if k not in facts.unread_names)
    return read


def written_tensors(facts: OpFacts, args: Args, kwargs: Kwargs, out: Any) -> list[torch.Tensor]:
    """Tensors the op writes: its outputs, or its written arguments when it returns nothing."""
    written = tensors(out if isinstance(out, (list, tuple)) else (out,))
    if facts.returns_nothing:
        written += tensors(written_args(facts, args, kwargs))
    return written
