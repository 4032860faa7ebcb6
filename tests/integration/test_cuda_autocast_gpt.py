"""A bf16 GPT with nn.LayerNorm planned for h100 (issue 36): CUDA autocast's policy changes the
prediction by the bytes docs/cuda_autocast.md gives for a LayerNorm on a low-precision residual
stream, and the plan still applies and trains on CPU with bitwise gradients."""

from __future__ import annotations

import pytest
import torch

from estimators.runtime.device import get_device_spec
from estimators.tracing.estimation import EstimateOptions, estimate
from examples.gpt import GPTConfig, build_gpt
from planner import PlanOptions, TrainStep, check_gradients, solve_sac

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]

B, T, D, LAYERS = 4, 128, 128, 2


def _gpt():
    """bf16 parameters: the residual stream (embeddings, x + f(x)) is bf16 under autocast."""
    cfg = GPTConfig(vocab_size=256, seq_len=T, n_layer=LAYERS, n_head=4, dim=D, dropout=0.0)
    model, inputs = build_gpt(cfg, batch_size=B, dtype=torch.bfloat16)
    return model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw", autocast_dtype=torch.bfloat16)


def test_layer_norm_in_float32_costs_what_the_table_says():
    model, step = _gpt()
    peaks = {amp: estimate(model, step, device="h100", options=EstimateOptions(cuda_autocast=amp)).module_info.peak_bytes
             for amp in (False, True)}
    # docs/cuda_autocast.md: a LayerNorm on a bf16 input keeps a float32 copy of it (4 B/element)
    # where the CPU's kept the input (2 B), float32 copies of its weight and bias, and the Linear
    # after it a bf16 copy of the float32 output where it kept the bf16 output: +2 B/element + 8 D.
    per_norm = 2 * B * T * D + 2 * get_device_spec("h100").round_bytes(4 * D)
    assert peaks[True] - peaks[False] == (2 * LAYERS + 1) * per_norm  # 2 per block and ln_f


def test_plan_for_h100_applies_and_trains_bitwise_on_cpu():
    model, step = _gpt()
    full = estimate(model, step, device="h100").module_info.peak_bytes
    plan = solve_sac(model, 0.8 * full / 2**30, step, options=PlanOptions(device="h100", reserve_gib=0))
    assert plan.predicted_peak_bytes <= 0.8 * full
    assert any(m.discard_ratio > 0 for m in plan.modules)
    check = check_gradients(model, plan)
    assert check.equal, check
