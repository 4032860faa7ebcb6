"""solve_sac(offload=True): plans that offload, applied and measured on CPU (planner/offload_solve.py)."""

from __future__ import annotations

import json

import pytest
import torch

from estimators.device import get_device_spec
from estimators.step import TrainStep
from examples import EXAMPLES
from planner import apply_plan
from planner.gradcheck import check_gradients
from planner.measure import measure_steps
from planner.plan import Plan
from planner.solve import PlanningError, plan_for_budget
from planner.tradeoff import step_time_curves
from tests.planner.conftest import planning

MiB = 2**20


def _gpt():
    model, inputs = EXAMPLES["gpt_demo"]()
    model.train()
    return model, inputs


def test_offload_plan_applies_exactly_and_measures_as_predicted():
    est, _, peak, low = planning("gpt_demo", "adamw")
    model, inputs = _gpt()
    budget = int(low + 0.6 * (peak - low))
    plan = plan_for_budget(model, est, budget, offload=True)
    assert plan.offloading, "a budget this loose is met by hidden copies, not recompute"
    for m in plan.modules:
        assert not set(m.offloaded_ops) & set(m.recomputed_ops)
    assert plan.step_ms == pytest.approx(plan.compute_ms + plan.recompute_ms + plan.exposed_comm_ms
                                         + plan.exposed_copy_ms)
    assert check_gradients(model, plan, inputs, loss_fn=model.loss_fn).equal
    fresh, _ = _gpt()
    step = TrainStep(inputs=inputs, loss_fn=fresh.loss_fn, optimizer="adamw")
    with apply_plan(fresh, plan) as handle:
        steps = measure_steps(fresh, step, torch.optim.AdamW(fresh.parameters()), n_steps=2)
        host_per_step = handle.host_bytes_offloaded // 2
    measured = max(s.peak_bytes for s in steps)
    assert measured == plan.predicted_peak_bytes  # measured error 0 B (gpt_demo)
    assert measured <= plan.usable_budget_bytes
    assert host_per_step == plan.host_peak_bytes > 0


def test_offload_never_slower_than_recompute_only_and_host_budget_holds():
    est, _, peak, low = planning("gpt_demo", "adamw")
    model, _ = _gpt()
    budget = int(low + 0.5 * (peak - low))
    rec = plan_for_budget(model, est, budget)
    three = plan_for_budget(model, est, budget, offload=True)
    assert three.step_ms <= rec.step_ms + 1e-9
    capped = plan_for_budget(model, est, budget, offload=True, host_budget_bytes=10 * MiB)
    assert capped.host_peak_bytes <= 10 * MiB
    assert capped.step_ms >= three.step_ms - 1e-9


def test_plan_file_round_trip_and_old_files_load():
    est, _, peak, low = planning("gpt_demo", "adamw")
    model, _ = _gpt()
    plan = plan_for_budget(model, est, int(low + 0.6 * (peak - low)), offload=True)
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.host_peak_bytes == plan.host_peak_bytes
    old = json.loads(plan.to_json())
    for k in ("host_peak_bytes", "compute_ms", "exposed_comm_ms", "exposed_copy_ms", "step_ms"):
        del old[k]
    for m in old["modules"]:
        m.pop("offloaded_ops", None)
    loaded = Plan.from_dict(old)
    assert loaded.step_ms == 0.0 and loaded.host_peak_bytes == 0
    assert "step timeline" not in loaded.summary()
    assert "step timeline" in plan.summary() and "host memory" in plan.summary()


def test_no_host_link_is_a_clear_error():
    est, _, peak, low = planning("gpt_demo", "adamw")
    model, _ = _gpt()
    est.spec = get_device_spec("cpu").replace(host_link_bytes_per_s=0.0)
    try:
        with pytest.raises(PlanningError, match="no host link"):
            plan_for_budget(model, est, int(low + 0.6 * (peak - low)), offload=True)
    finally:
        est.spec = get_device_spec("cpu")


def test_step_time_curves_side_by_side():
    est, _, _, _ = planning("gpt_demo", "adamw")
    curves = step_time_curves(est, n_points=4, device="cpu")
    assert len(curves.rows) == 4 and curves.baselines
    for r in curves.rows:
        if r.recompute_only_step_ms is not None:
            assert r.three_way_step_ms is not None
            assert r.three_way_step_ms <= r.recompute_only_step_ms + 1e-9
    assert curves.rows[-1].three_way_step_ms == pytest.approx(curves.no_ac_step_ms)


def test_blocks_too_small_to_offload_say_so():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
                for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    from planner import solve_sac

    model = Tiny()
    step = TrainStep(inputs=(torch.randn(8, 16),), optimizer="adamw")
    plan = solve_sac(model, 1.0, step=step, offload=True)
    assert not plan.offloading
    assert any("nothing is offloadable" in n and "MIN_OFFLOAD_BYTES" in n for n in plan.notes), plan.notes
    # blocks that do reach the threshold get no such note
    gpt, inputs = EXAMPLES["gpt_demo"]()
    big = solve_sac(gpt, 1.0, inputs, loss_fn=gpt.loss_fn, offload=True)
    assert not any("nothing is offloadable" in n for n in big.notes)
