"""The verification trace: the model traced again with a plan applied, as the plan will run.

``solve_sac`` never trusts the MILP's figure alone: each plan is applied to the model (under
FakeTensorMode, or for real in real mode) and the same training step traced again, so the peak it
states is a traced peak. The same trace finds planned modules whose recompute runs other ops
than their forward (a module that branches on grad mode, torch's ``CheckpointError``), which the
planner then leaves out by name::

    planned = traced_or_diverged(model, modules, est)    # or RecomputeDivergedError(fqns)
    planned.steady_peak_bytes
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.utils.checkpoint

from estimators.tracing.estimation import Estimate, estimate
from estimators.tracing.stacks import find_stacks
from estimators.tracing.sharded_model import original_class_name
from estimators.tracing.steady_state import first_step_module_info
from planner.applying.checkpointing import root_relative
from planner.distributed.fsdp import per_rank_info
from solver import predict_peak_bytes

__all__ = ["RecomputeDivergedError", "traced_estimate", "traced_or_diverged", "traced_peak",
           "peak_in_backward_of"]


def peak_in_backward_of(planned: Estimate, modules) -> str | None:
    """The checkpointed module (innermost) in whose backward the traced peak falls, if any."""
    from estimators.contract.module_info import Phase

    trace = planned.trace
    op = trace.ops[planned.timeline.peak_op_index]
    names = {m.fqn for m in modules}
    c = op.call if op.phase is Phase.BW else -1
    while c >= 0:
        if trace.calls[c].fqn in names:
            return trace.calls[c].fqn
        c = trace.calls[c].parent
    return None


def traced_peak(model, modules, est: Estimate) -> tuple[int, int]:
    """(first-step, steady-state) peak of the planned model, from a trace of the same step, mode
    and runtime as the estimate's (real mode applies the plan to the model and removes it)."""
    planned = traced_estimate(model, modules, est)
    return planned.first_step_peak_bytes, planned.steady_peak_bytes


class RecomputeDivergedError(RuntimeError):
    """The verification trace found planned modules whose recompute diverged from their forward."""

    def __init__(self, fqns: list[str]) -> None:
        super().__init__(f"the recompute of {', '.join(fqns)} ran other ops than the forward")
        self.fqns = fqns


def traced_or_diverged(model, modules, est: Estimate) -> Estimate:
    """``traced_estimate``, raising ``RecomputeDivergedError`` where a planned module's
    recompute diverged from its forward (the trace would then measure a fallback, or torch's
    checkpoint would refuse the recompute's metadata); other warnings pass through."""
    planned, error, diverged, others = trace_noting_divergence(model, modules, est)
    for w in others:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if diverged:
        raise RecomputeDivergedError(diverged) from error
    if error is not None:
        culprits = full_checkpoints_that_diverge(model, modules, est)
        if culprits:
            raise RecomputeDivergedError(culprits) from error
        raise error
    return planned


def trace_noting_divergence(model, modules, est: Estimate) -> tuple[Estimate | None, Exception | None,
                                                                     list[str], list]:
    """(the trace or None, torch's CheckpointError or None, the modules whose recompute
    diverged, the other warnings the trace gave)."""
    from planner.applying.planned_forward import CheckpointDivergenceWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            planned, error = traced_estimate(model, modules, est), None
        except torch.utils.checkpoint.CheckpointError as e:
            planned, error = None, e
    ours = [w.message.fqn for w in caught if isinstance(w.message, CheckpointDivergenceWarning)]
    others = [w for w in caught if not isinstance(w.message, CheckpointDivergenceWarning)]
    return planned, error, list(dict.fromkeys(f for f in ours if f)), others


def full_checkpoints_that_diverge(model, modules, est: Estimate) -> list[str]:
    """The fully checkpointed modules of ``modules`` whose recompute runs other ops than their
    forward, found by tracing them again replayed op by op (selective, nothing saved: the
    divergence then names its module). torch's own check of a full checkpoint only raises a
    CheckpointError naming no module (a module that runs an extra op when run in the backward)."""
    full = {m.fqn for m in modules if m.full}
    if not full:
        return []
    replayed = [dataclasses.replace(m, full=False) if m.full else m for m in modules]
    try:
        diverged = trace_noting_divergence(model, replayed, est)[2]
    except Exception:  # noqa: BLE001 - only an explanation: never hide torch's own error
        return []
    return [f for f in diverged if f in full]


def traced_estimate(model, modules, est: Estimate) -> Estimate:
    """The estimate of the model with ``modules`` applied (``est`` itself when empty). Where the
    plan treats the middle blocks of each stack alike (``plan_on_stacks``), the trace runs four
    blocks of each and lays the others in, as the unplanned trace does."""
    if not modules:
        return est
    from planner.applying.checkpointing import apply_module_plans

    opts = dataclasses.replace(est.options, progress=False)
    root = original_class_name(model)
    skipped = [st.block_name(k) for st in find_stacks(model) for k in st.skipped_keys]
    return estimate(model, est.step, device=est.spec, options=opts,
                    prepare=lambda m: apply_module_plans(m, _present(m, modules, root, skipped)),
                    prepare_on_stacks=lambda stacks: plan_on_stacks(modules, stacks, root))


def plan_on_stacks(modules, stacks, root: str) -> bool:
    """Whether the module plans do the same to blocks 1 to N-2 of every stack (blocks 0 and N-1
    are traced as they are) and checkpoint no module holding a stack: then a trace of blocks 0, 1,
    2 and N-1 with the plan, the others laid in as copies of block 2, is the planned full trace."""
    for st in stacks:
        prefix = f"{st.container}." if st.container else ""
        middle = {k: set() for k in st.keys[1:-1]}
        for mp in modules:
            rel = root_relative(mp.fqn, root)
            if rel is None or rel == "" or st.container == rel or st.container.startswith(rel + "."):
                return False  # the root, or a module holding the stack: its checkpoint spans the blocks
            if mp.offloaded_ops:
                return False  # host copies are not laid in (not checked against the full trace)
            if rel.startswith(prefix):
                key, _, sub = rel[len(prefix):].partition(".")
                if key in middle:
                    middle[key].add((sub, *(getattr(mp, f.name) for f in dataclasses.fields(mp) if f.name != "fqn")))
        if len({frozenset(v) for v in middle.values()}) > 1:
            return False
    return True


def _present(model, modules, root: str, skipped: list[str]) -> list:
    """The module plans whose module the traced copy has: all of them, but those in the blocks
    a truncated copy leaves out (``skipped``: their names; laid in from block 2's trace)."""
    out = []
    for mp in modules:
        rel = root_relative(mp.fqn, root) or ""
        block = next((b for b in skipped if rel == b or rel.startswith(b + ".")), None)
        if block is not None and not _has_module(model, block):
            continue
        out.append(mp)  # a plan of another model still fails in apply_module_plans, by name
    return out


def _has_module(model, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def per_rank_peaks(planned: Estimate, fsdp_units, world_size: int, mp_policy: Any = None) -> tuple[int, int]:
    """(first-step, steady-state) per-rank peak of a planned step's trace sharded over
    ``world_size`` ranks: the MILP's memory model with nothing more discarded, on the traced
    figures, with FSDP2's buffers for ``fsdp_units`` in ``mp_policy`` (``planner.distributed.fsdp``)."""
    info = planned.module_info
    if fsdp_units is not None:
        info = per_rank_info(info, list(fsdp_units), world_size, mp_policy)
    first = predict_peak_bytes(first_step_module_info(info), {}, world_size=world_size)
    return first, predict_peak_bytes(info, {}, world_size=world_size)
