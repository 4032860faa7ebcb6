"""planner/applying/pipeline.py: a stage's plan goes on its own PipelineStage."""

import dataclasses

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
