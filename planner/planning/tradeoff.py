"""Trade-off curves: the least recompute time the planner finds at each memory budget.

    from planner.planning.tradeoff import tradeoff_curve
    table = tradeoff_curve(est.module_info, n_points=20)    # or a model: traced once
    for p in table.pareto:
        print(p.predicted_peak_bytes, p.recompute_ms)

One ``SACMilp`` is built and re-solved with a new budget for every point, so the sweep pays the
model build once. Each row is costed by the solver's exact model: the peak is
``predict_peak_bytes`` of the plan, the recompute time is each checkpointed module's
``module_recompute_ms`` (fixed cost + exact trade-off curve), the same numbers the baselines in
``planner.planning.baselines`` are costed with.

What is reused across budgets: one ``SACMilp`` (its exact program and its MILP are built once;
a solve changes only the budget), the smallest reachable peak (one solve, then every budget below it is marked
infeasible without a solve), and plans: budgets are solved largest first, and a plan proven
optimal at one budget whose peak fits the next smaller budget is optimal there too (the least
recompute never falls as the budget shrinks), so that budget needs no solve. The backend is
called directly (``solver/milp/linear_model.py``), so a solve pays no model-building in Python. Rows
come back in ascending order. No warm start is passed to the
backend: measured with CBC's ``warmStart`` it did not help (``benchmarks/tradeoff_sweep.py
--warm-start``), because the slow points find their best plan early and spend the time proving
the lower bound, which a start does not move.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from estimators.contract.module_info import ModuleInfo
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import Estimate, EstimateOptions, as_train_step, estimate
from planner.options import PlanOptions
from planner.planning.floor import floor_text, lowering_hints, peak_breakdown
from solver import InfeasibleBudgetError, SACMilp, SolverOptions
from solver.errors import SolverTimeoutError

__all__ = [
    "PointStatus",
    "TradeoffPoint",
    "TradeoffTable",
    "tradeoff_curve",
    "default_budgets",
    "mark_pareto",
    "pareto_mask",
    "step_time_curves",
    "StepTimeCurves",
    "StepTimePoint",
    "BaselineStep",
]

logger = logging.getLogger(__name__)


class PointStatus(str, enum.Enum):
    """Outcome of one budget of a sweep (a ``str``: ``status == "infeasible"`` works)."""

    OPTIMAL = "optimal"
    """Least recompute time, proven within ``SolverOptions.rel_gap``."""
    FEASIBLE = "feasible"
    """Fits, but not proven least: the time limit stopped the search (see ``gap``), or a plan
    traced below the MILP's smallest reachable peak (a module that runs more than once per step,
    which the MILP under-rates: ``TradeoffTable.notes``)."""
    INFEASIBLE = "infeasible"
    """Below the smallest peak any plan reaches (``TradeoffTable.min_reachable_peak_bytes``)."""
    TIMEOUT = "timeout"
    """The backend found no plan within ``SolverOptions.time_limit_s``."""


@dataclass(frozen=True, kw_only=True)
class TradeoffPoint:
    """One budget of a sweep and the plan the solver found for it.

    >>> p = TradeoffPoint(budget_bytes=2**30, status=PointStatus.OPTIMAL,
    ...                   predicted_peak_bytes=2**30 - 5, recompute_ms=3.0, checkpointed=("M.a",))
    >>> p.feasible, p.n_checkpointed
    (True, 1)
    """

    budget_bytes: int
    """Per-rank budget the solver was given."""
    status: PointStatus
    predicted_peak_bytes: int | None = None
    """Exact model peak of the plan (<= budget); None when there is no plan."""
    recompute_ms: float | None = None
    """Recompute time of the plan in one micro-batch (the step's with one micro-batch); None
    when there is no plan."""
    recompute_pct_of_step: float | None = None
    """``recompute_ms`` as a percentage of the no-AC ``TradeoffTable.step_ms`` (None without a
    plan or step time): with several micro-batches both are one micro-batch's, plus the optimizer
    step once."""
    checkpointed: tuple[str, ...] = ()
    """Checkpointed modules, in forward pre-order."""
    on_pareto: bool = False
    """No other point of the table has <= peak and <= recompute with one of them strictly less."""
    gap: float | None = None
    """Relative optimality gap the backend reported."""
    solve_time_s: float = 0.0
    """Wall time of this point's solve (the shared model build is in ``TradeoffTable``)."""

    @property
    def feasible(self) -> bool:
        return self.status in (PointStatus.OPTIMAL, PointStatus.FEASIBLE)

    @property
    def n_checkpointed(self) -> int:
        return len(self.checkpointed)


@dataclass(frozen=True, kw_only=True)
class TradeoffTable:
    """A budget sweep: one row per budget, ascending, with the Pareto frontier marked.

    >>> table = tradeoff_curve(info, n_points=10)            # doctest: +SKIP
    >>> table.cheapest_under(int(0.6 * table.no_ac_peak_bytes)).recompute_ms  # doctest: +SKIP
    """

    rows: tuple[TradeoffPoint, ...]
    step_ms: float
    """Time without checkpointing of one micro-batch's forward + backward plus the optimizer
    step (the whole step with one micro-batch), in ms."""
    no_ac_peak_bytes: int
    """Per-rank peak without checkpointing, of the step as it runs under a plan: for an HF model
    with ``use_cache`` on, traced with the cache off (``solve_sac``'s plan notes give the cache-on
    figure too, one more trace; on a tiny Mistral under bf16 it was about 9 KB higher)."""
    min_reachable_peak_bytes: int
    """Smallest per-rank peak any plan reaches: the smallest feasible budget."""
    world_size: int
    build_time_s: float = 0.0
    """Building the MILP and finding the smallest reachable peak (paid once)."""
    sweep_time_s: float = 0.0
    """All the per-budget solves together."""
    notes: tuple[str, ...] = ()
    """What the table should be read with, e.g. a module called more than once per step whose
    fully checkpointed plan, traced, peaks under the MILP's smallest reachable peak."""

    @property
    def feasible_rows(self) -> tuple[TradeoffPoint, ...]:
        return tuple(r for r in self.rows if r.feasible)

    @property
    def pareto(self) -> tuple[TradeoffPoint, ...]:
        """Frontier points, by ascending peak."""
        return tuple(sorted((r for r in self.rows if r.on_pareto),
                            key=lambda r: (r.predicted_peak_bytes, r.recompute_ms)))

    def cheapest_under(self, peak_bytes: int) -> TradeoffPoint | None:
        """Feasible row of least recompute whose predicted peak is <= ``peak_bytes`` (ties: lower
        peak); None if no row fits. A row of the sweep only: to plan for a limit, plan at the
        limit itself (``solve_sac``), which takes any plan under it and so never recomputes more
        (between two rows the lower one can cost far more)."""
        fits = [r for r in self.feasible_rows if r.predicted_peak_bytes <= peak_bytes]
        return min(fits, key=lambda r: (r.recompute_ms, r.predicted_peak_bytes), default=None)


# ----------------------------------------------------------------------------- Pareto
def pareto_mask(points: Sequence[tuple[float, float] | None]) -> list[bool]:
    """For (peak, recompute) pairs, whether each is non-dominated; ``None`` entries are False.

    A point is dominated when another has <= peak and <= recompute, one of them strictly less.
    Equal points do not dominate each other. Comparisons are exact.

    >>> pareto_mask([(10, 1.0), (8, 2.0), (9, 2.0), None, (8, 2.0)])
    [True, True, False, False, True]
    """
    valid = [p for p in points if p is not None]
    return [
        p is not None and not any(
            q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in valid
        )
        for p in points
    ]


def mark_pareto(rows: Sequence[TradeoffPoint]) -> tuple[TradeoffPoint, ...]:
    """Copies of ``rows`` with ``on_pareto`` set; infeasible rows are never on the frontier."""
    pairs = [(r.predicted_peak_bytes, r.recompute_ms) if r.feasible else None for r in rows]
    return tuple(replace(r, on_pareto=m) for r, m in zip(rows, pareto_mask(pairs)))


# ----------------------------------------------------------------------------- budgets
def default_budgets(min_peak_bytes: int, max_peak_bytes: int, n_points: int) -> list[int]:
    """``n_points`` budgets evenly spaced from ``min_peak_bytes`` to ``max_peak_bytes``, both
    included (fewer when the range has fewer distinct byte counts).

    >>> default_budgets(100, 200, 3)
    [100, 150, 200]
    """
    _check_n_points(n_points)
    if max_peak_bytes <= min_peak_bytes:
        return [int(max_peak_bytes)]
    span = max_peak_bytes - min_peak_bytes
    out = [min_peak_bytes + (span * i) // (n_points - 1) for i in range(n_points)]
    return sorted(set(int(b) for b in out))


def _check_n_points(n_points: int) -> None:
    if isinstance(n_points, bool) or not isinstance(n_points, numbers.Integral) or n_points < 2:
        raise ValueError(f"n_points must be an int >= 2, got {n_points!r}")


def _budget_values(budgets: Sequence[float], what: str) -> list[int]:
    """Each value a positive, finite number of bytes (floats are floored to whole bytes)."""
    if isinstance(budgets, (str, bytes)) or not hasattr(budgets, "__iter__"):
        raise ValueError(f"{what} must be a list of byte counts, got {budgets!r}")
    out = []
    for b in budgets:
        ok = isinstance(b, numbers.Real) and not isinstance(b, bool)
        if not ok or not math.isfinite(b) or b <= 0:
            raise ValueError(f"every budget must be a positive, finite number of bytes; got {b!r}")
        if b < 1:
            raise ValueError(f"budget {b!r} is under one byte: budgets are bytes per rank, not "
                             "GiB; pass [int(g * 2**30) for g in budgets]")
        out.append(int(math.floor(b)))
    return out


def _check_budgets(budgets: Sequence[float]) -> list[int]:
    """Positive, finite, strictly ascending byte counts."""
    out = _budget_values(budgets, "budgets")
    if not out:
        raise ValueError("budgets is empty; pass at least one budget in bytes, or None for "
                         "n_points budgets from the smallest reachable peak to the no-AC peak")
    if any(hi <= lo for lo, hi in zip(out, out[1:])):
        shown = list(budgets)[:6]
        raise ValueError(
            "budgets must be distinct and in ascending order (the sweep solves them smallest "
            f"first); pass sorted(set(budgets)) — got {shown}{'...' if len(out) > 6 else ''}"
        )
    return out


# ----------------------------------------------------------------------------- the sweep
def _module_info(source: "torch.nn.Module | Estimate | ModuleInfo", step: TrainStep | None,
                 options: PlanOptions | None) -> tuple[ModuleInfo, "Estimate | None"]:
    """A ModuleInfo as is, an Estimate's, or one traced from a model (once); and the Estimate
    where a model was traced here (None otherwise)."""
    if isinstance(source, (ModuleInfo, Estimate)):
        if step is not None:
            raise ValueError("step describes the step to trace; this sweep was given a "
                             f"{type(source).__name__}, traced already: leave step out")
        if options is not None and options.trace != EstimateOptions():
            raise ValueError("options.trace says how to trace a model; this sweep was given a "
                             f"{type(source).__name__}, traced already: leave trace out")
        return (source, None) if isinstance(source, ModuleInfo) else (source.module_info, None)
    if isinstance(source, torch.nn.Module):
        from planner.applying.checkpointing import hf_cache_off

        options = options or PlanOptions()
        with hf_cache_off(source):  # trace the step as it runs once a plan is applied
            est = estimate(source, as_train_step(source, step), device=options.spec, options=options.trace)
        return est.module_info, est
    raise TypeError(
        "tradeoff_curve needs a torch.nn.Module, an estimators Estimate or a ModuleInfo; got "
        f"{type(source).__name__}"
    )


def _per_rank(info: ModuleInfo, source, options: PlanOptions) -> tuple[ModuleInfo, list[str] | None, int]:
    """``info`` per rank as ``solve_sac`` plans it: with FSDP2's buffers for the options' units
    (a sharded model's own), in its mixed precision; and the units and the ranks sharded over."""
    from planner.distributed.fsdp import FsdpPrecision, per_rank_info
    from planner.distributed.layout import fsdp_options, fsdp_precision

    units, world_size = options.fsdp_units, options.world_size
    if isinstance(source, torch.nn.Module):
        units, world_size = fsdp_options(source, units, world_size)
        precision = fsdp_precision(source, options.fsdp_mp_policy, units)
    else:
        policy = options.fsdp_mp_policy
        precision = None if policy is None else FsdpPrecision(policy.param_dtype, policy.reduce_dtype)
    if units is None:
        return info, None, world_size
    return per_rank_info(info, list(units), world_size, precision), list(units), world_size


def _solve_point(milp: SACMilp, budget: int, min_peak: int, step_ms: float) -> TradeoffPoint:
    t0 = time.perf_counter()
    if budget < min_peak:  # known without a solve: the min-peak solve proved it
        return TradeoffPoint(budget_bytes=budget, status=PointStatus.INFEASIBLE)
    try:
        res = milp.solve(budget)
    except InfeasibleBudgetError:
        return TradeoffPoint(budget_bytes=budget, status=PointStatus.INFEASIBLE,
                             solve_time_s=time.perf_counter() - t0)
    except SolverTimeoutError as e:
        logger.warning("budget %d bytes: %s", budget, e)
        return TradeoffPoint(budget_bytes=budget, status=PointStatus.TIMEOUT,
                             solve_time_s=time.perf_counter() - t0)
    return TradeoffPoint(
        budget_bytes=budget,
        status=PointStatus(res.status.value),
        predicted_peak_bytes=res.predicted_peak_bytes,
        recompute_ms=res.recompute_ms,
        recompute_pct_of_step=100.0 * res.recompute_ms / step_ms if step_ms > 0 else None,
        checkpointed=tuple(res.checkpointed),
        gap=res.gap,
        solve_time_s=time.perf_counter() - t0,
    )


def tradeoff_curve(
    source: "torch.nn.Module | Estimate | ModuleInfo",
    step: TrainStep | None = None,
    *,
    options: PlanOptions | None = None,
    budgets: Sequence[float] | None = None,
    n_points: int = 20,
    extra_budgets: Sequence[float] = (),
) -> TradeoffTable:
    """Solve the planner at every budget and return the budget -> recompute trade-off.

    ``source``: a model (its ``step`` traced once, as ``solve_sac`` traces it: the steady-state
    step), or an ``Estimate`` / ``ModuleInfo`` traced already (then no ``step`` and no
    ``options.trace``). ``options``: device, world size, solver and trace settings as for
    ``solve_sac`` (large models want ``PlanOptions(solver=SolverOptions(time_limit_s=...))``:
    every point pays up to that limit). ``budgets`` (bytes per rank) must be distinct and
    ascending; default: ``n_points`` evenly spaced from the smallest reachable peak to the no-AC
    peak. Budgets below the smallest reachable peak become ``"infeasible"`` rows and the sweep
    goes on; so do budgets the backend times out on (``"timeout"``). ``extra_budgets`` (any
    order, duplicates dropped) are merged into the grid, e.g. the baselines' peaks, so that each
    baseline has a planner point at exactly its peak. A model with modules that run more than
    once per step (weight sharing) is traced once more, with those fully checkpointed, as
    ``solve_sac`` does under the MILP's floor: the table's floor is then what ``solve_sac``
    reaches, and ``notes`` says so.

    Example::

        table = tradeoff_curve(model, TrainStep(inputs=batch, optimizer="adamw"),
                               options=PlanOptions(device="h100"))
        print(planner.analysis.report.tradeoff_table_text(table))
    """
    checked = None if budgets is None else _check_budgets(budgets)
    if checked is None:
        _check_n_points(n_points)  # before the trace and the min-peak solve
    extra = _budget_values(extra_budgets, "extra_budgets")
    info, est = _module_info(source, step, options)
    options = options or PlanOptions()
    info, units, world_size = _per_rank(info, source, options)
    solver_options = options.solver
    t0 = time.perf_counter()
    milp = SACMilp(info, world_size=world_size, fsdp_units=units, options=solver_options)
    min_peak = milp.min_reachable_peak_bytes()
    notes: list[str] = []
    below = None  # a plan traced under the MILP's floor (shared modules), as a row
    if est is not None and world_size == 1:
        below, note = _shared_floor_row(source, est, milp, min_peak, solver_options)
        notes += [note] if note else []
    else:
        notes += _shared_untraced_note(info)
    floor = below.predicted_peak_bytes if below is not None else min_peak
    if floor >= milp.no_ac_peak_bytes:
        notes.append(_nothing_to_lower_note(est, world_size))
    build_s = time.perf_counter() - t0
    if checked is not None and max(checked) * 2**20 <= floor:
        raise ValueError(
            f"every budget is over a million times below the smallest reachable peak "
            f"({floor:,} bytes): budgets are bytes per rank, not GiB; pass "
            f"[int(g * 2**30) for g in budgets] (got {list(budgets)[:6]})"
        )
    if checked is None:
        checked = default_budgets(floor, milp.no_ac_peak_bytes, n_points)
    checked = sorted(set(checked) | set(extra))
    step_ms = info.step_runtime_ms
    t1 = time.perf_counter()
    rows: list[TradeoffPoint] = []
    for budget in reversed(checked):  # largest first: a plan may serve the budgets below it
        prev = rows[-1] if rows else None
        if (prev is not None and prev.status is PointStatus.OPTIMAL
                and prev.predicted_peak_bytes is not None and prev.predicted_peak_bytes <= budget):
            # Optimal at a larger budget and fits this one: optimal here too (the least
            # recompute never falls as the budget shrinks), within the same proven gap.
            rows.append(replace(prev, budget_bytes=budget, solve_time_s=0.0))
        else:
            row = _solve_point(milp, budget, min_peak, step_ms)
            if (below is not None and below.predicted_peak_bytes <= budget
                    and (not row.feasible or below.recompute_ms < row.recompute_ms)):
                row = replace(below, budget_bytes=budget)  # the traced plan fits, and for less
            rows.append(row)
        logger.debug("budget %d: %s in %.3fs", budget, rows[-1].status.value, rows[-1].solve_time_s)
    rows.reverse()
    return TradeoffTable(
        rows=mark_pareto(rows),
        step_ms=step_ms,
        no_ac_peak_bytes=milp.no_ac_peak_bytes,
        min_reachable_peak_bytes=floor,
        world_size=milp.world_size,
        build_time_s=build_s,
        sweep_time_s=time.perf_counter() - t1,
        notes=tuple(notes),
    )


def _nothing_to_lower_note(est: "Estimate | None", world_size: int) -> str:
    """Why no plan lowers the peak: at the peak op no activation a checkpoint could drop is alive
    (the optimizer step, a loss on full logits, a net of in-place ops), and what the step holds
    there (traced estimates on one rank)."""
    note = ("no plan lowers the peak: where the step peaks, no activation that checkpointing could "
            "drop is alive")
    if est is None or world_size != 1:
        return note
    b = peak_breakdown(est)
    hints = lowering_hints(b)
    return f"{note}; {floor_text(b)}" + (f"; what would lower it: {'; '.join(hints)}" if hints else "")


def _shared(info) -> tuple[list[str], str]:
    """The outermost candidates that run more than once per step, as ``solve_sac`` finds them,
    and the plan note on them ("" if none)."""
    from planner.planning import plan_notes
    from planner.planning.candidates import allowed_units, shared_modules

    allowed, excluded = allowed_units(info, None)
    shared = shared_modules(info, allowed, excluded)
    return shared, plan_notes.shared_note(info, shared)


def _shared_untraced_note(info) -> list[str]:
    """The shared-module note where there is no model to trace (a ModuleInfo, an Estimate, or
    world_size > 1): the floor stated is the MILP's, which may be above what is reachable."""
    note = _shared(info)[1]
    return [note + "; this table states the MILP's floor (pass the model, world_size 1, to trace "
            "that plan)"] if note else []


def _shared_floor_row(model, est, milp: SACMilp, min_peak: int,
                      options: SolverOptions | None) -> tuple[TradeoffPoint | None, str]:
    """For a model with modules that run more than once per step, the plan ``solve_sac`` takes
    under the MILP's floor (the min-peak plan with those modules fully checkpointed), traced:
    a row where it peaks under ``min_peak``, and the note to read the table with. The MILP
    prices such a module with one window, so its floor can sit above what is reachable."""
    from planner.applying.checkpointing import hf_cache_off
    from planner.planning.candidates import shared_full_plan

    info = est.module_info
    shared, note = _shared(info)
    if not shared:
        return None, ""
    try:
        with hf_cache_off(model):
            found = shared_full_plan(model, est, info, milp, shared, options)
    except Exception as exc:  # the extra row must never cost the sweep itself
        logger.warning("could not trace the plan with %s fully checkpointed: %s", ", ".join(shared), exc)
        found = None
    if found is None:
        return None, note
    _, modules, planned = found
    peak = max(planned.first_step_peak_bytes, planned.steady_peak_bytes)
    if peak >= min_peak:
        return None, note
    recompute, step_ms = sum(m.recompute_ms for m in modules), info.step_runtime_ms
    return TradeoffPoint(
        budget_bytes=peak, status=PointStatus.FEASIBLE, predicted_peak_bytes=peak,
        recompute_ms=recompute,
        recompute_pct_of_step=100.0 * recompute / step_ms if step_ms > 0 else None,
        checkpointed=tuple(m.fqn for m in modules),
    ), note + (f"; rows from {peak:,} B take that plan, traced, where the MILP has none (under its "
               f"floor, {min_peak:,} B) or a dearer one")


# ----------------------------------------------------------------------------- step time curves
@dataclass(frozen=True, kw_only=True)
class StepTimePoint:
    """One budget: the recompute-only and the keep / recompute / offload plan on the timeline."""

    budget_bytes: int
    recompute_only_step_ms: float | None = None
    """Step time of the least-recompute plan (``SACMilp``); None when no plan fits."""
    three_way_step_ms: float | None = None
    """Step time of the three-way plan (``solver.offload.milp``); None when no plan fits."""
    three_way_exposed_copy_ms: float | None = None
    three_way_host_bytes: int | None = None
    """Bytes on host (per rank) of the three-way plan."""


@dataclass(frozen=True, kw_only=True)
class BaselineStep:
    """A hand-made baseline (``planner.planning.baselines``) on the step timeline."""

    name: str
    predicted_peak_bytes: int
    step_ms: float


@dataclass(frozen=True, kw_only=True)
class StepTimeCurves:
    """Step time against budget, recompute-only beside keep / recompute / offload."""

    rows: tuple[StepTimePoint, ...]
    baselines: tuple[BaselineStep, ...]
    no_ac_step_ms: float
    """Step on the timeline with nothing planned (exposed communication included)."""
    no_ac_peak_bytes: int


def step_time_curves(
    source: "torch.nn.Module | Estimate | ModuleInfo",
    step: TrainStep | None = None,
    *,
    options: PlanOptions | None = None,
    budgets: Sequence[float] | None = None,
    host_budget_bytes: int | None = None,
    n_points: int = 10,
) -> StepTimeCurves:
    """The step time of recompute-only and three-way plans at every budget, and the hand-made
    baselines', all on the step timeline of ``estimators.contract.timeline`` (a sibling of
    :func:`tradeoff_curve`, which plots recompute time alone). Budgets (bytes per rank)
    default to ``n_points`` from the smallest peak recompute alone reaches to the no-AC peak.

    Example::

        curves = step_time_curves(model, TrainStep(inputs=batch, optimizer="adamw"),
                                  options=PlanOptions(device="h100"))
        print(planner.analysis.report.step_time_curves_text(curves))
    """
    from planner.planning.baselines import hand_made_baselines
    from planner.planning.step_timeline import step_layout_of
    from solver.offload.milp import OffloadMilp

    info, _ = _module_info(source, step, options)
    options = options or PlanOptions()
    info, units, world_size = _per_rank(info, source, options)
    spec, solver_options = options.spec, options.solver
    layout = step_layout_of(info, spec, fsdp_units=units, world_size=world_size)
    sac = SACMilp(info, world_size=world_size, fsdp_units=units, options=solver_options)
    three = OffloadMilp(info, layout, copy_bytes_per_s=spec.host_copy_bytes_per_s,
                        copy_latency_s=spec.host_copy_latency_s, world_size=world_size,
                        host_budget_bytes=host_budget_bytes, fsdp_units=units, options=solver_options,
                        offload=spec.host_copy_bytes_per_s > 0)
    if budgets is None:
        _check_n_points(n_points)
        checked = default_budgets(sac.min_reachable_peak_bytes(), sac.no_ac_peak_bytes, n_points)
    else:
        checked = _check_budgets(budgets)
    rows = []
    for b in checked:
        try:
            rec = sac.solve(b)
        except (InfeasibleBudgetError, SolverTimeoutError):
            rec = None
        try:
            res = three.solve(b, incumbent=rec.discarded_bytes if rec is not None else None)
        except (InfeasibleBudgetError, SolverTimeoutError):
            res = None
        rows.append(StepTimePoint(
            budget_bytes=b,
            recompute_only_step_ms=three.timeline(rec.discarded_bytes, {}).step_ms if rec else None,
            three_way_step_ms=res.step_ms if res else None,
            three_way_exposed_copy_ms=res.timeline.exposed_copy_ms if res else None,
            three_way_host_bytes=res.host_peak_bytes if res else None,
        ))
    try:
        base = hand_made_baselines(info, world_size=world_size)
    except ValueError:  # no repeated blocks: no block baselines
        base = ()
    baselines = []
    for p in base:
        rec_ms = {layout.segment_of_backward(info.stats(f)): 0.0 for f in p.recompute_ms_by_module}
        for f, ms in p.recompute_ms_by_module.items():
            rec_ms[layout.segment_of_backward(info.stats(f))] += ms
        tl = layout.timeline(recompute_ms_by_segment=rec_ms)
        baselines.append(BaselineStep(name=p.name, predicted_peak_bytes=p.predicted_peak_bytes, step_ms=tl.step_ms))
    return StepTimeCurves(rows=tuple(rows), baselines=tuple(baselines),
                          no_ac_step_ms=three.baseline_timeline.step_ms, no_ac_peak_bytes=sac.no_ac_peak_bytes)
