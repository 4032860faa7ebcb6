"""estimators/tracing/fake_dispatch.py: the memo returns what FakeTensorMode returns, its key
determines the mode's, and the trace is the same with and without it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from estimators.tracing import fake_dispatch
from estimators.tracing.estimation import estimate
from estimators.tracing.fake_dispatch import FakeDispatchMemo, MemoMode, memo_available
from estimators.step.train_step import TrainStep
from examples.convnet import convnet_tiny
from examples.gpt import gpt_tiny
from examples.llama import llama_tiny
from tests.estimators.tracing.trace_equivalence import estimate_difference

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not memo_available(), reason="this torch lacks the internals the memo uses")


def _meta(t: torch.Tensor) -> tuple:
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device, t.requires_grad,
            t.untyped_storage().nbytes())


def _twice(memo: FakeDispatchMemo, func, args, kwargs=None):
    """The memo's first call (plain path, entry learnt) and its second (built from the entry),
    below autograd and view tracking, where the trace calls it (the tracer is a dispatch mode)."""
    kwargs = kwargs or {}
    with torch._C._AutoDispatchBelowADInplaceOrView():
        first = memo(func, args, kwargs)
        hits = memo.hits
        second = memo(func, args, kwargs)
    assert memo.hits == hits + 1, f"{func} was not taken from the memo"
    return first, second


def test_outputs_are_the_modes_new_views_and_in_place():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = FakeDispatchMemo(mode)
    with mode:
        x = torch.empty(6, 4)
        w = torch.empty(4, 5, requires_grad=True)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            plain = aten.mm.default(x, w)
        first, second = _twice(memo, aten.mm.default, (x, w))
        assert _meta(first) == _meta(second) == _meta(plain)
        assert first.untyped_storage() is not second.untyped_storage()  # a new tensor each time

        v1, v2 = _twice(memo, aten.t.default, (x,))
        assert _meta(v1) == _meta(v2) == _meta(x.t())
        assert v2.untyped_storage() is x.untyped_storage()  # a view shares its input's storage

        o1, o2 = _twice(memo, aten.add_.Tensor, (x, x))
        assert o1 is x and o2 is x  # in place: the argument itself

        s1, s2 = _twice(memo, aten.native_layer_norm.default, (x, [4], None, None, 1e-5))
        assert [_meta(t) for t in s1] == [_meta(t) for t in s2]


def test_the_key_tells_apart_what_the_modes_key_does():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = FakeDispatchMemo(mode)
    with mode:
        x = torch.empty(6, 4)
        xt = torch.empty(4, 6).t()  # same shape, other strides
        half = torch.empty(6, 4, dtype=torch.bfloat16)
        big = torch.empty(100)[: 24].view(6, 4)  # same shape and strides, larger storage
        grad = torch.empty(6, 4, requires_grad=True)
        keys = {memo._key(aten.sum.default, (t,), {}) for t in (x, xt, half, big, grad)}
        assert len(keys) == 5
        assert memo._key(aten.add.Tensor, (x, 1), {}) != memo._key(aten.add.Tensor, (x, 1.0), {})
        assert memo._key(aten.sum.dim_IntList, (x, [0]), {}) != memo._key(aten.sum.dim_IntList, (x, [1]), {})
        assert (memo._key(aten.sum.dim_IntList, (x, [0]), {"keepdim": True})
                != memo._key(aten.sum.dim_IntList, (x, [0]), {"keepdim": False}))


def test_what_the_key_does_not_describe_takes_the_plain_path():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = FakeDispatchMemo(mode)
    with mode:
        const = torch.tensor(2.0)  # a fake tensor with a constant
        assert isinstance(const, FakeTensor) and const.constant is not None
    real = torch.ones(3)
    for args in [(const, const), (real, real)]:
        with pytest.raises(fake_dispatch._NotKeyable):
            memo._key(aten.add.Tensor, args, {})
    with mode, torch._C._AutoDispatchBelowADInplaceOrView():
        for _ in range(2):
            assert memo(aten.mul.Tensor, (const, const), {}).constant.item() == 4.0
    assert memo.hits == 0


def test_the_memo_is_off_where_the_mode_differs():
    assert not FakeDispatchMemo(FakeTensorMode(shape_env=ShapeEnv())).enabled
    uncached = FakeTensorMode()
    uncached.cache_enabled = False
    assert not FakeDispatchMemo(uncached).enabled
    assert FakeDispatchMemo(FakeTensorMode()).enabled


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_with_another_mode_between_the_memo_leaves_the_op_to_it():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = FakeDispatchMemo(mode)
    with mode, torch._C._AutoDispatchBelowADInplaceOrView():
        x = torch.empty(3, 3)
        memo(aten.mm.default, (x, x), {})
        memo(aten.mm.default, (x, x), {})
        hits = memo.hits
        with _Seen() as seen:
            memo(aten.mm.default, (x, x), {})
    assert hits == 1 and memo.hits == hits and seen.ops == [aten.mm.default]


_MODELS = {"gpt_tiny": gpt_tiny, "llama_tiny": llama_tiny, "convnet_tiny": convnet_tiny}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["h100", "cpu"])
@pytest.mark.parametrize("name", sorted(_MODELS))
def test_estimates_equal_without_the_memo(name, device, monkeypatch):
    model, inputs = _MODELS[name](device="meta")
    step = TrainStep(inputs=inputs, loss_fn=lambda out, _: out.float().sum(), optimizer="adamw")
    estimate(model, step, device=device)  # the memo learns
    hits: list[int] = []
    real_call = FakeDispatchMemo.__call__

    def counting(self, func, args, kwargs):
        out = real_call(self, func, args, kwargs)
        hits.append(self.hits)
        return out

    monkeypatch.setattr(FakeDispatchMemo, "__call__", counting)
    memoised = estimate(model, step, device=device)
    assert hits and hits[-1] > 0.5 * len(memoised.trace.ops)
    monkeypatch.setattr(fake_dispatch, "_INTERNALS", False)
    plain = estimate(model, step, device=device)
    assert estimate_difference(plain, memoised) == ""
    assert (plain.module_info, plain.first_step_peak_bytes) == (memoised.module_info, memoised.first_step_peak_bytes)


def test_one_memo_key_is_one_key_of_the_mode(monkeypatch):
    """Over whole steps: every memo key met stands for a single key of FakeTensorMode."""
    seen: dict[tuple, object] = {}
    real_key = FakeDispatchMemo._key

    def checking(self, func, args, kwargs):
        key = real_key(self, func, args, kwargs)
        try:
            theirs = self.mode._cache_key(_CacheKeyState(None), func, args, kwargs)
        except Exception:  # noqa: BLE001 - the mode does not cache this call: nothing to compare
            return key
        assert seen.setdefault(key, theirs) == theirs, f"{func}: one memo key, two keys of the mode"
        return key

    monkeypatch.setattr(FakeDispatchMemo, "_key", checking)
    for name, make in sorted(_MODELS.items()):
        model, inputs = make(device="meta")
        estimate(model, TrainStep(inputs=inputs, loss_fn=lambda out, _: out.float().sum(), optimizer="adam"),
                 device="h100")
    assert len(seen) > 100


def test_a_list_of_new_tensors_is_memoised_and_so_is_a_split():
    """The mode does not cache list outputs ("to avoid the complexity"); a _foreach_ op whose
    outputs are new tensors is memoised with an entry made as the mode makes its own. ``split``
    returns a list of views the first time and the mode caches it as a tuple: the memo's hits
    return what the mode's own hits return (its entry, views of the input's storage)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = FakeDispatchMemo(mode)
    with mode, torch._C._AutoDispatchBelowADInplaceOrView():
        xs = [torch.empty(3, 4), torch.empty(5)]
        with torch._C._AutoDispatchBelowADInplaceOrView():
            plain = aten._foreach_sqrt.default(xs)
        first = memo(aten._foreach_sqrt.default, (xs,), {})
        hits = memo.hits
        second = memo(aten._foreach_sqrt.default, (xs,), {})
        assert memo.hits == hits + 1 and type(second) is list
        for a, b, c in zip(plain, first, second):
            assert _meta(a) == _meta(b) == _meta(c) and vars(a) == vars(c)
            assert c.untyped_storage() is not a.untyped_storage()
        x = torch.empty(6, 5).t()  # (5, 6), strides (1, 5): the views' strides are not contiguous ones
        first = memo(aten.split.Tensor, (x, 2), {})
        hits = memo.hits
        built = [memo(aten.split.Tensor, (x, 2), {}) for _ in range(2)]
        assert memo.hits == hits + 2
        theirs = aten.split.Tensor(x, 2)  # the mode's own cache hit, for reference
        assert type(first) is list and len(theirs) == len(first) == 3
        for parts in built:
            assert len(parts) == 3
            for a, b, c in zip(first, parts, theirs):
                assert _meta(a) == _meta(b) == _meta(c) and vars(b) == vars(c)
                assert b.untyped_storage() is x.untyped_storage() and b is not c
                assert torch._C._dispatch_key_set(b) == torch._C._dispatch_key_set(c)


def test_the_hot_path_modes_dispatch_without_torchs_per_call_dynamo_wrapper():
    """torch wraps a mode's __torch_dispatch__ in _disable_dynamo unless the mode opts out; the
    tracer and the memo opt out (HotPathMode), and the traced step runs with compilation off."""
    from estimators.tracing.op_args import HotPathMode
    from estimators.tracing.trace import StepTracer

    for mode in (StepTracer, MemoMode):
        assert issubclass(mode, HotPathMode)
        assert not hasattr(mode.__dict__["__torch_dispatch__"], "__wrapped__"), mode

    class Wrapped(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert hasattr(Wrapped.__dict__["__torch_dispatch__"], "__wrapped__")  # what the opt-out avoids
