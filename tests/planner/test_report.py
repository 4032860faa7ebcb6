"""planner/report.py: rendering only; hand-built data, exact text."""

from __future__ import annotations

import dataclasses

from planner.floor import PeakBreakdown, PeakContributor
from planner.gradcheck import GradientCheck
from planner.plan import ModulePlan, Plan
from planner.report import floor_text, gradient_check_text, plan_summary

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
