"""Kernel timings: each distinct op run on real tensors on this machine, with a cache file.

:class:`BenchmarkRuntime` is the ``RuntimeKind.BENCHMARK`` runtime model. It times an op the first
time it meets its signature (overload, argument layouts, non-tensor arguments), keeps the median
in memory and, with ``cache_path``, in a JSON file (``estimators.runtime.json_cache``) that later runs on
the same hardware read instead of timing again. Ops that cannot run standalone are priced by a
roofline instead (never written to the file).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._ops import OpOverload

from estimators.runtime.device import DeviceSpec, get_device_spec
from estimators.runtime.json_cache import BenchmarkCacheError, JsonTimingCache, is_time
from estimators.runtime.op_facts import hint, op_facts, read_tensors, tensor_bytes, timed_key, written_tensors
from estimators.runtime.op_signatures import OpSignature, TensorSpec, storage_extent, synthetic_tensor
from estimators.runtime.roofline import RooflineRuntime

__all__ = ["BenchmarkRuntime", "BenchmarkCacheError"]

logger = logging.getLogger(__name__)

Args = Sequence[Any]
Kwargs = Mapping[str, Any]

_CACHE_FORMAT = "sac-planner/benchmark-cache"
_CACHE_VERSION = 2  # 2: floating inputs uniform in [0.5, 1), not randn
_STREAM_RUNS = 3
"""Timings (each a median of ``timed_runs``) the streaming bandwidth is the best of."""
_STREAM_MIB = {"cpu": 64, "cuda": 1024}
"""Size of the copy that measures the streaming bandwidth: twice a CPU's last-level cache (32 MiB
on this project's machine), many times a GPU's L2."""


class BenchmarkRuntime:
    """Times each distinct op by running it on real tensors on this machine.

    Inputs are materialised with the traced shape / stride / dtype: fake (or meta) tensors become
    uniform in [0.5, 1) (floating: in every op's domain, see
    ``estimators.runtime.op_signatures.synthetic_tensor``) or zeros (integer / bool, so indices
    stay in range); real tensors are copied, data included. The op runs on these private copies,
    so in-place and random ops never touch the caller's tensors. The time is the median of
    ``timed_runs`` runs after ``warmup_runs``: CUDA events on a GPU; on CPU the ``clock`` (wall
    time, or the calling thread's CPU time). An op that cannot run standalone gets the roofline
    time of ``fallback_spec`` and is counted in :attr:`fallbacks`.

    With ``stream_floor`` no kernel is priced below the time to stream the bytes it
    reads and writes at this device's memory bandwidth, measured once per runtime by a copy
    larger than the caches (:attr:`stream_bytes_per_ms`). The benchmark re-runs a kernel on the
    same operands, so a memory-bound one reads them from the cache; in a step the working set
    evicts them between uses, and such kernels ran well above their warm benchmark
    (docs/accuracy.md#runtimes). Compute-bound kernels are above the floor
    and keep their timing. The cache file holds the raw timings; the floor is applied when an
    op is priced. Off by default: each runtime measures its own bandwidth, and ranks planning
    from shared timings (``planner.distributed.ranks.SharedBenchmark``) must price alike.

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
        clock: str = "auto",
        stream_floor: bool = False,
        stream_bytes_per_ms: float | None = None,
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
            clock: how a CPU kernel is timed. ``"wall"``: ``perf_counter_ns``. ``"thread"``: the
                calling thread's CPU time (``thread_time_ns``), what the kernel ran and not what
                other processes took from it while it ran: steady on a loaded machine and the
                wall time on an idle one, for a kernel on one intra-op thread (needs
                ``torch.get_num_threads() == 1``: other threads' work is not counted).
                ``"auto"``: ``"thread"`` on a CPU with one intra-op thread, else ``"wall"``.
                CUDA kernels are timed by CUDA events whatever the clock.
            stream_floor: price no kernel below its bytes at the device's streaming bandwidth
                (see above); False (default): the warm timings as measured.
            stream_bytes_per_ms: that bandwidth (bytes read and written per ms), where known;
                None: timed on first use.
        """
        self.device = _check_device(torch.device(device))
        self.clock = _check_clock(clock, self.device)
        if min(warmup_runs, timed_runs, autosave_every) < 1 or not max_ms_per_op > 0:
            raise ValueError(
                "warmup_runs, timed_runs and autosave_every must be >= 1, max_ms_per_op > 0"
            )
        self.fallback = RooflineRuntime(get_device_spec(fallback_spec))
        self.warmup_runs, self.timed_runs = warmup_runs, timed_runs
        self.max_ms_per_op = max_ms_per_op
        self.device_label = _device_label(self.device, self.clock)
        self.name = f"benchmark:{self.device_label}"
        self.hits = 0
        """Calls answered from the cache (memory or file), without running the op."""
        self.misses = 0
        """Calls that had to time (or fall back for) a new op signature."""
        self.stream_floor = stream_floor
        if stream_bytes_per_ms is not None and not (is_time(stream_bytes_per_ms) and stream_bytes_per_ms > 0):
            raise ValueError(f"stream_bytes_per_ms must be a finite number > 0, got {stream_bytes_per_ms!r}")
        self._stream_bytes_per_ms = stream_bytes_per_ms
        self._floors: dict[tuple, float] = {}
        self.fallbacks = 0
        """Misses priced by the fallback roofline because the op could not run standalone."""
        self.measurements = 0
        """Kernel timings taken by this runtime (misses and :meth:`benchmark_signature` calls that
        ran the op; fallbacks are not measurements)."""
        # Two layers, filled by one path (_fill): every price by key (fallbacks included) for
        # this process, and the real measurements by repr(key), as the JSON file holds them.
        self._memory: dict[tuple, float] = {}
        self._measured: dict[str, float] = {}
        self._fallback_funcs: set[Any] = set()
        self._autosave_every, self._unsaved = autosave_every, 0
        self._file: JsonTimingCache | None = None
        if cache_path is not None:
            self._file = JsonTimingCache(
                path=Path(cache_path), format=_CACHE_FORMAT, version=_CACHE_VERSION,
                description="benchmark cache", identity={"device": self.device_label},
            )
            self._measured.update(self._file.load())
            # Also save at exit / collection; the finaliser holds the dict, not self.
            weakref.finalize(self, _save_quietly, self._file, self._measured)

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        keys = timed_key(func, args, kwargs, out)
        if keys is None:
            return 0.0
        key, key_repr = keys
        ms = self._lookup(key, key_repr)
        if ms is not None:
            self.hits += 1
        else:
            self.misses += 1
            ms = self._fill(func, key, key_repr, args, kwargs, out)
        if not self.stream_floor:
            return ms
        floor = self._floors.get(key)
        if floor is None:
            floor = self._floors[key] = self.stream_ms(func, args, kwargs, out)
        return max(ms, floor)

    @property
    def stream_bytes_per_ms(self) -> float:
        """Bytes a copy larger than the caches moves per ms on this device (read and written),
        timed on the first call by this runtime's clock, the best of a few timings (or as
        given)."""
        if self._stream_bytes_per_ms is None:
            numel = _STREAM_MIB[self.device.type] * 2**20 // 4
            # Real tensors, whatever mode the caller is in (first asked inside a fake trace).
            with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
                src = torch.rand(numel, device=self.device)
                dst = torch.empty_like(src)
                # The fastest of the runs: another process's traffic only slows a copy.
                ms = min(self._time(lambda: dst.copy_(src)) for _ in range(_STREAM_RUNS))
            self._stream_bytes_per_ms = 2 * 4 * numel / max(ms, 1e-9)
            logger.info("benchmark on %s: no kernel priced below its bytes at %.3g GB/s (a %d MiB copy)",
                        self.device_label, self._stream_bytes_per_ms / 1e6, 4 * numel // 2**20)
        return self._stream_bytes_per_ms

    def stream_ms(self, func: Any, args: Args, kwargs: Kwargs, out: Any) -> float:
        """The floor of ``func``'s time: the bytes it reads and writes over
        :attr:`stream_bytes_per_ms` (0 for an op that moves no data: views, metadata)."""
        facts = op_facts(func)
        if facts.free:
            return 0.0
        moved = sum(map(tensor_bytes, read_tensors(facts, args, kwargs)))
        moved += sum(map(tensor_bytes, written_tensors(facts, args, kwargs, out)))
        return moved / self.stream_bytes_per_ms if moved else 0.0

    def benchmark_signature(self, sig: OpSignature) -> float:
        """Time one recorded op signature (see :class:`SignatureRecorder`), in ms, and cache it.

        The same path as a miss of :meth:`op_runtime_ms`: inputs are materialised from the
        recorded shapes / strides / dtypes; an op that cannot run standalone gets the fallback
        roofline (kept in memory only, like a fallback miss). A signature already cached is not
        timed again.
        """
        ms = self._lookup(sig.key, sig.key_repr)
        if ms is None:
            ms = self._fill(sig.func, sig.key, sig.key_repr, sig.args, sig.kwargs, sig.out)
        return ms

    def export_cache(self) -> dict[str, float]:
        """The measured timings (``repr`` of the cache key -> ms), as the cache file holds them:
        real measurements only, never fallback rooflines."""
        return dict(self._measured)

    def import_cache(self, entries: Mapping[str, float]) -> None:
        """Add measured timings (as from :meth:`export_cache` of a runtime on the same hardware);
        later calls with those signatures are cache hits."""
        bad = [k for k, v in entries.items() if not isinstance(k, str) or not is_time(v)]
        if bad:
            raise BenchmarkCacheError(f"import_cache got malformed entries, e.g. {bad[0]!r}")
        self._measured.update({k: float(v) for k, v in entries.items()})

    def save(self) -> None:
        """Write the measured timings to ``cache_path`` (atomically, merged with the file);
        no-op without one."""
        if self._file is not None:
            self._file.save(self._measured)
            self._unsaved = 0

    def _lookup(self, key: tuple, key_repr: str) -> float | None:
        ms = self._memory.get(key)
        if ms is None:
            ms = self._measured.get(key_repr)
            if ms is not None:
                self._memory[key] = ms
        return ms

    def _fill(self, func: Any, key: tuple, key_repr: str, args: Args, kwargs: Kwargs, out: Any) -> float:
        """Time a new signature (args: tensors or TensorSpecs), or price it by the fallback
        roofline when it cannot run standalone; the one way both layers are filled."""
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
            ms = self.fallback.price(func, *_priceable(args, kwargs, out))
        else:
            # Only real measurements are persisted: a later run must not read a roofline as a timing.
            self._measured[key_repr] = ms
            self._unsaved += 1
            if self._file is not None and self._unsaved >= self._autosave_every:
                self.save()
        self._memory[key] = ms
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
        # Not torch.utils.benchmark.Timer: its timeit() runs its own warm-up on every call, runs
        # at 1 thread unless told, and synchronises the whole device around a wall clock where
        # CUDA events time the stream; the median of single runs is what is cached here.
        timer = {"cuda": _cuda_time_ms, "thread": _thread_time_ms, "wall": _cpu_time_ms}[self.clock]
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


def _priceable(args: Args, kwargs: Kwargs, out: Any) -> tuple[Args, Kwargs, Any]:
    """The call as the roofline can price it: recorded TensorSpecs become meta tensors."""
    values = (*args, *kwargs.values(), *(out if isinstance(out, (list, tuple)) else (out,)))
    if not any(isinstance(v, TensorSpec) or _holds_spec(v) for v in values):
        return args, kwargs, out
    meta, memo = torch.device("meta"), {}
    return (
        [_materialise(a, meta, memo) for a in args],
        {k: _materialise(v, meta, memo) for k, v in kwargs.items()},
        _materialise(out, meta, memo),
    )


def _holds_spec(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, TensorSpec) or _holds_spec(v) for v in value
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


def _check_clock(clock: str, device: torch.device) -> str:
    """The clock a kernel is timed by: ``"cuda"`` (events), ``"thread"`` or ``"wall"``."""
    if clock not in ("auto", "wall", "thread"):
        raise ValueError(f"clock must be 'auto', 'wall' or 'thread', got {clock!r}")
    if device.type == "cuda":
        return "cuda"
    threads = torch.get_num_threads()
    if clock == "thread" and threads != 1:
        raise ValueError(
            f"clock='thread' times the calling thread only and torch runs {threads} intra-op "
            "threads here: call torch.set_num_threads(1) first, or use clock='wall'"
        )
    if clock == "auto":
        return "thread" if threads == 1 else "wall"
    return clock


def _device_label(device: torch.device, clock: str = "wall") -> str:
    """Identifies the hardware timings belong to; a cache file from another label is refused."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    # The thread count changes CPU kernel times as much as the chip does.
    label = f"cpu:{platform.machine()}:{torch.get_num_threads()}threads"
    return label + (":thread-cpu-time" if clock == "thread" else "")


def _materialise(value: Any, device: torch.device, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, TensorSpec):
        if id(value) not in memo:  # specs of one tensor are shared, like the tensor
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
    return hint(value)


def _real_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A private tensor with ``t``'s shape, strides and dtype on ``device``."""
    from torch._subclasses.fake_tensor import FakeTensor

    shape = [hint(s) for s in t.shape]
    stride = [hint(s) for s in t.stride()]
    # Storage span of the view: broadcast (stride-0) and overlapping layouts stay as traced.
    extent = storage_extent(shape, stride)
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        buf = synthetic_tensor(extent, t.dtype, device)
    else:
        span = t.detach().as_strided((extent,), (1,), t.storage_offset())
        buf = span.to(device, copy=True)
    return buf.as_strided(shape, stride, 0)


def _cpu_time_ms(run: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    run()
    return (time.perf_counter_ns() - start) / 1e6


def _thread_time_ms(run: Callable[[], Any]) -> float:
    start = time.thread_time_ns()
    run()
    return (time.thread_time_ns() - start) / 1e6


def _cuda_time_ms(run: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _save_quietly(file: JsonTimingCache, entries: Mapping[str, float]) -> None:
    """Last-chance save at exit / collection: a finaliser reports a failure, never raises."""
    if not entries:
        return
    try:
        file.save(entries)
    except OSError as exc:
        logger.warning("could not save benchmark cache %s: %s", file.path, exc)
