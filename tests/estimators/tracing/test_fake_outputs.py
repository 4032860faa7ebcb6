"""estimators/tracing/fake_outputs.py: the tensors built from a cache entry are the ones
FakeTensorMode builds from it, and another torch's code turns the builder off."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from estimators.tracing import fake_dispatch, fake_outputs
from estimators.tracing.estimation import estimate
from estimators.tracing.fake_dispatch import FakeDispatchMemo, memo_available
from estimators.tracing.fake_outputs import OutputBuilder
from estimators.step.train_step import TrainStep
from examples.gpt import gpt_tiny
from tests.estimators.tracing.trace_equivalence import estimate_difference

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not memo_available(), reason="this torch lacks the internals the memo uses")


def test_this_torchs_code_is_the_code_replicated():
    """A torch whose FakeTensor code moves fails here (update _REPLICATED after reading the
    diff), and builds through the mode meanwhile."""
    assert fake_outputs._source_hashes() == fake_outputs._REPLICATED
    assert fake_outputs._same_torch_code()


def _entry(mode, func, args, kwargs=None):
    memo = FakeDispatchMemo(mode)
    memo(func, args, kwargs or {})
    memo(func, args, kwargs or {})  # a view's first run may differ from the mode's cache hits
    found = fake_dispatch._MEMO[memo._key(func, args, kwargs or {})]
    assert found is not fake_dispatch._NO_KEY
    return found[0], found[1]


def _same(a, b):
    return (type(a) is type(b) and vars(a) == vars(b) and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.requires_grad == b.requires_grad and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()
            and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
            and torch._C._dispatch_key_set(a) == torch._C._dispatch_key_set(b))


@pytest.mark.parametrize("op", ["mm", "t", "detach", "max", "layer_norm", "conj", "add_"])
def test_built_tensors_are_the_modes(op):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch._C._AutoDispatchBelowADInplaceOrView():
        x = torch.empty(6, 4, requires_grad=True)
        w = torch.empty(4, 5)
        c = torch.empty(3, dtype=torch.complex64)
        func, args = {
            "mm": (aten.mm.default, (x, w)), "t": (aten.t.default, (x,)), "detach": (aten.detach.default, (x,)),
            "max": (aten.max.dim, (x, 1)), "layer_norm": (aten.native_layer_norm.default, (x, [4], None, None, 1e-5)),
            "conj": (aten._conj.default, (c,)), "add_": (aten.add_.Tensor, (w, w)),
        }[op]
        mode_key, entry = _entry(mode, func, args)
        builder = OutputBuilder(mode)
        assert builder.enabled and OutputBuilder.can_build(entry)
        with unset_fake_temporarily():
            theirs = builder.official(entry, mode_key, func, args)
            ours = builder.build(entry, mode_key, func, args)
    pairs = list(zip(theirs, ours)) if isinstance(theirs, tuple) else [(theirs, ours)]
    assert pairs
    for a, b in pairs:
        if any(a is arg for arg in args):
            assert b is a
            continue
        assert _same(a, b)
        assert b is not a and (b.untyped_storage() is a.untyped_storage()) == func.is_view


def test_another_torchs_code_builds_through_the_mode(monkeypatch):
    monkeypatch.setattr(fake_outputs, "_REPLICATED", {**fake_outputs._REPLICATED, "FakeTensor.__new__": "0" * 16})
    fake_outputs._same_torch_code.cache_clear()
    try:
        assert not OutputBuilder(FakeTensorMode()).enabled
    finally:
        monkeypatch.undo()
        fake_outputs._same_torch_code.cache_clear()
    assert OutputBuilder(FakeTensorMode()).enabled


def test_estimates_equal_with_the_modes_own_outputs(monkeypatch):
    model, inputs = gpt_tiny(device="meta")
    step = TrainStep(inputs=inputs, loss_fn=lambda out, _: out.sum(), optimizer="adamw")
    estimate(model, step, device="h100")
    built = []
    real_build = OutputBuilder.build

    def counting(self, *a):
        built.append(self.enabled)
        return real_build(self, *a)

    monkeypatch.setattr(OutputBuilder, "build", counting)
    ours = estimate(model, step, device="h100")
    assert sum(built) > 0.5 * len(ours.trace.ops)
    monkeypatch.setattr(fake_outputs, "_same_torch_code", lambda: False)
    theirs = estimate(model, step, device="h100")
    assert estimate_difference(theirs, ours) == ""
    assert (theirs.module_info, theirs.first_step_peak_bytes) == (ours.module_info, ours.first_step_peak_bytes)
