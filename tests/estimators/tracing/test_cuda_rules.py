"""estimators/tracing/cuda_rules.py: each CUDA rule on its own, against hand-computed bytes and torch's
own selection rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from estimators.tracing.cuda_rules import CudaSemanticsMode, SdpaKernel, select_sdpa_kernel
from estimators.tracing.estimation import EstimateOptions, estimate
from estimators.step.train_step import TrainStep


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.leaf = nn.Identity()

    def forward(self, x):
        return self.leaf(torch.tanh(x * self.w))  # saves x (input) and tanh's output


def _stats(model, x, device):
    return estimate(model, TrainStep(inputs=(x,)), device=device).module_info.stats(type(model).__name__)


def _funcs(model, inputs, device="h100"):
    return [str(o.func) for o in estimate(model, TrainStep(inputs=inputs), device=device).trace.ops]


def test_allocator_rounds_to_512_byte_blocks():
    x = torch.randn(10)  # 40 bytes
    cpu = _stats(Scale(10), x, "cpu")
    gpu = _stats(Scale(10), x, "h100")
    assert cpu.act_fw_bytes == 40 + 40  # x and tanh(x * w)
    assert gpu.act_fw_bytes == 512 + 512
    assert gpu.param_bytes == 512 and cpu.param_bytes == 40


# ----------------------------------------------------------------------------- dropout


class Drop(nn.Module):
    def __init__(self, n, drop=lambda x: F.dropout(x, 0.5, True)):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.leaf = nn.Identity()
        self.drop = drop

    def forward(self, x):
        return self.leaf(self.drop(x * self.w))


def test_dropout_mask_is_one_byte_bool_on_cuda():
    n = 4096
    x = torch.randn(n)
    cpu = _stats(Drop(n), x, "cpu")
    gpu = _stats(Drop(n), x, "h100")
    assert cpu.act_fw_bytes == 4 * n + 4 * n  # x, and a float32 noise tensor
    assert gpu.act_fw_bytes == 4 * n + 1 * n  # x, and a bool mask
    assert cpu.sac_memory_bytes == 4 * n
    # native_dropout's output is not saved, only its mask: caching the op would hold the output,
    # so it is always recomputed when the module is checkpointed (off the optional curve).
    drop = next(o for o in gpu.ops if o.func == "aten.native_dropout.default")
    assert (drop.memory_bytes, drop.cache_cost_bytes) == (n, 4 * n)


FUSED = [
    ("F.dropout", lambda x: F.dropout(x, 0.1, True)),
    ("nn.Dropout", nn.Dropout(0.1)),
    ("torch.dropout, train keyword", lambda x: torch.dropout(x, 0.1, train=True)),
    ("torch.dropout, positional", lambda x: torch.dropout(x, 0.1, True)),
]


@pytest.mark.parametrize("label, drop", FUSED, ids=[f[0] for f in FUSED])
def test_every_fused_dropout_spelling_runs_native_dropout(label, drop):
    n = 4096
    s = _stats(Drop(n, drop), torch.randn(n), "h100")
    assert s.act_fw_bytes == 4 * n + n, label
    assert any(o.func == "aten.native_dropout.default" for o in s.ops)


SAME = [
    # In-place dropout runs the composite (noise tensor) on CUDA too (Dropout.cpp dropout_).
    ("inplace", lambda x: F.dropout(x.clone(), 0.1, True, inplace=True)),
    ("dropout2d", lambda x: F.dropout2d(x.view(1, 4, 32, 32), 0.1, True).view(-1)),
    ("eval", lambda x: F.dropout(x, 0.1, False)),
    ("p=0", lambda x: torch.dropout(x, 0.0, True)),
]


@pytest.mark.parametrize("label, drop", SAME, ids=[s[0] for s in SAME])
def test_dropout_that_cuda_runs_like_the_cpu_is_left_alone(label, drop):
    n = 4096
    gpu = _funcs(Drop(n, drop), (torch.randn(n),))
    assert "aten.native_dropout.default" not in gpu, label
    cpu = _funcs(Drop(n, drop), (torch.randn(n),), "cpu")
    assert gpu == cpu, label


def test_bad_dropout_probability_keeps_torchs_error():
    with pytest.raises(Exception, match="dropout probability"):
        estimate(Drop(16, lambda x: F.dropout(x, 1.5, True)), TrainStep(inputs=(torch.randn(16),)), device="h100")


# ----------------------------------------------------------------------------- attention: selection


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype)


def test_flash_for_half_precision_without_a_mask():
    q = _t(2, 4, 64, 64)
    assert select_sdpa_kernel(q, q, q, dropout_p=0.1, is_causal=True)[0] is SdpaKernel.FLASH
    kv = _t(2, 2, 64, 64)
    assert select_sdpa_kernel(q, kv, kv, enable_gqa=True)[0] is SdpaKernel.FLASH


_Q = _t(2, 4, 64, 64)


@pytest.mark.parametrize(
    "why, q, kv, mask, causal",
    [
        ("float32", _Q.float(), _Q.float(), None, False),
        ("a mask", _Q, _Q, torch.zeros(64, 64, dtype=torch.bfloat16), False),
        ("a mask that needs grad", _Q, _Q, torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16, requires_grad=True), False),
        ("head dim 288 > 256", _t(2, 4, 64, 288), _t(2, 4, 64, 288), None, False),
        ("causal with Lq != Lk", _t(2, 4, 32, 64), _Q, None, True),
    ],
)
def test_memory_efficient_when_flash_cannot(why, q, kv, mask, causal):
    kernel, reasons = select_sdpa_kernel(q, kv, kv, mask, is_causal=causal)
    assert kernel is SdpaKernel.EFFICIENT, why
    assert len(reasons) == 1 and reasons[0].startswith("flash:"), reasons


@pytest.mark.parametrize(
    "why, q, kv, kw",
    [
        ("3-D inputs", _t(4, 64, 64), _t(4, 64, 64), {}),
        ("fp32 head dim not divisible by 4", _t(2, 4, 64, 6, dtype=torch.float32), None, {}),
        ("head counts differ without enable_gqa", _t(2, 4, 64, 64), _t(2, 2, 64, 64), {}),
        ("float64", _t(2, 4, 64, 64, dtype=torch.float64), None, {}),
        ("last-dim stride != 1", _t(2, 4, 64, 64).transpose(-1, -2), None, {}),
    ],
)
def test_math_as_the_last_resort(why, q, kv, kw):
    kv = q if kv is None else kv
    kernel, reasons = select_sdpa_kernel(q, kv, kv, **kw)
    assert kernel is SdpaKernel.MATH, why
    assert reasons


def test_user_switches_are_honoured():
    q = _t(2, 4, 64, 64)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert select_sdpa_kernel(q, q, q)[0] is SdpaKernel.EFFICIENT
    with sdpa_kernel([SDPBackend.MATH]):
        assert select_sdpa_kernel(q, q, q)[0] is SdpaKernel.MATH
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError, match="math kernel disabled"):
            select_sdpa_kernel(q.float(), q.float(), q.float())


# ----------------------------------------------------------------------------- attention: bytes


class Attn(nn.Module):
    def __init__(self, d, dtype=torch.float32, **sdpa):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d, dtype=dtype))
        self.leaf = nn.Identity()
        self.sdpa = sdpa

    def forward(self, x, *mask):  # x: (B, H, L, D)
        q = x * self.w
        return self.leaf(F.scaled_dot_product_attention(q, q, q, *mask, **self.sdpa))


B, H, L, D = 2, 4, 64, 16
RNG = 2 * 512  # the kernels' RNG seed and offset tensors: one allocator block each


def test_flash_keeps_qkv_output_and_logsumexp_never_seq_by_seq():
    x = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    act = B * H * L * D * 2
    lse = B * H * L * 4  # float32 log-sum-exp
    est = estimate(Attn(D, torch.bfloat16, dropout_p=0.1, is_causal=True), TrainStep(inputs=(x,)), device="h100")
    funcs = {str(o.func) for o in est.trace.ops}
    assert {"aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_flash_attention_backward.default"} <= funcs
    # x (saved by the mul), q (= k = v, one storage), the output, the log-sum-exp, seed, offset.
    assert est.module_info.stats("Attn").act_fw_bytes == act + act + act + lse + RNG
    assert max(s.nbytes for s in est.trace.storages if s.saved) < B * H * L * L * 2


def test_flash_pads_head_dim_to_a_multiple_of_8_as_attention_cpp_does():
    d = 12
    x = torch.randn(B, H, L, d, dtype=torch.bfloat16)
    s = estimate(Attn(d, torch.bfloat16), TrainStep(inputs=(x,)), device="h100").module_info.stats("Attn")
    act, padded = B * H * L * d * 2, B * H * L * 16 * 2
    # x (saved by the mul; q itself is only read by the pads, which save nothing), q padded to 16
    # three times (q = k = v: three pads of one tensor, each kept), the padded output (sliced back
    # to 12 for the caller: a view of it), the log-sum-exp, seed and offset.
    assert s.act_fw_bytes == act + 3 * padded + padded + B * H * L * 4 + RNG


@pytest.mark.slow
def test_efficient_for_float32_keeps_output_and_logsumexp():
    x = torch.randn(B, H, L, D)
    act = B * H * L * D * 4
    gpu = _stats(Attn(D, dropout_p=0.1, is_causal=True), x, "h100")
    assert gpu.act_fw_bytes == act + act + act + B * H * L * 4 + RNG
    cpu = _stats(Attn(D, dropout_p=0.1, is_causal=True), x, "cpu")
    assert cpu.act_fw_bytes >= 2 * act + B * H * L * L * 4  # the CPU math path keeps score-sized tensors


def test_efficient_keeps_the_bias_and_returns_its_gradient():
    x = torch.randn(B, H, L, D)
    bias = torch.randn(1, H, L, L, requires_grad=True)  # T5's position bias is trained

    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(D))
            self.b = nn.Parameter(bias.detach().clone())

        def forward(self, x):
            q = x * self.w
            # Computed in the forward, like T5's bias (an embedding lookup): an activation.
            return F.scaled_dot_product_attention(q, q, q, attn_mask=self.b * 2)

    est = estimate(Biased(), TrainStep(inputs=(x,)), device="h100")
    funcs = [str(o.func) for o in est.trace.ops]
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in funcs
    s = est.module_info.stats("Biased")
    act = B * H * L * D * 4
    # x, q, the bias (kept by the kernel), output, log-sum-exp, seed, offset.
    assert s.act_fw_bytes == act + act + H * L * L * 4 + act + B * H * L * 4 + RNG
    # The gradient reaches the bias under the rules (fake tensors, as a trace runs).
    with FakeTensorMode(allow_non_fake_inputs=True) as fm:
        b = fm.from_tensor(bias).requires_grad_()
        q = torch.randn(B, H, L, D, requires_grad=True)
        with CudaSemanticsMode():
            F.scaled_dot_product_attention(q, q, q, attn_mask=b).sum().backward()
    assert b.grad is not None and b.grad.shape == b.shape


def test_bool_mask_becomes_a_float_bias():
    x = torch.randn(B, H, L, D)
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    funcs = _funcs(Attn(D), (x, mask))
    assert "aten.where.self" in funcs and "aten._scaled_dot_product_efficient_attention.default" in funcs


def test_grouped_query_heads_reach_flash_unrepeated():
    Hkv = 2

    class GQA(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(D, dtype=torch.bfloat16))
            self.leaf = nn.Identity()

        def forward(self, q, kv):
            k = kv * self.w
            return self.leaf(F.scaled_dot_product_attention(q * self.w, k, k, is_causal=True, enable_gqa=True))

    q, kv = torch.randn(B, H, L, D, dtype=torch.bfloat16), torch.randn(B, Hkv, L, D, dtype=torch.bfloat16)
    s = estimate(GQA(), TrainStep(inputs=(q, kv)), device="h100").module_info.stats("GQA")
    # q, kv inputs; q*w, k (Hkv heads, not repeated); output; lse; seed, offset.
    expect = 2 * (B * H * L * D * 2) + 2 * (B * Hkv * L * D * 2) + B * H * L * D * 2 + B * H * L * 4 + RNG
    assert s.act_fw_bytes == expect


def test_math_fallback_runs_torchs_composite():
    x = torch.randn(B, H, L, D, dtype=torch.float64)
    funcs = _funcs(Attn(D, torch.float64), (x,))
    assert not any("flash" in f or "efficient" in f for f in funcs)
    assert "aten._softmax.default" in funcs or "aten._safe_softmax.default" in funcs


# ----------------------------------------------------------------------------- every op of the step


class CkptBlock(nn.Module):
    """Attention + dropout under non-reentrant checkpointing: the recompute runs in backward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def _body(self, x):
        q = x * self.w
        return F.dropout(F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True), 0.1, True)

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False, preserve_rng_state=True)


