"""Plans for the stages of one pipeline rank, over their schedule.

    plans = solve_pipeline_rank({1: (stage_module, step)}, budget_gib=40,
                                options=PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=8,
                                                                      stage_index=1, n_stages=4)))

Each local stage's micro-batch is traced once, as the schedule's stage runs it
(``estimators.step.stage_step``); the traces are laid out along the rank's action order into the
rank's memory over its schedule (``estimators.pipeline.memory``); one MILP for the rank has the
schedule's rows (``estimators.pipeline.points``: every micro-batch in flight holds what the plan
keeps), so each stage gets its own plan. Every plan is verified as ``solve_sac`` verifies one: each
planned stage is traced again and laid out again; the predicted peak is that, and the target
tightens where it is over.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Mapping

import torch
from torch.utils._pytree import tree_flatten

from estimators.pipeline.fsdp import fsdp_profile
from estimators.pipeline.makespan import bubble_fractions, makespan_ms, simulate
from estimators.pipeline.memory import RankMemory, rank_memory
from estimators.pipeline.points import StageView, rank_module_info, stage_root
from estimators.pipeline.schedule import Runtime
from estimators.pipeline.stage_trace import resident_bytes_at, stage_module_info, stage_profile
from estimators.step.stage_step import StageRole
from estimators.step.train_step import TrainStep, ZeroGrad
from estimators.tracing.estimation import estimate
from estimators.tracing.sharded_model import original_class_name
from planner.distributed.fsdp.stage import stage_fsdp
from planner.distributed.layout import plan_layout
from planner.errors import PlanningError
from planner.format import GiB, check_budget_gib, fmt_bytes
from planner.options import Pipeline, PlanOptions
from planner.plan import Plan, StepRecord, model_fingerprint, model_shape
from planner.plan_pipeline import PipelineRecord
from planner.planning.module_plans import module_plan
from planner.planning.op_steps import settle
from planner.planning.reserve import check_budget_on_device, default_reserve_bytes
from planner.planning.verification import traced_or_diverged
from planner.step_ref import StepRef
from solver import InfeasibleBudgetError, SACMilp

__all__ = ["solve_pipeline_rank", "RankPlanner", "trace_stage"]

logger = logging.getLogger(__name__)

_MAX_TIGHTENINGS = 4


def _tensor_bytes(obj) -> int:
    """The bytes of one micro-batch's tensors: their own elements, not their storages'. A
    micro-batch sliced from the batch the loop holds (``x[:mb]``) views its storage, and the
    schedule's n micro-batches of it are that batch, held once (as they are slices of a dataset
    tensor, they are n of these); a tensor named twice counts once."""
    seen = {}
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor):
            key = (id(t) if t.device.type == "meta" else
                   (id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), t.stride()))
            seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def _stage_step(step: TrainStep, role: StageRole, n_microbatches: int) -> TrainStep:
    """The traced micro-batch: its stage's role, and accumulating into gradients that exist
    (the memory model takes the first backward's gradients out itself)."""
    if step.micro_batches != 1:
        raise PlanningError("a pipeline stage's step is one micro-batch: leave TrainStep.micro_batches at 1 "
                            "and give the schedule's count as Pipeline(n_microbatches=...)")
    if role.is_last and step.target is None:
        raise PlanningError("the last stage computes loss_fn(output, target): pass TrainStep(target=...) "
                            "with one micro-batch's target")
    if not role.is_last and step.target is not None:
        raise PlanningError("only the last stage takes a target (it computes the loss); drop TrainStep.target")
    if step.keep_output:
        raise PlanningError("keep_output does not apply to a pipeline stage (the schedule decides what it "
                            "keeps: Pipeline(return_outputs=...))")
    return dataclasses.replace(step, stage=role, micro_batches=max(2, n_microbatches))


def trace_stage(model: torch.nn.Module, step: TrainStep, role: StageRole, options: PlanOptions):
    """One micro-batch of a pipeline stage traced as ``RankPlanner`` traces it (``Estimate``)."""
    return estimate(model, _stage_step(step, role, options.pipeline.n_microbatches), device=options.spec,
                    options=options.trace)


def _rank_stages(pipeline: Pipeline, stages: Mapping[int, tuple]) -> tuple[int, tuple[int, ...]]:
    layout = pipeline.layout
    rank = layout.rank_of(pipeline.stage_index)
    expected = layout.stages_of(rank)
    if tuple(sorted(stages)) != expected:
        raise PlanningError(
            f"stage {pipeline.stage_index} runs on rank {rank} with stages {list(expected)} "
            f"({layout.schedule_cls.__name__}, {pipeline.n_stages} stages, {pipeline.virtual_stages} per rank); "
            f"give every one of them, got {sorted(stages)}")
    return rank, expected


def _check_stages(stages: object) -> None:
    """``stages`` is {stage index: (module, TrainStep)}; a one-line TypeError otherwise (the
    message names types, never a module's repr)."""
    usage = "pass {stage index: (stage module, TrainStep(...))} for every stage of the rank"
    if not isinstance(stages, Mapping) or not stages:
        raise TypeError(f"stages must be a non-empty dict, got {type(stages).__name__}: {usage}")
    for s, v in stages.items():
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"stages' keys are stage indices (int), got {type(s).__name__}: {usage}")
        if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], torch.nn.Module)
                and isinstance(v[1], TrainStep)):
            got = (f"a tuple of ({', '.join(type(x).__name__ for x in v[:3])}{', ...' if len(v) > 3 else ''})"
                   if isinstance(v, tuple) else f"a {type(v).__name__}")
            raise TypeError(f"stages[{s}] must be a (module, TrainStep) pair, got {got}: {usage}")


