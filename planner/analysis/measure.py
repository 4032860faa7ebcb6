"""Measure real training steps: the peak memory an independent tracker sees, and the loss.

On CUDA the peak is ``torch.cuda.max_memory_allocated``; on CPU it is torch's own MemTracker
(torch.distributed._tools), which follows every tensor's storage. Only its allocator-level
tracking is used: no module hooks (its ModTracker is replaced, see ``_NoModuleHooks``), so the
step measured runs as it does untracked. Neither shares code with the
estimators, so a prediction checked against it is checked against an independent measurement.

    steps = measure_steps(model, TrainStep(inputs=batch, optimizer="adamw"), n_steps=3)
    max(s.peak_bytes for s in steps)      # the steady state binds from step 2 on

A loop someone else runs (a framework's trainer) is measured with ``StepPeaks``: started when
the loop begins, read at each optimizer-step boundary (``planner.integrations`` do this).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from estimators.runtime.device import get_device_spec
from estimators.step.optimizer import check_optimizer_params, resolve_optimizer
from estimators.step.train_step import TrainStep, run_step, step_mode, zero_grads
from estimators.tracing.trace import held_tensors
from planner.analysis.collectives import CallerHeldCollectives

__all__ = ["MeasuredStep", "StepPeaks", "gc_frozen", "measure_step", "measure_steps", "measure_run"]


@dataclass(frozen=True)
class MeasuredStep:
    peak_bytes: int
    loss: float | None
    """The last micro-batch's loss as backward saw it: divided by the step's ``micro_batches``."""
    step_time_ms: float
    tracker: str
    """What measured the peak."""
    activation_bytes: int | None = None
    """At the peak: everything but parameters, buffers, gradients and optimizer state (CPU only)."""


def measure_step(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    train_mode: bool | None = None,
) -> MeasuredStep:
    """Run one training step (one micro-batch, then ``optimizer.step()``) and measure its peak;
    ``train_mode`` as ``TrainStep.train_mode``."""
    check_real(model)
    with step_mode(model, train_mode):
        return _measure(model, inputs, optimizer, lambda on_phase: run_step(model, inputs, loss_fn, optimizer, on_phase))


def measure_steps(
    model: torch.nn.Module,
    step: TrainStep,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    n_steps: int = 3,
) -> list[MeasuredStep]:
    """Train ``n_steps`` real steps of the loop ``step`` describes (micro-batches, autocast,
    gradients reset after each optimizer step as ``step.zero_grad`` says) and measure each.

    ``optimizer`` is the real optimizer over ``model``'s parameters; None: ``step.optimizer``'s
    (the instance itself, or one built from its name or class over the model's trainable
    parameters, made once for these steps). Step 1 starts from the model as given (normally no
    gradients and no optimizer state: the first step of a fresh run); steps 2.. are the steady
    state. The gradients the steps leave are dropped where the model had none, so a second call
    starts from a fresh run's state again (the parameters stay trained).
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
    check_real(model)
    if optimizer is None and step.optimizer is not None:
        # Measured without an optimizer step, a step named "adamw" would lose AdamW's state from
        # the peak and train nothing.
        optimizer = _optimizer_of(model, step.optimizer)
    if optimizer is not None:
        # Seen: a TrainStep's optimizer built for model A, A's deepcopy measured: the loss
        # unchanged over 3 steps, and the optimizer's state not in the peak.
        check_optimizer_params(model, optimizer, {id(p) for p in model.parameters()}, "measure",
                               ": over another copy it trains that copy, and these steps nothing")
    out = []
    # A loop that keeps the output holds each step's last one into the next step's forward.
    held: list = [None]
    resident = step.held_tensors() + step.loss_closure_tensors(model)  # the same every step
    no_grad = [p for p in model.parameters() if p.grad is None]
    with step_mode(model, step.train_mode), _drop_grads(no_grad):
        for i in range(n_steps):
            if i:
                zero_grads(model, optimizer, step.zero_grad)
            out.append(_measure(model, step.inputs, optimizer, lambda on_phase: run_step(
                model, step.inputs, step.loss_fn, optimizer, on_phase,
                micro_batches=step.micro_batches, autocast_dtype=step.autocast_dtype,
                keep_output=step.keep_output, held_output=held, context=step.context,
            ), held=held_tensors(held[0]) + resident))
    return out


