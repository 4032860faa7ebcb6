"""FSDP2 inside a pipeline stage: what a rank holds over its schedule beyond the traced stage.

    stage = stage_fsdp(module, step, spec)                # planner.distributed.fsdp.stage: FSDP2's own sizes
    profile, over = fsdp_profile(est, stage_profile(est, stage_index=s), stage)
    rank_memory(actions, {s: profile}, n, runtime, fsdp={s: over})

The stage is traced as it was before ``fully_shard`` (the program one rank runs, at its local
tensor-parallel shapes); FSDP2's part is added by the rules below. They are how FSDP2 runs under
torch 2.13's schedules without a split backward as torchtitan 0.3.0 composes them
(``apply_fsdp_to_decoder`` with PP: every unit ``reshard_after_forward=False``, the root FSDP2's
default for a root, which never reshards after forward): ``PipelineStage`` runs every backward
with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, and each
stage's ``perform_reduce_grad`` runs after its last backward: after the loop in the one-stage
schedules (``ScheduleGPipe``, ``Schedule1F1B``), as the ``REDUCE_GRAD`` action right after the
stage's last backward in the runtime ones (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``:
mid-step, the rank's other stages still running; their ``UNSHARD`` / ``RESHARD`` actions are
not recursive and touch only the stage's root unit, which holds no parameters in torchtitan's
layout, a root that does is refused). A *unit* is one FSDP2 parameter group (a
``fully_shard`` call, on one module or several). Sizes are FSDP2's own, read from its
``FSDPParam`` objects (``planner.distributed.fsdp.stage``): a parameter's shard is dim 0 padded
to a multiple of ``W``, every rank's storage that padded chunk. Each rule is checked against
MemTracker on gloo ranks (``benchmarks/pipeline_e2e.py --dp``):

F1  resident: the padded parameter shards and the optimizer state over the rank's own (unpadded)
    shards, instead of the traced parameters and state; buffers as traced.
F2  gathered: a unit's unsharded parameters (its all-gather outputs, ``W`` padded shards) exist
    from its all-gather, before its first forward op of the step's first micro-batch, until the
    step's reduce (F5); every later forward and backward finds it gathered (no all-gather).
F3  all-gather buffers, in that first forward: the flat output of the unit gathered last is held
    until the next unit's copy-out or the end of the root's forward; while the next unit's
    all-gather runs (before its copy-out) both flat outputs are alive. At an op where units
    gather, the rank holds the most of: after the op, every unit gathered so far and the last
    flat output; before it (what was alive before the op's own allocations), each gather's
    moment with the previous flat output.
F4  gradients: the unsharded gradients, the traced ones (in the placements the backward gives
    them), appear in the step's first backward as without FSDP2 (M3) and accumulate until F5.
F5  reduce (``perform_reduce_grad``; in a one-stage schedule inside its loop after the last
    backward: every hold of the step still alive but the losses the loop has returned, all but
    the last, and under 1F1B the last forward's output still referenced; in a runtime schedule
    right after the stage's last backward, every hold of that moment, the rank's other
    micro-batches in flight included): unit by unit in FSDP2's order (the
    root's first, then by module order) each gradient the backward made in other tensor-parallel
    placements is redistributed to the parameter's (a copy; the kept one freed after it; not yet
    at a measured peak), the unit is resharded (its gathered parameters freed),
    the previous unit's reduce-scatter input freed, its own allocated while its gradients are
    alive, its gradients freed by the copy-in but its last parameter's (``foreach_reduce``'s loop
    variable holds it until it returns), its reduce-scatter output allocated (the sharded
    gradients, kept through the optimizer step until the loop's ``zero_grad``); gloo, the CPU
    target's backend, reduce-scatters a copy of the input (NCCL none). The last unit's input is
    freed at the end.
F6  the optimizer step runs over the shards: its traced temporaries scaled by the rank's share of
    the stage's elements (exact where ``W`` divides every parameter's dim 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from estimators.pipeline.profile import StageProfile
from estimators.tracing.records import StorageKind as K

__all__ = ["FsdpUnit", "FsdpStage", "FsdpProfile", "fsdp_profile", "reduce_grad"]


@dataclass(frozen=True, kw_only=True)
class FsdpUnit:
    """One FSDP2 unit of a stage, in bytes on one rank."""

    modules: tuple[str, ...]
    """Its modules' names as the stage's trace names them (``"LlamaStage.layers.3"``)."""
    gathered_bytes: int
    """Its unsharded parameters (FSDP2's all-gather outputs, padded); also its flat all-gather
    output's size."""
    grad_bytes: int
    """Its unsharded gradients."""
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    """Its sharded gradients (the reduce-scatter output they are views of)."""
    last_grad_bytes: int = 0
    """Its last parameter's unsharded gradient (freed after the others in F5)."""
    redistributed: tuple[tuple[int, int], ...] = ()
    """Per parameter whose gradient the backward makes in other tensor-parallel placements than
    the parameter's (a vocabulary-sharded embedding's is replicated): (its kept gradient, the
    gradient in the parameter's placements) bytes; FSDP2 redistributes it before the reduce (F5)."""

    @property
    def kept_grad_bytes(self) -> int:
        """Its unsharded gradients as the backward makes them, kept until the reduce (F4)."""
        return self.grad_bytes + sum(kept - own for kept, own in self.redistributed)


@dataclass(frozen=True, kw_only=True)
class FsdpStage:
    """A pipeline stage sharded by FSDP2, as one rank holds it (trace-independent)."""

    world_size: int
    units: tuple[FsdpUnit, ...]
    """In the order the step's reduce takes them (FSDP2's ``all_states``)."""
    sharded_param_bytes: int
    """The rank's padded parameter shards (F1)."""
    optimizer_state_bytes: int | None
    """The optimizer's state over the rank's shards (F1); None: the traced state scaled as F6."""
    shard_numel: int
    """Parameter elements of the rank's shards (unpadded)."""
    full_numel: int
    """... of the unsharded parameters (the traced ones)."""
    copies_reduce_scatter_input: bool = False
    """The backend reduce-scatters a copy of its input (gloo; F5)."""

    def __post_init__(self) -> None:
        if self.world_size < 2 or not self.units or not 0 < self.shard_numel <= self.full_numel:
            raise ValueError(f"an FSDP2 stage needs world_size >= 2, units and 0 < shard_numel <= full_numel, "
                             f"got {self.world_size}, {len(self.units)} units, {self.shard_numel} / {self.full_numel}")

    def scaled(self, nbytes: int) -> int:
        """``nbytes`` of the whole stage's parameters scaled to the rank's shards (F6)."""
        return -(-nbytes * self.shard_numel // self.full_numel)


@dataclass(frozen=True)
class FsdpProfile:
    """What the rank's memory adds for one FSDP2 stage of one trace (``rank_memory(fsdp=...)``)."""

    units: tuple[FsdpUnit, ...]
    first_forward: tuple[int, ...]
    """Per op of the forward (the profile's ``fw``), in the step's first forward: gathered units
    and all-gather buffers (F2, F3)."""
    copies_reduce_scatter_input: bool = False

    @property
    def gathered_bytes(self) -> int:
        return sum(u.gathered_bytes for u in self.units)

    @property
    def sharded_grad_bytes(self) -> int:
        """The gradients after the reduce (F5)."""
        return sum(u.reduce_scatter_output_bytes for u in self.units if u.grad_bytes)


def _allocated(trace, hi: int, skip: frozenset) -> np.ndarray:
    """Bytes of the micro-batch's own storages allocated at each op of [0, hi)."""
    out = np.zeros(hi, dtype=np.int64)
    for s in trace.storages:
        if s.kind in (K.ACTIVATION, K.TEMP) and s.sid not in skip and 0 <= s.alloc_op < hi:
            out[s.alloc_op] += s.nbytes
    return out


def _first_forward(est, units: tuple[FsdpUnit, ...], fw_len: int) -> tuple[int, ...]:
    """F2 + F3 at each op of the traced forward."""
    stats = {m.fqn: m for m in est.module_info.mod_stats}
    root = est.module_info.mod_stats[0]
    first = []
    for u in units:
        ops = [stats[f].fw_pre_op for f in u.modules if f in stats and stats[f].fw_pre_op >= 0]
        if not ops:
            raise ValueError(f"FSDP2 unit {list(u.modules)} never runs in the traced forward")
        first.append(min(ops))
    order = sorted(range(len(units)), key=lambda i: first[i])  # stable: a unit nested in another gathers after it
    trace = est.trace
    kept = frozenset(s for name in ("loss", "input_grad", "output_grad") for s in trace.marked_sids.get(name, ()))
    alloc = _allocated(trace, fw_len, kept)
    end = root.fw_post_op if root.fw_post_op >= 0 else fw_len
    out, k, gathered, buffer = [], 0, 0, 0
    for j in range(fw_len):
        moments = []
        while k < len(order) and first[order[k]] <= j:
            u = units[order[k]]
            moments.append(gathered + buffer + u.gathered_bytes)  # its all-gather beside the last flat output
            gathered, buffer = gathered + u.gathered_bytes, u.gathered_bytes
            k += 1
        held = gathered + (buffer if j < end else 0)
        out.append(max([held] + [m - int(alloc[j]) for m in moments]))
    return tuple(out)


def fsdp_profile(est, profile: StageProfile, stage: FsdpStage) -> tuple[StageProfile, FsdpProfile]:
    """``profile`` (of ``est``, one traced micro-batch of the stage before ``fully_shard``) as
    the rank holds it under ``stage`` (F1, F6), and what the rank's memory adds over the
    schedule (F2-F5)."""
    row0 = est.timeline.live_by_kind[0]
    traced_params, traced_state = int(row0[K.PARAM]), int(row0[K.OPTIMIZER])
    state = stage.scaled(traced_state) if stage.optimizer_state_bytes is None else stage.optimizer_state_bytes
    resident = profile.resident_bytes - traced_params - traced_state + stage.sharded_param_bytes + state
    grads = sum(u.kept_grad_bytes for u in stage.units)
    if grads != profile.grad_bytes:
        raise ValueError(f"the FSDP2 units' unsharded gradients ({grads} B) are not the traced ones "
                         f"({profile.grad_bytes} B): a parameter without a gradient, or one the backward "
                         "gives in another placement, is not modelled in an FSDP2 stage")
    sharded = dataclasses.replace(profile, resident_bytes=resident,
                                  optim=tuple(stage.scaled(b) for b in profile.optim))
    return sharded, FsdpProfile(stage.units, _first_forward(est, stage.units, len(profile.fw)),
                                stage.copies_reduce_scatter_input)


def reduce_grad(units: tuple[FsdpUnit, ...], before: int, *, copies_input: bool = False) -> int:
    """The highest point of F5 from ``before`` bytes (gradients unsharded, units gathered);
    ``copies_input``: the backend reduce-scatters a copy of the input (gloo)."""
    now, peak, held = before, before, 0
    for u in units:
        for kept, own in u.redistributed:  # each gradient redistributed (a copy), then the kept one freed
            peak = max(peak, now + own)
            now += own - kept
        now -= u.gathered_bytes + held
        if not u.grad_bytes:  # no gradient: nothing to reduce
            held = 0
            continue
        held = u.reduce_scatter_input_bytes
        now += held
        peak = max(peak, now)  # its input beside its gradients
        now += u.last_grad_bytes - u.grad_bytes + u.reduce_scatter_output_bytes
        peak = max(peak, now + (held if copies_input else 0))
        now -= u.last_grad_bytes
    return peak
