"""``PipelineRecord``: what a plan for a pipeline stage records of its pipeline (plain data).

A stage's peak is its schedule's: a plan holds for the stage, schedule, micro-batch count and
stage layout it was made for, and ``apply_plan`` refuses it on another stage. The record also
carries the stage's times, from which ``planner.distributed.pipeline.pipeline_step`` lays every
stage's plan out on the schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planner.errors import PlanFormatError

__all__ = ["PipelineRecord"]


@dataclass(frozen=True, kw_only=True)
class PipelineRecord:
    """The pipeline a stage plan was made for, and the stage's times on it."""

    schedule: str
    """The torch schedule class's name (``"Schedule1F1B"``)."""
    n_microbatches: int
    stage_index: int
    """The stage this plan is for."""
    n_stages: int
    virtual_stages: int = 1
    """Stages per rank."""
    rank_stages: tuple[int, ...] = ()
    """Every stage of the rank (planned together: they share its memory)."""
    split_backward: bool = False
    """The schedule runs the backward's input and weight halves apart: the plan must be applied
    to the ``PipelineStage`` (``apply_plan(stage, plan)``), which groups the weight half's
    recompute (one per micro-batch, not one per parameter group)."""
    return_outputs: bool = True
    """``schedule.step(..., return_outputs=...)``: the last stage keeps every output chunk."""
    fw_ms: float = 0.0
    """One micro-batch's forward on this stage (the loss included on the last)."""
    bw_ms: float = 0.0
    """Its backward (split: the input half), the plan's recompute included."""
    w_ms: float = 0.0
    """Split: the weight half, its recompute included."""
    optim_ms: float = 0.0
    makespan_ms: float = 0.0
    """The step on the schedule, every stage timed like this rank's (uniform stages); from every
    stage's plan: ``planner.distributed.pipeline.pipeline_step``."""
    bubble_fraction: float = 0.0
    """This rank's idle share of that step."""

    def __post_init__(self) -> None:
        for name in ("n_microbatches", "n_stages", "virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanFormatError(f"pipeline: {name} must be an int >= 1, got {v!r}")
        if not isinstance(self.stage_index, int) or not 0 <= self.stage_index < self.n_stages:
            raise PlanFormatError(f"pipeline: stage_index must be in [0, {self.n_stages}), got {self.stage_index!r}")
        object.__setattr__(self, "rank_stages", tuple(int(s) for s in self.rank_stages) or (self.stage_index,))

    def describe(self) -> str:
        virtual = f", {self.virtual_stages} stages per rank" if self.virtual_stages > 1 else ""
        return (f"stage {self.stage_index} of {self.n_stages} ({self.schedule}, {self.n_microbatches} "
                f"micro-batches{virtual})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "PipelineRecord":
        if not isinstance(d, dict):
            raise PlanFormatError(f"pipeline must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanFormatError(f"pipeline: unknown field(s) {unknown}")
        try:
            return cls(**{**d, "rank_stages": tuple(d.get("rank_stages", ()))})
        except TypeError as e:
            raise PlanFormatError(f"pipeline: {e}") from None
