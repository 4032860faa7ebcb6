"""planner/applying/forward_state.py: a recompute starts from the state its forward started from --
buffers mutated, rebound, registered or deleted; arguments aliased or held in containers the
caller changes after the call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from estimators.step.train_step import TrainStep
from tests.planner.applying.test_planned_forward import (
    _Encoder,
    _encoder_batch,
    _plan_at,
    _SpectralBlocks,
    _train_side_by_side,
)

def test_a_full_checkpoint_recomputes_from_the_buffers_the_forward_started_from():
    # Spectral norm's forward runs a power-iteration step on its buffers _u, _v and reads them.
    # The recompute started from the updated vectors: another weight, gradients 8.5e-4 off.
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    torch.manual_seed(0)
    ref, x = _SpectralBlocks(), torch.randn(4, 3, 8, 8)
    planned = copy.deepcopy(ref)
    apply_module_plans(planned, [ModulePlan(fqn="_SpectralBlocks.blocks", discard_ratio=1.0, full=True)])
    _same_adamw_steps(ref, planned, x, seeded=True)
    for n, b in ref.state_dict().items():
        assert torch.equal(planned.state_dict()[n], b), n


def _same_adamw_steps(ref: nn.Module, planned: nn.Module, x: torch.Tensor, n_steps: int = 3,
                      seeded: bool = False) -> None:
    """Train both with AdamW on ``x.sum()`` side by side (``seeded``: torch's seed set to the step
    number before each forward); every step's gradients bitwise equal."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, planned)]
    for step in range(n_steps):
        grads = []
        for m, opt in zip((ref, planned), opts):
            if seeded:
                torch.manual_seed(step)
            m(x).sum().backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        for n, g in grads[0].items():
            assert torch.equal(grads[1][n], g), (step, n)


class _RunningCentre(nn.Module):
    """A block that keeps a running mean and a call counter by rebinding its buffers
    (``self.mu = 0.9 * self.mu + ...``), then reads the new mean."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.register_buffer("mu", torch.zeros(16))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        with torch.no_grad():
            self.mu = 0.9 * self.mu + 0.1 * x.mean((0, 1))
            self.count = self.count + 1
        return x + self.fc2(torch.relu(self.fc1(x - self.mu)))


@pytest.mark.parametrize("full", [True, False])
def test_a_recompute_reads_the_buffers_the_forward_started_from_when_the_forward_rebinds_them(full):
    # The recompute read the rebound mean: gradients 3.26 off, and the counter stepped twice.
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    torch.manual_seed(0)
    ref = nn.Sequential(_RunningCentre(), _RunningCentre(), nn.Linear(16, 2))
    x = torch.randn(2, 32, 16) + 1.0
    planned = copy.deepcopy(ref)
    saved = () if full else (("aten.addmm.default", 0),)
    apply_module_plans(planned, [ModulePlan(fqn="Sequential.0", discard_ratio=1.0 if full else 0.5,
                                            full=full, saved_ops=saved)])
    _same_adamw_steps(ref, planned, x)
    assert int(planned[0].count) == 3
    for n, b in ref.state_dict().items():
        assert torch.equal(planned.state_dict()[n], b), n


class _DeletesItsBuffer(nn.Module):
    """A one-shot warm start: the first forward scales by ``init`` and deletes it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("init", torch.full((16,), 2.0))

    def forward(self, x):
        if hasattr(self, "init"):
            w = self.init
            del self.init
            return self.fc(x) * w
        return self.fc(x)


class _RegistersInForward(nn.Module):
    """A counter registered by the first forward, then rebound by every forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if "n" not in self._buffers:
            self.register_buffer("n", torch.zeros(()))
        with torch.no_grad():
            self.n = self.n + 1
        return self.fc(x) * self.n


@pytest.mark.parametrize("block", [_DeletesItsBuffer, _RegistersInForward])
def test_a_recompute_sees_the_buffer_table_the_forward_started_from(block):
    # A deleted buffer came back as None after the recompute (TypeError at step 2); a buffer
    # registered by the forward was already there in the recompute (gradients off at step 0).
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    torch.manual_seed(0)
    ref = nn.Sequential(block(), nn.Linear(16, 2))
    planned = copy.deepcopy(ref)
    apply_module_plans(planned, [ModulePlan(fqn="Sequential.0", discard_ratio=1.0, full=True)])
    _same_adamw_steps(ref, planned, torch.randn(4, 16))
    assert dict(ref.named_buffers()).keys() == dict(planned.named_buffers()).keys()
    for n, b in ref.named_buffers():
        assert torch.equal(dict(planned.named_buffers())[n], b), n


def test_a_checkpoint_under_save_on_cpu_recomputes_with_the_same_argument_aliasing():
    # The user's own saved-tensor hooks do the same to a real run: torch's save_on_cpu around
    # the step, attn(x, x, x) fully checkpointed -> CheckpointError in the backward.
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    torch.manual_seed(0)
    ref, batch = _Encoder(), _encoder_batch()
    planned = copy.deepcopy(ref)
    apply_module_plans(planned, [ModulePlan(fqn="_Encoder.enc.layers.0.self_attn", discard_ratio=1.0, full=True)])
    grads = []
    for m in (ref, planned):
        torch.manual_seed(2)
        with torch.autograd.graph.save_on_cpu():
            loss = m(*batch)
        loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _DenseLayer(nn.Module):
    """torchvision's DenseNet layer: takes the list of every earlier feature map."""

    def __init__(self, c_in: int, growth: int = 4) -> None:
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, growth, 3, padding=1)

    def forward(self, features: list):
        return self.conv(torch.relu(self.norm(torch.cat(features, 1))))


