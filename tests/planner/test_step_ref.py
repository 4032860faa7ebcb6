"""planner/step_ref.py: a plan keeps the step it was made for without keeping its memory alive
(the batch, what the loop holds, an optimizer instance); ``plan.train_step`` gives the step back
while the caller holds those."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from torch import nn

from planner import TrainStep, check_gradients, solve_sac
from planner.step_ref import StepRef


class _Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def example_inputs(self):
        return (torch.randn(4, 8),)


def _model():
    model = _Net()
    return model, model.example_inputs()


def _loss(out, inputs):
    return out.square().mean()


def _plan(step, model):
    return solve_sac(model, 1, step)


@pytest.mark.slow
def test_a_plan_keeps_no_tensor_of_its_step_alive():
    model, inputs = _model()
    held = torch.zeros(1000)
    optimizer = torch.optim.AdamW(model.parameters())
    plan = _plan(TrainStep(inputs=inputs, loss_fn=_loss, optimizer=optimizer, held=held), model)
    gone = [weakref.ref(t) for t in (*inputs, held)] + [weakref.ref(optimizer)]
    assert plan.train_step is not None and plan.train_step.held[0] is held  # while the caller holds them
    del inputs, held, optimizer
    gc.collect()
    assert [r() for r in gone] == [None] * len(gone)
    assert plan.train_step is None
    with pytest.raises(ValueError, match=r"whose batch was freed: a plan keeps no tensors of its step alive"):
        check_gradients(model, plan)


def test_the_step_is_rebuilt_from_the_tensors_the_caller_still_holds():
    model, inputs = _model()
    plan = _plan(TrainStep(inputs=inputs, loss_fn=_loss, optimizer="adamw"), model)
    gc.collect()  # the TrainStep object is gone; its inputs are the caller's
    step = plan.train_step
    assert step.inputs[0] is inputs[0] and step.loss_fn is _loss and step.optimizer == "adamw"
    assert check_gradients(model, plan).equal


@pytest.mark.slow
def test_a_step_of_the_models_example_inputs_is_made_again():
    model, _ = _model()
    plan = solve_sac(model, 1)  # model.example_inputs(): made by the planner, not kept
    gc.collect()
    assert plan.train_step is not None and plan.train_step.inputs is None
    assert check_gradients(model, plan).equal


def test_leaves_that_hold_no_memory_are_kept():
    x = torch.ones(3)
    ref = StepRef(TrainStep(inputs=(x, 0, "mean", None)))
    gc.collect()
    assert ref.get().inputs == (x, 0, "mean", None)
