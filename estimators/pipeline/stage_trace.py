"""A traced micro-batch of a pipeline stage -> ``StageProfile`` and the stage's ``ModuleInfo``.

    est = estimate(stage_module, TrainStep(inputs=h, stage=role, ...), device="h100")
    profile = stage_profile(est, stage_index=1)
    info = stage_module_info(est)            # windows as the schedule's backward keeps them

Reads the marks ``estimators.step.stage_step.run_stage_microbatch`` left in the trace
(``StepTrace.marks`` / ``marked_sids``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from estimators.contract.module_info import MemoryPoint, ModuleInfo, Phase
from estimators.pipeline.profile import StageProfile
from estimators.tracing.aggregate import memory_points
from estimators.tracing.memory import gradient_writes
from estimators.tracing.records import StepTrace, StorageKind as K

__all__ = ["stage_profile", "stage_module_info", "resident_bytes_at", "renamed", "MarksMissingError"]

_OWN = (K.ACTIVATION, K.TEMP)


class MarksMissingError(ValueError):
    """The estimate is not of a pipeline stage's micro-batch."""


def _marks(trace: StepTrace) -> tuple[int, int, int, int]:
    m, n = trace.marks, len(trace.ops)
    if "backward" not in m:
        raise MarksMissingError("this estimate is not of one pipeline stage micro-batch: trace it with "
                                "TrainStep(stage=StageRole(...)) (the planner does, from PlanOptions.pipeline)")
    opt = m.get("optimizer", n)
    return m["backward"], m.get("weight", opt), opt, n


def _live(trace: StepTrace, lo: int, hi: int, kinds, skip=frozenset()) -> np.ndarray:
    """Bytes of storages of ``kinds`` made in the step and alive at each op of [lo, hi)."""
    delta = np.zeros(max(hi - lo, 0) + 1, dtype=np.int64)
    for s in trace.storages:
        if s.kind not in kinds or s.alloc_op < 0 or s.sid in skip:
            continue
        a = max(s.alloc_op, lo)
        b = min((s.free_op if s.free_op is not None else hi) + 1, hi)
        if a < b:
            delta[a - lo] += s.nbytes
            delta[b - lo] -= s.nbytes
    return np.cumsum(delta[:-1])


def _across(trace: StepTrace, boundary: int, kinds, skip=frozenset()) -> int:
    """Bytes of storages of ``kinds`` made before ``boundary`` and alive at it."""
    return sum(s.nbytes for s in trace.storages
               if s.kind in kinds and s.sid not in skip and 0 <= s.alloc_op < boundary
               and (s.free_op is None or s.free_op >= boundary))


def _grad_pending(trace: StepTrace, lo: int, hi: int) -> np.ndarray:
    """At each op of [lo, hi): gradient bytes that do not exist yet there in the stage's first
    backward of a step, where the gradients are None (the loop zeroes them with ``set_to_none``);
    see ``estimators.tracing.memory.gradient_writes``."""
    return np.cumsum(gradient_writes(trace, lo, hi)[::-1])[::-1]


def _schedule_held(trace: StepTrace) -> frozenset[int]:
    """Storages the schedule keeps or receives (loss, gradients sent and received): counted by its
    rules, not as the micro-batch's own bytes."""
    return frozenset(s for name in ("loss", "input_grad", "output_grad") for s in trace.marked_sids.get(name, ()))


def _dropped_after_input_half(trace: StepTrace, role) -> frozenset[int]:
    """The last stage's output storages that autograd did not save: the schedule's ``fwd_cache``
    holds them from the forward until the micro-batch's backward pops them, into a local of
    ``backward_one_chunk`` that lives until the backward (or its input half) returns; the
    weight half runs from the loss alone. The trace's frame holds them to its end. After the
    input half they are the output chunk's (``return_outputs``) or nobody's."""
    if not role.is_last:
        return frozenset()
    root = next(c for c in trace.calls if c.parent < 0)
    return frozenset(s for s in root.output_sids if not trace.storages[s].saved)


def stage_profile(est, *, stage_index: int) -> StageProfile:
    """The ``StageProfile`` of ``est``, a trace of one pipeline micro-batch (see module doc)."""
    trace, tl = est.trace, est.timeline
    role = est.step.stage
    bw, w, opt, n = _marks(trace)
    kept = _schedule_held(trace)
    after = kept | _dropped_after_input_half(trace, role)  # from the weight half on
    row0 = tl.live_by_kind[0]
    split = role.split_backward
    root = next(c for c in trace.calls if c.parent < 0)
    ms = lambda lo, hi: float(sum(op.runtime_ms for op in trace.ops[lo:hi]))
    size = lambda name: sum(trace.storages[s].nbytes for s in set(trace.marked_sids.get(name, ())))
    return StageProfile(
        stage_index=stage_index, is_first=role.is_first, is_last=role.is_last, split=split,
        resident_bytes=int(row0[K.PARAM] + row0[K.BUFFER] + row0[K.OPTIMIZER]),
        grad_bytes=int(row0[K.GRAD]),
        input_bytes=0 if role.is_first else sum(trace.storages[s].nbytes for s in set(root.input_sids)),
        output_bytes=sum(trace.storages[s].nbytes for s in set(root.output_sids)),
        loss_bytes=size("loss"),
        # The forward's own bytes count its loss; after it, the schedule's hold does.
        fw=tuple(map(int, _live(trace, 0, bw, _OWN, kept - set(trace.marked_sids.get("loss", ()))))),
        bw=tuple(map(int, _live(trace, bw, w if split else opt, _OWN, kept))),
        w=tuple(map(int, _live(trace, w, opt, _OWN, after))) if split else (),
        grad_pending=tuple(map(int, _grad_pending(trace, w if split else bw, opt))),
        kept_after_fw=_across(trace, bw, _OWN, kept),
        kept_after_i=_across(trace, w, _OWN, after) if split else 0,
        optim=tuple(map(int, _live(trace, opt, n, (*_OWN, K.OPTIMIZER), after))),
        fw_ms=ms(0, bw), bw_ms=ms(bw, w if split else opt), w_ms=ms(w, opt) if split else 0.0,
        optim_ms=ms(opt, n), marks=(bw, w if split else opt, opt, n),
    )


