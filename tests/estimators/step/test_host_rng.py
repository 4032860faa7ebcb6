"""estimators/step/host_rng.py: Python's and numpy's global random states, saved, compared, restored."""

from __future__ import annotations

import random

import numpy as np
import pytest

from estimators.step import host_rng


@pytest.fixture
def numpy_generator_back():
    saved = np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(saved)


def test_draws_are_seen_and_undone():
    with host_rng.Draws() as quiet:
        pass
    assert not quiet.drew
    random.seed(5), np.random.seed(5)
    first = (random.random(), np.random.rand())
    random.seed(5), np.random.seed(5)
    with host_rng.Draws() as d:
        random.random(), np.random.rand()
    assert d.drew
    assert (random.random(), np.random.rand()) == first  # the block's draws were undone


def test_a_replaced_numpy_bit_generator_is_handled(numpy_generator_back):
    """``np.random.set_bit_generator(PCG64())`` makes the legacy state a dict (and warns): the
    tuple form crashed every checkpointed forward with KeyError."""
    import warnings

    np.random.set_bit_generator(np.random.PCG64(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rng = host_rng.HostRng()
        with rng.forward():
            x = np.random.rand()
        assert rng.start is not None
        np.random.rand()  # the stream moves on
        after = host_rng.get_state()
        with rng.recompute():
            assert np.random.rand() == x  # the forward's draw, replayed
        assert host_rng.same(host_rng.get_state(), after)  # and the stream where it was


def test_a_bit_generator_replaced_inside_the_block_is_put_back(numpy_generator_back):
    """Restoring a PCG64 state into the block's new generator raised ValueError (and, in
    ``Draws.__exit__``, replaced the step's own exception)."""
    np.random.set_bit_generator(np.random.PCG64(1))
    first = np.random.rand()
    np.random.set_bit_generator(np.random.PCG64(1))
    with host_rng.Draws() as d:
        np.random.set_bit_generator(np.random.MT19937(2))
        np.random.rand()
    assert d.drew
    assert np.random.rand() == first
