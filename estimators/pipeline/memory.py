"""A rank's memory over its pipeline schedule, composed from one traced micro-batch per stage.

    rm = rank_memory(layout.actions(rank), {s: profile_s, ...}, n_microbatches=8, runtime=layout.runtime)
    rm.peak_bytes, rm.actions[i].peak_bytes

The rules, read off torch.distributed.pipelining 2.13 (``stage.py``, ``schedules.py``,
``_backward.py``) and each checked against torch's MemTracker on real gloo runs (96 rank
configurations of GPipe, 1F1B, Interleaved1F1B and InterleavedZeroBubble, 2 and 4 ranks, 4 and 8
micro-batches: equal to the byte; ``benchmarks/pipeline_e2e.py``):

M1  resident: every local stage's parameters, buffers and optimizer state, and the batch the loop
    holds on a rank that reads it (``batch_bytes``).
M2  receive buffers: one per micro-batch for the activation (non-first stage) and one for its
    gradient (non-last stage), made at the first ``step()`` and kept across steps.
M3  gradients: none until the stage's first gradient-writing action of the step (the loop zeroes
    them with ``set_to_none``); during it they appear as they are written (``grad_pending``: a
    gradient made from its ``dw``, which the weight half assigns and AccumulateGrad steals, is
    that ``dw``, counted once); then all of them.
M4  each micro-batch between its forward and its backward keeps ``kept_after_fw``; between its
    input and weight halves ``kept_after_i``.
M5  what the schedule's bookkeeping keeps:
    - the last stage: each micro-batch's loss until the schedule's loop (``_step_microbatches``)
      returns; its output, the micro-batch's own bytes until its backward (or input half)
      ends, from then on as the output chunk until the next ``step()`` clears it
      (``return_outputs=True``, torch's default; with False nothing holds it); and after the
      loop the merged output (``torch.cat`` of the chunks) while the chunks are still held (the
      loop's holds are gone by then);
    - a sent tensor lives as long as its send's Work object (gloo keeps the tensor after
      ``wait()``): GPipe and the runtime schedules keep every Work to the end of the loop, so
      every micro-batch's output (non-last stage) and input gradient (non-first) live to then;
      1F1B keeps an input gradient until the stage's next backward ends, and the warm-up's last
      fired send (the output of micro-batch w - 2 of w warm-up forwards) until its 1B1F loop ends;
    - a split backward's input half leaves the input gradient on the receive buffer's ``.grad``
      until the next step's ``step()`` clears it: through the optimizer step.
M6  one optimizer step over every local stage's parameters; foreach temporaries add up.

A stage sharded by FSDP2 follows M1-M6 on its sharded state plus the rules F1-F6 of
``estimators.pipeline.fsdp`` (``fsdp=``): gathered units from the step's first forward, and the
reduce after the stage's last backward (no split backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from estimators.pipeline.fsdp import FsdpProfile, reduce_grad
from estimators.pipeline.profile import StageProfile
from estimators.pipeline.schedule import Runtime

__all__ = ["ActionMemory", "RankMemory", "rank_memory"]

_STEP, _NEXT_STEP = "step", "next step"  # when a schedule's hold ends (M5)


@dataclass(frozen=True)
class ActionMemory:
    """One compute action of a rank's schedule and the memory around it (bytes)."""

    stage: int
    kind: str
    microbatch: int
    base_bytes: int
    """Everything the action does not own: resident state, gradients, the schedule's holds, the
    other micro-batches in flight."""
    peak_bytes: int
    """The highest point inside the action."""
    in_flight: dict[int, int] = field(default_factory=dict)
    """Per local stage: its other micro-batches in flight (forward done, backward not)."""
    first_write: bool = False
    """The stage's first gradient-writing action of the step (M3)."""
    first_forward: bool = False
    """An FSDP2 stage's first forward of the step: its units gather (F2, F3)."""


