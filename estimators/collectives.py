"""Collective runtimes: an analytic ring model on a link, or timings measured in a process group.

Two ways to price an all-gather / reduce-scatter / all-reduce / broadcast of ``message_bytes``
over ``group_size`` ranks:

* :class:`AnalyticCollectiveModel`: ``latency_s + factor(n) * message_bytes / bandwidth`` per
  collective, with parameters from an :class:`~estimators.device.Interconnect` (datasheet) or
  fitted to measured points (:meth:`AnalyticCollectiveModel.fit`). No process group needed.
* :class:`CollectiveBenchmark`: runs the collective in an initialised ``torch.distributed`` group
  (gloo on CPU, nccl on GPU) and caches the median time.

``message_bytes`` is always the size of the whole buffer, never a shard:

* all_gather: the gathered (output) buffer, ``group_size`` times one rank's shard;
* reduce_scatter: the (input) buffer that is reduced, ``group_size`` times one rank's output;
* all_reduce and broadcast: the buffer itself.

Ring factors (bytes each rank sends, as a fraction of ``message_bytes``), n = ``group_size``:
all_gather and reduce_scatter ``(n - 1) / n``, all_reduce ``2 (n - 1) / n`` (a reduce-scatter then
an all-gather), broadcast 1 (a pipelined ring: every rank receives the buffer once). A group of one
costs 0. The latency is one fixed cost per collective: it does not grow with n (a fit at one group
size absorbs the ring's per-step latency into it). Not modelled: tree algorithms, protocol switches
with message size, contention with compute, multi-node topologies (one link for all ranks).

Example::

    model = AnalyticCollectiveModel.from_device("h100")
    model.time_ms(Collective.ALL_GATHER, message_bytes=2**30, group_size=8)   # ~2.1 ms on NVLink4
"""

from __future__ import annotations

import datetime
import enum
import functools
import logging
import math
import os
import statistics
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from estimators.device import DeviceSpec, Interconnect, get_device_spec, get_interconnect
from estimators.json_cache import BenchmarkCacheError, JsonTimingCache

__all__ = [
    "Collective",
    "CollectiveCost",
    "CollectivePoint",
    "AnalyticCollectiveModel",
    "CollectiveBenchmark",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveCacheError",
    "CollectiveFitError",
    "ring_factor",
    "bucket_bytes",
]

logger = logging.getLogger(__name__)


class Collective(enum.Enum):
    """The collectives FSDP-style training issues."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


def ring_factor(collective: Collective, group_size: int) -> float:
    """Bytes each rank moves, as a multiple of ``message_bytes`` (ring algorithms).

    >>> ring_factor(Collective.ALL_REDUCE, 8)
    1.75
    """
    _check_collective(collective)
    _check_group_size(group_size)
    n = group_size
    if n == 1:
        return 0.0
    if collective is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n
    if collective is Collective.BROADCAST:
        return 1.0
    return (n - 1) / n


def bucket_bytes(message_bytes: int) -> int:
    """``message_bytes`` rounded up to a power of two (at least 1): the benchmark cache's key.

    >>> bucket_bytes(1000), bucket_bytes(1024), bucket_bytes(1025)
    (1024, 1024, 2048)
    """
    _check_message_bytes(message_bytes)
    return 1 if message_bytes <= 1 else 1 << (message_bytes - 1).bit_length()


# ----------------------------------------------------------------------------- analytic model


class CollectiveFitError(ValueError):
    """Benchmark points that cannot determine a latency and a bandwidth."""


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """Latency and bandwidth of one collective: ``latency_s + factor * bytes / bandwidth``.

    Example::

        CollectiveCost(latency_s=5e-6, bandwidth_bytes_per_s=100e9)
    """

    latency_s: float
    """Fixed cost per collective, seconds."""
    bandwidth_bytes_per_s: float
    """Bytes per second one rank moves; ``math.inf`` when a fit found no size dependence."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(
                f"CollectiveCost.latency_s must be finite and >= 0, got {self.latency_s}"
            )
        if not self.bandwidth_bytes_per_s > 0:  # also rejects NaN
            raise ValueError(
                "CollectiveCost.bandwidth_bytes_per_s must be > 0, "
                f"got {self.bandwidth_bytes_per_s}"
            )

    @classmethod
    def of_link(cls, link: Interconnect) -> "CollectiveCost":
        return cls(latency_s=link.latency_s, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s)


