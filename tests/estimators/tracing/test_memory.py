"""estimators/tracing/memory.py: the live-bytes timeline and storage categories on hand-built storages,
against values computed by hand (no model, no tracer)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from estimators.tracing.memory import build_timeline
from estimators.contract.module_info import Phase
from estimators.tracing.records import StorageKind, StorageRecord, final_storage_kind

K = StorageKind


def _trace(n_ops: int, storages: list[StorageRecord]) -> SimpleNamespace:
    # build_timeline reads only the op count and the storages.
    return SimpleNamespace(ops=[None] * n_ops, storages=storages)


# Five ops. A storage is alive during op k when alloc_op <= k <= free_op (free_op None: to the end;
# alloc_op -1: there before the step, and not allocated by any op).
#   sid  kind        bytes  alloc  free   alive at ops
#   0    PARAM        100    -1     None   0 1 2 3 4
#   1    INPUT         10    -1     None   0 1 2 3 4
#   2    ACTIVATION    40     0     3      0 1 2 3
#   3    TEMP           8     1     1        1
#   4    TEMP           5     2     4          2 3 4
#   5    GRAD         100     3     None         3 4
_STORAGES = [
    (0, K.PARAM, 100, -1, None), (1, K.INPUT, 10, -1, None), (2, K.ACTIVATION, 40, 0, 3),
    (3, K.TEMP, 8, 1, 1), (4, K.TEMP, 5, 2, 4), (5, K.GRAD, 100, 3, None),
]


def _records():
    return [StorageRecord(sid=s, nbytes=b, alloc_op=a, free_op=f, kind=k) for s, k, b, a, f in _STORAGES]


def test_live_bytes_at_every_op_and_the_peak():
    tl = build_timeline(_trace(5, _records()))
    # op 0: 100 + 10 + 40; op 1: + 8; op 2: - 8 + 5; op 3: + 100 (grad); op 4: - 40 (activation freed)
    assert tl.total.tolist() == [150, 158, 155, 255, 215]
    assert tl.alloc_by_op.tolist() == [40, 8, 5, 100, 0]
    assert (tl.peak_bytes, tl.peak_op_index) == (255, 3)
    assert tl.before(3) == 155 and tl.before(1) == 150 and tl.before(4) == 215
    assert tl.by_kind(3) == {K.PARAM: 100, K.BUFFER: 0, K.INPUT: 10, K.GRAD: 100, K.OPTIMIZER: 0,
                             K.ACTIVATION: 40, K.TEMP: 5}
    assert tl.by_kind(4)[K.ACTIVATION] == 0
    assert np.array_equal(tl.live_by_kind.sum(axis=1), tl.total)


def test_storages_outside_the_ops_and_freed_by_their_own_op():
    records = [
        StorageRecord(sid=0, nbytes=7, alloc_op=1, free_op=1),     # alive during its own op only
        StorageRecord(sid=1, nbytes=3, alloc_op=2, free_op=0),     # a free before the alloc: one op
        StorageRecord(sid=2, nbytes=1000, alloc_op=3, free_op=None),  # after the last op: ignored
    ]
    tl = build_timeline(_trace(3, records))
    assert tl.total.tolist() == [0, 7, 3]
    assert tl.alloc_by_op.tolist() == [0, 7, 3]


def test_final_kind_gives_every_step_storage_its_category():
    rec = [
        StorageRecord(sid=0, nbytes=1, alloc_op=-1, kind=K.PARAM, saved=True),    # registered: kept
        StorageRecord(sid=1, nbytes=1, alloc_op=0, phase=Phase.FW, saved=True),   # activation
        StorageRecord(sid=2, nbytes=1, alloc_op=1, phase=Phase.FW),               # forward temporary
        StorageRecord(sid=3, nbytes=1, alloc_op=2, phase=Phase.BW, saved=True),   # saved in backward: temp
        StorageRecord(sid=4, nbytes=1, alloc_op=3, phase=Phase.BW, saved=True),   # a gradient wins
        StorageRecord(sid=5, nbytes=1, alloc_op=4, phase=Phase.OPTIM),            # optimizer-step temporary
        StorageRecord(sid=6, nbytes=1, alloc_op=0, phase=Phase.FW, saved=True),   # optimizer state wins
    ]
    # Registered storages (alloc_op -1) keep the kind they were registered with; StepTracer.finish
    # gives every storage made during the step the kind final_storage_kind decides.
    kinds = [r.kind if r.alloc_op < 0 else final_storage_kind(r, {4}, {6}) for r in rec]
    assert kinds == [K.PARAM, K.ACTIVATION, K.TEMP, K.TEMP, K.GRAD, K.OPTIMIZER, K.OPTIMIZER]