@dataclass(frozen=True)
class RankMemory:
    """The rank's memory over one step."""

    peak_bytes: int
    actions: tuple[ActionMemory, ...]
    merge_peak_bytes: int
    """At the end of ``step()``: the merged output beside the chunks (last stage)."""
    end_base_bytes: int
    """After ``step()`` returns: what the optimizer step starts from."""
    optim_peak_bytes: int
    reduce_peak_bytes: int = 0
    """FSDP2 stages: the highest point of the step's reduces (F5); 0 without FSDP2."""
    reduces: tuple[tuple[int, dict[int, int]], ...] = ()
    """Per FSDP2 stage's reduce (F5): its highest point and, per local stage, the other
    micro-batches in flight then (a runtime schedule reduces a stage mid-step)."""

    @property
    def peak_where(self) -> str:
        top = max(self.actions, key=lambda a: a.peak_bytes, default=None)
        ends = {"reduce-scatter": self.reduce_peak_bytes, "merge": self.merge_peak_bytes,
                "optimizer": self.optim_peak_bytes}
        if top is not None and top.peak_bytes >= max(ends.values()):
            return f"{top.stage}{top.kind}{top.microbatch}"
        return max(ends, key=ends.get)


def _warm_up_send(actions, stage: int, profile: StageProfile) -> tuple[int, int] | None:
    """1F1B (M5): (micro-batch whose output the warm-up's last fired send keeps, index of the
    action after which its 1B1F loop ends and lets go of it), or None."""
    mine = [(i, k, m) for i, (s, k, m) in enumerate(actions) if s == stage]
    first_b = next((j for j, (_, k, _) in enumerate(mine) if k == "B"), len(mine))
    last_f = max((j for j, (_, k, _) in enumerate(mine) if k == "F"), default=-1)
    end = next((mine[j][0] for j in range(last_f + 1, len(mine)) if mine[j][1] == "B"), None)
    if first_b < 2 or profile.is_last or end is None:
        return None
    return mine[first_b - 2][2], end


