"""estimators/tracing/fake_copy.py: the fake copy a trace runs never touches the user's model."""

from __future__ import annotations

import collections
import functools
import types

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import EstimateOptions, TraceMode, estimate
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


class _PartialForward(nn.Module):
    """A Linear whose forward is a closure over a ``functools.partial`` of its own bound forward,
    as torchtitan's ``Module.parallelize`` installs one over DTensor's ``local_map`` wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        wrapped = functools.partial(_scaled, self.lin.forward, 2.0)

        def forward_with_redistribution(x):
            return wrapped(x)

        self.lin.forward = forward_with_redistribution

    def forward(self, x):
        return self.lin(x)


def _scaled(fn, factor, x):
    return fn(x) * factor


def test_a_partial_a_stored_function_closes_over_is_rebuilt_over_the_copy():
    model = _PartialForward()
    copy, _ = fake_copy(model, FakeTensorMode())
    (cell,) = copy.lin.forward.__closure__
    wrapped = cell.cell_contents
    assert isinstance(wrapped, functools.partial)
    assert wrapped.args[0].__self__ is copy.lin and wrapped.args[1] == 2.0


class _Dispatcher:
    """An object that keeps a module's bound forward, as HF's expert-parallel implementation
    (``AllToAllEP.experts_forward``) does."""

    def __init__(self, forward) -> None:
        self.experts_forward, self.scale = forward, 2.0

    def __call__(self, x):
        return self.experts_forward(x) * self.scale


class _ObjectForward(nn.Module):
    """A Linear whose stored forward closes over such an object (HF's ``ep_forward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        dispatcher = _Dispatcher(self.lin.forward)

        def ep_forward(x):
            return dispatcher(x)

        self.lin.forward = ep_forward

    def forward(self, x):
        return self.lin(x)


def test_an_object_a_stored_function_closes_over_is_copied_over_the_copy():
    model = _ObjectForward()
    copy, _ = fake_copy(model, FakeTensorMode())
    (cell,) = copy.lin.forward.__closure__
    (original,) = model.lin.forward.__closure__
    dispatcher = cell.cell_contents
    assert dispatcher is not original.cell_contents and dispatcher.experts_forward.__self__ is copy.lin
    assert dispatcher.scale == 2.0 and original.cell_contents.experts_forward.__self__ is model.lin


@pytest.mark.parametrize("build", [lambda: _Patched(), lambda: _PartialForward(), lambda: _ObjectForward()],
                         ids=["patched", "partial", "object"])
def test_the_fake_trace_of_a_stored_forward_is_the_real_one_and_leaves_the_model_without_gradients(build):
    torch.manual_seed(0)
    model = build()
    step = TrainStep(inputs=(torch.randn(4, 8),), optimizer="adamw")
    fake = estimate(model, step)
    real = estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL))
    assert fake.module_info.peak_bytes == real.module_info.peak_bytes
    assert all(p.grad is None for p in model.parameters())


def test_a_process_group_a_module_keeps_is_shared_not_copied():
    import torch.distributed as dist

    from planner.distributed.fake_world import fake_process_group

    with fake_process_group(world_size=2, rank=0):
        model = nn.Linear(8, 8)
        model.tp_group = dist.group.WORLD  # as torchtitan's vocab-parallel Embedding keeps its TP group
        copy, _ = fake_copy(model, FakeTensorMode())
        assert copy.tp_group is model.tp_group


_META_PARAMS = [
    (torch.empty(4, 6, device="meta"), True),
    (torch.empty(6, 4, device="meta").t(), True),  # strides (1, 4)
    (torch.empty(3, device="meta", dtype=torch.bfloat16), False),
    (torch.empty(2, 3, 5, device="meta", dtype=torch.float16)[:, 1], True),  # offset 5, strides (15, 1)
]


def test_a_parameter_made_without_its_detach_is_the_constructors(monkeypatch):
    """A meta parameter's fake copy gets ``_is_param`` and ``requires_grad`` set on the new tensor
    itself, not on ``detach()`` of it as ``nn.Parameter`` does: the same parameter, checked once
    per process; the constructor again where the check finds them different."""
    from estimators.tracing import fake_copy as module
    from estimators.tracing.fake_dispatch import MemoMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    monkeypatch.setattr(module, "_SHORTCUT", None)
    with mode, MemoMode(mode):
        for t, grad in _META_PARAMS:
            ours = module._fake_cpu_parameter(t, grad)
            theirs = nn.Parameter(module._fake_cpu_empty(t), requires_grad=grad)
            assert module._SHORTCUT is True  # set by the first parameter, on this torch
            assert module._same_parameter(ours, theirs)
            assert ours._is_param and isinstance(ours, nn.Parameter) and type(ours) is FakeTensor
            assert (ours.shape, ours.stride(), ours.dtype, ours.requires_grad) == (t.shape, t.stride(), t.dtype, grad)

        detached = []
        real_new = nn.Parameter.__new__
        monkeypatch.setattr(nn.Parameter, "__new__", lambda cls, data=None, requires_grad=True:
                            detached.append(data) or real_new(cls, data, requires_grad))
        monkeypatch.setattr(module, "_SHORTCUT", None)
        monkeypatch.setattr(module, "_same_parameter", lambda a, b: False)
        for t, grad in _META_PARAMS:
            made = module._fake_cpu_parameter(t, grad)
            assert made._is_param and made.requires_grad == grad
        assert module._SHORTCUT is False and len(detached) == len(_META_PARAMS)  # the constructor each time


