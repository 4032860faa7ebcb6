"""SAC Planner: plan which activations a training step recomputes so it fits a memory budget.

    from planner import PlanOptions, TrainStep, apply_plan, check_gradients, solve_sac

    step = TrainStep(inputs=batch, loss_fn=loss_fn, optimizer="adamw")
    plan = solve_sac(model, budget_gib=40, step=step, options=PlanOptions(device="h100"))
    print(plan.summary())
    apply_plan(model, plan)              # or: with apply_plan(model, plan): ...
    plan.save("plan.json")

Everything a user needs is imported from here; the errors also from ``planner.errors``. The
sub-packages (``planning``, ``applying``, ``analysis``, ``distributed``) are the implementation.
"""

from estimators.step.train_step import TrainStep
from planner.analysis.gradcheck import check_gradients
from planner.applying.checkpointing import apply_plan, remove_plan
from planner.distributed.ranks import solve_sac_distributed
from planner.errors import PlanFormatError, PlanMismatchError, PlanningError
from planner.options import PlanOptions
from planner.plan import Plan
from planner.planning.solve import solve_sac
from planner.planning.tradeoff import tradeoff_curve

__all__ = [
    "solve_sac",
    "solve_sac_distributed",
    "apply_plan",
    "remove_plan",
    "check_gradients",
    "tradeoff_curve",
    "Plan",
    "TrainStep",
    "PlanOptions",
    "PlanningError",
    "PlanFormatError",
    "PlanMismatchError",
]
