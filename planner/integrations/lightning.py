"""Plan and apply inside a Lightning ``Trainer.fit``, reading the step from the Trainer.

    from planner.integrations.lightning import SACPlanCallback

    sac = SACPlanCallback(budget_gib=20)             # None: the GPU's memory
    trainer = L.Trainer(max_steps=1000, precision="bf16-mixed", accumulate_grad_batches=2,
                        callbacks=[sac])
    trainer.fit(module, train_dataloaders=loader)    # planned at on_train_start, then applied
    print(sac.plan.summary())

Needs ``pip install 'sac-planner[lightning]'``. The step is read at ``on_train_start``, once
``configure_optimizers`` ran and the train dataloader exists: ``training_step(batch, 0)`` on the
first batch of that dataloader (taking none of the loop's, moved by the module's own transfer
hooks) is the forward and the loss, divided over ``accumulate_grad_batches`` micro-batches as
Lightning's closure does; the precision plugin's context is the step's (``*-mixed``: autocast
with its cache off, as Lightning runs it; ``*-true``: the low default dtype); the optimizer is
the one configured, its gradients set to None where Lightning sets them. ``training_step`` runs
as in the loop: ``self(x)``, ``self.trainer`` and ``self.optimizers()`` work. What Lightning
keeps beside the step is counted too (:func:`lightning_step`). The root module is never
checkpointed (Lightning calls ``training_step``, not ``forward``); a fit that raises leaves the
module unplanned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import types
from typing import Any, Callable

import lightning.pytorch as pl
import torch

from estimators.step.train_step import TrainStep, ZeroGrad
from estimators.tracing.estimation import estimate
from planner.analysis.measure import StepPeaks
from planner.applying.checkpointing import apply_plan, check_plannable, hf_cache_off
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
from planner.plan import Plan
from planner.planning.solve import plan_estimate

__all__ = ["SACPlanCallback", "lightning_step", "plan_lightning"]

logger = logging.getLogger(__name__)


class SACPlanCallback(pl.Callback):
    """Plans at ``on_train_start``, applies the plan for the rest of ``fit``, removes it at
    ``on_train_end``. ``budget_gib`` None: the GPU's memory. ``options``: how to plan (None: the
    defaults on the module's device). ``measure``: measure every optimizer step's peak
    (``planner.analysis.StepPeaks``) and log it beside the predicted one to the Trainer's
    logger; None: on CUDA, where it costs nothing (on CPU MemTracker slows every op)."""

    def __init__(self, budget_gib: float | None = None, *, options: PlanOptions | None = None,
                 measure: bool | None = None) -> None:
        if budget_gib is not None:  # here, not once fit() has built everything
            check_budget_gib(budget_gib)
        plan_options(options, torch.device("cpu"))  # its type, before fit()
        self.budget_gib, self.options, self.measure = budget_gib, options, measure
        self.plan: Plan | None = None
        """The plan, once training started."""
        self.meter: StepPeaks | None = None
        self._handle = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plan = plan_lightning(trainer, pl_module, self.budget_gib, options=self.options)
        for note in self.plan.notes:
            logger.info("sac plan: %s", note)
        self._handle = apply_plan(pl_module, self.plan)
        if self.measure or (self.measure is None and pl_module.device.type == "cuda"):
            self.meter = StepPeaks(pl_module, trainer.optimizers[0])
            self.meter.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.meter is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        peak = self.meter.step_done()
        if trainer.logger is not None:  # floats, not tensors: nothing the next step would hold
            trainer.logger.log_metrics({"sac_predicted_peak_bytes": self.plan.predicted_peak_bytes,
                                        "sac_measured_peak_bytes": peak}, step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.meter is not None:
            self.meter.stop()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit that raised leaves the module unplanned, as ``on_train_end`` does."""
        self.on_train_end(trainer, pl_module)


