"""Process-wide settings a trace needs changed, changed for the tracing thread alone.

A trace runs the user's step under its own dispatch modes, and a few things it needs set are
process-wide in torch or Python: torch.compile's stance, a transformers module's functions, the
cyclic garbage collector. Set and restored around each trace, two traces in two threads restore
each other's values (the stance was left at ``force_eager`` for the whole process, so
``torch.compile`` compiled nothing in any thread), and a thread that is not planning sees the
planner's value meanwhile. Here each is changed for the threads that are tracing only, set up by
the first thread in and taken down by the last one out (a lock orders them):

* :func:`eager_in_this_thread`: ``torch.compile``'d code run by this thread runs eagerly, as under
  ``torch.compiler.set_stance("force_eager")``; every other thread compiles as it did.
* :func:`patched_in_this_thread`: ``owner.name`` is ``replacement`` in this thread, the original
  in every other.
* :func:`gc_paused`: the collector is off while any thread builds a trace's records.
* :func:`restored_by_last_out` / :func:`torch_rng_restored`: a state the threads inside may
  change (the random generators a real-mode step draws from) is put back as the first thread in
  found it when the last one leaves; each thread putting back its own start put back what
  another thread's step had drawn since.

Not covered: draws that a thread which is not planning makes while a trace runs are undone with
the trace's (as ``torch.random.fork_rng`` undoes them).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Callable, Iterator

__all__ = ["eager_in_this_thread", "patched_in_this_thread", "original", "gc_paused", "restored_by_last_out",
           "torch_rng_restored"]

_lock = threading.Lock()
_local = threading.local()


# ----------------------------------------------------------------------------- torch.compile


def _in_planning_thread() -> bool:
    return getattr(_local, "eager", 0) > 0


_eager_class: dict[type, type] = {}
"""torch's stance class -> its subclass that answers ``force_eager`` to planning threads."""


def _eager_subclass(cls: type) -> type:
    sub = _eager_class.get(cls)
    if sub is None:
        def stance(self) -> str:
            return "force_eager" if _in_planning_thread() else self.__dict__["stance"]

        def set_stance(self, value: str) -> None:
            self.__dict__["stance"] = value

        sub = _eager_class[cls] = type(f"{cls.__name__}EagerWhilePlanning", (cls,),
                                       {"stance": property(stance, set_stance), "__module__": __name__})
    return sub


_stances: list[tuple[Any, type]] = []
"""The stance objects made thread-aware, with their own classes (restored by the last thread out)."""
_eager_users = 0


@contextlib.contextmanager
def eager_in_this_thread() -> Iterator[None]:
    """In this thread, compiled code runs its Python eagerly (no compile, no cached graph, no
    code object marked to skip): the step's eager ops are what a trace records, and dynamo
    would otherwise trace the tracer's own dispatch code, or give up on the user's compiled
    function under a dispatch mode and mark it never to compile again.

    How: torch reads the stance from one object, ``torch._dynamo.eval_frame._stance``, at every
    entry to compiled code (``_callback_from_stance``, the fullgraph check). Its class becomes a
    subclass whose ``stance`` answers ``"force_eager"`` in threads inside this context and the
    object's own value in every other thread; the last thread out gives it its class back. A
    stance another thread sets meanwhile (``torch.compiler.set_stance``) is a new object: the
    next thread in makes that one thread-aware too, a thread already tracing sees its value."""
    global _eager_users
    from torch._dynamo import eval_frame

    with _lock:
        current = eval_frame._stance
        if type(current) not in _eager_class.values():
            _stances.append((current, type(current)))
            current.__class__ = _eager_subclass(type(current))
        _eager_users += 1
    _local.eager = getattr(_local, "eager", 0) + 1
    try:
        yield
    finally:
        _local.eager -= 1
        with _lock:
            _eager_users -= 1
            if _eager_users == 0:
                for obj, cls in _stances:
                    obj.__class__ = cls
                _stances.clear()


# ----------------------------------------------------------------------------- module attributes


class _Slot:
    """One patched attribute: its original and how many threads patch it."""

    def __init__(self, owner: Any, name: str, original: Any) -> None:
        self.owner, self.name, self.original, self.users = owner, name, original, 0
        key = (id(owner), name)

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            stack = getattr(_local, "patches", {}).get(key)
            return (stack[-1] if stack else self.original)(*args, **kwargs)

        dispatch.__wrapped__ = original  # inspect.signature and friends see the original
        self.dispatch = dispatch


_slots: dict[tuple[int, str], _Slot] = {}


def original(owner: Any, name: str) -> Any:
    """``owner.name`` as it is outside every :func:`patched_in_this_thread` (what a replacement
    calls: the attribute itself may be the dispatcher, which would call the replacement again)."""
    with _lock:
        slot = _slots.get((id(owner), name))
        return slot.original if slot is not None else getattr(owner, name)


@contextlib.contextmanager
def patched_in_this_thread(owner: Any, name: str, replacement: Callable) -> Iterator[None]:
    """``owner.name`` (a module's function) calls ``replacement`` in this thread and the original
    in every other, until the context ends; nested and concurrent uses stack."""
    key = (id(owner), name)
    with _lock:
        slot = _slots.get(key)
        if slot is None:
            slot = _slots[key] = _Slot(owner, name, getattr(owner, name))
            setattr(owner, name, slot.dispatch)
        slot.users += 1
    patches = _local.__dict__.setdefault("patches", {})
    patches.setdefault(key, []).append(replacement)
    try:
        yield
    finally:
        patches[key].pop()
        if not patches[key]:
            del patches[key]
        with _lock:
            slot.users -= 1
            if slot.users == 0:
                del _slots[key]
                if getattr(owner, name, None) is slot.dispatch:  # else someone replaced it since: theirs stays
                    setattr(owner, name, slot.original)


# ----------------------------------------------------------------------------- the collector

_gc_users = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off while any thread is inside, back as the first thread found it
    when the last one leaves. Building the records of a step makes a hundred thousand objects
    and no reference cycles: the collector's passes over the whole heap meanwhile (a tenth of
    the time) find nothing. Never around the traced step, whose frees the trace records."""
    global _gc_users, _gc_was_enabled
    with _lock:
        if _gc_users == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_users += 1
    try:
        yield
    finally:
        with _lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_was_enabled:
                gc.enable()


# ----------------------------------------------------------------------------- shared states

_saved: dict[Any, list] = {}
"""key -> [threads inside, the state the first one found]."""


@contextlib.contextmanager
def restored_by_last_out(key: Any, get: Callable[[], Any], put: Callable[[Any], None]) -> Iterator[None]:
    """``put`` back the state ``get`` read when the first thread entered (for ``key``), once the
    last thread inside leaves; nested uses in one thread count as threads."""
    with _lock:
        entry = _saved.get(key)
        if entry is None:
            entry = _saved[key] = [0, get()]
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            last = entry[0] == 0
            if last:
                del _saved[key]
        if last:
            put(entry[1])


def torch_rng_restored(devices: list[int] | tuple[int, ...] = ()) -> contextlib.AbstractContextManager:
    """``torch.random.fork_rng(devices)`` for threads that trace at once: torch's CPU generator and
    those of the CUDA ``devices`` as the first thread in found them, once the last one leaves."""
    import torch

    def get() -> tuple:
        return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]

    def put(state: tuple) -> None:
        torch.set_rng_state(state[0])
        for d, s in zip(devices, state[1]):
            torch.cuda.set_rng_state(s, d)

    return restored_by_last_out(("torch-rng", tuple(devices)), get, put)
