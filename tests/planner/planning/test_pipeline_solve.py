"""planner/planning/pipeline_solve.py: a stage planned over its schedule (fake traces)."""

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

from examples.pipeline_stages import llama_pipeline_model, llama_stage, stage_loss
from planner import PlanOptions, PlanningError, TrainStep, solve_sac
from planner.distributed.pipeline import Pipeline, RankPlanner, pipeline_step
from planner.format import GiB


@pytest.fixture(scope="module")
def four_stages():
    """A 4-layer Llama in 4 stages (one layer each), each stage's input for one micro-batch."""
    full = llama_pipeline_model(n_layers=4)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out, h = [], tokens
    for s in range(4):
        stage = llama_stage(full, s, 4)
        out.append((stage, TrainStep(inputs=h, loss_fn=stage_loss, optimizer="adamw",
                                     target=tokens if s == 3 else None)))
        with torch.no_grad():
            h = stage(h)
    return out


def _options(s: int, **kw) -> PlanOptions:
    return PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=8, stage_index=s, n_stages=4, **kw))


@pytest.mark.slow
def test_1f1b_stages_get_their_own_plans_for_their_in_flight_counts(four_stages):
    """Stage s of 1F1B holds 4 - s micro-batches: unplanned peaks fall down the pipe (traced:
    2,324,520 / 1,843,748 / 1,547,300 B; the last stage, its logits, 2,057,292), and at one budget
    of 1.6 MB each of the first three discards what its count needs: stage 0 most, stage 2 nothing."""
    planners = [RankPlanner({s: four_stages[s]}, options=_options(s)) for s in range(4)]
    peaks = [rp.unplanned_peak_bytes for rp in planners]
    assert peaks[0] > peaks[1] > peaks[2]
    budgets = [1_600_000] * 3 + [peaks[3] + 1]
    plans = [rp.plan(b / GiB)[s] for s, (rp, b) in enumerate(zip(planners, budgets))]
    freed = [sum(m.discarded_bytes for m in p.modules) for p in plans]
    assert freed[0] > freed[1] > freed[2] == 0 and freed[3] == 0
    assert all(p.predicted_peak_bytes <= b for p, b in zip(plans, budgets))
    assert plans[0].pipeline.stage_index == 0 and plans[0].pipeline.schedule == "Schedule1F1B"
    assert plans[0].baseline_peak_bytes == peaks[0]
    step = pipeline_step(plans)
    assert step.makespan_ms > 0 and set(step.bubble_fractions) == {0, 1, 2, 3}
    assert "pipeline         stage 0 of 4 (Schedule1F1B, 8 micro-batches)" in plans[0].summary()


def test_solve_sac_plans_a_stage_and_says_what_it_needs(four_stages):
    stage, step = four_stages[3]
    plan = solve_sac(stage, 1.0, step, options=_options(3))
    assert plan.modules == () and plan.pipeline.rank_stages == (3,)
    with pytest.raises(PlanningError, match="pass TrainStep\\(target=...\\)"):
        solve_sac(stage, 1.0, TrainStep(inputs=step.inputs, loss_fn=stage_loss), options=_options(3))
    with pytest.raises(PlanningError, match="leave TrainStep.micro_batches at 1"):
        solve_sac(four_stages[1][0], 1.0, TrainStep(inputs=four_stages[1][1].inputs, micro_batches=2),
                  options=_options(1))
    interleaved = PlanOptions(pipeline=Pipeline(ScheduleInterleaved1F1B, n_microbatches=4, stage_index=1,
                                                n_stages=4, virtual_stages=2))
    with pytest.raises(PlanningError, match="shares its rank with stages \\[1, 3\\].*solve_pipeline_rank"):
        solve_sac(four_stages[1][0], 1.0, four_stages[1][1], options=interleaved)
    with pytest.raises(PlanningError, match="smallest reachable peak over its schedule"):
        solve_sac(stage, 1e-4, step, options=_options(3))


def test_a_plan_that_verifies_over_is_stepped_past_until_one_fits():
    """The last of 4 GPipe stages (8 layers, 8 micro-batches) at 4,309,609 B: the MILP's plan
    (layers.6 at 0.998 of its bytes) verifies 695 B over, and so does every target within 30 KB
    below it (a partial discard maps to the same traced plan there); tightening steps past it."""
    from torch.distributed.pipelining import ScheduleGPipe

    full = llama_pipeline_model()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    h = tokens
    with torch.no_grad():
        for s in range(3):
            h = llama_stage(full, s, 4)(h)
    step = TrainStep(inputs=h, loss_fn=stage_loss, optimizer="adamw", target=tokens)
    options = PlanOptions(pipeline=Pipeline(ScheduleGPipe, n_microbatches=8, stage_index=3, n_stages=4))
    budget = 4_309_609
    plan = RankPlanner({3: (llama_stage(full, 3, 4), step)}, options=options).plan(budget / GiB)[3]
    assert plan.modules and plan.predicted_peak_bytes <= budget
    assert any("target tightened" in n for n in plan.notes)


def test_fsdp2_inside_a_stage_is_refused_with_what_to_do(four_stages):
    """FSDP2 under a pipeline schedule keeps its units gathered and its gradients unsharded
    across the micro-batches, which the rank's memory model does not hold yet: fsdp_units, or a
    stage already sharded by fully_shard, are refused before any trace."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from planner.distributed.fake_world import fake_process_group

    stage, step = four_stages[1]
    units = PlanOptions(fsdp_units=("LlamaStage",), world_size=2, pipeline=_options(1).pipeline)
    with pytest.raises(PlanningError, match="FSDP2 inside a pipeline stage is not modelled yet.*world_size=<dp>"):
        RankPlanner({1: (stage, step)}, options=units)
    with fake_process_group(world_size=2, rank=0):
        sharded = llama_stage(llama_pipeline_model(n_layers=4), 1, 4)
        fully_shard(sharded, mesh=init_device_mesh("cpu", (2,)))
        with pytest.raises(PlanningError, match="plan the stage before fully_shard"):
            RankPlanner({1: (sharded, step)}, options=_options(1))
    with pytest.raises(PlanningError, match="without offload for now"):
        RankPlanner({1: (stage, step)}, options=PlanOptions(offload=True, pipeline=_options(1).pipeline))


def test_stages_of_the_wrong_shape_are_refused_in_one_line():
    from planner.distributed.pipeline import solve_pipeline_rank

    module = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])  # a long repr
    step = TrainStep(inputs=torch.randn(2, 8))
    options = PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=2, n_stages=2))
    for bad, message in (({0: module}, r"stages\[0\] must be a \(module, TrainStep\) pair, got a Sequential"),
                         ([module], "stages must be a non-empty dict, got list"),
                         ({}, "non-empty dict"),
                         ({"0": (module, step)}, r"keys are stage indices \(int\), got str"),
                         ({0: (module,)}, r"got a tuple of \(Sequential\)"),
                         ({0: (step, module)}, r"got a tuple of \(TrainStep, Sequential\)")):
        with pytest.raises(TypeError, match=message) as e:
            solve_pipeline_rank(bad, 1.0, options=options)
        assert "\n" not in str(e.value) and len(str(e.value)) < 200
    with pytest.raises(PlanningError, match="needs options=PlanOptions"):
        solve_pipeline_rank({0: (module, step)}, 1.0, options=None)
