"""planner/applying/pipeline.py: a stage's plan goes on its own PipelineStage."""

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

from planner import apply_plan
from planner.errors import PlanMismatchError
from planner.plan import ModulePlan, Plan, model_fingerprint
from planner.plan_pipeline import PipelineRecord


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))

    def forward(self, x):
        return self.block(x)


def _plan(module, *, stage: int, split: bool) -> Plan:
    rec = PipelineRecord(schedule="ScheduleInterleavedZeroBubble" if split else "Schedule1F1B", n_microbatches=4,
                         stage_index=stage, n_stages=2, split_backward=split)
    return Plan(modules=(ModulePlan(fqn="_Stage.block", discard_ratio=1.0, full=True),), model_name="_Stage",
                model_fingerprint=model_fingerprint(module), device="cpu", world_size=1, budget_bytes=1 << 20,
                reserve_bytes=0, predicted_peak_bytes=1, solver_peak_bytes=1, baseline_peak_bytes=1, recompute_ms=0.0,
                baseline_step_ms=0.0, pipeline=rec)


def test_a_stage_plan_is_refused_on_another_stage(fake_group):
    from torch.distributed.pipelining import PipelineStage

    module = _Stage()
    stage = PipelineStage(module, 1, 2, torch.device("cpu"))
    with pytest.raises(PlanMismatchError, match="for pipeline stage 0 of 2 .* not stage 1 of 2"):
        apply_plan(stage, _plan(module, stage=0, split=False))
    with apply_plan(stage, _plan(module, stage=1, split=False)):
        assert "forward" in module.block.__dict__  # planned
    assert "forward" not in module.block.__dict__


def test_a_split_backward_plan_groups_the_weight_half_and_needs_the_stage(fake_group):
    from torch.distributed.pipelining import PipelineStage

    module = _Stage()
    plan = _plan(module, stage=1, split=True)
    with pytest.raises(PlanMismatchError, match="apply it to the PipelineStage"):
        apply_plan(module, plan)
    stage = PipelineStage(module, 1, 2, torch.device("cpu"))
    handle = apply_plan(stage, plan)
    assert getattr(stage.backward_weight_one_chunk, "sac_planner_grouped", False)
    handle.remove()
    assert "backward_weight_one_chunk" not in stage.__dict__
    # a plan that checkpoints nothing leaves the schedule's weight half alone
    with apply_plan(stage, dataclasses.replace(plan, modules=())):
        assert "backward_weight_one_chunk" not in stage.__dict__


def test_a_bare_module_of_the_same_stage_takes_a_full_backward_plan():
    module = _Stage()
    with apply_plan(module, _plan(module, stage=1, split=False)):
        out = module(torch.randn(2, 8, requires_grad=True)).sum()
        out.backward()


def test_a_plan_without_its_pipeline_record_is_refused_on_a_stage(fake_group):
    # "pipeline": null in an edited file removed the stage check
    from torch.distributed.pipelining import PipelineStage

    module = _Stage()
    stage = PipelineStage(module, 1, 2, torch.device("cpu"))
    with pytest.raises(PlanMismatchError, match="made for one process's step, not for pipeline stage 1 of 2"):
        apply_plan(stage, dataclasses.replace(_plan(module, stage=1, split=False), pipeline=None))
    assert "forward" not in module.block.__dict__


def _first_call_warnings(stage, x) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stage.forward_maybe_with_nosync(x).sum().backward()  # PipelineStage's own call of its module
    return [str(w.message) for w in caught]


def test_a_plan_on_a_bare_stage_module_is_checked_against_the_stage_that_runs_it(fake_group):
    from torch.distributed.pipelining import PipelineStage

    from planner.applying.planned_forward import StalePlanWarning

    x = torch.randn(2, 8, requires_grad=True)
    module = _Stage()
    with apply_plan(module, _plan(module, stage=0, split=False)):  # torchtitan: AC on the bare module
        stage = PipelineStage(module, 1, 2, torch.device("cpu"))
        (message,) = _first_call_warnings(stage, x)
        assert "for pipeline stage 0 of 2 (Schedule1F1B, 4 micro-batches), not stage 1 of 2" in message
        assert _first_call_warnings(stage, x) == []  # once
    with apply_plan(module, _plan(module, stage=1, split=False)):
        assert _first_call_warnings(stage, x) == []  # its own stage
    with apply_plan(module, dataclasses.replace(_plan(module, stage=1, split=False), pipeline=None)):
        with pytest.warns(StalePlanWarning, match="made for one process's step, not for pipeline stage 1 of 2"):
            stage.forward_maybe_with_nosync(x)
    with apply_plan(module, dataclasses.replace(_plan(module, stage=1, split=False), pipeline=None)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            module(x).sum().backward()  # not run by a stage: nothing to check
