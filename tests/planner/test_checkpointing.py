"""planner/checkpointing.py: a planned model computes exactly what the unplanned one does."""

from __future__ import annotations

import pytest
import torch

from examples import EXAMPLES
from planner import AlreadyCheckpointedError, PlanMismatchError, apply_plan, remove_plan
from tests.planner.conftest import EXAMPLE_NAMES, budgets, plan_at


def _loss_and_grads(model, inputs, seed=1234):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model.loss_fn(model(*inputs), inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
@pytest.mark.parametrize("which", ["slack", "binding", "tight"])
def test_same_loss_and_gradients_bitwise(name, which):
    budget = dict(zip(["slack", "binding", "tight"], budgets(name, 3)))[which]
    plan = plan_at(name, budget)
    if which != "slack":
        assert plan.modules, "a binding budget must checkpoint something"
        assert any(not m.full for m in plan.modules) or which == "tight"
    model, inputs = EXAMPLES[name]()
    model.train()
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    ref_loss, ref_grads = _loss_and_grads(model, inputs)
    with apply_plan(model, plan):
        loss, grads = _loss_and_grads(model, inputs)
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n


def test_remove_and_context_manager_restore_the_model():
    name = "gpt_demo"
    plan = plan_at(name, budgets(name, 3)[1])
    model, inputs = EXAMPLES[name]()
    forwards = {n: m.forward for n, m in model.named_modules()}
    handle = apply_plan(model, plan)
    assert len(handle.modules) == len(plan.modules)
    assert remove_plan(model) == len(plan.modules)
    assert all("forward" not in m.__dict__ for m in model.modules())
    with apply_plan(model, plan):
        pass
    for n, m in model.named_modules():
        assert m.forward == forwards[n] and "forward" not in m.__dict__


def _state(model):
    return {n: (m.__dict__.get("forward"), dict(m.__dict__)) for n, m in model.named_modules()}


def test_plan_for_another_model_is_refused_and_model_untouched():
    plan = plan_at("gpt_demo", budgets("gpt_demo", 3)[1])
    other, _ = EXAMPLES["gpt_small"]()
    before = _state(other)
    with pytest.raises(PlanMismatchError, match="made for GPT.*Re-plan"):
        apply_plan(other, plan)
    assert _state(other) == before


def test_already_checkpointed_models_are_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plan = plan_at("gpt_demo", budgets("gpt_demo", 3)[1])
    model, _ = EXAMPLES["gpt_demo"]()
    apply_plan(model, plan)
    with pytest.raises(AlreadyCheckpointedError, match="remove_plan"):
        apply_plan(model, plan)
    remove_plan(model)
    model.blocks[0].mlp = checkpoint_wrapper(model.blocks[0].mlp)
    with pytest.raises((AlreadyCheckpointedError, PlanMismatchError)):
        apply_plan(model, plan)
    plan2 = plan
    with pytest.raises(AlreadyCheckpointedError, match="checkpoint_wrapper"):
        apply_plan(model, plan2, check_fingerprint=False)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_failure_midway_rolls_back(monkeypatch):
    import planner.checkpointing as ck

    plan = plan_at("gpt_demo", budgets("gpt_demo", 3)[2])
    assert len(plan.modules) >= 2
    model, _ = EXAMPLES["gpt_demo"]()
    before = _state(model)
    calls = {"n": 0}
    real = ck._planned_forward

    def flaky(mod, mp):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(mod, mp)

    monkeypatch.setattr(ck, "_planned_forward", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        apply_plan(model, plan)
    assert _state(model) == before
