"""solver/sac_milp.py on hand-built ModuleInfos whose optimal plans are worked out by hand.

Op indices: forward posts at 10, 20, ...; backward starts later in reverse order. Each docstring
shows the arithmetic behind the expected plan (MiB = 2**20 bytes).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from estimators.contract.module_info import MemoryPoint, ModStats, TradeoffCurve
from solver import (
    Backend,
    InfeasibleBudgetError,
    SACMilp,
    SolverOptions,
    SolveStatus,
    min_reachable_peak_bytes,
    predict_peak_bytes,
    solve_milp,
)
from solver.errors import BackendUnavailableError, UnknownModuleError
from solver.options import backend_available
from tests.solver.builders import MiB, chain, make_info, mod, nested, pt

def assert_plan(res, expected: dict[str, float]) -> None:
    assert res.checkpointed == tuple(expected)
    for fqn, r in expected.items():
        assert res.decisions[fqn] == pytest.approx(r, abs=1e-6), fqn


# ----------------------------------------------------------------------------- known optima
def test_chain_budget_binds_exactly() -> None:
    """t=40 must drop 50 MiB; only b0 and b1 cover it; b0 is cheaper per byte: r=0.5, 5 ms."""
    res = solve_milp(chain(), 400 * MiB)
    assert_plan(res, {"M.b0": 0.5})
    assert res.predicted_peak_bytes == 400 * MiB
    assert res.recompute_ms == pytest.approx(5.0)
    assert res.status is SolveStatus.OPTIMAL
    assert res.discarded_bytes == {"M.b0": 50 * MiB}


def test_chain_tight_budget_uses_two_modules() -> None:
    """t=40 must drop 150 MiB: all of b0 (10 ms) then half of b1 (10 ms)."""
    res = solve_milp(chain(), 300 * MiB)
    assert_plan(res, {"M.b0": 1.0, "M.b1": 0.5})
    assert res.recompute_ms == pytest.approx(20.0)
    assert res.predicted_peak_bytes == 300 * MiB


@pytest.mark.parametrize("budget_mib", [450, 451, 10_000])
def test_slack_budget_checkpoints_nothing(budget_mib: int) -> None:
    res = solve_milp(chain(), budget_mib * MiB)
    assert res.checkpointed == () and res.decisions == {}
    assert res.predicted_peak_bytes == res.no_ac_peak_bytes == 450 * MiB
    assert res.recompute_ms == 0.0


def test_infeasible_budget_states_smallest_reachable() -> None:
    """Best case: t=40, 50 and 60 all bottom out at 250 MiB."""
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_milp(chain(), 249 * MiB)
    assert e.value.min_reachable_peak_bytes == 250 * MiB
    assert "262,144,000 bytes" in str(e.value) and "0.24 GiB" in str(e.value)
    assert min_reachable_peak_bytes(chain()) == 250 * MiB
    res = solve_milp(chain(), 250 * MiB)  # the stated budget is reachable
    assert res.predicted_peak_bytes == 250 * MiB
    assert_plan(res, {"M.b0": 1.0, "M.b1": 1.0})


def test_one_byte_below_smallest_reachable_is_infeasible() -> None:
    with pytest.raises(InfeasibleBudgetError):
        solve_milp(chain(), 250 * MiB - 1)


def test_parent_chosen_when_forward_binds() -> None:
    """Only t=25 binds (350 -> 200 MiB): B covers it at 0.06 ms/MiB, cheaper than its children
    (mlp 0.08, attn 0.1); its recompute at t=30 brings memory back to exactly 200."""
    res = solve_milp(nested(backward_binds=False), 200 * MiB)
    assert_plan(res, {"M.B": 0.75})
    assert res.recompute_ms == pytest.approx(9.0)


def test_child_chosen_when_backward_binds() -> None:
    """t=31 (210 MiB) is only covered by attn; B's window ends at 30. Drop 30 MiB of attn."""
    res = solve_milp(nested(backward_binds=True), 180 * MiB)
    assert_plan(res, {"M.B.attn": 0.3})
    assert res.recompute_ms == pytest.approx(3.0)


def test_fsdp_unit_blocks_its_ancestors() -> None:
    """B may not wrap the FSDP unit attn: mlp (0.08 ms/MiB) fully, then half of attn."""
    res = solve_milp(nested(backward_binds=False), 200 * MiB, fsdp_units=["M.B.attn"])
    assert_plan(res, {"M.B.attn": 0.5, "M.B.mlp": 1.0})
    assert res.recompute_ms == pytest.approx(13.0)


