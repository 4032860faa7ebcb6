"""A plan on the step timeline: compute, recompute, FSDP2's collectives and host copies.

The step is laid out at the granularity of the repeated blocks (``planner.planning.baselines.
find_blocks``); a plan's recompute lands in the segment its backward starts in, and offloaded
bytes go over the copy stream. Used for every plan's timeline fields and by the offload solve.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from estimators.contract.module_info import ModStats, ModuleInfo
from estimators.contract.timeline import StepLayout, StepTimeline, UnitComm, step_layout
from estimators.runtime.collectives import AnalyticCollectiveModel
from estimators.runtime.device import DeviceSpec
from planner.distributed.fsdp.comm import fsdp_comm_ms
from planner.plan import ModulePlan, op_key
from planner.planning.baselines import find_blocks

__all__ = ["offloaded_bytes", "step_layout_of", "plan_timeline", "timeline_fields"]


def offloaded_bytes(stats: ModStats, plan: ModulePlan) -> int:
    keys = set(plan.offloaded_ops)
    one = sum(op.memory_bytes for op in stats.ops if (op_key(op.func), op.occurrence) in keys)
    return one * max(1, stats.n_calls)


def _unit_comm(info: ModuleInfo, units: Sequence[str], world_size: int, spec: DeviceSpec) -> list[UnitComm]:
    est = fsdp_comm_ms(info, units, world_size, AnalyticCollectiveModel.from_device(spec))
    return [UnitComm(fqn=u.fqn, all_gather_ms=u.all_gather_ms / max(1, u.all_gathers),
                     all_gathers=u.all_gathers, reduce_scatter_ms=u.reduce_scatter_ms)
            for u in est.units]


def step_layout_of(info: ModuleInfo, spec: DeviceSpec, *, fsdp_units: Sequence[str] | None = None,
                   world_size: int = 1) -> StepLayout:
    """The step on the timeline: blocks from ``find_blocks`` (none: one segment per phase), FSDP2
    collectives priced on ``spec``'s link when sharded over ``world_size > 1`` ranks (left out
    where ``spec`` names no interconnect)."""
    try:
        blocks = list(find_blocks(info))
    except ValueError:
        blocks = []
    comm = []
    if fsdp_units and world_size > 1:
        try:
            comm = _unit_comm(info, list(fsdp_units), world_size, spec)
        except ValueError:  # a spec with no interconnect (the cpu target): comm not estimated,
            comm = []       # which the plan's notes say (planner.distributed.ranks._comm_note)
    return step_layout(info, blocks, comm=comm)


def plan_timeline(layout: StepLayout, info: ModuleInfo, modules: Iterable[ModulePlan],
                  copy_bytes_per_s: float, copy_latency_s: float = 0.0) -> StepTimeline:
    """The step of a plan on the timeline: each module's recompute (its op-level
    ``recompute_ms``) in the segment its backward starts in, each block's offloaded bytes in
    one copy per offloaded op and call, of ``copy_latency_s`` fixed time each."""
    rec: dict[int, float] = {}
    off: dict[str, int] = {}
    copies: dict[str, int] = {}
    for m in modules:
        s = info.stats(m.fqn)
        if m.recompute_ms:
            seg = layout.segment_of_backward(s)
            rec[seg] = rec.get(seg, 0.0) + m.recompute_ms
        if m.offloaded_ops:
            off[m.fqn] = offloaded_bytes(s, m)
            copies[m.fqn] = len(m.offloaded_ops) * max(1, s.n_calls)
    return layout.timeline(recompute_ms_by_segment=rec, offload_bytes=off,
                           copy_bytes_per_s=copy_bytes_per_s, offload_copies=copies,
                           copy_latency_s=copy_latency_s)


def timeline_fields(tl: StepTimeline) -> dict[str, float]:
    """The Plan fields of a timeline."""
    return {"compute_ms": tl.compute_ms, "exposed_comm_ms": tl.exposed_comm_ms,
            "exposed_copy_ms": tl.exposed_copy_ms, "step_ms": tl.step_ms}
