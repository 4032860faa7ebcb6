"""Screening tasks run in forked processes: the search's programs of different (TP, CP) degrees
are independent, so on a machine with several cores they are traced and planned side by side
(``SearchOptions.workers``). This process and its children each take the next task none has taken
(``pull_map``), so a long task does not leave the others idle; each child sends back what it
computed, exactly as the parent would have, and a child that fails has its tasks re-run here, so
the result never depends on how the work was split."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import traceback
from typing import Any, Callable

__all__ = ["Forked", "pull_map", "default_workers", "cpu_s"]

logger = logging.getLogger(__name__)


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


def pull_map(fn: Callable[[Any], Any], items: list, workers: int, *,
             child_setup: Callable[[], None] | None = None,
             finish: Callable[[], None] | None = None) -> list[tuple[Any, bool]]:
    """``fn(item)`` for every item, by this process and up to ``workers - 1`` forked children, each
    taking the next item none has taken (give the costliest first: the rest then even out). Returns
    ``(fn(item), whether a child computed it)`` in the items' order: what a child computed it
    counted in its own copy of the caller's state, which the caller adds. ``child_setup`` runs
    first in each child, ``finish`` last in every process (e.g. to close what ``fn`` kept open
    for the next item). A child that fails is logged and its items are computed here."""
    n = len(items)
    ctx = multiprocessing.get_context("fork")
    taken = ctx.Value("i", 0)

    def take() -> int | None:
        with taken.get_lock():
            i = taken.value
            taken.value = i + 1
        return i if i < n else None

    def loop(in_child: bool) -> dict[int, Any]:
        if in_child and child_setup is not None:
            child_setup()
        got = {}
        try:
            while (i := take()) is not None:
                c0 = time.process_time()
                got[i] = fn(items[i])
                logger.debug("task %d of %d: %.1f s CPU in process %d", i, n, time.process_time() - c0, os.getpid())
        finally:
            if finish is not None:
                finish()
        return got

    children = [Forked(loop, True) for _ in range(max(0, min(workers, n) - 1))]
    try:
        got = {i: (v, False) for i, v in loop(False).items()}
        for child in children:
            res = child.result()
            if res is None:
                logger.warning("a screening worker failed; its tasks are run here:\n%s", child.error)
                continue
            got.update({i: (v, True) for i, v in res.items()})
    finally:
        for child in children:
            child.close()
    missing = [i for i in range(n) if i not in got]
    if missing:
        try:
            for i in missing:
                got[i] = (fn(items[i]), False)
        finally:
            if finish is not None:
                finish()
    return [got[i] for i in range(n)]


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