def test_ac_units_restrict_candidates() -> None:
    res = solve_milp(chain(), 400 * MiB, ac_units=["M.b1"])
    assert_plan(res, {"M.b1": 0.5})
    assert res.recompute_ms == pytest.approx(10.0)


def test_world_size_shards_params_grads_optimizer() -> None:
    """(400 + 400 + 800) / 4 + 400 act = 800 MiB; 700 MiB needs 100 MiB of the 400 discardable."""
    stats = [mod("M"), mod("M.b", size_mib=400, ms=4, fw_post=10, bw_pre=30), mod("M.b.fc", leaf=True)]
    info = make_info(stats, [pt(20, 400, param_mib=400, grad_mib=400, opt_mib=800)])
    res = solve_milp(info, 700 * MiB, world_size=4)
    assert_plan(res, {"M.b": 0.25})
    assert res.no_ac_peak_bytes == 800 * MiB and res.predicted_peak_bytes == 700 * MiB
    assert res.world_size == 4
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_milp(info, 700 * MiB, world_size=1)
    assert e.value.min_reachable_peak_bytes == 1600 * MiB


def test_world_size_rounds_shards_up() -> None:
    info = make_info([mod("M")], [MemoryPoint(op_index=0, phase="fw", param_bytes=3, grad_bytes=2)])
    assert predict_peak_bytes(info, {}, world_size=2) == 3


def test_recompute_transient_counts_at_backward_start() -> None:
    """b0 is cheaper (0.05 vs 0.1 ms/MiB) but its recompute needs 80 MiB at t=40 (350 MiB).

    Budget 420 MiB, t=25 must drop 40 MiB: b0 would push t=40 to 430 -> use b1 (r=0.4, 4 ms).
    Budget 440 MiB leaves room for the transient: b0 (r=0.2, 1 ms)."""
    stats = [mod("M"), mod("M.b0", size_mib=100, ms=5, fw_post=10, bw_pre=40, transient_mib=80),
             mod("M.b1", size_mib=100, ms=10, fw_post=20, bw_pre=30)]
    info = make_info(stats, [pt(25, 460), pt(30, 300, rec="M.b1"), pt(40, 350, rec="M.b0")])
    res = solve_milp(info, 420 * MiB)
    assert_plan(res, {"M.b1": 0.4})
    assert res.recompute_ms == pytest.approx(4.0)
    res = solve_milp(info, 440 * MiB)
    assert_plan(res, {"M.b0": 0.2})
    assert res.predicted_peak_bytes == 440 * MiB


def test_piecewise_curve_is_exact_between_breakpoints() -> None:
    """Curve (0,0) (50 MiB, 1 ms) (100 MiB, 11 ms): dropping 60 MiB costs 1 + 10 * 10/50 = 3 ms."""
    stats = [mod("M"), mod("M.b", size_mib=100, fw_post=10, bw_pre=30,
                           curve=((0, 0.0), (50, 1.0), (100, 11.0)))]
    res = solve_milp(make_info(stats, [pt(20, 200)]), 140 * MiB)
    assert_plan(res, {"M.b": 0.6})
    assert res.recompute_ms == pytest.approx(3.0)


def test_forced_recompute_jump_is_paid_once_checkpointed() -> None:
    """b0: 2 ms of zero-byte ops first, then 1 ms per 100 MiB; b1: 4 ms per 100 MiB.
    Dropping 10 MiB: b0 costs 2.1 ms, b1 0.4 ms -> b1."""
    stats = [mod("M"), mod("M.b0", size_mib=100, fw_post=10, bw_pre=40,
                           curve=((0, 0.0), (0, 2.0), (100, 3.0))),
             mod("M.b1", size_mib=100, ms=4, fw_post=20, bw_pre=30)]
    res = solve_milp(make_info(stats, [pt(25, 300)]), 290 * MiB)
    assert_plan(res, {"M.b1": 0.1})
    res = solve_milp(make_info(stats, [pt(25, 300)]), 150 * MiB)
    # Drop 150 MiB: b0 fully (3 ms) + 50 MiB of b1 (2 ms) = 5 beats b1 fully + 50 of b0 (4 + 2.5).
    assert_plan(res, {"M.b0": 1.0, "M.b1": 0.5})
    assert res.recompute_ms == pytest.approx(5.0)


