"""The MILP's view of a rank over its schedule: one module tree for the rank's local stages and a
memory point per instant of the schedule where a peak can occur (torch-free).

    info, names = rank_module_info(stages, actions, n_microbatches=8, runtime=Runtime.ONE_F_ONE_B)
    SACMilp(info).solve(budget_bytes)      # one MILP for the rank
    names["Rank.s1.layers.4"]              # (1, "LlamaStage.layers.4"): stage, the stage's own name

A module's plan is the same for every micro-batch, so at a point of the schedule the rank holds
the current micro-batch's memory as traced (its own windows, as for any step) plus, for every
other micro-batch of stage g in flight, its kept bytes less everything the plan discards under
g: ``MemoryPoint.in_flight`` carries those counts and the solver adds ``- n * D_g`` to the row,
one linear term per stage. The base of each point is the rank's memory there without a plan
(``estimators.pipeline.memory``); the stage's trace gives the shape within each action.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, Phase
from estimators.pipeline.fsdp import FsdpProfile
from estimators.pipeline.memory import rank_memory
from estimators.pipeline.profile import StageProfile

__all__ = ["ROOT", "StageView", "rank_module_info", "stage_root"]

ROOT = "Rank"
"""The synthetic root of a rank's module tree; stage s's modules live under ``Rank.s<s>``."""


def stage_root(stage: int) -> str:
    return f"{ROOT}.s{stage}"


@dataclass(frozen=True)
class StageView:
    """What the rank's MILP needs of one local stage."""

    info: ModuleInfo
    """The stage's ModuleInfo, windows as its schedule keeps them
    (``estimators.pipeline.stage_trace.stage_module_info``)."""
    profile: StageProfile
    resident_at: Sequence[int]
    """Per op of its trace: bytes that are not the micro-batch's own (``resident_bytes_at``)."""
    fsdp: FsdpProfile | None = None
    """FSDP2's part for a stage ``fully_shard`` sharded (``profile`` is then the sharded one)."""


def _renamed(s: ModStats, root: str, new_root: str, offset: int) -> ModStats:
    shift = lambda v: v + offset if v >= 0 else v
    return dataclasses.replace(s, fqn=new_root + s.fqn[len(root):], fw_pre_op=shift(s.fw_pre_op),
                               fw_post_op=shift(s.fw_post_op), bw_pre_op=shift(s.bw_pre_op),
                               bw_post_op=shift(s.bw_post_op))


def rank_module_info(stages: dict[int, StageView], actions, n_microbatches: int, runtime, *,
                     return_outputs: bool = True, batch_bytes: int = 0, grads_at_start: bool = False,
                     ) -> tuple[ModuleInfo, dict[str, tuple[int, str]]]:
    """The rank's ModuleInfo (see the module docstring) and {its fqn: (stage, the stage's fqn)}.

    Each stage's ops are numbered after the previous stage's (an offset), so a micro-batch's own
    windows never cover another stage's points."""
    offsets, off = {}, 0
    for s in sorted(stages):
        offsets[s] = off
        off += stages[s].profile.marks[3] + 1
    stats = [ModStats(fqn=ROOT, is_leaf=False)]
    names: dict[str, tuple[int, str]] = {}
    orders: dict[str, list[str]] = {"fw_pre_order": [ROOT], "fw_post_order": [], "bw_pre_order": [], "bw_post_order": []}
    for s in sorted(stages):
        info = stages[s].info
        root = info.mod_stats[0].fqn
        rename = lambda f: stage_root(s) + f[len(root):]
        for st in info.mod_stats:
            new = _renamed(st, root, stage_root(s), offsets[s])
            stats.append(new)
            names[new.fqn] = (s, st.fqn)
        for key in orders:
            orders[key] += [rename(f) for f in getattr(info.mod_order, key)]
    orders["fw_post_order"].append(ROOT)
    orders["bw_post_order"].append(ROOT)
    fsdp = {s: v.fsdp for s, v in stages.items() if v.fsdp is not None}
    rm = rank_memory(actions, {s: v.profile for s, v in stages.items()}, n_microbatches, runtime,
                     return_outputs=return_outputs, batch_bytes=batch_bytes, grads_at_start=grads_at_start,
                     fsdp=fsdp)
    points = []
    for a in rm.actions:
        view = stages[a.stage]
        lo, hi = view.profile.segment(a.kind)
        in_flight = tuple((stage_root(t), n) for t, n in sorted(a.in_flight.items()) if n)
        root = view.info.mod_stats[0].fqn
        pend = view.profile.grad_pending
        for p in view.info.memory_points:
            if not lo <= p.op_index < hi:
                continue
            own = p.total_bytes - int(view.resident_at[p.op_index])
            if a.first_write and pend:  # M3: gradients not written yet do not exist
                own += view.profile.grad_bytes - pend[p.op_index - lo]
            if a.first_forward:  # F2, F3: FSDP2's units gather
                own += view.fsdp.first_forward[p.op_index - lo]
            points.append(MemoryPoint(
                op_index=p.op_index + offsets[a.stage], phase=p.phase, fqn=p.fqn, other_bytes=a.base_bytes + own,
                recompute_of=None if p.recompute_of is None else stage_root(a.stage) + p.recompute_of[len(root):],
                recompute_in_window=(None if p.recompute_in_window is None
                                     else stage_root(a.stage) + p.recompute_in_window[len(root):]),
                in_flight=in_flight))
    for base in (rm.merge_peak_bytes, rm.optim_peak_bytes):  # every window closed by then
        points.append(MemoryPoint(op_index=off, phase=Phase.OPTIM, other_bytes=base))
    for base, flight in rm.reduces:  # F5: between actions, no window open; others in flight mid-step
        points.append(MemoryPoint(op_index=off, phase=Phase.OPTIM, other_bytes=base,
                                  in_flight=tuple((stage_root(t), n) for t, n in sorted(flight.items()) if n)))
    order = ModOrder(**{k: tuple(v) for k, v in orders.items()})
    info = ModuleInfo(mod_order=order, mod_stats=tuple(stats), memory_points=_dominant(points), peak_bytes=rm.peak_bytes,
                      fw_runtime_ms=sum(v.profile.fw_ms for v in stages.values()),
                      bw_runtime_ms=sum(v.profile.bw_ms + v.profile.w_ms for v in stages.values()),
                      optimizer_runtime_ms=sum(v.profile.optim_ms for v in stages.values()))
    return info, names


def _dominant(points: list[MemoryPoint]) -> tuple[MemoryPoint, ...]:
    """``points`` less those another point dominates. A point's memory under any plan is its
    ``other_bytes`` plus a function of its instant, module, recompute marks and micro-batches in
    flight (``solver.plan_cost.MemoryModel``): of the points alike in all of those, the one with
    the most ``other_bytes`` is the highest under every plan. A schedule's steady micro-batches
    repeat one action's points each time: kept once, the rank's MILP has one row per distinct
    point instead of one per micro-batch, and the same peak under every plan."""
    best: dict[tuple, int] = {}
    for i, p in enumerate(points):
        key = (p.op_index, p.phase, p.fqn, p.recompute_of, p.recompute_in_window, p.in_flight)
        j = best.get(key)
        if j is None or p.other_bytes > points[j].other_bytes:
            best[key] = i
    return tuple(points[i] for i in sorted(best.values()))
