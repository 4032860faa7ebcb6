"""estimators/tracing/autocast_policy.py: CUDA autocast's lists read from the installed torch."""

from __future__ import annotations

import pytest

from estimators.tracing import autocast_policy
from estimators.tracing.autocast_policy import (
    CUDA_ONLY_REGISTRATIONS, CastPolicy, PolicyUnavailableError, autocast_kernel_ops, autocast_kernel_ops_by_op,
    cuda_policy, parse_autocast_header,
)


def test_the_lists_are_exactly_the_ops_with_a_cuda_autocast_kernel():
    """The header's lists plus autocast_mode.cpp's own three are what the dispatcher holds for
    AutocastCUDA: a torch whose lists move fails here, not in a plan."""
    assert set(cuda_policy()) == autocast_kernel_ops("AutocastCUDA")
    assert set(CUDA_ONLY_REGISTRATIONS) <= set(cuda_policy())


@pytest.mark.parametrize("key", ["AutocastCPU", "AutocastCUDA"])
def test_the_dispatchers_list_is_its_answer_op_by_op(key):
    assert autocast_kernel_ops(key) == autocast_kernel_ops_by_op(key)
    assert len(autocast_kernel_ops(key)) > 50


def test_policies_of_ops_the_docs_name():
    p = cuda_policy()
    assert p["aten::layer_norm"] is p["aten::exp"] is p["aten::pow.Tensor_Scalar"] is CastPolicy.FP32
    assert p["aten::softmax.int"] is p["aten::sum.dim_IntList"] is CastPolicy.FP32_SET_OPT_DTYPE
    assert p["aten::norm.Scalar"] is CastPolicy.FP32_APPEND_DTYPE
    assert p["aten::addcmul"] is p["aten::index_put"] is CastPolicy.PROMOTE
    assert p["aten::linear"] is p["aten::einsum"] is p["aten::mv"] is CastPolicy.LOWER
    assert p["aten::binary_cross_entropy"] is CastPolicy.BANNED
    assert "aten::cat" not in p and "aten::cross_entropy_loss" not in p


def test_header_macros_parse_with_overloads_and_continuations():
    text = (
        "#define AT_FORALL_LOWER_PRECISION_FP(_) \\\n  _(mm)            \\\n  _(conv_transpose2d, input)\n"
        "#define AT_FORALL_FP32(_) _(exp) _(pow, Tensor_Scalar)\n"
        "#define AT_FORALL_FP32_SET_OPT_DTYPE(_) \\\n  _(softmax, int)\n"
        '#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(_) \\\n  _(ADD_NS(norm), "norm.Scalar", \\\n'
        "    Tensor(const Tensor&, const Scalar&), \\\n    fp32_append_dtype)\n"
        "#define AT_FORALL_PROMOTE(_) \\\n  _(addcmul)\n"
    )
    assert parse_autocast_header(text) == {
        "aten::mm": CastPolicy.LOWER, "aten::conv_transpose2d.input": CastPolicy.LOWER,
        "aten::exp": CastPolicy.FP32, "aten::pow.Tensor_Scalar": CastPolicy.FP32,
        "aten::softmax.int": CastPolicy.FP32_SET_OPT_DTYPE, "aten::norm.Scalar": CastPolicy.FP32_APPEND_DTYPE,
        "aten::addcmul": CastPolicy.PROMOTE,
    }


def test_a_missing_list_is_an_error_not_an_empty_policy():
    with pytest.raises(PolicyUnavailableError, match="AT_FORALL_FP32"):
        parse_autocast_header("#define AT_FORALL_LOWER_PRECISION_FP(_) _(mm)\n")


def test_a_torch_without_headers_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(autocast_policy, "autocast_header_path", lambda: str(tmp_path / "missing.h"))
    cuda_policy.cache_clear()
    try:
        with pytest.raises(PolicyUnavailableError, match="cuda_autocast=False"):
            cuda_policy()
    finally:
        cuda_policy.cache_clear()
