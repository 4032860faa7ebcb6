"""estimators/tracing/fake_copy.py: the fake copy a trace runs never touches the user's model."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import estimate
from estimators.tracing.fake_copy import fake_copy, rebind_functions


class _Patched(nn.Module):
    """A module whose Linear got an instance-level forward closing over it, as HF's tensor
    parallel styles install (``module.forward = tp_forward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        original = self.lin.forward
        lin = self.lin

        def patched(x):
            return original(x) * lin.weight.shape[0]

        self.lin.forward = patched

    def forward(self, x):
        return self.lin(x)


def test_a_function_stored_on_a_module_is_rebuilt_over_the_copy():
    model = _Patched()
    copy, mapping = fake_copy(model, FakeTensorMode())
    fn = copy.lin.forward
    assert fn is not model.lin.forward
    cells = [c.cell_contents for c in fn.__closure__]
    assert copy.lin in cells and model.lin not in cells
    bound = [c for c in cells if isinstance(c, types.MethodType)]
    assert len(bound) == 1 and bound[0].__self__ is copy.lin  # the copy's own forward
    assert isinstance(mapping[id(model.lin.weight)], FakeTensor)


def test_rebinding_leaves_functions_without_copied_objects_alone():
    model = nn.Linear(2, 2)
    model.helper = lambda x: x + 1
    assert rebind_functions(model, {}) == 0


def test_the_fake_trace_of_a_patched_model_is_the_real_one_and_leaves_it_without_gradients():
    torch.manual_seed(0)
    model = _Patched()
    step = TrainStep(inputs=(torch.randn(4, 8),), optimizer="adamw")
    fake = estimate(model, step)
    from estimators.tracing.estimation import EstimateOptions, TraceMode

    real = estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL))
    assert fake.module_info.peak_bytes == real.module_info.peak_bytes
    assert all(p.grad is None for p in model.parameters())
