"""The search's report: what it tells a reader beyond the table."""

from __future__ import annotations

import pytest

from examples.llama import llama_tiny
from planner.search import Cluster, SearchOptions, SearchSpace, search

pytestmark = pytest.mark.slow


def _search(micro_batches):
    space = SearchSpace(tp=(1,), cp=(1,), pp=(1,), micro_batches=micro_batches, hsdp=False)
    return search(llama_tiny, Cluster.parse("2xcpu", budget_gib=1.0), global_batch=8, seq_len=32,
                  options=SearchOptions(space=space))


def test_a_winner_at_the_largest_micro_batch_with_room_to_spare_is_told_to_try_larger():
    r = _search((1,))
    assert r.winner.layout.micro_batch == 1 and r.winner.layout.accumulation == 4
    assert "the winner runs the largest micro-batch tried (1)" in r.table_text()
    assert "try --micro-batches 1,2 (SearchSpace.micro_batches)" in r.table_text()


def test_no_hint_where_the_winner_does_not_accumulate():
    r = _search((1, 2, 4))
    assert r.winner.layout.micro_batch == 4 and r.winner.layout.accumulation == 1
    assert "largest micro-batch tried" not in r.table_text()
