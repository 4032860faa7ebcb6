"""``solve_sac``: trace, solve, turn ratios into op decisions, and check the plan by tracing it.

    step = TrainStep(inputs=batch, optimizer="adamw", micro_batches=4)
    plan = solve_sac(model, budget_gib=40, step=step, options=PlanOptions(device="h100"))
    apply_plan(model, plan)

Plans are made for the steady-state step (``estimators.tracing.estimation``): the memory points the MILP
sees hold the optimizer state and the gradients the loop keeps; the first step's peak (no
optimizer state before its optimizer phase) is computed beside it, and the prediction is the
larger of the two (``Plan.binding_step`` says which).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import time
from typing import Any, Iterable

import torch
import torch.utils.checkpoint

from estimators.runtime.device import DeviceSpec
from estimators.tracing.estimation import (
    Estimate,
    as_train_step,
    estimate,
)
from estimators.tracing.steady_state import first_step_module_info
from estimators.step.train_step import TrainStep
from planner.options import PlanOptions
from planner.planning.floor import PeakBreakdown, floor_text, lowering_hints, peak_breakdown
from planner.distributed.fsdp import FsdpPrecision, original_class_name, per_rank_info
from planner.distributed.layout import check_parallel_support, fsdp_options, fsdp_precision, has_dtensors, plan_layout
from planner.format import GiB, check_budget_gib
from planner.plan import Plan, StepRecord, model_fingerprint, model_shape
from planner.planning import plan_notes
from planner.planning import verification
from planner.format import fmt_bytes
from planner.planning.verification import RecomputeDivergedError
from planner.planning.candidates import allowed_units, shared_full_plan, shared_modules
from planner.errors import PlanningError
from planner.planning.module_plans import module_plan
from planner.planning.reserve import check_budget_on_device, default_reserve_bytes
from planner.planning.step_timeline import plan_timeline, step_layout_of, timeline_fields
from planner.step_ref import StepRef
from solver import InfeasibleBudgetError, SACMilp, SolverOptions, predict_peak_bytes

__all__ = [
    "solve_sac",
    "plan_estimate",
    "plan_for_budget",
    "default_reserve_bytes",
    "PlanningError",
]

logger = logging.getLogger(__name__)

_MAX_TIGHTENINGS = 4


def _check_reserve_gib(reserve_gib: Any, budget_gib: float) -> None:
    """``reserve_gib``: None, or a finite number of GiB from 0 up to below the budget."""
    if reserve_gib is None:
        return
    ok = isinstance(reserve_gib, numbers.Real) and not isinstance(reserve_gib, bool)
    if not ok or not math.isfinite(reserve_gib) or not 0 <= reserve_gib < budget_gib:
        raise PlanningError(
            f"reserve_gib must be a number of GiB from 0 up to below the budget ({budget_gib:g} GiB), "
            f"got {reserve_gib!r}; it is held back for the CUDA context and fragmentation (None: "
            "the default for the device, 0: plan the budget as given)")




def _infeasible(budget: int, reserve: int, *, floor: "_Floor", spec: DeviceSpec) -> PlanningError:
    """The refusal: the smallest budget that verifies, what sets it and what would lower it."""
    need = _min_budget_bytes(floor.usable_bytes, budget, reserve, spec)
    need_gib = _gib_up(need)
    msg = (
        f"infeasible: a budget of {fmt_bytes(budget)} cannot be met; the smallest budget this "
        f"model can reach is {need_gib:.6f} GiB ({need:,} bytes"
        + (f", incl. a {fmt_bytes(need - floor.usable_bytes)} reserve" if need > floor.usable_bytes else "")
        + "). "
    )
    if floor.breakdown is not None:
        msg += f"With the most checkpointing possible, {floor_text(floor.breakdown)}{_model_margin(floor)}. "
    hints = lowering_hints(floor.breakdown) if floor.breakdown is not None else ()
    msg += "To go lower: " + "; or ".join(hints or ("a smaller batch or sequence length",
                                                    "world_size > 1 (FSDP)")) + "."
    return _with_floor(PlanningError(msg), need, floor.breakdown)


def _model_margin(floor: "_Floor") -> str:
    """Where the smallest usable budget is not the breakdown's traced peak: the memory model the
    plans are solved on can put the min-peak plan above its trace (a few KiB on small models, a
    fraction of a percent on large ones), and the MILP refuses a budget below the model's figure;
    said, so the stated floor and the traced peak beside it do not read as a contradiction."""
    gap = floor.usable_bytes - floor.breakdown.peak_bytes
    if not gap:
        return ""
    per_rank = " per rank" if floor.breakdown.world_size > 1 else ""
    return (f"; the memory model the plans are solved on puts that plan {fmt_bytes(abs(gap))} "
            f"{'higher' if gap > 0 else 'lower'}, at {fmt_bytes(floor.usable_bytes)}{per_rank} ({floor.usable_bytes:,} "
            "bytes), the figure a budget's usable part (budget - reserve) must hold")


def _with_floor(err: PlanningError, need_bytes: int, breakdown) -> PlanningError:
    """A refusal that states the smallest budget: ``min_budget_bytes`` / ``min_budget_gib`` (the
    figure to plan at) and ``floor`` (what fills memory there, or None where not traced)."""
    err.min_budget_bytes = need_bytes  # type: ignore[attr-defined]
    err.min_budget_gib = _gib_up(need_bytes)  # type: ignore[attr-defined]
    err.floor = breakdown  # type: ignore[attr-defined]
    return err


@dataclasses.dataclass(frozen=True)
class _Floor:
    usable_bytes: int
    """Smallest usable budget that verifies: the MILP's floor, or the traced peak of the
    min-peak plan where that is higher (a figure the planner then accepts)."""
    breakdown: "PeakBreakdown | None"


def _floor(milp: SACMilp, est: Estimate, info, model, world_size: int, solver_options,
           units: list[str] | None = None, mp_policy: Any = None) -> _Floor:
    """Trace the min-peak plan: its peak is the floor that verifies and its breakdown says why
    (per rank, at the per-rank peak, where ``world_size`` > 1)."""
    low = milp.min_reachable_peak_bytes()
    res = milp.solve(low)
    modules = tuple(module_plan(info.stats(f), res.discarded_bytes[f], solver_options) for f in res.checkpointed)
    try:
        planned = verification.traced_estimate(model, modules, est)
    except Exception as exc:  # the explanation must never hide the refusal itself
        logger.warning("could not trace the min-peak plan to explain the floor: %s", exc)
        return _Floor(low, _breakdown(est, world_size, units, mp_policy))
    traced = max(planned.first_step_peak_bytes, planned.steady_peak_bytes)
    unplanned = max(est.first_step_peak_bytes, est.steady_peak_bytes)
    if world_size == 1 and traced > unplanned:
        # The min-peak plan traced above the unplanned step (what its checkpoints hold: start
        # values of buffers their forwards rebind, inputs): no plan, which always verifies, is
        # the floor; a refusal would state more than is reachable.
        return _Floor(unplanned, _breakdown(est, world_size, units, mp_policy))
    return _Floor(max(low, traced) if world_size == 1 else low, _breakdown(planned, world_size, units, mp_policy))


def _breakdown(est: Estimate, world_size: int, units: list[str] | None, mp_policy: Any = None) -> PeakBreakdown:
    """``peak_breakdown`` of one rank: at the per-rank peak with FSDP2's buffers where sharded."""
    if world_size == 1:
        return peak_breakdown(est)
    info = est.module_info if units is None else per_rank_info(est.module_info, units, world_size, mp_policy)
    return peak_breakdown(est, world_size=world_size, per_rank_info=info)


