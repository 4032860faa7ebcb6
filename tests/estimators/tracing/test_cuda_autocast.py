"""estimators/tracing/cuda_autocast.py: one traced op per policy class. Under an h100 target the traced
output has the dtype and bytes CUDA autocast gives it (torch's lists: autocast_policy.cuda_policy);
under a cpu target what CPU autocast gives it, measured here on real tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from estimators.tracing.autocast_policy import CastPolicy, cuda_policy
from estimators.runtime.device import get_device_spec
from estimators.tracing.estimation import EstimateOptions, TraceError, estimate
from estimators.step.train_step import TrainStep

LOW = (torch.bfloat16, torch.float16)
_TO_COPY = torch.ops.aten._to_copy.default


class _Seen:
    """What the traced copy's forward produced (shared by the fake copy: deepcopy returns it)."""

    def __init__(self):
        self.dtypes = []

    def __deepcopy__(self, memo):
        return self


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class Probe(nn.Module):
    """``op`` (``fn``) on the step's inputs, each floating one scaled by a 0-d parameter (dtype
    kept) so the step has something to train."""

    def __init__(self, fn):
        super().__init__()
        self.op = Fn(fn)
        self.w = nn.Parameter(torch.ones(()))
        self.seen = _Seen()

    def forward(self, *xs):
        out = self.op(*[x * self.w if x.is_floating_point() else x for x in xs])
        self.seen.dtypes.append(out.dtype)
        return out.float().sum()


def _traced(fn, inputs, low, device):
    """(output dtype, bytes of the output's storage, casts) of ``fn`` in the traced step."""
    model = Probe(fn)
    est = estimate(model, step=TrainStep(inputs=inputs, autocast_dtype=low), device=device)
    call = next(c for c in est.trace.calls if c.fqn == "Probe.op")
    casts = [op for op in est.trace.ops if op.call == call.cid and op.phase.name == "FW" and op.func is _TO_COPY]
    nbytes = sum(est.trace.storages[s].nbytes for s in set(call.output_sids))
    return model.seen.dtypes[-1], nbytes, len(casts)


def _cpu_autocast(fn, inputs, low):
    """What CPU autocast makes of ``fn`` on real tensors: (dtype, bytes)."""
    with torch.autocast("cpu", dtype=low):
        out = fn(*inputs)
    return out.dtype, out.numel() * out.element_size()


def _round(n):
    return get_device_spec("h100").round_bytes(n)


def _x(low, *shape):
    return torch.randn(*shape).to(low)


FP32_CASES = {  # CUDA's float32 list: every low-precision floating argument cast to float32
    "exp": (lambda x: torch.exp(x), lambda low: (_x(low, 16, 64),), "aten::exp"),
    "pow": (lambda x: torch.pow(x, 3.0), lambda low: (_x(low, 16, 64),), "aten::pow.Tensor_Scalar"),
    "rsqrt": (lambda x: torch.rsqrt(x.abs() + 1), lambda low: (_x(low, 16, 64),), "aten::rsqrt"),
    "layer_norm": (lambda x: F.layer_norm(x, (64,)), lambda low: (_x(low, 16, 64),), "aten::layer_norm"),
    "group_norm": (lambda x: F.group_norm(x, 4), lambda low: (_x(low, 4, 8, 32),), "aten::group_norm"),
    "rms_norm": (lambda x: F.rms_norm(x, (64,)), lambda low: (_x(low, 16, 64),), "aten::rms_norm"),
    "softplus": (lambda x: F.softplus(x), lambda low: (_x(low, 16, 64),), "aten::softplus"),
    "mse_loss": (lambda x, y: F.mse_loss(x, y, reduction="none"), lambda low: (_x(low, 16, 64), _x(low, 16, 64)), "aten::mse_loss"),
}

