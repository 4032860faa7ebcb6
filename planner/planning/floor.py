"""What sets a step's peak: the live memory at the peak op, by category and by the module that made it.

Used to explain the floor of planning (the smallest reachable budget): traced with the
min-peak plan applied, the breakdown says which memory no checkpointing plan can remove
(parameters, gradients, optimizer state, the logits and loss of a full-vocabulary LM head...),
and :func:`lowering_hints` says what would lower it.

    breakdown = peak_breakdown(est)                  # est: an estimators.tracing.estimation.Estimate
    print(floor_text(breakdown))
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from estimators.tracing.estimation import Estimate
from estimators.contract.module_info import ModuleInfo, Phase
from estimators.tracing.trace import StorageKind
from planner.format import fmt_bytes
from solver.plan_cost import MemoryModel

__all__ = ["PeakContributor", "PeakBreakdown", "peak_breakdown", "lowering_hints", "floor_text"]

# Categories that exist whatever is checkpointed; they shard with world_size (FSDP).
_STATE = {
    StorageKind.PARAM: "parameters",
    StorageKind.GRAD: "gradients",
    StorageKind.OPTIMIZER: "optimizer state",
    StorageKind.BUFFER: "buffers",
    StorageKind.INPUT: "inputs",
}
_SHARDED = (StorageKind.PARAM, StorageKind.GRAD, StorageKind.OPTIMIZER)
_TOP_OPS = 3


@dataclass(frozen=True, kw_only=True)
class PeakContributor:
    """One share of the memory live at the peak."""

    what: str
    """``"parameters"``, ``"gradients"``..., or ``"activations and temporaries made in <fqn>"``."""
    memory_bytes: int
    module: str = ""
    """The module whose ops made these tensors ("" for state; ``"(outside every module)"`` for the
    loss and other code run outside the model)."""
    top_ops: tuple[tuple[str, int], ...] = ()
    """The ops that made most of them, (aten op, bytes), largest first."""


@dataclass(frozen=True, kw_only=True)
class PeakBreakdown:
    """The live memory at the peak op of a traced step."""

    peak_bytes: int
    op: str
    """Aten op at which the peak happens."""
    phase: str
    """``"forward"``, ``"backward"`` or ``"optimizer step"``."""
    module: str
    """Innermost module running at the peak ("" outside every module)."""
    contributors: tuple[PeakContributor, ...]
    """Largest first; together they sum to ``peak_bytes`` (per rank with ``world_size``)."""
    world_size: int = 1


_OUTSIDE = "(outside every module)"
_FSDP = "FSDP2's gathered parameters and communication buffers"
_PHASES = {Phase.FW: "forward", Phase.BW: "backward", Phase.OPTIM: "optimizer step"}


def peak_breakdown(est: Estimate, *, world_size: int = 1, per_rank_info: ModuleInfo | None = None) -> PeakBreakdown:
    """Live storages at ``est``'s peak op, grouped: state by category (divided by ``world_size``,
    as FSDP shards it), activations and temporaries by the module whose op allocated them.

    ``per_rank_info``: ``est.module_info`` with FSDP2's per-rank additions in its points'
    ``other_bytes`` (``planner.distributed.fsdp.fsdp_module_info``). With it the breakdown is taken
    at the per-rank peak, not at the peak of the unsharded trace (which is the optimizer step
    wherever the full state dominates), and FSDP2's gathered parameters and buffers there are
    one more contributor, so the contributors sum to the per-rank peak the solver states."""
    trace, timeline = est.trace, est.timeline
    t, fsdp_bytes = timeline.peak_op_index, 0
    if per_rank_info is not None and per_rank_info.memory_points:
        totals = MemoryModel(per_rank_info, world_size).point_bytes({})
        i = max(range(len(totals)), key=totals.__getitem__)
        t = per_rank_info.memory_points[i].op_index
        fsdp_bytes = per_rank_info.memory_points[i].other_bytes - est.module_info.memory_points[i].other_bytes
    state: collections.Counter = collections.Counter()
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for s in trace.storages:
        if not (max(s.alloc_op, 0) <= t and (s.free_op is None or t <= s.free_op)):
            continue
        if s.kind in _STATE:
            state[s.kind] += s.nbytes
            continue
        op = trace.ops[s.alloc_op] if 0 <= s.alloc_op < len(trace.ops) else None
        call = op.call if op is not None else s.owner_call
        fqn = trace.calls[call].fqn if 0 <= call < len(trace.calls) else _OUTSIDE
        by_module[fqn][str(op.func) if op is not None else "?"] += s.nbytes
    out = [
        PeakContributor(what=name, memory_bytes=-(-state[k] // world_size) if k in _SHARDED else state[k])
        for k, name in _STATE.items()
        if state[k]
    ]
    if fsdp_bytes:
        out.append(PeakContributor(what=_FSDP, memory_bytes=fsdp_bytes))
    for fqn, ops in by_module.items():
        out.append(PeakContributor(
            what=f"activations and temporaries made in {fqn}" if fqn != _OUTSIDE
            else "activations and temporaries made outside the model (the loss, ...)",
            memory_bytes=sum(ops.values()), module=fqn, top_ops=tuple(ops.most_common(_TOP_OPS)),
        ))
    out.sort(key=lambda c: (-c.memory_bytes, c.what))
    rec = trace.ops[t] if 0 <= t < len(trace.ops) else None
    return PeakBreakdown(
        peak_bytes=sum(c.memory_bytes for c in out),
        op=str(rec.func) if rec is not None else "",
        phase=_PHASES.get(rec.phase, "") if rec is not None else "",
        module=trace.calls[rec.call].fqn if rec is not None and 0 <= rec.call < len(trace.calls) else "",
        contributors=tuple(out),
        world_size=world_size,
    )


_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy")
"""Ops of a classification loss over a vocabulary. Not a bare softmax: attention's made the hint
appear for every attention model whose peak sits in a block."""
_NOT_CHUNKABLE = ("ctc_loss",)
"""Losses over the whole sequence at once: chunking them by position is no remedy (Wav2Vec2's CTC
log_softmax got the chunked cross-entropy hint)."""


def lowering_hints(b: PeakBreakdown, *, top: int = 3) -> tuple[str, ...]:
    """What would lower this peak, judged from its largest contributors."""
    hints: list[str] = []
    big = b.contributors[:top]
    state = sum(c.memory_bytes for c in b.contributors if c.what in ("parameters", "gradients", "optimizer state"))
    if any(c.what == "optimizer state" for c in big):
        hints.append("an optimizer with less state (sgd keeps none, adam/adamw two copies of the parameters)")
    if state and state >= b.peak_bytes // 3:
        hints.append(f"shard parameters, gradients and optimizer state over more ranks (world_size > {b.world_size}, FSDP)")
    if any(c.what == _FSDP for c in big):
        hints.append("tensor parallelism (each rank gathers its share of a layer), or FSDP2 mixed "
                     "precision (MixedPrecisionPolicy(param_dtype=torch.bfloat16) gathers half the bytes)")
    acts = [c for c in big if c.module]
    if acts:
        hints.append("a smaller batch or sequence length (activations and temporaries scale with both)")
    ops = [op for c in acts for op, _ in c.top_ops]
    if any(k in op for op in ops for k in _LOSS_OPS) and not any(k in op for op in ops for k in _NOT_CHUNKABLE):
        hints.append("computing the loss in chunks of the sequence (chunked cross-entropy), so the "
                     "full-vocabulary logits and their softmax are never all alive at once")
    if any(c.what == "inputs" for c in big):
        hints.append("a smaller batch (the inputs themselves are among the largest tensors)")
    return tuple(hints)


def floor_text(b: PeakBreakdown, *, top: int = 4) -> str:
    """One line: the peak op and its largest contributors, e.g. ``"... activations and
    temporaries made in GPT.lm_head: 32.00 MiB (aten.mm 32.00 MiB); parameters: 8.00 MiB; ..."``."""
    where = f"{b.op} in the {b.phase}" + (f" of {b.module}" if b.module else "")
    parts = []
    for c in b.contributors[:top]:
        ops = ", ".join(f"{op.removeprefix('aten.')} {fmt_bytes(n)}" for op, n in c.top_ops)
        parts.append(f"{c.what}: {fmt_bytes(c.memory_bytes)}" + (f" ({ops})" if ops else ""))
    rest = sum(c.memory_bytes for c in b.contributors[top:])
    if rest:
        parts.append(f"the rest: {fmt_bytes(rest)}")
    per_rank = " per rank" if b.world_size > 1 else ""
    return f"at its peak ({fmt_bytes(b.peak_bytes)}{per_rank}, at {where}) the step holds " + "; ".join(parts)