def test_fixed_recompute_cost_is_paid_by_any_checkpoint() -> None:
    """b0: 1 ms per 100 MiB plus a fixed 5 ms; b1: 4 ms per 100 MiB.
    Drop 10 MiB: b0 5.1 ms vs b1 0.4 -> b1. Drop 150 MiB: b0 fully + half b1 = 6 + 2 = 8 ms beats
    b1 fully + half b0 = 4 + 5.5."""
    stats = [mod("M"), mod("M.b0", size_mib=100, ms=1, fixed_ms=5.0, fw_post=10, bw_pre=40),
             mod("M.b1", size_mib=100, ms=4, fw_post=20, bw_pre=30)]
    info = make_info(stats, [pt(25, 300)])
    assert_plan(solve_milp(info, 290 * MiB), {"M.b1": 0.1})
    res = solve_milp(info, 150 * MiB)
    assert_plan(res, {"M.b0": 1.0, "M.b1": 0.5})
    assert res.recompute_ms == pytest.approx(8.0)


def test_retained_inputs_are_netted_from_discards() -> None:
    """b0 (0.05 ms/MiB) keeps 30 MiB of inputs alive when checkpointed; b1 (0.1 ms/MiB) none.
    Drop 50 MiB: b0 needs 80 MiB (4 ms) < b1 50 MiB (5 ms). Drop 20: b0 50 MiB (2.5) > b1 (2)."""
    stats = [mod("M"), mod("M.b0", size_mib=100, ms=5, fw_post=10, bw_pre=40, retain_mib=30),
             mod("M.b1", size_mib=100, ms=10, fw_post=20, bw_pre=30)]
    info = make_info(stats, [pt(25, 300)])
    res = solve_milp(info, 250 * MiB)
    assert_plan(res, {"M.b0": 0.8})
    assert res.predicted_peak_bytes == 250 * MiB == predict_peak_bytes(info, {"M.b0": 80 * MiB})
    assert_plan(solve_milp(info, 280 * MiB), {"M.b1": 0.2})
    assert predict_peak_bytes(info, {"M.b0": 10 * MiB}) == 320 * MiB  # a net loss


def test_module_without_backward_keeps_discard_to_the_end() -> None:
    """bw_pre_op = -1: the discard applies to every point after fw_post_op."""
    stats = [mod("M"), mod("M.b", size_mib=100, ms=1, fw_post=10)]
    info = make_info(stats, [pt(5, 150), pt(20, 300), pt(10_000, 250)])
    res = solve_milp(info, 200 * MiB)
    assert_plan(res, {"M.b": 1.0})
    assert res.predicted_peak_bytes == 200 * MiB


def test_equal_cost_ties_resolve_to_earlier_module() -> None:
    stats = [mod("M"), mod("M.a", size_mib=100, ms=10, fw_post=10, bw_pre=40),
             mod("M.b", size_mib=100, ms=10, fw_post=20, bw_pre=30)]
    info = make_info(stats, [pt(25, 300)])
    plans = [solve_milp(info, 250 * MiB).decisions for _ in range(3)]
    assert plans == [{"M.a": 0.5}] * 3


def test_model_built_once_resolves_any_budget() -> None:
    milp = SACMilp(chain())
    for mib in (450, 400, 300, 250):
        again = solve_milp(chain(), mib * MiB)
        res = milp.solve(mib * MiB)
        assert res.decisions == pytest.approx(again.decisions)
        assert res.predicted_peak_bytes <= mib * MiB
    assert milp.min_reachable_peak_bytes() == 250 * MiB
    assert milp.memory.peak(milp.min_peak_plan()) == 250 * MiB  # the plan that reaches it
    assert milp.n_variables > 0 and milp.n_constraints > 0


def test_write_lp_reads_like_the_maths(tmp_path) -> None:
    path = tmp_path / "sac.lp"
    solve_milp(chain(), 300 * MiB, options=SolverOptions(write_lp_path=path))
    text = path.read_text()
    for name in ("budget", "mem_at_op_40", "cum_fw_1", "cum_bw_1", "recompute_seg0_0",
                 "discard_only_if_checkpointed_0", "y1_M.b0", "peak_mib"):
        assert name in text, name


def test_no_candidates_below_peak_is_infeasible() -> None:
    info = make_info([mod("M"), mod("M.fc", leaf=True)], [pt(1, 100)])
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_milp(info, 50 * MiB)
    assert e.value.min_reachable_peak_bytes == 100 * MiB


