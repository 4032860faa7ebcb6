"""benchmarks/checkpoint_probe.py: the groups, the two ways of checkpointing them, their terms, and
one real round."""

from __future__ import annotations

import pytest

from benchmarks import checkpoint_probe as cp
from benchmarks import time_fidelity as tf
from estimators.runtime.device import get_device_spec
from estimators.tracing.estimation import estimate
from examples.gpt import GPTConfig, build_gpt
from estimators.step.train_step import TrainStep
from planner.analysis.calibration import CheckpointHostCosts, with_host_costs
from planner.options import PlanOptions


@pytest.fixture(scope="module")
def small():
    model, inputs = build_gpt(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32), batch_size=2)
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")
    costs = CheckpointHostCosts(checkpoint_call_ms=1.0, checkpoint_submodule_ms=0.01, recompute_op_ms=0.02,
                                selective_op_ms=0.005, selective_call_ms=0.3, recompute_op_warm_ms=0.01,
                                clock="thread")
    spec = with_host_costs(get_device_spec("cpu"), costs)
    est = estimate(model, step, device=spec)
    return model, step, spec, est


def test_the_groups_are_the_blocks_and_each_child_that_runs_ops(small):
    _, _, _, est = small
    groups = cp.groups_of(est.module_info)
    assert groups["blocks"] == ("GPT.blocks.0", "GPT.blocks.1")
    assert groups["blocks.*.mlp"] == ("GPT.blocks.0.mlp", "GPT.blocks.1.mlp")
    # the layer norms are leaves (no op table to re-run): not groups
    assert set(groups) == {"blocks", "blocks.*.attn", "blocks.*.mlp"}


def test_policy_is_the_full_recompute_plus_the_selective_policy(small):
    """Both re-run every op up to the stop; the selective path caching nothing adds its policy
    (forward and replay) and nothing else."""
    _, _, spec, est = small
    info = est.module_info
    fqns = cp.groups_of(info)["blocks"]
    full = cp.terms(info, cp.module_plans(fqns, "full"), spec, est.trace)
    policy = cp.terms(info, cp.module_plans(fqns, "policy"), spec, est.trace)
    assert all(not m.full and not m.saved_ops for m in cp.module_plans(fqns, "policy"))
    for k in ("kernels", "host/op", "calls"):
        assert policy[k] == pytest.approx(full[k]) and full[k] > 0
    assert full["policy"] == 0.0
    assert policy["policy"] == pytest.approx(sum(info.stats(f).selective_policy_ms for f in fqns)) and policy["policy"] > 0
    assert full["calls"] == pytest.approx(sum(info.stats(f).checkpoint_call_ms for f in fqns))


@pytest.mark.slow
def test_one_round_times_every_variant_and_reports_per_call(small, one_intra_op_thread):
    model, step, spec, est = small
    info = est.module_info
    groups = cp.groups_of(info)
    variants = cp.probe_variants(model, step, info, groups, PlanOptions(device=spec, reserve_gib=0))
    assert [v.name for v in variants] == ["no AC"] + [f"{g} {k}" for g in groups for k in cp.KINDS]
    samples = tf.time_variants(model, step, variants, rounds=1, warmup=0)
    lines = cp.report(variants, samples, info, spec, est.trace)
    assert len(lines) == 1 + 2 * len(groups)
    row = lines[1].split()
    assert row[:3] == ["blocks", "full", "2"]  # two blocks, one call each