def plan_lightning(trainer: pl.Trainer, pl_module: pl.LightningModule, budget_gib: float | None = None, *,
                   options: PlanOptions | None = None) -> Plan:
    """The plan of the step ``trainer.fit`` runs (call it once training started: optimizers and
    the train dataloader exist), for ``budget_gib`` (None: the device's memory)."""
    check_plannable(pl_module)
    options = plan_options(options, pl_module.device)
    budget = budget_gib_of(budget_gib, pl_module.device, options)
    read = lightning_step(trainer, pl_module, first_batch(trainer))
    step, notes = read.step, read.notes
    logged: dict[str, list] = {}
    with rng_kept(), _planning_view(pl_module, trainer, logged) as traced:
        with hf_cache_off(traced):  # traced as it runs under the plan, as solve_sac traces
            est = estimate(traced, step, device=options.spec, options=options.trace)
            if logged:  # what Lightning keeps of each value logged: known once training_step ran
                kept = tuple(t for dtypes in logged.values() for t in _zeros(dtypes))
                step = dataclasses.replace(step, held=step.held + kept)
                est = estimate(traced, step, device=options.spec, options=options.trace)
                notes += (f"training_step logs {', '.join(sorted(logged))}: what Lightning keeps of each "
                          "value logged is counted",)
        units = [s.fqn for s in est.module_info.mod_stats if "." in s.fqn]  # all but the root
        if options.ac_units is not None:
            units = [u for u in units if u in options.ac_units]
        plan = plan_estimate(traced, est, budget, options=options.replace(ac_units=tuple(units)))
    return with_notes(plan, notes)


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader as ``training_step`` gets it, taking none of the
    loop's (``peek_batch``), moved by the module's transfer hooks."""
    loader = trainer.train_dataloader  # the DataLoader, or a CombinedLoader of several
    loaders = getattr(loader, "flattened", [loader])
    if len(loaders) != 1:
        raise NotImplementedError(f"{len(loaders)} train dataloaders: SACPlanCallback plans one; "
                                  "plan with solve_sac and a TrainStep")
    return trainer.strategy.batch_to_device(peek_batch(loaders[0]))


def lightning_step(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> FrameworkStep:
    """The step ``trainer.fit`` runs, as a TrainStep (its forward: see ``_planning_view``).

    Counted beside the step (``TrainStep.held``): the closure's detached clone of the loss
    (``ClosureResult.loss``), and the next batch where the loader has no length (the data
    fetcher fetches one ahead only then) and the device is the host (a GPU run moves batches
    when they are used). Values logged with ``self.log`` in ``training_step``: see
    :func:`plan_lightning` and ``_log_recorder``."""
    if not pl_module.automatic_optimization:
        raise NotImplementedError("manual optimization: the loop is the module's own; plan it with "
                                  "solve_sac and a TrainStep that runs it")
    if len(trainer.optimizers) != 1:
        raise NotImplementedError(f"{len(trainer.optimizers)} optimizers: SACPlanCallback plans one")
    k = trainer.accumulate_grad_batches
    device = pl_module.device
    held = scalars(1, device)
    if device.type == "cpu" and not _has_len(trainer):
        held += tuple(torch.empty_like(t) for t in tensors_of(batch))
    notes = [f"step read from the Trainer: {k} micro-batch(es), optimizer {type(trainer.optimizers[0]).__name__}, "
             f"precision {trainer.precision} (training_step traced in the precision plugin's context)"]
    if trainer.gradient_clip_val:
        notes.append(f"gradient clipping (gradient_clip_val={trainer.gradient_clip_val}) is not in the planned "
                     "step: its temporaries come between backward and the optimizer step")
    if trainer.lr_scheduler_configs:
        notes.append("the learning-rate scheduler is not in the planned step (it holds no tensors)")
    # Lightning frees the gradients after the first micro-batch's training_step, before its
    # backward. With k > 1 the binding micro-batch is a later one (gradients alive throughout);
    # with k = 1 the last step's gradients are alive through the forward: the trace starts with
    # them (ZeroGrad.ZERO) and the planning forward frees them where Lightning does.
    step = TrainStep(inputs=(batch, 0), loss_fn=_loss_of if k > 1 else _loss_over_one,
                     optimizer=trainer.optimizers[0], micro_batches=k, train_mode=True, held=held,
                     zero_grad=ZeroGrad.ZERO if k == 1 else ZeroGrad.SET_TO_NONE)
    return FrameworkStep(step, tuple(notes))


def _loss_of(out: Any, inputs: Any) -> torch.Tensor:
    """The loss Lightning's automatic optimization backpropagates from what ``training_step``
    returned: the tensor, or a dict's ``"loss"``."""
    if isinstance(out, dict):
        if "loss" not in out:
            raise ValueError(f"training_step returned a dict without a 'loss' key (keys: {', '.join(map(str, out))}); "
                             "Lightning's automatic optimization backpropagates out['loss']: return {'loss': loss, ...}")
        return out["loss"]
    if out is None:
        raise ValueError("training_step returned None on the first batch (Lightning skips such a batch), so there "
                         "is no step to plan: plan with solve_sac and a TrainStep of a batch it trains on")
    return out


def _loss_over_one(out: Any, inputs: Any) -> torch.Tensor:
    """``_loss_of`` divided by ``accumulate_grad_batches`` = 1, as Lightning's closure divides
    (``ClosureResult``), into a new tensor: ``training_step``'s own output is not held through the
    backward (a loss can hold a large storage: CPU ``mse_loss`` returns a view of its elementwise
    buffer). With k > 1 the step's own division does the same."""
    return _loss_of(out, inputs) / 1


