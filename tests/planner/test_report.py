"""planner/report.py: rendering only; hand-built data, exact text (summary, measurements, floor,
gradient check, byte units)."""

from __future__ import annotations

import dataclasses

from planner.floor import PeakBreakdown, PeakContributor
from planner.gradcheck import GradientCheck
from planner.plan import ModulePlan, Plan
from planner.measure import MeasuredStep
from planner.report import (
    byte_unit,
    floor_text,
    fmt_bytes,
    gradient_check_text,
    plan_summary,
    prediction_vs_measurement,
    steps_vs_prediction,
)

MiB = 2**20


def _breakdown(**kw) -> PeakBreakdown:
    contributors = (
        PeakContributor(what="activations and temporaries made in GPT.lm_head", memory_bytes=300 * MiB,
                        module="GPT.lm_head", top_ops=(("aten.mm.default", 200 * MiB), ("aten._log_softmax.default", 100 * MiB))),
        PeakContributor(what="parameters", memory_bytes=20 * MiB),
        PeakContributor(what="gradients", memory_bytes=10 * MiB),
        PeakContributor(what="optimizer state", memory_bytes=6 * MiB),
        PeakContributor(what="inputs", memory_bytes=4 * MiB),
    )
    return PeakBreakdown(**{"peak_bytes": 340 * MiB, "op": "aten.nll_loss_forward.default", "phase": "forward",
                            "module": "", "contributors": contributors, **kw})


def test_floor_text_names_the_peak_and_its_largest_contributors():
    assert floor_text(_breakdown()) == (
        "at its peak (340.00 MiB, at aten.nll_loss_forward.default in the forward) the step holds "
        "activations and temporaries made in GPT.lm_head: 300.00 MiB (mm.default 200.00 MiB, "
        "_log_softmax.default 100.00 MiB); parameters: 20.00 MiB; gradients: 10.00 MiB; "
        "optimizer state: 6.00 MiB; the rest: 4.00 MiB"
    )
    text = floor_text(_breakdown(module="GPT.blocks.1", phase="backward", world_size=8), top=1)
    assert text.startswith("at its peak (340.00 MiB per rank, at aten.nll_loss_forward.default in the backward of GPT.blocks.1)")
    assert text.endswith("; the rest: 40.00 MiB")


def test_gradient_check_text():
    ok = GradientCheck(equal=True, n_params_compared=23, max_abs_diff=0.0, loss_planned=2.5, loss_reference=2.5)
    assert gradient_check_text(ok) == (
        "  gradients        bitwise EQUAL: loss and 23 parameter gradients compared (seed 0); max |diff| 0")
    bad = dataclasses.replace(ok, equal=False, max_abs_diff=0.0126, differing=tuple(f"p{i}" for i in range(10)),
                              loss_planned=2.25)
    lines = gradient_check_text(bad).splitlines()
    assert lines[0] == ("  gradients        DIFFERENT: loss and 23 parameter gradients compared (seed 0); "
                        "max |diff| 0.0126")
    assert lines[1] == "  loss             planned 2.25, unplanned 2.5"
    assert lines[2] == "  differing        p0, p1, p2, p3, p4, p5, p6, p7 (+2 more)"


def test_summary_shows_the_solve_time_only_when_known():
    plan = Plan(modules=(ModulePlan(fqn="M.a", discard_ratio=0.5, full=False, saved_ops=(("aten.mm.default", 0),)),),
                model_name="M", model_fingerprint="f", device="cpu", world_size=1, budget_bytes=100,
                reserve_bytes=0, predicted_peak_bytes=90, solver_peak_bytes=95, baseline_peak_bytes=120,
                recompute_ms=1.0, baseline_step_ms=10.0, solver_status="optimal")
    assert "  solver           optimal\n" in plan_summary(plan) + "\n"
    timed = dataclasses.replace(plan, solve_time_s=0.25)
    assert "  solver           optimal, 0.25 s" in plan_summary(timed)
    assert timed == plan and timed.to_dict() == plan.to_dict()


# ----------------------------------------------------------------------------- whole texts
def _plan(**kw) -> Plan:
    modules = (
        ModulePlan(fqn="M.blocks.0", discard_ratio=1.0, full=True, discarded_bytes=3 * MiB, recompute_ms=1.5),
        ModulePlan(fqn="M.blocks.1.attn", discard_ratio=0.25, full=False, discarded_bytes=512 * 2**10,
                   saved_ops=(("aten.mm.default", 0), ("aten.mm.default", 1)),
                   recomputed_ops=(("aten.gelu.default", 0),), recompute_ms=0.25),
    )
    fields = dict(modules=modules, model_name="M", model_fingerprint="f", device="h100", world_size=8,
                  budget_bytes=40 * 2**30, reserve_bytes=3 * 2**30, predicted_peak_bytes=36 * 2**30,
                  solver_peak_bytes=37 * 2**30, baseline_peak_bytes=50 * 2**30, recompute_ms=1.75,
                  baseline_step_ms=7.0, solver_status="optimal", notes=("step: optimizer adam",),
                  first_step_peak_bytes=30 * 2**30, steady_peak_bytes=36 * 2**30)
    return Plan(**{**fields, **kw})


