"""What a plan's notes say about the step it was planned for: the model output the step drops,
a real-mode trace, sparse gradients, train/eval mode, modules run more than once, a budget typed in
the wrong unit. Each returns the note (logged where the user may be surprised), or nothing."""

from __future__ import annotations

import logging
import math

import torch

from estimators.tracing.estimation import Estimate, TraceMode
from estimators.tracing.steady_state import sparse_grad_params
from estimators.step.train_step import TrainStep, mode_changes
from planner.format import GiB
from planner.format import fmt_bytes

__all__ = ["unit_slip_note", "output_note", "real_trace_note", "sparse_note", "mode_note", "shared_note",
           "no_optimizer_note", "precision_notes"]

logger = logging.getLogger(__name__)


_UNIT_SLIP = 512
"""A budget this many times the step's no-AC peak is more likely a figure in MiB or in bytes typed
as GiB than a budget: planning succeeds with nothing to checkpoint, so say it."""


def _as_typed(budget_bytes: int) -> float:
    """The figure the user typed, in GiB: the shortest decimal that floors to ``budget_bytes`` (the
    budget in bytes is floored, so 0.001 GiB is 1,073,741 B, which reads back as 0.000999999, and a
    fixed number of significant digits changes a longer figure: 439473 read back as 439470)."""
    exact = budget_bytes / GiB
    for digits in range(1, 18):
        typed = float(f"{exact:.{digits}g}")
        if int(typed * GiB) == budget_bytes:
            return typed
    return exact


def unit_slip_note(budget_bytes: int, peak_bytes: int) -> tuple[str, ...]:
    """The note for a budget ``_UNIT_SLIP`` times the peak or more: the figure as typed, read in
    the unit (MiB or bytes) that puts it nearer the step's peak, and the ``budget_gib`` that says
    so (a byte count 439473 beside a 476,568 B peak is bytes, not 429 GiB)."""
    if budget_bytes < _UNIT_SLIP * peak_bytes:
        return ()
    as_typed = _as_typed(budget_bytes)
    as_mib, as_bytes = as_typed * 2**20, as_typed  # the figure read as MiB, as bytes (in bytes)
    if as_bytes >= 1 and abs(math.log(as_bytes / peak_bytes)) < abs(math.log(as_mib / peak_bytes)):
        figure = f"{as_typed:,.0f}" if as_typed == int(as_typed) else repr(as_typed)
        fix = f"for {figure} bytes pass budget_gib={as_typed / GiB:.3g}"
    else:
        figure = repr(as_typed).removesuffix(".0")  # every digit typed: 1048575, not 1.04858e+06
        fix = f"for {figure} MiB pass budget_gib={as_typed / 1024:.6g}"
    note = (f"the budget ({fmt_bytes(budget_bytes)}) is {budget_bytes / peak_bytes:,.0f}x the step's "
            f"peak ({fmt_bytes(peak_bytes)}); budget_gib is in GiB: {fix}")
    logger.warning("%s", note)
    return (note,)


_OUTPUT_NOTE_FRACTION = 0.01
"""A dropped model output at least this share of the peak is named in the plan's notes."""


def output_note(info, step: TrainStep) -> str | None:
    """The step drops the model output before backward (``keep_output=False``, the default); a
    loop that holds it (``out = model(**batch); out.loss.backward()``) peaks higher by up to its
    size (the logits, for a language model) and nothing else would say so."""
    root = info.stats(info.mod_order.fw_pre_order[0]) if info.mod_order.fw_pre_order else None
    if step.keep_output or root is None or root.output_bytes < _OUTPUT_NOTE_FRACTION * info.peak_bytes:
        return None
    return (f"the step drops the model output ({fmt_bytes(root.output_bytes)}) once the loss is "
            "computed, as `loss = model(**batch).loss` and `loss = loss_fn(model(x), y)` do; a loop "
            "that holds it through backward (`out = model(**batch); out.loss.backward()`) peaks up "
            "to that much higher: plan it with TrainStep(keep_output=True)")


def real_trace_note(model: torch.nn.Module, est: Estimate) -> str | None:
    """What a real-mode trace stands for: this batch's run on the model's own tensors."""
    if est.options.mode is not TraceMode.REAL:
        return None
    note = ("traced in real mode: the figures follow this batch's run, and data-dependent paths "
            "(MoE routing, nonzero) may peak differently on other batches")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if est.spec.is_cuda and on_cpu and not est.options.cuda_semantics:
        note += (f"; the model ran on the CPU, so memory is the CPU's (its kernels' saved tensors, "
                 f"no {est.spec.name} allocation rounding), not {est.spec.name}'s: plan {est.spec.name} "
                 "with a fake trace where the model allows (figures 22 % apart on a ResNet)")
        logger.warning("%s", note)
    return note


