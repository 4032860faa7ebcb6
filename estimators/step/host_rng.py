"""Python's and numpy's global random states, which torch's RNG handling does not cover.

torch's checkpoint replays torch's generators in a recompute (``preserve_rng_state``); a module
that draws from ``random`` or ``numpy.random`` (Wav2Vec2's time masking uses ``np.random``) drew
a second, different mask in the recompute: every gradient of a checkpointed Wav2Vec2 differed
(up to 0.52) with no warning. ``PlannedForward`` keeps these states from the forward for the
recompute with :class:`HostRng`; ``check_gradients`` seeds them with :func:`seed_all`; the trace
puts them back after its step and warns where the step drew from them (:class:`Draws`).

numpy's global generator is read with ``get_state(legacy=False)``, which also works after
``np.random.set_bit_generator`` (the legacy tuple form is MT19937-only). Not covered:
generator objects reachable only outside the module's attributes (a global ``random.Random``
of the user's script, a generator in a closure), the compiled path (a
compiled forward's recompute is torch's), and draws other threads make while a recompute has
set the states back (torch's ``fork_rng`` has the same limit). Cost: reading and comparing the
states once per checkpointed forward (microseconds).
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator

import torch

__all__ = ["Draws", "HostRng", "get_state", "set_state", "same", "seed_all", "preserved", "owned_generators", "owned_states",
           "set_owned_states"]

State = tuple[Any, Any]


def _numpy_random() -> Any:
    np = sys.modules.get("numpy")  # torch imports numpy where it is installed
    return getattr(np, "random", None) if np is not None else None


def get_state() -> State:
    """(``random``'s state, (numpy's global bit generator, its state as a dict) or None)."""
    npr = _numpy_random()
    if npr is None:
        return random.getstate(), None
    return random.getstate(), (npr.get_bit_generator(), npr.get_state(legacy=False))


def set_state(state: State) -> None:
    py, np_state = state
    random.setstate(py)
    npr = _numpy_random()
    if np_state is not None and npr is not None:
        generator, values = np_state
        if npr.get_bit_generator() is not generator:  # the block replaced it (set_bit_generator)
            npr.set_bit_generator(generator)
        npr.set_state(values)


def same(a: State, b: State) -> bool:
    """The two states would give the same draws."""
    if a[0] != b[0] or (a[1] is None) != (b[1] is None):
        return False
    return a[1] is None or (a[1][0] is b[1][0] and _equal(a[1][1], b[1][1]))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        return bool(np.array_equal(a, b))
    return a == b


def seed_all(seed: int) -> None:
    """``torch.manual_seed`` plus ``random.seed`` and, where numpy is loaded, ``np.random.seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    npr = _numpy_random()
    if npr is not None:
        npr.seed(seed % 2**32)


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """The host states as they were on entry, however the block ends."""
    state = get_state()
    try:
        yield
    finally:
        set_state(state)


def owned_generators(module: torch.nn.Module) -> list[Any]:
    """Generator objects held as attributes of ``module`` or its submodules: ``torch.Generator``
    (torch's checkpoint replays only the default generators), ``random.Random``,
    ``numpy.random.Generator`` / ``RandomState``."""
    npr = _numpy_random()
    kinds: tuple = (torch.Generator, random.Random)
    if npr is not None:
        kinds += (npr.Generator, npr.RandomState)
    seen, out = set(), []
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, kinds) and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _gen_state(g: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    if hasattr(g, "bit_generator"):  # numpy Generator
        return g.bit_generator.state
    return g.get_state(legacy=False)  # numpy RandomState


def _set_gen_state(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        g.setstate(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _same_gen_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        # A torch.Generator's state: a fake tensor inside a fake trace, whose bytes cannot be
        # read. Kept as drawn (a CPU generator's few KiB); replaying an undrawn state is a no-op.
        return False
    return _equal(a, b)


def owned_states(module: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(generator, state) of every generator object ``module`` owns (``owned_generators``)."""
    return [(g, _gen_state(g)) for g in owned_generators(module)]


def set_owned_states(states: list[tuple[Any, Any]]) -> None:
    for g, st in states:
        _set_gen_state(g, st)


class HostRng:
    """The host states a checkpointed forward started from, kept only if it drew from them; and
    the states of the generator objects the module owns (``owned_generators``) that it drew
    from: a block drawing its dropout mask from ``self.gen = torch.Generator()`` recomputed
    another mask (5 of 16 gradients off, up to 1.29), one owning a ``random.Random`` drew twice
    per step (the next step's forward differed)."""

    __slots__ = ("start", "owned")

    def __init__(self) -> None:
        self.start: State | None = None
        self.owned: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def forward(self, module: torch.nn.Module | None = None) -> Iterator[None]:
        before = get_state()
        at_start = owned_states(module) if module is not None else []
        yield
        # Most modules draw nothing on the host: keep nothing (``random``'s state is ~24 KB).
        self.start = None if same(before, get_state()) else before
        self.owned = [(g, st) for g, st in at_start if not _same_gen_state(st, _gen_state(g))]

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Replay the forward's draws, then leave the host states as the recompute found them
        (what torch's checkpoint does for torch's generators)."""
        if self.start is None and not self.owned:
            yield
            return
        now = [(g, _gen_state(g)) for g, _ in self.owned]
        try:
            with preserved() if self.start is not None else contextlib.nullcontext():
                if self.start is not None:
                    set_state(self.start)
                set_owned_states(self.owned)
                yield
        finally:
            set_owned_states(now)


class Draws:
    """``with Draws() as d:`` ... then ``d.drew``: whether the block drew from the host
    generators; their states are put back either way."""

    def __init__(self) -> None:
        self.drew = False
        self._start: State | None = None

    def __enter__(self) -> "Draws":
        from estimators.tracing.thread_state import restored_by_last_out

        self._start = get_state()
        # Put back by the last of the threads tracing at once (a thread putting back its own
        # start would put back what another one drew since).
        self._restore = restored_by_last_out("host-rng", get_state, set_state)
        self._restore.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.drew = not same(self._start, get_state())
        self._restore.__exit__(*exc)
