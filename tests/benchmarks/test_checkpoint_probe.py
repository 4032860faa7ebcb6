"""benchmarks/checkpoint_probe.py: the per-call report, the shortened inputs, and one real round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import checkpoint_probe as cp
from benchmarks import time_fidelity as tf
from estimators.step.train_step import TrainStep
from planner.options import PlanOptions


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


def test_the_cross_check_prices_the_blocks_with_the_factor_fitted_on_their_children(small):
    """Steps made up at 1.5x the plain host and 2x the policy of every group: the factor fitted on
    the children prices the blocks' rows at what they measured."""
    model, _, spec, est = small
    info = est.module_info
    groups, _ = cp.groups_of(info)
    variants = cp.probe_variants(model, est, groups, PlanOptions(device=spec, reserve_gib=0))
    samples = {"no AC": [tf.Sample(wall_ms=0, cpu_ms=c) for c in (100.0, 103.0, 98.0)]}
    for v in variants[1:]:
        t = cp.terms(info, v.plan.modules, spec, est.trace)
        over = t["kernels"] + 1.5 * (t["calls"] + t["host/op"]) + 2.0 * t["policy"]
        samples[v.name] = [tf.Sample(wall_ms=0, cpu_ms=s.cpu_ms + over) for s in samples["no AC"]]
    head, *rows = cp.cross_check(variants, samples, info, spec, est.trace)
    assert "plain x1.50, policy x2.00" in head and [r.split()[:2] for r in rows] == [["blocks", "full"],
                                                                                     ["blocks", "policy"]]
    for r in rows:
        cols = r.replace(",", "").split()
        assert cols[3] == cols[5] and cols[3] != cols[7]  # measured == scaled, not the chains' price
