"""Plan and apply inside a Hugging Face ``transformers.Trainer`` run, reading the step from it.

    from planner.integrations.hf import plan_trainer

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    sac = plan_trainer(trainer, budget_gib=20)       # None: the GPU's memory
    trainer.train()                                  # planned at on_train_begin, then applied
    print(sac.plan.summary())

Needs ``pip install 'sac-planner[hf]'`` (transformers, accelerate). The step is read once
``train()`` has built it (``on_train_begin``): the model as accelerate prepared it, the optimizer
``create_optimizer`` made (class, param groups, hyper-parameters), ``gradient_accumulation_steps``
micro-batches, one batch of ``per_device_train_batch_size`` from ``get_train_dataloader()``,
``num_items_in_batch`` as ``get_batch_samples`` computes it, the loss as ``compute_loss`` takes it
from the output (which is then dropped), ``bf16`` / ``fp16`` autocast, gradients set to None after
each step, and what the Trainer keeps beside the step (see :func:`trainer_step`). The run is
left as it would be unplanned: the batch is read without taking it from the run (``peek_batch``),
and ``train()`` is wrapped so that within it ``args.activation_checkpointing``
(``gradient_checkpointing``) is off, with a note (the plan replaces it), and after it, also after
an exception, the plan is removed and the arguments and the model's checkpointing flags are as
they were. The predicted peak goes into the Trainer's logs (``sac_predicted_peak_bytes``), beside
the measured one (``sac_measured_peak_bytes``) where measuring is on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Any

import torch
import transformers

from estimators.step.train_step import TrainStep, ZeroGrad
from planner.analysis.measure import StepPeaks
from planner.applying.checkpointing import apply_plan
from planner.integrations.common import (
    FrameworkStep,
    budget_gib_of,
    peek_batch,
    plan_options,
    rng_kept,
    scalars,
    tensors_of,
    with_notes,
)
from planner.format import check_budget_gib
from planner.options import PlanOptions
from planner.planning.solve import solve_sac

__all__ = ["plan_trainer", "SACPlanCallback", "trainer_step"]

logger = logging.getLogger(__name__)

_CHECKPOINTING_ARGS = ("activation_checkpointing", "gradient_checkpointing")

_TRAINER_SCALARS = 4
"""Float32 scalars the Trainer keeps through the binding micro-batch's backward besides the
step's loss: its running loss (``_tr_loss``), the previous micro-batch's detached loss,
accelerate's ``loss / gradient_accumulation_steps`` copy in ``backward``, the last step's
gradient norm (measured: 4 B each)."""


def plan_trainer(trainer: transformers.Trainer, budget_gib: float | None = None, *,
                 options: PlanOptions | None = None, measure: bool | None = None) -> "SACPlanCallback":
    """Plan ``trainer``'s step for ``budget_gib`` when ``trainer.train()`` begins and apply the plan
    for the run; returns the callback (``.plan`` once training began).

    ``budget_gib`` None: the GPU's memory. ``options``: how to plan (``PlanOptions``; None: the
    defaults on the device the Trainer trains on). ``measure``: log the measured peak of every
    step beside the predicted one (``planner.analysis.StepPeaks``); None: on CUDA, where it costs
    nothing (on CPU it runs torch's MemTracker, which slows every op).

    Within each ``train()`` (``trainer.train`` is wrapped): ``args.activation_checkpointing`` is
    off (the plan replaces it); when ``train()`` ends, also by an exception, the plan is removed
    and the arguments and the model's HF checkpointing are as they were."""
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"plan_trainer takes a transformers.Trainer, got {type(trainer).__name__}")
    if any(isinstance(c, SACPlanCallback) for c in trainer.callback_handler.callbacks):
        raise ValueError("plan_trainer was called on this Trainer already: its callback plans every train()")
    _check_supported(trainer)
    callback = SACPlanCallback(trainer, budget_gib, options=options, measure=measure)
    # First in line: its on_log adds the peaks before the printer and the reporting integrations
    # see the logs.
    trainer.callback_handler.callbacks.insert(0, callback)
    train = trainer.train

    @functools.wraps(train)
    def planned_train(*args, **kwargs):
        callback.run_begins()
        try:
            return train(*args, **kwargs)
        finally:
            callback.run_ends()

    trainer.train = planned_train
    return callback


