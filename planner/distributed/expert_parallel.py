"""Expert parallel: one plan for every rank of a mixture-of-experts job, each rank's peak at the
load it is given, and the worst case its routing allows beside it.

    model.parallelize(parallel_dims)                 # torchtitan's EP (or any all-to-all EP)
    options = PlanOptions(device="h100", expert_load=ExpertLoad(capacity_factor=1.25))
    ep = plan_expert_parallel(model, 70, step, options=options)
    apply_plan(model, ep.plan)                       # the same plan on every rank of the group
    print(ep.summary())                              # peak at the stated load, worst case

Routing is data-dependent: how many tokens a rank's experts receive is known only when the step
runs, and a fake trace cannot see it. The step is planned for a stated load
(``estimators.tracing.routing.ExpertLoad``: balanced, a capacity factor, or one factor per rank
of the EP group), and the trace takes the routing's token counts from it. What is reported:

* ``plan``: made at the largest factor any rank is given, so that every rank of the group runs
  the same plan (a checkpointed MoE layer re-issues its all-to-alls in the recompute, on every
  rank or on none); its predicted peak is that of a rank at that factor;
* ``peak_bytes``: this rank's peak with the plan, at its own factor (the planned step traced at
  that factor where it is not the largest; with ``options.verify`` off, the MILP's figure: the
  plan's discard ratios on the memory model of a trace at that factor);
* ``worst_case_peak_bytes``: this rank's peak with the plan when every token of the group that
  can reach its experts does (``ExpertLoad.worst_case``: ``min(top_k, local experts)`` rows per
  token from every rank, or up to ``max_capacity_factor`` where the model drops tokens). A run
  never exceeds it, whatever the routing (the trace's other figures being exact).

With FSDP2 (``options.fsdp_units``) each figure is per rank with FSDP's buffers, as
``solve_sac`` predicts a sharded rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import as_train_step, estimate
from estimators.tracing.routing import Exchange, ExpertLoad, recorded_exchanges
from estimators.tracing.steady_state import first_step_module_info
from planner.applying.checkpointing import hf_cache_off
from planner.distributed.fsdp import fsdp_module_info
from planner.distributed.layout import fsdp_options
from planner.errors import PlanningError
from planner.format import fmt_bytes
from planner.options import PlanOptions
from planner.plan import Plan
from planner.planning.solve import plan_estimate
from planner.planning.verification import per_rank_peaks, traced_estimate
from solver import predict_peak_bytes

__all__ = ["ExpertLoad", "ExpertParallelPlan", "plan_expert_parallel"]


@dataclass(frozen=True)
class ExpertParallelPlan:
    """The plan of an expert-parallel rank and its figures (see the module docstring)."""

    plan: Plan
    """The same on every rank of the group: made at ``planned_capacity_factor``."""
    load: ExpertLoad
    planned_capacity_factor: float
    peak_bytes: int
    """This rank's steady-state peak with the plan, at its stated load."""
    first_step_peak_bytes: int
    worst_case_peak_bytes: int
    """This rank's steady-state peak with the plan under the worst routing (see the module docstring)."""
    worst_case_first_step_peak_bytes: int
    worst_case_capacity_factor: float
    exchanges: tuple[Exchange, ...]
    """The token-count exchanges of this rank's trace at its stated load (one per MoE layer traced)."""

    @property
    def capacity_factor(self) -> float:
        """This rank's factor: the rows its experts receive over the balanced share."""
        return self.exchanges[0].capacity_factor if self.exchanges else 1.0

    def summary(self) -> str:
        """One paragraph: the plan, this rank's peak at its load, the worst case."""
        ex = self.exchanges[0] if self.exchanges else None
        where = (f"rank {ex.ep_rank} of {ex.ep_size} (EP), {ex.local_experts} of {ex.experts} experts, "
                 f"receiving {ex.received_rows:,} rows per MoE layer (it routes {ex.routed_rows:,})"
                 if ex else "no token-count exchange traced")
        checkpointed = ", ".join(self.plan.checkpointed) or "nothing"
        return (f"expert parallel, {where}; plan made at capacity factor {self.planned_capacity_factor:g} "
                f"(checkpoints {checkpointed}): peak {fmt_bytes(self.peak_bytes)} at this rank's load "
                f"(factor {self.capacity_factor:g}), worst case {fmt_bytes(self.worst_case_peak_bytes)} "
                f"(factor {self.worst_case_capacity_factor:g}: every token that can reach this rank's experts)")


