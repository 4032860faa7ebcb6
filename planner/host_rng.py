"""Python's and numpy's global random states, which torch's RNG handling does not cover.

torch's checkpoint replays torch's generators in a recompute (``preserve_rng_state``); a module
that draws from ``random`` or ``numpy.random`` (Wav2Vec2's time masking uses ``np.random``) drew
a second, different mask in the recompute: every gradient of a checkpointed Wav2Vec2 differed
(up to 0.52) with no warning. ``PlannedForward`` keeps these states from the forward for the
recompute with :class:`HostRng`; ``check_gradients`` seeds them with :func:`seed_all`.

numpy is only looked at when the user's code has imported it. ``numpy.random.Generator``
objects a model owns are its own state and are not covered (nor are they by torch).
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator

import torch

__all__ = ["HostRng", "get_state", "set_state", "seed_all", "preserved"]

State = tuple[Any, Any]


def _numpy_random() -> Any:
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


def get_state() -> State:
    """(``random``'s state, ``numpy.random``'s legacy global state or None)."""
    npr = _numpy_random()
    return random.getstate(), (npr.get_state() if npr is not None else None)


def set_state(state: State) -> None:
    py, np_state = state
    random.setstate(py)
    npr = _numpy_random()
    if np_state is not None and npr is not None:
        npr.set_state(np_state)


def _same(a: State, b: State) -> bool:
    if a[0] != b[0]:
        return False
    if (a[1] is None) != (b[1] is None):
        return False
    if a[1] is None:
        return True
    # numpy's legacy state: ('MT19937', keys array, pos, has_gauss, cached_gaussian)
    import numpy as np

    return a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and tuple(a[1][2:]) == tuple(b[1][2:])


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


class HostRng:
    """The host states a checkpointed forward started from, kept only if it drew from them."""

    __slots__ = ("start",)

    def __init__(self) -> None:
        self.start: State | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        before = get_state()
        yield
        # Most modules draw nothing on the host: keep nothing (a state is ~5 KB) for those.
        self.start = None if _same(before, get_state()) else before

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Replay the forward's draws, then leave the host states as the recompute found them
        (what torch's checkpoint does for torch's generators)."""
        if self.start is None:
            yield
            return
        with preserved():
            set_state(self.start)
            yield
