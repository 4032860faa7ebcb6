"""benchmarks/checkpoint_probe.py: the groups, the two ways of checkpointing them, their terms tied to
the planner's price, the per-call report, and one real round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import checkpoint_probe as cp
from benchmarks import time_fidelity as tf
from estimators.runtime.device import get_device_spec
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import estimate
from examples.gpt import GPTConfig, build_gpt
from planner.analysis.calibration import CheckpointHostCosts, with_host_costs
from planner.options import PlanOptions
from planner.planning.module_plans import recompute_ms_with_saved


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


def test_the_groups_are_the_blocks_and_each_child_with_an_op_table(small):
    _, _, _, est = small
    groups, missing = cp.groups_of(est.module_info)
    assert groups["blocks"] == ("GPT.blocks.0", "GPT.blocks.1")
    assert groups["blocks.*.mlp"] == ("GPT.blocks.0.mlp", "GPT.blocks.1.mlp")
    # the layer norms are leaves (no op table to re-run): not groups
    assert set(groups) == {"blocks", "blocks.*.attn", "blocks.*.mlp"} and missing == []


def test_a_child_some_block_lacks_is_named_not_grouped():
    stats = [SimpleNamespace(fqn=f, is_leaf=False) for f in ("M.b.0", "M.b.0.attn", "M.b.0.cross", "M.b.1",
                                                             "M.b.1.attn")]
    groups, missing = cp.groups_of(SimpleNamespace(mod_stats=stats))
    assert groups == {"blocks": ("M.b.0", "M.b.1"), "blocks.*.attn": ("M.b.0.attn", "M.b.1.attn")}
    assert missing == ["cross"]


def test_full_terms_sum_to_the_planners_price_and_policy_adds_the_policy(small):
    """A plain checkpoint's terms add up to ``recompute_ms_with_saved`` with nothing saved; the
    selective path caching nothing re-runs the same ops and adds the policy, and nothing else."""
    _, _, spec, est = small
    info = est.module_info
    fqns = cp.groups_of(info)[0]["blocks"]
    full = cp.terms(info, cp.probe_plans(fqns, "full"), spec, est.trace)
    policy = cp.terms(info, cp.probe_plans(fqns, "policy"), spec, est.trace)
    planner = sum(recompute_ms_with_saved(info.stats(f), frozenset()) for f in fqns)
    assert full["kernels"] + full["host/op"] + full["calls"] == pytest.approx(planner) and planner > 0
    assert full["policy"] == 0.0 and full["policy ops"] == 0
    for k in ("kernels", "host/op", "calls"):
        assert policy[k] == pytest.approx(full[k])
    # the spec's policy costs: 5 us an op the policy sees, 0.3 ms a selective call
    assert policy["policy"] == pytest.approx(0.005 * policy["policy ops"] + 0.3 * len(fqns))
    assert all(not m.full and not m.saved_ops and m.discard_ratio == 1.0 for m in cp.probe_plans(fqns, "policy"))


def test_the_report_is_per_call_over_every_call_of_the_group():
    """Two modules, one called twice: the round's overheads over three calls, the terms too."""
    table = {"M.a": SimpleNamespace(n_calls=1, selective_policy_ms=0.0, checkpoint_call_ms=1.0, ops=()),
             "M.b": SimpleNamespace(n_calls=2, selective_policy_ms=0.0, checkpoint_call_ms=2.0, ops=())}
    info = SimpleNamespace(stats=table.__getitem__)
    plan = SimpleNamespace(modules=cp.probe_plans(("M.a", "M.b"), "full"))
    variants = [SimpleNamespace(name="no AC", plan=None), SimpleNamespace(name="g full", plan=plan)]
    samples = {"no AC": [tf.Sample(wall_ms=0, cpu_ms=c) for c in (100, 110, 100)],
               "g full": [tf.Sample(wall_ms=0, cpu_ms=c) for c in (106, 119, 112)]}
    (header, row) = cp.report(variants, samples, info, SimpleNamespace(recompute_op_ms=0.0), None)
    cols = row.split()
    assert cols[:4] == ["g", "full", "3", "+3.00"]  # median of 6 / 9 / 12 ms over 3 calls
    assert cols[7] == "1.00"  # host priced: 3 ms of calls over 3 calls


def test_a_shorter_sequence_cuts_the_token_inputs_and_nothing_else(small):
    model, step, _, _ = small
    short = cp.shortened(step, 8)
    (ids,) = short.inputs
    assert ids.shape == (2, 8) and ids.equal(step.inputs[0][:, :8])
    assert short.loss_fn is step.loss_fn and step.inputs[0].shape == (2, 16)  # the original is kept
    model.loss_fn(model(*short.inputs), short.inputs).backward()  # the model runs at that length
    with pytest.raises(ValueError, match="longer than"):
        cp.shortened(step, 17)
    images = TrainStep(inputs=(torch.rand(2, 3, 8, 8),), loss_fn=lambda out, inputs: out.sum(), optimizer="adamw")
    with pytest.raises(ValueError, match="token inputs"):
        cp.shortened(images, 4)


@pytest.mark.slow
def test_one_round_times_every_variant_and_reports_per_call(small, one_intra_op_thread):
    model, step, spec, est = small
    info = est.module_info
    groups, _ = cp.groups_of(info)
    variants = cp.probe_variants(model, est, groups, PlanOptions(device=spec, reserve_gib=0))
    assert [v.name for v in variants] == ["no AC"] + [f"{g} {k}" for g in groups for k in cp.KINDS]
    assert variants[0].plan.modules == ()  # the unplanned step applies the empty plan
    samples = tf.time_variants(model, step, variants, rounds=1, warmup=0)
    lines = cp.report(variants, samples, info, spec, est.trace)
    assert len(lines) == 1 + 2 * len(groups)
    assert lines[1].split()[:3] == ["blocks", "full", "2"]  # two blocks, one call each