def test_rules_hold_in_backward_and_in_the_recompute():
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((torch.is_grad_enabled(), str(func)))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(B, H, L, D)
        m = CkptBlock()
        with CudaSemanticsMode(), Spy():
            out = m(x)
            n_fw = len(seen)
            out.sum().backward()
    fw = [f for _, f in seen[:n_fw]]
    bw = [f for _, f in seen[n_fw:]]
    for op in ("aten._scaled_dot_product_efficient_attention.default", "aten.native_dropout.default"):
        assert fw.count(op) == 1 and bw.count(op) == 1, op  # the recompute ran the CUDA kernels
    assert not any("for_cpu" in f or "bernoulli" in f for f in fw + bw)


def test_rules_only_for_cuda_targets():
    n = 4096
    a = _stats(Drop(n), torch.randn(n), "cpu")
    b = estimate(Drop(n), TrainStep(inputs=(torch.randn(n),)), device="h100", options=EstimateOptions(cuda_semantics=False))
    # Rounding stays (it is the allocator of the target); the dropout rule is off.
    assert b.module_info.stats("Drop").act_fw_bytes == a.act_fw_bytes


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_internals_follow_the_rules(need_weights):
    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=need_weights)[0]

    funcs = _funcs(MHA(), (torch.randn(2, 32, 64),))
    # F.multi_head_attention_forward is Python: the mode stays in force for what it calls.
    if need_weights:  # explicit softmax weights, then F.dropout on them
        assert "aten.native_dropout.default" in funcs
    else:  # SDPA with dropout_p
        assert "aten._scaled_dot_product_efficient_attention.default" in funcs
    assert "aten.bernoulli_.float" not in funcs
