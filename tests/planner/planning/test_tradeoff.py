"""planner/planning/tradeoff.py: the budget sweep, its Pareto marking, infeasible points and bad input."""

from __future__ import annotations

import copy
import functools
import importlib
import math

import pytest
import torch

from estimators.tracing.estimation import estimate
from estimators.step.train_step import TrainStep
from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, TradeoffCurve
from examples import EXAMPLES
from planner.analysis.report import tradeoff_table_text
from planner.planning.tradeoff import (
    PointStatus,
    TradeoffPoint,
    TradeoffTable,
    default_budgets,
    mark_pareto,
    pareto_mask,
    tradeoff_curve,
)
from solver import SACMilp, predict_peak_bytes
from solver.plan_cost import module_recompute_ms
from planner.options import PlanOptions
from tests.planner.conftest import planning

MiB = 2**20


@functools.lru_cache(maxsize=None)
def demo_estimate():
    return planning("gpt_demo")[0]  # gpt_demo's step on the cpu with Adam, traced once per session


def _two_module_info() -> ModuleInfo:
    """Root R with children A and B, each discarding up to 100 bytes at cost 1 ms / 2 ms.

    Memory points: 1000 bytes at t=5, where both discards count, and 900 at t=11, after B's
    backward began (its activations are back), so only A's discard counts there."""
    def child(fqn, ms, fw_pre, fw_post, bw_pre, bw_post):
        curve = TradeoffCurve(discarded_bytes=(0, 100), recompute_ms=(0.0, ms))
        return ModStats(fqn=fqn, is_leaf=False, sac_memory_bytes=100, sac_runtime_ms=ms,
                        tradeoff=curve, fw_pre_op=fw_pre, fw_post_op=fw_post, bw_pre_op=bw_pre,
                        bw_post_op=bw_post)

    stats = (
        ModStats(fqn="R", is_leaf=False, fw_pre_op=0, fw_post_op=4, bw_pre_op=10, bw_post_op=20),
        child("R.a", 1.0, 0, 2, 12, 13),
        child("R.b", 2.0, 2, 4, 10, 11),
    )
    order = ModOrder(fw_pre_order=("R", "R.a", "R.b"), fw_post_order=("R.a", "R.b", "R"),
                     bw_pre_order=("R", "R.b", "R.a"), bw_post_order=("R.b", "R.a", "R"))
    points = (MemoryPoint(op_index=5, phase="fw", other_bytes=1000),
              MemoryPoint(op_index=11, phase="bw", other_bytes=900))
    return ModuleInfo(mod_order=order, mod_stats=stats, memory_points=points, peak_bytes=1000,
                      fw_runtime_ms=4.0, bw_runtime_ms=6.0)


# ----------------------------------------------------------------------------- exact small case
def test_hand_built_sweep_has_exact_rows():
    info = _two_module_info()
    table = tradeoff_curve(info, budgets=[799, 800, 850, 900, 950, 1000, 1200])
    assert table.no_ac_peak_bytes == 1000 and table.min_reachable_peak_bytes == 800
    assert table.step_ms == 10.0
    got = [(r.budget_bytes, r.status.value, r.predicted_peak_bytes, r.recompute_ms) for r in table.rows]
    # A (1 ms / 100 B) is discarded first, then B (2 ms / 100 B); the peak is max(1000 - dA - dB, 900 - dA).
    assert got == [
        (799, "infeasible", None, None),
        (800, "optimal", 800, 3.0),
        (850, "optimal", 850, 2.0),
        (900, "optimal", 900, 1.0),
        (950, "optimal", 950, 0.5),
        (1000, "optimal", 1000, 0.0),
        (1200, "optimal", 1000, 0.0),
    ]
    assert table.rows[1].checkpointed == ("R.a", "R.b") and table.rows[3].checkpointed == ("R.a",)
    assert table.rows[2].recompute_pct_of_step == 20.0
    # 1200 reaches the same plan as 1000: equal points do not dominate each other.
    assert [r.on_pareto for r in table.rows] == [False, True, True, True, True, True, True]