def _check_supported(trainer: transformers.Trainer) -> None:
    args = trainer.args
    if args.world_size > 1 or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise NotImplementedError("plan_trainer plans one process (no DDP, FSDP or DeepSpeed yet): "
                                  "plan the model with solve_sac and apply_plan before trainer.train()")
    if args.torch_compile:
        raise NotImplementedError("args.torch_compile compiles before training begins, and a plan must be "
                                  "applied before compiling: apply_plan, then torch.compile the model yourself")
    base = transformers.Trainer
    replaced = [n for n in ("compute_loss", "training_step")
                if getattr(type(trainer), n) is not getattr(base, n) or n in vars(trainer)]
    if replaced:
        raise NotImplementedError(
            f"{type(trainer).__name__} overrides {' and '.join(replaced)} (on the class or the instance), so its "
            "step cannot be read: "
            "plan it with solve_sac and a TrainStep whose loss_fn computes your loss from the model output")
    if trainer.label_smoother is not None:
        raise NotImplementedError("label_smoothing_factor > 0 is not read yet: plan with solve_sac and a "
                                  "TrainStep whose loss_fn applies your label smoothing")


def trainer_step(trainer: transformers.Trainer, optimizer: torch.optim.Optimizer) -> FrameworkStep:
    """The step ``trainer.train()`` runs, as a TrainStep, with notes on what it leaves out.

    ``optimizer``: the one ``on_train_begin`` is given (accelerate's wrapper or the optimizer).
    Counted beside the step (``TrainStep.held``): the step's other micro-batches (the Trainer
    fetches all of them before the first forward, on the device), the next step's first one
    where the device is the host (accelerate's DataLoaderShard fetches one ahead, moving it only
    when it is yielded), and the Trainer's bookkeeping scalars (``_TRAINER_SCALARS``)."""
    args = trainer.args
    k = args.gradient_accumulation_steps
    batch = _one_batch(trainer)
    _, num_items = trainer.get_batch_samples(iter([batch] * k), k, args.device)
    inputs = dict(batch)
    if trainer.model_accepts_loss_kwargs and num_items is not None:
        inputs["num_items_in_batch"] = num_items  # compute_loss passes it to the model
    ahead = k if args.device.type == "cpu" else k - 1
    held = tuple(torch.empty_like(t) for _ in range(ahead) for t in tensors_of(batch))
    held += scalars(_TRAINER_SCALARS, args.device)
    notes = [f"step read from the Trainer: {k} micro-batch(es) of {args.per_device_train_batch_size}, "
             f"optimizer {type(_inner(optimizer)).__name__}, "
             + ("bf16" if args.bf16 else "fp16" if args.fp16 else "no") + " autocast"]
    if args.max_grad_norm:
        notes.append(f"gradient clipping (max_grad_norm={args.max_grad_norm}) is not in the planned step: "
                     "its temporaries (a scalar per parameter) come between backward and the optimizer step")
    notes.append("the learning-rate scheduler is not in the planned step (it holds no tensors)")
    step = TrainStep(inputs=inputs, loss_fn=_loss_fn(trainer), optimizer=_inner(optimizer), micro_batches=k,
                     zero_grad=ZeroGrad.SET_TO_NONE, keep_output=False, train_mode=True, held=held,
                     autocast_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None)
    return FrameworkStep(step, tuple(notes))


def _one_batch(trainer: transformers.Trainer) -> dict:
    """One micro-batch as the Trainer's dataloader yields it (on its device), taken from none
    of the run's (``peek_batch``): the run draws the batches and masks it would draw unplanned."""
    from accelerate.utils import send_to_device

    batch = peek_batch(trainer.get_train_dataloader())
    if not isinstance(batch, dict):
        raise NotImplementedError(f"the Trainer's batches are {type(batch).__name__}, not dicts of model "
                                  "inputs: plan with solve_sac and a TrainStep")
    return send_to_device(batch, trainer.args.device)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def _loss_fn(trainer: transformers.Trainer):
    """The loss as ``Trainer.compute_loss`` takes it from the model output."""
    func = trainer.compute_loss_func
    if func is not None:
        return lambda out, inputs: func(out, inputs.get("labels"), num_items_in_batch=inputs.get("num_items_in_batch"))
    return lambda out, inputs: out["loss"] if isinstance(out, dict) else out[0]


