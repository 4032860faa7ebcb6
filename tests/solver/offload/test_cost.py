"""solver/offload/cost.py: which saved outputs a module can send to host, in which order, the copy
time of the first x bytes, and the memory model with offloads beside checkpoints."""

from __future__ import annotations

import pytest

from solver.offload.cost import (
    offload_curve,
    offload_ops,
    offload_take,
    offloadable_bytes,
    predict_offload_peak_bytes,
)
from tests.solver.offload.builders import RATE, MiB, info


def test_offload_order_is_largest_first_and_the_copy_curve_accumulates_per_op():
    i = info(small_op_bytes=1000)
    b0 = i.stats("M.b.0")
    # No size rule: the 1000-byte output is offloadable, taken after the 100 MiB one.
    assert offloadable_bytes(b0) == 100 * MiB + 1000
    assert [op.memory_bytes for op in offload_ops(b0)] == [100 * MiB, 1000]
    assert offload_take(b0, 1) == ([b0.ops[0]], 100 * MiB)
    assert offload_take(b0, 100 * MiB + 1)[1] == 100 * MiB + 1000
    # A host budget left smaller than the big op: it is skipped, the small one taken.
    assert offload_take(b0, 1, cap_bytes=4096) == ([b0.ops[1]], 1000)
    # Copy time per op: bytes / rate + 5 us latency, cumulative.
    assert offload_curve(b0, RATE, 5e-6) == [(0, 0.0), (100 * MiB, pytest.approx(100.005)),
                                             (100 * MiB + 1000, pytest.approx(100.005 + 1000 / MiB + 0.005))]


def test_an_offload_is_gone_from_its_forward_end_until_its_copy_back():
    i = info()
    # 40 MiB of b0 gone from op 10 until op 30 (b1's backward start): 260 at 25, 200 at 35.
    assert predict_offload_peak_bytes(i, {}, {"M.b.0": (40 * MiB, 10, 30)}) == 260 * MiB
    assert predict_offload_peak_bytes(i, {}, {}) == i.peak_bytes