def rank_memory(actions, profiles: dict[int, StageProfile], n_microbatches: int, runtime, *,
                return_outputs: bool = True, batch_bytes: int = 0, grads_at_start: bool = False,
                fsdp: dict[int, FsdpProfile] | None = None) -> RankMemory:
    """The rank's memory over one step (``actions``: the rank's ``(stage, kind, micro-batch)``
    in order; ``profiles``: its local stages; ``runtime``: ``estimators.pipeline.schedule.Runtime``).

    ``grads_at_start``: the loop keeps gradients allocated between steps (``ZeroGrad.ZERO``): M3
    does not apply. ``fsdp``: the stages sharded by FSDP2 (their profiles as ``fsdp_profile``
    gives them; no split backward)."""
    fsdp = fsdp or {}
    if fsdp and (grads_at_start or any(k in ("I", "W") for _, k, _ in actions)):
        raise ValueError("FSDP2 stages are modelled without a split backward, with gradients set to None "
                         "between steps")
    resident = batch_bytes + sum(p.resident_bytes for p in profiles.values())
    resident += sum(n_microbatches * ((0 if p.is_first else p.input_bytes) + (0 if p.is_last else p.output_bytes))
                    for p in profiles.values())  # M2
    state: dict[tuple[int, int], str] = {}
    held: dict[tuple, tuple[int, object]] = {}  # key -> (bytes, when it ends)
    grads_done: set[int] = set(profiles) if grads_at_start else set()
    gathered: set[int] = set()  # FSDP2 stages past their first forward (F2)
    reduced: dict[int, int] = {}  # FSDP2 stages past their reduce: their sharded gradients (F5)
    backwards: dict[int, int] = {}  # per stage: its backwards so far
    reduces: list[tuple[int, dict[int, int]]] = []

    def reduce(s: int, before: int) -> None:  # F5
        reduces.append((reduce_grad(fsdp[s].units, before, copies_input=fsdp[s].copies_reduce_scatter_input),
                        in_flight(-1, -1)))
        gathered.discard(s)
        reduced[s] = fsdp[s].sharded_grad_bytes  # through the optimizer step
    warm = {}
    if runtime is Runtime.ONE_F_ONE_B:
        warm = {s: w for s, p in profiles.items() if (w := _warm_up_send(actions, s, p)) is not None}

    def base(s: int, mb: int) -> int:
        b = resident + sum(reduced.get(t, profiles[t].grad_bytes) for t in grads_done)
        b += sum(v for v, _ in held.values()) + sum(fsdp[t].gathered_bytes for t in gathered)
        for (t, m), st in state.items():
            if (t, m) != (s, mb):
                b += profiles[t].kept_after_fw if st == "F" else profiles[t].kept_after_i
        return b

    def in_flight(s: int, mb: int) -> dict[int, int]:
        flight: dict[int, int] = {}
        for (t, m) in state:
            if (t, m) != (s, mb):
                flight[t] = flight.get(t, 0) + 1
        return flight

    out = []
    for i, (s, kind, mb) in enumerate(actions):
        p = profiles[s]
        curve = p.curve(kind)
        writes = kind == "W" or (kind == "B")
        first_write = writes and s not in grads_done
        first_forward = kind == "F" and s in fsdp and s not in gathered
        if first_write:  # M3
            top = max(c + p.grad_bytes - p.grad_pending[j] for j, c in enumerate(curve)) if curve else 0
        elif first_forward:  # F2, F3
            top = max(c + e for c, e in zip(curve, fsdp[s].first_forward))
        else:
            top = max(curve, default=0)
        b = base(s, mb)
        out.append(ActionMemory(s, kind, mb, b, b + top, in_flight(s, mb), first_write, first_forward))
        if first_forward:
            gathered.add(s)
        if kind == "F":
            state[(s, mb)] = "F"
            if p.is_last and p.loss_bytes:
                held[("loss", s, mb)] = (p.loss_bytes, _STEP)
            continue
        if p.is_last and return_outputs and kind in ("B", "I"):  # after the backward pops it
            held[("chunk", s, mb)] = (p.output_bytes, _NEXT_STEP)
        if kind == "I":
            state[(s, mb)] = "I"
            if not p.is_first:
                held[("input_grad", s, mb)] = (p.input_bytes, _NEXT_STEP)
            continue
        state.pop((s, mb), None)  # B or W ends the micro-batch
        if writes:
            grads_done.add(s)
        if runtime is Runtime.ONE_F_ONE_B and kind == "B":
            for k in [k for k, (_, end) in held.items() if end == ("next B", s)]:
                del held[k]
        if not p.is_last and runtime is not Runtime.ONE_F_ONE_B:
            held[("sent output", s, mb)] = (p.output_bytes, _STEP)
        if not p.is_first and kind == "B":
            held[("input_grad", s, mb)] = (p.input_bytes, ("next B", s) if runtime is Runtime.ONE_F_ONE_B else _STEP)
        if s in warm and warm[s][0] == mb:  # its backward is done, the warm-up send still holds it
            held[("warm-up send", s)] = (p.output_bytes, "loop")
        if s in warm and warm[s][1] == i:
            held.pop(("warm-up send", s), None)
        backwards[s] = backwards.get(s, 0) + 1
        if runtime is Runtime.RUNTIME and s in gathered and backwards[s] == n_microbatches:
            reduce(s, base(-1, -1))  # F5: REDUCE_GRAD right after the stage's last backward
    # F5 after a one-stage loop: every hold of the step, the last loss only, 1F1B's last output
    inside = -sum((n_microbatches - 1) * p.loss_bytes for p in profiles.values() if p.is_last)
    if runtime is Runtime.ONE_F_ONE_B:
        inside += sum(p.output_bytes for p in profiles.values() if not p.is_last)
    for s in sorted(set(fsdp) & gathered):
        reduce(s, base(-1, -1) + inside)
    reduce_peak = max((r for r, _ in reduces), default=0)
    for k in [k for k, (_, end) in held.items() if end != _NEXT_STEP]:
        del held[k]
    end = base(-1, -1)
    merge_peak = end + sum(n_microbatches * p.output_bytes for p in profiles.values() if p.is_last and return_outputs)
    n_opt = max((len(p.optim) for p in profiles.values()), default=0)
    opt = [sum(p.optim[j] for p in profiles.values() if j < len(p.optim)) for j in range(n_opt)]  # M6
    optim_peak = end + max(opt, default=0)
    peak = max([a.peak_bytes for a in out] + [merge_peak, optim_peak, reduce_peak])
    return RankMemory(peak, tuple(out), merge_peak, end, optim_peak, reduce_peak, tuple(reduces))
