"""Trace a step on fake CPU tensors the way CUDA kernels would run it.

Fake CUDA tensors cannot run on a CPU-only torch build, so a plan for a GPU is traced on fake CPU
tensors. Where CPU and CUDA run different kernels for the same call, what is kept for backward
differs; each rule below makes the trace follow CUDA and is tested on its own
(tests/estimators/test_cuda_rules.py):

1. Allocator rounding: the CUDA caching allocator hands out blocks in multiples of 512 bytes.
   Applied to every storage through ``DeviceSpec.round_bytes`` (estimators/tracing/estimation.py).
2. Dropout: on CUDA ``aten::dropout`` (``F.dropout``, ``nn.Dropout``, ``torch.dropout(x, p,
   train)``) runs the fused ``native_dropout`` when training with ``0 < p < 1`` on a non-empty
   tensor and keeps a 1-byte bool mask; the CPU path keeps a full-width scaled noise tensor.
   In-place dropout (``F.dropout(inplace=True)``, ``torch.dropout_``) and feature / alpha dropout
   (``F.dropout1d/2d/3d``, ``F.alpha_dropout``) run the same composite on both devices, so they
   are left alone.
3. Attention: ``F.scaled_dot_product_attention`` runs the kernel CUDA's ``select_sdp_backend``
   (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) would pick, see
   :func:`select_sdpa_kernel`, and the trace runs that kernel's own aten op -- its meta kernel
   works on fake CPU tensors, backward included -- so what it keeps is the real kernel's:

   * flash: q, k, v (head dim padded to a multiple of 8, as attention.cpp does), the output,
     the float32 log-sum-exp (B x H x L) and the RNG seed/offset; never a seq x seq matrix.
   * memory-efficient: the same plus the additive bias (a bool mask is first turned into a
     float one, as attention.cpp does; a bias that requires grad -- T5's position bias -- gets
     its gradient). Grouped-query k/v are repeated to the query's heads first: the efficient
     op's backward takes equal head counts.
   * math (last resort): torch's composite, which keeps the score-sized softmax matrices.

   Modelled selection, for dense (non-nested) inputs on an sm80+ GPU (every CUDA DeviceSpec
   here: A100, L4, H100, H200, B200), in torch's default priority order flash > efficient > math
   (``torch._C._get_sdp_priority_order()``), honouring the user's switches
   (``torch.backends.cuda.enable_flash_sdp`` ..., ``torch.nn.attention.sdpa_kernel``):

   * fused kernels: q, k, v 4-D; non-zero sequence lengths; equal batch sizes; equal head
     counts, or ``enable_gqa`` with k/v heads equal and dividing the query heads; last-dim stride
     1 for q, k, v and the mask.
   * flash: no mask; q, k, v the same head dim <= 256; fp16 / bf16; ``is_causal`` only with
     equal query and key lengths.
   * efficient: q and k the same head dim; q and v head dims divisible by 8 (fp16 / bf16) or 4
     (fp32); q, k, v storage offsets aligned the same way; fp16, bf16 or fp32.

   Not modelled: cuDNN attention (torch prefers it on sm90 / sm100 when its cuDNN is newer than
   9.15; without a mask it keeps what flash keeps), the sm86/89 flash limit on head dims in
   (192, 256] when training, nested tensors, the FP8 flash of FA3, and dropout inside the math
   fallback (counted as the CPU composite). The kernels' RNG seed / offset tensors are counted as
   one 512-byte block each, as the meta kernels report them; the efficient kernel keeps them on
   the host on CUDA (up to 1 KiB per call over-counted).

The rules hold for every op of the step: torch pops a TorchFunctionMode while it handles a call, so
``loss.backward()`` -- and the recompute of checkpointed modules inside it -- used to run without
them; the mode re-enters itself around ``Tensor.backward``, ``torch.autograd.backward`` /
``grad`` and ``F.multi_head_attention_forward`` (``torch.overrides.redispatch_function``), so the
recompute runs the same kernels as the forward and a selective-checkpoint policy sees the same ops
in both. The rules apply only to fake traces for a ``kind == "cuda"`` DeviceSpec; a real run
measures what its own device does, and a plan made under the rules applies on CPU unchanged (its
CUDA op keys are simply not found there: those ops are recomputed).
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, redispatch_function

__all__ = ["CudaSemanticsMode", "SdpaKernel", "select_sdpa_kernel"]

_aten = torch.ops.aten
_SAME_ON_CPU = object()  # a rule's answer: CUDA runs what the CPU runs for these arguments


class SdpaKernel(enum.Enum):
    """The attention kernels CUDA chooses between (in its default priority order)."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


