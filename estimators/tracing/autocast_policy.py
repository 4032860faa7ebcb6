"""CUDA autocast's op lists for the installed torch, read from torch itself.

torch ships ``ATen/autocast_mode.h`` (under ``torch/include``) with the lists its CUDA autocast
registers, one C macro per cast policy (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``); ``autocast_mode.cpp`` registers them for CUDA and adds three ops of its own
(``cudnn_convolution`` and ``cudnn_convolution_transpose`` in lower precision,
``binary_cross_entropy`` refused), written here as :data:`CUDA_ONLY_REGISTRATIONS` because the .cpp
is not shipped. Which ops hold a CUDA or a CPU autocast kernel in this process is the dispatcher's
answer (``torch._C._dispatch_has_kernel_for_dispatch_key``); the tests check that the header's
lists plus those three are exactly the ops with a CUDA autocast kernel, so a torch whose lists move
fails there rather than planning with a stale policy. The CPU's lists are not in the header: ops
with a CPU autocast kernel are known (the dispatcher), their policies are measured in the tests.
"""

from __future__ import annotations

import enum
import functools
import os
import re

import torch

__all__ = [
    "CastPolicy", "PolicyUnavailableError", "CUDA_ONLY_REGISTRATIONS", "autocast_header_path",
    "parse_autocast_header", "cuda_policy", "autocast_kernel_ops",
]


class CastPolicy(enum.Enum):
    """``at::autocast::CastPolicy`` (autocast_mode.h), plus the op CUDA autocast refuses."""

    LOWER = "lower_precision_fp"
    """Floating tensor arguments (not float64) cast to the autocast dtype."""
    FP32 = "fp32"
    """Floating tensor arguments cast to float32."""
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    """A ``dtype=None`` argument set to float32 when the first tensor is floating."""
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    """Redispatched to the overload that takes a trailing ``dtype``, float32."""
    PROMOTE = "promote"
    """Floating tensor arguments cast to the widest of them."""
    BANNED = "banned"
    """Refused under autocast (``binary_cross_entropy``)."""


class PolicyUnavailableError(RuntimeError):
    """CUDA autocast's policy cannot be modelled in this process; the message says what to do."""


_MACROS = {
    "AT_FORALL_LOWER_PRECISION_FP": CastPolicy.LOWER,
    "AT_FORALL_FP32": CastPolicy.FP32,
    "AT_FORALL_FP32_SET_OPT_DTYPE": CastPolicy.FP32_SET_OPT_DTYPE,
    "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE": CastPolicy.FP32_APPEND_DTYPE,
    "AT_FORALL_PROMOTE": CastPolicy.PROMOTE,
}

CUDA_ONLY_REGISTRATIONS = {
    "aten::cudnn_convolution": CastPolicy.LOWER,
    "aten::cudnn_convolution_transpose": CastPolicy.LOWER,
    "aten::binary_cross_entropy": CastPolicy.BANNED,
}
"""What autocast_mode.cpp registers for CUDA beside the header's lists."""


def autocast_header_path() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


def parse_autocast_header(text: str) -> dict[str, CastPolicy]:
    """``"aten::op"`` / ``"aten::op.overload"`` -> policy, from the header's ``AT_FORALL_*`` macros
    (``_(pow, Tensor_Scalar)`` is ``aten::pow.Tensor_Scalar``; the redispatch list names its ops
    as strings, ``"norm.Scalar"``)."""
    policies: dict[str, CastPolicy] = {}
    for macro, policy in _MACROS.items():
        m = re.search(r"#define\s+" + macro + r"\(_\)((?:[^\n]*\\\n)*[^\n]*)", text)
        if m is None:
            raise PolicyUnavailableError(f"torch's autocast_mode.h has no {macro} list")
        body = m.group(1).replace("\\\n", " ")
        if policy is CastPolicy.FP32_APPEND_DTYPE:
            names = re.findall(r'"([\w.]+)"', body)
        else:
            names = [".".join(p.strip() for p in entry.split(",")) for entry in re.findall(r"_\(([^()]*)\)", body)]
        if not names:
            raise PolicyUnavailableError(f"torch's autocast_mode.h {macro} list is empty")
        for name in names:
            policies[f"aten::{name}"] = policy
    return policies


@functools.cache
def cuda_policy() -> dict[str, CastPolicy]:
    """CUDA autocast's policy for every op overload it registers in the installed torch."""
    path = autocast_header_path()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PolicyUnavailableError(
            f"torch's autocast op lists ({path}) cannot be read ({e.strerror}): this torch install "
            "ships no C++ headers, so CUDA autocast cannot be modelled; install torch from its "
            "wheel (which has torch/include), or trace with CPU autocast's policy instead "
            "(EstimateOptions(cuda_autocast=False))") from None
    policies = {**parse_autocast_header(text), **CUDA_ONLY_REGISTRATIONS}
    known = set(torch._C._dispatch_get_all_op_names())
    return {name: p for name, p in policies.items() if name in known}


def autocast_kernel_ops(dispatch_key: str) -> frozenset[str]:
    """The ops holding a kernel for ``dispatch_key`` (``"AutocastCPU"``, ``"AutocastCUDA"``) in this
    process: torch's and any extension's loaded so far. Asked of the dispatcher in one call
    (``_dispatch_get_registrations_for_dispatch_key``: the same test per op, in C++); op by op
    where this torch lacks it (a scan of every op, tens of milliseconds per trace)."""
    listed = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if listed is not None:
        return frozenset(listed(dispatch_key))
    return autocast_kernel_ops_by_op(dispatch_key)


def autocast_kernel_ops_by_op(dispatch_key: str) -> frozenset[str]:
    """:func:`autocast_kernel_ops`, asking the dispatcher op by op."""
    return frozenset(n for n in torch._C._dispatch_get_all_op_names()
                     if torch._C._dispatch_has_kernel_for_dispatch_key(n, dispatch_key))
