"""Selective-AC statistics: each module's forward ops, what recomputing them frees, and the curve.

Rules (each has its own test in tests/estimators/test_sac.py):

* a view-like op never costs memory: it aliases a storage another op created;
* the grouping rules (in-place chains, random ops, forced saves and recomputes) are
  ``estimators.contract.sac_groups``, shared with the op-level solver; an op with an output autograd does
  not save, or saves only outside this module, has a cache cost there (caching it would hold that
  output until this module's backward, longer than the unplanned step does);
* an op frees memory only through new storages that autograd saves for backward *inside this
  module alone*; a storage another module also saves stays alive anyway;
* a cast of a parameter (``_to_copy``: autocast's low-precision weight copy) frees nothing:
  autocast caches it until the autocast region ends, so a checkpoint does not drop it during the
  forward, and the recompute casts again in backward.

The greedy order takes units by memory freed per ms of recompute, largest first, so the cumulative
(discarded bytes, recompute ms) curve is convex and exact at every breakpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Union

import torch

from estimators.contract.module_info import Phase, SACOp, TradeoffCurve
from estimators.contract.sac_groups import SACGroup, sac_groups
from estimators.tracing.trace import ModuleCall, StepTrace, StorageKind

__all__ = [
    "module_ops", "greedy_units", "cumulative_curve", "replay_ms", "fixed_recompute_ms", "forced_recompute_ops",
    "subtree", "last_saved", "policy_ops", "full_recompute_ms",
]

_TO_COPY = torch.ops.aten._to_copy.default


@functools.lru_cache(maxsize=None)
def _name(func) -> str:
    """``str(func)`` once per op (an OpOverload builds it anew at each call)."""
    return str(func)


def subtree(trace: StepTrace, call: ModuleCall) -> set[int]:
    """Call ids of ``call`` and every call nested in it (calls are recorded in pre-order)."""
    ids = {call.cid}
    for c in trace.calls[call.cid + 1 :]:
        if c.parent in ids:
            ids.add(c.cid)
        elif c.depth <= call.depth:
            break
    return ids


def _moved_bytes(trace: StepTrace, rec) -> int:
    """Bytes an op reads and writes, as the storages it touches hold them (a view: none)."""
    if rec.is_view:
        return 0
    return sum(trace.storages[s].nbytes for s in {*rec.arg_sids, *rec.new_sids})


HostOpMs = Union[float, Callable[[Optional[int]], float]]
"""The host's cost of re-running an op: a constant, or a function of the bytes the op before
it read and wrote (None: the module's first op) (``DeviceSpec.recompute_op_host_ms``)."""


def _call_ops(trace: StepTrace, call: ModuleCall, host_op_ms: HostOpMs) -> list[SACOp]:
    inside = subtree(trace, call)
    ops: list[SACOp] = []
    seen: dict[str, int] = {}
    creator: dict[int, int] = {}  # sid -> index in `ops`
    recs = [r for r in trace.ops[call.fw_first_op : call.fw_last_op + 1] if r.phase is Phase.FW]
    last_write = {sid: i for i, r in enumerate(recs) for sid in r.mutated_sids}
    host = host_op_ms if callable(host_op_ms) else (lambda _, ms=host_op_ms: ms)
    moved_before: int | None = None
    for rec in recs:
        name = _name(rec.func)
        occ = seen.get(name, 0)
        seen[name] = occ + 1
        i = len(ops)
        memory = unsaved = 0
        saved = inner = False
        param_cast = rec.func is _TO_COPY and any(trace.storages[a].kind is StorageKind.PARAM for a in rec.arg_sids)
        for sid in rec.new_sids:
            st = trace.storages[sid]
            creator[sid] = i
            saved |= st.saved
            inner |= bool(st.saved_by_calls & inside)
            if st.saved and st.saved_by_calls <= inside and not param_cast:
                memory += st.nbytes
            elif not st.saved or not (st.saved_by_calls & inside):
                # Unsaved, or saved only by later modules (a block's output, which the next block
                # saves): their backward runs before this module's, so a cached copy would
                # outlive the unplanned one until this module's backward ends.
                unsaved += st.nbytes
        # Storages read here that a later op mutates in place: a saved copy would hold the
        # mutated values at recompute time (see SACOp.reads_before_mutation).
        # A view reads no values: it aliases the storage, as in the forward.
        stale = () if rec.is_view else tuple(sorted(
            {creator.get(sid, i) for sid in rec.arg_sids if last_write.get(sid, -1) > i and sid not in rec.mutated_sids}))
        parent = -1
        if rec.mutated_sids:
            parent = creator.get(rec.mutated_sids[0], i)
            saved |= any(trace.storages[s].saved for s in rec.mutated_sids)
            inner |= any(trace.storages[s].saved_by_calls & inside for s in rec.mutated_sids)
        ops.append(
            SACOp(
                func=name,
                occurrence=occ,
                runtime_ms=rec.runtime_ms + host(moved_before),
                memory_bytes=memory,
                is_view=rec.is_view,
                inplace_parent=parent,
                reads_before_mutation=stale,
                is_random=rec.is_random,
                is_saved=saved,
                saved_inside=inner,
                cache_cost_bytes=unsaved if saved else 0,
            )
        )
        if callable(host_op_ms):
            moved_before = _moved_bytes(trace, rec)
    return ops


def module_ops(trace: StepTrace, calls: list[ModuleCall], host_op_ms: HostOpMs = 0.0) -> tuple[SACOp, ...]:
    """Op table of a module, summed over its calls (matched by (func, occurrence)). Each op's
    ``runtime_ms`` is its traced time plus ``host_op_ms``, the host's cost of re-running it in a
    recompute (``DeviceSpec.recompute_op_host_ms``: by the bytes the op before it in the
    module's forward moved; the module's first op as after an unknown one, cold)."""
    if not calls:
        return ()
    first = _call_ops(trace, calls[0], host_op_ms)
    if len(calls) == 1:
        return tuple(first)
    mem = [o.memory_bytes for o in first]
    rt = [o.runtime_ms for o in first]
    inner = [o.saved_inside for o in first]  # saved inside in any call: the stop comes after it
    index = {(o.func, o.occurrence): i for i, o in enumerate(first)}
    for call in calls[1:]:
        for o in _call_ops(trace, call, host_op_ms):
            i = index.get((o.func, o.occurrence))
            if i is not None:
                mem[i] += o.memory_bytes
                rt[i] += o.runtime_ms
                inner[i] = inner[i] or o.saved_inside
    return tuple(
        dataclasses.replace(o, memory_bytes=m, runtime_ms=r, saved_inside=s)
        for o, m, r, s in zip(first, mem, rt, inner)
    )


def greedy_units(ops: tuple[SACOp, ...], groups: tuple[SACGroup, ...] | None = None) -> list[SACGroup]:
    """Units worth recomputing, in greedy order (most bytes per ms first, then op order).

    A unit is a group of ``estimators.contract.sac_groups``; groups whose decision the rules fix (must
    save, must recompute) are not choices, so they are not on the curve, nor are groups that
    free nothing. ``groups``: ``sac_groups(ops)`` where the caller has them."""
    units = [g for g in (sac_groups(ops) if groups is None else groups) if g.is_choice and g.memory_bytes > 0]
    # Cheapest time per byte first; ties by first op so the order is deterministic.
    units.sort(key=lambda u: (u.runtime_ms / u.memory_bytes, u.ops[0]))
    return units


def cumulative_curve(units: list[SACGroup]) -> TradeoffCurve:
    """The cumulative (discarded bytes, recompute ms) breakpoints of ``units`` in their order."""
    xs, ys = [0], [0.0]
    for u in units:
        xs.append(xs[-1] + u.memory_bytes)
        ys.append(ys[-1] + u.runtime_ms)
    return TradeoffCurve(discarded_bytes=tuple(xs), recompute_ms=tuple(ys))


def last_saved(ops: tuple[SACOp, ...]) -> int:
    """Index of the last op whose output an op of the module saves (``SACOp.saved_inside``; -1:
    none): where the recompute is priced to stop. torch stops it once the module's saved tensors
    are all packed again, and an op that saves only its inputs packs them before its kernel
    runs, so that op's kernel does not run again (a Llama layer's down projection). A lower
    bound where an op between the last saved output's producer and the op that saves it
    computes something else (a side branch): torch re-runs it, unpriced; the op tables do not
    record which op packs what. Without a saved output nothing is unpacked, so nothing is
    recomputed."""
    return max((i for i, o in enumerate(ops) if (o.is_saved if o.saved_inside is None else o.saved_inside)),
               default=-1)


def replay_ms(ops: tuple[SACOp, ...], rerun: Callable[[int, SACOp], bool]) -> float:
    """Time of a recompute that re-runs the ops ``rerun(index, op)`` selects (each op's
    ``runtime_ms``: its kernel and the host's cost of re-running it), up to the early stop
    (:func:`last_saved`)."""
    return sum(o.runtime_ms for i, o in enumerate(ops[: last_saved(ops) + 1]) if rerun(i, o))


def policy_ops(ops: tuple[SACOp, ...]) -> int:
    """Ops a selective policy sees in one call: every forward op, and every op the recompute
    replays up to the early stop (a cached op is looked up, not re-run, but still dispatched)."""
    return len(ops) + last_saved(ops) + 1


def fixed_recompute_ms(ops: tuple[SACOp, ...], groups: tuple[SACGroup, ...] | None = None) -> float:
    """Recompute time paid by any checkpoint of the module: the ops autograd does not save are
    re-run (saving them would cost memory the baseline never held), and so are the forced ones."""
    forced = set(forced_recompute_ops(ops, groups))
    return replay_ms(ops, lambda i, o: not o.is_saved or i in forced)


def full_recompute_ms(ops: tuple[SACOp, ...], groups: tuple[SACGroup, ...] | None = None) -> float:
    """Re-run time of a plain (full) checkpoint: every op up to the early stop; 0 where some
    group must be saved (discarding everything is then a selective checkpoint)."""
    if any(g.must_save for g in (sac_groups(ops) if groups is None else groups)):
        return 0.0
    return replay_ms(ops, lambda i, o: True)


def forced_recompute_ops(ops: tuple[SACOp, ...], groups: tuple[SACGroup, ...] | None = None) -> list[int]:
    """Ops (views aside: they launch nothing) re-run whenever the module is checkpointed: the
    must-recompute groups of ``estimators.contract.sac_groups``."""
    return [
        i for g in (sac_groups(ops) if groups is None else groups) if g.must_recompute
        for i in g.ops if not ops[i].is_view
    ]