@contextlib.contextmanager
def _drop_grads(params: list[torch.nn.Parameter]):
    """On the way out, ``params``' gradients set to None (the steps' last ones, held otherwise:
    a second measure_steps' first step read them as the model's)."""
    try:
        yield
    finally:
        for p in params:
            p.grad = None


@contextlib.contextmanager
def gc_frozen():
    """For timing steps: within, the objects that existed on entry are out of the garbage
    collector's reach (``gc.freeze``), so a ``gc.collect()`` before each timed step frees the
    steps' own garbage without walking the whole heap: a full collection walks every Python
    object, for long in a process with large libraries imported, and leaves the caches cold for
    the step after it, as a training loop's steps do not find them. On the way out (an exception
    too) everything is collectable again. Where the caller has frozen objects already, nothing is
    done: ``gc.unfreeze`` would release theirs too. Meanwhile a garbage cycle that reaches an
    object frozen on entry waits for the exit to be freed, and a freeze another thread makes is
    released with ours."""
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def check_real(model: torch.nn.Module, doing: str = "measuring") -> None:
    """Raise, saying what to do, where ``model`` cannot run a real training step: on the meta
    device, or without parameters. ``doing``: what runs the steps ("measuring", "profiling")."""
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"the model is on the meta device: {doing} runs real training steps, which need "
            "real weights; materialize it first (model.to_empty(device='cpu') and initialize or "
            "load its weights) -- planning (solve_sac) works on the meta model as it is"
        )
    if next(model.parameters(), None) is None:
        raise ValueError(f"the model has no parameters: there is no training step for {doing}")


def _optimizer_of(model: torch.nn.Module, optimizer: Any) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    device = next((p.device.type for p in model.parameters()), "cpu")
    params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return resolve_optimizer(optimizer, params, get_device_spec(device), fake=False)


class _NoModuleHooks:
    """Stands in for MemTracker's ModTracker, which installs global module forward hooks and, on
    every module's inputs and outputs, multi-grad hooks that keep them referenced into the
    backward: they changed what is alive when (and HF families warned "Module is None"). The
    peak needs only the allocator-level tracking (MemTracker's dispatch mode and storage weak
    references), so nothing is hooked on modules: no module is ever "in backward" or a parent."""

    parents = frozenset({"Global"})
    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> "_NoModuleHooks":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def measure_run(run: Callable[[], Any], *, modules: Sequence[torch.nn.Module],
                optimizer: torch.optim.Optimizer | None = None, held: Sequence[torch.Tensor] = ()) -> MeasuredStep:
    """The peak of ``run()``, measured as ``measure_steps`` measures a step, for a step that
    ``TrainStep`` does not describe (a pipeline rank's ``schedule.step()``, then the optimizer's).

    ``modules``: the models trained (their parameters, buffers and gradients are counted);
    ``held``: tensors made before the run that it holds or uses (the batch, a pipeline stage's
    receive buffers, the output chunks of the previous step): MemTracker sees only what it is
    told of or sees made. CPU: MemTracker; CUDA: ``max_memory_allocated``. The caller must not
    keep references to ``held`` itself beyond the run's (MemTracker holds them weakly)."""
    device = next(p for m in modules for p in m.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        return MeasuredStep(torch.cuda.max_memory_allocated(device), None, (time.perf_counter() - t0) * 1e3,
                            "torch.cuda.max_memory_allocated")
    mt, grad_hooks = _memory_tracker(*modules)
    try:
        mt.track_external(*modules, *([optimizer] if optimizer is not None else []), *held)
        held = ()
        t0 = time.perf_counter()
        with _tracking(mt):
            run()
    finally:
        for h in grad_hooks:
            h.remove()
    return _measured(mt, device, None, time.perf_counter() - t0)


def _collectives_mode() -> contextlib.AbstractContextManager:
    """Inside a MemTracker, on ranks: collectives held as the caller holds them (see
    ``collectives``), so a gloo worker thread's late release is not in the peak."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return CallerHeldCollectives() if distributed else contextlib.nullcontext()


@contextlib.contextmanager
def _tracking(mt: Any):
    with mt, _collectives_mode():
        yield


def _memory_tracker(*models: torch.nn.Module, made_here_only: bool = False) -> tuple[Any, list]:
    """torch's MemTracker measuring storages only, and the gradient hooks that file a parameter's
    ``.grad`` as GRAD once accumulated (the handles, for removal): a post-accumulate hook reads
    ``p.grad`` and holds nothing. ``made_here_only``: see ``_made_here_tracker``."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    mt = _made_here_tracker()() if made_here_only else MemTracker()
    mt._mod_tracker = _NoModuleHooks()

    def as_grad(p: torch.Tensor) -> None:
        if p.grad is not None:
            mt._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)

    handles = [p.register_post_accumulate_grad_hook(as_grad)
               for model in models for p in model.parameters() if p.requires_grad]
    return mt, handles


