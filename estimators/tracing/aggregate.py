"""Trace + memory timeline -> ModuleInfo: one ModStats per module and the memory points."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from estimators.tracing.memory import MemoryTimeline, gradient_writes
from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, Phase
from estimators.runtime.device import DeviceSpec
from estimators.tracing.sac import (
    forced_recompute_ops,
    full_recompute_ms,
    subtree,
    fixed_recompute_ms,
    greedy_units,
    module_ops,
    cumulative_curve,
    policy_ops,
)
from estimators.contract.sac_groups import cached_if_saved, sac_groups, unsafe_reads
from estimators.tracing.trace import ModuleCall, StepTrace, StorageKind

__all__ = ["build_module_info", "memory_points", "points_at"]



def _order(calls: list[ModuleCall], key) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for c in sorted(calls, key=key):
        seen.setdefault(c.fqn, None)
    return tuple(seen)


def _mod_order(trace: StepTrace) -> ModOrder:
    calls = trace.calls
    with_bw = [c for c in calls if c.bw_first_op >= 0]
    return ModOrder(
        fw_pre_order=_order(calls, lambda c: c.cid),
        fw_post_order=_order(calls, lambda c: c.post_rank),
        # A parent's backward starts with (before) its first child's and ends after its last.
        bw_pre_order=_order(with_bw, lambda c: (c.bw_first_op, c.depth)),
        bw_post_order=_order(with_bw, lambda c: (c.bw_last_op, -c.depth)),
    )


def _ancestors_and_self(trace: StepTrace, cid: int):
    while cid >= 0:
        yield cid
        cid = trace.calls[cid].parent


def _per_call_saved_bytes(trace: StepTrace) -> dict[int, set[int]]:
    """Call id -> sids autograd packed while that call (or a nested one) ran; params excluded."""
    saved: dict[int, set[int]] = defaultdict(set)
    for s in trace.storages:
        if not s.saved or s.kind is StorageKind.PARAM:
            continue
        for cid in s.saved_by_calls:
            for a in _ancestors_and_self(trace, cid):
                saved[a].add(s.sid)
    return saved


def _bw_runtime_by_call(trace: StepTrace) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for op in trace.ops:
        if op.phase is Phase.BW:
            for a in _ancestors_and_self(trace, op.call):
                out[a] += op.runtime_ms
    return out


def _sum_bytes(trace: StepTrace, sids) -> int:
    return sum(trace.storages[s].nbytes for s in set(sids))


def _submodules(trace: StepTrace, call: ModuleCall) -> int:
    """Modules that ran nested in ``call`` (at any depth, each counted once): what the checkpoint
    wrapper walks on every call of a checkpointed module (``DeviceSpec.checkpoint_submodule_ms``)."""
    return len({trace.calls[c].fqn for c in subtree(trace, call)} - {call.fqn})


def _rerun_host(host: DeviceSpec | None):
    """The host's cost of re-running an op, as ``module_ops`` takes it: by the bytes the op
    before it moved where the spec has a warm cost (``DeviceSpec.recompute_op_host_ms``), else
    a constant (no bytes worked out)."""
    if host is None:
        return 0.0
    if host.recompute_op_warm_ms is None or host.host_cache_bytes <= 0:
        return host.recompute_op_ms
    return host.recompute_op_host_ms


def _call_host_ms(host: DeviceSpec, submodules: int) -> float:
    """Host time of one call of a checkpointed module with ``submodules`` nested modules."""
    return host.checkpoint_call_ms + host.checkpoint_submodule_ms * submodules


def _local_stats(
    trace: StepTrace, fqn: str, calls: list[ModuleCall], saved: dict[int, set[int]],
    last_fw_write: dict[int, tuple[int, Any]], host: DeviceSpec | None,
) -> dict:
    """The fields of a module's ModStats that depend on its own ops and storages only: the same
    for a call laid in as a copy of another (``StepTrace.twin_of``) as for that call. ``host``:
    the spec whose checkpoint host costs are priced (None: none)."""
    is_leaf = fqn in trace.leaf_fqns
    first = calls[0]
    n = len(calls)
    call_ms = n * _call_host_ms(host, _submodules(trace, first)) if host is not None else 0.0
    ops = () if is_leaf else module_ops(trace, calls, _rerun_host(host))
    groups = sac_groups(ops) if ops else ()
    units = greedy_units(ops, groups) if ops else []
    curve = cumulative_curve(units)
    forced = set(forced_recompute_ops(ops, groups)) if ops else set()
    policy_ms = ((host.selective_op_ms * policy_ops(ops) + host.selective_call_ms) * n
                 if host is not None and ops else 0.0)
    full_ms = full_recompute_ms(ops, groups) if ops else 0.0
    return dict(
        is_leaf=is_leaf,
        input_bytes=_sum_bytes(trace, first.input_sids),
        input_numel=max(c.input_numel for c in calls),
        output_bytes=_sum_bytes(trace, first.output_sids),
        act_fw_bytes=_sum_bytes(trace, set().union(*(saved.get(c.cid, set()) for c in calls))),
        sac_memory_bytes=curve.total_bytes,
        sac_runtime_ms=curve.total_ms,
        recompute_fixed_ms=(fixed_recompute_ms(ops, groups) + call_ms + policy_ms) if ops else 0.0,
        checkpoint_call_ms=call_ms if ops else 0.0,
        selective_policy_ms=policy_ms,
        full_recompute_ms=full_ms + call_ms if full_ms else 0.0,
        checkpoint_retain_bytes=0 if is_leaf else _retained_inputs(trace, calls),
        tradeoff=curve,
        ops=ops,
        recompute_growth_bytes=_recompute_growth(trace, first, ops, units, forced) if ops else (),
        forced_discard_bytes=sum(ops[i].memory_bytes for i in forced),
        sac_blocker="" if is_leaf else (_sac_blocker(trace, calls, last_fw_write) or _unsafe_read_blocker(ops)),
    )


def _mod_stats(
    trace: StepTrace,
    tl: MemoryTimeline,
    fqn: str,
    calls: list[ModuleCall],
    local: dict,
    bw_rt: dict[int, float],
    fw_rt_cum: np.ndarray,
    live_act: np.ndarray,
) -> ModStats:
    first, last = calls[0], max(calls, key=lambda c: c.fw_last_op)
    temp = tl.live_by_kind[:, StorageKind.TEMP]
    bw_calls = [c for c in calls if c.bw_first_op >= 0]
    bw_pre = min((c.bw_first_op for c in bw_calls), default=-1)
    bw_post = max((c.bw_last_op for c in bw_calls), default=-1)
    transient = 0
    act_bw_peak = act_grad = grad_total = 0
    if bw_pre >= 0:
        act_bw_peak = int(live_act[bw_pre : bw_post + 1].max())
        act_grad = max(0, int(temp[bw_pre : bw_post + 1].max() - temp[bw_pre]))
        grad_total = int(tl.live_by_kind[bw_pre, StorageKind.GRAD])
    if not local["is_leaf"] and first.fw_last_op >= first.fw_first_op:
        # The recompute replays the forward, and with it the forward's temporaries (tensors
        # autograd does not keep, e.g. attention scores before softmax): their peak growth.
        w = temp[first.fw_first_op : first.fw_last_op + 1]
        before = temp[first.fw_first_op - 1] if first.fw_first_op > 0 else 0
        transient = max(0, int(w.max() - before))
    fw_ms = sum(
        float(fw_rt_cum[c.fw_last_op + 1] - fw_rt_cum[c.fw_first_op]) for c in calls
    )
    return ModStats(
        fqn=fqn,
        n_calls=len(calls),
        param_bytes=trace.param_bytes_by_module.get(fqn, 0),
        grad_bytes=trace.grad_bytes_by_module.get(fqn, 0),
        act_total_bytes=int(live_act[last.fw_last_op]),
        grad_total_bytes=grad_total,
        act_bw_peak_bytes=act_bw_peak,
        act_grad_bytes=act_grad,
        fw_runtime_ms=fw_ms,
        bw_runtime_ms=sum(bw_rt.get(c.cid, 0.0) for c in calls),
        recompute_transient_bytes=transient,
        fw_pre_op=min(c.fw_first_op for c in calls),
        fw_post_op=last.fw_last_op + 1,
        bw_pre_op=bw_pre,
        bw_post_op=bw_post,
        **local,
    )


def _unsafe_read_blocker(ops) -> str:
    unsafe = unsafe_reads(ops)
    if not unsafe:
        return ""
    op = ops[unsafe[0]]
    return (f"{op.func} reads a tensor a later in-place op overwrites, in a part of the module that "
            "must be saved: its recompute would read the new values")


def _last_fw_writes(trace: StepTrace) -> dict[int, tuple[int, Any]]:
    """Storage id -> (index, func) of the last forward op that mutates it in place."""
    out: dict[int, tuple[int, Any]] = {}
    for op in trace.ops:
        if op.phase is Phase.FW:
            for sid in op.mutated_sids:
                out[sid] = (op.index, op.func)
    return out


def _sac_blocker(trace: StepTrace, calls: list[ModuleCall], last_fw_write: dict[int, tuple[int, Any]]) -> str:
    """Why a checkpoint of this module would be unsafe, from the trace ("" if it is not)."""
    seqs = set()  # the ops of each call (OpOverloads are one object per op)
    for c in calls:
        ops = [trace.ops[k] for k in range(c.fw_first_op, c.fw_last_op + 1)]
        # Buffers this call writes in place are given back to its recompute as the forward found
        # them (planner.applying.forward_state): a later write of one (BatchNorm's num_batches_tracked,
        # updated again by a second call of a shared block) does not reach the recompute.
        own_buffers = {sid for op in ops if op.phase is Phase.FW for sid in op.mutated_sids
                       if trace.storages[sid].kind is StorageKind.BUFFER}
        for op in ops:
            if op.phase is not Phase.FW:
                continue
            for sid in op.mutated_sids:
                st = trace.storages[sid]
                # Buffers (BatchNorm statistics) are put back after the recompute; anything else
                # made before the call (an input, a parameter) would be mutated a second time.
                if st.alloc_op < c.fw_first_op and st.kind is not StorageKind.BUFFER:
                    return f"mutates a tensor made before its call in place ({op.func})"
            for sid in op.arg_sids:
                # An input the caller overwrites in place after the call: the recompute would
                # read the new values (`g = gate(h); h.relu_()`: wrong gradients).
                st = trace.storages[sid]
                later = last_fw_write.get(sid)
                # Batch norm passes its running statistics only to update them (a shared one
                # updates them again after this call); the recompute puts them back anyway.
                if (later is not None and later[0] > c.fw_last_op and st.alloc_op < c.fw_first_op
                        and not (st.kind is StorageKind.BUFFER and "batch_norm" in str(op.func))
                        and sid not in own_buffers):
                    return f"reads a tensor the caller later overwrites in place ({later[1]})"
        seqs.add(tuple(op.func for op in ops if op.phase is Phase.FW))
    if len(seqs) > 1:
        return f"called {len(calls)} times per step with different ops in each call"
    return ""


_GROWTH_ROWS = 8
"""Units replayed together by ``_recompute_growth`` (a model's root has a thousand)."""


def _recompute_growth(trace: StepTrace, call: ModuleCall, ops, units, forced: set[int]) -> tuple[int, ...]:
    """Peak growth of live bytes during the recompute of ``call``, at each curve breakpoint.

    Replays the forward ops of the call as the checkpoint re-runs them: a cached op (saved, not
    recomputed) allocates nothing; a recomputed op allocates its outputs, which live to the end of
    the recompute when autograd saves them inside the module (the checkpoint holds them for the
    backward) and otherwise die when they died in the forward. The replay stops after the last
    op that saves inside the module (torch's early stop)."""
    inside = subtree(trace, call)
    fw = [rec for rec in trace.ops[call.fw_first_op : call.fw_last_op + 1] if rec.phase is Phase.FW]
    if len(fw) != len(ops):  # the op table is the first call's; it always is, but never guess
        return ()
    last = max((i for i, rec in enumerate(fw)
                if any(trace.storages[s].saved_by_calls & inside for s in rec.new_sids)), default=-1)
    if last < 0:
        return (0,) * (len(units) + 1)
    index = np.array([rec.index for rec in fw[: last + 1]])

    def alive(i: int, diff: np.ndarray) -> None:
        """Add the bytes op i's outputs hold at each replayed position (difference array)."""
        for sid in fw[i].new_sids:
            st = trace.storages[sid]
            held = bool(st.saved_by_calls & inside) or st.free_op is None
            end = last if held else min(last, int(np.searchsorted(index, st.free_op, "right")) - 1)
            if end >= i:
                diff[i] += st.nbytes
                diff[end + 1] -= st.nbytes

    cacheable = {i for i, o in enumerate(ops) if cached_if_saved(o) and i not in forced}
    diff = np.zeros(last + 2, dtype=np.int64)
    for i in range(last + 1):
        if i not in cacheable:
            alive(i, diff)
    cur = np.cumsum(diff)[: last + 1]
    out = [max(0, int(cur.max()))]
    for start in range(0, len(units), _GROWTH_ROWS):  # a row per unit, a block of rows at a time
        chunk = units[start : start + _GROWTH_ROWS]
        adds = np.zeros((len(chunk), last + 2), dtype=np.int64)
        for row, u in enumerate(chunk):
            for i in u.ops:
                if i <= last:
                    alive(i, adds[row])
        levels = np.cumsum(np.cumsum(adds, axis=1)[:, : last + 1], axis=0) + cur
        out += [max(0, int(m)) for m in levels.max(axis=1)]
        cur = levels[-1]
    return tuple(out)


def _retained_inputs(trace: StepTrace, calls: list[ModuleCall]) -> int:
    """Inputs the unplanned step frees before the module's backward; a checkpoint holds them."""
    held = set()
    for c in calls:
        for sid in c.input_sids:
            s = trace.storages[sid]
            if s.alloc_op >= 0 and s.free_op is not None and c.bw_first_op >= 0 and s.free_op < c.bw_first_op:
                held.add(sid)
    return _sum_bytes(trace, held)


def _point(trace: StepTrace, tl: MemoryTimeline, k: int, recompute_of: str | None,
           written: np.ndarray) -> MemoryPoint:
    row = tl.live_by_kind[k]
    op = trace.ops[k] if k < len(trace.ops) else None
    fqn = trace.calls[op.call].fqn if op is not None and op.call >= 0 else ""
    return MemoryPoint(
        op_index=k,
        phase=op.phase if op is not None else Phase.FW,
        fqn=fqn,
        param_bytes=int(row[StorageKind.PARAM]),
        grad_bytes=int(row[StorageKind.GRAD]),
        optimizer_bytes=int(row[StorageKind.OPTIMIZER]),
        activation_bytes=int(row[StorageKind.ACTIVATION]),
        other_bytes=int(row[StorageKind.TEMP] + row[StorageKind.INPUT] + row[StorageKind.BUFFER]),
        recompute_of=recompute_of,
        grad_written_bytes=int(written[min(k, len(written) - 1)]),
    )


def _written_before(writes: np.ndarray) -> np.ndarray:
    """Entry k: the gradient bytes ``writes`` (``gradient_writes`` of the whole step) made before op k."""
    return np.concatenate([[0], np.cumsum(writes)])


def points_at(trace: StepTrace, tl: MemoryTimeline, op_indices) -> list[MemoryPoint]:
    """The memory point at each of ``op_indices`` (``memory_points`` keeps only some)."""
    written = _written_before(gradient_writes(trace, 0, len(trace.ops)))
    return [_point(trace, tl, int(k), None, written) for k in op_indices]


def memory_points(trace: StepTrace, tl: MemoryTimeline, stats: list[ModStats]) -> list[MemoryPoint]:
    """One point per interval in which the set of discarded modules is constant (its highest
    live-bytes op), plus one recompute point at the start of each candidate's backward. Where
    the gradients exist before the step (accumulation), backward intervals also end at every
    gradient write, so a point's ``grad_written_bytes`` holds over its whole interval."""
    n = len(tl.total)
    if n == 0:
        return []
    cands = [s for s in stats if not s.is_leaf and s.sac_memory_bytes > 0]
    bounds = {0}
    for s in cands:
        bounds.add(min(s.fw_post_op, n - 1))
        if s.bw_pre_op >= 0:
            bounds.add(s.bw_pre_op)
            if s.checkpoint_retain_bytes and 0 <= s.bw_post_op < n - 1:
                bounds.add(s.bw_post_op + 1)  # a checkpoint's held inputs die here (solver)
    writes = gradient_writes(trace, 0, len(trace.ops))
    if any(s.kind is StorageKind.GRAD and s.alloc_op < 0 for s in trace.storages):
        # Gradients kept across backwards (accumulation): where each backward's gradients are
        # extra until reduced (FSDP2), the instants between two writes are apart.
        bounds.update(int(k) + 1 for k in np.flatnonzero(writes) if k + 1 < n)
    starts = np.array(sorted(bounds), dtype=np.int64)
    written = _written_before(writes)
    maxes = np.maximum.reduceat(tl.total, starts)
    points = []
    ends = list(starts[1:]) + [n]
    for a, b, m in zip(starts, ends, maxes):
        k = int(a + np.argmax(tl.total[a:b] == m))
        points.append(_point(trace, tl, k, None, written))
    for s in cands:
        if s.bw_pre_op >= 0:
            points.append(_point(trace, tl, s.bw_pre_op, s.fqn, written))
    points.sort(key=lambda p: (p.op_index, p.recompute_of or ""))
    return points


def build_module_info(trace: StepTrace, tl: MemoryTimeline, spec: DeviceSpec | None = None) -> ModuleInfo:
    """The ModuleInfo of a traced step; recompute is priced with ``spec``'s checkpoint host costs
    (``DeviceSpec.checkpoint_call_ms`` and the like; None: kernels only)."""
    by_fqn: dict[str, list[ModuleCall]] = {}
    for c in trace.calls:
        by_fqn.setdefault(c.fqn, []).append(c)
    saved = _per_call_saved_bytes(trace)
    bw_rt = _bw_runtime_by_call(trace)
    last_fw_write = _last_fw_writes(trace)
    rts = np.array([op.runtime_ms if op.phase is Phase.FW else 0.0 for op in trace.ops])
    fw_rt_cum = np.concatenate([[0.0], np.cumsum(rts)])
    # Activations, temporaries and inputs live at every op: computed once for all modules.
    act_kinds = [StorageKind.ACTIVATION, StorageKind.TEMP, StorageKind.INPUT]
    live_act = tl.live_by_kind[:, act_kinds].sum(axis=1)
    local_of: dict[int, dict] = {}  # call id -> local stats of the module called once there
    stats = []
    for fqn, calls in by_fqn.items():
        key = trace.twin_of.get(calls[0].cid, calls[0].cid) if len(calls) == 1 else -1
        local = local_of.get(key)
        if local is None:
            local = _local_stats(trace, fqn, calls, saved, last_fw_write, spec)
            if key >= 0:
                local_of[key] = local
        stats.append(_mod_stats(trace, tl, fqn, calls, local, bw_rt, fw_rt_cum, live_act))
    peak_k = tl.peak_op_index
    peak_op = ""
    if 0 <= peak_k < len(trace.ops):
        op = trace.ops[peak_k]
        where = trace.calls[op.call].fqn if op.call >= 0 else "(outside modules)"
        peak_op = f"{op.func} in {where} ({op.phase})"
    by_phase = defaultdict(float)
    for op in trace.ops:
        by_phase[op.phase] += op.runtime_ms
    return ModuleInfo(
        mod_order=_mod_order(trace),
        mod_stats=tuple(stats),
        memory_points=tuple(memory_points(trace, tl, stats)),
        peak_bytes=tl.peak_bytes,
        peak_op_index=peak_k,
        peak_op=peak_op,
        fw_runtime_ms=by_phase[Phase.FW],
        bw_runtime_ms=by_phase[Phase.BW],
        optimizer_runtime_ms=by_phase[Phase.OPTIM],
        device=trace.device,
    )
