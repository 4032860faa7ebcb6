"""Count a CPU trace the way CUDA kernels would use memory.

Fake CUDA tensors cannot run on a CPU-only torch build, so a plan for a GPU is traced on fake CPU
tensors. Three CPU/CUDA differences change what is kept for backward; each rule below makes the
trace follow the CUDA behaviour and each is tested on its own (tests/estimators/test_cuda_rules.py):

1. Allocator rounding: the CUDA caching allocator hands out blocks in multiples of 512 bytes.
   Applied to every storage through ``DeviceSpec.round_bytes``.
2. Dropout mask: on CUDA ``F.dropout`` runs ``native_dropout`` and keeps a 1-byte bool mask; the
   CPU path keeps a full-width scaled noise tensor. ``F.dropout`` is routed to ``native_dropout``.
3. Fused attention: on CUDA ``F.scaled_dot_product_attention`` runs the flash / memory-efficient
   kernels, which keep the output and the log-sum-exp (batch x heads x seq, float32) and never a
   seq x seq score, softmax or dropout matrix, also with ``dropout_p > 0`` (the CPU falls back to
   the math path there). The call is routed to the fused CPU kernel, whose autograd formula keeps
   the same tensors (q, k, v, output, log-sum-exp). Grouped-query k/v are passed with their own
   head count, as the CUDA kernels take them, not repeated.

The rules apply only under fake tensors for a ``kind == "cuda"`` DeviceSpec; a real run measures
what its own device does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CudaSemanticsMode"]

_DROPOUT_FUNCS = {F.dropout, torch.dropout, torch.nn.functional.dropout}
_SDPA_FUNCS = {F.scaled_dot_product_attention}


class CudaSemanticsMode(TorchFunctionMode):
    """Route dropout and SDPA calls to the kernels CUDA would run (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUT_FUNCS:
            return _cuda_dropout(*args, **kwargs)
        if func in _SDPA_FUNCS:
            return _fused_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    if p == 1:
        return input * 0 if not inplace else input.zero_()
    out, _mask = torch.native_dropout(input, p, True)
    return input.copy_(out) if inplace else out


def _fused_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    # Layout: (batch, heads, seq, head_dim); k/v may have fewer heads (GQA).
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query,
        key,
        value,
        dropout_p,
        is_causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    return out
