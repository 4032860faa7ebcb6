"""Stated routing: the values a fake trace of a mixture-of-experts step reads, from a stated load.

A fake trace has shapes, not values. A mixture of experts under expert parallelism (torchtitan's
``AllToAllTokenDispatcher``, Megatron's all-to-all dispatcher) reads values: each rank counts the
tokens its router sends to every expert, exchanges the counts with an ``all_to_all_single``, and
reads them (``.tolist()``) as the split sizes of the all-to-alls that carry the tokens. Those sizes
set the shape of every tensor the rank's experts compute on. Routing is data-dependent, so the
trace is told the load instead (:class:`ExpertLoad`), and :class:`StatedRouting`, a layer in the
trace's op path below the tracer, gives the step's value reads the values that load produces:

1. **The router's choice**: the indices ``topk`` returns hold a balanced routing, token ``t``'s
   ``j``-th choice among ``n`` experts being ``(t * k + j) % n`` (torchtitan's
   ``_debug_force_load_balance``): every expert gets the same count from this rank.
2. **Index arithmetic** on values held this way runs for real (on the CPU, on real tensors beside
   the fake ones): an op whose tensor arguments all hold values (the one-hot routing map, its
   per-expert sums, ``argsort``, ``cumsum``, ``repeat_interleave``...) gets values for its outputs.
   An integer or boolean factory (``zeros``, ``arange``...) holds its values too (``empty``
   holds none: its values are whatever memory held). All of it is lazy: computed only when a
   value is read, so a causal mask built from ``arange`` never is.
3. **The token-count exchange**, an all-to-all of an integer tensor holding values (functional
   ``all_to_all_single``; ``dist.all_to_all_single`` or ``dist.all_to_all`` in place), returns
   what the load says this rank receives: from every rank of the group, ``factor * N / EP`` rows
   (``N`` = the rows this rank routes, the sum of its counts), spread evenly over its ``e`` local
   experts. The fake process group moves no data; the load stands for the other ranks.
4. **Value reads** (``.item()``, ``.tolist()``, ``bool()``) of a tensor holding values return them;
   an op whose output shape depends on values (``nonzero``, ``unique``) gets its shape from them.

Only the rows a rank *receives* depend on the load: it always sends ``N = tokens * top_k`` rows.
Float tensors stay fake; nothing else of the trace changes. An op the engine cannot run (another
namespace, a random one) leaves its outputs without values, and a tensor written in place by one
loses its values: a later read then fails as a fake trace does without a stated load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from estimators.runtime.op_facts import op_facts, written_args
from estimators.tracing.op_args import op_tensors
from estimators.tracing.subclasses import storage_of

__all__ = ["ExpertLoad", "ExpertLoadError", "Exchange", "StatedRouting", "stated_routing", "recorded_exchanges"]

aten = torch.ops.aten
_A2A = torch.ops._c10d_functional.all_to_all_single.default
_A2A_BASE = torch.ops.c10d.alltoall_base_.default
_EXCHANGES = frozenset({_A2A, _A2A_BASE, torch.ops.c10d.alltoall_.default})
"""The all-to-alls a token-count exchange runs: functional (torchtitan's partial_dtensor backend),
in place into one tensor (``dist.all_to_all_single``) or a list of them (``dist.all_to_all``,
its spmd_types backend)."""
_UNDEFINED = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                        aten.new_empty_strided.default, aten.empty_strided.default, aten.empty_permuted.default})
"""Factories whose values are whatever memory held: never values to read."""
_TOPK = frozenset({aten.topk.default})
_READS = {aten._local_scalar_dense.default: lambda v: v.item(), aten.is_nonzero.default: lambda v: bool(v.item())}
_LIKE = frozenset({aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                   aten.new_zeros.default, aten.new_ones.default, aten.new_full.default})
"""Factories whose tensor argument is a template (its shape, dtype), not a value they read."""
_REAL_NUMEL = 1 << 16
"""A real tensor the step reads holds its values (copied at each op that reads it) up to this size."""


class ExpertLoadError(ValueError):
    """A stated load the routing cannot produce (the message says the most it can)."""


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """How many tokens each rank's routed experts receive in the planned step, as a multiple of
    the balanced share. Routing is data-dependent; a fake trace follows this statement instead.

        ExpertLoad()                              # balanced: every expert gets tokens * top_k / E
        ExpertLoad(capacity_factor=1.25)          # every rank's experts get 1.25 x that
        ExpertLoad(capacity_factor=(4/3, 2/3))    # rank 0 of the EP group 4/3 x, rank 1 2/3 x
        ExpertLoad.worst_case()                   # every token that can reach a rank's experts does

    A rank always sends ``tokens * top_k`` rows; the factor sets the rows it receives: ``factor *
    tokens * top_k`` per MoE layer (from each of the ``EP`` ranks of its group, ``factor / EP`` of
    their rows), spread evenly over its local experts, rounded to whole rows."""

    capacity_factor: float | tuple[float, ...] = 1.0
    """The rows this rank's experts receive over the balanced share: 1.0 is balanced; a tuple
    gives one factor per rank of the expert-parallel group (by its rank in that group);
    ``math.inf`` is the worst case (:meth:`worst_case`)."""

    max_capacity_factor: float | None = None
    """The model drops the tokens an expert receives beyond this factor (its capacity): the
    worst case stops there. None: dropless (torchtitan's all-to-all EP), the worst case is every
    token of the group routed to this rank's experts (at most ``min(top_k, local experts)`` rows
    per token)."""

    def __post_init__(self) -> None:
        factors = self.capacity_factor if isinstance(self.capacity_factor, tuple) else (self.capacity_factor,)
        if not factors:
            raise ExpertLoadError("capacity_factor must be a number or a tuple of one number per EP rank, got ()")
        for f in factors:
            if isinstance(f, bool) or not isinstance(f, numbers.Real) or math.isnan(f) or f < 0:
                raise ExpertLoadError(f"capacity_factor must hold numbers >= 0 (1.0: balanced), got {f!r}")
        cap = self.max_capacity_factor
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Real)
                                or not math.isfinite(cap) or cap <= 0):
            raise ExpertLoadError(f"max_capacity_factor must be a number > 0 or None (dropless), got {cap!r}")
        if cap is not None and any(math.isfinite(f) and f > cap for f in factors):
            raise ExpertLoadError(f"capacity_factor {self.capacity_factor!r} is above the model's capacity "
                                  f"(max_capacity_factor={cap:g}): its experts drop what is above it")

    @classmethod
    def balanced(cls) -> "ExpertLoad":
        """Every expert receives ``tokens * top_k / E`` rows from every rank."""
        return cls()

    @classmethod
    def worst_case(cls, max_capacity_factor: float | None = None) -> "ExpertLoad":
        """Every token that can reach a rank's experts does (or up to the model's capacity)."""
        return cls(capacity_factor=math.inf, max_capacity_factor=max_capacity_factor)

    @property
    def is_worst_case(self) -> bool:
        return not isinstance(self.capacity_factor, tuple) and math.isinf(self.capacity_factor)

    def planned(self) -> "ExpertLoad":
        """The load one plan for every rank is made for: the largest factor, on every rank (the
        ranks of a group must run the same plan: a recompute re-issues its all-to-alls)."""
        if not isinstance(self.capacity_factor, tuple):
            return self
        return dataclasses.replace(self, capacity_factor=float(max(self.capacity_factor)))

    def factor_of(self, ep_rank: int, ep_size: int) -> float:
        """The factor of rank ``ep_rank`` of a group of ``ep_size``."""
        if not isinstance(self.capacity_factor, tuple):
            return float(self.capacity_factor)
        if len(self.capacity_factor) != ep_size:
            raise ExpertLoadError(f"capacity_factor gives {len(self.capacity_factor)} factors, but the "
                                  f"expert-parallel group has {ep_size} ranks: give one per rank")
        return float(self.capacity_factor[ep_rank])


@dataclass(frozen=True)
class Exchange:
    """One token-count exchange of the trace, as the stated load answered it."""

    ep_size: int
    ep_rank: int
    experts: int
    """Experts over the group (the count tensor's size)."""
    local_experts: int
    routed_rows: int
    """Rows this rank sends (tokens x top_k)."""
    received_rows: int
    """Rows this rank's experts receive."""
    capacity_factor: float
    """``received_rows`` over the balanced share (``routed_rows``)."""


@dataclass(frozen=True)
class _Layout:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    storage_numel: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Layout":
        nbytes = t.untyped_storage().nbytes()
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, nbytes // t.element_size())

    @staticmethod
    def contiguous(size) -> tuple[int, ...]:
        strides, n = [], 1
        for d in reversed(tuple(size)):
            strides.append(n)
            n *= max(d, 1)
        return tuple(reversed(strides))

    def flat_from(self, value: torch.Tensor) -> torch.Tensor:
        """A real flat storage of this layout holding ``value`` where the tensor lies."""
        flat = torch.zeros(max(self.storage_numel, 1), dtype=self.dtype)
        flat.as_strided(self.size, self.stride, self.offset).copy_(value)
        return flat


@contextlib.contextmanager
def _real() -> Iterator[None]:
    """Real tensors, computed for real: no dispatch mode (the trace's fake mode) sees them."""
    with _disable_current_modes(), torch._C._DisableTorchDispatch(), torch.no_grad():
        yield


class _Node:
    """A storage's values: a real flat tensor, made when first asked for."""

    __slots__ = ("dtype", "_make", "_flat")

    def __init__(self, dtype: torch.dtype, make: Callable[[], torch.Tensor]) -> None:
        self.dtype, self._make, self._flat = dtype, make, None

    def flat(self) -> torch.Tensor:
        if self._flat is None:
            with _real():
                self._flat = self._make()
            self._make = None
        return self._flat


@dataclass(frozen=True)
class _Spec:
    """A tensor argument whose values are known: its storage's node and its view of it."""

    node: _Node | None  # None: a template (its values are not read)
    layout: _Layout

    def value(self) -> torch.Tensor:
        lay = self.layout
        with _real():
            if self.node is None:
                return torch.empty_strided(lay.size, lay.stride, dtype=lay.dtype)
            return self.node.flat().as_strided(lay.size, lay.stride, lay.offset)


class _Apply:
    """One op on known values, run once, when one of its results is first asked for."""

    def __init__(self, func, skeleton: tuple, specs: list[_Spec], mutated: set[int],
                 outputs: list[_Layout | None]) -> None:
        self.func, self.skeleton, self.specs, self.mutated, self.outputs = func, skeleton, specs, mutated, outputs
        self._flats: list[torch.Tensor | None] | None = None
        self._mutated: dict[int, torch.Tensor] = {}

    def _run(self) -> None:
        real = []
        for i, spec in enumerate(self.specs):
            if i in self.mutated:  # written in place: a copy, the values before it stay as they were
                self._mutated[i] = spec.node.flat().clone()
                real.append(self._mutated[i].as_strided(spec.layout.size, spec.layout.stride, spec.layout.offset))
            else:
                real.append(spec.value())
        args, kwargs = _fill(self.skeleton, iter(real))
        out = self.func(*args, **kwargs)
        outs = op_tensors(out if isinstance(out, (tuple, list)) else (out,))
        self._flats = [lay.flat_from(o) if lay is not None else None for lay, o in zip(self.outputs, outs)]
        self.specs = self.skeleton = None  # run once: its inputs' values are no longer held here

    def output(self, j: int) -> torch.Tensor:
        if self._flats is None:
            self._run()
        return self._flats[j]

    def written(self, i: int) -> torch.Tensor:
        if self._flats is None:
            self._run()
        return self._mutated[i]


class _Slot:
    """Where a tensor argument sits in an op's arguments (the op is kept without its tensors)."""


def _skeleton(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _Slot
    if type(obj) in (tuple, list):
        return type(obj)(_skeleton(x) for x in obj)
    if type(obj) is dict:
        return {k: _skeleton(v) for k, v in obj.items()}
    return obj


def _fill(obj: Any, values) -> Any:
    if obj is _Slot:
        return next(values)
    if type(obj) in (tuple, list):
        return type(obj)(_fill(x, values) for x in obj)
    if type(obj) is dict:
        return {k: _fill(v, values) for k, v in obj.items()}
    return obj


def _is_data_dependent(e: Exception) -> bool:
    name = type(e).__name__
    return "DataDependent" in name or "DynamicOutputShape" in name


_RECORDERS: list[list[Exchange]] = []


@contextlib.contextmanager
def recorded_exchanges() -> Iterator[list[Exchange]]:
    """The token-count exchanges of the last fake trace with a stated load run inside (an
    estimate that traces twice keeps the second's), in order: one per MoE layer traced."""
    exchanges: list[Exchange] = []
    _RECORDERS.append(exchanges)
    try:
        yield exchanges
    finally:
        _RECORDERS.remove(exchanges)


def stated_routing(load: ExpertLoad | None, fake_mode: Any, run: Callable[[Any, tuple, dict], Any]
                   ) -> Callable[[Any, tuple, dict], Any]:
    """The trace's op runner ``run`` with the values of ``load`` (``run`` itself for None)."""
    if load is None:
        return run
    if not isinstance(load, ExpertLoad):
        raise TypeError(f"expert_load must be an ExpertLoad, got {type(load).__name__}")
    if fake_mode is None:
        raise ValueError("EstimateOptions(expert_load=...) needs mode=TraceMode.FAKE: a real trace follows "
                         "the routing of the batch it runs")
    return StatedRouting(load, fake_mode).wrap(run)


class StatedRouting:
    """The stated-routing layer of one fake trace (see the module docstring).

        stated = StatedRouting(ExpertLoad(capacity_factor=1.5), fake_mode)
        tracer.run_op = stated.wrap(tracer.run_op)
        ...
        stated.exchanges        # each token-count exchange, as answered
    """

    def __init__(self, load: ExpertLoad, fake_mode: Any) -> None:
        self.load, self.fake_mode = load, fake_mode
        for recorder in _RECORDERS:  # a new trace: the exchanges recorded are this one's
            recorder.clear()
        self._nodes: dict[int, _Node] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._self_ref = weakref.ref(self)
        self._topk: list[tuple[int, int, int]] = []
        """(tokens, k, n) of every routing ``topk`` gave, in order."""
        self.exchanges: list[Exchange] = []

    def wrap(self, run: Callable[[Any, tuple, dict], Any]) -> Callable[[Any, tuple, dict], Any]:
        """``run`` (an op runner: ``func, args, kwargs -> out``) with the stated values."""
        return lambda func, args, kwargs: self._run(run, func, args, kwargs)

    # ------------------------------------------------------------------ values
    def _key(self, t: torch.Tensor) -> tuple[int, Any] | None:
        st = storage_of(t)
        return None if st is None else (id(st), st)

    def _set(self, t: torch.Tensor, node: _Node) -> None:
        key = self._key(t)
        if key is None:
            return
        k, st = key
        self._nodes[k] = node
        if k not in self._refs:
            self._refs[k] = weakref.ref(st, lambda _, k=k, me=self._self_ref: (s := me()) and s._drop(k))

    def _drop(self, k: int) -> None:
        self._nodes.pop(k, None)
        self._refs.pop(k, None)

    def _forget(self, t: Any) -> None:
        """Written by an op this layer does not run: its values are no longer known."""
        for x in t if isinstance(t, (list, tuple)) else (t,):
            if isinstance(x, torch.Tensor) and (key := self._key(x)) is not None:
                self._nodes.pop(key[0], None)

    def _spec(self, t: torch.Tensor) -> _Spec | None:
        """``t``'s values where known: held by its storage, a fake constant's, or a real tensor's."""
        from torch._subclasses.fake_tensor import FakeTensor

        if type(t) is torch.Tensor:  # real in a fake trace (an index made outside it): its own values
            if t.device.type == "meta" or t.numel() > _REAL_NUMEL:
                return None
            with _real():
                flat = t.detach().contiguous().reshape(-1).clone()
            lay = _Layout(tuple(t.shape), _Layout.contiguous(t.shape), 0, t.dtype, t.numel())
            return _Spec(_Node(t.dtype, lambda: flat), lay)
        if type(t) is not FakeTensor:
            return None
        key = self._key(t)
        node = self._nodes.get(key[0]) if key is not None else None
        if node is None and t.constant is not None:  # torch.tensor(...) in the step: fake keeps its value
            const, lay = t.constant, _Layout.of(t)
            node = _Node(t.dtype, lambda: lay.flat_from(const))
            self._set(t, node)
        if node is None or node.dtype != t.dtype:
            return None
        return _Spec(node, _Layout.of(t))

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values of fake tensor ``t``, where known."""
        spec = self._spec(t)
        return None if spec is None else spec.value()

    # ------------------------------------------------------------------ dispatch
    def _run(self, run, func, args: tuple, kwargs: dict) -> Any:
        read = _READS.get(func)
        if read is not None:
            v = self.value(args[0]) if args and isinstance(args[0], torch.Tensor) else None
            if v is None:
                return run(func, args, kwargs)
            with _real():
                return read(v)
        facts = op_facts(func)
        if facts.is_query:
            return run(func, args, kwargs)
        tensors = op_tensors(args, kwargs)
        if func in _EXCHANGES:
            out = run(func, args, kwargs)
            for t in written_args(facts, args, kwargs):
                self._forget(t)
            self._exchange(func, args, out)
            return out
        if func.namespace != "aten" or facts.is_random or func in _UNDEFINED:
            out = run(func, args, kwargs)
            for t in written_args(facts, args, kwargs):
                self._forget(t)
            return out
        specs = [_Spec(None, _Layout.of(t)) if func in _LIKE and i == 0 else self._spec(t)
                 for i, t in enumerate(tensors)]
        known = all(s is not None for s in specs)
        try:
            out = run(func, args, kwargs)
        except Exception as e:
            if known and specs and _is_data_dependent(e):
                return self._dynamic(func, args, kwargs, specs)
            raise
        if func in _TOPK:
            self._route(out[1], args, kwargs)
        elif known and (specs or _integral(out)):
            self._record(func, args, kwargs, tensors, specs, out, facts)
        else:
            for t in written_args(facts, args, kwargs):
                self._forget(t)
        return out

    def _record(self, func, args, kwargs, tensors, specs, out, facts) -> None:
        """The outputs of an op on known values hold its results (computed when asked for)."""
        flat_out = op_tensors(out if isinstance(out, (tuple, list)) else (out,))
        written = {id(t) for t in written_args(facts, args, kwargs) if isinstance(t, torch.Tensor)}
        mutated = {i for i, t in enumerate(tensors) if id(t) in written}
        in_storages = {id(s): i for i, t in enumerate(tensors) if (s := storage_of(t)) is not None}
        layouts: list[_Layout | None] = []
        for o in flat_out:
            st = storage_of(o)
            layouts.append(None if st is None or id(st) in in_storages else _Layout.of(o))
        apply = _Apply(func, _skeleton((args, kwargs)), specs, mutated, layouts)
        for j, (o, lay) in enumerate(zip(flat_out, layouts)):
            if lay is not None:
                self._set(o, _Node(lay.dtype, lambda j=j: apply.output(j)))
        for i in mutated:
            base = specs[i].node
            if base is not None:
                self._set(tensors[i], _Node(base.dtype, lambda i=i: apply.written(i)))

    def _dynamic(self, func, args, kwargs, specs: list[_Spec]) -> Any:
        """An op whose output shape depends on values, run on the known ones: fake outputs of
        the real shapes, holding the real values."""
        with _real():
            real_args, real_kwargs = _fill(_skeleton((args, kwargs)), iter([s.value() for s in specs]))
            out = func(*real_args, **real_kwargs)
        converter = self.fake_mode.fake_tensor_converter

        def fake(r: torch.Tensor) -> torch.Tensor:
            f = converter.from_real_tensor(self.fake_mode, r)
            lay = _Layout.of(f)
            with _real():
                kept = r.clone()
            self._set(f, _Node(lay.dtype, lambda: lay.flat_from(kept)))
            return f

        if isinstance(out, (tuple, list)):
            return type(out)(fake(o) if isinstance(o, torch.Tensor) else o for o in out)
        return fake(out)

    def _route(self, indices: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Rule 1: a balanced routing in ``topk``'s indices."""
        x, k = args[0], args[1] if len(args) > 1 else kwargs.get("k")
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", -1)) % max(x.dim(), 1)
        n = x.shape[dim] if x.dim() else 1
        lay = _Layout.of(indices)
        moved = [*lay.size[:dim], *lay.size[dim + 1:], k]
        tokens = math.prod(moved[:-1])
        self._topk.append((tokens, k, n))

        def make() -> torch.Tensor:
            ids = (torch.arange(tokens * k).reshape(tokens, k) % n).reshape(moved).movedim(-1, dim)
            return lay.flat_from(ids.to(lay.dtype))

        self._set(indices, _Node(lay.dtype, make))

    def _exchange(self, func, args: tuple, out: Any) -> None:
        """Rule 3: the counts this rank receives, as the load states them, in the output chunks of
        a count exchange (any of the three forms of all-to-all; else nothing is set)."""
        if func is _A2A:  # (input, output_split_sizes, input_split_sizes, group_name) -> output
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(args[3])
            sources, outputs = [args[0]], _chunks(out, args[1], group)
        elif func is _A2A_BASE:  # (output, input, group, output_split_sizes, input_split_sizes, ...)
            group = _group(args[2])
            sources, outputs = [args[1]], _chunks(args[0], args[3], group)
        else:  # c10d.alltoall_(output_tensors, input_tensors, group, ...): one tensor per rank
            group, sources, outputs = _group(args[2]), list(args[1]), [(o, _Layout.of(o)) for o in args[0]]
        specs = [self._spec(t) for t in sources]
        if not sources or any(s is None or not _integral_dtype(s.layout.dtype) for s in specs):
            return
        ep_size, ep_rank = group.size(), group.rank()
        with _real():
            counts = torch.cat([s.value().reshape(-1) for s in specs])
            routed, experts = int(counts.sum()), counts.numel()
        local = math.prod(outputs[0][1].size) if outputs else 0
        if (len(outputs) != ep_size or local * ep_size != experts
                or any(math.prod(lay.size) != local for _, lay in outputs)):
            return  # not a count exchange: every rank sends each its experts' counts
        factor, per_source = self._rows_per_source(routed, experts, local, ep_size, ep_rank)
        flats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage -> (a tensor on it, its values)
        with _real():
            received = torch.full((local,), per_source // local, dtype=counts.dtype)
            received[: per_source % local] += 1
            for t, lay in outputs:  # every rank sends alike
                k = id(storage_of(t))
                if k not in flats:
                    flats[k] = (t, torch.zeros(max(lay.storage_numel, 1), dtype=lay.dtype))
                flats[k][1].as_strided(lay.size, lay.stride, lay.offset).copy_(received.reshape(lay.size))
        for t, flat in flats.values():
            self._set(t, _Node(flat.dtype, lambda flat=flat: flat))
        exchange = Exchange(ep_size, ep_rank, experts, local, routed, per_source * ep_size,
                            (per_source * ep_size / routed) if routed else factor)
        self.exchanges.append(exchange)
        for recorder in _RECORDERS:
            recorder.append(exchange)

    def _rows_per_source(self, routed: int, experts: int, local: int, ep_size: int, ep_rank: int
                         ) -> tuple[float, int]:
        """(factor, rows each rank sends this one) under the load, checked against the routing."""
        factor = self.load.factor_of(ep_rank, ep_size)
        k = next((k for tokens, k, n in reversed(self._topk) if n == experts), None)
        most = None if k is None else routed // k * min(k, local)  # every token, each to min(k, e) of ours
        cap = self.load.max_capacity_factor
        if math.isinf(factor):
            if most is None:
                raise ExpertLoadError(
                    f"the worst case needs the router's top_k, but no topk over the {experts} experts "
                    "ran before the token-count exchange; state a capacity_factor instead")
            rows = most if cap is None else min(most, round(cap * routed / ep_size))
            return rows * ep_size / routed if routed else 0.0, rows
        rows = round(factor * routed / ep_size)
        if most is not None and rows > most:
            raise ExpertLoadError(
                f"capacity_factor {factor:g} asks {rows} rows from each rank for rank {ep_rank}'s "
                f"{local} experts, but its {routed // k} tokens of top_k {k} can send at most {most} "
                f"(capacity_factor {most * ep_size / routed:g}, the worst case)")
        return factor, rows


def _chunks(out: torch.Tensor, splits: Any, group: Any) -> list[tuple[torch.Tensor, _Layout]]:
    """The layouts of ``out``'s chunks along dim 0 by ``splits`` (empty or None: equal ones, one
    per rank of ``group``), each with ``out`` (whose storage it is on)."""
    if not splits:
        splits = [out.shape[0] // group.size()] * group.size()
    whole, chunks, offset = _Layout.of(out), [], out.storage_offset()
    step = out.stride()[0] if out.dim() else 0
    for n in splits:
        chunks.append((out, dataclasses.replace(whole, size=(n, *whole.size[1:]), offset=offset)))
        offset += n * step
    return chunks


def _group(arg: Any) -> dist.ProcessGroup:
    """A c10d op's group argument (the TorchScript box of a ``ProcessGroup``, or one)."""
    return arg if isinstance(arg, dist.ProcessGroup) else dist.ProcessGroup.unbox(arg)


def _integral_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _integral(out: Any) -> bool:
    """An integer or boolean tensor among the outputs (a factory's worth holding values for)."""
    return any(_integral_dtype(t.dtype) for t in op_tensors(out if isinstance(out, (tuple, list)) else (out,)))
