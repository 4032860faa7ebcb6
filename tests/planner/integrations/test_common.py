"""planner/integrations/common.py: the batch a framework integration plans from is read without
taking it from the run."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from planner.integrations.common import peek_batch


class _OnePass(IterableDataset):
    """A stream read once (a socket, a generator): every iterator continues the same one."""

    def __init__(self, n):
        self.rows = iter(torch.arange(n, dtype=torch.float32).unsqueeze(1))

    def __iter__(self):
        return self.rows


def test_a_single_pass_stream_gives_the_run_every_example_after_a_peek():
    loader = DataLoader(_OnePass(10), batch_size=4)
    batch = peek_batch(loader)
    assert batch.flatten().tolist() == [0, 1, 2, 3] and type(loader.dataset) is not _OnePass
    assert [b.flatten().tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert type(loader.dataset) is _OnePass  # as it was, once the run began
    assert [b.tolist() for b in peek_batch(DataLoader(_OnePass(2), batch_size=None))] == [0]


def test_a_shuffled_map_style_loader_draws_the_run_the_same_order():
    data = TensorDataset(torch.arange(8.0))
    torch.manual_seed(1)
    ref = [b[0].tolist() for b in DataLoader(data, batch_size=2, shuffle=True)]
    torch.manual_seed(1)
    loader = DataLoader(data, batch_size=2, shuffle=True)
    assert peek_batch(loader)[0].tolist() == ref[0]
    assert [b[0].tolist() for b in loader] == ref


def test_an_empty_stream_says_there_is_nothing_to_plan():
    with pytest.raises(ValueError, match="yields no example"):
        peek_batch(DataLoader(_OnePass(0), batch_size=2))
