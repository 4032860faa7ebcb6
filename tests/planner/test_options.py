"""planner/options.py: PlanOptions is a checked value; the entry points take it and the TrainStep
as the one way to describe a plan, and say where an old keyword went."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples import EXAMPLES
from planner import Plan, PlanningError, PlanOptions, TrainStep, check_gradients, solve_sac, tradeoff_curve
from solver import SolverOptions


def test_defaults_plan_one_process_on_the_default_device():
    o = PlanOptions()
    assert (o.world_size, o.fsdp_units, o.ac_units, o.offload, o.verify) == (1, None, None, False, True)
    assert o.spec.name == "cpu" and o.solver == SolverOptions()


def test_options_are_frozen_keyword_only_values():
    o = PlanOptions(device="h100", fsdp_units=["GPT", "GPT.blocks.0"])
    assert o.fsdp_units == ("GPT", "GPT.blocks.0")  # lists become tuples: hashable, comparable
    assert o == PlanOptions(device="h100", fsdp_units=("GPT", "GPT.blocks.0"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.device = "cpu"  # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanOptions("h100")  # type: ignore[misc]
    assert o.replace(world_size=8).world_size == 8 and o.world_size == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"ac_units": "GPT.blocks.0"}, r"^ac_units must be a list of module names, e\.g\. \['GPT\.blocks\.0'\]"),
    ({"fsdp_units": [1, 2]}, r"^fsdp_units must hold module names"),
    ({"world_size": 0}, r"^world_size must be an int >= 1, got 0"),
    ({"world_size": True}, r"^world_size must be an int >= 1"),
    ({"reserve_gib": -1}, r"^reserve_gib must be a number of GiB from 0"),
    ({"reserve_gib": float("nan")}, r"^reserve_gib must be a number of GiB from 0"),
    ({"host_budget_gib": 4}, r"^host_budget_gib only applies with offload=True"),
    ({"offload": True, "host_budget_gib": -4}, r"^host_budget_gib must be a positive finite number of GiB"),
])
def test_bad_values_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(PlanningError, match=message):
        PlanOptions(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"verify": "yes"}, r"^verify must be True or False"),
    ({"solver": {"time_limit_s": 3}}, r"^solver must be a solver\.SolverOptions"),
    ({"trace": "real"}, r"^trace must be an EstimateOptions"),
    ({"device": 3}, r"^device must be a device name or a DeviceSpec"),
])
def test_wrong_types_are_refused(kwargs, message):
    with pytest.raises(TypeError, match=message):
        PlanOptions(**kwargs)


def test_an_unknown_device_is_named_when_built():
    with pytest.raises(ValueError, match="unknown device 'h1000'; known devices: .*h100"):
        PlanOptions(device="h1000")


def test_old_keywords_say_where_they_went():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(TypeError) as e:
        solve_sac(model, 1, inputs=inputs, optimizer="adamw", device="h100", solver_options=None, colour=1)
    msg = str(e.value)
    assert "inputs, optimizer go in the step: step=TrainStep(inputs=..., optimizer=...)" in msg
    assert "settings go in the options: options=PlanOptions(device=..., solver=...)" in msg
    assert "unknown argument(s) 'colour'" in msg


def test_a_step_or_options_of_the_wrong_kind_is_refused():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(TypeError, match=r"step must be a TrainStep, got tuple"):
        solve_sac(model, 1, inputs)
    with pytest.raises(TypeError, match=r"options must be a PlanOptions, got dict"):
        solve_sac(model, 1, TrainStep(inputs=inputs), options={"device": "h100"})
    with pytest.raises(TypeError, match=r"step must be a TrainStep, got tuple"):
        tradeoff_curve(model, inputs)


def test_a_plan_carries_its_step_in_memory_only(tmp_path):
    torch.manual_seed(0)
    model, inputs = EXAMPLES["gpt_tiny"]()
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")
    plan = solve_sac(model, 1, step)
    assert plan.train_step is step
    assert check_gradients(model, plan).equal  # the plan's own step
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded == plan and loaded.train_step is None and "train_step" not in plan.to_dict()
    with pytest.raises(ValueError, match=r"does not carry its training step.*pass it, check_gradients\(model, plan, TrainStep"):
        check_gradients(model, loaded)
    assert check_gradients(model, loaded, step).equal


def test_the_pipeline_is_one_line_and_checked():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV

    from planner.options import Pipeline

    pipe = Pipeline(Schedule1F1B, n_microbatches=8, stage_index=1, n_stages=4)
    assert PlanOptions(pipeline=pipe).pipeline.layout.rank_of(1) == 1
    with pytest.raises(PlanningError, match="stage_index must be an int in \\[0, n_stages=4\\)"):
        Pipeline(Schedule1F1B, n_microbatches=8, stage_index=4, n_stages=4)
    with pytest.raises(PlanningError, match="not modelled yet"):
        Pipeline(ScheduleDualPipeV, n_microbatches=8, stage_index=1, n_stages=4, virtual_stages=2)
    with pytest.raises(PlanningError, match="n_microbatches >= n_stages"):
        Pipeline(Schedule1F1B, n_microbatches=2, stage_index=1, n_stages=4)
    with pytest.raises(TypeError, match="pipeline must be a planner.options.Pipeline"):
        PlanOptions(pipeline="1F1B")


def test_a_pipeline_torch_would_refuse_later_is_refused_at_once():
    import time

    from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule

    from planner.options import Pipeline

    t = time.monotonic()
    with pytest.raises(PlanningError, match=r"n_microbatches must be an int in \[1, 4,096\]"):
        Pipeline(ScheduleGPipe, n_microbatches=10**30, n_stages=2)  # grew memory until it died
    with pytest.raises(PlanningError, match="stage micro-batches"):
        Pipeline(ScheduleGPipe, n_microbatches=4096, n_stages=32)
    assert time.monotonic() - t < 2
    for cls in (PipelineScheduleMulti, _PipelineSchedule):  # failed inside torch, later
        with pytest.raises(PlanningError, match="schedule class or object, one of ScheduleGPipe"):
            Pipeline(cls, n_microbatches=4, n_stages=2)
    with pytest.raises(PlanningError, match="with 9 micro-batches on 4 ranks: torch refuses it"):
        Pipeline(ScheduleInterleaved1F1B, n_microbatches=9, n_stages=8, virtual_stages=2)
    assert Pipeline(ScheduleInterleaved1F1B, n_microbatches=8, n_stages=8, virtual_stages=2).layout.n_ranks == 4
