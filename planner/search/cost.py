"""A layout's step time, modelled (no GPU has measured it): compute + recompute + the collectives the
compute stream waits for + pipeline bubbles, from the traced per-rank program and the plan.

Whole-model layouts (no PP), one micro-batch on the step timeline (``estimators.contract.timeline``:
compute per block, FSDP2's all-gathers prefetched a block ahead, its reduce-scatters after each
block's backward), then ``accumulation`` of them and one optimizer step::

    step = accumulation x (compute + recompute + exposed FSDP/HSDP + exposed TP/SP/CP) + optimizer

* compute and TP / SP / CP collectives are the trace's (roofline on the device; each collective
  costs the step what its compute stream waits for, ``estimators.tracing.comm_overlap``);
* FSDP2's collectives are priced on the link of their group (``Cluster.link``): the node's where
  the shard group lies within a node, the network's otherwise; HSDP adds an all-reduce of each
  unit's gradient shard over the replicas after its reduce-scatter. FSDP2 gathers and reduces
  every micro-batch (its default, as torchtitan runs gradient accumulation);
* recompute is the plan's, in the segment its module's backward starts in.

Pipeline layouts: every stage's forward and backward durations (the plan's recompute inside the
backward; under a split backward in both halves) on the schedule's action order
(``estimators.pipeline.makespan``), a hand-over between ranks priced as a point-to-point send of
the stage boundary over the link between pipeline ranks. FSDP2 under PP (torchtitan keeps
parameters gathered after forward; torch's ``PipelineStage`` defers resharding and gradient sync
to the step's end) gathers each parameter once per step, overlapped with the first forward as far
as it lasts, and reduce-scatters every gradient after the last backward, exposed::

    step = makespan(with hand-overs, + optimizer) + exposed all-gather + reduce-scatter (+ HSDP all-reduce)

Not modelled: contention between compute and communication, collective algorithms other than a
ring, topology beyond "within a node or not", kernel efficiency beyond the device's derating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from estimators.contract.timeline import UnitComm, step_layout
from estimators.pipeline.makespan import simulate
from estimators.runtime.collectives import AnalyticCollectiveModel, Collective
from planner.distributed.fsdp.comm import fsdp_comm_ms
from planner.planning.baselines import find_blocks
from solver.plan_cost import module_recompute_ms

__all__ = ["StepTime", "RankTraffic", "unit_comms", "model_step_time", "pipeline_step_time", "pipeline_bound", "PipelineBound",
           "in_trace_comm_ms"]


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step of the layout, modelled, in ms; the parts add up to ``step_ms``."""

    compute_ms: float
    """Forward, backward and optimizer compute of every micro-batch (the binding rank's)."""
    recompute_ms: float
    exposed_comm_ms: float
    """Collective time the compute stream waits for: FSDP2 / HSDP, TP / SP / CP, PP hand-overs."""
    bubble_ms: float
    """Pipeline idle time of the binding rank (0 without PP)."""
    step_ms: float

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / (self.step_ms / 1e3) if self.step_ms > 0 else 0.0


def _collectives(link) -> AnalyticCollectiveModel:
    return AnalyticCollectiveModel.from_interconnect(link)