def test_default_budgets_span_min_reachable_to_no_ac_peak():
    table = tradeoff_curve(_two_module_info(), n_points=5)
    assert [r.budget_bytes for r in table.rows] == [800, 850, 900, 950, 1000]
    assert all(r.status is PointStatus.OPTIMAL for r in table.rows)
    assert default_budgets(0, 10, 3) == [0, 5, 10]
    assert default_budgets(7, 7, 20) == [7]


# ----------------------------------------------------------------------------- Pareto marking
def _row(peak, ms, status=PointStatus.OPTIMAL):
    ok = status in (PointStatus.OPTIMAL, PointStatus.FEASIBLE)
    return TradeoffPoint(budget_bytes=peak, status=status, predicted_peak_bytes=peak if ok else None,
                         recompute_ms=ms if ok else None)


def test_pareto_marking_on_a_hand_built_table():
    rows = [
        _row(100, 9.0),                          # frontier: least memory
        _row(120, 9.0),                          # dominated by (100, 9): more memory, same time
        _row(130, 5.0),                          # frontier
        _row(130, 5.0),                          # equal to the previous: both stay
        _row(140, 6.0),                          # dominated by (130, 5)
        _row(150, 0.0),                          # frontier: no recompute
        _row(160, 0.0, PointStatus.FEASIBLE),    # dominated by (150, 0) even though feasible
        _row(90, 0.0, PointStatus.INFEASIBLE),   # no plan: never on the frontier
        _row(95, 0.0, PointStatus.TIMEOUT),
    ]
    marked = mark_pareto(rows)
    assert [r.on_pareto for r in marked] == [True, False, True, True, False, True, False, False, False]
    table = TradeoffTable(rows=marked, step_ms=10.0, no_ac_peak_bytes=150,
                          min_reachable_peak_bytes=100, world_size=1)
    assert [(r.predicted_peak_bytes, r.recompute_ms) for r in table.pareto] == [
        (100, 9.0), (130, 5.0), (130, 5.0), (150, 0.0)]
    assert table.cheapest_under(135) == marked[2]
    assert table.cheapest_under(99) is None
    assert pareto_mask([]) == []


def test_sweep_rows_on_pareto_are_monotone():
    table = tradeoff_curve(demo_estimate(), n_points=8)
    front = table.pareto
    assert len(front) >= 2
    assert all(a.predicted_peak_bytes < b.predicted_peak_bytes and a.recompute_ms > b.recompute_ms
               for a, b in zip(front, front[1:]))


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_rows_are_costed_by_the_exact_model():
    est = demo_estimate()
    info = est.module_info
    table = tradeoff_curve(est, n_points=6)
    milp = SACMilp(info)
    assert table.no_ac_peak_bytes == info.peak_bytes
    assert table.min_reachable_peak_bytes == milp.min_reachable_peak_bytes()
    assert [r.budget_bytes for r in table.rows][0] == table.min_reachable_peak_bytes
    assert [r.budget_bytes for r in table.rows][-1] == table.no_ac_peak_bytes
    for r in table.rows:
        assert r.feasible and r.predicted_peak_bytes <= r.budget_bytes
        res = milp.solve(r.budget_bytes)  # same plan from an independently built model
        assert r.checkpointed == res.checkpointed
        assert r.predicted_peak_bytes == predict_peak_bytes(info, res.discarded_bytes)
        expect_ms = sum(module_recompute_ms(info.stats(f), d) for f, d in res.discarded_bytes.items())
        assert r.recompute_ms == expect_ms
        assert r.recompute_pct_of_step == 100 * r.recompute_ms / info.step_runtime_ms


