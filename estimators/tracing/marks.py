"""Named positions and storages a step announces while it is traced.

A pipeline stage's micro-batch (``estimators.step.stage_step``) names where its loss, backward
and weight half begin, and the tensors the schedule keeps apart from the step (its loss, the
received output gradient, the input gradient it sends); readers of the trace
(``estimators.pipeline``) find those parts through ``StepTrace.marks`` / ``marked_sids``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from estimators.tracing.records import StepTrace
    from estimators.tracing.trace import StepTracer

__all__ = ["TraceMarks"]


class TraceMarks:
    """What a step marks during ``tracer``'s trace; ``into(trace)`` records it on the trace."""

    def __init__(self, tracer: StepTracer) -> None:
        self.tracer = tracer
        self.positions: dict[str, int] = {}
        self.sids: dict[str, tuple[int, ...]] = {}

    def mark(self, name: str, tensor: torch.Tensor | None = None) -> None:
        """Name the next op's position (``tensor`` None; the first mark of a name holds) or a
        tensor's storage (several tensors may share a name)."""
        if tensor is None:
            self.positions.setdefault(name, len(self.tracer.ops))
            return
        sid = self.tracer.sid_of(tensor)
        if sid is not None:
            self.sids[name] = self.sids.get(name, ()) + (sid,)

    def into(self, trace: StepTrace) -> StepTrace:
        trace.marks.update(self.positions)
        trace.marked_sids.update(self.sids)
        return trace
