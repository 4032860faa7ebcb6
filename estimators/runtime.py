"""Per-op runtime models: a roofline on a DeviceSpec (no GPU needed) or real kernel timings.

The step tracer calls, for every aten op it records (after running it)::

    runtime_ms = model.op_runtime_ms(func, args, kwargs, out)

``args`` / ``kwargs`` / ``out`` may hold FakeTensors (a FakeTensorMode may be active) or real
tensors; both give the same roofline number. Example::

    from estimators.runtime import make_runtime_model
    model = make_runtime_model("roofline", get_device_spec("h100"))
    model.op_runtime_ms(torch.ops.aten.mm.default, (a, b), {}, a @ b)

What the roofline models, exactly:

* ``time = max(flops / (peak(dtype) * compute_efficiency),
  bytes / (bandwidth * bandwidth_efficiency)) + kernel_launch_ms``. ``peak(dtype)`` is the spec's
  peak for the dtype of the op's first floating tensor input (its output's when it has none).
* FLOPs come from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention), plus
  the CPU / "overrideable" fused-attention ops and ``_addmm_activation`` that torch's registry
  lacks. Attention follows torch's convention: ``is_causal`` does not halve the count. Other ops
  count 0 FLOPs, so they are memory-bound by construction.
* Bytes = tensor inputs read + tensor outputs written, per view (not whole storages). A stride-0
  (broadcast) dimension is read once, as torch's own ``get_num_bytes`` does. ``out=`` arguments
  and the ``self`` of write-only ops (``copy_``, ``fill_``, ``zero_``, in-place RNG) are not read.
  Ops that return nothing (``_foreach_add_``) write their mutated arguments.
* Free (0 ms, no launch): views and in-place view ops, metadata queries, allocation-only ops
  (``empty*``, ``resize_``, ``set_``), profiler markers, ``_local_scalar_dense`` (a host read; a
  device sync is not modelled), ops whose written tensors are all empty, ops that touch no bytes.
* Not modelled: collectives and host<->device copies (priced as plain memory ops at device
  bandwidth), cache effects, kernel fusion.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch._ops import OpOverload
from torch.utils import flop_counter

from estimators.device import DeviceSpec, get_device_spec

__all__ = [
    "RuntimeModel",
    "RuntimeKind",
    "RooflineRuntime",
    "BenchmarkRuntime",
    "BenchmarkCacheError",
    "make_runtime_model",
    "op_flops",
    "TensorSpec",
    "OpSignature",
    "SignatureRecorder",
    "benchmark_runtime_override",
]

logger = logging.getLogger(__name__)
aten = torch.ops.aten

FlopFormula = Callable[..., Any]
Args = Sequence[Any]
Kwargs = Mapping[str, Any]


@runtime_checkable
class RuntimeModel(Protocol):
    """Anything that prices one aten op in milliseconds."""

    name: str
    """Short label recorded with the estimates, e.g. ``"roofline:h100"``."""

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        """Estimated runtime of ``func(*args, **kwargs)`` that produced ``out``."""
        ...


class RuntimeKind(enum.Enum):
    """Which RuntimeModel :func:`make_runtime_model` builds."""

    ROOFLINE = "roofline"
    BENCHMARK = "benchmark"


# ----------------------------------------------------------------------------- op classification


def _packets(namespace: Any, names: str) -> frozenset[Any]:
    # getattr with a default: some names exist only in some torch versions of the supported range.
    found = (getattr(namespace, n, None) for n in names.split())
    return frozenset(p for p in found if p is not None)


# View-like ops whose schema does not mark them as views (is_view) yet launch no kernel.
_VIEW_LIKE = _packets(aten, "_unsafe_view unsafe_split unsafe_split_with_sizes unsafe_chunk lift")
_METADATA = _packets(
    aten,
    "sym_size sym_stride sym_numel sym_storage_offset size stride numel dim is_same_size "
    "is_contiguous is_strides_like_format is_non_overlapping_and_dense sym_is_contiguous "
    "_local_scalar_dense _assert_async _assert_scalar _assert_tensor_metadata sym_constrain_range "
    "sym_constrain_range_for_size _functional_sym_constrain_range",
)
# Allocation without initialisation: the caching allocator hands out memory, no kernel runs.
_ALLOCATION = _packets(
    aten, "empty empty_like empty_strided empty_permuted new_empty new_empty_strided resize_ set_"
)
_FREE_PACKETS = _VIEW_LIKE | _METADATA | _ALLOCATION
_FREE_NAMESPACES = frozenset({"prim", "profiler"})
# In-place ops that overwrite ``self`` without reading it: its bytes are written, not read.
_WRITE_ONLY_SELF = _packets(
    aten,
    "copy_ fill_ zero_ normal_ uniform_ random_ bernoulli_ exponential_ geometric_ "
    "log_normal_ cauchy_ _foreach_copy_ _foreach_zero_",
)


# Same convention as torch's registry: the op's raw args, its output as ``out_val``.
def _sdpa_forward_flop(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_backward_flop(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


def _addmm_activation_flop(bias: Any, mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.mm_flop(mat1.shape, mat2.shape)


def _extra_formulas() -> dict[Any, FlopFormula]:
    """Formulas torch's flop_registry lacks; same call convention (raw args, ``out_val=``)."""
    pairs = [
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward_flop),
        ("_scaled_dot_product_fused_attention_overrideable", _sdpa_forward_flop),
        ("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_backward_flop),
        ("_addmm_activation", _addmm_activation_flop),
    ]
    return {getattr(aten, n): f for n, f in pairs if hasattr(aten, n)}


