"""Pipeline parallelism (``torch.distributed.pipelining``): one plan per stage, made for the
micro-batches its schedule keeps in flight.

    from planner import PlanOptions, TrainStep, apply_plan, solve_sac
    from planner.distributed.pipeline import Pipeline

    options = PlanOptions(device="h100", pipeline=Pipeline(Schedule1F1B, n_microbatches=8,
                                                           stage_index=rank, n_stages=4))
    plan = solve_sac(stage_module, budget_gib=70, step=TrainStep(inputs=h_mb, loss_fn=loss_fn,
                     optimizer="adamw", target=labels_mb if last else None), options=options)
    stage = PipelineStage(stage_module, rank, 4, device)
    apply_plan(stage, plan)

A rank that runs several stages (interleaved and zero-bubble schedules) plans them together:
``solve_pipeline_rank({s: (module_s, step_s) for s in rank_stages}, budget_gib, options=options)``
returns one plan per stage. ``pipeline_step(plans)`` lays every stage's plan out on the schedule:
the step's makespan, each rank's idle share and timeline.

A stage may be tensor parallel (its modules parallelized over the ``tp`` mesh dim, torchtitan's
order: pipeline split, then TP, then the plan): each rank is traced at its local shapes with the
collectives DTensor issues. ``plan_layout_rank`` plans one rank of a PP x TP layout in this
process on torch's fake process group (no GPU, no other process)::

    def build(stage, mesh):                      # the job's own split and parallelize
        module = parallelize(split(model, stage), mesh["tp"])
        return module, TrainStep(inputs=..., loss_fn=loss_fn, optimizer="adamw", context=loss_parallel)

    r = plan_layout_rank(build, 80, mesh_shape={"pp": 8, "tp": 8}, rank=0, schedule=Schedule1F1B,
                         n_microbatches=16, options=PlanOptions(device="h100"))
    r.predicted_peak_bytes, r.makespan_ms, r.plans

A stage may also be sharded by FSDP2 over a ``dp`` dim (torchtitan's order: split, TP, then
``fully_shard`` every unit with ``reshard_after_forward=False`` and the stage last): the planner
reads the units from ``fully_shard``'s state and holds what FSDP2 does under the schedule, each
unit gathered from its first forward of the step to the stage's reduce after its last backward,
the unsharded gradients until then (``estimators.pipeline.fsdp``). With
``mesh_shape={"pp": 8, "dp": 8, "tp": 8}`` ``build`` shards over ``mesh["dp"]``
(``examples.pipeline_stages.llama_stage_builder`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from estimators.pipeline.makespan import Span, bubble_fractions, makespan_ms, simulate, timeline_text
from estimators.pipeline.schedule import ScheduleLayout, schedule_class
from planner.errors import PlanningError
from planner.format import GiB, check_budget_gib
from planner.options import Pipeline, PlanOptions
from planner.plan import Plan
from planner.plan_pipeline import PipelineRecord
from planner.planning.pipeline_solve import RankPlanner, solve_pipeline_rank
from planner.planning.reserve import check_budget_on_device

__all__ = ["Pipeline", "solve_pipeline_rank", "RankPlanner", "PipelineStep", "pipeline_step", "plan_layout_rank",
           "fake_layout_rank", "LayoutRankPlan"]


@dataclass(frozen=True)
class PipelineStep:
    """A step of the whole pipeline from every stage's plan."""

    makespan_ms: float
    """The step: the last rank's last action plus its optimizer step."""
    bubble_fractions: dict[int, float]
    """Per rank: idle share of the step."""
    spans: dict[int, list[Span]]

    def timeline_text(self, width: int = 96) -> str:
        return timeline_text(self.spans, width)


