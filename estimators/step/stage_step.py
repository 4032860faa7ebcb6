"""One micro-batch of a pipeline stage, as ``torch.distributed.pipelining`` runs it.

A stage of a pipeline schedule does not run ``loss.backward()``: per micro-batch it runs its
module on the activation it received (a leaf that requires grad), computes the loss only on the
last stage (``loss_fn(output, target)``, as the schedule calls it), and runs the backward through
torch's own ``stage_backward`` (seeded, on a non-last stage, by the output gradient it received),
or, under a zero-bubble schedule, ``stage_backward_input`` now and ``stage_backward_weight``
later. ``run_stage_microbatch`` runs exactly that, with torch's functions, so that a trace of it
counts what the schedule's stage counts.

    role = StageRole(is_first=False, is_last=False, split_backward=True)
    run_stage_microbatch(module, (h,), loss_fn, None, optimizer, role, on_phase=..., on_mark=...)

``on_mark(name, tensor)`` names the parts of the micro-batch for the trace (``MARKS``): where the
backward, its weight half and the optimizer step begin, and the tensors the schedule keeps beyond
the micro-batch's own lifetime (its loss, the received activation's ``.grad``) or that stand for
its receive buffers (the output gradient).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from estimators.contract.module_info import Phase

__all__ = ["StageRole", "MARKS", "run_stage_microbatch"]

MARKS = ("backward", "weight", "optimizer", "loss", "output_grad", "input_grad")
"""Names ``run_stage_microbatch`` passes to ``on_mark``: op positions (``backward``, ``weight``,
``optimizer``) and tensors (``loss``, ``output_grad``: the received output gradient, one
receive buffer; ``input_grad``: the gradient sent back, which a split backward leaves on the
received activation's ``.grad``)."""


@dataclass(frozen=True, kw_only=True)
class StageRole:
    """Which parts of a pipeline micro-batch a stage runs."""

    is_first: bool
    """The stage gets the batch itself (no activation received, no input gradient sent)."""
    is_last: bool
    """The stage computes the loss (no output gradient received)."""
    split_backward: bool = False
    """The schedule splits the backward: ``stage_backward_input`` (I), later
    ``stage_backward_weight`` (W). torch's first stage computes nothing in I and its whole
    backward in W."""
    group_weight_backward: bool = True
    """Run W under one ``torch.utils.checkpoint.GraphExecGroup``: W calls ``autograd.grad`` once
    per parameter group, and a checkpointed region would be recomputed (and held) once per group
    otherwise; ``planner.applying.pipeline.apply_to_stage`` installs the same on the
    ``PipelineStage``."""

    def describe(self) -> str:
        where = "first" if self.is_first else "last" if self.is_last else "middle"
        if self.is_first and self.is_last:
            where = "only"
        return f"{where} stage" + (", split backward" if self.split_backward else "")


def run_stage_microbatch(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    target: Any,
    optimizer: torch.optim.Optimizer | None,
    role: StageRole,
    *,
    on_phase: Callable[[Phase], None] | None = None,
    on_mark: Callable[[str, torch.Tensor | None], None] | None = None,
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> set[int]:
    """Forward, loss (last stage), backward of one micro-batch, then the optimizer step.

    ``inputs``: the stage's forward input (a tensor or a tuple of positional tensors): the
    batch on the first stage, else the received activation (made a leaf that requires grad, as
    the receive buffer is). ``context``: ``TrainStep.context``, entered around the forward, the
    loss and the backward (both halves), as a loop enters it around ``schedule.step()``
    (torchtitan's ``train_context``: ``loss_parallel`` for vocabulary-sharded logits); the
    optimizer step runs outside it. Returns the ids of the parameters whose ``.grad`` the
    backward wrote (a split backward assigns ``.grad`` itself, so post-accumulate-grad hooks do
    not fire)."""
    phase = on_phase or (lambda _p: None)
    mark = on_mark or (lambda _n, _t=None: None)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not role.is_first:
        args = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)
    params = [p for p in model.parameters() if p.requires_grad]
    before = {id(p): (p.grad, p.grad._version if p.grad is not None else -1) for p in params}
    with context() if context is not None else contextlib.nullcontext():
        _forward_backward(model, args, loss_fn, target, role, params, phase, mark)
    written = {id(p) for p in params
               if p.grad is not None and (p.grad is not before[id(p)][0] or p.grad._version != before[id(p)][1])}
    if optimizer is not None:
        phase(Phase.OPTIM)
        mark("optimizer", None)
        optimizer.step()
    return written


def _forward_backward(model, args: tuple, loss_fn, target, role: StageRole, params: list, phase, mark) -> None:
    """The micro-batch's forward, loss (last stage) and backward, as the schedule runs them."""
    from torch.distributed.pipelining._backward import (
        stage_backward, stage_backward_input, stage_backward_weight)

    phase(Phase.FW)
    out = model(*args)
    outputs = out if isinstance(out, tuple) else (out,)
    if role.is_last:  # the schedule computes the loss right after the forward
        loss = loss_fn(out, target)
        mark("loss", loss)
    phase(Phase.BW)
    mark("backward", None)
    if role.is_last:
        bw_outputs, bw_grads = [loss], None
    else:
        grads = [torch.empty_like(o) for o in outputs]  # the output gradients received (values unread)
        for g in grads:
            mark("output_grad", g)
        bw_outputs, bw_grads = list(outputs), grads
    input_values = [a for a in args if isinstance(a, torch.Tensor)]
    if not role.split_backward:
        sent = stage_backward(bw_outputs if not role.is_last else bw_outputs[0], bw_grads, input_values)
        for g in sent:
            if g is not None:
                mark("input_grad", g)
    elif role.is_first:  # torch's stage 0: I is a no-op, W runs the whole backward
        mark("weight", None)
        with _grouped(role):
            stage_backward(bw_outputs if not role.is_last else bw_outputs[0], bw_grads, input_values)
    else:
        _, groups = stage_backward_input(bw_outputs, bw_grads, input_values, iter(params))
        for a in input_values:
            if a.grad is not None:
                mark("input_grad", a.grad)  # stage_backward_input leaves it on the buffer
        mark("weight", None)
        with _grouped(role):
            stage_backward_weight(iter(params), groups)


def _grouped(role: StageRole):
    if not role.group_weight_backward:
        return contextlib.nullcontext()
    from torch.utils.checkpoint import GraphExecGroup

    return GraphExecGroup()