def test_infeasible_budgets_are_reported_and_the_sweep_goes_on():
    info = demo_estimate().module_info
    low = SACMilp(info).min_reachable_peak_bytes()
    budgets = [low // 4, low // 2, low - 1, low, (low + info.peak_bytes) // 2]
    table = tradeoff_curve(info, budgets=budgets)
    assert [r.status.value for r in table.rows[:3]] == ["infeasible"] * 3
    assert all(not r.feasible and r.predicted_peak_bytes is None and not r.on_pareto
               for r in table.rows[:3])
    assert all(r.feasible for r in table.rows[3:])
    assert table.rows[3].predicted_peak_bytes == low
    text = tradeoff_table_text(table)
    assert text.count("infeasible") == 3 and "*" in text


@pytest.mark.slow
def test_model_input_is_traced_once_and_matches_the_estimate(monkeypatch):
    est_mod = importlib.import_module("planner.planning.tradeoff")
    calls = []
    real = est_mod.estimate
    monkeypatch.setattr(est_mod, "estimate", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, inputs = EXAMPLES["gpt_small"]()
    table = tradeoff_curve(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), n_points=3)
    assert len(calls) == 1
    est = real(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="cpu")
    assert table.no_ac_peak_bytes == est.module_info.peak_bytes
    assert table.min_reachable_peak_bytes < table.no_ac_peak_bytes
    assert len(table.rows) == 3 and all(r.feasible for r in table.rows)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "budgets, match",
    [
        ([], "budgets is empty"),
        ([3 * MiB, 2 * MiB], "ascending order"),
        ([2 * MiB, 2 * MiB], "distinct"),
        ([math.nan], "positive, finite"),
        ([-1], "positive, finite"),
        ([0], "positive, finite"),
        ([math.inf], "positive, finite"),
        ([True], "positive, finite"),
        (["1GiB"], "positive, finite"),
        ("1000", "list of byte counts"),
    ],
)
def test_bad_budgets_raise_before_any_work(budgets, match):
    with pytest.raises(ValueError, match=match):
        tradeoff_curve(_two_module_info(), budgets=budgets)


def test_bad_n_points_and_input_type():
    with pytest.raises(ValueError, match="n_points"):
        tradeoff_curve(_two_module_info(), n_points=1)
    with pytest.raises(TypeError, match="torch.nn.Module, an estimators Estimate or a ModuleInfo"):
        tradeoff_curve({"not": "a model"})


def test_extra_budgets_are_merged_into_the_grid():
    info = _two_module_info()
    table = tradeoff_curve(info, n_points=3, extra_budgets=[975, 900.7, 975])
    assert [r.budget_bytes for r in table.rows] == [800, 900, 975, 1000]
    table = tradeoff_curve(info, extra_budgets=[700], budgets=[850])
    assert [(r.budget_bytes, r.status.value) for r in table.rows] == [(700, "infeasible"), (850, "optimal")]
    with pytest.raises(ValueError, match="positive, finite"):
        tradeoff_curve(info, extra_budgets=[math.nan])