def pipeline_step(plans: Sequence) -> PipelineStep:
    """``plans``: one plan per stage of one pipeline (``Plan.pipeline`` set), all made for the
    same schedule, micro-batch count and stage layout (the step is laid out on it)."""
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence) or \
            not all(isinstance(p, Plan) and p.pipeline is not None for p in plans) or not plans:
        raise PlanningError("pipeline_step needs a list of pipeline stage plans (Plan.pipeline set), one per stage")
    first = plans[0].pipeline
    recs: dict[int, PipelineRecord] = {}
    for p in plans:
        rec = p.pipeline
        ours, theirs = _pipeline_of(rec), _pipeline_of(first)
        if ours != theirs:
            raise PlanningError(f"pipeline_step lays out one pipeline: the plan for stage {rec.stage_index} is for "
                                f"{rec.describe()}, the one for stage {first.stage_index} for {first.describe()}; "
                                "give the plans of one pipeline (re-plan the stages made for another)")
        if rec.stage_index in recs:
            raise PlanningError(f"pipeline_step got two plans for stage {rec.stage_index}; give one per stage")
        recs[rec.stage_index] = rec
    missing = sorted(set(range(first.n_stages)) - set(recs))
    if missing:
        raise PlanningError(f"pipeline_step needs a plan for every stage; missing {missing[:20]}"
                            f"{' ...' if len(missing) > 20 else ''}")
    layout = ScheduleLayout.of(schedule_class(first.schedule), n_microbatches=first.n_microbatches,
                               n_stages=first.n_stages, virtual_stages=first.virtual_stages)
    times = lambda s, k: {"F": recs[s].fw_ms, "B": recs[s].bw_ms, "I": recs[s].bw_ms, "W": recs[s].w_ms}[k]
    spans = simulate({r: layout.actions(r) for r in range(layout.n_ranks)}, layout.stage_to_rank(), times)
    optim = {r: sum(recs[s].optim_ms for s in layout.stages_of(r)) for r in range(layout.n_ranks)}
    return PipelineStep(makespan_ms(spans, optim), bubble_fractions(spans), spans)


@dataclass(frozen=True)
class LayoutRankPlan:
    """One rank of a pipeline layout, planned (``plan_layout_rank``). Bytes are the rank's peak
    over its schedule; times are the target device's (roofline), the whole pipeline's step with
    every stage timed as this rank's."""

    rank: int
    coordinates: dict[str, int]
    """The rank's place on the mesh: ``{"pp": 0, "tp": 3}``."""
    stages: tuple[int, ...]
    """The pipeline stages this rank runs."""
    unplanned_peak_bytes: int
    min_peak_bytes: int
    """The smallest peak a plan reaches (the MILP's floor over the schedule)."""
    unplanned_makespan_ms: float
    budget_bytes: int | None
    plans: dict[int, Plan] | None
    """{stage: Plan} at ``budget_bytes``; None without a budget or where none fits (``refusal``)."""
    refusal: str | None
    """Why no plan fits the budget (the planner's message), or None."""
    trace_s: float
    plan_s: float

    @property
    def predicted_peak_bytes(self) -> int | None:
        """The planned rank's peak (every local stage's plan carries it), or None."""
        return None if not self.plans else max(p.predicted_peak_bytes for p in self.plans.values())

    @property
    def makespan_ms(self) -> float | None:
        """The planned pipeline step (``PipelineRecord.makespan_ms``), or None."""
        return None if not self.plans else next(iter(self.plans.values())).pipeline.makespan_ms


StageBuilder = Callable[[int, Any], tuple]
"""``build(stage_index, mesh) -> (stage module, TrainStep)``: the stage's module, split and
parallelized over ``mesh`` as the job does it (torchtitan's order), and one micro-batch's step at
this rank's local shapes (``context=loss_parallel`` where the logits stay vocabulary-sharded)."""


