"""estimators/tracing/aggregate.py: the ModuleInfo built from one traced step of a three-module net,
against bytes, orders and memory points worked out by hand (CPU target, fake mode, no optimizer).

    Net: a = Linear(4, 8) (32 + 8 floats = 160 B), act = ReLU, b = Linear(8, 2, no bias) (64 B)
    x: [3, 4] float32 = 48 B; a's output and act's output [3, 8] = 96 B; b's output [3, 2] = 24 B
    loss = output.sum(): 4 B
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimators.tracing.estimation import estimate
from estimators.contract.module_info import ModOrder
from estimators.step.train_step import TrainStep


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.b = nn.Linear(8, 2, bias=False)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


@pytest.fixture(scope="module")
def est():
    torch.manual_seed(0)
    return estimate(Net(), TrainStep(inputs=(torch.randn(3, 4),)), device="cpu")


def test_module_order_forward_and_backward(est):
    # A parent's backward starts with its first child's (b: the last to run forward) and ends last.
    assert est.module_info.mod_order == ModOrder(
        fw_pre_order=("Net", "Net.a", "Net.act", "Net.b"),
        fw_post_order=("Net.a", "Net.act", "Net.b", "Net"),
        bw_pre_order=("Net", "Net.b", "Net.act", "Net.a"),
        bw_post_order=("Net.b", "Net.act", "Net.a", "Net"),
    )


def test_bytes_per_module(est):
    info = est.module_info
    got = {s.fqn: (s.is_leaf, s.n_calls, s.param_bytes, s.grad_bytes, s.input_bytes, s.output_bytes,
                   s.act_fw_bytes) for s in info.mod_stats}
    assert got == {
        # act_fw_bytes: what autograd saved while the module ran, parameters excluded: a saves x
        # (48, for its weight gradient), act its output (96, for threshold_backward), b its input
        # (act's output, 96); the root holds both storages once: 48 + 96.
        "Net": (False, 1, 224, 224, 48, 24, 144),
        "Net.a": (True, 1, 160, 160, 48, 96, 48),
        "Net.act": (True, 1, 0, 0, 96, 96, 96),
        "Net.b": (True, 1, 64, 64, 96, 24, 96),
    }


def test_the_root_sac_table_and_trade_off(est):
    s = est.module_info.stats("Net")
    assert [(o.func, o.memory_bytes, o.is_saved, o.is_view) for o in s.ops] == [
        ("aten.t.default", 0, False, True),
        ("aten.addmm.default", 0, False, False),   # a's output: only relu reads it, nobody saves it
        ("aten.relu.default", 96, True, False),    # the one activation a checkpoint can drop
        ("aten.t.default", 0, False, True),
        ("aten.mm.default", 0, False, False),      # the output: saved by no one
    ]
    addmm, relu = s.ops[1], s.ops[2]
    assert s.sac_memory_bytes == s.tradeoff.total_bytes == 96
    assert s.sac_runtime_ms == relu.runtime_ms
    # Any checkpoint re-runs addmm (unsaved, before the last saved op); mm comes after it: no.
    assert s.recompute_fixed_ms == addmm.runtime_ms
    # Recompute growth: addmm's 96 B alone, then addmm's and relu's outputs both alive.
    assert s.recompute_growth_bytes == (96, 192)
    assert s.forced_discard_bytes == 0 and s.checkpoint_retain_bytes == 0 and s.sac_blocker == ""
    assert all(est.module_info.stats(f).ops == () for f in ("Net.a", "Net.act", "Net.b"))


def test_op_spans_and_runtimes_follow_the_trace(est):
    info, ops = est.module_info, est.trace.ops
    spans = {s.fqn: (s.fw_pre_op, s.fw_post_op, s.bw_pre_op, s.bw_post_op) for s in info.mod_stats}
    # Forward: t addmm | relu | t mm | sum (loss, outside). Backward from op 6; b's at 8..16,
    # act's threshold_backward at 17..18, a's weight and bias gradients at 19..26.
    assert spans == {"Net": (0, 5, 8, 26), "Net.a": (0, 2, 19, 26), "Net.act": (2, 3, 17, 18),
                     "Net.b": (3, 5, 8, 16)}
    assert info.stats("Net").fw_runtime_ms == sum(op.runtime_ms for op in ops[0:5])
    assert info.fw_runtime_ms == sum(op.runtime_ms for op in ops if op.phase.name == "FW")
    assert info.bw_runtime_ms == sum(op.runtime_ms for op in ops if op.phase.name == "BW")
    assert info.optimizer_runtime_ms == 0.0


def test_peak_and_memory_points(est):
    info = est.module_info
    # Peak at threshold_backward: params 224 + x 48 + loss 4 + its grad 4 + act's output 96
    # + b's weight grad 64 + act's input grad 96 + threshold_backward's output 96.
    assert (info.peak_bytes, info.peak_op_index) == (632, 18)
    assert info.peak_op == "aten.threshold_backward.default in Net.act (bw)"
    # One point per interval in which the discarded set is constant (Net's forward end at 5 and
    # backward start at 8 cut the step), at its highest op, plus Net's recompute point at 8.
    pts = [(p.op_index, p.phase, p.fqn, p.recompute_of) for p in info.memory_points]
    assert pts == [(2, "fw", "Net.act", None), (5, "fw", "", None), (8, "bw", "Net.b", "Net"),
                   (18, "bw", "Net.act", None)]
    # relu (op 2): 272 B of params and x, a's and act's outputs; op 5: b's output and the loss.
    totals = [p.param_bytes + p.grad_bytes + p.optimizer_bytes + p.activation_bytes + p.other_bytes
              for p in info.memory_points]
    assert totals == [224 + 48 + 96 + 96, 224 + 48 + 96 + 24 + 4, 224 + 48 + 96 + 4 + 4, 632]
    first = info.memory_points[0]
    assert (first.param_bytes, first.grad_bytes, first.activation_bytes) == (224, 0, 96)


class Twice(nn.Module):
    """One non-leaf block called twice per step."""

    def __init__(self):
        super().__init__()
        self.blk = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        return self.blk(self.blk(x.view(3, 4)))


def test_recompute_is_priced_with_the_checkpoints_host_costs():
    """A spec's checkpoint host costs, over a block's two calls: every re-run op (views too)
    costs recompute_op_ms more, each call checkpoint_call_ms, and a selective policy
    selective_op_ms for each op it sees (forward ops and ops replayed up to the last saved one)
    and selective_call_ms a call, which a full checkpoint does not pay."""
    from estimators.runtime.device import get_device_spec
    from estimators.tracing.sac import fixed_recompute_ms, last_saved, replay_ms

    step = TrainStep(inputs=(torch.randn(3, 4),))
    spec = get_device_spec("cpu").replace(checkpoint_call_ms=1.0, recompute_op_ms=0.5, selective_op_ms=0.25,
                                          selective_call_ms=0.75)
    base = estimate(Twice(), step, device="cpu").module_info.stats("Twice.blk")
    s = estimate(Twice(), step, device=spec).module_info.stats("Twice.blk")
    assert s.n_calls == 2 and any(o.is_view for o in s.ops)
    assert [o.runtime_ms for o in s.ops] == pytest.approx([o.runtime_ms + 2 * 0.5 for o in base.ops])
    assert s.checkpoint_call_ms == 2 * 1.0
    assert s.selective_policy_ms == pytest.approx(2 * (0.25 * (len(s.ops) + last_saved(s.ops) + 1) + 0.75))
    assert s.recompute_fixed_ms == pytest.approx(fixed_recompute_ms(s.ops) + 2.0 + s.selective_policy_ms)
    assert s.full_recompute_ms == pytest.approx(replay_ms(s.ops, lambda i, o: True) + 2.0)
    assert (base.checkpoint_call_ms, base.selective_policy_ms) == (0.0, 0.0)
    assert base.full_recompute_ms == pytest.approx(replay_ms(base.ops, lambda i, o: True))


class _Streaming(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Identity()  # not a leaf: its ops make a table

    def forward(self, x):  # x: (128, 128) fp32, 64 KiB
        y = x * 2  # reads x, writes y: 128 KiB
        z = y.view(-1)  # a view: moves nothing
        w = z.sin()  # 128 KiB
        return self.out(w.sum())


class Streams(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = _Streaming()

    def forward(self, x):
        return self.blk(x)


def test_a_rerun_ops_host_cost_is_warm_after_an_op_that_streams_little():
    """recompute_op_ms (cold, 1 ms here) after an op that read and wrote host_cache_bytes or
    more (or first in the module), recompute_op_warm_ms (0) after a view, and in proportion to
    the bytes in between: mul first (1.0), the view after mul's 128 KiB of 256 (0.5), sin
    after the view (0), sum after sin's 128 KiB (0.5). Without a warm cost, all at 1 ms."""
    from estimators.runtime.device import get_device_spec

    step = TrainStep(inputs=(torch.randn(128, 128, requires_grad=True),))
    plain = get_device_spec("cpu")
    base = estimate(Streams(), step, device=plain).module_info.stats("Streams.blk")
    cold = plain.replace(recompute_op_ms=1.0)
    spec = cold.replace(recompute_op_warm_ms=0.0, host_cache_bytes=256 * 1024)
    s = estimate(Streams(), step, device=spec).module_info.stats("Streams.blk")
    assert [o.func for o in s.ops] == ["aten.mul.Tensor", "aten.view.default", "aten.sin.default", "aten.sum.default"]
    assert [a.runtime_ms - o.runtime_ms for o, a in zip(base.ops, s.ops)] == pytest.approx([1.0, 0.5, 0.0, 0.5])
    c = estimate(Streams(), step, device=cold).module_info.stats("Streams.blk")
    assert [a.runtime_ms - o.runtime_ms for o, a in zip(base.ops, c.ops)] == pytest.approx([1.0] * 4)


