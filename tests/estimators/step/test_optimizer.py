"""estimators/step/optimizer.py: the optimizer a trace runs is the user's, rebuilt over the traced
parameters; the user's instance is never stepped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from estimators.runtime.device import get_device_spec
from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
from estimators.step.optimizer import param_groups, resolve_optimizer
from estimators.step.train_step import TrainStep
from estimators.tracing.trace import StorageKind
from examples import EXAMPLES
from planner.analysis.measure import measure_steps


def test_an_instance_is_rebuilt_with_its_groups_and_hyper_parameters_and_left_untouched():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    user = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=3e-4, betas=(0.8, 0.95))
    copies = {id(p): torch.nn.Parameter(p.detach().clone()) for p in model.parameters()}
    groups = param_groups(model, user, copies)
    built = resolve_optimizer(user, groups, get_device_spec("cpu"), fake=False)
    assert built is not user and type(built) is torch.optim.AdamW
    assert [g["weight_decay"] for g in built.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.8, 0.95) for g in built.param_groups)
    assert [len(g["params"]) for g in built.param_groups] == [1, 3]
    assert all(p is copies[id(q)] for g, u in zip(built.param_groups, user.param_groups)
               for p, q in zip(g["params"], u["params"]))
    assert not user.state  # the user's instance was never stepped


@pytest.mark.slow
@pytest.mark.parametrize("mode", [TraceMode.FAKE, TraceMode.REAL])
def test_optimizer_over_another_models_parameters_is_refused(mode):
    model, inputs = EXAMPLES["gpt_tiny"]()
    other, _ = EXAMPLES["gpt_tiny"]()
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)  # momentum state went uncounted
    with pytest.raises(ValueError, match=r"not this GPT's parameters; build it over model.parameters\(\)"):
        estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer=sgd), options=EstimateOptions(mode=mode))
    ok = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert ok.timeline.live_by_kind[-1][StorageKind.OPTIMIZER] >= params  # one momentum buffer each


def test_unknown_optimizer_name():
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamx'.*adam"):
        estimate(torch.nn.Linear(4, 4), TrainStep(inputs=(torch.randn(2, 4),), optimizer="adamx"))


@pytest.mark.slow
def test_optimizers_that_make_state_in_their_constructor_trace_in_fake_mode():
    # Adagrad makes its step counts in __init__; built outside the fake mode they were real, and
    # its step's .item() on them raised torch's bare DataDependentOutputException.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    step = TrainStep(inputs=(torch.randn(8, 16),), optimizer=torch.optim.Adagrad)
    est = estimate(model, step)
    first, steady, _ = [m.peak_bytes for m in measure_steps(model, step, torch.optim.Adagrad(model.parameters()),
                                                            n_steps=3)]
    assert (est.first_step_peak_bytes, est.steady_peak_bytes) == (first, steady)
    # ASGD reads its (non-constant) state with .item() inside the step: a clear refusal.
    with pytest.raises(TraceError, match=r"the optimizer step \(ASGD\) raised DataDependentOutputException.*"
                                         r"trace in real mode"):
        estimate(model, dataclasses.replace(step, optimizer=torch.optim.ASGD))