def sparse_note(model: torch.nn.Module) -> str | None:
    """Sparse gradients are not in the figures: say so, with the parameters that have them."""
    ids = sparse_grad_params(model)
    names = [n for n, p in model.named_parameters() if id(p) in ids and p.requires_grad]
    if not names:
        return None
    note = (f"sparse gradients ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) are not "
            "counted: a sparse tensor's size depends on its values, which the trace does not see, "
            "so the measured peak can exceed the prediction by their indices and values (8,704 B "
            "per micro-batch for 64 lookups of a 32-wide float32 embedding)")
    logger.warning("%s", note)
    return note


def mode_note(model: torch.nn.Module, step: TrainStep) -> str | None:
    """Say which modules in eval mode were planned in train mode (``TrainStep.train_mode``)."""
    switched = mode_changes(model, step.train_mode)
    if switched and not model.training:
        logger.warning("the model is in eval mode: planned in train mode (dropout, BatchNorm batch "
                       "statistics), as its training loop runs it; TrainStep(train_mode=False) "
                       "plans it as it is")
        return ("the model is in eval mode: planned in train mode, as model.train() runs it "
                "(TrainStep(train_mode=False): as it is)")
    if switched:
        return f"{switched} module(s) in eval mode: planned in train mode (TrainStep(train_mode=True))"
    if not model.training:
        return "planned in eval mode (TrainStep(train_mode=False)): dropout off, BatchNorm running statistics"
    return None


def shared_note(info, shared: list[str]) -> str:
    """What the planner says of candidates that run more than once per step, "" if none.

    The memory model gives a module one window, from its last call's forward end to its first
    call's backward start (``ModStats.fw_post_op`` / ``bw_pre_op``); the activations of its other
    calls, which a checkpoint discards too, count as kept before and after it. Plans with such a
    module are traced, so their prediction holds, but its checkpoint is under-rated: the smallest
    reachable peak stated (ALBERT's shared layer, called once per layer) can sit well above what a
    full checkpoint of the shared module traces and measures."""
    outer = [info.stats(f) for f in shared]
    if not outer:
        return ""
    names = ", ".join(f"{s.fqn} ({s.n_calls} calls)" for s in outer)
    return (f"{names} {'runs' if len(outer) == 1 else 'run'} more than once per step (shared weights): "
            "the memory model credits a checkpoint of such a module only from its last call's forward "
            "end to its first call's backward start, not the activations its other calls discard, so "
            "it is planned where that pays (the plan is traced: its prediction holds) but under-rated; "
            "below the MILP's smallest reachable peak the planner traces its min-peak plan with "
            f"{'it' if len(outer) == 1 else 'them'} fully checkpointed instead (not optimal: a "
            "per-call window in the MILP is not built)")


def no_optimizer_note(step: TrainStep) -> str | None:
    """A step planned without an optimizer holds no optimizer state; ``solve_sac``'s default. A
    loop that trains with one peaks higher by its state (AdamW: twice the trainable parameters'
    bytes), so say so."""
    if step.optimizer is not None:
        return None
    note = ("planned without an optimizer (solve_sac's default; --optimizer none): no optimizer state is "
            "in the figures; a loop that steps one holds its state too (AdamW/Adam: twice the trainable "
            "parameters' bytes). Pass optimizer=\"adamw\" (a name, a class, a factory or your instance)")
    logger.warning("%s", note)
    return note


def precision_notes(precision, step: TrainStep) -> list[str]:
    """FSDP2's mixed precision (an ``FsdpPrecision``, or None), and where the step traced
    computes in a wider dtype than the policy's ``param_dtype`` (no autocast): its activations
    are counted at the traced width, above what the run holds."""
    if precision is None:
        return []
    notes = [precision.describe()]
    low = precision.param_dtype
    if low is not None and step.autocast_dtype is None and low.itemsize < precision.traced_param_dtype.itemsize:
        name = str(low).replace("torch.", "")
        notes.append(f"the step is traced in {str(precision.traced_param_dtype).replace('torch.', '')}, but FSDP2 "
                     f"computes in {name}: activations are counted at the wider dtype (an upper bound); trace "
                     f"TrainStep(autocast_dtype=torch.{name}) to count them near {name}")
    return notes
