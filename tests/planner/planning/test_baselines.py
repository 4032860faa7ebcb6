"""planner/planning/baselines.py: hand-made policies costed by the planner's model, and the planner beating
every one of them at its own peak."""

from __future__ import annotations

import functools

import pytest

from estimators.tracing.estimation import estimate
from estimators.contract.module_info import ModOrder, ModStats, ModuleInfo, SACOp
from estimators.tracing.sac import cumulative_curve, fixed_recompute_ms, greedy_units
from examples import EXAMPLES
from planner.planning.baselines import (
    attention_core_ac,
    find_attention_cores,
    find_blocks,
    full_ac,
    hand_made_baselines,
    no_ac,
    op_sac,
    op_sac_module,
)
from planner.analysis.report import tradeoff_table_text
from planner.planning.module_plans import module_plan
from planner.planning.solve import plan_for_budget
from planner.planning.verification import traced_peak
from planner.planning.tradeoff import tradeoff_curve
from solver import SolverOptions, predict_peak_bytes
from solver.plan_cost import module_recompute_ms
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep
from tests.planner.conftest import planning

EXACT = SolverOptions(rel_gap=0.0)
"""Proven optimal: the comparison must not depend on where the backend stopped."""


@functools.lru_cache(maxsize=None)
def demo():
    model, inputs = EXAMPLES["gpt_demo"]()
    return model, inputs, planning("gpt_demo")[0]  # this step on the cpu with Adam, traced once per session


# ----------------------------------------------------------------------------- the headline
def test_planner_is_at_or_below_every_baseline_at_its_peak():
    _, _, est = demo()
    info = est.module_info
    bases = hand_made_baselines(info)
    assert [b.name for b in bases] == [
        "no AC", "full AC, every block", "full AC, every 2nd block", "full AC, every 3rd block",
        "op-level SAC (torchtitan 'op')", "attention core (Megatron)"]
    peaks = sorted({b.predicted_peak_bytes for b in bases})
    table = tradeoff_curve(info, options=PlanOptions(solver=EXACT), budgets=peaks)
    at = {r.budget_bytes: r for r in table.rows}
    for b in bases:
        r = at[b.predicted_peak_bytes]
        assert r.feasible, b.name
        assert r.predicted_peak_bytes <= b.predicted_peak_bytes, b.name
        assert r.recompute_ms <= b.recompute_ms, (b.name, r.recompute_ms, b.recompute_ms)
    # Not a tie: each checkpointing baseline is strictly beaten on this decoder.
    assert all(at[b.predicted_peak_bytes].recompute_ms < b.recompute_ms for b in bases[1:])
    text = tradeoff_table_text(table, bases)
    assert all(b.name in text for b in bases)


@pytest.mark.slow
def test_realised_plans_also_beat_the_baselines():
    """The applied plan (ratios rounded to whole ops, peak re-traced) at each baseline's traced
    peak: both sides as they run, not as the MILP prices them (it prices checkpointing the last
    block's attention core of gpt_demo below its traced peak, so a baseline's MILP figure can be
    a budget no plan with that module verifies at)."""
    model, inputs, est = demo()
    info = est.module_info
    for b in hand_made_baselines(info)[1:]:
        applied = tuple(module_plan(info.stats(f), d) for f, d in b.discarded_bytes.items())
        reached = max(traced_peak(model, applied, est))
        plan = plan_for_budget(model, est, reached, solver_options=EXACT)
        assert plan.predicted_peak_bytes <= reached, b.name
        assert plan.recompute_ms <= b.recompute_ms, (b.name, plan.recompute_ms, b.recompute_ms)


# ----------------------------------------------------------------------------- costing
def test_baselines_are_costed_by_the_exact_model():
    _, _, est = demo()
    info = est.module_info
    blocks = find_blocks(info)
    assert blocks == tuple(f"GPT.blocks.{i}" for i in range(4))
    assert no_ac(info).predicted_peak_bytes == info.peak_bytes and no_ac(info).recompute_ms == 0
    every2 = full_ac(info, every=2)
    assert every2.checkpointed == ("GPT.blocks.1", "GPT.blocks.3")  # torchtitan: 1-based multiples
    full = {f: info.stats(f).sac_memory_bytes for f in every2.checkpointed}
    assert every2.discarded_bytes == full
    assert every2.predicted_peak_bytes == predict_peak_bytes(info, full)
    assert every2.recompute_ms == sum(module_recompute_ms(info.stats(f), d) for f, d in full.items())
    assert every2.recompute_pct_of_step == 100 * every2.recompute_ms / info.step_runtime_ms
    cores = attention_core_ac(info)
    assert cores.checkpointed == find_attention_cores(info) == tuple(
        f"GPT.blocks.{i}.attn.core" for i in range(4))
    op = op_sac(info)
    for f in blocks:
        d, ms = op_sac_module(info.stats(f))
        assert op.discarded_bytes[f] == d and op.recompute_ms_by_module[f] == ms
        # Saving matmul outputs keeps something, and it costs at least the exact curve there.
        assert 0 < d < info.stats(f).sac_memory_bytes
        assert ms >= module_recompute_ms(info.stats(f), d)
    assert op.predicted_peak_bytes == predict_peak_bytes(info, dict(op.discarded_bytes))


