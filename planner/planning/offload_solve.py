"""Plans that offload: the three-way MILP's decisions as ModulePlans, checked by tracing them.

    plan = solve_sac(model, budget_gib=40, step=TrainStep(inputs=batch),
                     options=PlanOptions(device="h100", offload=True, host_budget_gib=128))
    plan.offloading, plan.host_peak_bytes, plan.step_ms, plan.exposed_copy_ms

``solve_sac(..., offload=True)`` comes here (``plan_offload``). The step is laid out on the
timeline at the granularity of the repeated blocks (``planner.planning.baselines.find_blocks``), with
FSDP2's collectives when ``fsdp_units`` and ``world_size > 1`` are given, and solved by
``solver.offload.milp.OffloadMilp`` with the recompute-only plan of ``SACMilp`` as its incumbent
(so a three-way plan is never slower on the timeline than the recompute-only one). An
offloading block's ModulePlan lists the ops whose saved outputs go to host
(``offloaded_ops``), in forward order until the MILP's bytes are reached. The applied plan is
traced (``planner.planning.verification.traced_estimate``) where the apply side can offload
(``planner.applying.offload``), as for SAC plans.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from estimators.tracing.estimation import Estimate
from estimators.tracing.steady_state import first_step_module_info
from estimators.contract.module_info import ModStats, ModuleInfo
from planner.applying.offload import MIN_OFFLOAD_BYTES, predicted_host_bytes
from planner.distributed.fsdp import original_class_name
from planner.distributed.layout import plan_layout
from planner.format import GiB
from planner.plan import ModulePlan, Plan, StepRecord, model_fingerprint, model_shape, op_key
from planner.errors import PlanningError
from planner.planning.module_plans import module_plan
from planner.planning.step_timeline import offloaded_bytes, plan_timeline, step_layout_of, timeline_fields
from planner.planning.verification import traced_estimate
from planner.step_ref import StepRef
from solver import InfeasibleBudgetError, SACMilp, SolverOptions
from solver.offload.cost import (
    offload_take,
    offloadable_bytes,
    predict_offload_peak_bytes,
)
from solver.offload.milp import OffloadMilp

__all__ = ["plan_offload", "offload_module_plan"]

logger = logging.getLogger(__name__)

_MAX_TIGHTENINGS = 4


def offload_module_plan(stats: ModStats, offload_bytes: int, min_bytes: int,
                        cap_bytes: int | None = None) -> tuple[ModulePlan, int]:
    """The ops of ``stats`` whose saved outputs go to host, in the MILP's order
    (``solver.offload.cost.offload_take``: largest first, the cheapest bytes per ms of copy
    stream) until at least ``offload_bytes`` (over all calls) are covered, skipping any that
    would pass ``cap_bytes`` (what is left of the host budget); and the bytes they really
    offload. ``offloaded_ops`` lists them in forward order."""
    ops, total = offload_take(stats, offload_bytes, min_bytes, cap_bytes)
    rank = {(op_key(op.func), op.occurrence): i for i, op in enumerate(stats.ops)}
    chosen = sorted(((op_key(op.func), op.occurrence) for op in ops), key=rank.__getitem__)
    plan = ModulePlan(fqn=stats.fqn, discard_ratio=0.0, full=False, offloaded_ops=tuple(chosen),
                      offloaded_bytes=total, input_numel=stats.input_numel)
    return plan, total


def plan_offload(
    model: torch.nn.Module,
    est: Estimate,
    budget_bytes: int,
    *,
    info: ModuleInfo,
    world_size: int = 1,
    reserve_bytes: int = 0,
    allowed: list[str] | None = None,
    fsdp_units: list[str] | None = None,
    solver_options: SolverOptions | None = None,
    verify: bool = True,
    host_budget_bytes: int | None = None,
    notes: list[str],
) -> Plan:
    """The keep / recompute / offload Plan for one budget (see the module docstring).
    ``info`` carries the FSDP2 additions already (``planner.planning.solve.plan_for_budget``)."""

    spec = est.spec
    if spec.host_copy_bytes_per_s <= 0:
        raise PlanningError(f"device {spec.name!r} has no host link (host_link_bytes_per_s = 0): "
                            "offload cannot be planned; pass a DeviceSpec with one or offload=False")
    t0 = time.perf_counter()
    layout = step_layout_of(info, spec, fsdp_units=fsdp_units, world_size=world_size)
    if len(layout.blocks) < 2:
        notes.append("no repeated blocks (<prefix>.<int>) found: nothing is offloaded")
    min_bytes = MIN_OFFLOAD_BYTES
    if len(layout.blocks) >= 2 and not any(offloadable_bytes(info.stats(b), min_bytes) > 0
                                           for b in list(layout.blocks)[:-1]):
        # Without this, a plan of small blocks offloads nothing and does not say why.
        notes.append("the repeated blocks save no activation that can go to host (saved, not a "
                     "view, not empty; the last block never offloads): nothing is offloadable")
    milp = OffloadMilp(info, layout, copy_bytes_per_s=spec.host_copy_bytes_per_s,
                       copy_latency_s=spec.host_copy_latency_s, world_size=world_size,
                       host_budget_bytes=host_budget_bytes, min_offload_bytes=min_bytes,
                       ac_units=allowed, fsdp_units=fsdp_units, options=solver_options)
    sac = SACMilp(info, world_size=world_size, ac_units=allowed, fsdp_units=fsdp_units, options=solver_options)
    traced_ok = verify and world_size == 1
    if verify and world_size == 1 and not traced_ok:
        notes.append("offload plan not traced: the apply side (planner.applying.offload) is missing; the "
                     "predicted peak is the MILP's")
    usable = budget_bytes - reserve_bytes
    target = usable
    first_info = first_step_module_info(info)
    result = None
    for _ in range(_MAX_TIGHTENINGS + 1):
        try:
            incumbent = sac.solve(target).discarded_bytes
        except InfeasibleBudgetError:
            incumbent = None
        try:
            res = milp.solve(target, incumbent=incumbent)
        except InfeasibleBudgetError as e:
            raise PlanningError(f"keep / recompute / offload: {e}") from e
        modules, host = _module_plans(info, res, min_bytes, solver_options, module_plan,
                                      host_budget_bytes)
        windows = {m.fqn: (offloaded_bytes(info.stats(m.fqn), m), info.stats(m.fqn).fw_post_op,
                           milp.back_op(m.fqn)) for m in modules if m.offloaded_ops}
        solver_first = predict_offload_peak_bytes(first_info, res.discarded_bytes, windows,
                                                  world_size=world_size)
        if traced_ok:
            planned = traced_estimate(model, modules, est)
            first, steady = planned.first_step_peak_bytes, planned.steady_peak_bytes
        else:
            first, steady = solver_first, milp.peak_bytes(res.discarded_bytes,
                                                          {f: w[0] for f, w in windows.items()})
        result = (res, modules, host, first, steady, solver_first)
        traced = max(first, steady)
        if traced <= usable:
            break
        over = traced - usable
        notes.append(f"traced peak {traced / GiB:.3f} GiB overshot the MILP's "
                     f"{res.predicted_peak_bytes / GiB:.3f} GiB: target tightened")
        target -= 2 * over + usable // 1000
    res, modules, host, first, steady, solver_first = result
    if max(first, steady) > usable:
        raise PlanningError(f"no offload plan verified under {usable / GiB:.3f} GiB usable (last "
                            f"traced peak {max(first, steady) / GiB:.3f} GiB); raise the budget")
    if res.from_incumbent or (res.discarded_bytes and not res.offloaded_bytes and milp.n_offload_blocks):
        # The backend may reach the recompute-only plan itself (it starts from it): say so too.
        notes.append("the recompute-only plan is at least as fast on the timeline: nothing offloaded")
    if host_budget_bytes is not None:
        notes.append(f"host budget {host_budget_bytes / GiB:.2f} GiB per rank")
    host = sum(predicted_host_bytes(est.trace, modules).values())  # what the apply side copies
    micro_batches = est.step.micro_batches if est.step is not None else 1
    tl = plan_timeline(layout, info, modules, spec.host_copy_bytes_per_s, spec.host_copy_latency_s)
    return Plan(
        modules=modules, model_name=original_class_name(model), model_fingerprint=model_fingerprint(model),
        trainable_numel=model_shape(model).trainable_numel,
        device=spec.name, world_size=world_size, layout=plan_layout(model, fsdp_units, world_size), budget_bytes=budget_bytes, reserve_bytes=reserve_bytes,
        predicted_peak_bytes=max(first, steady),
        solver_peak_bytes=max(solver_first, res.predicted_peak_bytes),
        baseline_peak_bytes=res.no_ac_peak_bytes, recompute_ms=tl.recompute_ms,
        baseline_step_ms=est.module_info.step_runtime_ms,
        solver_status=res.status.value, solve_time_s=time.perf_counter() - t0, notes=tuple(notes),
        first_step_peak_bytes=first, steady_peak_bytes=steady, host_peak_bytes=host,
        host_bytes_per_step=host * micro_batches,
        step=StepRecord.of(est.step) if est.step is not None else None,
        step_ref=StepRef(est.step) if est.step is not None else None,
        **timeline_fields(tl),
    )


def _module_plans(info: ModuleInfo, res: Any, min_bytes: int, options, module_plan,
                  host_budget_bytes: int | None) -> tuple[tuple[ModulePlan, ...], int]:
    """ModulePlans in forward pre-order, and the bytes the offloading ones send to host (whole
    ops: within the host budget, which may leave a block short of the MILP's bytes; the trace
    of the plan then says whether it still fits)."""
    plans: dict[str, ModulePlan] = {}
    host = 0
    for f, d in res.discarded_bytes.items():
        plans[f] = module_plan(info.stats(f), d, options)
    for f, nbytes in res.offloaded_bytes.items():
        cap = None if host_budget_bytes is None else host_budget_bytes - host
        p, real = offload_module_plan(info.stats(f), nbytes, min_bytes, cap)
        if p.offloaded_ops:
            plans[f] = p
            host += real
    order = {s.fqn: i for i, s in enumerate(info.mod_stats)}
    return tuple(plans[f] for f in sorted(plans, key=order.__getitem__)), host