@contextlib.contextmanager
def _planning_forward(model: torch.nn.Module):
    """accelerate wraps ``model.forward`` in ``torch.autocast(<run device>)`` and converts the
    outputs to float32. A fake trace runs CPU tensors, on which a CUDA autocast does nothing, so
    while planning the forward is the model's own with that conversion, and the step's
    ``autocast_dtype`` autocasts on the traced tensors' device (on a CPU run: the same ops)."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield
        return
    from accelerate.utils import convert_to_fp32

    if getattr(original, "__self__", None) is not model:
        raise NotImplementedError("accelerate wrapped a forward that is not the model's own method: "
                                  "plan with solve_sac and apply_plan before trainer.train()")
    func = original.__func__

    def forward(self, *args, **kwargs):
        return convert_to_fp32(func(self, *args, **kwargs))

    model.forward = types.MethodType(forward, model)
    try:
        yield
    finally:
        model.forward = wrapped


class SACPlanCallback(transformers.TrainerCallback):
    """Plans at ``on_train_begin``, applies the plan for the run, removes it at ``on_train_end``;
    logs the predicted (and, measuring, the measured) peak. Made by :func:`plan_trainer`."""

    def __init__(self, trainer: transformers.Trainer, budget_gib: float | None, *,
                 options: PlanOptions | None = None, measure: bool | None = None) -> None:
        if budget_gib is not None:  # here, not once train() has built everything
            check_budget_gib(budget_gib)
        plan_options(options, torch.device("cpu"))  # its type, before train()
        self.trainer, self.budget_gib, self.options, self.measure = trainer, budget_gib, options, measure
        self.plan = None
        """The plan, once training began."""
        self.notes: list[str] = []
        self.meter: StepPeaks | None = None
        self._handle = None
        self._args: dict[str, Any] = {}
        self._model_checkpointing: dict[torch.nn.Module, tuple] = {}

    def run_begins(self) -> None:
        """Before ``train()``: HF's checkpointing arguments off (train() reads them before the
        loop; transformers 5 names them activation_, keeping gradient_ as a mirrored alias)."""
        self.notes = []
        self._args = {n: getattr(self.trainer.args, n) for n in _CHECKPOINTING_ARGS if hasattr(self.trainer.args, n)}
        on = [n for n, v in self._args.items() if v]
        for name in on:
            setattr(self.trainer.args, name, False)
        if on:
            self.notes.append(f"args.{on[0]} turned off: the plan replaces it")

    def run_ends(self) -> None:
        """After ``train()``, also one that raised: the plan removed, the meter stopped, HF's
        checkpointing arguments and the model's checkpointing flags as they were."""
        self.on_train_end(self.trainer.args, None, None)
        for name, value in self._args.items():
            if getattr(self.trainer.args, name) != value:
                setattr(self.trainer.args, name, value)
        for module, (flag, func) in self._model_checkpointing.items():
            module.gradient_checkpointing = flag
            if func is not None:
                module._gradient_checkpointing_func = func
        self._args, self._model_checkpointing = {}, {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # transformers 5 names it activation checkpointing (the gradient_ names warn, deprecated).
        new = hasattr(model, "activation_checkpointing_disable")
        if getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False):
            self._model_checkpointing = {m: (m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
                                         for m in model.modules() if hasattr(m, "gradient_checkpointing")}
            (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
            self.notes.append("the model's HF gradient checkpointing turned off: the plan replaces it")
        read = trainer_step(self.trainer, optimizer)
        options = plan_options(self.options, args.device)
        budget = budget_gib_of(self.budget_gib, args.device, options)
        with rng_kept(), _planning_forward(model):
            plan = solve_sac(model, budget, read.step, options=options)
        self.plan = with_notes(plan, (*read.notes, *self.notes))
        for note in self.plan.notes:
            logger.info("sac plan: %s", note)
        self._handle = apply_plan(model, self.plan)
        if self.measure or (self.measure is None and args.device.type == "cuda"):
            # The Trainer's running loss exists before the meter starts: named, so it counts.
            running = getattr(self.trainer, "_tr_loss", None)
            self.meter = StepPeaks(model, _inner(optimizer), external=(running,) if running is not None else ())
            self.meter.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.step_done()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.plan is None or logs is None or "loss" not in logs:
            return
        peaks = {"sac_predicted_peak_bytes": self.plan.predicted_peak_bytes}
        if self.meter is not None and self.meter.peaks_bytes:
            peaks["sac_measured_peak_bytes"] = self.meter.peaks_bytes[-1]
        logs.update(peaks)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(peaks)  # Trainer.log appended its copy before on_log

    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.stop()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
