"""Pipeline parallelism (``torch.distributed.pipelining``): one plan per stage, made for the
micro-batches its schedule keeps in flight.

    from planner import PlanOptions, TrainStep, apply_plan, solve_sac
    from planner.distributed.pipeline import Pipeline

    options = PlanOptions(device="h100", pipeline=Pipeline(Schedule1F1B, n_microbatches=8,
                                                           stage_index=rank, n_stages=4))
    plan = solve_sac(stage_module, budget_gib=70, step=TrainStep(inputs=h_mb, loss_fn=loss_fn,
                     optimizer="adamw", target=labels_mb if last else None), options=options)
    stage = PipelineStage(stage_module, rank, 4, device)
    apply_plan(stage, plan)

A rank that runs several stages (interleaved and zero-bubble schedules) plans them together:
``solve_pipeline_rank({s: (module_s, step_s) for s in rank_stages}, budget_gib, options=options)``
returns one plan per stage. ``pipeline_step(plans)`` lays every stage's plan out on the schedule:
the step's makespan, each rank's idle share and timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from estimators.pipeline.makespan import Span, bubble_fractions, makespan_ms, simulate, timeline_text
from estimators.pipeline.schedule import ScheduleLayout, schedule_class
from planner.errors import PlanningError
from planner.options import Pipeline
from planner.plan import Plan
from planner.plan_pipeline import PipelineRecord
from planner.planning.pipeline_solve import RankPlanner, solve_pipeline_rank

__all__ = ["Pipeline", "solve_pipeline_rank", "RankPlanner", "PipelineStep", "pipeline_step"]


@dataclass(frozen=True)
class PipelineStep:
    """A step of the whole pipeline from every stage's plan."""

    makespan_ms: float
    """The step: the last rank's last action plus its optimizer step."""
    bubble_fractions: dict[int, float]
    """Per rank: idle share of the step."""
    spans: dict[int, list[Span]]

    def timeline_text(self, width: int = 96) -> str:
        return timeline_text(self.spans, width)


def pipeline_step(plans: Sequence) -> PipelineStep:
    """``plans``: one plan per stage of one pipeline (``Plan.pipeline`` set), all made for the
    same schedule, micro-batch count and stage layout (the step is laid out on it)."""
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence) or \
            not all(isinstance(p, Plan) and p.pipeline is not None for p in plans) or not plans:
        raise PlanningError("pipeline_step needs a list of pipeline stage plans (Plan.pipeline set), one per stage")
    first = plans[0].pipeline
    recs: dict[int, PipelineRecord] = {}
    for p in plans:
        rec = p.pipeline
        ours, theirs = _pipeline_of(rec), _pipeline_of(first)
        if ours != theirs:
            raise PlanningError(f"pipeline_step lays out one pipeline: the plan for stage {rec.stage_index} is for "
                                f"{rec.describe()}, the one for stage {first.stage_index} for {first.describe()}; "
                                "give the plans of one pipeline (re-plan the stages made for another)")
        if rec.stage_index in recs:
            raise PlanningError(f"pipeline_step got two plans for stage {rec.stage_index}; give one per stage")
        recs[rec.stage_index] = rec
    missing = sorted(set(range(first.n_stages)) - set(recs))
    if missing:
        raise PlanningError(f"pipeline_step needs a plan for every stage; missing {missing[:20]}"
                            f"{' ...' if len(missing) > 20 else ''}")
    layout = ScheduleLayout.of(schedule_class(first.schedule), n_microbatches=first.n_microbatches,
                               n_stages=first.n_stages, virtual_stages=first.virtual_stages)
    times = lambda s, k: {"F": recs[s].fw_ms, "B": recs[s].bw_ms, "I": recs[s].bw_ms, "W": recs[s].w_ms}[k]
    spans = simulate({r: layout.actions(r) for r in range(layout.n_ranks)}, layout.stage_to_rank(), times)
    optim = {r: sum(recs[s].optim_ms for s in layout.stages_of(r)) for r in range(layout.n_ranks)}
    return PipelineStep(makespan_ms(spans, optim), bubble_fractions(spans), spans)


def _pipeline_of(rec: PipelineRecord) -> tuple:
    """What every stage plan of one pipeline has in common."""
    return rec.schedule, rec.n_microbatches, rec.n_stages, rec.virtual_stages, rec.split_backward, rec.return_outputs
