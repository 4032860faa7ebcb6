"""Shared, cached planning results: tracing and solving once per example keeps the suite fast."""

from __future__ import annotations

import functools

from estimators.tracing.estimation import estimate
from examples import EXAMPLES
from planner.planning.solve import plan_for_budget
from solver import SACMilp
from estimators.step.train_step import TrainStep

EXAMPLE_NAMES = ["gpt_demo", "convnet_demo"]


@functools.lru_cache(maxsize=None)
def planning(name: str, optimizer: str = "adam"):
    """(estimate, milp, no-AC peak, smallest reachable peak) for an example, planned for cpu."""
    model, inputs = EXAMPLES[name]()
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer=optimizer), device="cpu")
    milp = SACMilp(est.module_info)
    return est, milp, est.module_info.peak_bytes, milp.min_reachable_peak_bytes()


def budgets(name: str, n: int) -> list[int]:
    """n budgets from just above the smallest reachable peak to above the no-AC peak."""
    _, _, high, low = planning(name)
    fracs = {3: [1.05, 0.5, 0.06], 4: [0.8, 0.55, 0.3, 0.06]}[n]
    return [int(low + f * (high - low)) for f in fracs]


@functools.lru_cache(maxsize=None)
def plan_at(name: str, budget_bytes: int):
    est, milp, _, _ = planning(name)
    model, _ = EXAMPLES[name]()
    return plan_for_budget(model, est, budget_bytes, milp=milp)