def _min_budget_bytes(usable: int, budget: int, reserve: int, spec: DeviceSpec) -> int:
    """Smallest budget whose usable part (budget - reserve) holds ``usable``. With the default
    reserve, which grows with the budget, that is more than ``usable + reserve``."""
    if reserve != default_reserve_bytes(spec, budget):
        return usable + reserve  # a reserve the caller fixed
    need = usable + default_reserve_bytes(spec, usable)
    while need - default_reserve_bytes(spec, need) < usable:
        need += max(1, (usable - need + default_reserve_bytes(spec, need)))
    return need


def _gib_up(nbytes: int) -> float:
    """GiB rounded up to 6 decimals: asking for the printed figure gives at least ``nbytes``."""
    g = math.ceil(nbytes / GiB * 1e6) / 1e6
    while int(g * GiB) < nbytes:
        g += 1e-6
    return g


def solve_sac(
    model: torch.nn.Module,
    budget_gib: float,
    step: TrainStep | None = None,
    *,
    options: PlanOptions | None = None,
    **unknown: Any,
) -> Plan:
    """Plan selective activation checkpointing so the training ``step`` fits ``budget_gib`` per rank.

    Traces the steady-state step (fake mode by default: no GPU, no real memory), solves the
    MILP, turns each module's ratio into op decisions and, with ``options.verify``, traces the
    planned model to predict its peak (tightening the target if the trace shows the MILP was
    optimistic). The prediction is the larger of the first step's and the steady state's peak.

    Example::

        step = TrainStep(inputs=(tokens,), optimizer="adamw", micro_batches=2)
        plan = solve_sac(model, budget_gib=40, step=step, options=PlanOptions(device="h100"))
        print(plan.summary())
        apply_plan(model, plan)

    ``step`` is the loop (``TrainStep``; None: ``model.example_inputs()``, ``output.sum()``, no
    optimizer). ``options`` says how to plan it (``PlanOptions``: device, reserve, parallel
    layout, offload, solver and trace settings; None: the defaults).
    """
    if unknown:
        raise TypeError(_moved_arguments("solve_sac", unknown))
    from planner.applying.checkpointing import check_plannable, hf_cache_off, unwrap_compiled

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"solve_sac plans a torch.nn.Module, got {type(model).__name__}")
    options = _check_options(options)
    model = unwrap_compiled(model)  # plan what torch.compile wraps; the compiled module is untouched
    check_plannable(model)  # before anything touches the model
    _check_budget(budget_gib, options)  # all before the trace, which can take minutes
    units, _ = fsdp_options(model, options.fsdp_units, options.world_size)  # refuses options a sharded model contradicts
    fsdp_precision(model, options.fsdp_mp_policy, units)
    check_parallel_support(model, options)
    given, step = step, as_train_step(model, step)
    if options.pipeline is not None:  # a pipeline stage: planned for its schedule, on its rank
        return _solve_stage(model, budget_gib, step, options)
    with hf_cache_off(model):  # trace the step as it runs once the plan is applied
        est = estimate(model, step, device=options.spec, options=options.trace)
    plan = plan_estimate(model, est, budget_gib, options=options)
    if given is None or given.inputs is None:
        # The inputs are the model's example_inputs(), which check_gradients makes again: the
        # plan keeps the step as given, not the tensors made for it.
        plan = dataclasses.replace(plan, step_ref=StepRef(given or TrainStep()))
    return plan


