"""Planner: what users touch. Plan a model's selective activation checkpointing and apply it.

    from planner import solve_sac, apply_plan
    plan = solve_sac(model, budget_gib=40, inputs=batch, optimizer="adamw", device="h100")
    print(plan.summary())
    apply_plan(model, plan)          # or: with apply_plan(model, plan): ...
    plan.save("plan.json")
"""

from planner.checkpointing import (
    AlreadyCheckpointedError,
    AppliedPlan,
    PlanMismatchError,
    apply_plan,
    remove_plan,
)
from planner.plan import ModulePlan, Plan, PlanFormatError
from planner.solve import PlanningError, solve_sac

__all__ = [
    "solve_sac",
    "apply_plan",
    "remove_plan",
    "Plan",
    "ModulePlan",
    "AppliedPlan",
    "PlanningError",
    "PlanFormatError",
    "PlanMismatchError",
    "AlreadyCheckpointedError",
]
