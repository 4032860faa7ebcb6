"""estimators/cuda_rules.py: each CUDA memory rule on its own, against hand-computed bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from estimators.estimate import estimate


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.leaf = nn.Identity()

    def forward(self, x):
        return self.leaf(torch.tanh(x * self.w))  # saves x (input) and tanh's output


def _stats(model, x, device):
    return estimate(model, (x,), device=device).module_info.stats(type(model).__name__)


def test_allocator_rounds_to_512_byte_blocks():
    x = torch.randn(10)  # 40 bytes
    cpu = _stats(Scale(10), x, "cpu")
    gpu = _stats(Scale(10), x, "h100")
    assert cpu.act_fw_bytes == 40 + 40  # x and tanh(x * w)
    assert gpu.act_fw_bytes == 512 + 512
    assert gpu.param_bytes == 512 and cpu.param_bytes == 40


class Drop(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.leaf = nn.Identity()

    def forward(self, x):
        return self.leaf(F.dropout(x * self.w, 0.5, True))


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


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.leaf = nn.Identity()

    def forward(self, x):  # x: (B, H, L, D)
        q = x * self.w
        return self.leaf(F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True))


def test_sdpa_keeps_output_and_logsumexp_never_seq_by_seq():
    B, H, L, D = 2, 4, 64, 16
    x = torch.randn(B, H, L, D)
    act = B * H * L * D * 4
    lse = B * H * L * 4  # float32 log-sum-exp
    gpu = _stats(Attn(D), x, "h100")
    # x (saved by the mul), q (= k = v, one storage), the output and the log-sum-exp.
    assert gpu.act_fw_bytes == act + act + act + lse
    cpu = _stats(Attn(D), x, "cpu")
    seq_by_seq = B * H * L * L * 4
    assert cpu.act_fw_bytes >= 2 * act + seq_by_seq  # the math path keeps score-sized tensors
    est = estimate(Attn(D), (x,), device="h100")
    assert max(s.nbytes for s in est.trace.storages if s.saved) < seq_by_seq


def test_sdpa_with_grouped_query_heads():
    B, H, Hkv, L, D = 1, 8, 2, 32, 16

    class GQA(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(D))
            self.leaf = nn.Identity()

        def forward(self, q, kv):
            k = kv * self.w
            return self.leaf(F.scaled_dot_product_attention(q * self.w, k, k, is_causal=True, enable_gqa=True))

    q, kv = torch.randn(B, H, L, D), torch.randn(B, Hkv, L, D)
    est = estimate(GQA(), (q, kv), device="h100")
    s = est.module_info.stats("GQA")
    # q, kv inputs; q*w, k (Hkv heads, not repeated); output; lse.
    expect = 2 * (B * H * L * D * 4) + 2 * (B * Hkv * L * D * 4) + B * H * L * D * 4 + B * H * L * 4
    assert s.act_fw_bytes == expect


def test_rules_only_for_cuda_targets():
    n = 4096
    a = _stats(Drop(n), torch.randn(n), "cpu")
    from estimators.estimate import EstimateOptions

    b = estimate(Drop(n), (torch.randn(n),), device="h100", options=EstimateOptions(cuda_semantics=False))
    # Rounding stays (it is the allocator of the target); the dropout rule is off.
    assert b.module_info.stats("Drop").act_fw_bytes == a.act_fw_bytes