class _DenseBlock(nn.Module):
    def __init__(self, c: int = 8, n: int = 3, growth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(c + i * growth, growth) for i in range(n))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))  # the list the layer got grows after its call
        return torch.cat(features, 1).mean()


class _TakesItsShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x, shape: torch.Size, extra: tuple):
        h = torch.tanh(self.up(x.reshape(shape.numel() // 16, 16)))
        return self.down(h).reshape(shape) + extra[0]


@pytest.mark.slow
def test_sizes_and_tuples_of_values_reach_the_recompute_unchanged():
    # The container copies turned a torch.Size into a plain tuple: .numel() failed in every
    # recompute, and solve_sac crashed at every budget that planned such a block.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_TakesItsShape() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x, x.shape, (1.0, 2))
            return x

    torch.manual_seed(0)
    ref = Net()
    step = TrainStep(inputs=(torch.randn(8, 32, 16),), optimizer="adamw")
    plan = _plan_at(ref, step, 0.0)
    assert plan.modules
    measured = _train_side_by_side(copy.deepcopy(ref), copy.deepcopy(ref), plan, step, n_steps=2)
    assert measured[1].peak_bytes == plan.predicted_peak_bytes


@pytest.mark.slow
def test_a_list_argument_the_caller_appends_to_reaches_the_recompute_as_the_forward_got_it():
    # The recompute got the caller's list, one feature map longer: "running_mean should contain
    # 12 elements not 8" in solve_sac's verification trace, at every budget.
    torch.manual_seed(0)
    ref = _DenseBlock()
    step = TrainStep(inputs=(torch.randn(4, 8, 16, 16),), optimizer="adamw")
    plan = _plan_at(ref, step, 0.5)
    assert any(m.fqn.startswith("_DenseBlock.layers.") for m in plan.modules)
    measured = _train_side_by_side(copy.deepcopy(ref), copy.deepcopy(ref), plan, step, n_steps=2)
    assert measured[1].peak_bytes == plan.predicted_peak_bytes


class _OwnNoise(nn.Module):
    """A block drawing its dropout mask from a generator object it owns."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import random

        import numpy as np

        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.kind = kind
        self.gen = {"torch": lambda: torch.Generator().manual_seed(7), "random": lambda: random.Random(7),
                    "numpy": lambda: np.random.default_rng(7)}[kind]()

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.kind == "torch":
            keep = torch.rand(h.shape, generator=self.gen) > 0.2
        else:
            draw = self.gen.random() if self.kind == "random" else float(self.gen.random())
            keep = torch.arange(h.shape[-1]) % 5 != int(draw * 5)
        return x + self.fc2(h * keep)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "random", "numpy"])
def test_a_generator_the_module_owns_is_replayed_in_the_recompute(kind):
    # A block's own torch.Generator: the recompute drew another mask, 5 of 16 gradients off (up
    # to 1.29), no word; its own random.Random drew twice per step, the next step's forward
    # differed. check_gradients compared runs that drew from different states.
    from planner import check_gradients
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    torch.manual_seed(0)
    ref = nn.Sequential(_OwnNoise(kind), _OwnNoise(kind), nn.Linear(16, 4))
    planned = copy.deepcopy(ref)
    handle = apply_module_plans(planned, [ModulePlan(fqn=f"Sequential.{i}", discard_ratio=1.0, full=True)
                                          for i in range(2)])
    x = torch.randn(512, 16)
    _same_adamw_steps(ref, planned, x)
    handle.remove()
    torch.manual_seed(0)
    model = nn.Sequential(_OwnNoise(kind), _OwnNoise(kind), nn.Linear(16, 4))
    step = TrainStep(inputs=(x,), optimizer="adamw")
    plan = _plan_at(model, step, 0.0)
    assert plan.modules
    assert check_gradients(model, plan, TrainStep(inputs=(x,))).equal
