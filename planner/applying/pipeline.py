"""Applying a pipeline stage's plan: to its ``PipelineStage`` (or to the stage's module).

    apply_plan(stage, plan)          # stage: torch.distributed.pipelining.PipelineStage

A stage's plan holds for that stage of that schedule: given the ``PipelineStage``, its index is
checked against the plan's; a plan for a schedule that splits the backward (zero-bubble) must be
applied there, because it also runs the stage's weight half under one
``torch.utils.checkpoint.GraphExecGroup``. torch's weight half calls ``autograd.grad`` once per
parameter group, and non-reentrant checkpoint recomputes once per call: a checkpointed layer was
recomputed (and its recompute kept) once per group, and full per-layer checkpointing measured
17 % above the unplanned peak instead of 34 % below it (InterleavedZeroBubble, 2 ranks).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from planner.errors import PlanMismatchError

__all__ = ["stage_target", "group_weight_backward", "is_pipeline_stage", "stage_mismatch", "enclosing_stage"]


def is_pipeline_stage(obj: Any) -> bool:
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # a torch without distributed
        return False
    return isinstance(obj, _PipelineStageBase)


def stage_mismatch(rec: Any, stage: Any) -> str | None:
    """Why a plan with pipeline record ``rec`` (None: a plan for one process's step) does not hold
    on ``stage`` (a ``PipelineStage``; None: not a stage), or None."""
    if stage is None:
        return None
    this = f"stage {stage.stage_index} of {stage.num_stages}"
    if rec is None:
        return (f"the plan was made for one process's step, not for pipeline {this} (its schedule holds "
                "several micro-batches at once): plan the stage with PlanOptions(pipeline=Pipeline(...))")
    if (stage.stage_index, stage.num_stages) != (rec.stage_index, rec.n_stages):
        return (f"the plan is for pipeline stage {rec.stage_index} of {rec.n_stages} ({rec.schedule}, "
                f"{rec.n_microbatches} micro-batches), not {this}: each stage has its own plan (its schedule "
                "holds another number of micro-batches)")
    return None


def enclosing_stage(frame: Any, depth: int = 64) -> Any:
    """The ``PipelineStage`` whose method is running below ``frame`` (its caller chain), or
    None: how a plan applied to a bare stage module finds its stage at its first call."""
    if "torch.distributed.pipelining.stage" not in sys.modules:
        return None
    from torch.distributed.pipelining.stage import _PipelineStageBase

    for _ in range(depth):
        if frame is None:
            return None
        if "self" in frame.f_code.co_varnames[:1] and isinstance(frame.f_locals.get("self"), _PipelineStageBase):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def stage_target(target: Any, plan) -> tuple[torch.nn.Module, Any]:
    """(the module the plan checkpoints, the ``PipelineStage`` or None); raises
    ``PlanMismatchError`` for a stage other than the plan's (or a plan made for one process's
    step), or a split-backward plan given a bare module. A bare module's stage is checked at its
    first call (``PlannedForward.expect``)."""
    rec = plan.pipeline
    if is_pipeline_stage(target):
        why = stage_mismatch(rec, target)
        if why is not None:
            raise PlanMismatchError(why)
        return target.submod, target
    if rec is not None and rec.split_backward:
        raise PlanMismatchError(
            f"this plan is for stage {rec.stage_index} of a {rec.schedule} pipeline, which splits the backward: "
            "apply it to the PipelineStage (apply_plan(stage, plan)), which also makes the weight half "
            "recompute each checkpointed module once (not once per parameter group)")
    return target, None


def group_weight_backward(stage: Any) -> Callable[[], None]:
    """Run ``stage.backward_weight_one_chunk`` under one ``GraphExecGroup``; returns the undo."""
    from torch.utils.checkpoint import GraphExecGroup

    original = stage.__dict__.get("backward_weight_one_chunk")
    bound = stage.backward_weight_one_chunk

    def grouped(*args, **kwargs):
        with GraphExecGroup():
            return bound(*args, **kwargs)

    grouped.sac_planner_grouped = True
    stage.backward_weight_one_chunk = grouped

    def undo() -> None:
        if stage.__dict__.get("backward_weight_one_chunk") is grouped:
            if original is None:
                del stage.__dict__["backward_weight_one_chunk"]
            else:
                stage.backward_weight_one_chunk = original
    return undo
