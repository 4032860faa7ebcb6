"""Pipeline layouts: every rank planned over its schedule (``RankPlanner``), from one trace per
stage program (``World.trace_stages``), and the step on the schedule (``cost.pipeline_step_time``).

FSDP2 under a pipeline: torchtitan keeps a stage's parameters gathered after forward, and torch's
``PipelineStage`` defers resharding and gradient sync to the step's end, so through the step a rank
holds its stages' parameters gathered and their gradients unsharded, beside its shard of the
parameters and of the optimizer state. The rank is therefore planned as one process holding its
whole stages (``world_size=1``: what ``RankPlanner`` traces and verifies) and shifted by a constant:

    per-rank peak = planned peak + ceil(P / W) - (O - ceil(O / W))

(``P`` the rank's parameter bytes, ``O`` its optimizer state's, ``W`` the FSDP degree): the rank
holds its parameter shard on top, and a ``1 / W`` share of the optimizer state instead of all of it.
The budget the rank is planned for is the usable budget less that shift.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

from estimators.tracing.records import StorageKind
from planner.errors import PlanningError
from planner.format import GiB, fmt_bytes
from planner.search.cost import RankTraffic, pipeline_bound, pipeline_step_time
from planner.search.results import Evaluation, Status
from planner.search.programs import StageSet, World

__all__ = ["PipelineCases", "rank_actions"]


@functools.lru_cache(maxsize=256)
def rank_actions(layout) -> dict[int, list]:
    """Every rank's actions of a schedule layout, listed once per layout."""
    return {r: layout.actions(r) for r in range(layout.n_ranks)}