class Nested(nn.Module):
    """A block with four modules nested in it, two levels deep, called once."""

    def __init__(self):
        super().__init__()
        self.blk = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 4)))

    def forward(self, x):
        return self.blk(x)


@pytest.mark.parametrize("model, fqn, calls, nested", [(Twice, "Twice.blk", 2, 2), (Nested, "Nested.blk", 1, 4)])
def test_each_call_is_priced_per_module_nested_in_it(model, fqn, calls, nested):
    """checkpoint_submodule_ms is paid per call and per module that ran nested in the checkpointed
    one, at any depth, each once (Twice.blk: Linear and Tanh, run twice a call; Nested.blk: two
    Linears, a Tanh and the inner Sequential): checkpoint_call_ms, the fixed recompute and the
    full recompute each rise by calls * nested * that cost, and nothing else moves."""
    from estimators.runtime.device import get_device_spec

    step = TrainStep(inputs=(torch.randn(3, 4),))
    plain = get_device_spec("cpu").replace(checkpoint_call_ms=1.0)
    base = estimate(model(), step, device=plain).module_info.stats(fqn)
    s = estimate(model(), step, device=plain.replace(checkpoint_submodule_ms=0.125)).module_info.stats(fqn)
    extra = calls * nested * 0.125
    assert base.checkpoint_call_ms == calls * 1.0
    assert s.checkpoint_call_ms == pytest.approx(base.checkpoint_call_ms + extra)
    assert s.recompute_fixed_ms == pytest.approx(base.recompute_fixed_ms + extra)
    assert s.full_recompute_ms == pytest.approx(base.full_recompute_ms + extra)
    assert [o.runtime_ms for o in s.ops] == [o.runtime_ms for o in base.ops]
    # What the solver prices a checkpoint of it at, whatever it discards.
    from solver.plan_cost import module_recompute_ms

    for discarded in (0, s.sac_memory_bytes // 2, s.sac_memory_bytes):
        assert module_recompute_ms(s, discarded) == pytest.approx(module_recompute_ms(base, discarded) + extra)
