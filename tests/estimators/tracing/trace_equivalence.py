"""Two traces of one step, compared record by record up to the numbering of their storages.

A replicated trace (``estimators.tracing.replicate``) numbers the storages of its laid-in blocks
after all the others; every other field of every op, call and storage must be the full trace's.
"""

from __future__ import annotations

import numpy as np

from estimators.tracing.estimation import Estimate
from estimators.tracing.records import StepTrace

_OP_FIELDS = ("index", "func", "phase", "call", "runtime_ms", "is_view", "is_random")
_CALL_FIELDS = ("cid", "fqn", "parent", "depth", "fw_first_op", "fw_last_op", "bw_first_op", "bw_last_op",
                "post_rank", "input_numel")
_STORAGE_FIELDS = ("nbytes", "alloc_op", "free_op", "kind", "phase", "owner_call", "saved", "saved_by_calls")


def trace_difference(a: StepTrace, b: StepTrace) -> str:
    """The first difference between ``a`` and ``b`` ("" if none), storages matched in the order
    the ops and calls reference them."""
    for what, x, y in (("ops", a.ops, b.ops), ("storages", a.storages, b.storages), ("calls", a.calls, b.calls)):
        if len(x) != len(y):
            return f"{len(x)} {what} vs {len(y)}"
    match: dict[int, int] = {}

    def same_sids(xs, ys, where: str) -> str:
        if len(xs) != len(ys):
            return f"{where}: {len(xs)} storages vs {len(ys)}"
        for s, t in zip(xs, ys):
            if match.setdefault(s, t) != t:
                return f"{where}: storage {s} is {match[s]} here and {t} there"
        return ""

    for x, y in zip(a.ops, b.ops):
        for f in _OP_FIELDS:
            if getattr(x, f) != getattr(y, f):
                return f"op {x.index} ({x.func}) {f}: {getattr(x, f)} vs {getattr(y, f)}"
        for f in ("new_sids", "arg_sids", "mutated_sids"):
            why = same_sids(getattr(x, f), getattr(y, f), f"op {x.index} ({x.func}) {f}")
            if why:
                return why
    for x, y in zip(a.calls, b.calls):
        for f in _CALL_FIELDS:
            if getattr(x, f) != getattr(y, f):
                return f"call {x.fqn} {f}: {getattr(x, f)} vs {getattr(y, f)}"
        for f in ("input_sids", "output_sids"):
            why = same_sids(getattr(x, f), getattr(y, f), f"call {x.fqn} {f}")
            if why:
                return why
    for s, t in match.items():
        x, y = a.storages[s], b.storages[t]
        for f in _STORAGE_FIELDS:
            if getattr(x, f) != getattr(y, f):
                return f"storage {s} (= {t}) {f}: {getattr(x, f)} vs {getattr(y, f)}"
    rest_a = sorted(_summary(s) for s in a.storages if s.sid not in match)
    matched = set(match.values())
    rest_b = sorted(_summary(s) for s in b.storages if s.sid not in matched)
    if rest_a != rest_b:
        return "the storages no op or call references differ"
    for f in ("leaf_fqns", "param_bytes_by_module", "grad_bytes_by_module", "device"):
        if getattr(a, f) != getattr(b, f):
            return f"trace {f} differs"
    if [a.storages[s].nbytes for s in a.previous_output_sids] != [b.storages[s].nbytes for s in b.previous_output_sids]:
        return "previous output differs"
    return ""


def _summary(s) -> tuple:
    return (s.nbytes, s.alloc_op, -2 if s.free_op is None else s.free_op, int(s.kind), s.phase.value, s.saved)


def estimate_difference(full: Estimate, replicated: Estimate) -> str:
    """The first difference between two estimates of one step ("" if none): the trace, the
    memory timeline, the ModuleInfo, the first step's peak."""
    why = trace_difference(full.trace, replicated.trace)
    if why:
        return why
    if not (np.array_equal(full.timeline.live_by_kind, replicated.timeline.live_by_kind)
            and np.array_equal(full.timeline.alloc_by_op, replicated.timeline.alloc_by_op)):
        return "memory timelines differ"
    if full.module_info != replicated.module_info:
        for x, y in zip(full.module_info.mod_stats, replicated.module_info.mod_stats):
            if x != y:
                f = next(f for f in x.__dataclass_fields__ if getattr(x, f) != getattr(y, f))
                return f"ModStats of {x.fqn} differ in {f}"
        return "ModuleInfo differs"
    if full.first_step_peak_bytes != replicated.first_step_peak_bytes:
        return "first-step peaks differ"
    return ""