PROMOTE_CASES = {  # CUDA's promote list: mixed arguments cast to the widest (float32)
    "addcmul": (lambda a, b, c: torch.addcmul(a, b, c), lambda low: (torch.randn(16, 64), _x(low, 16, 64), _x(low, 16, 64)), "aten::addcmul"),
    "atan2": (lambda a, b: torch.atan2(a, b), lambda low: (torch.randn(16, 64), _x(low, 16, 64)), "aten::atan2"),
    "dot": (lambda a, b: torch.dot(a, b), lambda low: (torch.randn(1024), _x(low, 1024)), "aten::dot"),
}


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(FP32_CASES))
def test_float32_list(name, low):
    fn, make, op = FP32_CASES[name]
    assert cuda_policy()[op] is CastPolicy.FP32
    inputs = make(low)
    ref = fn(*[x.float() for x in inputs])
    dtype, nbytes, casts = _traced(fn, inputs, low, "h100")
    assert (dtype, nbytes) == (torch.float32, _round(ref.numel() * 4))
    assert casts == len(inputs)  # each low-precision input copied to float32
    assert _traced(fn, inputs, low, "cpu")[:2] == _cpu_autocast(fn, inputs, low)


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(PROMOTE_CASES))
def test_promote_list(name, low):
    fn, make, op = PROMOTE_CASES[name]
    assert cuda_policy()[op] is CastPolicy.PROMOTE
    inputs = make(low)
    ref = fn(*[x.float() for x in inputs])
    dtype, nbytes, casts = _traced(fn, inputs, low, "h100")
    assert (dtype, nbytes) == (torch.float32, _round(ref.numel() * 4))
    assert casts == sum(x.dtype == low for x in inputs)
    cpu = _cpu_autocast_or_error(fn, inputs, low)
    if isinstance(cpu, Exception):  # the CPU kernel refuses mixed dtypes: so does the CPU trace
        with pytest.raises(TraceError):
            _traced(fn, inputs, low, "cpu")
    else:
        assert _traced(fn, inputs, low, "cpu")[:2] == cpu


def _cpu_autocast_or_error(fn, inputs, low):
    try:
        return _cpu_autocast(fn, inputs, low)
    except RuntimeError as e:
        return e


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
def test_softmax_sets_float32_dtype_and_fp16_runs_the_fused_kernel(low):
    assert cuda_policy()["aten::softmax.int"] is CastPolicy.FP32_SET_OPT_DTYPE
    fn = lambda x: F.softmax(x, -1)  # noqa: E731
    inputs = (_x(low, 16, 64),)
    dtype, nbytes, casts = _traced(fn, inputs, low, "h100")
    assert (dtype, nbytes) == (torch.float32, _round(16 * 64 * 4))
    # SoftMax.cpp: a half input runs _softmax(half_to_float=True); bfloat16 is copied first.
    assert casts == (0 if low is torch.float16 else 1)
    assert _traced(fn, inputs, low, "cpu")[:2] == _cpu_autocast(fn, inputs, low)


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
def test_norm_appends_float32_dtype(low):
    assert cuda_policy()["aten::norm.ScalarOpt_dim"] is CastPolicy.FP32_APPEND_DTYPE
    fn = lambda x: torch.norm(x, 2, dim=-1)  # noqa: E731
    inputs = (_x(low, 16, 64),)
    assert _traced(fn, inputs, low, "h100") == (torch.float32, _round(16 * 4), 0)
    assert _traced(fn, inputs, low, "cpu")[:2] == _cpu_autocast(fn, inputs, low)


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
def test_lower_precision_only_on_cuda(low):
    """einsum and mv are on CUDA's lower-precision list only."""
    for op, fn, inputs in (("aten::einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), (torch.randn(16, 64), torch.randn(64, 32))),
                           ("aten::mv", lambda a, b: torch.mv(a, b), (torch.randn(64, 32), torch.randn(32)))):
        assert cuda_policy()[op] is CastPolicy.LOWER
        ref = fn(*inputs)
        assert _traced(fn, inputs, low, "h100") == (low, _round(ref.numel() * 2), 2)
        assert _traced(fn, inputs, low, "cpu")[:2] == _cpu_autocast_or_error(fn, inputs, low)


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
def test_cat_is_left_alone_on_cuda(low):
    """cat is on the CPU's promote list only: on CUDA its kernel promotes, nothing is copied."""
    assert "aten::cat" not in cuda_policy()
    fn = lambda a, b: torch.cat([a, b])  # noqa: E731
    inputs = (torch.randn(16, 64), _x(low, 16, 64))
    assert _traced(fn, inputs, low, "h100") == (torch.float32, _round(32 * 64 * 4), 0)
    assert _traced(fn, inputs, low, "cpu")[:2] == _cpu_autocast(fn, inputs, low)
    assert _traced(fn, inputs, low, "cpu")[2] == 1  # CPU autocast copies the low-precision one


@pytest.mark.slow
def test_binary_cross_entropy_is_refused_for_cuda():
    fn = lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), y)  # noqa: E731
    inputs = (torch.randn(16), torch.rand(16))
    with pytest.raises(TraceError, match="binary_cross_entropy_with_logits"):
        _traced(fn, inputs, torch.bfloat16, "h100")
    assert _traced(fn, inputs, torch.bfloat16, "cpu")[0] == _cpu_autocast(fn, inputs, torch.bfloat16)[0]


