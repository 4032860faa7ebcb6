"""A two-block GPT traced with made-up host costs, for the benchmarks' pricing tests."""

from __future__ import annotations

import pytest

from estimators.runtime.device import get_device_spec
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import estimate
from examples.gpt import GPTConfig, build_gpt
from planner.analysis.calibration import CheckpointHostCosts, with_host_costs

HOST_COSTS = CheckpointHostCosts(checkpoint_call_ms=1.0, checkpoint_submodule_ms=0.01, recompute_op_ms=0.02,
                                 selective_op_ms=0.005, selective_call_ms=0.3, recompute_op_warm_ms=0.01,
                                 clock="thread")


@pytest.fixture(scope="module")
def small():
    """(model, step, spec, estimate): a 2-block GPT, the cpu spec with ``HOST_COSTS``."""
    model, inputs = build_gpt(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32), batch_size=2)
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")
    spec = with_host_costs(get_device_spec("cpu"), HOST_COSTS)
    return model, step, spec, estimate(model, step, device=spec)
