"""planner/analysis/gradcheck.py: the planned step against the unplanned one, bitwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples import EXAMPLES
from planner.analysis.gradcheck import check_gradients
from planner.plan import ModulePlan, Plan, model_fingerprint
from tests.planner.conftest import budgets, plan_at
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})


def _same(a, b):
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a.values(), (b[k] for k in a)))


@pytest.mark.slow
@pytest.mark.parametrize("keep_output", [False, True])  # True: the output held through backward
def test_a_real_plan_is_bitwise_equal_and_the_model_is_left_as_found(keep_output):
    name = "convnet_demo"  # BatchNorm statistics and dropout-free: state must be put back
    plan = plan_at(name, budgets(name, 3)[1])
    model, inputs = EXAMPLES[name]()
    model(*inputs).sum().backward()  # gradients already there must survive the check
    before = _snapshot(model)
    check = check_gradients(model, plan, TrainStep(inputs=inputs, loss_fn=model.loss_fn, keep_output=keep_output))
    assert check.equal and check.max_abs_diff == 0.0 and check.differing == ()
    assert check.n_params_compared == sum(1 for p in model.parameters() if p.requires_grad)
    assert check.loss_planned == check.loss_reference
    after = _snapshot(model)
    assert _same(before[0], after[0]) and _same(before[1], after[1])
    assert not any("_sac_planner" in k for m in model.modules() for k in m.__dict__)  # plan removed


class _Scaled(nn.Module):
    """Reads a Python-side setting the parent changes after calling it: the recompute, which
    runs in the backward, sees the changed value (a forward that runs twice is not a pure one)."""

    def __init__(self, setting: dict) -> None:
        super().__init__()
        self.setting = setting
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.setting["scale"])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.setting = {"scale": 1.0}
        self.a = _Scaled(self.setting)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        self.setting["scale"] = 1.0
        h = self.a(x)
        self.setting["scale"] = 2.0
        return self.b(torch.relu(h))


def _full_plan(model: nn.Module, fqn: str) -> Plan:
    """A plan that fully checkpoints one module (figures not traced: the check needs none)."""
    return Plan(
        modules=(ModulePlan(fqn=fqn, discard_ratio=1.0, full=True),), model_name=type(model).__name__,
        model_fingerprint=model_fingerprint(model), device="cpu", world_size=1, budget_bytes=1,
        reserve_bytes=0, predicted_peak_bytes=0, solver_peak_bytes=0, baseline_peak_bytes=0,
        recompute_ms=0.0, baseline_step_ms=0.0,
    )


def test_a_recompute_that_differs_is_caught():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    check = check_gradients(model, _full_plan(model, "_Net.a"), TrainStep(inputs=(x,)))
    assert not check.equal and check.loss_planned == check.loss_reference  # same forward
    assert "a.lin.weight" in check.differing and check.max_abs_diff > 0
    assert check.n_params_compared == 4


@pytest.mark.slow
def test_a_bf16_plan_is_checked_under_autocast():
    """The check runs the step the plan was made for: a bf16 plan checked in fp32 compared other
    kernels than training runs (and printed 'bitwise EQUAL' for them)."""
    from estimators.tracing.estimation import estimate
    from estimators.step.train_step import TrainStep
    from planner.planning.solve import plan_for_budget
    from solver import SACMilp

    model, inputs = EXAMPLES["gpt_tiny"]()
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, autocast_dtype=torch.bfloat16)
    est = estimate(model, step)
    budget = (est.module_info.peak_bytes + SACMilp(est.module_info).min_reachable_peak_bytes()) // 2
    plan = plan_for_budget(model, est, budget)
    assert plan.modules and plan.step.autocast == "bfloat16"
    check = check_gradients(model, plan)  # the plan's own step: bf16
    assert check.equal
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = float(model.loss_fn(model(*inputs), inputs))
    torch.manual_seed(0)
    fp32 = float(model.loss_fn(model(*inputs), inputs))
    assert bf16 != fp32 and check.loss_reference == bf16
    assert check_gradients(model, plan, TrainStep(inputs=inputs, loss_fn=model.loss_fn)).loss_reference == fp32


class _NumpyMasked(nn.Module):
    """Drops features with a numpy draw (as Wav2Vec2's time masking does) inside module ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        import numpy as np

        keep = torch.from_numpy(np.random.rand(8) > 0.5).to(x.dtype)
        return self.b(torch.relu(self.a(x)) * keep)


@pytest.mark.parametrize("modules", [(), (ModulePlan(fqn="_NumpyMasked.a", discard_ratio=1.0, full=True),)])
def test_numpy_draws_are_seeded_and_the_rng_streams_go_on(modules):
    """The check seeded torch only: with numpy masks, an empty plan was reported as differing.
    It also re-seeded the user's generators and left them so."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model, x = _NumpyMasked(), torch.randn(4, 8)
    plan = Plan(
        modules=modules, model_name="_NumpyMasked", model_fingerprint=model_fingerprint(model),
        device="cpu", world_size=1, budget_bytes=1, reserve_bytes=0, predicted_peak_bytes=0,
        solver_peak_bytes=0, baseline_peak_bytes=0, recompute_ms=0.0, baseline_step_ms=0.0,
    )
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = (torch.rand(1).item(), np.random.rand(), random.random())
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    check = check_gradients(model, plan, TrainStep(inputs=(x,)))
    assert check.equal, check.differing
    assert (torch.rand(1).item(), np.random.rand(), random.random()) == expected


def test_nan_gradients_of_the_same_bits_are_equal():
    # torch.equal calls NaN != NaN: a step whose gradients are NaN in both runs, bit for bit,
    # was reported "equal=False" with every parameter listed, and the CLI blamed the plan.
    class _Log(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.scale = nn.Parameter(torch.tensor(2.0))  # 0-dim (CLIP's logit_scale): viewed as bytes

        def forward(self, x):
            # A finite loss (0) with NaN gradients: sqrt's inf slope at 0 times relu's 0.
            return torch.sqrt(torch.relu(self.inner(x) * self.scale - 1e6))

    torch.manual_seed(0)
    model, x = _Log(), torch.randn(4, 8)
    check = check_gradients(model, _full_plan(model, "_Log.inner"), TrainStep(inputs=(x,)))
    assert check.equal and check.differing == () and check.n_params_compared == 5


@pytest.mark.hf
def test_an_hf_model_whose_cached_step_rounds_otherwise_is_compared_with_the_cache_off_too():
    """GPT-Neo with its default use_cache=True: the plan turns the cache off, and HF computes the
    cached step with other rounding (1.5e-8 here, even with no module planned). The check says
    so: the planned step is bitwise the unplanned one run with the cache off, as the plan runs;
    the config's use_cache is back on after."""
    transformers = pytest.importorskip("transformers")
    from estimators.step.train_step import TrainStep
    from planner import solve_sac
    from planner.analysis.report import gradient_check_text

    torch.manual_seed(0)
    model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=64, window_size=8)).train()
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    plan = solve_sac(model, 1.0, TrainStep(inputs=batch, optimizer="adamw"), options=PlanOptions(reserve_gib=0))
    check = check_gradients(model, plan, TrainStep(inputs=batch))
    assert model.config.use_cache is True
    if check.equal:  # a torch whose kernels round the cached step alike: nothing to explain
        assert check.equal_with_cache_off is None
    else:
        assert check.equal_with_cache_off is True, check
        assert "bitwise equal to it with use_cache off" in gradient_check_text(check)
    # Not an HF model: a real difference is the plan's, and no cache run is made.
    net = _Net()
    assert check_gradients(net, _full_plan(net, "_Net.a"), TrainStep(inputs=(torch.randn(4, 8),))).equal_with_cache_off is None


@pytest.mark.hf
def test_an_hf_classifier_s_config_is_left_as_found():
    """ViT's first forward with labels sets config.problem_type (None -> 'single_label_
    classification'); the check puts the config back (found by a new-user helper)."""
    transformers = pytest.importorskip("transformers")
    from estimators.step.train_step import TrainStep
    from planner import solve_sac

    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=3)).train()
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([0, 2])}
    plan = solve_sac(model, 1.0, TrainStep(inputs=batch, optimizer="adamw"), options=PlanOptions(reserve_gib=0))
    before = dict(model.config.__dict__)
    assert check_gradients(model, plan, TrainStep(inputs=batch)).equal
    assert model.config.__dict__ == before and model.config.problem_type is None


@pytest.mark.slow
def test_a_compiled_model_is_refused_with_the_module_to_check():
    """It named apply_plan, which the user did not call (found by a new-user helper)."""
    net = _Net()
    compiled = torch.compile(net)
    with pytest.raises(TypeError, match=r"check_gradients got a torch.compile'd model.*_orig_mod"):
        check_gradients(compiled, _full_plan(net, "_Net.a"), TrainStep(inputs=(torch.randn(4, 8),)))