def test_nothing_nested_even_when_nesting_would_help() -> None:
    """{attn, mlp} reaches max(150, 0, 100, 20) = 150 MiB, {B} only 200. B with attn inside it
    would reach 100 MiB, but nesting counts attn's bytes twice and is forbidden."""
    info = nested(backward_binds=False)
    assert min_reachable_peak_bytes(info) == 150 * MiB
    with pytest.raises(InfeasibleBudgetError):
        solve_milp(info, 149 * MiB)
    assert_plan(solve_milp(info, 150 * MiB), {"M.B.attn": 1.0, "M.B.mlp": 1.0})


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("budget", [-1, 0, math.nan, math.inf, -math.inf, True, "40GiB", None])
def test_bad_budget_says_what_to_pass(budget) -> None:
    with pytest.raises(ValueError, match="positive, finite number of bytes"):
        solve_milp(chain(), budget)


@pytest.mark.parametrize("ws", [0, -2, 1.5, True])
def test_bad_world_size(ws) -> None:
    with pytest.raises(ValueError, match="world_size"):
        solve_milp(chain(), 300 * MiB, world_size=ws)


def test_unknown_ac_unit_lists_close_names() -> None:
    with pytest.raises(UnknownModuleError, match=r"'M\.b3'.*close names: 'M\.b\d'"):
        solve_milp(chain(), 300 * MiB, ac_units=["M.b3"])
    with pytest.raises(UnknownModuleError, match="fsdp_units"):
        solve_milp(chain(), 300 * MiB, fsdp_units=["M.block0"])
    with pytest.raises(TypeError, match="list of module fqns"):
        solve_milp(chain(), 300 * MiB, ac_units="M.b0")


def test_predict_peak_rejects_bad_decisions() -> None:
    with pytest.raises(UnknownModuleError):
        predict_peak_bytes(chain(), {"M.bx": 1})
    with pytest.raises(ValueError, match="not in"):
        predict_peak_bytes(chain(), {"M.b0": 101 * MiB})


def test_highs_is_the_default_with_a_proven_gap() -> None:
    opts = SolverOptions()
    assert opts.backend is Backend.HIGHS and opts.rel_gap == 1e-4
    assert solve_milp(chain(), 300 * MiB).backend is Backend.HIGHS


def test_cbc_is_the_fallback_with_a_logged_reason(monkeypatch, caplog) -> None:
    import solver.options as so

    monkeypatch.setattr(so, "highs_load_error", lambda: "ImportError: libhighs.so: cannot open shared object")
    with caplog.at_level("WARNING", logger="solver.options"):
        opts = SolverOptions()
    assert opts.backend is Backend.CBC
    assert "highspy cannot load (ImportError: libhighs.so" in caplog.text and "CBC" in caplog.text
    with pytest.raises(BackendUnavailableError, match=r"pip install highspy.*Backend.CBC"):
        SolverOptions(backend=Backend.HIGHS)
    monkeypatch.setattr(so, "cbc_path", lambda: None)
    with pytest.raises(BackendUnavailableError, match="cbc"):
        SolverOptions()


@pytest.mark.parametrize("kw", [dict(time_limit_s=0), dict(time_limit_s=math.nan), dict(rel_gap=-1e-3),
                                dict(rel_gap=1.0), dict(threads=0), dict(backend="gurobi"),
                                dict(verbose="yes")])
def test_bad_options(kw) -> None:
    with pytest.raises((ValueError, TypeError)):
        SolverOptions(**kw)


@pytest.mark.skipif(not backend_available(Backend.HIGHS), reason="highspy not installed")
def test_highs_gives_the_same_plans() -> None:
    opts = SolverOptions(backend="highs")
    for mib in (400, 300):
        assert solve_milp(chain(), mib * MiB, options=opts).decisions == pytest.approx(
            solve_milp(chain(), mib * MiB, options=SolverOptions(backend="cbc")).decisions)
    res = solve_milp(nested(backward_binds=True), 180 * MiB, options=opts)
    assert_plan(res, {"M.B.attn": 0.3})
    assert res.backend is Backend.HIGHS


def test_infeasible_message_units() -> None:
    small = str(InfeasibleBudgetError(5 * MiB, 50 * MiB, 2))
    assert "5.00 MiB (5,242,880 bytes)" in small and "50.00 MiB" in small and "world_size=2" in small
    big = str(InfeasibleBudgetError(30 * 2**30, 33_512_000_000, 1))
    assert "30.00 GiB" in big and "31.21 GiB (33,512,000,000 bytes" in big


