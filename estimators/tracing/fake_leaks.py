"""Fake tensors a trace left behind in the user's process, found and cleared.

A fake trace runs the user's forward on fake tensors. Code that memoises a tensor across calls
keeps what the trace made: BEiT, Data2VecVision and DINOv3 (transformers 5) build their relative
position index through an ``lru_cache`` keyed on sizes only, so after planning, the user's real
training got that FakeTensor back, and its loss and gradients were fake too (``loss.item()``
raised DataDependentOutputException). Planning must leave the process as it found it::

    with fake_trace_mode() as trace:
        ...                                  # the trace, on tensors of ``trace.mode``
    # on exit: lru caches holding fake tensors of ``mode`` are cleared; any other holder is
    # named in a FakeTensorLeakWarning

The check costs one ``gc.collect`` where the mode outlives the trace (its tensors, or reference
cycles among the trace's objects, keep it alive), and a scan of the heap only where fake
tensors of the mode are still alive after that.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import types
import warnings
import weakref
from typing import Iterator

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["FakeTensorLeakWarning", "FakeTrace", "fake_trace_mode", "left_behind"]

_LEFT: "weakref.WeakValueDictionary[int, FakeTensor]" = weakref.WeakValueDictionary()
"""Fake tensors earlier traces left in the process (reported), while something holds them."""


def left_behind() -> list[FakeTensor]:
    """The fake tensors earlier traces left behind and something still holds (a user's hook
    that appends its output to a list on the model). A later trace must not deep-copy them: a
    copy of a fake tensor whose trace is over crashed the process (segfault) on the third
    ``solve_sac`` of such a model."""
    return list(_LEFT.values())


class FakeTensorLeakWarning(UserWarning):
    """The fake trace left fake tensors in the user's process that the planner could not clear."""


class FakeTrace:
    """Holds the mode of one trace; emptied when the trace ends, so that only what the trace
    left behind keeps the mode alive."""

    def __init__(self, mode: FakeTensorMode | None) -> None:
        self.mode = mode


@contextlib.contextmanager
def fake_trace_mode() -> Iterator[FakeTrace]:
    """A FakeTensorMode for one trace; once the trace is over and its objects are gone, the
    tensors of this mode that something still holds are cleared (lru caches) or reported."""
    box = FakeTrace(FakeTensorMode(allow_non_fake_inputs=True))
    alive = weakref.ref(box.mode)
    try:
        yield box
    except BaseException:
        # The traceback still holds the trace's frames: clear the caches, report nothing.
        _clear(box.mode, report=False)
        raise
    finally:
        box.mode = None
    if alive() is not None:
        gc.collect()  # the trace's own cycles (hooks, closures) go first
    if alive() is not None:
        _clear(alive(), report=True)


_CACHE_SEARCH_DEPTH, _CACHE_SEARCH_NODES = 4, 4096
"""How far up from a left fake tensor the holders are searched for an lru cache: a tensor in a
tuple the cache returns, in ``functools.cache``'s dict, in a fake module copy a method cache
keeps as part of its key (tensor -> parameter table -> module -> key -> dict -> cache)."""


def _lru_caches_holding(tensors: list[FakeTensor]) -> dict[int, functools._lru_cache_wrapper]:
    found: dict[int, functools._lru_cache_wrapper] = {}
    skip = {id(tensors)}
    seen: set[int] = set()
    level: list[object] = list(tensors)
    for _ in range(_CACHE_SEARCH_DEPTH):
        if not level:
            break
        skip.add(id(level))
        nxt: list[object] = []
        # One heap scan a level for all its objects: one per object took 4 minutes where a
        # T5-large's forward raised mid-trace (thousands of fake tensors still alive).
        for r in gc.get_referrers(*level):
            if id(r) in seen or id(r) in skip or isinstance(r, (types.FrameType, types.ModuleType)):
                continue
            seen.add(id(r))
            if isinstance(r, functools._lru_cache_wrapper):
                found[id(r)] = r
            elif len(seen) < _CACHE_SEARCH_NODES and not _is_module_globals(r):
                nxt.append(r)
        level = nxt
    return found


def _is_module_globals(obj: object) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("__name__"), str) and obj.get("__name__") in sys.modules \
        and getattr(sys.modules[obj["__name__"]], "__dict__", None) is obj


def _clear(mode: FakeTensorMode, *, report: bool) -> None:
    left = _tensors_of(mode)
    caches = _lru_caches_holding(left)
    for cache in caches.values():
        cache.cache_clear()
    if not report:
        return
    if caches:
        del left
        gc.collect()
        left = _tensors_of(mode)
    if left:
        for t in left:
            _LEFT[id(t)] = t
        holders = sorted({_describe(r) for r in gc.get_referrers(*left) if r is not left})
        warnings.warn(
            f"the fake trace left {len(left)} fake tensor(s) in this process, held by "
            f"{', '.join(holders[:5]) or 'an unknown object'}: code that keeps tensors across "
            "calls (a cache) now holds fake ones, which real runs would use. Run one real forward "
            "before planning (the cache then holds real tensors), or clear that cache after it.",
            FakeTensorLeakWarning, stacklevel=4)


def _tensors_of(mode: FakeTensorMode) -> list[FakeTensor]:
    # type() rather than isinstance: isinstance reads __class__, which some module objects
    # answer with a deprecation warning.
    return [o for o in gc.get_objects() if type(o) is FakeTensor and o.fake_mode is mode]


def _describe(holder: object) -> str:
    """A holder as a user would look for it."""
    if isinstance(holder, types.FrameType):
        return f"a frame of {holder.f_code.co_qualname}"
    if _is_module_globals(holder):
        return f"a global of {holder['__name__']}"
    if isinstance(holder, dict):
        return "a dict"
    return type(holder).__qualname__
