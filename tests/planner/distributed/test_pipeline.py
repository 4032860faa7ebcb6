"""planner/distributed/pipeline.py: a rank of a PP x TP layout planned in one process on the fake
process group (the gloo check of the same plans: tests/integration/test_pipeline_gloo.py), and
``pipeline_step``, which lays out the plans of one pipeline and refuses plans that are not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B

from examples.llama import LlamaConfig
from examples.pipeline_stages import llama_stage_builder
from planner import PlanOptions, PlanningError
from planner.distributed.pipeline import fake_layout_rank, pipeline_step, plan_layout_rank
from planner.distributed.ranks import plan_hash
from planner.plan import Plan
from planner.plan_pipeline import PipelineRecord

CONFIG = LlamaConfig(vocab_size=256, seq_len=32, n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
MESH = {"pp": 2, "tp": 2}


def _build(sequence_parallel=True):
    return llama_stage_builder(CONFIG, n_stages=2, micro_batch=2, sequence_parallel=sequence_parallel)


def test_a_layout_without_a_pipeline_dim_is_refused():
    with pytest.raises(PlanningError, match="name a 'pp' dim"):
        plan_layout_rank(_build(), 1.0, mesh_shape={"tp": 2}, rank=0, schedule=Schedule1F1B, n_microbatches=4)


@pytest.mark.slow
def test_the_ranks_of_a_tp_group_get_one_plan_that_records_the_layout(one_intra_op_thread):
    """Ranks 0 and 1 run stage 0 over tp=2: each is traced at its local shapes, and both get
    the same plan, which records the tensor-parallel layout; below the floor the refusal says
    what the rank can reach."""
    options = PlanOptions(device="cpu", reserve_gib=0)
    free = plan_layout_rank(_build(), None, mesh_shape=MESH, rank=0, schedule=Schedule1F1B, n_microbatches=4,
                            options=options)
    assert free.coordinates == {"pp": 0, "tp": 0} and free.stages == (0,) and free.plans is None
    assert free.min_peak_bytes < free.unplanned_peak_bytes and free.unplanned_makespan_ms > 0
    budget = (free.min_peak_bytes + free.unplanned_peak_bytes) // 2
    ranks = [plan_layout_rank(_build(), budget / 2**30, mesh_shape=MESH, rank=r, schedule=Schedule1F1B,
                              n_microbatches=4, options=options) for r in (0, 1)]
    (plan0,), (plan1,) = (r.plans.values() for r in ranks)
    assert plan_hash(plan0) == plan_hash(plan1) and plan0.modules
    assert ranks[0].predicted_peak_bytes <= budget and ranks[0].makespan_ms >= free.unplanned_makespan_ms
    assert plan0.layout.meshes == ("tp=2",) and plan0.layout.dtensor_parameters > 0
    low = plan_layout_rank(_build(), free.min_peak_bytes / 2 / 2**30, mesh_shape=MESH, rank=0,
                           schedule=Schedule1F1B, n_microbatches=4, options=options)
    assert low.plans is None and "smallest reachable peak over its schedule" in low.refusal


@pytest.mark.slow
def test_a_plan_goes_on_its_own_layout_only(one_intra_op_thread):
    """The stage plan of a TP rank applies to the stage parallelized as planned, and is refused
    on the same stage without tensor parallelism (its per-rank peak would not hold)."""
    from planner import apply_plan
    from planner.errors import PlanMismatchError

    with fake_layout_rank(_build(), mesh_shape=MESH, rank=2, schedule=Schedule1F1B, n_microbatches=4,
                          options=PlanOptions(device="cpu", reserve_gib=0)) as (rp, coordinates):
        assert coordinates == {"pp": 1, "tp": 0}
        plans = rp.plan((rp.min_peak_bytes() + rp.unplanned_peak_bytes) / 2 / 2**30)
        module, _ = rp.stages[1]
        with apply_plan(module, plans[1]):
            pass
    from examples.pipeline_stages import LlamaStage, layer_ranges

    plain = LlamaStage.on_meta(CONFIG, layer_ranges(4, 2)[1], first=False, last=True)
    with pytest.raises(PlanMismatchError, match="tensor parallel over tp=2"):
        apply_plan(plain, plans[1])
    assert torch.distributed.is_initialized() is False


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