def test_plan_summary_whole_text():
    assert plan_summary(_plan()) == "\n".join([
        "SAC plan for M on h100 (world_size 8)",
        "  budget           40.00 GiB  (reserve 3.00 GiB, usable 37.00 GiB)",
        "  peak, no AC      50.00 GiB",
        "  peak, planned    36.00 GiB  (MILP model: 37.00 GiB)",
        "  binds            steady state (first step 30.00 GiB, steady state 36.00 GiB)",
        "  recompute        1.750 ms/step = 25.0% of the 7.000 ms step",  # 1.75 / 7
        "  solver           optimal",
        "",
        "  module           discard       freed   recompute  policy",
        "  M.blocks.0        100.0%    3.00 MiB    1.500 ms  full",
        "  M.blocks.1.attn    25.0%  512.00 KiB    0.250 ms  SAC: save 2 ops, recompute 1",
        "  note: step: optimizer adam",
    ])
    empty = plan_summary(_plan(modules=(), recompute_ms=0.0, first_step_peak_bytes=37 * 2**30))
    assert "  binds            first step (first step 37.00 GiB, steady state 36.00 GiB)" in empty
    assert "\n\n  nothing to checkpoint: the step fits as it is\n" in empty


def test_prediction_and_steps_against_measurements():
    plan = _plan(predicted_peak_bytes=1000, budget_bytes=1100, reserve_bytes=50, first_step_peak_bytes=None,
                 steady_peak_bytes=None)
    m = MeasuredStep(peak_bytes=1010, loss=2.5, step_time_ms=3.0, tracker="T")
    assert prediction_vs_measurement(plan, m) == "\n".join([
        "  predicted peak   1000 B (1,000 B)",
        "  measured peak    1010 B (1,010 B)  [T]",
        "  error            +1.00%; measured is within the usable budget",  # usable 1050
        "  loss             2.5",
    ])
    over = dataclasses.replace(m, peak_bytes=1051)
    assert "  error            +5.10%; measured is ABOVE the usable budget" in prediction_vs_measurement(plan, over)
    assert steps_vs_prediction(plan, [m, over]) == "\n".join([
        "  predicted peak   1000 B (1,000 B)",
        "  step             measured peak  vs predicted  vs usable budget  loss",
        "     1      1010 B (      1,010 B)        +1.00%            within  2.5",
        "     2    1.03 KiB (      1,051 B)        +5.10%             ABOVE  2.5",  # 1051 B >= 1 KiB
        "  measured by T",
    ])


def test_byte_units_at_their_edges():
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 2**20 - 1, 2**20, 2**30, -3 * 2**20)] == [
        "0 B", "1023 B", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1.00 GiB", "-3.00 MiB"]
    assert fmt_bytes(1536, digits=0) == "2 KiB" and fmt_bytes(1536, digits=3) == "1.500 KiB"
    assert [byte_unit(n) for n in (5, 2**10, 2**20 + 1, 2**40)] == [
        (1, "B"), (2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB")]


def test_step_one_is_compared_with_the_first_steps_prediction():
    plan = _plan(predicted_peak_bytes=1000, budget_bytes=1100, reserve_bytes=50, first_step_peak_bytes=900,
                 steady_peak_bytes=None)
    steps = [MeasuredStep(peak_bytes=b, loss=2.5, step_time_ms=3.0, tracker="T") for b in (900, 1000)]
    text = steps_vs_prediction(plan, steps)
    assert "; first step 900 B (900 B)" in text.splitlines()[0]
    assert "     1       900 B (        900 B)        +0.00%            within  2.5" in text
    assert "     2      1000 B (      1,000 B)        +0.00%            within  2.5" in text


def test_times_of_a_step_of_several_micro_batches_say_they_are_one_micro_batch_s():
    """The trace is one micro-batch's: with 2 or 4 micro-batches the plan's times are the same
    per micro-batch figures, and the summary printed them as "ms/step" (found by a new-user
    helper). It says per micro-batch, and what the step recomputes."""
    from estimators.step import TrainStep
    from planner.plan import StepRecord

    def summary(k: int) -> str:
        step = StepRecord.of(TrainStep(inputs=(), optimizer="adamw", micro_batches=k))
        return plan_summary(_plan(step=step))

    assert "  recompute        1.750 ms/step = 25.0% of the 7.000 ms step" in summary(1)
    four = summary(4)
    assert ("  recompute        1.750 ms per micro-batch (7.000 ms per step of 4) = 25.0% of the "
            "7.000 ms of one micro-batch and the optimizer step") in four
    assert "ms/step" not in four
