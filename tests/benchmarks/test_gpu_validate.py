"""benchmarks/gpu_validate.py: its CPU-only answer, and its pieces run on CPU (the CUDA path needs a
GPU; these check what it computes from the same calls)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_validate as gv
from examples import EXAMPLES
from tests.planner.conftest import budgets, plan_at, planning


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer of a machine without CUDA")
def test_without_cuda_it_says_what_it_needs_and_exits_0(capsys):
    assert gv.main([]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA GPU" in out and "--device cpu" in out


def test_plan_step_time_is_the_planners_own_figure():
    name = "gpt_demo"
    est = planning(name)[0]
    plan = plan_at(name, budgets(name, 3)[1])
    assert plan.modules and plan.recompute_ms > 0
    assert gv.plan_step_ms(est, plan) == plan.baseline_step_ms + plan.recompute_ms


def test_must_save_hits_count_every_saved_op_of_a_cpu_plan_on_cpu():
    name = "gpt_demo"
    plan = plan_at(name, budgets(name, 3)[1])
    planned = sum(len(m.saved_ops) for m in plan.modules)
    assert planned > 0
    model, inputs = EXAMPLES[name]()
    peaks, hits, tracker = gv.train_steps(model, inputs, model.loss_fn, steps=1, plan=plan)
    assert hits == planned
    assert len(peaks) == 1 and peaks[0] > 0 and "MemTracker" in tracker
    assert gv.saved_hits(model) == 0  # the plan is removed with its counters


@pytest.mark.slow
def test_dry_run_runs_the_whole_pipeline_on_cpu_and_writes_the_csv(tmp_path, capsys):
    """--dry-run: the unplanned row and, per budget, a roofline and a benchmark plan, measured on
    this CPU, in the CSV; what needs CUDA is named as skipped."""
    import csv

    path = tmp_path / "rows.csv"
    assert gv.main(["--dry-run", "--models", "gpt_tiny", "--budget-fracs", "0.2", "0.8", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped for want of a GPU" in out and "max_memory_allocated" in out
    rows = list(csv.DictReader(path.open()))
    assert [(r["plan_mode"], r["budget_frac"]) for r in rows] == [
        ("none", "nan"), ("roofline", "0.2"), ("roofline", "0.8"), ("benchmark", "0.2"), ("benchmark", "0.8")]
    for r in rows:
        assert int(r["measured_peak_steady_bytes"]) == int(r["predicted_peak_bytes"])  # MemTracker, CPU: exact
        assert float(r["measured_step_ms"]) > 0 and float(r["predicted_step_ms_benchmark"]) > 0
