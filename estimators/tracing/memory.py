"""Memory from the trace: live bytes by category at every op, module snapshots, the step peak.

A storage is alive during op k when ``alloc_op <= k <= free_op``. Live bytes are built with one
delta array per category and a cumulative sum, so the whole timeline costs O(ops + storages).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimators.tracing.trace import StepTrace, StorageKind

__all__ = ["MemoryTimeline", "build_timeline", "gradient_writes", "CATEGORY_NAMES"]

CATEGORY_NAMES = {
    StorageKind.PARAM: "parameters",
    StorageKind.BUFFER: "buffers",
    StorageKind.INPUT: "inputs",
    StorageKind.GRAD: "gradients",
    StorageKind.OPTIMIZER: "optimizer state and step temporaries",
    StorageKind.ACTIVATION: "activations (saved for backward)",
    StorageKind.TEMP: "temporaries",
}
_N_KINDS = len(StorageKind)


@dataclass
class MemoryTimeline:
    """Live bytes per category (columns = StorageKind) during each op (rows)."""

    live_by_kind: np.ndarray  # int64 [n_ops, n_kinds]
    alloc_by_op: np.ndarray  # int64 [n_ops]: bytes the op itself allocated
    total: np.ndarray  # int64 [n_ops]

    @property
    def peak_bytes(self) -> int:
        return int(self.total.max()) if len(self.total) else 0

    @property
    def peak_op_index(self) -> int:
        return int(self.total.argmax()) if len(self.total) else -1

    def before(self, op_index: int) -> int:
        """Live bytes just before op ``op_index`` allocated its outputs."""
        return int(self.total[op_index] - self.alloc_by_op[op_index])

    def by_kind(self, op_index: int) -> dict[StorageKind, int]:
        return {k: int(self.live_by_kind[op_index, k]) for k in StorageKind}


def build_timeline(trace: StepTrace) -> MemoryTimeline:
    n = max(len(trace.ops), 1)
    delta = np.zeros((n + 1, _N_KINDS), dtype=np.int64)
    alloc = np.zeros(n, dtype=np.int64)
    for s in trace.storages:
        start = max(s.alloc_op, 0)
        if start >= n:
            continue
        delta[start, s.kind] += s.nbytes
        if s.alloc_op >= 0:
            alloc[s.alloc_op] += s.nbytes
        if s.free_op is not None and s.free_op + 1 <= n:
            delta[max(s.free_op + 1, start + 1), s.kind] -= s.nbytes
    live = np.cumsum(delta[:n], axis=0)
    return MemoryTimeline(live_by_kind=live, alloc_by_op=alloc, total=live.sum(axis=1))


_OWN = (StorageKind.ACTIVATION, StorageKind.TEMP)


def gradient_writes(trace: StepTrace, lo: int, hi: int) -> np.ndarray:
    """At each op of [lo, hi): the gradient bytes written there, for a loop whose gradients are
    None when the backward starts (torch's AccumulateGrad steals ``dw``; FSDP2's unsharded
    parameters in every micro-batch): a gradient counts after the op that writes it, on top
    of what the trace counts.

    The trace accumulates (``grad += dw``, in place) into gradients that exist; such a backward
    instead makes ``dw`` the gradient (the split weight half assigns ``weight.grad = dw``): the
    gradient is ``dw``'s storage, counted once, from ``dw``'s allocation on. The trace counts
    ``dw`` among its own bytes until it frees it, which can be long after the accumulation (the
    weight half keeps a parameter group's ``dw`` tuple while the next group's gradients are
    computed, and a checkpointed module recomputed there), so a gradient is written at the op
    that frees ``dw``, and counts from the op after. A gradient written from a storage of
    another size (a view of a larger one) is written at the accumulating op."""
    storages = {s.sid: s for s in trace.storages}
    grads = {s.sid: s.nbytes for s in trace.storages if s.kind is StorageKind.GRAD}
    writes = np.zeros(max(hi - lo, 0), dtype=np.int64)
    for op in trace.ops[lo:hi]:
        for sid in op.mutated_sids:
            if sid not in grads:
                continue
            nbytes = grads.pop(sid)
            at = op.index
            for src in (storages.get(a) for a in op.arg_sids if a != sid):
                if src is not None and src.kind in _OWN and src.alloc_op >= 0 and src.nbytes == nbytes:
                    at = max(at, hi - 1 if src.free_op is None else min(src.free_op, hi - 1))
                    break
            writes[at - lo] += nbytes
    return writes