@functools.lru_cache(maxsize=None)
def _made_here_tracker() -> type:
    """A MemTracker that counts only storages made while it runs and those named to
    ``track_external``. MemTracker starts counting a storage the first time an op's output holds
    it, so a view of a storage made before it started (a row of a dataset tensor the loader
    indexes, on the host) would count the whole dataset from then on; here an output that aliases an input's storage the
    tracker never saw is left out. For StepPeaks, whose tracker starts before a loop that loads
    its own data."""
    import torch.distributed._tools.mem_tracker as mem_tracker

    class MadeHereTracker(mem_tracker.MemTracker):
        _unseen: frozenset = frozenset()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            outer = self._unseen
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self._unseen = frozenset(id(st) for t in tensors for st in mem_tracker.get_untyped_storages(t)
                                     if st not in self._WINFO)
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._unseen = outer

        def _track(self, reftype, t):
            if self._unseen and any(id(st) in self._unseen for st in mem_tracker.get_untyped_storages(t)):
                return  # a view of (or in-place op on) a storage made before the tracker started
            super()._track(reftype, t)

    return MadeHereTracker


@contextlib.contextmanager
def _sparse_storages_seen():
    """MemTracker reads one storage per tensor and raises on a sparse COO tensor ("Cannot access
    storage of SparseTensorImpl": every step with ``Embedding(sparse=True)`` gradients); while
    it runs, such a tensor counts as the storages of its indices and values, what it holds."""
    import torch.distributed._tools.mem_tracker as mem_tracker

    plain = mem_tracker.get_untyped_storages

    def storages(t: torch.Tensor) -> set:
        if isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo:
            return plain(t._indices()) | plain(t._values())
        return plain(t)

    mem_tracker.get_untyped_storages = storages
    try:
        yield
    finally:
        mem_tracker.get_untyped_storages = plain