class CudaSemanticsMode(TorchFunctionMode):
    """Route dropout and SDPA calls to the kernels CUDA would run (see module docstring).
    ``watch``: an ``AutocastWatch`` (``estimators.tracing.cuda_autocast``) shown every call."""

    def __init__(self, watch=None) -> None:
        super().__init__()
        self._watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        watch = self._watch
        if watch is not None and not watch.seen:
            watch.note()
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            with self:  # torch pops the mode while it calls us: what the rule runs stays under it
                out = rule(*args, **kwargs)
            if out is not _SAME_ON_CPU:
                return out
        if func in _KEEP_RULES_INSIDE:
            # torch pops the mode while it calls us, and these run model code or rules' targets:
            # Tensor.backward runs the recompute of checkpointed modules, MHA calls F.dropout and
            # SDPA. Skip this one hop of dispatch (no recursion into us) with the mode re-entered.
            with self:
                return redispatch_function(func, types, args, kwargs)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- dropout


def _fused_dropout_applies(input: torch.Tensor, p: float, train: bool) -> bool:
    # aten/src/ATen/native/Dropout.cpp: is_fused_kernel_acceptable (CUDA) and ``train``.
    return bool(train) and 0 < p < 1 and input.numel() > 0


def _functional_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` / ``nn.Dropout`` on CUDA."""
    if inplace or not isinstance(input, torch.Tensor) or not _fused_dropout_applies(input, p, training):
        return _SAME_ON_CPU  # the composite (or F.dropout's own error for a bad p)
    return torch.native_dropout(input, p, True)[0]


def _torch_dropout(input, p, train):
    """``torch.dropout(input, p, train)`` (the keyword is ``train``, not ``training``)."""
    if not isinstance(input, torch.Tensor) or not _fused_dropout_applies(input, p, train):
        return _SAME_ON_CPU
    return torch.native_dropout(input, p, True)[0]


# ----------------------------------------------------------------------------- attention


def _dims_ok(query, key, value) -> str | None:
    """sdp_utils: the constraints both fused kernels share (dense inputs)."""
    if not (query.dim() == key.dim() == value.dim() == 4):
        return "q, k, v are not 4-D"
    if query.size(-2) == 0 or key.size(-2) == 0:
        return "a sequence length is 0"
    if not (query.size(0) == key.size(0) == value.size(0)):
        return "batch sizes differ"
    return None


def _heads_ok(query, key, value, enable_gqa: bool) -> str | None:
    hq, hk, hv = query.size(1), key.size(1), value.size(1)
    if hq == hk == hv:
        return None
    if enable_gqa and hk == hv and hq % hk == 0:
        return None
    return f"head counts q={hq} k={hk} v={hv} need enable_gqa with k/v heads dividing q's"


def _strides_ok(query, key, value, attn_mask, ignore_singleton: bool) -> str | None:
    ok = all(t.stride(-1) == 1 for t in (query, key, value))
    if ignore_singleton and query.size(-1) == 1:
        ok = True
    if attn_mask is not None and attn_mask.stride(-1) != 1:
        ok = False
    return None if ok else "a last dimension has stride != 1"


def _dtype_ok(query, key, value, allowed) -> str | None:
    if query.dtype == key.dtype == value.dtype and query.dtype in allowed:
        return None
    return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} not all one of {sorted(map(str, allowed))}"


def _flash_rejects(query, key, value, attn_mask, is_causal, enable_gqa) -> str | None:
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash disabled by the user"
    if attn_mask is not None:
        return "flash takes no attn_mask"
    d = query.size(-1)
    if not (key.size(-1) == d == value.size(-1) and d <= 256):
        return "flash needs one head dim <= 256 for q, k, v"
    if is_causal and query.size(-2) != key.size(-2):
        return "flash's is_causal needs equal query and key lengths"
    return (
        _dtype_ok(query, key, value, (torch.float16, torch.bfloat16))
        or _heads_ok(query, key, value, enable_gqa)
        or _strides_ok(query, key, value, attn_mask, ignore_singleton=True)
    )


def _efficient_rejects(query, key, value, attn_mask, enable_gqa) -> str | None:
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "memory-efficient disabled by the user"
    wrong = _dtype_ok(query, key, value, (torch.float16, torch.bfloat16, torch.float32))
    if wrong:
        return wrong
    # minimum_gemm_alignment on sm80+: 128 bits of tensor-core operand -> 8 halves or 4 floats.
    align = 8 if query.dtype in (torch.float16, torch.bfloat16) else 4
    dq, dv = query.size(-1), value.size(-1)
    if not (dq == key.size(-1) and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0):
        return f"memory-efficient needs q/k head dims equal and q, v head dims divisible by {align}"
    if any(t.numel() and t.storage_offset() % align for t in (query, key, value)):
        return f"memory-efficient needs storage offsets divisible by {align} elements"
    return _heads_ok(query, key, value, enable_gqa) or _strides_ok(
        query, key, value, attn_mask, ignore_singleton=False
    )


def select_sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> tuple[SdpaKernel, tuple[str, ...]]:
    """The kernel CUDA (sm80+) would run for these SDPA arguments, and why faster ones were not.

    >>> q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    >>> select_sdpa_kernel(q, q, q)[0]
    <SdpaKernel.FLASH: 'flash'>
    """
    reasons: list[str] = []
    shared = _dims_ok(query, key, value)
    if shared is None:
        for kernel, why in (
            (SdpaKernel.FLASH, _flash_rejects(query, key, value, attn_mask, is_causal, enable_gqa)),
            (SdpaKernel.EFFICIENT, _efficient_rejects(query, key, value, attn_mask, enable_gqa)),
        ):
            if why is None:
                return kernel, tuple(reasons)
            reasons.append(f"{kernel.value}: {why}")
    else:
        reasons.append(f"fused kernels: {shared}")
    if not torch.backends.cuda.math_sdp_enabled():
        raise RuntimeError(
            "no SDPA kernel CUDA could run for these arguments with the math kernel disabled "
            f"({'; '.join(reasons)}); enable it (torch.backends.cuda.enable_math_sdp(True))"
        )
    return SdpaKernel.MATH, tuple(reasons)


def _additive_mask(attn_mask, dtype):
    # attention.cpp convert_boolean_attn_mask: True takes part, so False becomes -inf.
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=attn_mask.device)
    return torch.where(attn_mask.logical_not(), -math.inf, zero)


def _efficient_bias(bias, query, key):
    # attention.cpp preprocess_mask: a bias whose strides are not 8-aligned is padded to a
    # multiple of 8 on its last dim (then sliced back), and expanded to (B, H, Lq, Lk).
    aligned = bias.stride(-1) == 1 and all(s % 8 == 0 for s in bias.stride()[:-1])
    if not aligned:
        n = bias.size(-1)
        bias = F.pad(bias, (0, 8 - n % 8))[..., :n]
    return bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _flash(query, key, value, dropout_p, is_causal, scale):
    # attention.cpp: head dim padded to a multiple of 8; the scale is the unpadded one's.
    d = query.size(-1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if d % 8:
        query, key, value = (F.pad(t, (0, 8 - d % 8)) for t in (query, key, value))
    out = _aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, False, scale=scale
    )[0]
    return out[..., :d] if out.size(-1) != d else out


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale):
    if key.size(1) != query.size(1):  # GQA: the efficient op's backward takes equal heads
        key = key.repeat_interleave(query.size(1) // key.size(1), dim=1)
        value = value.repeat_interleave(query.size(1) // value.size(1), dim=1)
    bias = _additive_mask(attn_mask, query.dtype)
    if bias is not None:
        bias = _efficient_bias(bias, query, key)
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return _aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, lse, dropout_p, is_causal, scale=scale
    )[0]


def _cuda_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` as CUDA runs it (see module docstring, rule 3)."""
    if attn_mask is not None and is_causal:
        raise RuntimeError(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True"
        )
    kernel, _ = select_sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if kernel is SdpaKernel.FLASH:
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if kernel is SdpaKernel.EFFICIENT:
        return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return _aten._scaled_dot_product_attention_math(
        query, key, value, _additive_mask(attn_mask, query.dtype), dropout_p, is_causal,
        None, scale=scale, enable_gqa=enable_gqa,
    )[0]


# Not every function: a C++ method (Tensor.unflatten's super()) reports its Python override as the
# function, so re-entering the mode around any Python function would loop.
_KEEP_RULES_INSIDE = frozenset(
    {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad, F.multi_head_attention_forward}
)

_RULES = {
    F.dropout: _functional_dropout,
    torch.dropout: _torch_dropout,
    F.scaled_dot_product_attention: _cuda_sdpa,
}