def plan_estimate(model: torch.nn.Module, est: Estimate, budget_gib: float, *,
                  options: PlanOptions | None = None) -> Plan:
    """What :func:`solve_sac` does once it has traced the step: the plan for ``budget_gib`` from
    ``est`` (an estimate of ``model``'s step, traced with ``hf_cache_off`` as solve_sac traces it).
    For callers that trace the step themselves, e.g. to choose ``options.ac_units`` from the
    traced module names (``planner.integrations``)."""
    options = _check_options(options)
    budget, host_budget = _check_budget(budget_gib, options)
    fsdp_units, world_size = fsdp_options(model, options.fsdp_units, options.world_size)
    mp_policy = fsdp_precision(model, options.fsdp_mp_policy, fsdp_units)
    check_parallel_support(model, options)
    spec = options.spec
    reserve = (int(options.reserve_gib * GiB) if options.reserve_gib is not None
               else default_reserve_bytes(spec, budget))
    return plan_for_budget(
        model,
        est,
        budget,
        unplanned_peak_bytes=unplanned_peak_bytes(model, est),
        world_size=world_size,
        reserve_bytes=reserve,
        ac_units=options.ac_units,
        fsdp_units=fsdp_units,
        fsdp_mp_policy=mp_policy,
        solver_options=options.solver,
        verify=options.verify,
        offload=options.offload,
        host_budget_bytes=host_budget,
    )


def _solve_stage(model: torch.nn.Module, budget_gib: float, step: TrainStep, options: PlanOptions) -> Plan:
    from planner.planning.pipeline_solve import solve_pipeline_rank

    pipe = options.pipeline
    if pipe.virtual_stages > 1:
        stages = pipe.layout.stages_of(pipe.layout.rank_of(pipe.stage_index))
        raise PlanningError(
            f"stage {pipe.stage_index} shares its rank with stages {list(stages)} ({pipe.virtual_stages} per rank): "
            "plan them together with planner.distributed.pipeline.solve_pipeline_rank({stage: (module, step), ...}, "
            "budget_gib, options=options)")
    return solve_pipeline_rank({pipe.stage_index: (model, step)}, budget_gib, options=options)[pipe.stage_index]


