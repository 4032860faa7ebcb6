"""planner/plan_summary.py: a hand-built Plan rendered as exact text."""

from __future__ import annotations

import dataclasses

import pytest

from planner.plan import ModulePlan, Plan
from planner.plan_summary import plan_summary
from tests.planner.analysis.test_report import make_plan


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
def test_plan_summary_whole_text():
    assert plan_summary(make_plan()) == "\n".join([
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
    empty = plan_summary(make_plan(modules=(), recompute_ms=0.0, first_step_peak_bytes=37 * 2**30))
    assert "  binds            first step (first step 37.00 GiB, steady state 36.00 GiB)" in empty
    assert "\n\n  nothing to checkpoint: the step fits as it is\n" in empty


def test_times_of_a_step_of_several_micro_batches_say_they_are_one_micro_batch_s():
    """The trace is one micro-batch's: with 2 or 4 micro-batches the plan's times are the same
    per micro-batch figures, and the summary printed them as "ms/step" (found by a new-user
    helper). It says per micro-batch, and what the step recomputes."""
    from estimators.step.train_step import TrainStep
    from planner.plan import StepRecord

    def summary(k: int) -> str:
        step = StepRecord.of(TrainStep(inputs=(), optimizer="adamw", micro_batches=k))
        return plan_summary(make_plan(step=step))

    assert "  recompute        1.750 ms/step = 25.0% of the 7.000 ms step" in summary(1)
    four = summary(4)
    assert ("  recompute        1.750 ms per micro-batch (7.000 ms per step of 4) = 25.0% of the "
            "7.000 ms of one micro-batch and the optimizer step") in four
    assert "ms/step" not in four


@pytest.mark.slow  # imports torch.distributed.pipelining (seconds on a loaded machine)
def test_a_long_pipeline_summarises_its_first_and_last_ranks():
    """A rank per timeline row: 1,024 stages printed 1,024 rows (99 KB)."""
    from planner.plan_pipeline import PipelineRecord

    rec = PipelineRecord(schedule="ScheduleGPipe", n_microbatches=8, stage_index=3, n_stages=256, fw_ms=1.0,
                         bw_ms=2.0, makespan_ms=100.0, bubble_fraction=0.5)
    text = plan_summary(dataclasses.replace(make_plan(), pipeline=rec))
    assert "... 240 more ranks" in text and "rank 0 |" in text and "rank 255 |" in text
    assert len(text) < 10_000