@dataclass(frozen=True, kw_only=True)
class CollectivePoint:
    """One measured (or synthetic) collective time: what :meth:`AnalyticCollectiveModel.fit` takes.

    Example::

        CollectivePoint(collective=Collective.ALL_REDUCE, message_bytes=2**20, group_size=2,
                        runtime_ms=0.41)
    """

    collective: Collective
    message_bytes: int
    """Whole-buffer size, as defined in the module docstring."""
    group_size: int
    """Ranks in the group (>= 2 for a fit: a group of one moves nothing)."""
    runtime_ms: float
    """Measured time of one collective."""

    def __post_init__(self) -> None:
        _check_collective(self.collective)
        _check_message_bytes(self.message_bytes)
        _check_group_size(self.group_size)
        if not (math.isfinite(self.runtime_ms) and self.runtime_ms >= 0):
            raise ValueError(
                f"CollectivePoint.runtime_ms must be finite and >= 0, got {self.runtime_ms}"
            )


@dataclass(frozen=True, kw_only=True)
class AnalyticCollectiveModel:
    """Per collective, ``time = latency_s + ring_factor(collective, n) * message_bytes / bw``.

    Build it from a link (:meth:`from_interconnect`, :meth:`from_device`: every collective shares
    the link's numbers) or fit it to benchmark points (:meth:`fit`: one cost per collective).

    Example::

        link = Interconnect(name="test", bandwidth_bytes_per_s=100e9, latency_s=5e-6)
        model = AnalyticCollectiveModel.from_interconnect(link)
        model.time_ms(Collective.ALL_GATHER, 2**30, 8)   # 0.005 + 7/8 * 2**30 / 1e8 = 9.40024096
    """

    costs: Mapping[Collective, CollectiveCost]
    """Latency and bandwidth of each collective the model prices."""
    name: str = "analytic"
    """Label recorded with estimates, e.g. ``"analytic:nvlink4"``."""

    def __post_init__(self) -> None:
        for collective, cost in self.costs.items():
            _check_collective(collective)
            if not isinstance(cost, CollectiveCost):
                raise ValueError(f"costs[{collective}] must be a CollectiveCost, got {cost!r}")
        if not self.costs:
            raise ValueError("AnalyticCollectiveModel needs the cost of at least one collective")
        # Read-only copy: the frozen model must not change under a caller's dict.
        object.__setattr__(self, "costs", types.MappingProxyType(dict(self.costs)))

    @classmethod
    def from_interconnect(cls, link: Interconnect | str) -> "AnalyticCollectiveModel":
        """Every collective on one link's latency and bandwidth."""
        link = get_interconnect(link)
        cost = CollectiveCost.of_link(link)
        return cls(costs={c: cost for c in Collective}, name=f"analytic:{link.name}")

    @classmethod
    def from_device(cls, device: DeviceSpec | str) -> "AnalyticCollectiveModel":
        """The model of ``device``'s default link (:attr:`DeviceSpec.collective_link`)."""
        spec = get_device_spec(device)
        link = spec.collective_link
        if link is None:
            raise ValueError(
                f"device {spec.name!r} names no interconnect; pass "
                "spec.replace(interconnect=get_interconnect('nvlink4')) or use "
                "AnalyticCollectiveModel.from_interconnect(...)"
            )
        return cls.from_interconnect(link)

    @classmethod
    def fit(
        cls, points: Iterable[CollectivePoint], *, relative_error: bool = True
    ) -> "AnalyticCollectiveModel":
        """Least-squares latency and bandwidth of each collective that has points (both >= 0).

        Args:
            points: at least two distinct ``ring_factor * message_bytes`` per collective, from
                groups of two or more ranks.
            relative_error: minimise squared relative errors (each point weighted by 1 / its
                time), so small messages' latency counts as much as large messages' bandwidth;
                ``False``: plain squared errors in seconds, dominated by the largest messages.

        Example::

            model = AnalyticCollectiveModel.fit(bench.points())
        """
        by_collective: dict[Collective, list[CollectivePoint]] = {}
        for p in points:
            if not isinstance(p, CollectivePoint):
                raise TypeError(f"fit takes CollectivePoint items, got {type(p).__name__}")
            by_collective.setdefault(p.collective, []).append(p)
        if not by_collective:
            raise CollectiveFitError("fit needs benchmark points; got none")
        costs = {c: _fit_one(c, pts, relative_error) for c, pts in by_collective.items()}
        return cls(costs=costs, name="analytic:fit")

    def time_ms(self, collective: Collective, message_bytes: int, group_size: int) -> float:
        """Time of one collective of ``message_bytes`` (whole buffer) over ``group_size`` ranks."""
        factor = ring_factor(collective, group_size)
        _check_message_bytes(message_bytes)
        if factor == 0.0:
            return 0.0
        cost = self.costs.get(collective)
        if cost is None:
            known = ", ".join(c.value for c in self.costs)
            raise KeyError(
                f"{self.name} has no cost for {collective.value} (it prices {known}); "
                "fit it with points of that collective too"
            )
        return (cost.latency_s + factor * message_bytes / cost.bandwidth_bytes_per_s) * 1e3