def unit_comms(info, units: Sequence[str], fsdp_size: int, link, *, replicas: int = 1,
               replica_link=None) -> list[UnitComm]:
    """FSDP2's collectives per unit on ``link`` (a group of ``fsdp_size``), with HSDP's all-reduce
    of each gradient shard over ``replicas`` on ``replica_link`` added to its reduce-scatter."""
    if fsdp_size <= 1 and replicas <= 1:
        return []
    est = fsdp_comm_ms(info, units, max(1, fsdp_size), _collectives(link))
    ar = _collectives(replica_link or link) if replicas > 1 else None
    out = []
    for u in est.units:
        extra = ar.time_ms(Collective.ALL_REDUCE, -(-u.reduce_scatter_bytes // fsdp_size), replicas) \
            if ar is not None and u.reduce_scatter_bytes else 0.0
        out.append(UnitComm(fqn=u.fqn, all_gather_ms=u.all_gather_ms / max(1, u.all_gathers),
                            all_gathers=u.all_gathers, reduce_scatter_ms=u.reduce_scatter_ms + extra))
    return out


def in_trace_comm_ms(est) -> float:
    """What the traced rank's own collectives (TP / SP / CP) cost its compute stream: their
    exposed time (the trace's runtime of a collective op is that, ``comm_overlap``)."""
    full = getattr(est.trace, "collective_ms", None) or {}
    return float(sum(est.trace.ops[i].runtime_ms for i in full))


def model_step_time(est, info, discarded: Mapping[str, int], comm: Sequence[UnitComm], *,
                    accumulation: int) -> StepTime:
    """The step of a whole-model layout (module docstring): ``info`` the per-rank ModuleInfo the
    plan was solved on, ``discarded`` its per-module discards, ``comm`` FSDP2's unit collectives."""
    try:
        blocks = list(find_blocks(info))
    except ValueError:
        blocks = []
    layout = step_layout(info, blocks, comm=list(comm))
    rec: dict[int, float] = {}
    for fqn, d in discarded.items():
        s = info.stats(fqn)
        seg = layout.segment_of_backward(s)
        rec[seg] = rec.get(seg, 0.0) + module_recompute_ms(s, d)
    tl = layout.timeline(recompute_ms_by_segment=rec)
    optim = info.optimizer_runtime_ms
    tp_comm = in_trace_comm_ms(est)
    per_mb_compute = tl.compute_ms - optim - tp_comm
    compute = accumulation * per_mb_compute + optim
    recompute = accumulation * tl.recompute_ms
    exposed = accumulation * (tl.exposed_comm_ms + tp_comm)
    return StepTime(compute_ms=compute, recompute_ms=recompute, exposed_comm_ms=exposed, bubble_ms=0.0,
                    step_ms=compute + recompute + exposed)


@dataclass(frozen=True, kw_only=True)
class RankTraffic:
    """What one pipeline rank's FSDP2 collectives move per step."""

    param_bytes: int
    """The rank's stages' parameters (gathered once per step)."""
    grad_bytes: int
    """Their gradients (reduce-scattered once per step)."""


def pipeline_step_time(layout, records: Mapping[int, object], recompute_ms: Mapping[int, float],
                       traffic: Mapping[int, RankTraffic], *, hop_bytes: int, pp_link, fsdp_size: int,
                       fsdp_link, replicas: int, replica_link, actions=None) -> StepTime:
    """The step of a pipeline layout (module docstring). ``layout``: the schedule's
    ``ScheduleLayout``; ``records``: each stage's ``PipelineRecord`` (its plan's durations);
    ``recompute_ms``: each stage's recompute per micro-batch; ``traffic``: per rank; FSDP2 over
    ``fsdp_size`` ranks on ``fsdp_link``, HSDP's ``replicas`` on ``replica_link``; ``actions``:
    every rank's actions where known already (``layout.actions`` otherwise)."""
    hop = _collectives(pp_link)
    p2p = hop.costs[Collective.BROADCAST]
    hop_ms = 1e3 * (p2p.latency_s + hop_bytes / p2p.bandwidth_bytes_per_s)
    dur = {s: {"F": r.fw_ms, "B": r.bw_ms, "I": r.bw_ms, "W": r.w_ms} for s, r in records.items()}
    acts = actions if actions is not None else {r: layout.actions(r) for r in range(layout.n_ranks)}
    stage_rank = layout.stage_to_rank()
    optim = {r: sum(records[s].optim_ms for s in layout.stages_of(r)) for r in acts}
    spans = simulate(acts, stage_rank, lambda s, k: dur[s][k], lambda _a, _b: hop_ms)
    spans0 = simulate(acts, stage_rank, lambda s, k: dur[s][k])
    end = max(sp[-1].end_ms + optim[r] for r, sp in spans.items())
    end0 = max(sp[-1].end_ms + optim[r] for r, sp in spans0.items())
    busy = {r: sum(x.end_ms - x.start_ms for x in sp) for r, sp in spans0.items()}
    halves = 2 if layout.split_backward else 1
    rec = {r: layout.n_microbatches * halves * sum(recompute_ms.get(s, 0.0) for s in layout.stages_of(r))
           for r in acts}
    gather = reduce = 0.0
    fsdp, ar = _collectives(fsdp_link), _collectives(replica_link)
    for r, t in traffic.items():
        first_fw = next((x.end_ms - x.start_ms for x in spans0[r] if x.kind == "F"), 0.0)
        g = fsdp.time_ms(Collective.ALL_GATHER, t.param_bytes, fsdp_size)
        red = fsdp.time_ms(Collective.REDUCE_SCATTER, t.grad_bytes, fsdp_size)
        red += ar.time_ms(Collective.ALL_REDUCE, -(-t.grad_bytes // fsdp_size), replicas)
        gather, reduce = max(gather, max(0.0, g - first_fw)), max(reduce, red)
    binding = max(acts, key=lambda r: busy[r] + optim[r])
    step = end + gather + reduce
    compute = busy[binding] - rec[binding] + optim[binding]
    exposed = (end - end0) + gather + reduce
    return StepTime(compute_ms=compute, recompute_ms=rec[binding], exposed_comm_ms=exposed,
                    bubble_ms=max(0.0, step - compute - rec[binding] - exposed), step_ms=step)


@dataclass(frozen=True)
class PipelineBound:
    """Lower bounds of a pipeline layout, before its stages are traced (``pipeline_bound``)."""

    step_ms: float
    floor_bytes: int
    """The largest rank's smallest possible peak: its state and, for each micro-batch in flight,
    what its layers keep with every one of them checkpointed."""
    floor_rank: int
    in_flight: int
    """Micro-batches that rank holds at its first backward."""


def pipeline_bound(info, layout, ranges, state_bytes: Mapping[int, int], grad_bytes: Mapping[int, int], *,
                   usable_bytes: int, actions: Mapping[int, list]) -> PipelineBound:
    """Lower bounds of a pipeline layout's step and peak before its stages are traced, from
    ``info``, the whole-model program of the same degrees and micro-batch (the same ops at the
    same shapes):

    * each stage as long as its layers' forward and backward there (the embedding on the first,
      the rest of the model on the last); the schedule's makespan with no communication;
    * (torchtitan's ``return_outputs=False``: the last stage keeps no output chunks)
    * at the start of each backward a rank's ``k`` micro-batches in flight hold at least their
      saved activations (``act_fw_bytes``) beside its state (its gradients once every local stage
      has made them, not before: they are None at the step's start): what the usable budget does not
      hold must be discarded from every one of them, at no less than the layers' convex
      recompute-vs-memory curves cost, every micro-batch (twice under a split backward), on that
      rank's busy time. Its floor: every layer discarding all it can (each micro-batch in flight
      keeps the rest), or the stage checkpointed whole (its recompute brings one micro-batch's
      activations back at once), whichever is lower.

    ``ranges``: each stage's layers; ``state_bytes``: each pipeline rank's state, gradients
    included; ``grad_bytes``: the gradients in it."""
    root = info.mod_stats[0].fqn
    n_layers = sum(len(r) for r in ranges)
    layer = [info.stats(f"{root}.layers.{i}") for i in range(n_layers)]
    embed = info.stats(f"{root}.tok_embeddings")
    rest_fw = info.fw_runtime_ms - sum(x.fw_runtime_ms for x in layer) - embed.fw_runtime_ms
    rest_bw = info.bw_runtime_ms - sum(x.bw_runtime_ms for x in layer) - embed.bw_runtime_ms
    n = len(ranges)
    dur = {}
    for s in range(n):
        fw = sum(layer[i].fw_runtime_ms for i in ranges[s]) + (embed.fw_runtime_ms if s == 0 else 0.0) \
            + (rest_fw if s == n - 1 else 0.0)
        bw = sum(layer[i].bw_runtime_ms for i in ranges[s]) + (embed.bw_runtime_ms if s == 0 else 0.0) \
            + (rest_bw if s == n - 1 else 0.0)
        half = bw / 2 if layout.split_backward else bw
        dur[s] = {"F": fw, "B": bw, "I": half, "W": bw - half}
    spans = simulate(dict(actions), layout.stage_to_rank(), lambda s, k: dur[s][k])
    optim = info.optimizer_runtime_ms / layout.n_ranks  # the ranks share the optimizer's work
    bound = max(sp[-1].end_ms for sp in spans.values()) + optim
    halves = 2 if layout.split_backward else 1
    curve = layer[0].tradeoff
    most = curve.total_bytes + layer[0].forced_discard_bytes  # a layer's largest discard
    floor, floor_rank, floor_k = 0, 0, 0
    release = ("W",) if layout.split_backward else ("B",)  # a micro-batch's activations go, its gradients come
    for r, acts in actions.items():
        layers_r = [i for s in layout.stages_of(r) for i in ranges[s]]
        kept = sum(layer[i].act_fw_bytes for i in layers_r)
        busy = sum(dur[s][kind] for s, kind, _m in acts)
        local, graded, held = set(layout.stages_of(r)), set(), 0
        for s, kind, _m in acts:  # micro-batches between their forward and their (last) backward
            held += kind == "F"
            if kind not in release:
                continue
            # The gradients are None at the step's start (zero_grad(set_to_none=True)): counted
            # once every local stage has run a backward that makes them.
            state = state_bytes[r] - (0 if graded >= local else grad_bytes[r])
            graded.add(s)
            # Every layer checkpointed: each micro-batch in flight keeps what its layers cannot
            # discard, and the first layer's recompute brings its discard back; the stage
            # checkpointed whole instead: its recompute brings one micro-batch's activations back.
            low = state + min(kept, held * max(0, kept - most * len(layers_r)) + most)
            if low > floor:
                floor, floor_rank, floor_k = low, r, held
            excess = state + held * kept - usable_bytes
            if excess > 0 and layers_r:
                per_layer = min(curve.total_bytes, excess / (held * len(layers_r)))
                rec = layout.n_microbatches * halves * len(layers_r) * _curve_ms(curve, per_layer)
                bound = max(bound, busy + rec + optim)
            held -= 1
        if state_bytes[r] - grad_bytes[r] > floor:
            floor, floor_rank, floor_k = state_bytes[r] - grad_bytes[r], r, 0
    return PipelineBound(step_ms=bound, floor_bytes=floor, floor_rank=floor_rank, in_flight=floor_k)


def _curve_ms(curve, discarded: float) -> float:
    """The convex curve's recompute time at ``discarded`` bytes (linear between breakpoints)."""
    xs, ys = curve.discarded_bytes, curve.recompute_ms
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if discarded <= x1:
            return y0 + (y1 - y0) * ((discarded - x0) / (x1 - x0) if x1 > x0 else 1.0)
    return ys[-1]
