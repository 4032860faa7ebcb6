"""How much of each collective a rank's compute stream waits for: the collectives in the step time.

A functional collective (``_c10d_functional.*``, what DTensor issues for tensor, sequence and
context parallelism) runs on the communication stream; eagerly its output is an
``AsyncCollectiveTensor`` that is waited for where it is first used, so the ops between the
collective and that first use overlap it. The traced order of a fake trace waits at once (torch
sees a fake mode and waits eagerly), so the rule reads uses from the storages instead:

    comm_start(c) = max(compute clock when c is issued, comm_end(previous collective))
    comm_end(c)   = comm_start(c) + comm_ms(c)
    an op that reads an output of c (not a view, not a wait) starts at max(clock, comm_end(c))

The compute stream's wait is charged to the collective it waited for: a collective's *exposed*
time. All collectives share one stream (collectives of one rank run in issue order), and every
collective is complete at the end of each phase (the optimizer reads the gradients, a backward
ends with its reductions). Compute does not slow down while a collective runs (no contention).

:func:`exposed_comm_ms` returns, per op index, the exposed time of each collective; the step's
compute-stream time is then ``sum(compute ops) + sum(exposed)`` exactly. :func:`apply_comm_overlap`
makes that the trace's own: each collective's ``runtime_ms`` becomes its exposed time (what it
adds to the step, and to a recompute that re-issues it), its whole time is kept in
``StepTrace.collective_ms``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from estimators.contract.module_info import Phase
from estimators.runtime.collective_ops import is_collective
from estimators.tracing.records import OpRecord, StepTrace
from estimators.tracing.subclasses import SYNC_OPS

__all__ = ["exposed_comm_ms", "apply_comm_overlap"]


def exposed_comm_ms(ops: Sequence[OpRecord], is_collective: Callable[[OpRecord], bool],
                    is_sync: Callable[[OpRecord], bool]) -> dict[int, float]:
    """Exposed ms of every collective op (by op index), given each op's ``runtime_ms`` (a
    collective's: its whole communication time). ``is_sync``: ops that only wait (never stall
    themselves: the first real use does)."""
    clock = comm_free = 0.0
    pending: dict[int, tuple[float, int]] = {}  # output sid -> (comm end, collective op index)
    exposed: dict[int, float] = {}
    phase: Phase | None = None

    def drain() -> None:
        nonlocal clock
        for end, who in sorted(set(pending.values())):
            if end > clock:
                exposed[who] += end - clock
                clock = end
        pending.clear()

    for op in ops:
        if op.phase is not phase:
            drain()
            phase = op.phase
        if not pending and comm_free <= clock:
            # Both streams idle: times from here on are measured from here, so a block's
            # collectives get the same exposed ms wherever the block runs (not a rounding of
            # the step's elapsed time), as a laid-in copy of a block assumes.
            clock = comm_free = 0.0
        if is_collective(op):
            start = max(clock, comm_free)
            comm_free = start + op.runtime_ms
            exposed[op.index] = 0.0
            for sid in op.new_sids:
                pending[sid] = (comm_free, op.index)
            continue
        if pending and not op.is_view and not is_sync(op):
            waits = [pending.pop(s) for s in op.arg_sids if s in pending]
            for end, who in sorted(waits):
                if end > clock:
                    exposed[who] += end - clock
                    clock = end
        clock += op.runtime_ms
    drain()
    return exposed


def apply_comm_overlap(trace: StepTrace) -> None:
    """Charge each collective of ``trace`` only its exposed time (see the module docstring)."""
    full = {op.index: op.runtime_ms for op in trace.ops if is_collective(op.func)}
    if not full:
        return
    exposed = exposed_comm_ms(trace.ops, lambda op: op.index in full, lambda op: op.func in SYNC_OPS)
    for i, ms in exposed.items():
        trace.ops[i].runtime_ms = ms
    trace.collective_ms = full