def plan_layout_rank(build: StageBuilder, budget_gib: float | None, *, mesh_shape: Mapping[str, int], rank: int,
                     schedule: Any, n_microbatches: int, virtual_stages: int = 1,
                     options: PlanOptions | None = None) -> LayoutRankPlan:
    """Plan rank ``rank`` of a pipeline layout in this process, on torch's fake process group.

    ``mesh_shape``: the job's mesh, outermost dim first, torchtitan's names and order, e.g.
    ``{"pp": 8, "dp": 16, "tp": 8}``; it must have ``"pp"``. The mesh is built (device type
    "cpu": the host the trace runs on) as rank ``rank`` of their product, and ``build(s, mesh)``
    makes each stage ``s`` of the rank (``virtual_stages`` of them; stage ``s`` runs on pipeline
    rank ``s % pp``). A ``"dp"`` dim over 1 is FSDP2 inside the stages: ``build`` must
    ``fully_shard`` the stage over ``mesh["dp"]`` as the job does (every unit with
    ``reshard_after_forward=False``, then the stage; ``examples.pipeline_stages.shard_llama_stage``),
    and the rank's peak holds FSDP2's padded shards, its units gathered from their first forward
    to the stage's reduce and its unsharded gradients until then; a stage built unsharded is
    refused (a replicated ``dp``, DDP, is a mesh without that dim). Schedules without a split
    backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) with FSDP2. ``options``: device, reserve,
    solver and trace settings (its ``pipeline`` and ``world_size`` are set here, keeping a given
    pipeline's ``return_outputs``: torchtitan steps with False). ``budget_gib`` None: the figures
    without a plan. Each local stage is traced once; a plan's peak is its
    traced one, FSDP2's part included."""
    budget = None if budget_gib is None else int(check_budget_gib(budget_gib) * GiB)  # before any trace
    if budget is not None:
        check_budget_on_device(budget, (options or PlanOptions()).spec)
    t0 = time.perf_counter()
    with fake_layout_rank(build, mesh_shape=mesh_shape, rank=rank, schedule=schedule, n_microbatches=n_microbatches,
                          virtual_stages=virtual_stages, options=options) as (rp, coordinates):
        trace_s, t1 = time.perf_counter() - t0, time.perf_counter()
        plans, refusal = None, None
        if budget_gib is not None:
            try:
                plans = {s: dataclasses.replace(p, step_ref=None) for s, p in rp.plan(budget_gib).items()}
            except PlanningError as e:
                refusal = str(e)
        return LayoutRankPlan(
            rank=rank, coordinates=coordinates, stages=rp.local, unplanned_peak_bytes=rp.unplanned_peak_bytes,
            min_peak_bytes=rp.min_peak_bytes(), unplanned_makespan_ms=rp.unplanned_makespan_ms(),
            budget_bytes=budget, plans=plans, refusal=refusal, trace_s=trace_s, plan_s=time.perf_counter() - t1)


@contextlib.contextmanager
def fake_layout_rank(build: StageBuilder, *, mesh_shape: Mapping[str, int], rank: int, schedule: Any,
                     n_microbatches: int, virtual_stages: int = 1, options: PlanOptions | None = None,
                     estimates: Mapping[int, Any] | None = None) -> Iterator[tuple[RankPlanner, dict[str, int]]]:
    """``plan_layout_rank``'s set-up, held open: the rank's traced ``RankPlanner`` and its mesh
    coordinates, inside the fake process group (plan and verify any budget, or other schedules
    over the same stages with ``for_options``, before the block ends; plans made here carry a
    ``train_step`` on fake DTensors: drop it, ``dataclasses.replace(plan, step_ref=None)``,
    before the block ends if they are kept). ``estimates``: traces of local stages to use
    instead of tracing them (``RankPlanner``'s)."""
    from torch.distributed.device_mesh import init_device_mesh

    from planner.distributed.fake_world import fake_process_group

    shape = dict(mesh_shape)
    if "pp" not in shape or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape.values()):
        raise PlanningError(f"mesh_shape must map dim names to sizes >= 1 and name a 'pp' dim, got {mesh_shape!r}")
    with fake_process_group(world_size=math.prod(shape.values()), rank=rank):
        mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
        coordinates = dict(zip(shape, mesh.get_coordinate()))
        given = options.pipeline if options is not None else None
        pipe = Pipeline(schedule, n_microbatches=n_microbatches, stage_index=coordinates["pp"],
                        n_stages=shape["pp"] * virtual_stages, virtual_stages=virtual_stages,
                        return_outputs=given.return_outputs if given is not None else True)
        options = dataclasses.replace(options or PlanOptions(), pipeline=pipe, world_size=shape.get("dp", 1))
        local = pipe.layout.stages_of(pipe.layout.rank_of(pipe.stage_index))
        yield RankPlanner({s: build(s, mesh) for s in local}, options=options, estimates=estimates), coordinates


def _pipeline_of(rec: PipelineRecord) -> tuple:
    """What every stage plan of one pipeline has in common."""
    return rec.schedule, rec.n_microbatches, rec.n_stages, rec.virtual_stages, rec.split_backward, rec.return_outputs
