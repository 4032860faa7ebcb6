"""estimators/tracing/comm_overlap.py: a collective costs what the compute stream waits for (hand-computed)."""

from __future__ import annotations

import pytest

from estimators.contract.module_info import Phase
from estimators.tracing.comm_overlap import exposed_comm_ms
from estimators.tracing.records import OpRecord

COLL, COMPUTE, WAIT, VIEW = "coll", "compute", "wait", "view"


def _ops(*rows):
    """rows: (kind, runtime_ms, new_sids, arg_sids[, phase])."""
    out = []
    for i, row in enumerate(rows):
        kind, ms, new, args, *phase = row
        out.append(OpRecord(index=i, func=kind, phase=phase[0] if phase else Phase.FW, call=-1, runtime_ms=ms,
                            new_sids=tuple(new), arg_sids=tuple(args), is_view=kind == VIEW, mutated_sids=(),
                            is_random=False))
    return out


def _exposed(ops):
    return exposed_comm_ms(ops, lambda op: op.func == COLL, lambda op: op.func == WAIT)


def test_compute_before_the_first_use_hides_the_collective():
    ops = _ops((COLL, 4.0, [10], [1]), (COMPUTE, 2.0, [2], [1]), (WAIT, 0.0, [], [10]),
               (VIEW, 0.0, [], [10]), (COMPUTE, 1.0, [3], [10]))
    # issued at 0, done at 4; 2 ms of independent compute; the first real use waits 2 ms.
    assert _exposed(ops) == {0: pytest.approx(2.0)}


def test_a_fully_hidden_collective_costs_nothing():
    ops = _ops((COLL, 1.0, [10], [1]), (COMPUTE, 3.0, [2], [1]), (COMPUTE, 1.0, [3], [10]))
    assert _exposed(ops) == {0: 0.0}


def test_collectives_queue_on_one_stream_and_the_wait_goes_to_the_one_waited_for():
    ops = _ops((COLL, 4.0, [10], [1]), (COLL, 4.0, [11], [1]), (COMPUTE, 1.0, [2], [1]),
               (COMPUTE, 1.0, [3], [11]), (COMPUTE, 1.0, [4], [10]))
    # c1 runs 0-4, c2 4-8; the reader of c2 at t=1 waits until 8 (7 ms); c1 is done by then.
    assert _exposed(ops) == {0: 0.0, 1: pytest.approx(7.0)}


def test_every_collective_is_complete_at_the_end_of_its_phase():
    ops = _ops((COLL, 5.0, [10], [1], Phase.BW), (COMPUTE, 1.0, [2], [1], Phase.BW),
               (COMPUTE, 1.0, [3], [1], Phase.OPTIM))
    assert _exposed(ops) == {0: pytest.approx(4.0)}


def test_the_compute_stream_time_is_compute_plus_exposed_exactly():
    ops = _ops((COLL, 4.0, [10], [1]), (COMPUTE, 2.0, [2], [1]), (COMPUTE, 1.0, [3], [10]),
               (COLL, 3.0, [11], [3]), (COMPUTE, 1.0, [4], [2]), (COMPUTE, 2.0, [5], [11], Phase.BW))
    exposed = _exposed(ops)
    # c1: 0-4, read at 2 -> +2, clock 5; c2: 5-8; compute to 6; phase end drains to 8 (+2).
    assert exposed == {0: pytest.approx(2.0), 3: pytest.approx(2.0)}
    compute = sum(op.runtime_ms for op in ops if op.func == COMPUTE)
    assert compute + sum(exposed.values()) == pytest.approx(10.0)