class PipelineCases:
    """The pipeline candidates of one World: rank planners shared across FSDP degrees."""

    def __init__(self, evaluator, world: World | None) -> None:
        self.ev, self.world = evaluator, world
        """None: verification only (``verify`` makes its own fake process groups)."""
        cache = getattr(evaluator, "stage_cache", None) if world is not None else None
        self.planners: dict[tuple, object] = {} if cache is None else cache.setdefault(("planners", world.tp, world.cp), {})
        """Rank planners by (split, schedule, micro-batches, rank, verify): kept across this (TP, CP)'s Worlds."""
        self.traced = 0
        """Stage programs ``verify`` traced."""

    def _split(self, t) -> StageSet:
        return StageSet(pp=t.pp, virtual=t.virtual_stages, split=t.split_backward, micro_batch=t.micro_batch)

    def options(self, t, stage: int, *, verify: bool = False):
        from torch.distributed.pipelining import schedules

        from planner.options import Pipeline, PlanOptions

        return PlanOptions(device=self.ev.cluster.spec, reserve_gib=0, verify=verify, solver=self.ev.solver,
                           pipeline=Pipeline(getattr(schedules, t.schedule_class), n_microbatches=t.accumulation,
                                             stage_index=stage, n_stages=t.n_stages, virtual_stages=t.virtual_stages,
                                             return_outputs=False))  # as torchtitan steps its schedule

    def bound(self, t):
        """Lower bounds of ``t``'s step and peak before any stage is traced
        (``cost.pipeline_bound``), from the whole-model program of the same degrees and micro-batch."""
        from planner.search.layouts import state_bound_bytes

        fam = self.ev.family
        info = self.world.layer_times(t.micro_batch).module_info
        layout = self.options(t, 0).pipeline.layout
        state = {r: state_bound_bytes(t, fam, rank=r) for r in range(t.pp)}
        grads = {r: fam.param_bytes(tp=t.tp, layer_ids=ids, first=first, last=last)  # unsharded under PP
                 for r, (ids, first, last) in enumerate(fam.rank_layer_sets(t.pp, t.virtual_stages))}
        return pipeline_bound(info, layout, fam.stage_layers(t.n_stages), state, grads,
                              usable_bytes=self.ev.cluster.usable_bytes, actions=rank_actions(layout))

    def traces(self, t):
        return self.world.trace_stages(self._split(t), options_for=lambda s: self.options(t, s))

    def planner(self, t, rank: int, *, verify: bool = False):
        from planner.planning.pipeline_solve import RankPlanner

        key = (self._split(t), t.schedule, t.accumulation, rank, verify)
        if key not in self.planners:
            traces = self.traces(t)
            stages = self.options(t, 0).pipeline.layout.stages_of(rank)
            self.planners[key] = RankPlanner({s: (traces.modules[s], traces.steps[s]) for s in stages},
                                             options=self.options(t, stages[0], verify=verify),
                                             estimates={s: traces.estimates[s] for s in stages})
        return self.planners[key]

    def _shift(self, stage_state: tuple[int, int, int], w: int) -> int:
        p, o, _ = stage_state
        return -(-p // w) - (o - -(-o // w)) if w > 1 else 0

    def evaluate(self, t) -> Evaluation:
        """Every rank's MILP plan over its schedule from the world's shared stage traces (screening)."""
        traces = self.traces(t)

        def with_rank(r, plan):
            rp = self.planner(t, r)
            return plan(rp, self._state_of(traces.estimates, rp.local))

        program = (f"{t.n_stages} stages of {t.micro_batch} x {self.world.local_seq} tokens, "
                   f"{traces.traced} stage programs traced")
        return self._plan_ranks(t, with_rank, verify=False, program=program)

    def _plan_ranks(self, t, with_rank, *, verify: bool, program: str) -> Evaluation:
        """Plan every pipeline rank of ``t`` at the usable budget less FSDP2's shift;
        ``with_rank(r, plan)`` calls ``plan(its RankPlanner, its state)`` where the planner lives."""
        plans, peaks, state, empty = {}, {}, {}, True
        for r in range(t.pp):
            out = with_rank(r, lambda rp, st, r=r: self._plan_rank(t, r, rp, st))
            if isinstance(out, Evaluation):
                return out
            got, peaks[r], state[r] = out
            plans.update(got)
            empty = empty and not any(p.modules for p in got.values())
        binding = max(peaks, key=peaks.get)
        st = self._time(t, plans, state)
        status = Status.FITS if (verify or empty) else Status.PLANNED
        where = f"rank {binding} (stage{'s' if t.virtual_stages > 1 else ''} " \
                f"{', '.join(map(str, self.options(t, 0).pipeline.layout.stages_of(binding)))})"
        return Evaluation(layout=t, status=status, peak_bytes=peaks[binding], binding=where,
                          rank_peaks=tuple(peaks[r] for r in range(t.pp)),
                          checkpointed=sum(len(p.modules) for p in plans.values()), time=st, program=program,
                          plans=tuple(plans[s] for s in sorted(plans)) if verify else ())

    def _plan_rank(self, t, r: int, rp, state):
        """(its stage plans, its peak, its state) of pipeline rank ``r``, or an OVER Evaluation."""
        usable = self.ev.cluster.usable_bytes
        shift = self._shift(state, t.fsdp_size)
        if usable - shift < 1:
            return self._over(t, r, rp, shift, f"its state alone, {fmt_bytes(shift)}, is over the budget")
        try:
            # Planned as one process holding its stages whole: its budget is not one GPU's. Screened
            # on the MILP's figures, as whole-model layouts are; a verified plan is settled on op steps.
            got = {s: replace(p, step_ref=None) for s, p in
                   rp.plan((usable - shift) / GiB, on_device=False, settle=rp.options.verify).items()}
        except PlanningError as e:
            return self._over(t, r, rp, shift, str(e))
        if any(p.modules for p in got.values()):
            return got, max(p.predicted_peak_bytes for p in got.values()) + shift, state
        return got, rp.unplanned_peak_bytes + shift, state

    @staticmethod
    def _state_of(estimates, stages) -> tuple[int, int, int]:
        """(parameter, optimizer state, gradient) bytes of the rank's stages, as traced."""
        p = o = g = 0
        for s in stages:
            est = estimates[s]
            row = est.timeline.live_by_kind[0]
            p, o = p + int(row[StorageKind.PARAM]), o + int(row[StorageKind.OPTIMIZER])
            g += est.module_info.mod_stats[0].grad_bytes
        return p, o, g

    def _over(self, t, rank: int, rp, shift: int, why: str) -> Evaluation:
        try:
            floor = rp.min_peak_bytes() + shift
        except Exception:  # noqa: BLE001 - only an explanation
            floor = 0
        why = " ".join(why.split())
        if not why.startswith(f"rank {rank} "):  # the planner's own message names the rank already
            why = f"rank {rank}: {why}"
        return Evaluation(layout=t, status=Status.OVER, peak_bytes=floor, binding=f"rank {rank}",
                          why=why + (f" (FSDP2 under PP adds {fmt_bytes(shift)} per rank)" if shift > 0 else ""))

    def _time(self, t, plans, state):
        layout = self.options(t, 0).pipeline.layout
        records = {s: p.pipeline for s, p in plans.items()}
        recompute = {s: p.recompute_ms for s, p in plans.items()}
        traffic = {r: RankTraffic(param_bytes=state[r][0], grad_bytes=state[r][2]) for r in state}
        c = self.ev.cluster
        return pipeline_step_time(
            layout, records, recompute, traffic, actions=rank_actions(layout),
            hop_bytes=self.ev.family.stage_boundary_bytes(t.micro_batch, self.ev.family.seq_len // t.cp // t.tp),
            pp_link=c.link(2, t.dp * t.cp * t.tp), fsdp_size=t.fsdp_size, fsdp_link=c.link(t.fsdp_size, t.tp),
            replicas=t.dp_replicate, replica_link=c.link(t.dp_replicate, t.tp * t.cp * t.dp_shard))

    def verify(self, e: Evaluation) -> Evaluation:
        """Every pipeline rank planned and verified by ``planner.distributed.pipeline``'s
        ``fake_layout_rank`` (``plan_layout_rank``'s set-up): the rank's stages built by the
        family's stage builder on a fake (pp, tp) mesh, traced, planned, and traced again with the
        plan applied. Runs outside any World (one fake process group at a time)."""
        from planner.distributed.pipeline import fake_layout_rank

        t = e.layout
        t0 = time.perf_counter()
        build = self.ev.family.stage_builder(n_stages=t.n_stages, micro_batch=t.micro_batch)
        opts = self.options(t, 0, verify=True)

        def with_rank(r, plan):
            with fake_layout_rank(build, mesh_shape={"pp": t.pp, "tp": t.tp}, rank=r * t.tp,
                                  schedule=opts.pipeline.schedule, n_microbatches=t.accumulation,
                                  virtual_stages=t.virtual_stages, options=opts) as (rp, _coords):
                self.traced += len(rp.local)
                return plan(rp, self._state_of(rp.traced, rp.local))

        self.traced = 0
        got = self._plan_ranks(t, with_rank, verify=True, program=(
            f"{t.n_stages} stages; every rank verified by fake_layout_rank (plan_layout_rank's set-up)"))
        if got.status is Status.FITS:
            return got
        return replace(got, why=f"verification ({time.perf_counter() - t0:.0f} s): {got.why}")
