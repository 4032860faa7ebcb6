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

from typing import Any, Callable

import torch

from planner.errors import PlanMismatchError

__all__ = ["stage_target", "group_weight_backward", "is_pipeline_stage"]


def is_pipeline_stage(obj: Any) -> bool:
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # a torch without distributed
        return False
    return isinstance(obj, _PipelineStageBase)


def stage_target(target: Any, plan) -> tuple[torch.nn.Module, Any]:
    """(the module the plan checkpoints, the ``PipelineStage`` or None); raises
    ``PlanMismatchError`` for a stage other than the plan's, or a split-backward plan given a
    bare module."""
    rec = plan.pipeline
    if is_pipeline_stage(target):
        if rec is not None and (target.stage_index, target.num_stages) != (rec.stage_index, rec.n_stages):
            raise PlanMismatchError(
                f"this plan is for pipeline stage {rec.stage_index} of {rec.n_stages} ({rec.schedule}, "
                f"{rec.n_microbatches} micro-batches), not stage {target.stage_index} of {target.num_stages}: "
                "each stage has its own plan (its schedule holds another number of micro-batches)")
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