def _check_budget(budget_gib: Any, options: PlanOptions) -> tuple[int, int | None]:
    """The budget and the host budget in bytes, checked against each other, the reserve and the
    target's memory."""
    budget = int(check_budget_gib(budget_gib) * GiB)
    check_budget_on_device(budget, options.spec)
    _check_reserve_gib(options.reserve_gib, budget / GiB)
    host_budget = None if options.host_budget_gib is None else int(check_budget_gib(
        options.host_budget_gib, "host_budget_gib",
        "; pass None for no host limit, or offload=False to keep everything on the device") * GiB)
    return budget, host_budget


_OPTION_FIELDS = {"device": "device", "world_size": "world_size", "reserve_gib": "reserve_gib",
                  "ac_units": "ac_units", "fsdp_units": "fsdp_units", "offload": "offload",
                  "host_budget_gib": "host_budget_gib", "verify": "verify",
                  "solver_options": "solver", "estimate_options": "trace"}


def _moved_arguments(entry: str, unknown: dict[str, Any]) -> str:
    """The TypeError text for keywords of the old API: where each one lives now."""
    step = sorted(k for k in unknown if k in ("inputs", "loss_fn", "optimizer"))
    opts = sorted(k for k in unknown if k in _OPTION_FIELDS)
    other = sorted(set(unknown) - set(step) - set(opts))
    parts = []
    if step:
        parts.append(f"{', '.join(step)} go in the step: step=TrainStep({', '.join(f'{k}=...' for k in step)})")
    if opts:
        parts.append("settings go in the options: options=PlanOptions("
                     + ", ".join(f"{_OPTION_FIELDS[k]}=..." for k in opts) + ")")
    if other:
        parts.append(f"unknown argument(s) {', '.join(map(repr, other))}")
    return f"{entry}() got keyword argument(s) it does not take: " + "; ".join(parts)


def _check_options(options: PlanOptions | None) -> PlanOptions:
    if options is None:
        return PlanOptions()
    if not isinstance(options, PlanOptions):
        raise TypeError(f"options must be a PlanOptions, got {type(options).__name__}: "
                        "pass options=PlanOptions(device=..., ...)")
    return options


def plan_for_budget(
    model: torch.nn.Module,
    est: Estimate,
    budget_bytes: int,
    *,
    world_size: int = 1,
    reserve_bytes: int = 0,
    ac_units: Iterable[str] | None = None,
    fsdp_units: Iterable[str] | None = None,
    fsdp_mp_policy: Any = None,
    solver_options: SolverOptions | None = None,
    verify: bool = True,
    milp: SACMilp | None = None,
    offload: bool = False,
    host_budget_bytes: int | None = None,
    unplanned_peak_bytes: int | None = None,
) -> Plan:
    """The Plan for one budget, from an existing estimate (see :func:`solve_sac`); the estimate
    carries the step and trace options its verification trace reuses. With ``fsdp_units`` the
    memory points get FSDP2's per-rank additions (``planner.distributed.fsdp.fsdp_module_info``) here, the
    one place every entry point goes through, with ``fsdp_mp_policy`` (FSDP2's mixed precision)
    if given; a ``milp`` passed in must be built on those.
    ``unplanned_peak_bytes``: the peak of the model as it runs without the plan where that is
    not ``est``'s (see :func:`unplanned_peak_bytes`); the plan's ``baseline_peak_bytes``."""
    plan = _plan_for_budget(model, est, budget_bytes, world_size=world_size, reserve_bytes=reserve_bytes,
                            ac_units=ac_units, fsdp_units=fsdp_units, mp_policy=fsdp_mp_policy,
                            solver_options=solver_options, verify=verify, milp=milp, offload=offload,
                            host_budget_bytes=host_budget_bytes)
    if not (unplanned_peak_bytes is None or unplanned_peak_bytes == plan.baseline_peak_bytes or world_size > 1):
        # per rank (world_size > 1) the no-AC figure is the MILP's (sharded state); the trace is not
        plan = dataclasses.replace(plan, baseline_peak_bytes=unplanned_peak_bytes, notes=(*plan.notes, (
            f"peak, no AC is the model as it runs unplanned, with HF use_cache on ({unplanned_peak_bytes:,} B); "
            f"the plan runs it with use_cache off, whose no-AC peak is {plan.baseline_peak_bytes:,} B")))
    if not plan.modules and plan.predicted_peak_bytes <= plan.usable_budget_bytes:
        plan = dataclasses.replace(plan, notes=(*plan.notes, (
            f"the usable budget ({fmt_bytes(plan.usable_budget_bytes)}) holds the step without "
            f"checkpointing (peak {fmt_bytes(plan.predicted_peak_bytes)}): nothing to checkpoint"),
            *plan_notes.unit_slip_note(plan.budget_bytes, plan.baseline_peak_bytes)))
    return plan


