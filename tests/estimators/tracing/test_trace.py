"""estimators/tracing/trace.py: module order and attribution in forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimators.tracing.estimation import EstimateOptions, TraceMode, estimate
from estimators.step.train_step import TrainStep

REAL = EstimateOptions(mode=TraceMode.REAL)


class Chain(nn.Module):
    def __init__(self, shared_twice: bool = False, tied: bool = False):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 50, bias=False)
        self.shared_twice = shared_twice
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)  # idx does not require grad
        x = self.a(x)
        if self.shared_twice:
            x = self.a(x)
        return self.head(self.b(x))


def _info(model, mode=REAL):
    idx = torch.randint(0, 50, (3, 5))
    return estimate(model, TrainStep(inputs=(idx,)), options=mode).module_info


def test_orders_of_a_chain():
    info = _info(Chain())
    o = info.mod_order
    assert o.fw_pre_order == (
        "Chain", "Chain.emb", "Chain.a", "Chain.a.0", "Chain.a.1", "Chain.a.2",
        "Chain.b", "Chain.b.0", "Chain.b.1", "Chain.head",
    )
    assert o.fw_post_order == (
        "Chain.emb", "Chain.a.0", "Chain.a.1", "Chain.a.2", "Chain.a",
        "Chain.b.0", "Chain.b.1", "Chain.b", "Chain.head", "Chain",
    )
    assert o.bw_pre_order == (
        "Chain", "Chain.head", "Chain.b", "Chain.b.1", "Chain.b.0",
        "Chain.a", "Chain.a.2", "Chain.a.1", "Chain.a.0", "Chain.emb",
    )
    assert o.bw_post_order[-1] == "Chain"
    assert o.bw_post_order.index("Chain.b") < o.bw_post_order.index("Chain.a")


def test_module_with_non_grad_inputs_gets_its_backward():
    # ModTracker misses the post-backward of modules whose inputs do not require grad.
    info = _info(Chain())
    emb = info.stats("Chain.emb")
    assert 0 <= emb.bw_pre_op <= emb.bw_post_op
    assert emb.bw_runtime_ms > 0
    assert "Chain.emb" in info.mod_order.bw_post_order


def test_module_called_twice_sums_its_calls():
    once = _info(Chain()).stats("Chain.a")
    twice = _info(Chain(shared_twice=True)).stats("Chain.a")
    assert once.n_calls == 1 and twice.n_calls == 2
    act = 3 * 5 * 8 * 4  # one (3, 5, 8) float activation
    # A call saves its input (first addmm) and its tanh output (tanh and the second addmm); its
    # output is saved by the next module, so only the tanh output can be discarded.
    assert (once.act_fw_bytes, once.sac_memory_bytes) == (2 * act, act)
    assert (twice.act_fw_bytes, twice.sac_memory_bytes) == (4 * act, 2 * act)
    assert twice.fw_runtime_ms > once.fw_runtime_ms
    assert twice.bw_pre_op < twice.bw_post_op


def test_shared_parameters_counted_once():
    plain = _info(Chain()).stats("Chain")
    tied = _info(Chain(tied=True)).stats("Chain")
    emb_bytes = 50 * 8 * 4
    assert plain.param_bytes - tied.param_bytes == emb_bytes
    assert tied.param_bytes == sum(p.numel() * 4 for p in Chain(tied=True).parameters())


def test_backward_ops_attributed_to_modules_in_fake_mode_too():
    fake = _info(Chain(), EstimateOptions(mode=TraceMode.FAKE))
    real = _info(Chain())
    assert fake.mod_order == real.mod_order
    for a, b in zip(fake.mod_stats, real.mod_stats):
        assert (a.bw_pre_op, a.bw_post_op) == (b.bw_pre_op, b.bw_post_op), a.fqn


def test_held_tensors_opens_what_pytree_does_not():
    # HF's DynamicCache keeps the K/V cache in cache.layers[i].keys / .values, an object pytree
    # leaves closed: a loop holding the output holds those tensors too.
    from estimators.tracing.trace import held_tensors

    class Layer:
        def __init__(self):
            self.keys, self.values, self.is_initialized = torch.ones(2), torch.ones(3), True

    class Cache:
        def __init__(self):
            self.layers = [Layer(), Layer()]
            self.model = nn.Linear(2, 2)  # a module is not opened: its parameters are not the output's

    logits = torch.zeros(4)
    out = {"logits": logits, "past_key_values": Cache(), "again": logits}
    found = held_tensors(out)
    assert sorted(t.numel() for t in found) == [2, 2, 3, 3, 4]
    assert held_tensors(None) == []


class _UnusedBranch(nn.Module):
    """Returns a second output the loss never reads: tanh saves its own output for backward."""

    def __init__(self):
        super().__init__()
        self.a, self.pool = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x)
        return h, torch.tanh(self.pool(h))


def _real_frees(model, x, loss_fn):
    """Which outputs of a real forward are still alive once the loss is computed and the output
    dropped (as run_step drops it), by position."""
    import weakref

    alive = {}
    out = model(x)
    for i, t in enumerate(out):
        weakref.finalize(t.untyped_storage(), alive.pop, i, None)
        alive[i] = True
    loss = loss_fn(out, None)
    del out, t
    return set(alive), loss


@pytest.mark.slow
def test_the_trace_frees_an_unread_output_when_the_real_run_does():
    # The pack hook returned the tensor itself: for an op that saves its own output (tanh) that
    # is output -> grad_fn -> saved output, a cycle only the garbage collector frees, so the
    # trace kept the unread tanh output and its graph (h and the pool's input) to the step's
    # end: 173,840 B predicted (49,672 B over; AdamW state of the unused pool included) against
    # 124,168 B measured.
    from estimators.step.train_step import TrainStep
    from planner.analysis.measure import measure_steps

    torch.manual_seed(0)
    model, x = _UnusedBranch(), torch.randn(32, 64)
    loss_fn = lambda out, inputs: out[0].sum()  # noqa: E731
    still_alive, _ = _real_frees(model, x, loss_fn)
    assert still_alive == set()  # the real run freed both outputs once the loss was computed
    for mode in (REAL, EstimateOptions()):
        trace = estimate(model, TrainStep(inputs=(x,), loss_fn=loss_fn), options=mode).trace
        tanh = next(op for op in trace.ops if "tanh" in str(op.func))
        rec = trace.storages[tanh.new_sids[0]]
        loss_op = next(op.index for op in trace.ops if op.phase.name == "BW")
        assert rec.free_op is not None and rec.free_op < loss_op, mode
    step = TrainStep(inputs=(x,), loss_fn=loss_fn, optimizer="adamw")
    measured = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=2)[1].peak_bytes
    assert estimate(model, step).module_info.peak_bytes == measured == 124_168


def test_pack_hook_aliases_are_not_ops_of_the_step():
    torch.manual_seed(0)
    trace = estimate(_UnusedBranch(), TrainStep(inputs=(torch.randn(4, 64),), loss_fn=lambda o, i: o[1].sum()), options=REAL).trace
    assert not any(str(op.func) == "aten.detach.default" and op.phase.name == "FW" for op in trace.ops)


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """An independent view of a real run: the storages each op makes, alive or not (weakly)."""

    def __init__(self):
        super().__init__()
        self.made, self.alive, self.ops = [], set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        from estimators.runtime.op_facts import op_facts

        out = func(*args, **(kwargs or {}))
        if op_facts(func).is_query or func is torch.ops.aten.detach.default:
            return out  # autograd's own alias of a saved output (the trace's pack hook makes it)
        seen = {id(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in seen:
                key = (self.ops, len(self.made))
                self.made.append(key)
                self.alive.add(key)
                weakref.finalize(t.untyped_storage(), self.alive.discard, key)
        self.ops += 1
        return out


def test_the_trace_frees_the_storages_the_real_run_frees():
    # The forward storages still alive when backward starts: recorded by the trace (real mode,
    # same ops) and by a plain dispatch recorder on an untraced run of the same step. With the
    # pack hook's cycle the trace kept the unread tanh output and the pool's input.
    from estimators.step.train_step import run_step

    torch.manual_seed(0)
    model, x = _UnusedBranch(), torch.randn(8, 64)
    loss_fn = lambda out, inputs: out[0].sum()  # noqa: E731
    rec = _Recorder()
    phases = []
    with rec:
        run_step(model, (x,), loss_fn, None, on_phase=lambda p: phases.append((p, rec.ops, set(rec.alive))))
    bw_start, alive_real = next((ops, alive) for p, ops, alive in phases if p.name == "BW")
    trace = estimate(model, TrainStep(inputs=(x,), loss_fn=loss_fn), options=REAL).trace
    made = [(op.index, i) for op in trace.ops for i, _ in enumerate(op.new_sids)]
    bw_op = next(op.index for op in trace.ops if op.phase.name == "BW")
    assert bw_op == bw_start
    alive_trace = {
        (op.index, i) for op in trace.ops if op.index < bw_op for i, sid in enumerate(op.new_sids)
        if trace.storages[sid].free_op is None or trace.storages[sid].free_op >= bw_op
    }
    # The recorder numbers storages across the step; map them to (op, position in that op).
    by_op: dict[int, list[int]] = {}
    for o, n in rec.made:
        by_op.setdefault(o, []).append(n)
    real = {(o, by_op[o].index(n)) for o, n in alive_real}
    assert made and alive_trace == real


@pytest.mark.slow
def test_a_loss_closing_over_the_batch_it_is_given_counts_it_once():
    # An autoencoder's target is its input: `lambda out, batch: F.l1_loss(out, x)` with
    # inputs=(x,). The fake trace counted the real x read by the loss as a second tensor:
    # +262,144 B (1024 x 64 float32) over the real trace and the measured step.
    import torch.nn.functional as F

    from estimators.step.train_step import TrainStep
    from planner.analysis.measure import measure_steps

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))
    x = torch.randn(1024, 64)
    peaks = {}
    for name, loss in [("given", lambda out, batch: F.l1_loss(out, batch[0])),
                       ("closed over", lambda out, batch: F.l1_loss(out, x)),
                       ("a view closed over", lambda out, batch: F.l1_loss(out, x[:, :]))]:
        step = TrainStep(inputs=(x,), loss_fn=loss, optimizer="sgd")
        fake = estimate(model, step=step).module_info.peak_bytes
        real = estimate(model, step=step, options=EstimateOptions(mode=TraceMode.REAL)).module_info.peak_bytes
        peaks[name] = (fake, real)
    measured = measure_steps(model, TrainStep(inputs=(x,), loss_fn=lambda out, batch: F.l1_loss(out, x),
                                              optimizer="sgd"), n_steps=2)[1].peak_bytes
    assert {v for pair in peaks.values() for v in pair} == {measured}, peaks


def test_peeking_the_autograd_sequence_number_calls_no_torch_function_mode():
    """Each module call peeks the number autograd's next Node gets (ModuleCall.seq_start/seq_end):
    the number is that Node's, grad mode is left as it was, and the step's torch-function modes
    (CudaSemanticsMode) see none of the probe's calls."""
    from torch.overrides import TorchFunctionMode

    from estimators.runtime.roofline import RooflineRuntime
    from estimators.runtime.device import get_device_spec
    from estimators.tracing.trace import StepTracer

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    tracer = StepTracer(nn.Linear(2, 2), "Linear", RooflineRuntime(get_device_spec("h100")))
    x = torch.ones(2, requires_grad=True)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), Counting():
            peeked = tracer._peek_seq()
            assert Counting.calls == 0 and torch.is_grad_enabled() == grad
        with torch.enable_grad():
            assert (x * 2).grad_fn._sequence_nr() == peeked
