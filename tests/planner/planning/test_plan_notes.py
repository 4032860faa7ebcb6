"""planner/planning/plan_notes.py: what a plan's notes tell the user about the step it was planned for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from estimators.tracing.estimation import EstimateOptions, TraceMode
from estimators.step.train_step import TrainStep
from examples import EXAMPLES
from planner import PlanningError, solve_sac
from planner.options import PlanOptions


@pytest.mark.slow
def test_bytes_given_as_gib_are_refused_and_a_roomy_budget_says_so():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(PlanningError, match=r"budget_gib is in GiB.*pass budget_gib=0\.008382"):
        solve_sac(model, budget_gib=9_000_000, step=TrainStep(inputs=inputs, loss_fn=model.loss_fn))
    plan = solve_sac(model, options=PlanOptions(verify=False), budget_gib=64, step=TrainStep(inputs=inputs, loss_fn=model.loss_fn))
    assert not plan.modules
    assert any("nothing to checkpoint" in n for n in plan.notes)
    # 64 meant as MiB: thousands of times the step's peak, so the note names the GiB unit.
    assert any("budget_gib is in GiB: for 64 MiB pass budget_gib=0.0625" in n for n in plan.notes)
    roomy = solve_sac(model, options=PlanOptions(verify=False), budget_gib=2 * plan.baseline_peak_bytes / 2**30, step=TrainStep(inputs=inputs, loss_fn=model.loss_fn))
    assert not roomy.modules and not any("budget_gib is in GiB" in n for n in roomy.notes)


def test_a_dropped_output_the_size_of_a_few_percent_of_the_peak_is_named_in_the_notes():
    # A loop that holds the output through backward but was planned without keep_output peaks
    # higher by up to the output's size (a Qwen2: 262,144 B of logits, 8 %), and nothing said so.
    model, inputs = EXAMPLES["gpt_tiny"]()
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps))
    notes = solve_sac(model, options=PlanOptions(verify=False), budget_gib=0.01, step=step).notes
    assert "optimizer a factory function" in notes[0]
    assert any("drops the model output (64.00 KiB)" in n and "TrainStep(keep_output=True)" in n for n in notes)
    kept = solve_sac(model, options=PlanOptions(verify=False), budget_gib=0.01, step=dataclasses.replace(step, keep_output=True))
    assert not any("drops the model output" in n for n in kept.notes)


def test_a_real_mode_plan_says_what_its_figures_stand_for(caplog):
    # A ResNet planned for h100 in real mode got CPU figures, 22 % under the fake trace's h100
    # ones, and the summary said "on h100" with no word.
    model, inputs = EXAMPLES["convnet_tiny"]()
    real = EstimateOptions(mode=TraceMode.REAL)
    cpu = solve_sac(model, options=PlanOptions(trace=real, verify=False), budget_gib=0.01, step=TrainStep(inputs=inputs, optimizer="adamw"))
    assert any(n.startswith("traced in real mode: the figures follow this batch's run") for n in cpu.notes)
    assert not any("memory is the CPU's" in n for n in cpu.notes)
    with caplog.at_level("WARNING", logger="planner.planning.plan_notes"):
        gpu = solve_sac(model, options=PlanOptions(device="h100", reserve_gib=0, trace=real, verify=False), budget_gib=0.01, step=TrainStep(inputs=inputs, optimizer="adamw"))
    assert any("memory is the CPU's (its kernels' saved tensors, no h100 allocation rounding)" in n for n in gpu.notes)
    assert "plan h100 with a fake trace" in caplog.text
    fake = solve_sac(model, options=PlanOptions(verify=False), budget_gib=0.01, step=TrainStep(inputs=inputs, optimizer="adamw"))
    assert not any("real mode" in n for n in fake.notes)


@pytest.mark.slow
def test_a_plan_without_an_optimizer_says_its_state_is_not_in_the_figures():
    # solve_sac's default is no optimizer: a plan made that way, trained with AdamW, measured
    # 5,246,584 B against a 4,294,967 B budget, and only "optimizer None" said why.
    model, inputs = EXAMPLES["gpt_tiny"]()
    bare = solve_sac(model, options=PlanOptions(verify=False), budget_gib=0.01, step=TrainStep(inputs=inputs, loss_fn=model.loss_fn))
    assert any(n.startswith("planned without an optimizer (solve_sac's default; --optimizer none)") for n in bare.notes)
    adamw = solve_sac(model, options=PlanOptions(verify=False), budget_gib=0.01, step=TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"))
    assert not any("planned without an optimizer" in n for n in adamw.notes)


def test_the_unit_slip_note_gives_the_figure_as_typed():
    """0.001 GiB floors to 1,073,741 B, which read back as 0.000999999 (found by a new-user helper)."""
    from planner.planning.plan_notes import unit_slip_note

    (note,) = unit_slip_note(int(0.001 * 2**30), 1_000)
    assert "for 0.001 MiB pass budget_gib=9.76563e-07" in note


def test_the_unit_slip_note_reads_a_byte_count_as_bytes_and_keeps_its_digits():
    """budget_gib=439473 (a byte count; the step peaks at 476,568 B) was answered "for 439470 MiB
    pass budget_gib=429.17": five significant digits changed the user's figure, and of the two
    slips (MiB, bytes) it named the one 10^6x off the peak (found by a new-user helper)."""
    from planner.planning.plan_notes import unit_slip_note

    (note,) = unit_slip_note(439473 * 2**30, 476_568)
    assert "for 439,473 bytes pass budget_gib=0.000409" in note and "439470" not in note
    (mib,) = unit_slip_note(123457 * 2**30, 100 * 2**30)  # 123,457 MiB = 120.6 GiB beside a 100 GiB peak
    assert "for 123457 MiB pass budget_gib=120.563" in mib
    (seven,) = unit_slip_note(1_048_575 * 2**30, 1000 * 2**30)
    assert "for 1048575 MiB pass budget_gib=1024" in seven
