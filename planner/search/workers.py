"""Screening shards run in forked processes: the search's whole-model programs of different
(TP, CP) degrees are independent, so on a machine with several cores they are traced and planned
side by side (``SearchOptions.workers``). Each child computes its shard exactly as the parent
would and sends back what it found; a child that fails is re-run here, so the result never
depends on how the work was split."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from typing import Any, Callable

__all__ = ["Forked", "balanced_shards", "default_workers", "cpu_s"]


def cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the workers)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


class Forked:
    """``fn(arg)`` in a forked child; ``result()`` its value, or None where the child failed
    (the caller then computes it itself)."""

    def __init__(self, fn: Callable[[Any], Any], arg: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_run, args=(fn, arg, send), daemon=True)
        self._proc.start()
        send.close()
        self.error = ""

    def result(self) -> Any:
        try:
            kind, value = self._recv.recv()
        except EOFError:
            kind, value = "error", "the worker ended without an answer"
        finally:
            self._recv.close()
            self._proc.join()
        if kind == "ok":
            return value
        self.error = value
        return None

    def close(self) -> None:
        """Ends the child where its result was never read (the parent failed first)."""
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()
        self._recv.close()


def _run(fn: Callable[[Any], Any], arg: Any, send) -> None:
    try:
        out = ("ok", fn(arg))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-runs the shard
        out = ("error", traceback.format_exc(limit=8))
    try:
        send.send(out)
    except Exception:  # noqa: BLE001 - an answer that does not pickle: the parent re-runs it
        send.send(("error", traceback.format_exc(limit=4)))
    finally:
        send.close()


def balanced_shards(items: list, cost: Callable[[Any], float], n: int) -> list[list]:
    """``items`` in at most ``n`` shards of about equal total ``cost`` (largest first to the
    lightest shard), each shard in the items' own order; empty shards dropped."""
    n = max(1, min(n, len(items)))
    load = [0.0] * n
    where: dict[int, int] = {}
    for i in sorted(range(len(items)), key=lambda i: -cost(items[i])):
        k = min(range(n), key=load.__getitem__)
        where[i] = k
        load[k] += cost(items[i])
    shards = [[x for i, x in enumerate(items) if where[i] == k] for k in range(n)]
    return [s for s in shards if s]


def default_workers() -> int:
    """Processes the screening uses by default: ``SAC_SEARCH_WORKERS`` where set (the test suite
    sets 1: its own workers already fill the cores), else one per core, at most 4 (each holds a
    model's traces: about 1 GiB for a 405B search)."""
    env = os.environ.get("SAC_SEARCH_WORKERS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"SAC_SEARCH_WORKERS must be an int >= 1, got {env!r}")
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))