def _has_len(trainer: pl.Trainer) -> bool:
    from lightning.fabric.utilities.data import has_len

    loader = trainer.train_dataloader
    return all(has_len(dl) for dl in getattr(loader, "flattened", [loader]))


def _zeros(dtypes: list[tuple[torch.dtype, torch.device]]) -> list[torch.Tensor]:
    return [torch.zeros((), dtype=dt, device=dev) for dt, dev in dtypes]


@contextlib.contextmanager
def _planning_view(pl_module: pl.LightningModule, trainer: pl.Trainer, logged: dict):
    """``pl_module`` as the planner traces it: called as the loop calls it, it runs
    ``training_step`` in the precision context (inside it, ``self(x)`` and ``self.forward(x)``
    are the module's own forward); ``self.log`` keeps what Lightning keeps (``_log_recorder``);
    the trainer is attached (``self.trainer``, ``self.optimizers()``; see ``_step_as_forward``).
    All undone after."""
    log, log_dict = _log_recorder(logged)
    pl_module.forward = types.MethodType(_step_as_forward(_precision_context(trainer), trainer), pl_module)
    pl_module.log = types.MethodType(log, pl_module)
    pl_module.log_dict = types.MethodType(log_dict, pl_module)
    try:
        yield pl_module
    finally:
        for name in ("forward", "log", "log_dict", "_sac_logged"):
            pl_module.__dict__.pop(name, None)


def _precision_context(trainer: pl.Trainer) -> Callable[[torch.nn.Module], Any]:
    """A factory of the context ``training_step`` runs in, on the traced tensors' device.

    MixedPrecision autocasts for the run's device with ``cache_enabled=False``; a fake trace
    runs CPU tensors, so the same autocast is entered for the device the traced parameters are
    on. Other plugins (HalfPrecision's default dtype, 32-bit) are device-free: their own."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = trainer.precision_plugin
    if not isinstance(plugin, MixedPrecision):
        return lambda module: plugin.forward_context()
    dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16

    def autocast(module: torch.nn.Module):
        p = next(module.parameters(), None)
        device = p.device.type if p is not None and p.device.type != "meta" else "cpu"
        return torch.autocast(device, dtype=dtype, cache_enabled=False)

    return autocast


def _step_as_forward(context: Callable[[torch.nn.Module], Any], trainer: pl.Trainer):
    """The loop's call, ``training_step(batch, batch_idx)``. While it runs, the instance's
    ``forward`` is the class's again, so ``self(x)`` in ``training_step`` (Lightning's own idiom)
    runs the module's forward; and ``trainer`` is attached, also to a fake trace's copy of the
    module (Lightning's ``__getstate__`` detaches a copy; the copy shares the trainer)."""

    def forward(self, batch, batch_idx):
        step_forward, attached = self.__dict__.pop("forward"), self._trainer
        self._trainer = trainer
        try:
            with context(self):
                out = self.training_step(batch, batch_idx)
        finally:
            self.forward, self._trainer = step_forward, attached
        if trainer.accumulate_grad_batches == 1:
            # Lightning's closure clones the loss while the last step's clone is still held, then
            # zeroes the gradients (set to None) before the backward.
            clone = _loss_of(out, None).detach().clone()
            for p in self.parameters():
                p.grad = None
            del clone
        return out

    return forward


def _log_recorder(logged: dict):
    """``self.log`` / ``self.log_dict`` while planning. Lightning's result collection keeps, per
    name logged in ``training_step`` (``_ResultMetric.update``, on_step): a float32 clone of the
    value, replaced by the next log of that name, so it lives from the log call to the end of
    the step: the recorder keeps it on the traced module so. Beside the step it keeps the last
    step's clone (in ``trainer.callback_metrics``) and the metric's states made at the first log
    (``value``'s default and, for a mean, ``cumulated_batch_size`` and its default, int64): the
    recorder writes their dtypes into ``logged`` (name -> [(dtype, device)]), counted as held.
    Nothing is logged."""

    def log(self, name, value, *args, reduce_fx="mean", **kwargs):
        if isinstance(value, numbers.Number):  # Lightning makes it a tensor of the default dtype
            value = torch.tensor(value, dtype=torch.get_default_dtype())
        if not isinstance(value, torch.Tensor):
            return
        v = value.detach()
        if v.dtype not in (torch.float32, torch.float64):
            v = v.to(torch.get_default_dtype())
        self.__dict__.setdefault("_sac_logged", {})[name] = v.clone()
        float_, int_ = (v.dtype, v.device), (torch.int64, v.device)
        logged[name] = [float_, float_] + ([int_, int_] if reduce_fx in ("mean", torch.mean) else [])

    def log_dict(self, dictionary, *args, **kwargs):
        for name, value in dictionary.items():
            log(self, name, value, *args, **kwargs)

    return log, log_dict