def plan_expert_parallel(model: torch.nn.Module, budget_gib: float, step: TrainStep | None = None, *,
                         options: PlanOptions | None = None) -> ExpertParallelPlan:
    """Plan an expert-parallel rank under ``options.expert_load`` (None: balanced): the plan
    ``solve_sac`` makes at the largest stated factor, this rank's peak with it at its own factor,
    and its peak under the worst routing. Call it on every rank (a live group, or one rank of
    ``fake_process_group``) with the same arguments: the plan is the same on all."""
    options = options if options is not None else PlanOptions()
    if options.pipeline is not None:
        raise PlanningError("plan_expert_parallel plans a whole model's rank; expert parallel inside a pipeline "
                            "stage is not modelled (plan the stage with solve_sac and options.expert_load)")
    load = options.expert_load if options.expert_load is not None else ExpertLoad()
    planned_options = options.replace(expert_load=load.planned())
    step = as_train_step(model, step)
    units, world_size = fsdp_options(model, options.fsdp_units, options.world_size)

    def traced(stated: ExpertLoad):
        with hf_cache_off(model):  # as solve_sac traces the step
            return estimate(model, step, device=options.spec,
                            options=dataclasses.replace(options.trace, expert_load=stated, progress=False))

    with recorded_exchanges() as recorded:
        est = traced(planned_options.expert_load)
    planned_exchanges = tuple(recorded)
    plan = plan_estimate(model, est, budget_gib, options=planned_options)

    def at(stated: ExpertLoad) -> tuple[int, int, tuple[Exchange, ...]]:
        with recorded_exchanges() as exchanges:
            est = traced(stated)
            if options.verify:  # the planned step traced at this load
                first, steady = per_rank_peaks(traced_estimate(model, plan.modules, est), units, world_size)
            else:  # the MILP's figure: the plan's discard ratios on this load's memory model
                first, steady = _milp_peaks(est, plan, units, world_size)
        return first, steady, tuple(exchanges)

    if load == planned_options.expert_load:  # this rank is at the planned factor: the plan's own figures
        first, steady, exchanges = plan.first_step_peak_bytes, plan.steady_peak_bytes, planned_exchanges
    else:
        first, steady, exchanges = at(load)
    worst_first, worst, worst_exchanges = at(ExpertLoad.worst_case(load.max_capacity_factor))
    return ExpertParallelPlan(
        plan=plan, load=load, planned_capacity_factor=float(planned_options.expert_load.capacity_factor),
        peak_bytes=steady, first_step_peak_bytes=first, worst_case_peak_bytes=worst,
        worst_case_first_step_peak_bytes=worst_first,
        worst_case_capacity_factor=worst_exchanges[0].capacity_factor if worst_exchanges else 1.0,
        exchanges=exchanges)


def _milp_peaks(est, plan: Plan, units, world_size: int) -> tuple[int, int]:
    """(first-step, steady-state) peak of the memory model of ``est`` with each of the plan's
    modules discarding its ratio of that trace's recomputable bytes (per rank, FSDP2 included)."""
    info = est.module_info if units is None else fsdp_module_info(est.module_info, list(units), world_size)
    discarded = {m.fqn: int(m.discard_ratio * info.stats(m.fqn).sac_memory_bytes) for m in plan.modules}
    return (predict_peak_bytes(first_step_module_info(info), discarded, world_size=world_size),
            predict_peak_bytes(info, discarded, world_size=world_size))