def solve_pipeline_rank(stages: Mapping[int, tuple[torch.nn.Module, TrainStep]], budget_gib: float, *,
                        options: PlanOptions) -> dict[int, Plan]:
    """One plan per stage of the rank that runs ``options.pipeline.stage_index``, so that the rank
    fits ``budget_gib`` over its schedule at the least recompute time.

    ``stages``: {stage index: (stage module, one micro-batch's TrainStep)} for every stage of
    that rank (one, or ``virtual_stages``). A step's ``inputs`` are what the stage's forward
    gets (the batch on stage 0, an activation of the right shape elsewhere: fake or meta tensors
    do), its ``loss_fn(output, target)`` and ``target`` the schedule's (last stage only)."""
    if isinstance(options, PlanOptions):  # before any trace (RankPlanner refuses other options)
        check_budget_on_device(int(check_budget_gib(budget_gib) * GiB), options.spec)
    return RankPlanner(stages, options=options).plan(budget_gib)


class RankPlanner:
    """A rank of a pipeline, traced once and planned for any budget (``plan``): the unplanned
    peak over its schedule and the smallest one a plan reaches are known before any budget."""

    def __init__(self, stages: Mapping[int, tuple[torch.nn.Module, TrainStep]], *, options: PlanOptions,
                 estimates: Mapping[int, object] | None = None) -> None:
        """``estimates``: traces of some of the stages to use instead of tracing them (e.g. one
        middle stage's, ``estimators.pipeline.stage_trace.renamed`` for the others): each must be
        of that stage's micro-batch as this planner traces it (its role, device, trace options)."""
        _check_stages(stages)
        pipeline = options.pipeline if isinstance(options, PlanOptions) else None
        if pipeline is None:
            raise PlanningError("planning a pipeline rank needs options=PlanOptions(pipeline=Pipeline(...))")
        if options.offload:
            raise PlanningError("a pipeline stage is planned without offload for now (recompute only): "
                                "plan it with offload=False")
        if options.fsdp_units is not None:
            raise PlanningError("a pipeline stage's FSDP2 units are read from the stage: fully_shard it first "
                                "(torchtitan's order: split, parallelize, fully_shard; examples.pipeline_stages."
                                "shard_llama_stage) and drop fsdp_units")
        t0 = time.perf_counter()
        self.stages = stages
        self.rank, self.local = _rank_stages(pipeline, stages)
        self.fsdp = _stage_fsdp(stages, options)
        split = pipeline.layout.split_backward
        self.traced = {}
        for s in self.local:
            model, step = stages[s]
            role = StageRole(is_first=s == 0, is_last=s == pipeline.n_stages - 1, split_backward=split)
            if estimates is not None and s in estimates:
                if estimates[s].step.stage != role:
                    raise PlanningError(f"the estimate given for stage {s} is of a {_role_text(estimates[s].step.stage)}, "
                                        f"this stage is a {role.describe()}")
                self.traced[s] = estimates[s]
                continue
            self.traced[s] = trace_stage(model, step, role, options)
        for s in self.fsdp:  # gradients the backward makes in other placements (FSDP2 redistributes them)
            if self.traced[s].grad_placements:
                model, step = stages[s]
                self.fsdp[s] = stage_fsdp(model, step.optimizer, options.spec,
                                          grad_placements=self.traced[s].grad_placements)
        self._views = {s: _view(e, s, self.fsdp.get(s)) for s, e in self.traced.items()}
        self._verified: dict[tuple, tuple] = {}
        """(stage, its module plans) -> the planned stage's profile and FSDP2 part (traced once)."""
        self._op_ms: dict[tuple[str, int], float] = {}
        self.trace_time_s = time.perf_counter() - t0
        self._schedule(options)

    def for_options(self, options: PlanOptions) -> "RankPlanner":
        """The same traced stages planned for other options: another schedule or micro-batch
        count over the same stages with the same kind of backward (split or not), another
        device reserve or solver. Shares the traces and verified plans."""
        new, old = options.pipeline, next(iter(self.traced.values())).step.stage
        if new is None or _rank_stages(new, self.stages)[1] != self.local:
            raise PlanningError("for_options keeps the rank's stages: give a Pipeline with the same stages per rank")
        if new.layout.split_backward != old.split_backward:
            raise PlanningError("for_options keeps the traces: the new schedule must split the backward as the old one does")
        if options.spec != self.options.spec or options.trace != self.options.trace or options.world_size != self.options.world_size:
            raise PlanningError("for_options keeps the traces: device, trace options and world_size must not change")
        if self.fsdp:
            _stage_fsdp(self.stages, options)  # FSDP2 stages: what the new schedule does not model is refused
        other = object.__new__(RankPlanner)
        other.__dict__.update({k: v for k, v in self.__dict__.items()})
        other._schedule(options)
        return other

    def _schedule(self, options: PlanOptions) -> None:
        """Lay the traced stages out on ``options.pipeline``'s schedule and build the rank's MILP."""
        pipeline = options.pipeline
        self.options, self.pipeline, self.layout = options, pipeline, pipeline.layout
        n, last, stages = pipeline.n_microbatches, pipeline.n_stages - 1, self.stages
        batch = sum(n * (_tensor_bytes(stages[s][1].inputs) if s == 0 else 0)
                    + n * (_tensor_bytes(stages[s][1].target) if s == last else 0) for s in self.local)
        self.kw = dict(return_outputs=pipeline.return_outputs, batch_bytes=batch,
                       grads_at_start=any(stages[s][1].zero_grad is ZeroGrad.ZERO for s in self.local))
        self.actions = self.layout.actions(self.rank)
        info, self.names = rank_module_info(self._views, self.actions, n, self.layout.runtime, **self.kw)
        allowed = None if options.ac_units is None else [
            f for f, (_s, own) in self.names.items() if own in set(options.ac_units)]
        self.milp = SACMilp(info, ac_units=allowed, options=options.solver)
        self.unplanned = rank_memory(self.actions, {s: v.profile for s, v in self._views.items()}, n,
                                     self.layout.runtime, fsdp=_fsdp_parts(self._views), **self.kw)

    @property
    def unplanned_peak_bytes(self) -> int:
        """The rank's peak over its schedule without a plan."""
        return self.unplanned.peak_bytes

    def unplanned_makespan_ms(self) -> float:
        """The pipeline step without a plan, every stage timed as this rank's stages (the rule of
        ``PipelineRecord.makespan_ms``)."""
        profiles = {s: v.profile for s, v in self._views.items()}
        spans = _uniform_spans(self.layout, profiles)
        return makespan_ms(spans, {r: sum(p.optim_ms for p in profiles.values()) for r in spans})

    def min_peak_bytes(self) -> int:
        """The smallest peak the MILP reaches over the schedule (the smallest budget it takes)."""
        return self.milp.min_reachable_peak_bytes()

    def plan(self, budget_gib: float, *, on_device: bool = True, settle: bool = True) -> dict[int, Plan]:
        """One plan per local stage for ``budget_gib`` (see ``solve_pipeline_rank``).

        ``settle=False``: the MILP's plan as solved, priced on its modules' convex envelopes, not
        moved onto the steps its op plans take (``_on_op_steps``): a search screens every layout
        on the MILP's figures, and settles only the plans it verifies.

        ``on_device=False``: the budget is a stand-in's, not one GPU's, and may exceed its memory
        (the search plans an FSDP2 pipeline rank as one process holding its stages whole, for the
        usable budget less its shift: a rank that holds 1/W of the optimizer state is planned
        for more than the GPU has)."""
        t0 = time.perf_counter()
        budget = int(check_budget_gib(budget_gib) * GiB)
        options = self.options
        if on_device:
            check_budget_on_device(budget, options.spec)
        reserve = (int(options.reserve_gib * GiB) if options.reserve_gib is not None
                   else _default_reserve(options, budget))
        usable = budget - reserve
        target, notes = usable, []
        for attempt in range(_MAX_TIGHTENINGS + 1):
            try:
                res = self.milp.solve(target)
            except InfeasibleBudgetError as e:
                floor = self.min_peak_bytes()
                if attempt > 0:  # tightened past the floor: the min-peak plan is the last candidate
                    break
                raise PlanningError(
                    f"rank {self.rank} ({_where(self.pipeline, self.local)}) cannot fit {fmt_bytes(usable)} usable: "
                    f"the smallest reachable peak over its schedule is {fmt_bytes(floor)} ({floor / GiB:.6f} GiB); "
                    f"unplanned {fmt_bytes(self.unplanned_peak_bytes)}. Raise the budget, or use more micro-batches "
                    "of fewer samples, or more stages") from e
            if settle:
                res = self._on_op_steps(res, target)
            modules = _stage_modules(res.discarded_bytes, self.names, self.traced, options)
            if not options.verify:  # the MILP's figure
                verified, profiles = _MilpFigure(res.predicted_peak_bytes), {s: v.profile for s, v in self._views.items()}
                notes.append("predicted peak is the MILP's over the schedule (not traced: verify=False)")
                break
            verified, profiles = self._verify(modules)
            if verified.peak_bytes <= usable:
                break
            over = verified.peak_bytes - usable
            notes.append(f"verified peak {fmt_bytes(verified.peak_bytes)} overshot the MILP's "
                         f"{fmt_bytes(res.predicted_peak_bytes)} by {fmt_bytes(over)}: target tightened")
            # The MILP misjudged this plan by `over`; a neighbouring plan may err the same way, and a
            # partial discard maps to the same traced plan over a range of targets: step past it,
            # twice as far on each attempt.
            target -= (2 * over + usable // 1000) << attempt
        if verified.peak_bytes > usable:  # every tightened plan verified over: the min-peak plan, if it fits
            res = self.milp.solve(self.min_peak_bytes())
            modules = _stage_modules(res.discarded_bytes, self.names, self.traced, options)
            verified, profiles = self._verify(modules)
            if verified.peak_bytes > usable:
                raise PlanningError(
                    f"no plan for rank {self.rank} ({_where(self.pipeline, self.local)}) verified under "
                    f"{fmt_bytes(usable)}: the min-peak plan verifies at {fmt_bytes(verified.peak_bytes)}. "
                    "Raise the budget to that")
            notes.append("the least-recompute plans verified over budget: using the min-peak plan")
        return _plans(self, profiles, modules, verified, res, budget, reserve, notes,
                      time.perf_counter() - t0 + self.trace_time_s, traced_plans=isinstance(verified, RankMemory))

    def _on_op_steps(self, res, target: int):
        """``res`` settled on the steps its modules' op plans take (``planner.planning.op_steps``):
        each discard a micro-batch in flight repeats, so a partial step the op plan rounds up
        costs its recompute once and frees the bytes the budget did not need once per micro-batch."""
        discards = settle(self.milp, res.discarded_bytes, target, self._recompute_ms)
        if discards == dict(res.discarded_bytes):
            return res
        size = {f: self.milp.memory.stats[f].sac_memory_bytes for f in discards}
        order = [c.fqn for c in self.milp.candidates if c.fqn in discards]
        return dataclasses.replace(
            res, discarded_bytes={f: discards[f] for f in order}, checkpointed=tuple(order),
            decisions={f: discards[f] / size[f] if size[f] else 1.0 for f in order},
            predicted_peak_bytes=self.milp.memory.peak(discards),
            recompute_ms=sum(self._recompute_ms(f, d) for f, d in discards.items()))

    def _recompute_ms(self, fqn: str, discarded: int) -> float:
        """What the op plan of discarding ``discarded`` bytes of the rank's module ``fqn`` recomputes."""
        key = (fqn, discarded)
        if key not in self._op_ms:
            s, own = self.names[fqn]
            stats = self.traced[s].module_info.stats(own)
            self._op_ms[key] = module_plan(stats, discarded, self.options.solver).recompute_ms
        return self._op_ms[key]

    def _verify(self, modules):
        """Every planned stage traced again and the rank laid out again: (RankMemory, profiles)."""
        profiles, fsdp = {}, {}
        for s, est in self.traced.items():
            key = (s, modules[s])
            if key not in self._verified:
                planned = traced_or_diverged(self.stages[s][0], modules[s], est) if modules[s] else est
                view = _view(planned, s, self.fsdp.get(s), module_info=False)
                self._verified[key] = (view.profile, view.fsdp)
            profiles[s], over = self._verified[key]
            if over is not None:
                fsdp[s] = over
        rm = rank_memory(self.actions, profiles, self.pipeline.n_microbatches, self.layout.runtime, fsdp=fsdp,
                         **self.kw)
        return rm, profiles


def _role_text(role) -> str:
    return "plain step (no stage role)" if role is None else role.describe()


def _view(est, s: int, fsdp, *, module_info: bool = True) -> StageView:
    """Stage ``s``'s view of its trace ``est``; an FSDP2 stage's profile as the rank holds it
    (``fsdp``: ``planner.distributed.fsdp.stage.stage_fsdp``'s)."""
    profile, over = stage_profile(est, stage_index=s), None
    if fsdp is not None:
        try:
            profile, over = fsdp_profile(est, profile, fsdp)
        except ValueError as e:
            raise PlanningError(f"stage {s}: {e}") from e
    info = stage_module_info(est)[0] if module_info else None
    return StageView(info, profile, resident_bytes_at(est) if module_info else (), over)


def _fsdp_parts(views) -> dict:
    return {s: v.fsdp for s, v in views.items() if v.fsdp is not None}


def _stage_fsdp(stages, options: PlanOptions) -> dict:
    """{stage: FsdpStage} of the stages ``fully_shard`` sharded (all of the rank's or none), with
    what the rank's memory model does not hold refused."""
    fsdp = {s: stage_fsdp(m, step.optimizer, options.spec) for s, (m, step) in stages.items()}
    sharded = {s: f for s, f in fsdp.items() if f is not None}
    if not sharded:
        if options.world_size > 1:
            raise PlanningError(
                f"world_size={options.world_size} (a mesh's dp dim) inside a pipeline stage means FSDP2 over the "
                "stage's data-parallel group: fully_shard the stage first (torchtitan's order: split, parallelize, "
                "fully_shard; examples.pipeline_stages.shard_llama_stage), the planner reads its units and group "
                "size; a stage each data-parallel rank holds whole (DDP) is planned with world_size=1")
        return {}
    if len(sharded) != len(fsdp):
        raise PlanningError(f"stages {sorted(sharded)} of the rank are sharded by fully_shard and "
                            f"{sorted(set(fsdp) - set(sharded))} are not: shard every stage of the rank or none")
    sizes = {f.world_size for f in sharded.values()}
    if len(sizes) > 1 or options.world_size not in (1, *sizes):
        raise PlanningError(f"world_size={options.world_size} but the rank's stages are sharded over "
                            f"{sorted(sizes)} ranks; drop world_size (it is read from the stages)")
    layout = options.pipeline.layout
    if layout.split_backward:
        raise PlanningError(
            f"FSDP2 inside a pipeline stage is modelled without a split backward; {layout.schedule_cls.__name__}'s "
            "input and weight halves under FSDP2 are not modelled yet: use ScheduleGPipe, Schedule1F1B, "
            "ScheduleInterleaved1F1B or ScheduleLoopedBFS")
    if layout.runtime is Runtime.RUNTIME:
        for s, f in sharded.items():
            root = original_class_name(stages[s][0])
            if any(root in u.modules for u in f.units):
                raise PlanningError(
                    f"stage {s}'s root FSDP2 unit holds parameters: {layout.schedule_cls.__name__} gathers it at the "
                    "step's start (its UNSHARD action), which is not modelled yet; fully_shard the stage's "
                    "parameter-holding children before the stage (examples.pipeline_stages.shard_llama_stage)")
    if any(step.zero_grad is ZeroGrad.ZERO for _, step in stages.values()):
        raise PlanningError("an FSDP2 stage is modelled with its gradients set to None between steps "
                            "(zero_grad(set_to_none=True)); ZeroGrad.ZERO keeps the sharded gradients, which the "
                            "pipeline's reduce then accumulates into: not modelled yet")
    return sharded


class _MilpFigure:
    """The MILP's peak standing for a verified one (no trace: ``verify=False``, or per rank)."""

    def __init__(self, peak_bytes: int) -> None:
        self.peak_bytes, self.peak_where = peak_bytes, "the MILP's peak point"


def _default_reserve(options: PlanOptions, budget: int) -> int:
    return default_reserve_bytes(options.spec, budget)


def _where(pipeline: Pipeline, local: tuple[int, ...]) -> str:
    return (f"stage{'s' if len(local) > 1 else ''} {', '.join(map(str, local))} of {pipeline.n_stages}, "
            f"{pipeline.layout.schedule_cls.__name__}, {pipeline.n_microbatches} micro-batches")


def _stage_modules(discarded: Mapping[str, int], names, traced, options) -> dict[int, tuple]:
    out: dict[int, list] = {s: [] for s in traced}
    for f, d in discarded.items():
        s, own = names[f]
        out[s].append(module_plan(traced[s].module_info.stats(own), d, options.solver))
    return {s: tuple(m) for s, m in out.items()}


def _plans(rp: RankPlanner, profiles, modules, verified, res, budget, reserve, notes, solve_s, *,
           traced_plans: bool) -> dict[int, Plan]:
    layout, pipeline, local, options, traced = rp.layout, rp.pipeline, rp.local, rp.options, rp.traced
    if not traced_plans:  # the unplanned traces' times: add each plan's recompute to its backward
        halves = 2 if layout.split_backward else 1  # a split backward recomputes in both halves
        profiles = {s: dataclasses.replace(
            p, bw_ms=p.bw_ms + sum(m.recompute_ms for m in modules[s]),
            w_ms=p.w_ms + (halves - 1) * sum(m.recompute_ms for m in modules[s])) for s, p in profiles.items()}
    spans = _uniform_spans(layout, profiles)
    step_ms = makespan_ms(spans, {r: sum(p.optim_ms for p in profiles.values()) for r in spans})
    bubble = bubble_fractions(spans)[layout.rank_of(local[0])]
    out = {}
    for s in local:
        model, step = rp.stages[s]
        p = profiles[s]
        record = PipelineRecord(
            schedule=layout.schedule_cls.__name__, n_microbatches=pipeline.n_microbatches, stage_index=s,
            n_stages=pipeline.n_stages, virtual_stages=pipeline.virtual_stages, rank_stages=local,
            split_backward=layout.split_backward, return_outputs=pipeline.return_outputs,
            fw_ms=p.fw_ms, bw_ms=p.bw_ms, w_ms=p.w_ms, optim_ms=p.optim_ms, makespan_ms=step_ms,
            bubble_fraction=bubble)
        est = traced[s]
        out[s] = Plan(
            modules=modules[s], model_name=original_class_name(model), model_fingerprint=model_fingerprint(model),
            trainable_numel=model_shape(model).trainable_numel, device=options.spec.name,
            world_size=rp.fsdp[s].world_size if s in rp.fsdp else 1, layout=plan_layout(model, None, 1),
            budget_bytes=budget, reserve_bytes=reserve,
            predicted_peak_bytes=verified.peak_bytes, solver_peak_bytes=res.predicted_peak_bytes,
            baseline_peak_bytes=rp.unplanned_peak_bytes, recompute_ms=sum(m.recompute_ms for m in modules[s]),
            baseline_step_ms=est.module_info.step_runtime_ms, solver_status=res.status.value,
            notes=(step.describe().replace("1 micro-batch(es)", f"{pipeline.n_microbatches} micro-batches"),
                   f"pipeline: {record.describe()}; the rank's peak over its schedule, at {verified.peak_where}",
                   *notes),
            steady_peak_bytes=verified.peak_bytes, step=StepRecord.of(step), pipeline=record,
            solve_time_s=solve_s, step_ref=StepRef(est.step))
    return out


def _uniform_spans(layout, profiles):
    """The schedule's spans, every stage timed as this rank's stages (their mean)."""
    n = len(profiles)
    mean = {k: sum(p.duration_ms(k) for p in profiles.values()) / n for k in ("F", "B", "I", "W")}
    acts = {r: layout.actions(r) for r in range(layout.n_ranks)}
    return simulate(acts, layout.stage_to_rank(), lambda s, k: profiles[s].duration_ms(k) if s in profiles else mean[k])
