"""Collective timings measured in an initialised ``torch.distributed`` process group, cached.

:class:`CollectiveBenchmark` runs all-gather / reduce-scatter / all-reduce / broadcast (gloo on
CPU, nccl on GPU), keeps the median per power-of-two bucket of ``message_bytes`` (whole buffer,
as in ``estimators.runtime.collectives``), and saves it in a JSON file (``estimators.runtime.json_cache``). Its
points fit an :class:`~estimators.runtime.collectives.AnalyticCollectiveModel`::

    bench = CollectiveBenchmark(cache_path="collectives_gloo.json")
    model = AnalyticCollectiveModel.fit(bench.points())
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.distributed as dist

from estimators.runtime.collectives import (
    Collective,
    CollectivePoint,
    bucket_bytes,
    check_collective,
    check_message_bytes,
)
from estimators.runtime.json_cache import BenchmarkCacheError, JsonTimingCache

__all__ = ["CollectiveBenchmark", "CollectiveError", "CollectiveTimeoutError", "CollectiveCacheError"]

logger = logging.getLogger(__name__)


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
        check_collective(collective)
        check_message_bytes(message_bytes)
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
    if c is Collective.ALL_TO_ALL:
        out = torch.empty_like(buf)
        return lambda: dist.all_to_all_single(out, buf, group=group, async_op=True)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return lambda: dist.broadcast(buf, src=src, group=group, async_op=True)


# torch 2.13 renamed the tensor variants (the old names warn); older torch has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
