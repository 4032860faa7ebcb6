"""The schedule's timeline of a stage plan's record, every stage timed as the record's stage."""

from __future__ import annotations

from typing import Any

from estimators.pipeline.makespan import simulate, timeline_text
from estimators.pipeline.schedule import ScheduleLayout, schedule_class

__all__ = ["uniform_timeline_text"]


def uniform_timeline_text(record: Any, width: int = 80) -> str:
    """``record``: a ``PipelineRecord`` (schedule name, micro-batches, stages, times)."""
    layout = ScheduleLayout.of(schedule_class(record.schedule), n_microbatches=record.n_microbatches,
                               n_stages=record.n_stages, virtual_stages=record.virtual_stages)
    times = {"F": record.fw_ms, "B": record.bw_ms, "I": record.bw_ms, "W": record.w_ms}
    spans = simulate({r: layout.actions(r) for r in range(layout.n_ranks)}, layout.stage_to_rank(),
                     lambda _s, k: times[k])
    return timeline_text(spans, width)
