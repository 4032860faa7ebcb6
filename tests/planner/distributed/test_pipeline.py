"""planner/distributed/pipeline.py: ``pipeline_step`` lays out the plans of one pipeline, and
refuses plans that are not (it laid every stage out on the first plan's schedule)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.distributed.pipeline import pipeline_step
from planner.errors import PlanningError
from planner.plan import Plan
from planner.plan_pipeline import PipelineRecord


def _plan(stage: int, n_stages: int = 2, **record) -> Plan:
    rec = PipelineRecord(**{"schedule": "Schedule1F1B", "n_microbatches": 4, "stage_index": stage,
                            "n_stages": n_stages, "fw_ms": 1.0, "bw_ms": 2.0, **record})
    return Plan(modules=(), model_name="Stage", model_fingerprint="0" * 16, device="cpu", world_size=1,
                budget_bytes=1 << 20, reserve_bytes=0, predicted_peak_bytes=1, solver_peak_bytes=1,
                baseline_peak_bytes=1, recompute_ms=0.0, baseline_step_ms=0.0, pipeline=rec)


def test_the_plans_of_one_pipeline_are_laid_out():
    step = pipeline_step([_plan(1), _plan(0)])
    # 1F1B, 2 stages, 4 micro-batches of 1 + 2 ms: (n + stages - 1) * 3 ms
    assert step.makespan_ms == pytest.approx(15.0) and set(step.spans) == {0, 1}


@pytest.mark.parametrize("other, what", [
    ({"schedule": "ScheduleGPipe"}, "ScheduleGPipe"),
    ({"n_microbatches": 8}, "8 micro-batches"),
    ({"return_outputs": False}, "Schedule1F1B, 4 micro-batches"),
])
def test_plans_of_different_pipelines_are_refused(other, what):
    with pytest.raises(PlanningError, match=f"one pipeline: the plan for stage 1 is for stage 1 of 2 \\(.*{what}"):
        pipeline_step([_plan(0), _plan(1, **other)])


def test_what_is_not_one_plan_per_stage_is_refused():
    with pytest.raises(PlanningError, match="two plans for stage 0"):
        pipeline_step([_plan(0), _plan(0), _plan(1)])
    with pytest.raises(PlanningError, match=r"missing \[1\]"):
        pipeline_step([_plan(0)])
    plain = dataclasses.replace(_plan(0), pipeline=None)
    for bad in ([plain, _plan(1)], [], "plans", [torch.nn.Linear(2, 2)], None):
        with pytest.raises(PlanningError, match="a list of pipeline stage plans"):
            pipeline_step(bad)