def test_held_inputs_count_through_the_checkpoints_own_backward() -> None:
    """b discards 100 MiB and its checkpoint holds 30 MiB of inputs the unplanned step frees
    before b's backward (bw_pre 40 .. bw_post 45). At t=42, inside that backward, the unplanned
    step holds 250 MiB; checkpointed, the inputs are still alive there: 280 MiB (the point at
    t=30 drops from 300 to 230). Traced on gpt_demo, leaving this out priced the last block's
    attention core 3 MiB low."""
    b = ModStats(fqn="M.b", is_leaf=False, sac_memory_bytes=100 * MiB, sac_runtime_ms=10.0,
                 tradeoff=TradeoffCurve(discarded_bytes=(0, 100 * MiB), recompute_ms=(0.0, 10.0)),
                 fw_post_op=10, bw_pre_op=40, bw_post_op=45, checkpoint_retain_bytes=30 * MiB)
    info = make_info([mod("M"), b, mod("M.b.fc", leaf=True)],
                     [pt(30, 300), pt(42, 250), pt(50, 100)])
    assert predict_peak_bytes(info, {}) == 300 * MiB
    assert predict_peak_bytes(info, {"M.b": 100 * MiB}) == 280 * MiB
    assert min_reachable_peak_bytes(info) == 280 * MiB
    res = solve_milp(info, 280 * MiB)
    assert res.predicted_peak_bytes == 280 * MiB
    with pytest.raises(InfeasibleBudgetError):
        solve_milp(info, 279 * MiB)


@pytest.mark.skipif(not backend_available(Backend.CBC), reason="no CBC binary here")
def test_cbc_through_pulp_finds_the_highs_plan() -> None:
    """The CBC fallback builds its PuLP model from the same arrays HiGHS gets."""
    cbc = SolverOptions(backend="cbc")
    for mib in (250, 300, 400):
        a, b = solve_milp(chain(), mib * MiB), solve_milp(chain(), mib * MiB, options=cbc)
        assert b.backend is Backend.CBC
        assert b.recompute_ms == pytest.approx(a.recompute_ms, rel=1e-6)
        assert b.predicted_peak_bytes <= mib * MiB
    assert min_reachable_peak_bytes(chain(), options=cbc) == 250 * MiB


def test_big_models_log_the_start_and_end_of_a_solve(monkeypatch, caplog) -> None:
    """A 70B graph can take the whole time limit: the start and how it ended are logged at INFO
    (the CLI's progress); small models stay quiet."""
    import logging

    import solver.sac_milp as milp_module

    monkeypatch.setattr(milp_module, "LOUD_CANDIDATES", 0)
    with caplog.at_level(logging.INFO, logger="solver.sac_milp"):
        solve_milp(chain(), 400 * MiB)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("planning ") and "candidate modules for a 0.39 GiB budget" in m
               for m in msgs), msgs
    assert any(m.startswith("SAC MILP: optimal in") and m.endswith("recompute 5.000 ms")
               for m in msgs), msgs
    monkeypatch.setattr(milp_module, "LOUD_CANDIDATES", 10**9)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="solver.sac_milp"):
        solve_milp(chain(), 400 * MiB)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_checkpoint_whose_forced_discards_alone_fit_is_kept() -> None:
    """b0 always discards 40 MiB when checkpointed (forced; 1 ms fixed) and 100 MiB more along its
    curve at 10 ms; b1 discards 100 MiB at 50 ms. Drop 30 MiB: checkpointing b0 at ratio 0 (1 ms)
    is optimal. A plan that dropped the ratio-0 checkpoint (it discards nothing on its curve)
    ended over the budget and fell back to another plan."""
    b0 = dataclasses.replace(mod("M.b0", size_mib=100, ms=10, fixed_ms=1.0, fw_post=10, bw_pre=40),
                             forced_discard_bytes=40 * MiB)
    stats = [mod("M"), b0, mod("M.b1", size_mib=100, ms=50, fw_post=20, bw_pre=30)]
    info = make_info(stats, [pt(25, 300)])
    res = solve_milp(info, 270 * MiB)
    assert res.checkpointed == ("M.b0",)
    assert res.discarded_bytes == {"M.b0": 0}
    assert res.predicted_peak_bytes == 260 * MiB == predict_peak_bytes(info, {"M.b0": 0})
    assert res.recompute_ms == pytest.approx(1.0)
    assert min_reachable_peak_bytes(info) == 300 * MiB - 140 * MiB - 100 * MiB
