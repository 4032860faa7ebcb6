"""``StageProfile``: one traced micro-batch of a pipeline stage, as plain numbers (torch-free).

Made by ``estimators.pipeline.stage_trace.stage_profile`` from a trace of
``estimators.step.stage_step.run_stage_microbatch``; read by ``estimators.pipeline.memory``
(the rank's memory over its schedule), ``estimators.pipeline.points`` (the MILP's rows) and
``estimators.pipeline.makespan`` (the step time).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageProfile"]


@dataclass(frozen=True, kw_only=True)
class StageProfile:
    """Bytes and times of one micro-batch of one stage. A micro-batch's own bytes are its
    activations and temporaries; what the schedule keeps beyond the micro-batch (its loss, the
    input gradient it sends) and what stands for the receive buffers are left out of the curves
    and counted by the schedule's rules."""

    stage_index: int
    is_first: bool
    is_last: bool
    split: bool
    """The backward runs as an input half (I) and a weight half (W)."""
    resident_bytes: int
    """Parameters, buffers and optimizer state: alive through the whole step."""
    grad_bytes: int
    """Parameter gradients once every one exists (after the stage's first backward)."""
    input_bytes: int
    """The activation received per micro-batch (0 on the first stage): one receive buffer."""
    output_bytes: int
    """The stage's output per micro-batch: on a non-last stage the activation sent (one receive
    buffer for its gradient), on the last stage the chunk ``step()`` keeps (logits)."""
    loss_bytes: int = 0
    """Last stage: one micro-batch's loss, kept by the schedule until its step ends."""
    fw: tuple[int, ...]
    """The micro-batch's own bytes at each op of its forward (and loss)."""
    bw: tuple[int, ...]
    """... of its backward, or of the input half (split)."""
    w: tuple[int, ...] = ()
    """... of the weight half (split)."""
    grad_pending: tuple[int, ...] = ()
    """At each op of the backward that writes the gradients (``bw``, or ``w`` when split): the
    gradient bytes that the stage's first backward of a step has not made yet there, beyond what
    the curve counts (a gradient made from a ``dw`` is that ``dw``: the curve counts it until the
    trace frees ``dw``, then the gradient counts; ``stage_trace._grad_pending``)."""
    kept_after_fw: int
    """The micro-batch's bytes alive between its forward and its backward."""
    kept_after_i: int = 0
    """... between its input half and its weight half (split)."""
    optim: tuple[int, ...] = ()
    """Bytes the optimizer step allocates, at each of its ops."""
    fw_ms: float = 0.0
    bw_ms: float = 0.0
    """The backward's time, or the input half's (split)."""
    w_ms: float = 0.0
    optim_ms: float = 0.0
    marks: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Op indices in the trace where the backward, the weight half (= backward when not split,
    = optimizer when no W), the optimizer step and the end lie; the forward starts at 0."""

    def curve(self, kind: str) -> tuple[int, ...]:
        """The micro-batch's own bytes over action ``kind`` (``"F"``, ``"B"``, ``"I"``, ``"W"``)."""
        if kind == "F":
            return self.fw
        if kind in ("B", "I"):
            return self.bw if not (self.split and self.is_first and kind == "I") else (0,)
        return self.w

    def segment(self, kind: str) -> tuple[int, int]:
        """[first op, end) of action ``kind`` in the trace's op numbering."""
        bw, w, opt, _ = self.marks
        if kind == "F":
            return 0, bw
        if kind == "B":
            return bw, opt
        if kind == "I":
            return bw, w
        return w, opt

    def duration_ms(self, kind: str) -> float:
        return {"F": self.fw_ms, "B": self.bw_ms, "I": self.bw_ms, "W": self.w_ms}[kind]