def _fit_one(
    collective: Collective, points: list[CollectivePoint], relative_error: bool
) -> CollectiveCost:
    x = np.array([ring_factor(collective, p.group_size) * p.message_bytes for p in points], float)
    y_s = np.array([p.runtime_ms for p in points], float) / 1e3
    if np.unique(x[x > 0]).size < 2:
        raise CollectiveFitError(
            f"{collective.value}: a latency and a bandwidth need points at two or more message "
            f"sizes from groups of two or more ranks; got {len(points)} point(s) with bytes moved "
            f"{sorted(set(x.tolist()))}"
        )
    if relative_error and np.any(y_s <= 0):
        raise CollectiveFitError(
            f"{collective.value}: a relative-error fit needs positive runtimes; pass "
            "relative_error=False or drop the zero-time points"
        )
    weight = 1 / y_s if relative_error else np.ones_like(y_s)
    design = np.column_stack([weight, weight * x])
    scale = np.abs(design).max(axis=0)  # equilibrate columns: seconds vs seconds-per-byte
    latency_s, s_per_byte = _nonnegative_lstsq(design / scale, weight * y_s) / scale
    if s_per_byte <= 0:
        logger.warning("%s: the fit found no dependence on message size", collective.value)
    bandwidth = 1 / s_per_byte if s_per_byte > 0 else math.inf
    return CollectiveCost(latency_s=float(latency_s), bandwidth_bytes_per_s=float(bandwidth))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a @ c - b|| over c >= 0, for two columns (exact: an active-set of size 2)."""
    c, *_ = np.linalg.lstsq(a, b, rcond=None)
    if np.all(c >= 0):
        return c
    # The convex optimum lies on a face c[j] = 0: the best one-column fit, clamped at 0.
    faces = []
    for j in range(a.shape[1]):
        col = a[:, j]
        face = np.zeros(a.shape[1])
        face[j] = max(0.0, float(col @ b) / float(col @ col))
        faces.append(face)
    return min(faces, key=lambda f: float(np.linalg.norm(a @ f - b)))


# ----------------------------------------------------------------------------- benchmark


class CollectiveError(RuntimeError):
    """A benchmarked collective failed: a rank died or the process group broke."""


class CollectiveTimeoutError(CollectiveError):
    """A benchmarked collective did not complete within the benchmark's ``timeout_s``."""