def unplanned_peak_bytes(model: torch.nn.Module, est: Estimate) -> int | None:
    """The steady-state peak of ``model`` trained without a plan, where ``est`` (traced the way
    the plan runs it) differs: an HF model with ``use_cache`` on keeps its K/V cache alive until
    the output is dropped, which the plan turns off (its K/V are not all saved for backward:
    with a padding mask HF repeats grouped K/V heads). One more trace; None for other models."""
    from planner.applying.checkpointing import hf_cache_note

    if hf_cache_note(model) is None:
        return None
    opts = dataclasses.replace(est.options, progress=False)
    return estimate(model, est.step, device=est.spec, options=opts).module_info.peak_bytes


def _plan_for_budget(
    model: torch.nn.Module,
    est: Estimate,
    budget_bytes: int,
    *,
    world_size: int,
    reserve_bytes: int,
    ac_units: Iterable[str] | None,
    fsdp_units: Iterable[str] | None,
    mp_policy: Any,
    solver_options: SolverOptions | None,
    verify: bool,
    milp: SACMilp | None,
    offload: bool,
    host_budget_bytes: int | None,
) -> Plan:
    if reserve_bytes < 0 or reserve_bytes >= budget_bytes:
        default = est.spec.is_cuda and reserve_bytes == default_reserve_bytes(est.spec, budget_bytes)
        cuda = " (the default on a CUDA target: 1 GiB for the CUDA context + 5 % of the budget)" if default else ""
        raise PlanningError(
            f"the reserve ({fmt_bytes(reserve_bytes)}{cuda}) must be >= 0 and below the budget "
            f"({fmt_bytes(budget_bytes)}); pass a smaller reserve_gib (reserve_gib=0 plans the budget "
            "as given, e.g. one read off tradeoff_curve, whose peaks hold no reserve)"
        )
    from planner.applying.checkpointing import check_plannable, hf_cache_note, unwrap_compiled

    model = unwrap_compiled(model)
    check_plannable(model)
    units = None if fsdp_units is None else list(fsdp_units)
    if mp_policy is not None and not isinstance(mp_policy, FsdpPrecision):  # a MixedPrecisionPolicy
        mp_policy = FsdpPrecision.of(mp_policy, model)
    info = est.module_info if units is None else per_rank_info(est.module_info, units, world_size, mp_policy)
    first_info = first_step_module_info(info)
    t0 = time.perf_counter()
    notes: list[str] = [est.step.describe()] + plan_notes.precision_notes(mp_policy, est.step) + [
        n for n in (hf_cache_note(model), plan_notes.mode_note(model, est.step),
                    plan_notes.output_note(info, est.step), plan_notes.real_trace_note(model, est),
                    plan_notes.sparse_note(model), plan_notes.no_optimizer_note(est.step)) if n]
    allowed, excluded = allowed_units(info, ac_units)
    notes += [f"{fqn} not checkpointed: {why}" for fqn, why in excluded.items()]
    shared_fqns = shared_modules(info, allowed, excluded)
    shared = plan_notes.shared_note(info, shared_fqns)
    notes += [shared] if shared else []
    if offload:
        from planner.planning.offload_solve import plan_offload

        return plan_offload(model, est, budget_bytes, info=info, world_size=world_size,
                            reserve_bytes=reserve_bytes, allowed=allowed, fsdp_units=units,
                            solver_options=solver_options, verify=verify,
                            host_budget_bytes=host_budget_bytes, notes=notes)
    if milp is None or excluded:  # a caller's MILP may not know which modules are unsafe
        milp = SACMilp(info, world_size=world_size, ac_units=allowed, fsdp_units=units, options=solver_options)
    usable = budget_bytes - reserve_bytes
    target = usable
    # The floor and the last-resort min-peak plan come from the MILP over every allowed module,
    # not one re-planned without a mispriced module: asking for the stated floor must give the
    # plan that was traced to state it.
    full_milp = milp

    def floor() -> _Floor:
        return _floor(full_milp, est, info, model, world_size, solver_options, units, mp_policy)

    mispriced: dict[str, str] = {}  # candidates whose traced recompute set a peak the MILP missed
    tensor_parallel = has_dtensors(model)  # per-rank plans of a TP model are traced (FSDP-only: the MILP's)

    def peaks_of(res, modules) -> tuple[int, int]:
        """(first-step, steady-state) peak of a plan: traced, or the MILP's per-rank figures."""
        if verify and world_size == 1:
            planned = verification.traced_or_diverged(model, modules, est)
            culprit = verification.peak_in_backward_of(planned, modules)
            if culprit is not None and max(planned.first_step_peak_bytes, planned.steady_peak_bytes) > usable:
                mispriced.setdefault(culprit, f"its recompute set a traced peak of "
                                              f"{fmt_bytes(planned.steady_peak_bytes)}")
            return planned.first_step_peak_bytes, planned.steady_peak_bytes
        if verify and tensor_parallel:  # per rank: the planned step's trace, sharded by the FSDP rules
            planned = verification.traced_or_diverged(model, modules, est)
            return verification.per_rank_peaks(planned, units, world_size, mp_policy)
        first = predict_peak_bytes(first_info, res.discarded_bytes, world_size=world_size)
        return first, res.predicted_peak_bytes

    def leave_out_diverged(fqns: list[str]) -> None:
        """The recompute of these modules runs other ops than their forward (a module that
        branches on state the recompute sees otherwise): they are not checkpointed; plan again
        without them."""
        nonlocal allowed, milp, full_milp
        why = "its recompute ran other ops than its forward"
        notes.extend(f"{f} not checkpointed: {why}" for f in fqns)
        excluded.update({f: why for f in fqns})
        names = allowed if allowed is not None else [s.fqn for s in info.mod_stats]
        allowed = [f for f in names if f not in excluded and f not in mispriced]
        milp = full_milp = SACMilp(info, world_size=world_size, ac_units=allowed, fsdp_units=units,
                                   options=solver_options)

    traced = None  # every attempt may end in leaving out modules whose recompute diverged
    for attempt in range(_MAX_TIGHTENINGS + 1):
        try:
            res = milp.solve(target)
        except InfeasibleBudgetError as e:
            if attempt == 0:
                found = (shared_full_plan(model, est, info, full_milp, shared_fqns, solver_options)
                         if shared_fqns and verify and world_size == 1 else None)
                found_peak = (max(found[2].first_step_peak_bytes, found[2].steady_peak_bytes)
                              if found is not None else None)
                if found_peak is not None and found_peak <= usable:
                    res, modules, planned = found
                    peaks = planned.first_step_peak_bytes, planned.steady_peak_bytes
                    traced = found_peak
                    notes.append("below the MILP's smallest reachable peak: the min-peak plan with "
                                 f"{', '.join(shared_fqns)} fully checkpointed, traced at {fmt_bytes(traced)}")
                    break
                low = floor()
                if found_peak is not None and found_peak < low.usable_bytes:  # the lower floor verifies
                    low = _Floor(found_peak, _breakdown(found[2], world_size, units, mp_policy))
                err = _infeasible(budget_bytes, reserve_bytes, floor=low, spec=est.spec)
                if excluded:  # say what the floor would be without the safety exclusions
                    err.args = (err.args[0] + " Left out as unsafe to checkpoint: "
                                + "; ".join(f"{f} ({why})" for f, why in excluded.items()) + ".",)
                if shared:
                    err.args = (err.args[0] + f" Note: {shared}.",)
                raise err from e
            break  # tightened past the floor: the min-peak plan is the last candidate (below)
        modules = tuple(module_plan(info.stats(f), res.discarded_bytes[f], solver_options) for f in res.checkpointed)
        n_mispriced = len(mispriced)
        try:
            peaks = peaks_of(res, modules)
        except RecomputeDivergedError as e:
            leave_out_diverged(e.fqns)
            continue
        traced = max(peaks)
        if traced <= usable:
            break
        over = traced - usable
        culprit = next(reversed(mispriced)) if len(mispriced) > n_mispriced else None
        if culprit is not None:
            # The traced peak falls in the backward of a module this plan checkpoints: the MILP
            # misjudged that module's recompute, so plan again without it at the same target.
            notes.append(f"traced peak {fmt_bytes(traced)} overshot the MILP's "
                         f"{fmt_bytes(res.predicted_peak_bytes)} in the backward of {culprit}: "
                         "planned again without checkpointing it")
            names = allowed if allowed is not None else [s.fqn for s in info.mod_stats]
            milp = SACMilp(info, world_size=world_size, ac_units=[f for f in names if f not in mispriced],
                           fsdp_units=units, options=solver_options)
            continue
        notes.append(
            f"traced peak {fmt_bytes(traced)} overshot the MILP's {fmt_bytes(res.predicted_peak_bytes)}"
            f" by {fmt_bytes(over)}: target tightened"
        )
        # The MILP misjudged this plan by `over`; a neighbouring plan may err the same way, so
        # step past it (twice the miss) plus a small margin so the loop does not creep.
        target -= 2 * over + usable // 1000
    if traced is None or traced > usable:
        # The min-peak plan: the refusal states its traced peak as the smallest budget, so
        # asking for that figure must give this plan.
        while True:  # each pass leaves out at least one module, or ends
            res = full_milp.solve(full_milp.min_reachable_peak_bytes())
            modules = tuple(module_plan(info.stats(f), res.discarded_bytes[f], solver_options)
                            for f in res.checkpointed)
            try:
                peaks = peaks_of(res, modules)
                break
            except RecomputeDivergedError as e:  # a module no attempt above had checkpointed
                leave_out_diverged(e.fqns)
        traced = max(peaks)
        notes.append("the least-recompute plans traced over budget: using the min-peak plan")
    if world_size > 1:
        notes.append("world_size > 1: predicted peak is the planned step's trace, per rank by the FSDP rules"
                     if verify and tensor_parallel else
                     "world_size > 1: predicted peak is the MILP's per-rank figure (not traced)")
    first, steady = peaks
    plan = Plan(
        modules=modules,
        model_name=original_class_name(model),
        model_fingerprint=model_fingerprint(model),
        trainable_numel=model_shape(model).trainable_numel,
        device=est.spec.name,
        world_size=world_size,
        layout=plan_layout(model, units, world_size),
        budget_bytes=budget_bytes,
        reserve_bytes=reserve_bytes,
        predicted_peak_bytes=max(first, steady),
        solver_peak_bytes=max(predict_peak_bytes(first_info, res.discarded_bytes, world_size=world_size),
                              res.predicted_peak_bytes),
        baseline_peak_bytes=res.no_ac_peak_bytes,
        recompute_ms=sum(m.recompute_ms for m in modules),
        baseline_step_ms=est.module_info.step_runtime_ms,
        solver_status=res.status.value,
        solve_time_s=time.perf_counter() - t0,
        notes=tuple(notes),
        first_step_peak_bytes=first,
        steady_peak_bytes=steady,
        step=StepRecord.of(est.step), step_ref=StepRef(est.step),
        **_timeline_fields(info, modules, est.spec, units, world_size),
    )
    if traced > usable:
        need = _min_budget_bytes(floor().usable_bytes, budget_bytes, reserve_bytes, est.spec)
        left_out = ("; left out as unsafe to checkpoint: " + "; ".join(f"{f} ({why})" for f, why in excluded.items())
                    if excluded else "")
        raise _with_floor(PlanningError(
            f"no plan verified under {fmt_bytes(usable)} usable (last traced peak "
            f"{fmt_bytes(traced)}); the smallest budget that verifies is {_gib_up(need):.6f} GiB "
            f"({need:,} bytes)"
            + left_out
        ), need, None)
    return plan


def _timeline_fields(info, modules, spec: DeviceSpec, units, world_size: int) -> dict[str, float]:
    """The plan on the step timeline (compute, exposed comm, step), as Plan fields."""
    layout = step_layout_of(info, spec, fsdp_units=units, world_size=world_size)
    return timeline_fields(plan_timeline(layout, info, modules, spec.host_copy_bytes_per_s))
