"""estimators/step.py: the TrainStep options (validation, clear errors) and the loop it runs."""

from __future__ import annotations

import pytest
import torch

from estimators.device import get_device_spec
from estimators.estimate import estimate
from estimators.step import TrainStep, ZeroGrad, run_step, zero_grads
from examples import EXAMPLES


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_micro_batches_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"micro_batches must be an int >= 1"):
        TrainStep(micro_batches=bad)


@pytest.mark.parametrize("bad", [torch.float32, torch.float64, torch.int8, "bf16"])
def test_unknown_autocast_dtype(bad):
    with pytest.raises(ValueError, match=r"autocast_dtype must be None, torch.bfloat16 or torch.float16"):
        TrainStep(autocast_dtype=bad)


def test_zero_grad_accepts_its_names_and_refuses_others():
    assert TrainStep(zero_grad="zero").zero_grad is ZeroGrad.ZERO
    with pytest.raises(ValueError, match=r"zero_grad must be ZeroGrad.SET_TO_NONE"):
        TrainStep(zero_grad="sometimes")


def test_fields_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        TrainStep((torch.ones(1),))  # noqa: the point is that it raises
    step = TrainStep()
    with pytest.raises(AttributeError):
        step.micro_batches = 2  # type: ignore[misc]


def test_a_dtype_the_target_cannot_run():
    step = TrainStep(autocast_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"float16 cannot run on the target 'cpu'.*autocast_dtype=torch.bfloat16"):
        step.check_target(get_device_spec("cpu"))
    step.check_target(get_device_spec("h100"))  # CUDA targets run both
    no_bf16 = get_device_spec("cpu").replace(name="old-cpu", peak_flops_per_s={torch.float32: 1e11})
    with pytest.raises(ValueError, match=r"bfloat16 cannot run on the target 'old-cpu'.*drop autocast_dtype"):
        TrainStep(autocast_dtype=torch.bfloat16).check_target(no_bf16)


def test_estimate_refuses_fp16_for_the_cpu_target():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(ValueError, match=r"float16 cannot run on the target 'cpu'"):
        estimate(model, step=TrainStep(inputs=inputs, autocast_dtype=torch.float16))


def test_step_and_loose_arguments_together_are_refused():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(ValueError, match=r"pass either step=TrainStep\(...\) or inputs, optimizer"):
        estimate(model, inputs, step=TrainStep(), optimizer="adam")


def test_grads_alive_at_start():
    assert not TrainStep().grads_alive_at_start
    assert TrainStep(micro_batches=2).grads_alive_at_start
    assert TrainStep(zero_grad=ZeroGrad.ZERO).grads_alive_at_start


def test_accumulation_gives_the_mean_gradient_of_the_micro_batches():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    run_step(lin, (x,), None, None, micro_batches=4)
    accumulated = lin.weight.grad.clone()
    zero_grads(lin, None, ZeroGrad.SET_TO_NONE)
    assert lin.weight.grad is None
    run_step(lin, (x,), None, None)
    assert torch.allclose(accumulated, lin.weight.grad)


def test_autocast_covers_forward_and_loss_not_backward():
    seen = {}

    def loss_fn(out, inputs):
        seen["out"] = out.dtype
        seen["in_autocast"] = torch.is_autocast_enabled("cpu")
        return out.float().sum()

    lin = torch.nn.Linear(4, 4)
    run_step(lin, (torch.randn(2, 4),), loss_fn, None, autocast_dtype=torch.bfloat16)
    assert seen == {"out": torch.bfloat16, "in_autocast": True}
    assert lin.weight.grad.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