# ----------------------------------------------------------------------------- plotting
@pytest.mark.slow
def test_plot_draws_curve_and_baselines_and_writes_only_when_asked(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib: pip install sac-planner[plot]")
    from planner.planning.baselines import hand_made_baselines
    from planner.analysis.plotting import plot_tradeoff

    monkeypatch.chdir(tmp_path)
    info = demo_estimate().module_info
    bases = hand_made_baselines(info)
    table = tradeoff_curve(info, n_points=4, extra_budgets=[info.peak_bytes // 10])  # one infeasible
    fig = plot_tradeoff(table, bases)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "predicted peak memory per rank (MiB)"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert all(b.name in labels for b in bases) and "SAC planner (MILP)" in labels
    curve = next(line for line in ax.get_lines() if line.get_label() == "SAC planner (MILP)")
    assert list(curve.get_ydata()) == sorted((r.recompute_ms for r in table.feasible_rows), reverse=True)
    assert "1 budget(s) infeasible" in ax.get_title()
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "figs" / "curve.png"
    plot_tradeoff(table, bases, save_path=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    import sys

    from planner.analysis.plotting import plot_tradeoff

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    table = tradeoff_curve(_two_module_info(), n_points=2)
    with pytest.raises(ImportError, match=r"pip install sac-planner\[plot\]"):
        plot_tradeoff(table)


def test_sweep_reuse_matches_independent_solves() -> None:
    """Budgets are solved largest first and a plan that fits the next budget is reused there:
    every row still has the least recompute an independent solve finds at its budget."""
    from solver import solve_milp
    from tests.solver.builders import MiB, chain

    info = chain()
    budgets = [b * MiB for b in (250, 275, 300, 350, 400, 425, 449)]
    table = tradeoff_curve(info, budgets=budgets)
    for row in table.rows:
        alone = solve_milp(info, row.budget_bytes)
        assert row.recompute_ms == pytest.approx(alone.recompute_ms, rel=1e-4, abs=1e-9)
        assert row.predicted_peak_bytes <= row.budget_bytes


def test_budgets_given_in_gib_are_refused_with_the_conversion():
    """A user passing GiB ([4.0, 5.0]) to the byte-valued sweep got all-infeasible rows."""
    est = demo_estimate()
    with pytest.raises(ValueError, match=r"bytes per rank, not GiB"):
        tradeoff_curve(est, budgets=[4.0, 5.0])
    # Under a byte each: floored to 0 they were refused as "not in ascending order".
    with pytest.raises(ValueError, match=r"0.0007 is under one byte: budgets are bytes per rank, not GiB"):
        tradeoff_curve(_two_module_info(), budgets=[0.0007, 0.0009])


def test_estimate_options_trace_the_model_as_asked():
    """A model whose fake trace is refused (an LSTM) had to be traced by hand before the sweep."""
    import torch

    from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode
    from tests.estimators.tracing.test_estimation import _LSTMNet

    torch.manual_seed(0)
    model, x = _LSTMNet(), torch.randn(4, 12, 8)
    with pytest.raises(TraceError, match="TraceMode.REAL"):
        tradeoff_curve(model, TrainStep(inputs=(x,)), n_points=2)
    real = EstimateOptions(mode=TraceMode.REAL)
    table = tradeoff_curve(model, TrainStep(inputs=(x,)), options=PlanOptions(trace=real), n_points=2)
    traced = estimate(model, TrainStep(inputs=(x,)), options=real)
    assert table.no_ac_peak_bytes == traced.steady_peak_bytes
    with pytest.raises(ValueError, match="leave trace out"):
        tradeoff_curve(traced, options=PlanOptions(trace=real))


class _InputMutatingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def forward(self, x):
        x.mul_(1.0)  # in place on the block's input: a recompute would do it again
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_the_curve_leaves_out_the_modules_solve_sac_refuses_to_checkpoint():
    # The curve's floor checkpointed two such blocks; solve_sac at its own middle budget refused
    # (smallest reachable = the no-AC peak), naming them unsafe.
    from planner import PlanningError, solve_sac

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), _InputMutatingBlock(), _InputMutatingBlock(),
                                torch.nn.Linear(32, 3))
    step = TrainStep(inputs=torch.randn(2, 32, 8), optimizer="adamw")
    table = tradeoff_curve(model, step, n_points=3)
    assert all(not row.checkpointed for row in table.rows)
    assert table.min_reachable_peak_bytes == table.no_ac_peak_bytes
    with pytest.raises(PlanningError, match="left out as unsafe|Left out as unsafe"):
        solve_sac(model, (table.no_ac_peak_bytes - 1024) / 2**30, step)


@pytest.mark.slow
def test_a_module_called_twice_gets_the_traced_floor_solve_sac_reaches():
    """A block applied twice: the MILP prices it with one window, so its floor (3,101,632 B) sat
    above what ``solve_sac`` reaches with the block fully checkpointed (2,578,368 B, measured).
    The table states the reachable floor, fills the budgets under the MILP's floor with that
    traced plan, and says why; given a ModuleInfo alone it says the floor is the MILP's."""
    from planner import apply_plan, solve_sac
    from planner.analysis.measure import measure_steps
    from tests.planner.planning.test_solve import _SharedBlockNet

    torch.manual_seed(0)
    model, x = _SharedBlockNet(), torch.randn(256, 64)
    step = TrainStep(inputs=(x,), optimizer="adamw")
    table = tradeoff_curve(model, step, n_points=4)
    assert table.min_reachable_peak_bytes == 2_578_368
    floor_row = table.rows[0]
    assert floor_row.status is PointStatus.FEASIBLE and floor_row.predicted_peak_bytes == 2_578_368
    assert "_SharedBlockNet.shared" in floor_row.checkpointed
    milp_floor = SACMilp(estimate(model, step, device="cpu").module_info).min_reachable_peak_bytes()
    assert milp_floor > 2_578_368
    assert all(r.feasible and r.predicted_peak_bytes <= r.budget_bytes for r in table.rows)
    assert any("_SharedBlockNet.shared (2 calls)" in n and f"{milp_floor:,} B" in n for n in table.notes)
    plan = solve_sac(model, options=PlanOptions(reserve_gib=0), budget_gib=table.min_reachable_peak_bytes / 2**30, step=step)
    assert plan.predicted_peak_bytes == table.min_reachable_peak_bytes
    mine = copy.deepcopy(model)
    with apply_plan(mine, plan):
        steps = measure_steps(mine, step, torch.optim.AdamW(mine.parameters()), n_steps=3)
    assert [s.peak_bytes for s in steps[1:]] == [table.min_reachable_peak_bytes] * 2
    untraced = tradeoff_curve(estimate(model, step, device="cpu").module_info, n_points=2)
    assert untraced.min_reachable_peak_bytes == milp_floor
    assert any("states the MILP's floor" in n for n in untraced.notes)


def test_a_step_no_plan_can_lower_says_why():
    """A ReLU chain with AdamW peaks in its optimizer step, where no activation is alive: the
    floor is the no-AC peak, and the table's notes say where it peaks and what it holds."""
    from planner.planning.tradeoff import tradeoff_curve

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    table = tradeoff_curve(model, TrainStep(inputs=(torch.randn(2, 16),), optimizer="adamw"), n_points=2)
    assert table.min_reachable_peak_bytes == table.no_ac_peak_bytes
    (note,) = [n for n in table.notes if n.startswith("no plan lowers the peak")]
    assert "optimizer state" in note and "at its peak" in note


@pytest.mark.slow
def test_the_sweep_plans_per_rank_with_the_options_fsdp_units_and_precision():
    """As solve_sac does: FSDP2's gathered parameters and buffers in the policy's dtypes, per rank
    (the sweep ignored fsdp_units: its no-AC peak and floor were those of ZeRO-style sharding)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from planner.distributed.fsdp import FsdpPrecision, fsdp_module_info

    est = demo_estimate()
    units = ["GPT", *(s.fqn for s in est.module_info.mod_stats if s.fqn.count(".") == 2 and ".blocks." in s.fqn)]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mp in (None, policy):
        options = PlanOptions(world_size=4, fsdp_units=units, fsdp_mp_policy=mp)
        table = tradeoff_curve(est, options=options, n_points=3)
        info = fsdp_module_info(est.module_info, units, 4, mp_policy=mp and FsdpPrecision(torch.bfloat16, torch.float32))
        milp = SACMilp(info, world_size=4, fsdp_units=units)
        assert (table.no_ac_peak_bytes, table.min_reachable_peak_bytes) == (milp.no_ac_peak_bytes,
                                                                            milp.min_reachable_peak_bytes())
    zero = tradeoff_curve(est, options=PlanOptions(world_size=4), n_points=3)
    assert table.no_ac_peak_bytes > zero.no_ac_peak_bytes  # FSDP2's buffers are in it


@pytest.mark.slow
def test_plot_labels_coinciding_policies_once_and_marks_the_budget():
    """Two policies at one point (every 2nd and every 3rd block of a 2-block model) printed their
    names over each other, and the user's budget was not on the plot."""
    import dataclasses

    pytest.importorskip("matplotlib", reason="plotting needs matplotlib: pip install sac-planner[plot]")
    from planner.analysis.plotting import plot_tradeoff
    from planner.planning.baselines import hand_made_baselines

    info = demo_estimate().module_info
    bases = hand_made_baselines(info)
    twin = dataclasses.replace(bases[2], name="twin of " + bases[2].name)
    table = tradeoff_curve(info, n_points=3)
    budget = int(0.6 * table.no_ac_peak_bytes)
    ax = plot_tradeoff(table, [*bases, twin], budget_bytes=budget).axes[0]
    notes = {t.xy: t.get_text() for t in ax.texts}
    assert len(notes) == len(ax.texts) == len(bases)  # one label per point
    assert notes[(bases[2].predicted_peak_bytes / 2**20, bases[2].recompute_ms)] == f"{bases[2].name} = {twin.name}"
    line = next(line for line in ax.get_lines() if line.get_label().startswith("your budget"))
    assert list(line.get_xdata()) == [budget / 2**20] * 2
    assert f"your budget ({budget / 2**20:.2f} MiB)" in [t.get_text() for t in ax.get_legend().get_texts()]