class _Tables(nn.Module):
    """Tables of every kind a module keeps: parameters, buffers (one non-persistent), a plain
    forward hook and one bound to the module (deepcopy rebinds that one to the copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3), persistent=False)
        self.register_buffer("absent", None)
        self.lin.register_forward_hook(_plain_hook)
        self.register_forward_pre_hook(self._bound_hook)

    def _bound_hook(self, module, args):
        return None

    def forward(self, x):
        return self.lin(x) * self.scale


def _plain_hook(module, args, out):
    return None


def _tables(root: nn.Module) -> list:
    """Each module's tables, their keys in order, and what each value is in the copy."""
    index = {id(t): f"{n}.{k}" for n, m in root.named_modules() for k, t in [*m._parameters.items(),
                                                                         *m._buffers.items()] if t is not None}
    index.update({id(m): f"module {n}" for n, m in root.named_modules()})
    out = []
    for name, mod in root.named_modules():
        for attr, table in sorted(vars(mod).items()):
            if type(table) in (collections.OrderedDict, set, dict):
                values = (table.items() if isinstance(table, dict) else ((x, None) for x in sorted(table)))
                out.append((name, attr, type(table), [
                    (k, index.get(id(v)) or (v.__self__ is mod if hasattr(v, "__self__") else v) if v is not None else None)
                    for k, v in values]))
    return out


def test_module_tables_are_copied_as_deepcopy_copies_them(monkeypatch):
    """fake_copy puts its own copies of the modules' OrderedDict and set tables in deepcopy's memo
    (deepcopy's own, through __reduce_ex__, raised and caught two exceptions per table): the same
    tables, the same keys in order, each value what deepcopy makes of it."""
    import copyreg

    from estimators.tracing import fake_copy as module

    model = _Tables()
    reduced = []
    slotnames = copyreg._slotnames
    monkeypatch.setattr(copyreg, "_slotnames", lambda cls: reduced.append(cls) or slotnames(cls))
    ours, _ = fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True))
    # Left to deepcopy: the root's _modules (its module is not copied yet), the bound hook's table.
    assert reduced.count(collections.OrderedDict) == 2 and set not in reduced
    reduced.clear()
    monkeypatch.setattr(module, "_copy_module_tables", lambda model, memo, skipped: None)
    theirs, _ = fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True))
    assert reduced.count(collections.OrderedDict) > 20 and set in reduced  # deepcopy's own path, for reference
    assert _tables(ours) == _tables(theirs)
    assert any(name == "" and attr == "_forward_pre_hooks" and [v for _, v in values] == [True]
               for name, attr, _, values in _tables(ours))  # the hook bound to the copy
    assert any(attr == "_parameters" and values == [("weight", "lin.weight"), ("bias", "lin.bias")]
               for _, attr, _, values in _tables(ours))
    assert ours._forward_pre_hooks is not model._forward_pre_hooks
    assert ours._non_persistent_buffers_set == {"scale"} and ours._non_persistent_buffers_set is not \
        model._non_persistent_buffers_set
    x = torch.randn(2, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert ours(x).shape == (2, 3)


def test_a_truncated_copy_copies_the_kept_blocks_tables_and_never_visits_the_skipped_ones(monkeypatch):
    """With blocks left out (a replicated trace), the tables are put in the memo before the kept
    blocks are copied (truncate_in_memo deep-copies them), and the left-out blocks are not walked."""
    import copyreg

    from estimators.tracing import fake_copy as module
    from estimators.tracing.stacks import find_stacks
    from examples.gpt import gpt_bench

    model, _ = gpt_bench(device="meta", n_layer=8)
    stacks = find_stacks(model)
    skipped = [model.blocks._modules[k] for st in stacks for k in st.skipped_keys]
    assert len(skipped) == 4
    memos = []
    real = module._copy_module_tables
    monkeypatch.setattr(module, "_copy_module_tables",
                        lambda model, memo, skip: (real(model, memo, skip), memos.append(memo)))
    reduced = []
    slotnames = copyreg._slotnames
    monkeypatch.setattr(copyreg, "_slotnames", lambda cls: reduced.append(cls) or slotnames(cls))
    copy, _ = fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True), stacks)
    assert len(copy.blocks) == 4
    assert collections.OrderedDict not in reduced and set not in reduced
    memo = memos[0]
    assert all(id(m._forward_hooks) not in memo for b in skipped for m in b.modules())
    kept = model.blocks[0]
    assert all(memo[id(m._forward_hooks)] is c._forward_hooks for m, c in zip(kept.modules(), copy.blocks[0].modules()))