# torch's entries first: where both exist (a future torch), torch's formula wins.
_FLOP_FORMULAS: dict[Any, FlopFormula] = {**_extra_formulas(), **flop_counter.flop_registry}


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    """What one OpOverload needs, computed once per func so the per-call path stays cheap."""

    free: bool
    formula: FlopFormula | None = None
    dynamic_output: bool = False
    """Output shape depends on data: the output joins the cache key."""
    unread: frozenset[int] = frozenset()
    """Argument positions written but not read (``out=``, ``self`` of ``copy_``)."""
    unread_names: frozenset[str] = frozenset()
    """The same arguments by name, for when they come as kwargs."""
    written_args: tuple[tuple[int, str], ...] = ()
    """(position, name) of mutated arguments, for ops that return nothing."""


_OP_INFO: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _classify(func)
    return info


def _classify(func: Any) -> _OpInfo:
    packet = getattr(func, "_overloadpacket", func)
    schema = getattr(func, "_schema", None)
    tags = getattr(func, "tags", ())
    free = (
        getattr(func, "is_view", False)
        or torch.Tag.inplace_view in tags
        or packet in _FREE_PACKETS
        or getattr(func, "namespace", None) in _FREE_NAMESPACES
    )
    if free or schema is None:
        return _OpInfo(free=free, formula=_FLOP_FORMULAS.get(packet))
    written = [
        (i, a.name, a.kwarg_only)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    unread = {(i, n) for i, n, kwarg_only in written if kwarg_only}  # out= buffers
    if packet in _WRITE_ONLY_SELF and written and written[0][0] == 0:
        unread.add(written[0][:2])
    return _OpInfo(
        free=False,
        formula=_FLOP_FORMULAS.get(packet),
        dynamic_output=torch.Tag.dynamic_output_shape in tags,
        unread=frozenset(i for i, _ in unread),
        unread_names=frozenset(n for _, n in unread),
        written_args=tuple((i, n) for i, n, _ in written) if not schema.returns else (),
    )


# ----------------------------------------------------------------------------- signatures and sizes


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


def _hint(x: Any, unknown: int = 0) -> Any:
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


def _safe_signature(values: Any) -> tuple[Any, ...]:
    """Slow path of :func:`_signature` for symbolic shapes and non-strided tensors."""
    sig = []
    for v in values:
        if isinstance(v, torch.Tensor):
            stride = tuple(map(_hint, v.stride())) if v.layout == torch.strided else str(v.layout)
            sig.append((tuple(map(_hint, v.shape)), stride, v.dtype))
        elif isinstance(v, (list, tuple)):
            sig.append(_safe_signature(v))
        else:
            v = _hint(v)
            sig.append(v if _hashable(v) else repr(v))
    return tuple(sig)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _cache_key(func: Any, info: _OpInfo, args: Args, kwargs: Kwargs, out: Any, safe: bool) -> tuple:
    sign = _safe_signature if safe else _signature
    key: tuple = (func, sign(args))
    if kwargs:
        key += (tuple(kwargs), sign(kwargs.values()))
    if info.dynamic_output:
        key += (sign(out if isinstance(out, (list, tuple)) else (out,)),)
    return key


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in this view; a stride-0 (broadcast) dim is read once."""
    try:
        strides = t.stride()
    except (RuntimeError, NotImplementedError):  # sparse and other non-strided layouts
        return _hint(t.numel()) * t.element_size()
    n = 1
    for size, stride in zip(t.shape, strides):
        if type(size) is not int or type(stride) is not int:
            size, stride = _hint(size), _hint(stride)
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def _is_empty(t: torch.Tensor) -> bool:
    """Known to hold no element; a data-dependent size is not known to be 0."""
    return any(_hint(s, unknown=-1) == 0 for s in t.shape)


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_tensors(v))
    return found


def _read_tensors(info: _OpInfo, args: Args, kwargs: Kwargs) -> list[torch.Tensor]:
    if not info.unread:
        return _tensors(args) + _tensors(kwargs.values())
    read = _tensors(a for i, a in enumerate(args) if i not in info.unread)
    read += _tensors(v for k, v in kwargs.items() if k not in info.unread_names)
    return read


def _written_tensors(info: _OpInfo, args: Args, kwargs: Kwargs, out: Any) -> list[torch.Tensor]:
    written = _tensors(out if isinstance(out, (list, tuple)) else (out,))
    for pos, name in info.written_args:
        value = args[pos] if pos < len(args) else kwargs.get(name)
        written += _tensors((value,))
    return written


def _first_float_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
    for t in tensors:
        if t.is_floating_point():
            return t.dtype
    return None


def op_flops(func: Any, args: Args, kwargs: Kwargs, out: Any) -> int:
    """FLOPs of one aten op by torch's flop_counter formulas (plus CPU attention); 0 if none.

    >>> op_flops(torch.ops.aten.mm.default, (torch.ones(2, 3), torch.ones(3, 4)), {}, None)
    48
    """
    formula = _op_info(func).formula
    if formula is None:
        return 0
    return _call_formula(func, formula, args, kwargs, out)


_FORMULA_FAILED: set[Any] = set()


def _call_formula(func: Any, formula: FlopFormula, args: Args, kwargs: Kwargs, out: Any) -> int:
    try:
        # The registry's own convention (FlopCounterMode._count_flops): raw args, output as out_val;
        # its shape_wrapper turns tensors into shapes.
        return int(_hint(formula(*args, **kwargs, out_val=out)))
    except Exception as exc:  # noqa: BLE001 -- any formula bug must not kill a whole trace
        if func not in _FORMULA_FAILED:
            _FORMULA_FAILED.add(func)
            logger.warning("FLOP formula for %s failed (%s); pricing it as memory-bound", func, exc)
        return 0


# ----------------------------------------------------------------------------- roofline


class RooflineRuntime(RuntimeModel):
    """Roofline time of each op on a DeviceSpec; see the module docstring for what is modelled.

    Results are cached by (func, input shapes / strides / dtypes, non-tensor args), so a step with
    tens of thousands of ops prices each distinct op once.
    """

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.name = f"roofline:{spec.name}"
        self._cache: dict[tuple, float] = {}
        self._bytes_per_ms = spec.memory_bandwidth_bytes_per_s * spec.bandwidth_efficiency / 1e3

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        info = _OP_INFO.get(func) or _op_info(func)  # inlined lookup: this is the hot path
        if info.free:
            return 0.0
        try:
            key = _cache_key(func, info, args, kwargs, out, safe=False)
            ms = self._cache.get(key)
        except (TypeError, RuntimeError, NotImplementedError):
            # Symbolic shapes are unhashable, sparse tensors have no strides: slower exact key.
            key = _cache_key(func, info, args, kwargs, out, safe=True)
            ms = self._cache.get(key)
        if ms is None:
            ms = self._cache[key] = self._price(func, info, args, kwargs, out)
        return ms

    def _price(self, func: Any, info: _OpInfo, args: Args, kwargs: Kwargs, out: Any) -> float:
        """Uncached roofline time in ms (``info`` from the op classification)."""
        reads = _read_tensors(info, args, kwargs)
        writes = _written_tensors(info, args, kwargs, out)
        if writes and all(map(_is_empty, writes)):
            return 0.0  # empty outputs: kernels early-exit or are skipped
        moved_bytes = sum(map(_tensor_bytes, writes)) + sum(map(_tensor_bytes, reads))
        flops = _call_formula(func, info.formula, args, kwargs, out) if info.formula else 0
        if moved_bytes == 0 and flops == 0:
            return 0.0
        memory_ms = moved_bytes / self._bytes_per_ms
        compute_ms = 0.0
        if flops:
            dtype = _first_float_dtype(reads) or _first_float_dtype(writes) or torch.float32
            compute_ms = flops / (self.spec.flops_per_s(dtype) * self.spec.compute_efficiency) * 1e3
        return max(memory_ms, compute_ms) + self.spec.kernel_launch_ms

    def __repr__(self) -> str:
        return f"RooflineRuntime({self.spec.name!r}, cached={len(self._cache)})"


# ----------------------------------------------------------------------------- benchmark


class BenchmarkCacheError(ValueError):
    """A benchmark cache file that is corrupt, of another format, or from another device."""


_CACHE_FORMAT = "sac-planner/benchmark-cache"
_CACHE_VERSION = 1


class BenchmarkRuntime(RuntimeModel):
    """Times each distinct op by running it on real tensors on this machine.

    Inputs are materialised with the traced shape / stride / dtype: fake (or meta) tensors become
    ``randn`` (floating) or zeros (integer / bool, so indices stay in range); real tensors are
    copied, data included. The op runs on these private copies, so in-place and random ops never
    touch the caller's tensors. The time is the median of ``timed_runs`` runs after
    ``warmup_runs`` (CUDA events on a GPU, ``perf_counter_ns`` on CPU). An op that cannot run
    standalone gets the roofline time of ``fallback_spec`` and is counted in :attr:`fallbacks`.

    Example::

        bench = BenchmarkRuntime(cache_path="bench_cpu.json")
        ms = bench.op_runtime_ms(torch.ops.aten.mm.default, (a, b), {}, out)
        bench.save()
    """

    def __init__(
        self,
        *,
        device: str | torch.device = "cpu",
        fallback_spec: DeviceSpec | str = "cpu",
        warmup_runs: int = 2,
        timed_runs: int = 5,
        max_ms_per_op: float = 200.0,
        cache_path: str | os.PathLike[str] | None = None,
        autosave_every: int = 64,
    ) -> None:
        """
        Args:
            device: where kernels run: ``"cpu"`` or a CUDA device (needs CUDA).
            fallback_spec: DeviceSpec (or name) whose roofline prices ops that cannot run alone.
            warmup_runs: untimed runs first (>= 1: the first run also proves the op runs).
            timed_runs: most timed runs; their median is the result.
            max_ms_per_op: fewer timed runs (at least 1) for slow ops, to bound the cost.
            cache_path: JSON file timings are loaded from and saved to; ``None``: memory only.
            autosave_every: with ``cache_path``, save after this many new timings (and at exit).
        """
        self.device = _check_device(torch.device(device))
        if min(warmup_runs, timed_runs, autosave_every) < 1 or not max_ms_per_op > 0:
            raise ValueError(
                "warmup_runs, timed_runs and autosave_every must be >= 1, max_ms_per_op > 0"
            )
        self.fallback = RooflineRuntime(get_device_spec(fallback_spec))
        self.warmup_runs, self.timed_runs = warmup_runs, timed_runs
        self.max_ms_per_op = max_ms_per_op
        self.device_label = _device_label(self.device)
        self.name = f"benchmark:{self.device_label}"
        self.hits = 0
        """Calls answered from the cache (memory or file), without running the op."""
        self.misses = 0
        """Calls that had to time (or fall back for) a new op signature."""
        self.fallbacks = 0
        """Misses priced by the fallback roofline because the op could not run standalone."""
        self.measurements = 0
        """Kernel timings taken by this runtime (misses and :meth:`benchmark_signature` calls that
        ran the op; fallbacks are not measurements)."""
        self._memory: dict[tuple, float] = {}
        self._measured: dict[str, float] = {}  # repr(key) -> ms: what the JSON file holds
        self._fallback_funcs: set[Any] = set()
        self._cache_path = Path(cache_path) if cache_path is not None else None
        self._autosave_every, self._unsaved = autosave_every, 0
        if self._cache_path is not None:
            self._measured.update(_load_cache(self._cache_path, self.device_label))
            # Also save at exit / collection; the finaliser holds the dict, not self.
            weakref.finalize(
                self, _save_quietly, self._cache_path, self.device_label, self._measured
            )

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        info = _op_info(func)
        if info.free:
            return 0.0
        key = _cache_key(func, info, args, kwargs, out, safe=True)
        ms = self._memory.get(key)
        if ms is None:
            ms = self._measured.get(repr(key))
            if ms is not None:
                self._memory[key] = ms
        if ms is not None:
            self.hits += 1
            return ms
        self.misses += 1
        ms = self._memory[key] = self._measure_or_fallback(func, info, key, args, kwargs, out)
        return ms

    def benchmark_signature(self, sig: "OpSignature") -> float:
        """Time one recorded op signature (see :class:`SignatureRecorder`), in ms, and cache it.

        The same path as a miss of :meth:`op_runtime_ms`: inputs are materialised from the
        recorded shapes / strides / dtypes; an op that cannot run standalone gets the fallback
        roofline (kept in memory only, like a fallback miss). A signature already cached is not
        timed again.
        """
        ms = self._memory.get(sig.key)
        if ms is None:
            ms = self._measured.get(sig.key_repr)
        if ms is None:
            ms = self._benchmark_signature(sig)
        self._memory[sig.key] = ms
        return ms

    def export_cache(self) -> dict[str, float]:
        """The measured timings (``repr`` of the cache key -> ms), as the cache file holds them:
        real measurements only, never fallback rooflines."""
        return dict(self._measured)

    def import_cache(self, entries: Mapping[str, float]) -> None:
        """Add measured timings (as from :meth:`export_cache` of a runtime on the same hardware);
        later calls with those signatures are cache hits."""
        bad = [k for k, v in entries.items() if not isinstance(k, str) or not _is_time(v)]
        if bad:
            raise BenchmarkCacheError(f"import_cache got malformed entries, e.g. {bad[0]!r}")
        self._measured.update({k: float(v) for k, v in entries.items()})

    def _benchmark_signature(self, sig: "OpSignature") -> float:
        func, info = sig.func, _op_info(sig.func)
        try:
            ms = self._measure(func, sig.args, sig.kwargs)
        except Exception:  # noqa: BLE001 -- any kernel error: "cannot run standalone"
            self.fallbacks += 1
            meta, memo = torch.device("meta"), {}
            args = [_materialise(a, meta, memo) for a in sig.args]
            kwargs = {k: _materialise(v, meta, memo) for k, v in sig.kwargs.items()}
            return self.fallback._price(func, info, args, kwargs, _materialise(sig.out, meta, memo))
        self._measured[sig.key_repr] = ms
        return ms

    def save(self) -> None:
        """Write the measured timings to ``cache_path`` (atomically); no-op without one."""
        if self._cache_path is not None:
            _save_cache(self._cache_path, self.device_label, self._measured)
            self._unsaved = 0

    def _measure_or_fallback(
        self, func: Any, info: _OpInfo, key: tuple, args: Args, kwargs: Kwargs, out: Any
    ) -> float:
        try:
            ms = self._measure(func, args, kwargs)
        except Exception as exc:  # noqa: BLE001 -- any kernel error: "cannot run standalone"
            self.fallbacks += 1
            if func not in self._fallback_funcs:
                self._fallback_funcs.add(func)
                logger.debug(
                    "cannot benchmark %s standalone (%s: %s); using the roofline of %s",
                    func, type(exc).__name__, exc, self.fallback.spec.name,
                )
            return self.fallback._price(func, info, args, kwargs, out)
        # Only real measurements are persisted: a later run must not read a roofline as a timing.
        self._measured[repr(key)] = ms
        self._unsaved += 1
        if self._cache_path is not None and self._unsaved >= self._autosave_every:
            self.save()
        return ms

    def _measure(self, func: Any, args: Args, kwargs: Kwargs) -> float:
        # Leave every dispatch mode (FakeTensorMode, the tracer, user modes): these are our kernels.
        with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
            memo: dict[int, torch.Tensor] = {}
            real_args = [_materialise(a, self.device, memo) for a in args]
            real_kwargs = {k: _materialise(v, self.device, memo) for k, v in kwargs.items()}
            ms = self._time(lambda: func(*real_args, **real_kwargs))
        self.measurements += 1
        return ms

    def _time(self, run: Callable[[], Any]) -> float:
        timer = _cuda_time_ms if self.device.type == "cuda" else _cpu_time_ms
        first_ms = timer(run)  # also proves the op runs at all
        for _ in range(self.warmup_runs - 1):
            timer(run)
        runs = max(1, min(self.timed_runs, int(self.max_ms_per_op / max(first_ms, 1e-6))))
        return statistics.median(timer(run) for _ in range(runs))

    def __repr__(self) -> str:
        return (
            f"BenchmarkRuntime({self.device_label!r}, hits={self.hits}, misses={self.misses}, "
            f"fallbacks={self.fallbacks})"
        )


def _check_device(device: torch.device) -> torch.device:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"BenchmarkRuntime runs on 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "BenchmarkRuntime(device='cuda') needs a CUDA device and this torch sees none; "
            "benchmark on 'cpu' or plan for a GPU with the roofline model (RooflineRuntime)"
        )
    return device


def _device_label(device: torch.device) -> str:
    """Identifies the hardware timings belong to; a cache file from another label is refused."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    # The thread count changes CPU kernel times as much as the chip does.
    return f"cpu:{platform.machine()}:{torch.get_num_threads()}threads"


def _materialise(value: Any, device: torch.device, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, TensorSpec):
        if id(value) not in memo:  # specs of one tensor are shared, like the tensor (see _to_spec)
            memo[id(value)] = value.synthetic(device)
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:  # the same tensor passed twice stays one tensor (aliasing ops)
            memo[id(value)] = _real_tensor(value, device)
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        items = [_materialise(v, device, memo) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, torch.device):
        return device  # factory / _to_copy device args name the traced (fake) device
    return _hint(value)


def _real_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A private tensor with ``t``'s shape, strides and dtype on ``device``."""
    from torch._subclasses.fake_tensor import FakeTensor

    shape = [_hint(s) for s in t.shape]
    stride = [_hint(s) for s in t.stride()]
    # Storage span of the view: broadcast (stride-0) and overlapping layouts stay as traced.
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        buf = _synthetic(extent, t.dtype, device)
    else:
        span = t.detach().as_strided((extent,), (1,), t.storage_offset())
        buf = span.to(device, copy=True)
    return buf.as_strided(shape, stride, 0)


def _synthetic(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        # randn has no kernel for every float dtype (float8): draw in float32 and cast.
        if dtype.itemsize < 2 and not dtype.is_complex:
            return torch.randn(numel, device=device).to(dtype)
        return torch.randn(numel, dtype=dtype, device=device)
    return torch.zeros(numel, dtype=dtype, device=device)


def _cpu_time_ms(run: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    run()
    return (time.perf_counter_ns() - start) / 1e6


def _cuda_time_ms(run: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _load_cache(path: Path, device_label: str) -> dict[str, float]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchmarkCacheError(
            f"benchmark cache {path} is unreadable ({exc}); delete it or pass another cache_path"
        ) from exc
    _check_cache_header(data, path, device_label)
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(_is_time(v) for v in entries.values()):
        raise BenchmarkCacheError(f"benchmark cache {path} has malformed entries; delete it")
    return {str(k): float(v) for k, v in entries.items()}


def _check_cache_header(data: Any, path: Path, device_label: str) -> None:
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT:
        raise BenchmarkCacheError(f"{path} is not a benchmark cache (format {_CACHE_FORMAT!r})")
    if data.get("version") != _CACHE_VERSION:
        raise BenchmarkCacheError(
            f"benchmark cache {path} has version {data.get('version')!r}, this code reads "
            f"{_CACHE_VERSION}; delete it to re-measure"
        )
    if data.get("device") != device_label:
        raise BenchmarkCacheError(
            f"benchmark cache {path} was measured on {data.get('device')!r}, this runtime "
            f"benchmarks on {device_label!r}; pass one cache_path per device"
        )


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _save_quietly(path: Path, device_label: str, entries: Mapping[str, float]) -> None:
    """Last-chance save at exit / collection: a finaliser reports a failure, never raises."""
    if not entries:
        return
    try:
        _save_cache(path, device_label, entries)
    except OSError as exc:
        logger.warning("could not save benchmark cache %s: %s", path, exc)


def _save_cache(path: Path, device_label: str, entries: Mapping[str, float]) -> None:
    try:
        # Merge, do not overwrite: several runtimes (or processes) may share one cache file.
        merged = {**_load_cache(path, device_label), **entries}
    except BenchmarkCacheError:
        merged = dict(entries)  # a foreign or corrupt file was refused at load; replace it
    payload = {
        "format": _CACHE_FORMAT,
        "version": _CACHE_VERSION,
        "device": device_label,
        "torch_version": torch.__version__,
        "entries": merged,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: an interrupted save never leaves a half-written cache behind.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- signatures to share


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a benchmark needs of one tensor argument: shape, strides, dtype (concrete ints)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        """The spec of ``t`` (symbolic sizes by their hints); non-strided layouts are refused."""
        return cls(tuple(map(_hint, t.shape)), tuple(map(_hint, t.stride())), t.dtype)

    def synthetic(self, device: torch.device) -> torch.Tensor:
        """A tensor of this layout on ``device``: ``randn`` if floating, zeros otherwise."""
        shape, stride = list(self.shape), list(self.stride)
        extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        return _synthetic(extent, self.dtype, device).as_strided(shape, stride, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class OpSignature:
    """One distinct op a trace priced, with what :meth:`BenchmarkRuntime.benchmark_signature`
    needs to run it again: the overload and its arguments, tensors as :class:`TensorSpec`."""

    func: Any
    key: tuple
    """The runtime cache key (as :class:`BenchmarkRuntime` computes it)."""
    key_repr: str
    """``repr(key)``: how timings are named in the cache file and across processes."""
    args: tuple
    kwargs: dict
    out: Any


def _to_spec(value: Any, memo: dict[int, TensorSpec]) -> Any:
    """``value`` with every tensor replaced by its :class:`TensorSpec` (one per tensor object)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = TensorSpec.of(value)
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        items = [_to_spec(v, memo) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return _hint(value)


class SignatureRecorder(RuntimeModel):
    """A runtime model that times nothing: it records the distinct op signatures of a trace
    (the ones :class:`BenchmarkRuntime` would time) and prices every op at 0 ms.

    Example::

        recorder = SignatureRecorder()
        with benchmark_runtime_override(recorder):
            estimate(model, inputs, options=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
        bench = BenchmarkRuntime()
        for sig in recorder.signatures():
            bench.benchmark_signature(sig)
    """

    def __init__(self) -> None:
        self.name = "signatures"
        self.skipped = 0
        """Calls of ops with a non-strided tensor (sparse...): not recorded; a BenchmarkRuntime
        times them when it meets them."""
        self._seen: dict[str, OpSignature] = {}

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        info = _op_info(func)
        if info.free:
            return 0.0
        key = _cache_key(func, info, args, kwargs, out, safe=True)
        key_repr = repr(key)
        if key_repr not in self._seen:
            memo: dict[int, TensorSpec] = {}
            try:
                self._seen[key_repr] = OpSignature(
                    func=func, key=key, key_repr=key_repr, args=_to_spec(tuple(args), memo),
                    kwargs={k: _to_spec(v, memo) for k, v in kwargs.items()}, out=_to_spec(out, memo),
                )
            except (RuntimeError, NotImplementedError):  # non-strided tensors have no TensorSpec
                self.skipped += 1
        return 0.0

    def signatures(self) -> list[OpSignature]:
        """The distinct signatures, sorted by ``key_repr`` (the same order in every process that
        traced the same step)."""
        return [self._seen[k] for k in sorted(self._seen)]

    def __repr__(self) -> str:
        return f"SignatureRecorder(signatures={len(self._seen)})"


_BENCHMARK_OVERRIDE: contextvars.ContextVar[RuntimeModel | None] = contextvars.ContextVar(
    "benchmark_runtime_override", default=None
)


@contextlib.contextmanager
def benchmark_runtime_override(model: RuntimeModel):
    """While active, ``make_runtime_model(BENCHMARK, spec)`` (no options) returns ``model``
    instead of a new :class:`BenchmarkRuntime`: how a trace records signatures or uses timings
    shared between processes. Other kinds and calls with options are unaffected.
    """
    token = _BENCHMARK_OVERRIDE.set(model)
    try:
        yield model
    finally:
        _BENCHMARK_OVERRIDE.reset(token)


# ----------------------------------------------------------------------------- factory


def make_runtime_model(kind: RuntimeKind | str, spec: DeviceSpec, **kw: Any) -> RuntimeModel:
    """Build the RuntimeModel of ``kind`` for the target ``spec``.

    ``ROOFLINE`` takes no options. ``BENCHMARK`` takes :class:`BenchmarkRuntime`'s keywords: it
    times kernels on ``device`` (default ``"cuda"`` for a CUDA spec, else ``"cpu"``); ops that
    cannot run get ``spec``'s roofline when ``spec`` is that kind of device, else the cpu spec's.

    >>> make_runtime_model("roofline", get_device_spec("h100")).name
    'roofline:h100'
    """
    kind = _parse_kind(kind)
    if kind is RuntimeKind.ROOFLINE:
        if kw:
            raise TypeError(f"the roofline runtime model takes no options, got {sorted(kw)}")
        return RooflineRuntime(spec)
    override = _BENCHMARK_OVERRIDE.get()
    if override is not None and not kw:
        return override
    device = torch.device(kw.pop("device", "cuda" if spec.is_cuda else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"benchmarking for {spec.name!r} needs a CUDA device and this machine has none: use "
            f"RuntimeKind.ROOFLINE to plan for {spec.name!r} here, or device='cpu' to time this CPU"
        )
    kw.setdefault("fallback_spec", spec if spec.kind == device.type else "cpu")
    return BenchmarkRuntime(device=device, **kw)


def _parse_kind(kind: RuntimeKind | str) -> RuntimeKind:
    if isinstance(kind, RuntimeKind):
        return kind
    try:
        return RuntimeKind(str(kind).strip().lower())
    except ValueError:
        known = ", ".join(k.value for k in RuntimeKind)
        raise ValueError(f"unknown runtime model kind {kind!r}; known kinds: {known}") from None