def _measure(model: torch.nn.Module, inputs: Any, optimizer, run, held: list | None = None) -> MeasuredStep:
    """``run(on_phase)`` runs the step; its peak on the model's device. ``held``: tensors made
    before the step that it holds (the previous step's output), for MemTracker to count."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss = run(None)
        torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        return MeasuredStep(torch.cuda.max_memory_allocated(device), loss, dt * 1e3, "torch.cuda.max_memory_allocated")
    mt, grad_hooks = _memory_tracker(model)
    # The batch is in device memory too (as on a GPU, where max_memory_allocated counts it);
    # MemTracker only sees tensors made inside its context unless told about them.
    batch = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    try:
        with _sparse_storages_seen():  # gradients kept from the last step may be sparse
            mt.track_external(model, *([optimizer] if optimizer is not None else []), *batch, *(held or ()))
            held = None  # MemTracker holds them weakly: the step lets go of them when the loop does
            t0 = time.perf_counter()
            with _tracking(mt):
                loss = run(None)  # no module hooks, so no per-module stats to reset per micro-batch
    finally:
        for h in grad_hooks:
            h.remove()
    return _measured(mt, device, loss, time.perf_counter() - t0)


def _measured(mt: Any, device: Any, loss: float | None, elapsed_s: float) -> MeasuredStep:
    """The step a MemTracker saw: its peak on ``device``, and the part of it that is not
    parameters, buffers, gradients or optimizer state."""
    snap = mt.get_tracker_snapshot("peak")[device]
    state = sum(v for k, v in snap.items() if getattr(k, "name", "") in ("PARAM", "BUFFER", "GRAD", "OPT"))
    peak = int(snap["Total"])
    return MeasuredStep(peak, loss, elapsed_s * 1e3, "torch.distributed._tools.MemTracker", peak - int(state))


class StepPeaks:
    """Peak memory of each optimizer step of a loop this process runs but does not own (a
    framework's trainer), with the meter ``measure_steps`` uses.

        meter = StepPeaks(model, optimizer)
        meter.start()                 # where the loop begins
        peak = meter.step_done()      # at each step boundary: peak bytes since the last one
        meter.stop()

    CUDA: ``max_memory_allocated``, reset at each boundary. CPU: one MemTracker (storages only)
    from ``start`` to ``stop``, its peak read and reset at each boundary, so everything made since
    ``start`` counts while it is alive: what a step inherits from the one before (the last loss a
    trainer keeps, a logged value, a batch fetched ahead) is in the next step's peak, as a GPU's
    allocator counts it. Of what exists before ``start`` only the model, the optimizer (its
    state) and ``external`` tensors count, also where the loop takes views of the rest: a
    trainer's host-side dataset does not.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 external: tuple = ()) -> None:
        check_real(model)
        self.model, self.optimizer, self.external = model, optimizer, tuple(external)
        self.device = next(model.parameters()).device
        self.peaks_bytes: list[int] = []
        """The peak of each step measured so far, in order."""
        self._mt: Any = None
        self._collectives: Any = None
        self._hooks: list = []
        self._sparse: contextlib.ExitStack | None = None

    def start(self) -> None:
        if self._mt is not None or self._sparse is not None:
            raise RuntimeError("StepPeaks.start() called twice; call stop() first")
        self._sparse = contextlib.ExitStack()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._sparse.enter_context(_sparse_storages_seen())
        self._mt, self._hooks = _memory_tracker(self.model, made_here_only=True)
        opt = [self.optimizer] if self.optimizer is not None else []
        self._mt.track_external(self.model, *opt, *self.external)
        self._mt.__enter__()
        self._collectives = _collectives_mode()
        self._collectives.__enter__()

    def step_done(self) -> int:
        """The peak since ``start`` or the last ``step_done``, in bytes; the next step starts here."""
        if self._sparse is None:
            raise RuntimeError("StepPeaks.step_done() before start()")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            mt = self._mt
            peak = int(mt.get_tracker_snapshot("peak")[self.device]["Total"])
            mt._peak_mem_snap = mt.get_tracker_snapshot()  # what MemTracker.__enter__ resets
            mt._peak_mem = {dev: snap["Total"] for dev, snap in mt._peak_mem_snap.items()}
        self.peaks_bytes.append(peak)
        return peak

    def stop(self) -> None:
        """End the measurement (idempotent): the tracker and its gradient hooks are removed."""
        if self._mt is not None:
            self._collectives.__exit__(None, None, None)
            self._mt.__exit__(None, None, None)
            for h in self._hooks:
                h.remove()
            self._mt, self._hooks = None, []
        if self._sparse is not None:
            self._sparse.close()
            self._sparse = None
