"""planner/analysis/report.py: rendering only; hand-built data, exact text (measurements,
gradient check)."""

from __future__ import annotations

import dataclasses

from planner.analysis.gradcheck import GradientCheck
from planner.plan import ModulePlan, Plan
from planner.analysis.measure import MeasuredStep
from planner.analysis.report import gradient_check_text, prediction_vs_measurement, steps_vs_prediction

MiB = 2**20


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


def make_plan(**kw) -> Plan:
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


def test_prediction_and_steps_against_measurements():
    plan = make_plan(predicted_peak_bytes=1000, budget_bytes=1100, reserve_bytes=50, first_step_peak_bytes=None,
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


def test_step_one_is_compared_with_the_first_steps_prediction():
    plan = make_plan(predicted_peak_bytes=1000, budget_bytes=1100, reserve_bytes=50, first_step_peak_bytes=900,
                 steady_peak_bytes=None)
    steps = [MeasuredStep(peak_bytes=b, loss=2.5, step_time_ms=3.0, tracker="T") for b in (900, 1000)]
    text = steps_vs_prediction(plan, steps)
    assert "; first step 900 B (900 B)" in text.splitlines()[0]
    assert "     1       900 B (        900 B)        +0.00%            within  2.5" in text
    assert "     2      1000 B (      1,000 B)        +0.00%            within  2.5" in text