def test_cpu_autocast_regions_turned_off_by_the_model_stay_off():
    def fn(x):
        with torch.autocast("cpu", enabled=False):
            return torch.exp(x)
    inputs = (_x(torch.bfloat16, 16, 64),)
    assert _traced(fn, inputs, torch.bfloat16, "h100")[:1] == (torch.bfloat16,)


def test_a_real_trace_keeps_cpu_autocast():
    from estimators.tracing.estimation import TraceMode

    with pytest.raises(ValueError, match="needs mode=TraceMode.FAKE"):
        EstimateOptions(mode=TraceMode.REAL, cuda_autocast=True)
    model = Probe(torch.exp)
    step = TrainStep(inputs=(_x(torch.bfloat16, 16, 64),), autocast_dtype=torch.bfloat16)
    estimate(model, step=step, device="h100", options=EstimateOptions(mode=TraceMode.REAL))
    assert model.seen.dtypes == [torch.bfloat16]  # CPU autocast lets exp follow its input


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW, ids=str)
def test_cross_entropy_decomposes_and_its_parts_meet_the_policy(low):
    """cross_entropy_loss is on the CPU's float32 list only. CUDA decomposes it: log_softmax keeps
    the logits' dtype (cross_entropy passes it), nll_loss (float32 list) copies that to float32."""
    target = torch.randint(0, 100, (32,))
    fn = lambda x: F.cross_entropy(x, target, reduction="none")  # noqa: E731
    inputs = (_x(low, 32, 100),)

    def log_softmax_bytes(device):
        est = estimate(Probe(fn), step=TrainStep(inputs=inputs, autocast_dtype=low), device=device)
        op = next(op for op in est.trace.ops if str(op.func) == "aten._log_softmax.default")
        return sum(est.trace.storages[s].nbytes for s in op.new_sids)

    assert _traced(fn, inputs, low, "h100") == (torch.float32, _round(32 * 4), 1)
    assert log_softmax_bytes("h100") == _round(32 * 100 * 2)
    assert _traced(fn, inputs, low, "cpu")[:2] == _cpu_autocast(fn, inputs, low)
    assert log_softmax_bytes("cpu") == 32 * 100 * 4  # the CPU's float32 op copies the logits first