def _op(func, mem, ms, **kw):
    # In-place ops on a saved storage count as saved, as the tracer marks them.
    saved = mem > 0 or kw.get("inplace_parent", -1) >= 0
    return SACOp(func=func, occurrence=0, runtime_ms=ms, memory_bytes=mem, is_saved=saved, **kw)


def _module(ops):
    """ModStats as estimators/tracing/aggregate.py builds them from an op table."""
    ops = tuple(ops)
    curve = cumulative_curve(greedy_units(ops))
    return ModStats(fqn="M.blk", is_leaf=False, ops=ops, recompute_fixed_ms=fixed_recompute_ms(ops),
                    tradeoff=curve, sac_memory_bytes=curve.total_bytes)


def test_op_policy_keeps_inplace_and_random_groups_together():
    ops = [
        _op("aten.addmm.default", 100, 2.0),                                   # 0 saved: matmul
        _op("aten.gelu.default", 50, 1.0),                                     # 1 recomputed
        _op("aten.add_.Tensor", 0, 0.5, inplace_parent=1),                     # 2 goes with 1
        _op("aten.mul.Tensor", 0, 0.25),                                       # 3 unsaved: fixed cost
        _op("aten.empty_like.default", 30, 0.0),                               # 4
        _op("aten.bernoulli_.float", 0, 0.75, inplace_parent=4, is_random=True),  # 5 with 4
        _op("aten.native_dropout.default", 20, 0.5, is_random=True),           # 6 random: with 5
        _op("aten._scaled_dot_product_flash_attention_for_cpu.default", 60, 4.0),  # 7 saved: SDPA
        _op("aten.view.default", 0, 0.0, is_view=True),                        # 8 a view
    ]
    s = _module(ops)
    assert s.recompute_fixed_ms == 0.25
    d, ms = op_sac_module(s)
    assert d == 50 + 30 + 20
    assert ms == 0.25 + 1.0 + 0.5 + 0.0 + 0.75 + 0.5
    # A matmul that draws random numbers pins the whole random group: all of it is saved.
    ops[6] = _op("aten.bmm.default", 20, 0.5, is_random=True)
    d, ms = op_sac_module(_module(ops))
    assert d == 50 and ms == 0.25 + 1.0 + 0.5
    # Saving nothing recomputes every unit: the module's full recompute.
    s = _module(ops)
    d, ms = op_sac_module(s, save_ops=frozenset())
    assert d == s.sac_memory_bytes and ms == module_recompute_ms(s, d)


# ----------------------------------------------------------------------------- discovery
def _tree(*fqns_leaf: tuple[str, bool]) -> ModuleInfo:
    names = tuple(f for f, _ in fqns_leaf)
    stats = tuple(ModStats(fqn=f, is_leaf=leaf) for f, leaf in fqns_leaf)
    order = ModOrder(fw_pre_order=names, fw_post_order=names[::-1], bw_pre_order=names,
                     bw_post_order=names[::-1])
    return ModuleInfo(mod_order=order, mod_stats=stats)


def test_find_blocks_picks_the_largest_sibling_group_of_non_leaves():
    info = _tree(
        ("Net", False),
        ("Net.stem.0", False), ("Net.stem.1", False),
        ("Net.layers.0", False), ("Net.layers.0.mlp.0", True), ("Net.layers.0.mlp.1", True),
        ("Net.layers.0.mlp.2", True), ("Net.layers.0.mlp.3", True),
        ("Net.layers.1", False), ("Net.layers.2", False), ("Net.layers.10", False),
    )
    # mlp.0..3 are leaves (never checkpointed); blocks sort by index, not by name.
    assert find_blocks(info) == ("Net.layers.0", "Net.layers.1", "Net.layers.2", "Net.layers.10")
    tie = _tree(("Net", False), ("Net.a.0", False), ("Net.a.0.b.0", False), ("Net.a.0.b.1", False),
                ("Net.a.1", False))
    assert find_blocks(tie) == ("Net.a.0", "Net.a.1")  # equal size: the shallower group
    with pytest.raises(ValueError, match="pass blocks="):
        find_blocks(_tree(("Net", False), ("Net.fc", True)))


def test_llama_layers_are_blocks_and_has_no_attention_core():
    model, inputs = EXAMPLES["llama_tiny"]()
    info = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn), device="cpu").module_info
    blocks = find_blocks(info)
    assert blocks and all(f.startswith("Llama.layers.") for f in blocks)
    names = [b.name for b in hand_made_baselines(info, every_k=(2,))]
    assert "attention core (Megatron)" not in names and "full AC, every 2nd block" in names
    with pytest.raises(ValueError, match="no attention core"):
        attention_core_ac(info)


def test_bad_arguments():
    _, _, est = demo()
    info = est.module_info
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        full_ac(info, every=0)
    with pytest.raises(TypeError, match="not the string"):
        full_ac(info, "GPT.blocks.0")
    with pytest.raises(ValueError, match="blocks is empty"):
        op_sac(info, [])
    with pytest.raises(KeyError, match="GPT.blocks.9"):
        full_ac(info, ["GPT.blocks.9"])
