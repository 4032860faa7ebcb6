"""Planner: what users touch. Plan a model's selective activation checkpointing and apply it.

    from planner import solve_sac, apply_plan
    plan = solve_sac(model, budget_gib=40, inputs=batch, optimizer="adamw", device="h100")
    plan = solve_sac(model, budget_gib=40, step=TrainStep(inputs=batch, optimizer="adamw",
                                                          micro_batches=4), device="h100")
    print(plan.summary())
    apply_plan(model, plan)          # or: with apply_plan(model, plan): ...
    plan.save("plan.json")

    est = estimate(model, batch, optimizer="adamw", device="h100")    # estimators.tracing.estimation
    table = tradeoff_curve(est)                      # least recompute at 20 budgets
    fig = plot_tradeoff(table, hand_made_baselines(est.module_info))  # needs sac-planner[plot]
"""

from estimators.step.train_step import TrainStep, ZeroGrad
from planner.applying.checkpointing import (
    AlreadyCheckpointedError,
    AppliedPlan,
    PlanMismatchError,
    apply_plan,
    remove_plan,
)
from planner.planning.baselines import BaselinePoint, hand_made_baselines
from planner.distributed.ranks import PlanHashMismatchError, plan_hash, solve_sac_distributed
from planner.distributed.fsdp import fsdp_units_of
from planner.analysis.gradcheck import GradientCheck, check_gradients
from planner.plan import ModulePlan, Plan, PlanFormatError
from planner.analysis.plotting import plot_tradeoff
from planner.planning.solve import PlanningError, solve_sac
from planner.planning.tradeoff import TradeoffTable, tradeoff_curve

__all__ = [
    "solve_sac",
    "solve_sac_distributed",
    "TrainStep",
    "ZeroGrad",
    "apply_plan",
    "remove_plan",
    "check_gradients",
    "GradientCheck",
    "Plan",
    "ModulePlan",
    "AppliedPlan",
    "PlanningError",
    "PlanFormatError",
    "PlanMismatchError",
    "AlreadyCheckpointedError",
    "PlanHashMismatchError",
    "plan_hash",
    "fsdp_units_of",
    "tradeoff_curve",
    "TradeoffTable",
    "hand_made_baselines",
    "BaselinePoint",
    "plot_tradeoff",
]