def test_lower_precision_ops_left_to_the_cpu_kernel_cast_down_there():
    """CUDA's lower-precision ops that have a CPU autocast kernel are not taken over: the CPU's must
    cast them down too (and its weight cache then holds them as CUDA's does)."""
    from estimators.tracing.cuda_autocast import taken_over

    both = {n for n, p in cuda_policy().items() if p is CastPolicy.LOWER} - set(taken_over())
    assert {"aten::linear", "aten::matmul", "aten::mm", "aten::bmm", "aten::scaled_dot_product_attention"} <= both
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    calls = {
        "aten::linear": lambda: F.linear(x, w), "aten::matmul": lambda: x @ w.t(), "aten::mm": lambda: torch.mm(x, w.t()),
        "aten::addmm": lambda: torch.addmm(torch.randn(16), x, w.t()),
        "aten::bmm": lambda: torch.bmm(x[None], w.t()[None]),
        "aten::baddbmm": lambda: torch.baddbmm(torch.randn(1, 4, 16), x[None], w.t()[None]),
        "aten::addbmm": lambda: torch.addbmm(torch.randn(4, 16), x[None], w.t()[None]),
        "aten::linalg_vecdot": lambda: torch.linalg.vecdot(x, x),
        "aten::scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(x[None], x[None], x[None]),
        "aten::prelu": lambda: F.prelu(x, torch.ones(1)),
        "aten::conv1d": lambda: F.conv1d(x[None], torch.randn(2, 4, 3)),
        "aten::conv2d": lambda: F.conv2d(x[None, None], torch.randn(2, 1, 3, 3)),
        "aten::conv3d": lambda: F.conv3d(x[None, None, None], torch.randn(2, 1, 1, 3, 3)),
        "aten::conv_transpose1d": lambda: F.conv_transpose1d(x[None], torch.randn(4, 2, 3)),
        "aten::conv_transpose2d.input": lambda: F.conv_transpose2d(x[None, None], torch.randn(1, 2, 3, 3)),
        "aten::conv_transpose3d.input": lambda: F.conv_transpose3d(x[None, None, None], torch.randn(1, 2, 1, 3, 3)),
        "aten::conv_tbc": lambda: torch.conv_tbc(x[:, None], torch.randn(3, 8, 2), torch.randn(2)),
        "aten::_convolution.deprecated": lambda: torch._convolution(x[None, None], torch.randn(2, 1, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True),
    }
    assert set(calls) == both
    for low in LOW:
        for name, call in calls.items():
            with torch.autocast("cpu", dtype=low):
                assert call().dtype == low, name


# ----------------------------------------------------------------------------- weight-cast cache


class _Twice(nn.Module):
    """A parameter fed twice to einsum (lower precision on CUDA's list only) and once to mv; a
    Linear called twice (lower precision on both lists)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64))
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        a = torch.einsum("bd,ed->be", x, self.w) + torch.einsum("bd,ed->be", x, self.w)
        return a.sum() + torch.mv(self.w, x[0]).sum() + self.lin(x).sum() + self.lin(x).sum()


def _param_casts(est) -> dict[int, list]:
    """Forward casts of each parameter (by the bytes of its storage)."""
    tr = est.trace
    params = {s.sid: s.nbytes for s in tr.storages if s.kind.name == "PARAM"}
    casts: dict[int, list] = {}
    for op in tr.ops:
        if op.phase.name == "FW" and op.func is _TO_COPY and op.arg_sids and op.arg_sids[0] in params:
            casts.setdefault(params[op.arg_sids[0]], []).append(op)
    return casts


@pytest.mark.slow
def test_cuda_keeps_one_copy_of_a_parameter_per_autocast_region():
    x = torch.randn(8, 64)
    step = TrainStep(inputs=(x,), autocast_dtype=torch.bfloat16)
    h100 = _param_casts(estimate(_Twice(), step, device="h100"))
    # w: einsum casts it once (cached_cast), the second einsum and mv find the copy; lin.weight and
    # lin.bias: once each (the CPU kernel's cache, the same code as CUDA's).
    assert sorted(len(v) for v in h100.values()) == [1, 1, 1]
    cpu = _param_casts(estimate(_Twice(), step, device="cpu"))
    # CPU autocast leaves einsum to its inner bmm, which casts a view of w (not cached) each time.
    assert sorted(len(v) for v in cpu.values()) == [1, 1, 2]


class _NoGradUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64))
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        with torch.no_grad():  # autograd keeps nothing: only the cache holds w's copy
            a = torch.einsum("bd,ed->be", x, self.w)
        return self.lin(x).sum() + a.sum()


def test_the_cached_copy_lives_until_the_forward_s_autocast_region_ends():
    est = estimate(_NoGradUse(), TrainStep(inputs=(torch.randn(8, 64),), autocast_dtype=torch.bfloat16), device="h100")
    tr = est.trace
    (cast,) = _param_casts(est)[32 * 64 * 4]  # w's
    copy = tr.storages[cast.new_sids[0]]
    last_fw = max(op.index for op in tr.ops if op.phase.name == "FW")
    assert copy.free_op == last_fw  # not freed after einsum: held to the end of the region


def test_a_composite_left_alone_outside_autocast_runs_as_called():
    """cross_entropy_loss decomposes with CUDA's policy for its parts only under autocast: a
    bfloat16 model trained without autocast keeps nll_loss in bfloat16 (no float32 copy of the
    log-probabilities), as the trace without the CUDA policy does."""
    target = torch.randint(0, 100, (32,))
    model = Probe(lambda x: F.cross_entropy(x, target, reduction="none"))
    step = TrainStep(inputs=(_x(torch.bfloat16, 32, 100),))

    def fw_ops(cuda_autocast):
        est = estimate(model, step=step, device="h100", options=EstimateOptions(cuda_autocast=cuda_autocast))
        return [(str(op.func), [est.trace.storages[s].nbytes for s in op.new_sids])
                for op in est.trace.ops if op.phase.name == "FW"]

    ops = fw_ops(None)
    assert [f for f, _ in ops].count("aten._to_copy.default") == 1  # Probe's out.float() only
    assert ops == fw_ops(False)


def test_a_float32_convolution_with_same_padding_is_not_cast_without_autocast():
    """conv2d.padding (padding="same") is a composite only the CPU's lists hold; outside autocast
    its convolution (CUDA's lower-precision list) ran the policy and the float32 model's step was
    traced in bfloat16 (three casts, a smaller peak)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding="same"))
    step = TrainStep(inputs=(torch.randn(2, 3, 16, 16),), loss_fn=lambda out, _: out.sum(), optimizer="sgd")
    est = estimate(model, step=step, device="h100")
    plain = estimate(model, step=step, device="h100", options=EstimateOptions(cuda_autocast=False))
    assert [str(op.func) for op in est.trace.ops if op.phase.name == "FW"] == [
        "aten.convolution.default", "aten.sum.default"]
    assert est.module_info.peak_bytes == plain.module_info.peak_bytes


