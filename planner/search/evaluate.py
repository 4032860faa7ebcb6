"""Each candidate layout's per-rank plan at the device's budget and its modelled step time, one
trace per distinct per-rank program (``planner.search.programs``).

    evaluator = Evaluator(family, cluster, global_batch=512, options=options)
    evaluations = evaluator.screen(layouts)        # every candidate: a MILP plan per rank, a step time
    evaluations = evaluator.verify(evaluations)    # the best ones: plans traced and verified per rank

**Screening** (every candidate): the program is traced once; the candidate's FSDP2 degree is
applied by numbers (``planner.distributed.fsdp.fsdp_module_info``: the FSDP rules on the traced
points) and its plan is the MILP's at the usable budget, the figure ``solve_sac`` reports per rank
without tracing (``verify=False``); a step that fits without a plan needs none (its per-rank peak
is the trace's). Whole-model layouts go fastest bound first (their step with nothing recomputed),
and one whose bound is over the fastest step planned so far is ``BOUNDED`` without its MILP
(``_settle_models``). Pipeline ranks are planned over their schedule (``RankPlanner``).

**Verification** (the ``verify_top`` best of screening, and every candidate the table would call
"fits"): the plan is made as ``solve_sac`` makes it, traced with the plan applied, and its traced
per-rank peak is what the table reports. Only a verified candidate is said to fit.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from estimators.tracing.steady_state import first_step_module_info
from planner.distributed.fsdp import fsdp_module_info
from planner.errors import PlanningError
from planner.format import fmt_bytes, fmt_ms
from planner.planning.candidates import allowed_units
from planner.search.cost import model_step_time, unit_comms
from planner.search.layouts import Cluster, Layout
from planner.search.pipeline_eval import PipelineCases
from planner.search.programs import World
from planner.search.results import Evaluation, Status
from planner.search.workers import default_workers, pull_map
from solver import InfeasibleBudgetError, SACMilp, SolverOptions, predict_peak_bytes
from solver.plan_cost import MemoryModel

__all__ = ["Status", "Evaluation", "Evaluator"]

logger = logging.getLogger(__name__)


@dataclass
class _ModelCase:
    """A whole-model program at one FSDP degree: its per-rank points and MILP (built once)."""

    info: Any
    first_info: Any
    milp: SACMilp | None = None
    outcome: tuple | None = None


class Evaluator:
    """Screens and verifies layouts of one model on one cluster (see the module docstring)."""

    def __init__(self, family, cluster: Cluster, *, global_batch: int, verify_top: int = 1,
                 verify_all: bool = False, bound: bool = True, ac_units=None,
                 solver: SolverOptions | None = None, progress: bool = False, full_ac=frozenset(),
                 workers: int | None = None) -> None:
        self.family, self.cluster, self.global_batch = family, cluster, global_batch
        self.workers = default_workers() if workers is None else workers
        """Processes that screen the (TP, CP) worlds (1: this one alone)."""
        self.full_ac = frozenset(full_ac)
        """Whole-model layouts also evaluated with every block fully checkpointed (a recipe's FullAC)."""
        self.full_ac_results: dict[Layout, Evaluation] = {}
        self.verify_top, self.verify_all, self.ac_units = verify_top, verify_all, ac_units
        self.bound = bound
        self.solver = solver or SolverOptions()
        self.progress = progress
        self.progress_ticks = True
        self.traced = 0
        self.trace_s = 0.0
        self._speculated: tuple[Layout, Evaluation] | None = None
        """(layout, its verification) made beside the pipeline screening (``_screen_pipelines``)."""
        self._open: World | None = None
        self._pending: dict[Layout, Any] = {}
        self._seen: dict[Layout, Evaluation] = {}
        """The pipeline screening's bounds, and what this process has evaluated (``_pipeline_task``)."""
        self._best_model: Any = None
        """The fastest whole-model step planned so far by any screening process (a shared double)."""
        self.stage_cache: dict = {}
        """Stage traces and rank planners, kept across the search's Worlds (``World.trace_stages``)."""
        self.t0 = time.perf_counter()
        self.done = 0
        self.total = 0

    # ------------------------------------------------------------------ screening
    def screen(self, layouts) -> list[Evaluation]:
        """Every layout planned per rank (MILP) and timed; one World per (TP, CP) at a time.

        First every whole-model layout, and each pipeline layout's bounds (``cost.pipeline_bound``,
        from the whole-model program); then the pipeline layouts, each traced only while its step
        bound is under the fastest planned step (``_screen_pipelines``). Both parts run their
        (TP, CP) worlds in ``workers`` processes (``planner.search.workers.pull_map``): they share
        nothing, and the result is one process's."""
        self.total = len(layouts)
        groups: dict[tuple[int, int], list[Layout]] = {}
        for t in layouts:
            groups.setdefault((t.tp, t.cp), []).append(t)
        items = sorted(groups.items(), key=lambda kv: (-_world_cost(kv), kv[0]))
        out: dict[Layout, Evaluation] = {}
        pending: dict[Layout, Any] = {}
        self._best_model = multiprocessing.get_context("fork").Value("d", float("inf"))
        for ((part_out, part_pending, full_ac, done), *_), in_child in self._pull(self._screen_worlds, items):
            out.update(part_out)
            pending.update(part_pending)
            self.full_ac_results.update(full_ac)
            if in_child:
                self.done += done
        self._settle_models(out)
        self._screen_pipelines(pending, out)
        return [out[t] for t in layouts]

    def _pull(self, fn, items) -> list[tuple[Any, bool]]:
        """``pull_map`` over the workers: each task returns ``(value, programs traced, trace
        seconds)``; what a child traced is added to this process's counts."""
        got = pull_map(fn, items, self.workers, child_setup=self._as_child, finish=self._close_world)
        for (_value, traced, trace_s), in_child in got:
            if in_child:
                self.traced += traced
                self.trace_s += trace_s
        return got

    def _as_child(self) -> None:
        self.progress_ticks = False  # the parent counts the layouts evaluated

    def _world(self, tp: int, cp: int) -> World:
        """The (TP, CP) world the pipeline tasks of this process run in: kept open while the next
        task has the same degrees (``_close_world`` after the last)."""
        if self._open is not None and (self._open.tp, self._open.cp) != (tp, cp):
            self._close_world()
        if self._open is None:
            self._open = World(self.family, self.cluster, tp=tp, cp=cp, progress=self.progress,
                               stage_cache=self.stage_cache).__enter__()
        return self._open

    def _close_world(self) -> None:
        if self._open is not None:
            world, self._open = self._open, None
            world.__exit__(None, None, None)

    def _screen_worlds(self, item) -> tuple:
        """The whole-model layouts and pipeline bounds of one (TP, CP) world: ((evaluations,
        pipeline bounds, FullAC evaluations, layouts done), programs traced, trace seconds)."""
        out: dict[Layout, Evaluation] = {}
        pending: dict[Layout, Any] = {}
        traced, trace_s, done = self.traced, self.trace_s, self.done
        (tp, cp), group = item
        if cp > 1:  # checked before a world is built: the stage step has no context
            for t in (t for t in group if t.pp > 1):
                out[t] = Evaluation(layout=t, status=Status.NOT_EVALUATED, why=(
                    "PP x CP is not planned: a pipeline stage's step runs no context (context_parallel)"))
                self._tick()
            group = [t for t in group if t.pp == 1]
        if group:
            with World(self.family, self.cluster, tp=tp, cp=cp, progress=self.progress,
                       stage_cache=self.stage_cache) as world:
                pipes = PipelineCases(self, world)
                refusal = pp_tp_refusal(world) if tp > 1 and any(t.pp > 1 for t in group) else ""
                models = sorted((t for t in group if t.pp == 1), key=lambda t: (t.micro_batch, -t.dp_shard))
                bounds = {t: self._model_bound(world, t) for t in models}
                for t in sorted(models, key=lambda t: (bounds[t][1].step_ms, t)):
                    out[t] = self._model_candidate(world, t, *bounds[t])
                    self._tick()
                for t in (t for t in group if t.pp > 1):
                    if refusal:
                        out[t] = Evaluation(layout=t, status=Status.NOT_EVALUATED, why=refusal)
                        self._tick()
                    else:
                        pending[t] = pipes.bound(t)
                self.traced += world.traced
                self.trace_s += world.trace_s
        full_ac = {t: e for t, e in self.full_ac_results.items() if t in out}
        return (out, pending, full_ac, self.done - done), self.traced - traced, self.trace_s - trace_s

    def _screen_pipelines(self, pending: dict, out: dict) -> None:
        """The pipeline layouts, as one process screening them by their step bound, fastest first,
        would: a layout is traced only while its bound is under the fastest step planned before it
        (whichever degrees that has), else it is ``BOUNDED``.

        Run by split in the workers (a split's stage traces serve all its layouts; a process keeps
        its (TP, CP) world open for the next split of the same degrees), each split's layouts in
        bound order against what its process planned so far; with workers to spare, the fastest
        planned whole-model layout is verified beside them (``verify`` takes that result where the
        layout is still the one to verify). A process knows no more than one process would at any
        layout, so together they trace a superset of what one process would; the final pass below
        keeps one process's verdict, layout by layout."""
        order = sorted(pending, key=lambda t: (pending[t].step_ms, t))
        self._pending, self._seen = pending, dict(out)
        splits: dict[tuple, list[Layout]] = {}
        for t in order:
            if self._untraced(t, pending[t], out) is None:
                splits.setdefault((t.tp, t.cp, t.pp, t.virtual_stages, t.split_backward, t.micro_batch), []).append(t)
        tasks: list[tuple[str, Any]] = [("verify", e) for e in [self._speculation(out)] if e is not None]
        tasks += sorted((("pipelines", layouts) for layouts in splits.values()),
                        key=lambda task: (-task[1][0].tp, task[1][0].cp, -len(task[1]), task[1][0]))
        planned: dict[Layout, Evaluation] = {}
        self._speculated = None
        for (kind, arg), (res, _in_child) in zip(tasks, self._pull(self._pipeline_task, tasks)):
            if kind == "verify":
                self._speculated = (arg.layout, res[0])
            else:
                planned.update(res[0])
        for t in order:
            e = self._untraced(t, pending[t], out)
            out[t] = planned[t] if e is None else e
            self._tick()

    def _speculation(self, out: dict) -> Evaluation | None:
        """The whole-model layout to verify beside the pipeline screening: the fastest planned one,
        where there are workers to spare and it needs verifying."""
        if self.workers < 2 or self.verify_all or self.verify_top < 1:
            return None
        runs = sorted((e for e in out.values() if e.runs and e.layout.pp == 1), key=lambda e: (e.step_ms, e.layout))
        return runs[0] if runs and runs[0].status is Status.PLANNED else None

    def _pipeline_task(self, task) -> tuple:
        """("verify", evaluation) or ("pipelines", the layouts of one split in bound order):
        (the verified evaluation or the layouts' evaluations, programs traced, trace seconds)."""
        kind, arg = task
        traced, trace_s = self.traced, self.trace_s
        if kind == "verify":
            self._close_world()  # one fake process group at a time
            got = self._verify_one(arg)
            value: Any = replace(got, plans=tuple(replace(p, step_ref=None) for p in got.plans))  # may cross a pipe
        else:
            world = self._world(arg[0].tp, arg[0].cp)
            traced0, trace_s0 = world.traced, world.trace_s
            pipes, value = PipelineCases(self, world), {}
            for t in arg:
                bound = self._pending[t]
                e = self._untraced(t, bound, self._seen)
                if e is None:
                    e = replace(pipes.evaluate(t), bound_ms=bound.step_ms, floor_bytes=bound.floor_bytes)
                self._seen[t] = value[t] = e
            self.traced += world.traced - traced0
            self.trace_s += world.trace_s - trace_s0
        return value, self.traced - traced, self.trace_s - trace_s

    def _untraced(self, t: Layout, bound, out: dict) -> Evaluation | None:
        """Over budget or slower by its bound (not traced), or None: it must be planned."""
        usable = self.cluster.usable_bytes
        if bound.floor_bytes > usable:
            return Evaluation(layout=t, status=Status.OVER, peak_bytes=bound.floor_bytes, binding=f"rank {bound.floor_rank}",
                              bound_ms=bound.step_ms, floor_bytes=bound.floor_bytes, why=(
                f"rank {bound.floor_rank} holds at least {fmt_bytes(bound.floor_bytes)} with every layer checkpointed "
                f"(its state and {bound.in_flight} micro-batches in flight, each keeping what its layers cannot "
                f"discard), over the usable {fmt_bytes(usable)}; not traced"))
        best = min((e.step_ms for e in out.values() if e.runs), default=float("inf"))
        if self.bound and bound.step_ms >= best:
            return Evaluation(layout=t, status=Status.BOUNDED, bound_ms=bound.step_ms, floor_bytes=bound.floor_bytes, why=(
                f"a lower bound of its step (its schedule's compute and the recompute its micro-batches in flight "
                f"force, no communication) is {fmt_ms(bound.step_ms)}, over the fastest planned layout's "
                f"{fmt_ms(best)}; not traced"))
        return None

    def _tick(self) -> None:
        self.done += 1
        if self.progress and self.progress_ticks and (self.done % 10 == 0 or self.done == self.total):
            print(f"[search] {self.done}/{self.total} candidates evaluated, {self.traced} programs traced "
                  f"({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)

    def _case(self, world: World, est, w: int, cache: dict) -> _ModelCase:
        key = (id(est), w)
        if key not in cache:
            info = fsdp_module_info(est.module_info, world.units, w) if w > 1 else est.module_info
            cache[key] = _ModelCase(info=info, first_info=first_step_module_info(info))
        return cache[key]

    def _model_bound(self, world: World, t: Layout) -> tuple:
        """(FSDP2's unit collectives, ``t``'s step with nothing recomputed): its program traced, no
        plan; a lower bound of its step under any plan, as recompute only adds to a segment of the
        step's fixed-order timeline."""
        est = world.trace_model(micro_batch=t.micro_batch, accumulation=t.accumulation)
        case = self._case(world, est, t.fsdp_size, world.cache)
        comm = self._comm(case, world, t)
        return comm, model_step_time(est, case.info, {}, comm, accumulation=t.accumulation)

    def _model_candidate(self, world: World, t: Layout, comm, bound) -> Evaluation:
        """``t`` planned at the usable budget, or ``BOUNDED`` without its MILP where it needs one and
        ``bound`` (``_model_bound``) is over the fastest whole-model step planned so far."""
        est = world.trace_model(micro_batch=t.micro_batch, accumulation=t.accumulation)
        w = t.fsdp_size
        case = self._case(world, est, w, world.cache)
        program = f"TP {t.tp} x CP {t.cp}, micro-batch {t.micro_batch} ({len(est.trace.ops):,} ops traced)"
        if t in self.full_ac:
            self.full_ac_results[t] = self._full_ac(est, case, comm, t, program)
        if case.outcome is None:
            unplanned = self._peak(case, {}, w)
            if unplanned <= self.cluster.usable_bytes:
                case.outcome = ({}, unplanned, None, "")
            elif self.bound and t not in self.full_ac and bound.step_ms > self._best_model.value:
                return self._bounded_model(t, bound.step_ms, self._best_model.value, program)
            else:
                case.outcome = self._plan_points(case, world.units, w)
        discards, peak, floor, why = case.outcome
        if peak is None:
            return Evaluation(layout=t, status=Status.OVER, peak_bytes=floor, binding="every rank",
                              why=why, program=program, bound_ms=bound.step_ms)
        st = bound if not discards else model_step_time(est, case.info, discards, comm, accumulation=t.accumulation)
        with self._best_model.get_lock():
            self._best_model.value = min(self._best_model.value, st.step_ms)
        return Evaluation(layout=t, status=Status.FITS if not discards else Status.PLANNED, peak_bytes=peak,
                          binding="every rank", checkpointed=len(discards), time=st, program=program,
                          bound_ms=bound.step_ms)

    @staticmethod
    def _bounded_model(t: Layout, bound_ms: float, best_ms: float, program: str) -> Evaluation:
        return Evaluation(layout=t, status=Status.BOUNDED, bound_ms=bound_ms, program=program, why=(
            f"a lower bound of its step (its traced compute and exposed communication, nothing recomputed) is "
            f"{fmt_ms(bound_ms)}, over the fastest planned layout's {fmt_ms(best_ms)}; not planned"))

    def _settle_models(self, out: dict) -> None:
        """The whole-model verdicts one process would reach screening them by bound, fastest first:
        a layout that needs a plan is ``BOUNDED`` where its bound is over the fastest step planned
        before it. A process bounds a layout only where a planned one's step (at least that one's
        bound, so earlier in this order) is under its bound, so each one bounded there is bounded
        here, and every other one here was planned there: the result does not depend on the split."""
        if not self.bound:
            return
        best = float("inf")
        models = [t for t, e in out.items() if t.pp == 1 and e.bound_ms is not None]
        for t in sorted(models, key=lambda t: (out[t].bound_ms, t)):
            e = out[t]
            needs_plan = not (e.status is Status.FITS and e.checkpointed == 0)
            if needs_plan and t not in self.full_ac and e.bound_ms > best:
                out[t] = self._bounded_model(t, e.bound_ms, best, e.program)
            elif e.status is Status.BOUNDED:
                raise RuntimeError(f"search: {t.describe()} was bounded by a screening process but not by the "
                                   "one-process order; this is a bug, please report it")
            elif e.runs:
                best = min(best, e.step_ms)

    def _comm(self, case: _ModelCase, world: World, t: Layout):
        w = t.fsdp_size
        return unit_comms(case.info, world.units, w, self.cluster.link(w, t.tp), replicas=t.dp_replicate,
                          replica_link=self.cluster.link(t.dp_replicate, t.tp * t.cp * t.dp_shard))

    def _full_ac(self, est, case: _ModelCase, comm, t: Layout, program: str) -> Evaluation:
        """``t`` with every block fully checkpointed (torchtitan's FullAC), by the MILP's memory model."""
        from planner.planning.baselines import find_blocks

        discards = {b: case.info.stats(b).sac_memory_bytes for b in find_blocks(case.info)}
        peak = self._peak(case, discards, t.fsdp_size)
        st = model_step_time(est, case.info, discards, comm, accumulation=t.accumulation)
        status = Status.PLANNED if peak <= self.cluster.usable_bytes else Status.OVER
        return Evaluation(layout=t, status=status, peak_bytes=peak, binding="every rank",
                          checkpointed=len(discards), time=st, program=program + ", every block checkpointed")

    @staticmethod
    def _peak(case: _ModelCase, discards, w: int) -> int:
        """The per-rank peak with these discards, first step and steady state (FSDP rules applied)."""
        return max(predict_peak_bytes(case.first_info, discards, world_size=w),
                   predict_peak_bytes(case.info, discards, world_size=w))

    def _plan_points(self, case: _ModelCase, units, w: int):
        """(discards, per-rank peak, floor, why) of the MILP's plan at the usable budget, for a
        step that does not fit unplanned."""
        usable = self.cluster.usable_bytes
        allowed, _ = allowed_units(case.info, self.ac_units)
        case.milp = SACMilp(case.info, world_size=w, ac_units=allowed, fsdp_units=units, options=self.solver)
        target = usable
        for _ in range(3):
            try:
                res = case.milp.solve(target)
            except InfeasibleBudgetError as e:
                return None, None, e.min_reachable_peak_bytes, self._floor_text(case, w, e.min_reachable_peak_bytes)
            peak = self._peak(case, res.discarded_bytes, w)
            if peak <= usable:
                return dict(res.discarded_bytes), peak, None, ""
            target -= peak - usable  # the first step binds: ask the steady state for less
        floor = case.milp.min_reachable_peak_bytes()
        return None, None, floor, self._floor_text(case, w, floor)

    def _floor_text(self, case: _ModelCase, w: int, floor: int) -> str:
        """Which rank, what fills it at the smallest reachable peak (the MILP's min-peak plan)."""
        discards = case.milp.min_peak_plan()  # found with the floor: no solve more
        mm = MemoryModel(case.info, w)
        pts = mm.point_bytes(discards)
        i = max(range(len(pts)), key=pts.__getitem__)
        p = case.info.memory_points[i]
        state = -(-(p.param_bytes + p.grad_bytes + p.optimizer_bytes) // w)
        acts = pts[i] - state - p.other_bytes
        where = f"{p.phase.value} of {p.fqn or 'the loss'}"
        return (f"every rank (alike) at least {fmt_bytes(floor)} with the most checkpointing, at the "
                f"{where}: sharded state {fmt_bytes(state)}, activations kept {fmt_bytes(max(0, acts))}, "
                f"FSDP2 buffers and temporaries {fmt_bytes(p.other_bytes)}; usable {fmt_bytes(self.cluster.usable_bytes)}")

    # ------------------------------------------------------------------ verification
    def verify(self, evaluations: list[Evaluation]) -> list[Evaluation]:
        """Trace the planned candidates in rank order, as ``solve_sac`` plans them, until the
        fastest is verified (FITS) or ``verify_top`` were traced; one that traces over the budget
        becomes OVER and the next one is tried. ``verify_all``: every planned candidate."""
        done: dict[Layout, Evaluation] = {}
        if self.verify_all:
            for e in evaluations:
                if e.status is Status.PLANNED:
                    done[e.layout] = self._verify_one(e)
            return [done.get(e.layout, e) for e in evaluations]
        tried = 0
        while tried < self.verify_top:
            ranked = sorted((done.get(e.layout, e) for e in evaluations if done.get(e.layout, e).runs),
                            key=lambda e: (e.step_ms, e.layout))
            if not ranked or ranked[0].status is Status.FITS:
                break
            e = ranked[0]
            if self._speculated is not None and self._speculated[0] == e.layout:
                done[e.layout] = self._speculated[1]
            else:
                done[e.layout] = self._verify_one(e)
            tried += 1
        return [done.get(e.layout, e) for e in evaluations]

    def _verify_one(self, e: Evaluation) -> Evaluation:
        t0 = time.perf_counter()
        if e.layout.pp > 1:  # fake_layout_rank makes each rank's fake process group
            cases = PipelineCases(self, None)
            got = cases.verify(e)
            self.traced += cases.traced
            self.trace_s += time.perf_counter() - t0
        else:
            with World(self.family, self.cluster, tp=e.layout.tp, cp=e.layout.cp, progress=self.progress) as world:
                got = self._verify_model(world, e)
                self.traced += world.traced
                self.trace_s += world.trace_s
        if self.progress:
            print(f"[search] verified {e.layout.describe()}: {got.status.value} ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
        return got

    def _verify_model(self, world: World, e: Evaluation) -> Evaluation:
        from planner.distributed.layout import has_dtensors
        from planner.planning import verification
        from planner.planning.solve import plan_for_budget
        from planner.planning.reserve import default_reserve_bytes

        t = e.layout
        est = world.trace_model(micro_batch=t.micro_batch, accumulation=t.accumulation)
        w = t.fsdp_size
        budget = self.cluster.budget_bytes
        try:
            plan = plan_for_budget(world.model, est, budget, world_size=w, fsdp_units=world.units if w > 1 else None,
                                   reserve_bytes=default_reserve_bytes(est.spec, budget), ac_units=self.ac_units,
                                   solver_options=self.solver, verify=True)
        except PlanningError as err:
            return replace(e, status=Status.OVER, why=f"verification: {err}")
        if has_dtensors(world.model):  # solve_sac traced the planned step per rank already
            traced = plan.predicted_peak_bytes
        else:  # FSDP only: solve_sac states the MILP's per-rank figure; trace the plan here
            planned = verification.traced_or_diverged(world.model, plan.modules, est)
            traced = max(verification.per_rank_peaks(planned, world.units if w > 1 else None, w))
        if traced > plan.usable_budget_bytes:
            return replace(e, status=Status.OVER, peak_bytes=traced,
                           why=f"the plan traced at {fmt_bytes(traced)} per rank, over the usable "
                               f"{fmt_bytes(plan.usable_budget_bytes)}")
        case = self._case(world, est, w, {})
        discards = {m.fqn: m.discarded_bytes for m in plan.modules}
        st = model_step_time(est, case.info, discards, self._comm(case, world, t), accumulation=t.accumulation)
        return replace(e, status=Status.FITS, peak_bytes=traced, checkpointed=len(plan.modules), time=st,
                       plans=(plan,))


def pp_tp_refusal(world: World) -> str:
    """Why a TP-parallel pipeline stage cannot be planned here, or "" once it can: the planner's
    own check (``planner.distributed.layout.check_parallel_support``) on the world's parallelized
    model as a stage, so the search turns PP x TP on when the planner does."""
    from torch.distributed.pipelining import Schedule1F1B

    from planner.distributed.layout import check_parallel_support
    from planner.options import Pipeline, PlanOptions

    options = PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=2, stage_index=0, n_stages=2))
    try:
        check_parallel_support(world.model, options)
    except PlanningError as e:
        return "PP x TP planning not built (" + str(e).split(":")[0] + ")"
    return ""


def _world_cost(item) -> float:
    """A (TP, CP) world's screening work, roughly: a trace per micro-batch, a plan per whole-model
    layout, a bound per pipeline layout."""
    (_tp, _cp), group = item
    return 4.0 * len({t.micro_batch for t in group}) + sum(1.0 if t.pp == 1 else 0.2 for t in group)
