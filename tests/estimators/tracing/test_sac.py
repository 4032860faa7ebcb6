"""estimators/tracing/sac.py: the selective-AC rules, each on a hand-built case."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from estimators.tracing.estimation import EstimateOptions, TraceMode, estimate
from estimators.contract.module_info import SACOp
from estimators.tracing.sac import cumulative_curve, greedy_units
from estimators.step.train_step import TrainStep

REAL = EstimateOptions(mode=TraceMode.REAL)


def _ops(model, *inputs, fqn):
    info = estimate(model, TrainStep(inputs=inputs), options=REAL).module_info
    return info.stats(fqn)


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *a):
        return self.inner(*a)


class ViewThenMm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))
        self.leaf = nn.Identity()  # makes this module non-leaf

    def forward(self, x):  # x: (4, 4, 4)
        h = torch.tanh(x.view(4, 16))  # view, then tanh (saves its output)
        return self.leaf(h.t().t() @ self.w)


def test_view_ops_never_cost_memory():
    x = torch.randn(4, 4, 4, requires_grad=True)
    st = _ops(Wrap(ViewThenMm()), x, fqn="Wrap.inner")
    views = [o for o in st.ops if o.is_view]
    assert {o.func for o in views} >= {"aten.view.default", "aten.t.default"}
    assert all(o.memory_bytes == 0 for o in views)
    tanh = next(o for o in st.ops if o.func == "aten.tanh.default")
    assert tanh.memory_bytes == 4 * 16 * 4 and tanh.is_saved
    units = greedy_units(st.ops)
    assert all(not st.ops[i].is_view for u in units for i in u.ops)
    assert st.sac_memory_bytes == 4 * 16 * 4


class InplaceAfterMm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.leaf = nn.Identity()

    def forward(self, x):
        h = x @ self.w
        h = h + 1.0  # saves nothing (a sigmoid here saved its output, which mul_ then overwrote:
        h.mul_(2.0)  # torch's own backward refuses that step, and the trace now does too)
        return self.leaf(h * h)


def test_inplace_op_goes_with_its_parent():
    x = torch.randn(4, 8, requires_grad=True)
    st = _ops(Wrap(InplaceAfterMm()), x, fqn="Wrap.inner")
    names = [o.func for o in st.ops]
    i_sig = names.index("aten.add.Tensor")
    i_mul_ = names.index("aten.mul_.Tensor") if "aten.mul_.Tensor" in names else names.index("aten.mul_.Scalar")
    assert st.ops[i_mul_].inplace_parent == i_sig
    unit = next(u for u in greedy_units(st.ops) if i_sig in u.ops)
    assert i_mul_ in unit.ops


class InplaceOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = nn.Identity()

    def forward(self, x):
        x.relu_()  # mutates a storage made outside this module: can only be saved
        return self.leaf(x * x)


def test_inplace_on_outside_storage_is_forced_saved():
    x = torch.randn(4, 8)
    y = (x * 1.0).requires_grad_()
    model = nn.Sequential(nn.Identity(), Wrap(InplaceOnInput()))
    st = _ops(model, y.detach().clone().requires_grad_() * 1.0, fqn="Sequential.1.inner")
    relu_ = next(i for i, o in enumerate(st.ops) if o.func == "aten.relu_.default")
    assert st.ops[relu_].inplace_parent == relu_
    assert all(relu_ not in u.ops for u in greedy_units(st.ops))


class TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.leaf = nn.Identity()

    def forward(self, x):
        h = F.dropout(x @ self.w, 0.5, True)
        h = torch.tanh(h)
        return self.leaf(F.dropout(h @ self.w, 0.5, True))


def test_random_ops_recomputed_together():
    x = torch.randn(4, 8, requires_grad=True)
    st = _ops(Wrap(TwoDropouts()), x, fqn="Wrap.inner")
    rand = [i for i, o in enumerate(st.ops) if o.is_random]
    assert len(rand) == 2
    units = greedy_units(st.ops)
    holding = [u for u in units if any(i in u.ops for i in rand)]
    assert len(holding) == 1 and set(rand) <= set(holding[0].ops)


def test_greedy_order_and_curve_on_a_hand_built_table():
    ops = (
        SACOp(func="a", occurrence=0, runtime_ms=4.0, memory_bytes=100),  # 25 B/ms
        SACOp(func="v", occurrence=0, runtime_ms=0.0, memory_bytes=0, is_view=True),
        SACOp(func="b", occurrence=0, runtime_ms=1.0, memory_bytes=100),  # 100 B/ms
        SACOp(func="c", occurrence=0, runtime_ms=1.0, memory_bytes=0),  # frees nothing
        SACOp(func="r", occurrence=0, runtime_ms=1.0, memory_bytes=30, is_random=True),
        SACOp(func="r", occurrence=1, runtime_ms=1.0, memory_bytes=30, is_random=True),  # 30 B/ms together
        SACOp(func="i", occurrence=0, runtime_ms=0.5, memory_bytes=0, inplace_parent=0),
    )
    units = greedy_units(ops)
    assert [u.ops for u in units] == [(2,), (4, 5), (0, 6)]
    curve = cumulative_curve(units)
    assert curve.discarded_bytes == (0, 100, 160, 260)
    assert curve.recompute_ms == (0.0, 1.0, 3.0, 7.5)
    segs = curve.lower_convex_envelope()
    slopes = [s for s, _ in segs]
    assert slopes == sorted(slopes)  # convex
    assert curve.recompute_ms_at(130) == 2.0


def test_storage_saved_by_another_module_frees_nothing():
    class Producer(nn.Module):
        def __init__(self):
            super().__init__()
            self.leaf = nn.Identity()

        def forward(self, x):
            return self.leaf(torch.tanh(x))  # tanh saves its output ...

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = Producer()

        def forward(self, x):
            y = self.p(x)
            return torch.sin(y)  # ... and sin, outside Producer, saves it too

    st = _ops(Top(), torch.randn(4, 4, requires_grad=True), fqn="Top.p")
    tanh = next(o for o in st.ops if o.func == "aten.tanh.default")
    assert tanh.is_saved and tanh.memory_bytes == 0
    assert st.sac_memory_bytes == 0


class ConvInplaceSiLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.act, self.conv2 = nn.Conv2d(4, 8, 1), nn.SiLU(inplace=True), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.conv2(self.act(self.conv1(x)))


def test_a_read_before_an_inplace_op_shares_the_decision_of_what_it_reads():
    # silu_ overwrites the conv output; its backward needs the input, so autograd clones it
    # first. Recomputing that clone from the saved (overwritten) conv output read silu's values:
    # wrong gradients, 3.3e-4 off. The clone now goes with the conv (and silu_, its in-place op).
    x = torch.randn(2, 4, 6, 6)
    for options in (REAL, EstimateOptions()):
        st = estimate(Wrap(ConvInplaceSiLU()), TrainStep(inputs=(x,)), options=options).module_info.stats("Wrap.inner")
        funcs = [o.func for o in st.ops]
        conv, clone, silu = (funcs.index(f) for f in ("aten.convolution.default", "aten.clone.default",
                                                        "aten.silu_.default"))
        assert conv < clone < silu
        assert st.ops[clone].reads_before_mutation == (conv,)
        assert st.ops[silu].inplace_parent == conv
        units = greedy_units(st.ops)
        assert any({conv, clone, silu} <= set(u.ops) for u in units)
        assert not any(clone in u.ops and conv not in u.ops for u in units)


class ViewThenInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):  # x: (2, 4, 8): Linear views its 3-D input and output
        return self.out(torch.relu_(self.fc(x)))


def test_a_view_of_a_storage_a_later_op_overwrites_reads_nothing_stale():
    # The view after addmm aliases its output: it reads no values, so it links to nothing (it
    # had forced the {addmm, view, relu_} group to be recomputed, 0.55 -> 0.96 ms on an MLP).
    st = _ops(Wrap(ViewThenInplace()), torch.randn(2, 4, 8), fqn="Wrap.inner")
    assert all(not o.reads_before_mutation for o in st.ops if o.is_view)
    relu = next(i for i, o in enumerate(st.ops) if o.func == "aten.relu_.default")
    group = next(u for u in greedy_units(st.ops) if relu in u.ops)
    assert st.ops[group.ops[0]].func == "aten.addmm.default"


class GatedBlock(nn.Module):
    """A Llama MLP's shape: its last matmul saves only its input, and its output goes on to the
    residual add, which the next block saves."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(x)))