def _registered() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::layer_norm", "AutocastPrivateUse1")


class _OpensAutocast(nn.Module):
    """Opens CPU autocast itself for part of its forward, or not (``opens``); notes whether
    CUDA's kernels are registered before and inside (``seen``, which the fake copy shares)."""

    def __init__(self, opens: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.opens = opens
        self.seen = _Seen()

    def forward(self, x):
        self.seen.dtypes.append(_registered())
        y = torch.exp(self.lin(x))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.opens):
            z = F.layer_norm(self.lin(y), (y.shape[-1],))  # linear: cast down; layer_norm: float32 on CUDA
            self.seen.dtypes.append(_registered())
        return F.cross_entropy(z, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


def test_kernels_are_registered_only_for_a_step_that_turns_autocast_on(monkeypatch):
    """A step that never turns CPU autocast on is traced without CUDA's autocast kernels (outside
    autocast each runs its op as called; registering them is a twentieth of a small trace); one
    that turns it on where nothing announced it (the model itself) is traced again with them. The
    estimates are those made with the kernels registered from the start."""
    from estimators.tracing import estimation
    from tests.estimators.tracing.trace_equivalence import estimate_difference

    step = TrainStep(inputs=(torch.randn(8, 64),), optimizer="adam")
    plain, opens = _OpensAutocast(opens=False), _OpensAutocast()
    lazy = [estimate(m, step=step, device="h100") for m in (plain, opens)]
    assert plain.seen.dtypes == [False, False]  # one trace, no kernels
    assert opens.seen.dtypes == [False, False, True, True]  # traced again, with them
    assert not _registered()

    monkeypatch.setattr(estimation, "AutocastWatch", lambda: None)  # registered from the start
    plain.seen.dtypes.clear(), opens.seen.dtypes.clear()
    eager = [estimate(m, step=step, device="h100") for m in (plain, opens)]
    assert plain.seen.dtypes == opens.seen.dtypes == [True, True]
    for a, b in zip(lazy, eager):
        assert estimate_difference(a, b) == ""
        assert a.module_info == b.module_info
    casts = [op for op in lazy[1].trace.ops if op.phase.name == "FW" and op.func is _TO_COPY]
    assert len(casts) >= 3  # the policy ran: weight and input cast down, layer_norm's input up


def test_a_step_that_opens_autocast_registers_the_kernels_from_the_start():
    model = _OpensAutocast(opens=False)
    estimate(model, step=TrainStep(inputs=(torch.randn(8, 64),), autocast_dtype=torch.bfloat16), device="h100")
    assert model.seen.dtypes == [True, True]
    assert not _registered()


class _DotsInAutocast(nn.Module):
    """dot(float32, bfloat16) inside an autocast region the model opens: CUDA promotes both to
    float32; without CUDA's kernels CPU autocast leaves them mixed and the kernel refuses them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(256))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.dot(self.w * 2, x.to(torch.bfloat16))


def test_a_step_that_fails_without_the_kernels_while_autocast_is_on_is_traced_with_them(monkeypatch):
    from estimators.tracing import estimation
    from tests.estimators.tracing.trace_equivalence import estimate_difference

    step = TrainStep(inputs=(torch.randn(256),), loss_fn=lambda out, _: out.float(), optimizer="sgd")
    lazy = estimate(_DotsInAutocast(), step=step, device="h100")
    monkeypatch.setattr(estimation, "AutocastWatch", lambda: None)
    eager = estimate(_DotsInAutocast(), step=step, device="h100")
    assert estimate_difference(lazy, eager) == "" and lazy.module_info == eager.module_info
    monkeypatch.setattr(estimation, "CudaAutocast", lambda: contextlib.nullcontext())  # no kernels at all
    with pytest.raises(TraceError):
        estimate(_DotsInAutocast(), step=step, device="h100")
