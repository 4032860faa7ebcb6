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

from estimators.pipeline.schedule import MAX_MICROBATCHES, MAX_STAGES, ScheduleError, ScheduleLayout, schedule_class
from planner.errors import PlanFormatError
from planner.plan_fields import check_bool, check_float, check_int, check_str, fields_of, short

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
        # Bounded as every field of a plan file (planner.plan_fields): the file may come from
        # anywhere. The pipeline is checked as Pipeline checks it, the stage's rank included.
        check_str("pipeline.schedule", self.schedule, nonempty=True)
        check_int("pipeline.n_microbatches", self.n_microbatches, low=1, high=MAX_MICROBATCHES)
        for name in ("n_stages", "virtual_stages"):
            check_int(f"pipeline.{name}", getattr(self, name), low=1, high=MAX_STAGES)
        if not isinstance(self.stage_index, int) or isinstance(self.stage_index, bool) \
                or not 0 <= self.stage_index < self.n_stages:
            raise PlanFormatError(f"pipeline: stage_index must be in [0, {self.n_stages}), got {short(self.stage_index)}")
        try:
            layout = ScheduleLayout.of(schedule_class(self.schedule), n_microbatches=self.n_microbatches,
                                       n_stages=self.n_stages, virtual_stages=self.virtual_stages)
        except ScheduleError as e:
            raise PlanFormatError(f"pipeline: {e}") from None
        stages = self.rank_stages
        if isinstance(stages, (str, bytes)) or not isinstance(stages, (list, tuple)) or len(stages) > self.n_stages:
            raise PlanFormatError(f"pipeline.rank_stages must list at most n_stages ({self.n_stages}) stages")
        stages = tuple(check_int("pipeline.rank_stages[]", s, high=self.n_stages - 1) for s in stages)
        rank = layout.rank_of(self.stage_index)
        if stages and stages != layout.stages_of(rank):
            raise PlanFormatError(f"pipeline.rank_stages {list(stages)[:8]} are not the stages of stage "
                                  f"{self.stage_index}'s rank {rank} ({list(layout.stages_of(rank))[:8]}) under "
                                  f"{self.schedule} with {self.virtual_stages} stage(s) per rank")
        object.__setattr__(self, "rank_stages", layout.stages_of(rank))
        for name in ("split_backward", "return_outputs"):
            check_bool(f"pipeline.{name}", getattr(self, name))
        if self.split_backward != layout.split_backward:
            raise PlanFormatError(f"pipeline.split_backward is {str(self.split_backward).lower()}, but {self.schedule} "
                                  f"{'splits' if layout.split_backward else 'does not split'} the backward")
        for name in ("fw_ms", "bw_ms", "w_ms", "optim_ms", "makespan_ms"):
            object.__setattr__(self, name, check_float(f"pipeline.{name}", getattr(self, name)))
        object.__setattr__(self, "bubble_fraction", check_float("pipeline.bubble_fraction", self.bubble_fraction, high=1.0))

    def describe(self) -> str:
        virtual = f", {self.virtual_stages} stages per rank" if self.virtual_stages > 1 else ""
        return (f"stage {self.stage_index} of {self.n_stages} ({self.schedule}, {self.n_microbatches} "
                f"micro-batches{virtual})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "PipelineRecord":
        return cls(**fields_of("pipeline", d, cls))
