"""benchmarks/step_host.py: the groups, the two ways of checkpointing them, their terms tied to the
planner's price, and the cold factor fitted from what a step measured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import step_host as sh
from planner.planning.module_plans import recompute_ms_with_saved


def test_the_groups_are_the_blocks_and_each_child_with_an_op_table(small):
    _, _, _, est = small
    groups, missing = sh.groups_of(est.module_info)
    assert groups["blocks"] == ("GPT.blocks.0", "GPT.blocks.1")
    assert groups["blocks.*.mlp"] == ("GPT.blocks.0.mlp", "GPT.blocks.1.mlp")
    # the layer norms are leaves (no op table to re-run): not groups
    assert set(groups) == {"blocks", "blocks.*.attn", "blocks.*.mlp"} and missing == []


def test_a_child_some_block_lacks_is_named_not_grouped():
    stats = [SimpleNamespace(fqn=f, is_leaf=False) for f in ("M.b.0", "M.b.0.attn", "M.b.0.cross", "M.b.1",
                                                             "M.b.1.attn")]
    groups, missing = sh.groups_of(SimpleNamespace(mod_stats=stats))
    assert groups == {"blocks": ("M.b.0", "M.b.1"), "blocks.*.attn": ("M.b.0.attn", "M.b.1.attn")}
    assert missing == ["cross"]


def test_full_terms_sum_to_the_planners_price_and_policy_adds_the_policy(small):
    """A plain checkpoint's terms add up to ``recompute_ms_with_saved`` with nothing saved; the
    selective path caching nothing re-runs the same ops and adds the policy, and nothing else."""
    _, _, spec, est = small
    info = est.module_info
    fqns = sh.groups_of(info)[0]["blocks"]
    full = sh.terms(info, sh.probe_plans(fqns, "full"), spec, est.trace)
    policy = sh.terms(info, sh.probe_plans(fqns, "policy"), spec, est.trace)
    planner = sum(recompute_ms_with_saved(info.stats(f), frozenset()) for f in fqns)
    assert full["kernels"] + full["host/op"] + full["calls"] == pytest.approx(planner) and planner > 0
    assert full["policy"] == 0.0 and full["policy ops"] == 0
    for k in ("kernels", "host/op", "calls"):
        assert policy[k] == pytest.approx(full[k])
    # the spec's policy costs: 5 us an op the policy sees, 0.3 ms a selective call
    assert policy["policy"] == pytest.approx(0.005 * policy["policy ops"] + 0.3 * len(fqns))
    assert all(not m.full and not m.saved_ops and m.discard_ratio == 1.0 for m in sh.probe_plans(fqns, "policy"))


def test_the_host_groups_are_the_blocks_children_not_the_blocks(small):
    _, _, _, est = small
    assert sh.host_groups(est.module_info) == {"blocks.*.attn": ("GPT.blocks.0.attn", "GPT.blocks.1.attn"),
                                               "blocks.*.mlp": ("GPT.blocks.0.mlp", "GPT.blocks.1.mlp")}


def _terms(kernels, calls, per_op, policy=0.0):
    return {"kernels": kernels, "calls": calls, "host/op": per_op, "policy": policy}


def test_the_scales_recover_the_factors_a_step_measured_at():
    """Two groups measured at 1.5x their priced plain host and 2x their priced policy: the fit
    gives those factors, whatever the kernels."""
    measured = [("full", 10.0 + 1.5 * (1.0 + 0.6), _terms(10.0, 1.0, 0.6)),
                ("full", 4.0 + 1.5 * (2.0 + 0.2), _terms(4.0, 2.0, 0.2)),
                ("policy", 10.0 + 1.5 * 1.6 + 2.0 * 0.9, _terms(10.0, 1.0, 0.6, 0.9)),
                ("policy", 4.0 + 1.5 * 2.2 + 2.0 * 0.4, _terms(4.0, 2.0, 0.2, 0.4))]
    scales = sh.fit_host_scales(measured)
    assert scales.plain == pytest.approx(1.5) and scales.policy == pytest.approx(2.0)


def test_the_scales_are_never_negative_and_one_where_nothing_was_priced():
    # a step measured below its kernels: no host at all, not a negative one
    assert sh.fit_host_scales([("full", 3.0, _terms(5.0, 1.0, 0.5))]).plain == 0.0
    assert sh.fit_host_scales([]) == sh.HostScales(plain=1.0, policy=1.0)
    # only plain checkpoints timed: the policy's factor stays 1
    assert sh.fit_host_scales([("full", 6.0, _terms(5.0, 1.0, 0.0))]) == sh.HostScales(plain=1.0, policy=1.0)