def test_the_recompute_is_priced_up_to_where_torch_stops_it():
    """``last_saved`` is where torch's recompute stops: after the last op whose output the module
    itself saves. The down projection saves its input before its kernel runs, so it is not
    re-run, nor the add whose output only the next block saves (both were priced before)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from estimators.tracing.sac import last_saved, replay_ms

    model = nn.Sequential(GatedBlock(), GatedBlock())
    x = torch.randn(4, 8, requires_grad=True)
    ops = _ops(model, x, fqn="Sequential.0").ops
    add = ops[-1]
    assert add.func == "aten.add.Tensor" and add.is_saved and not add.saved_inside

    class Rerun(TorchDispatchMode):  # the backward runs with grad off; a recompute with it on
        def __init__(self):
            super().__init__()
            self.funcs: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.is_grad_enabled():
                self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    loss = model[1](checkpoint(model[0], x, use_reentrant=False)).sum()
    seed = torch.ones_like(loss)
    with Rerun() as rerun:
        loss.backward(seed)
    stop = last_saved(ops)
    assert rerun.funcs[: stop + 1] == [o.func for o in ops[: stop + 1]]
    assert all(o.is_view for o in ops[stop + 1 : len(rerun.funcs)])  # the down weight's view, then the stop
    assert [o.func for o in ops[stop + 1:] if not o.is_view] == ["aten.mm.default", "aten.add.Tensor"]
    assert replay_ms(ops, lambda i, o: True) < sum(o.runtime_ms for o in ops)  # their kernels not priced
    legacy = tuple(dataclasses.replace(o, saved_inside=None) for o in ops)  # not recorded: is_saved
    assert last_saved(legacy) == len(ops) - 1