class CollectiveCacheError(BenchmarkCacheError):
    """A collective benchmark cache file that is corrupt or of another format / version."""


_CACHE_FORMAT = "sac-planner/collective-benchmark-cache"
_CACHE_VERSION = 1
_KEY_SEP = "|"


class _Key(NamedTuple):
    setup: str
    """Backend, tensor device and dtype, e.g. ``"gloo:cpu:float32"``: timings of one setup never
    answer another."""
    collective: Collective
    group_size: int
    bucket_bytes: int

    def text(self) -> str:
        return _KEY_SEP.join((self.setup, self.collective.value, str(self.group_size),
                              str(self.bucket_bytes)))

    @classmethod
    def parse(cls, text: str) -> "_Key":
        setup, collective, n, nbytes = text.split(_KEY_SEP)
        return cls(setup, Collective(collective), int(n), int(nbytes))


class CollectiveBenchmark:
    """Times collectives in the current ``torch.distributed`` process group, with a cache.

    A miss runs the collective ``1 + timed_runs`` times on a buffer of the message's power-of-two
    bucket (one warm-up, then ``timed_runs`` timed runs, a barrier before each) and keeps the
    median; the ranks then agree on the largest median, so every rank returns the same number.
    Any message in the same bucket, on a group of the same size, backend and dtype, is then
    answered from the cache without running anything. Buffers hold ``dtype`` elements (at least
    one per rank); gloo groups run on CPU tensors, nccl groups on the current CUDA device.

    Every rank of the group must make the same calls in the same order with the same cache
    contents: a rank that hits while another misses leaves the other waiting in the collective,
    which ends in :class:`CollectiveTimeoutError` after ``timeout_s``, not in a hang. After such
    an error the group is unusable: destroy it and initialise a new one.

    Without an initialised group, or under a fake one (``backend="fake"``), :meth:`time_ms`
    returns ``None``: price the collective with an :class:`AnalyticCollectiveModel` instead.

    Example::

        dist.init_process_group("gloo", ...)
        bench = CollectiveBenchmark(cache_path="collectives_gloo.json")
        ms = bench.time_ms(Collective.ALL_GATHER, 64 * 2**20)   # None outside a real group
        model = AnalyticCollectiveModel.fit(bench.points())
    """

    def __init__(
        self,
        *,
        timed_runs: int = 5,
        timeout_s: float = 60.0,
        cache_path: str | os.PathLike[str] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """
        Args:
            timed_runs: timed runs per measurement; their median is the result.
            timeout_s: longest wait for one collective (or barrier) before
                :class:`CollectiveTimeoutError`.
            cache_path: JSON file timings are loaded from and saved to (after every new
                measurement); ``None``: memory only. One file per cluster / link topology.
            dtype: element type of the buffers (reductions sum in it).
        """
        if timed_runs < 1 or not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(
                "timed_runs must be >= 1 and timeout_s finite and > 0, "
                f"got {timed_runs}, {timeout_s}"
            )
        self.timed_runs, self.timeout_s, self.dtype = timed_runs, float(timeout_s), dtype
        self.hits = 0
        """Calls answered from the cache (memory or file) without running a collective."""
        self.misses = 0
        """Calls that had to measure."""
        self.runs = 0
        """Collective launches (warm-ups and timed runs; barriers and agreement not counted)."""
        self.skipped = 0
        """Calls answered ``None``: no process group, or a fake one."""
        self._file: JsonTimingCache | None = None
        self._entries: dict[_Key, float] = {}
        if cache_path is not None:
            self._file = JsonTimingCache(
                path=Path(cache_path), format=_CACHE_FORMAT, version=_CACHE_VERSION,
                description="collective benchmark cache", error=CollectiveCacheError,
            )
            self._entries.update(self._parse(self._file.load()))

    def time_ms(
        self, collective: Collective, message_bytes: int, group: Any = None
    ) -> float | None:
        """Median time of ``collective`` on ``message_bytes`` (whole buffer) over ``group``.

        ``group``: a ProcessGroup, or ``None`` for the default (world) group. Returns ``None``
        when there is no real group to run in (none initialised, or a fake one).
        """
        _check_collective(collective)
        _check_message_bytes(message_bytes)
        if not _real_group(group):
            self.skipped += 1
            return None
        key = _Key(_setup_label(group, self.dtype), collective, dist.get_world_size(group),
                   bucket_bytes(message_bytes))
        ms = self._entries.get(key)
        if ms is not None:
            self.hits += 1
            return ms
        self.misses += 1
        ms = self._entries[key] = self._measure(key, group)
        logger.debug("measured %s: %.4f ms", key.text(), ms)
        self.save()
        return ms

    def points(self) -> list[CollectivePoint]:
        """Every cached timing as a fit point (``message_bytes`` = the bucket size measured)."""
        return [
            CollectivePoint(collective=k.collective, message_bytes=k.bucket_bytes,
                            group_size=k.group_size, runtime_ms=ms)
            for k, ms in sorted(self._entries.items(), key=lambda e: e[0].text())
        ]

    def save(self) -> None:
        """Write the cache to ``cache_path`` (atomic, merged with the file); no-op without one."""
        if self._file is not None:
            self._file.save({k.text(): ms for k, ms in self._entries.items()})

    def _parse(self, entries: Mapping[str, float]) -> dict[_Key, float]:
        try:
            return {_Key.parse(k): ms for k, ms in entries.items()}
        except ValueError as exc:
            raise CollectiveCacheError(
                f"collective benchmark cache {self._file.path} has malformed entries ({exc}); "
                "delete it"
            ) from exc

    # -- measuring

    def _measure(self, key: _Key, group: Any) -> float:
        device = _tensor_device(dist.get_backend(group))
        launch = _launcher(key, group, device, self.dtype)
        sync = torch.zeros(1, device=device)
        run = functools.partial(self._run_once, key, group, launch, sync)
        run()  # warm-up: connections, buffers, algorithm choice
        median_ms = statistics.median(run() for _ in range(self.timed_runs))
        return self._agree(key, group, median_ms, device)

    def _run_once(
        self, key: _Key, group: Any, launch: Callable[[], Any], sync: torch.Tensor
    ) -> float:
        # A 1-element all_reduce is the barrier: it works alike on every backend and device and
        # shares the timeout handling (dist.barrier on nccl needs device ids and guesses them).
        barrier = dist.all_reduce(sync, group=group, async_op=True)
        self._wait(barrier, key, sync.device, "the barrier before")
        start = time.perf_counter_ns()
        work = launch()
        self.runs += 1
        self._wait(work, key, sync.device, "")
        return (time.perf_counter_ns() - start) / 1e6

    def _agree(self, key: _Key, group: Any, median_ms: float, device: torch.device) -> float:
        """The largest median over the ranks: a collective ends when its slowest rank does."""
        value = torch.tensor([median_ms], dtype=torch.float64, device=device)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._wait(work, key, device, "the agreement after")
        return float(value.item())

    def _wait(self, work: Any, key: _Key, device: torch.device, stage: str) -> None:
        start = time.monotonic()
        try:
            if device.type == "cuda":
                _poll(work, self.timeout_s)  # the CPU thread must not block in a dead NCCL group
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 -- backends raise RuntimeError subclasses
            raise _failure(exc, key, stage, time.monotonic() - start, self.timeout_s) from exc

    def __repr__(self) -> str:
        return (
            f"CollectiveBenchmark(hits={self.hits}, misses={self.misses}, runs={self.runs}, "
            f"skipped={self.skipped}, cached={len(self._entries)})"
        )


class _PollTimeout(Exception):
    pass


_SPIN_S = 5e-3
_SLEEP_FRACTION = 1 / 64
_SLEEP_MAX_S = 1e-2


def _poll(work: Any, timeout_s: float) -> None:
    """Wait for ``work`` without blocking in the backend (a dead NCCL group would never return).

    The first ``_SPIN_S`` are a busy check: a short collective is timed to the microsecond. After
    that the thread sleeps between checks, each sleep ``1/64`` of the time waited so far (at most
    10 ms), so a long or hung wait costs no core and adds at most ~1.6 % plus the OS's sleep
    granularity (~0.1 ms) to the time the caller measures around it."""
    start = time.monotonic()
    deadline = start + timeout_s
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise _PollTimeout("timed out")
        waited = now - start
        if waited > _SPIN_S:
            time.sleep(min(waited * _SLEEP_FRACTION, _SLEEP_MAX_S))
    work.wait()  # completed: returns at once, or raises the backend's error


def _failure(
    exc: Exception, key: _Key, stage: str, waited_s: float, timeout_s: float
) -> CollectiveError:
    what = f"{stage} {key.collective.value}".strip()
    subject = (
        f"{what} of a {key.bucket_bytes}-byte buffer (bucket of the message) over "
        f"{key.group_size} ranks ({key.setup})"
    )
    timed_out = isinstance(exc, _PollTimeout) or waited_s >= 0.9 * timeout_s or (
        "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
    )
    if timed_out:
        return CollectiveTimeoutError(
            f"{subject} did not complete within the timeout of {timeout_s:g} s: a rank did not "
            "join (hung, dead, or calling another collective or size; every rank must make the "
            "same calls in the same order). The group is unusable now: destroy and "
            "re-initialise it."
        )
    return CollectiveError(
        f"{subject} failed after {waited_s:.2f} s: {type(exc).__name__}: {exc}. A rank probably "
        "died; the group is unusable now: destroy and re-initialise it."
    )


def _real_group(group: Any) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        logger.debug("no process group is initialised: collective timings fall back")
        return False
    if dist.get_backend(group) == "fake":
        logger.debug("fake process group: collective timings fall back")
        return False
    return True


def _setup_label(group: Any, dtype: torch.dtype) -> str:
    backend = str(dist.get_backend(group))
    device = _tensor_device(backend)
    where = f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else "cpu"
    return f"{backend}:{where}:{str(dtype).removeprefix('torch.')}"


def _tensor_device(backend: str) -> torch.device:
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _launcher(key: _Key, group: Any, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """A closure that starts the collective asynchronously on private buffers; returns its Work."""
    n = key.group_size
    numel = -(-key.bucket_bytes // dtype.itemsize)
    c = key.collective
    if c in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        shard = -(-numel // n)  # whole buffer = n equal shards, >= 1 element each
        full = torch.zeros(n * shard, dtype=dtype, device=device)
        part = torch.zeros(shard, dtype=dtype, device=device)
        if c is Collective.ALL_GATHER:
            return lambda: _all_gather(full, part, group=group, async_op=True)
        return lambda: _reduce_scatter(part, full, group=group, async_op=True)
    buf = torch.zeros(numel, dtype=dtype, device=device)
    if c is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(buf, group=group, async_op=True)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return lambda: dist.broadcast(buf, src=src, group=group, async_op=True)


# torch 2.13 renamed the tensor variants (the old names warn); older torch has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- argument checks


def _check_collective(collective: Any) -> None:
    if not isinstance(collective, Collective):
        known = ", ".join(f"Collective.{c.name}" for c in Collective)
        raise TypeError(f"collective must be one of {known}, got {collective!r}")


def _check_message_bytes(message_bytes: Any) -> None:
    if isinstance(message_bytes, bool) or not isinstance(message_bytes, int) or message_bytes < 0:
        raise ValueError(f"message_bytes must be an int >= 0, got {message_bytes!r}")


def _check_group_size(group_size: Any) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