def resident_bytes_at(est) -> np.ndarray:
    """At each op, the traced step's bytes that are not the micro-batch's own as the profile's
    curves count them: parameters, buffers, gradients, inputs, the optimizer state that existed
    before the step, and what the schedule keeps or receives (loss, gradients sent and received;
    the last stage's output after the input half, ``_dropped_after_input_half``)."""
    trace = est.trace
    kept = _schedule_held(trace)
    w, n = _marks(trace)[1], len(trace.ops)
    kinds = (*_OWN, K.OPTIMIZER)
    own = np.concatenate([_live(trace, 0, w, kinds, kept),
                          _live(trace, w, n, kinds, kept | _dropped_after_input_half(trace, est.step.stage))])
    return est.timeline.total - own


def stage_module_info(est) -> tuple[ModuleInfo, tuple[tuple[int, str], ...]]:
    """The stage's ModuleInfo with the windows its schedule's backward keeps, and the ops where a
    split backward's input half recomputes a module while its discard still holds.

    Split backward: a checkpointed module's discarded activations stay discarded from its forward
    end until its first **weight-half** op (the input half recomputes them and frees them again;
    the unplanned step keeps them for the weight half), so its window ends there. Without a split
    the trace's own ModuleInfo is returned."""
    info = est.module_info
    role = est.step.stage
    if role is None or not role.split_backward:
        return info, ()
    trace = est.trace
    _, w, opt, _ = _marks(trace)
    parent = {c.cid: c.parent for c in trace.calls}
    first_w: dict[int, int] = {}
    for op in trace.ops[w:opt]:
        c = op.call
        while c >= 0 and c not in first_w:
            first_w[c] = op.index
            c = parent[c]
    by_fqn: dict[str, int] = {}
    for c in trace.calls:
        if c.cid in first_w:
            by_fqn[c.fqn] = min(by_fqn.get(c.fqn, first_w[c.cid]), first_w[c.cid])
    stats, in_window = [], []
    for st in info.mod_stats:
        w_op = by_fqn.get(st.fqn, -1)
        if not st.is_leaf and st.sac_memory_bytes > 0 and 0 <= st.bw_pre_op < w_op and w_op > st.fw_post_op:
            in_window.append((st.bw_pre_op, st.fqn))
            st = dataclasses.replace(st, bw_pre_op=w_op)
        stats.append(st)
    points = list(memory_points(trace, est.timeline, stats))
    for t, fqn in in_window:
        row = est.timeline.live_by_kind[t]
        points.append(MemoryPoint(op_index=t, phase=Phase.BW, fqn=fqn, other_bytes=int(row.sum()),
                                  recompute_in_window=fqn))
    points.sort(key=lambda p: (p.op_index, p.recompute_of or "", p.recompute_in_window or ""))
    return dataclasses.replace(info, mod_stats=tuple(stats), memory_points=tuple(points)), tuple(in_window)


def renamed(est, rename):
    """``est`` with every module name ``rename(fqn)``: one trace for the stages that run the same
    modules under other names (the middle stages of a decoder: ``layers.8..15`` and
    ``layers.16..23``), traced once. Only names change; the ops, storages and times are the
    traced stage's."""
    trace = dataclasses.replace(
        est.trace, calls=[dataclasses.replace(c, fqn=rename(c.fqn)) for c in est.trace.calls],
        leaf_fqns={rename(f) for f in est.trace.leaf_fqns},
        param_bytes_by_module={rename(f): b for f, b in est.trace.param_bytes_by_module.items()},
        grad_bytes_by_module={rename(f): b for f, b in est.trace.grad_bytes_by_module.items()})
    info = est.module_info
    order = dataclasses.replace(info.mod_order, **{k: tuple(rename(f) for f in getattr(info.mod_order, k))
                                                   for k in ("fw_pre_order", "fw_post_order", "bw_pre_order",
                                                             "bw_post_order")})
    stats = tuple(dataclasses.replace(m, fqn=rename(m.fqn)) for m in info.mod_stats)
    points = tuple(dataclasses.replace(p, fqn=rename(p.fqn) if p.fqn else p.fqn,
                                       recompute_of=rename(p.recompute_of) if p.recompute_of else None)
                   for p in info.memory_points)
    info = dataclasses.replace(info, mod_order=order, mod_stats=stats, memory_points=points)
    return dataclasses.replace(est, trace=trace, module_info=info)
