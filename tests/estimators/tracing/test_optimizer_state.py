"""estimators/tracing/optimizer_state.py: the state made without a step is the state torch's first
step on zero gradients leaves, entry for entry, and anything else is left to that step."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.optim.optimizer import register_optimizer_step_post_hook

from estimators.tracing import optimizer_state
from estimators.tracing.estimation import estimate
from estimators.tracing.optimizer_state import make_first_step_state
from estimators.step.train_step import TrainStep, ZeroGrad
from examples.gpt import gpt_tiny
from tests.estimators.tracing.trace_equivalence import estimate_difference


class _Net(torch.nn.Module):
    """Parameters of several shapes and layouts: a transposed (non-contiguous) one, a frozen one,
    one outside the optimizer's stepped set that holds a gradient already."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Parameter(torch.randn(6, 3).t())  # strides (1, 3)
        self.c = torch.nn.Parameter(torch.randn(5))
        self.frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
        self.held = torch.nn.Parameter(torch.randn(3))  # not stepped, has a gradient


_CASES = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, foreach=True),
    "adam-single": lambda ps: torch.optim.Adam(ps, foreach=False),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, weight_decay=0.1),
    "adamw-amsgrad-single": lambda ps: torch.optim.AdamW(ps, amsgrad=True, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}


def _setup(make_opt, fake: FakeTensorMode | None):
    torch.manual_seed(0)
    net = _Net()
    if fake is not None:
        for mod in net.modules():
            for name, p in list(mod._parameters.items()):
                mod._parameters[name] = torch.nn.Parameter(fake.from_tensor(p), requires_grad=p.requires_grad)
    with fake if fake is not None else torch.no_grad():
        net.held.grad = torch.zeros_like(net.held)
        groups = [{"params": [net.a.weight, net.b, net.held]}, {"params": [net.a.bias, net.c, net.frozen], "lr": 0.01}]
        opt = make_opt(groups)
    stepped = [net.a.weight, net.a.bias, net.b, net.c]
    return net, opt, stepped


def _warm_up(opt, stepped, fake):
    """What the planner's general path does: zero gradients, one step (here as a reference)."""
    with fake if fake is not None else torch.no_grad():
        with torch.no_grad():
            for p in stepped:
                p.grad = torch.zeros_like(p)
        opt.step()


def _describe_state(opt, order):
    """Every entry of the state: parameter (by position), key, and the tensor's metadata."""
    out = []
    for p, entries in opt.state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                const = value.constant if isinstance(value, FakeTensor) else value.detach()
                out.append((order[id(p)], key, type(value).__name__, value.dtype, tuple(value.shape), value.stride(),
                            value.storage_offset(), value.untyped_storage().nbytes(), str(value.device),
                            value.requires_grad, value.is_contiguous(),
                            None if const is None or const.numel() > 1 else float(const)))
            else:
                out.append((order[id(p)], key, repr(value)))
    return out


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_state_is_the_first_steps(case, fake):
    modes = [FakeTensorMode(allow_non_fake_inputs=True) if fake else None for _ in range(2)]
    net_ref, opt_ref, stepped_ref = _setup(_CASES[case], modes[0])
    _warm_up(opt_ref, stepped_ref, modes[0])
    net, opt, stepped = _setup(_CASES[case], modes[1])
    with modes[1] if fake else torch.no_grad():
        assert make_first_step_state(opt, stepped)
    order_ref = {id(p): i for i, p in enumerate(net_ref.parameters())}
    order = {id(p): i for i, p in enumerate(net.parameters())}
    expected = _describe_state(opt_ref, order_ref)
    assert _describe_state(opt, order) == expected
    if case.startswith("adam"):
        assert len(expected) >= 4 * 3  # the held parameter's gradient gets state too


class _MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.RMSprop(ps),
    lambda ps: _MyAdam(ps),
    lambda ps: torch.optim.Adam(ps, differentiable=True),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01)),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=True),
], ids=["rmsprop", "subclass", "differentiable", "tensor-lr", "sgd-decay", "sgd-maximize"])
def test_other_optimizers_are_left_to_their_step(make_opt):
    net, opt, stepped = _setup(make_opt, None)
    assert not make_first_step_state(opt, stepped)
    assert not opt.state


def test_a_step_hook_leaves_the_state_to_the_step():
    net, opt, stepped = _setup(_CASES["adam"], None)
    handle = opt.register_step_pre_hook(lambda *_: None)
    assert not make_first_step_state(opt, stepped)
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda *_: None)
    try:
        assert not make_first_step_state(opt, stepped)
    finally:
        handle.remove()
    assert make_first_step_state(opt, stepped)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(optimizer="adamw"),
    dict(optimizer="sgd"),
    dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    dict(optimizer=lambda ps: torch.optim.Adam(ps, amsgrad=True), zero_grad=ZeroGrad.ZERO),
    dict(optimizer="adam", micro_batches=2),
    dict(optimizer=lambda ps: torch.optim.Adam(ps, foreach=False)),
], ids=["adamw", "sgd", "sgd-momentum", "adam-amsgrad-zero", "adam-micro2", "adam-single"])
def test_estimates_equal_the_warm_up_steps(kw, monkeypatch):
    model, inputs = gpt_tiny(device="meta")
    step = TrainStep(inputs=inputs, loss_fn=lambda out, _: out.sum(), **kw)
    made = estimate(model, step, device="h100")
    monkeypatch.setattr(optimizer_state, "_MAKERS", {})  # every optimizer takes the warm-up step
    stepped = estimate(model, step, device="h100")
    assert estimate_difference(stepped, made) == ""
    assert (stepped.module_info, stepped.first_step_peak_bytes) == (made.module_info, made.first_step_peak_bytes)


def test_a_step_count_is_the_fake_tensor_torch_tensor_makes(monkeypatch):
    """Adam's step count, made directly (Python dispatch off while its tensors are built, the
    FakeTensor constructor), is what ``torch.tensor(1.0)`` makes under the mode, with the memo's
    mode above it as while the state is made; the converter where the constructor does not fit."""
    from estimators.tracing.fake_dispatch import MemoMode

    def describe(t):
        return (type(t), t.dtype, tuple(t.shape), t.device, float(t.constant), type(t.constant), t.constant.device,
                torch._C._dispatch_key_set(t), sorted(k for k in vars(t) if k != "constant"),
                {k: v for k, v in vars(t).items() if k not in ("constant", "fake_mode")}, t.fake_mode is mode)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, MemoMode(mode):
        ours = optimizer_state._step_count()
        theirs = torch.tensor(1.0, dtype=optimizer_state._scalar_dtype(), device="cpu")
        assert describe(ours) == describe(theirs)
        assert mode.fake_tensor_converter._get_memo(ours.constant) is ours  # a kernel on the constant maps back
        assert torch._C._len_torch_dispatch_stack() == 2  # the modes are still on
        monkeypatch.setattr(optimizer_state, "FakeTensor", lambda *a, **k: (_ for _ in ()).throw(TypeError()))
        fallback = optimizer_state._step_count()
        assert describe(fallback) == describe(theirs)
