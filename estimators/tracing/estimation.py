"""``estimate()``: trace one training step once and derive every estimate from that trace.

    est = estimate(model, TrainStep(inputs=(idx,), loss_fn=my_loss, optimizer="adamw"), device="h100")
    est.module_info.peak_bytes           # steady-state step peak without checkpointing
    est.first_step_peak_bytes            # the first step's (optimizer state not yet created)
    est.module_info.stats("GPT.blocks.0").act_fw_bytes

Fake mode (default) runs on a copy of the model whose parameters are fake CPU tensors: no memory
is allocated and nothing is computed, so a 70B model given on the meta device is planned on a
laptop. Real mode runs the step on the model itself with real tensors, then puts back its
parameters, buffers and gradients as they were (and the RNG state): it is how the estimates are
checked against measurements. Neither mode touches the optimizer instance a user passes (a new
one of the same class and hyper-parameters is built over the traced parameters).

The step traced is the steady state of the loop ``TrainStep`` describes (``estimators/step/train_step.py``):

* optimizer state alive from the start: before tracing, every parameter gets a zero gradient and
  the optimizer steps once (free in fake mode), so its state exists as from step 2 on;
* gradients as the loop keeps them: ``ZeroGrad.SET_TO_NONE`` with one micro-batch starts with no
  gradients; ``ZeroGrad.ZERO`` or a micro-batch after the first of gradient accumulation starts
  with all of them allocated (the binding micro-batch: the first one of an accumulation step holds
  less). One micro-batch is traced (the others are the same ops), then the optimizer step;
* forward and loss under ``torch.autocast`` when ``autocast_dtype`` is set.

The first step of a fresh run differs only in that the optimizer state does not exist before the
optimizer phase (and, with one micro-batch, no gradient exists in its forward):
``first_step_peak_bytes`` removes those bytes from the steady-state timeline. That is exact for
torch's optimizers, which create all their state before any update math; in the first step's
backward with ``ZeroGrad.ZERO`` and one micro-batch it is an upper bound (gradients are counted
as alive from the start of backward). The prediction is the larger of the two peaks.

Mixed precision: a trace for a CUDA target (fake mode) runs the step's autocast regions with CUDA
autocast's op policy, from torch's own lists (``estimators/tracing/cuda_autocast.py``, differences
and their bytes in docs/cuda_autocast.md); a CPU target and a real-mode trace run CPU autocast.
Autocast's cache of low-precision copies of the parameters lives as on the device: until the
autocast region ends, longer where autograd saves them.
"""

from __future__ import annotations

import contextlib
import importlib
import dataclasses
import enum
import functools
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from estimators.step import host_rng
from estimators.tracing.aggregate import build_module_info
from estimators.tracing.comm_overlap import apply_comm_overlap
from estimators.tracing.cuda_autocast import AutocastWatch, CudaAutocast
from estimators.tracing.cuda_rules import CudaSemanticsMode
from estimators.tracing.fake_dispatch import MemoMode
from estimators.tracing.fake_kernels import FakeKernelError, RealKernelsMode
from estimators.tracing.hf_paths import hf_real_paths
from estimators.runtime.device import DeviceSpec, get_device_spec
from estimators.tracing.marks import TraceMarks
from estimators.tracing.memory import MemoryTimeline, build_timeline
from estimators.tracing.sharded_model import fsdp_units_of, original_class_name, uneven_shards
from estimators.runtime.collective_ops import CollectivePricing
from estimators.runtime.models import RuntimeKind, make_runtime_model
from estimators.tracing import fake_leaks
from estimators.step.stage_step import run_stage_microbatch
from estimators.step.train_step import StepError, TrainStep, run_step, step_mode
from estimators.contract.module_info import ModuleInfo
from estimators.step.optimizer import check_optimizer_params, param_groups, resolve_optimizer
from estimators.tracing.steady_state import first_step_module_info, first_step_peak, grad_placement_hooks, steady_state
from estimators.tracing.trace import InplaceModifiedError, StepTrace, StepTracer
from estimators.tracing.model_calls import refuse_calls_of
from estimators.tracing.dtensor_foreach import local_foreach
from estimators.tracing.replicate import NotReplicable, expand_stacks
from estimators.tracing.routing import ExpertLoad, stated_routing
from estimators.tracing.stacks import Stack, find_stacks
from estimators.tracing.fake_copy import FakeCopyError, fake_copy, fake_tensor
from estimators.tracing.real_mode import restored, undo
from estimators.tracing.thread_state import eager_in_this_thread, gc_paused, torch_rng_restored
from estimators.tracing.truncation import FullListsRuntime, may_index_blocks, pre_step_owners

__all__ = [
    "DEFAULT_DEVICE",
    "TraceMode",
    "EstimateOptions",
    "Estimate",
    "estimate",
    "TraceError",
    "HostRandomnessWarning",
    "DrawnControlFlowWarning",
    "resolve_optimizer",
    "check_optimizer_params",
    "as_train_step",
    "first_step_module_info",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, tuple], torch.Tensor]
DEFAULT_DEVICE = "cpu"
"""The target every entry point plans for unless told otherwise (``estimate``, ``solve_sac``,
``tradeoff_curve``, the CLI...): this machine's CPU, so a plan can be checked here like for like.
Pass ``device="h100"`` (or another DeviceSpec name) to plan for a GPU."""


class TraceError(StepError):
    """The step could not be traced; the message says what to change."""


class TraceMode(enum.Enum):
    FAKE = "fake"  # FakeTensorMode on a fake copy of the model: no memory, no compute
    REAL = "real"  # real tensors on the model's own device


@dataclass(frozen=True, kw_only=True)
class EstimateOptions:
    mode: TraceMode = TraceMode.FAKE
    """FAKE plans without allocating; REAL runs the model itself (and restores it), for validation."""
    runtime: RuntimeKind = RuntimeKind.ROOFLINE
    """ROOFLINE costs ops on the DeviceSpec; BENCHMARK times real kernels on this machine."""
    cuda_semantics: bool | None = None
    """Apply the CUDA memory rules (estimators/tracing/cuda_rules.py). Default: when the target is a CUDA
    device and the trace is fake."""
    cuda_autocast: bool | None = None
    """Run autocast regions with CUDA autocast's op policy (estimators/tracing/cuda_autocast.py), not
    the CPU's. Default: with the CUDA memory rules. Needs a fake trace."""
    progress: bool = False
    """Log progress (INFO on this module's logger) after each top-level module and phase."""
    replicate_blocks: bool = True
    """In a fake trace (without ``prepare``, or with one ``estimate``'s ``prepare_on_stacks``
    allows), run four blocks of each stack of identical blocks (a ``ModuleList`` of at least
    five transformer layers: ``estimators.tracing.stacks``) and lay the
    others in as copies of one (``estimators.tracing.replicate``): the trace the full step gives,
    in the time of four blocks. Where the traced blocks differ, the full model is traced (said at
    DEBUG on ``estimators.tracing.replicate``'s logger). False: always trace every block."""
    local_foreach: bool = True
    """Run DTensor's elementwise ``_foreach_`` ops (an optimizer's foreach step) on the local shards
    where DTensor's dispatch runs that same op there (``estimators.tracing.dtensor_foreach``): the
    same trace without DTensor's per-element sharding propagation. False: DTensor's dispatch."""
    expert_load: ExpertLoad | None = None
    """The tokens each rank's experts receive, for the routing's value reads (``estimators.tracing.routing``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TraceMode):
            object.__setattr__(self, "mode", TraceMode(self.mode))
        if not isinstance(self.runtime, RuntimeKind):
            object.__setattr__(self, "runtime", RuntimeKind(self.runtime))
        if self.cuda_autocast and self.mode is TraceMode.REAL:
            raise ValueError("EstimateOptions(cuda_autocast=True) needs mode=TraceMode.FAKE: a real trace "
                             "runs this machine's kernels and its CPU autocast")


@dataclass
class Estimate:
    """The trace (of the steady-state step) and everything derived from it."""

    trace: StepTrace
    timeline: MemoryTimeline
    module_info: ModuleInfo
    """Memory points and ``peak_bytes`` of the steady-state step (what plans are made for)."""
    spec: DeviceSpec
    trace_time_s: float
    step: TrainStep = dataclasses.field(default_factory=TrainStep)
    """The step traced (inputs resolved); verification traces and measurements run the same."""
    options: "EstimateOptions" = dataclasses.field(default_factory=lambda: EstimateOptions())
    """How it was traced; a verification trace uses the same mode and runtime."""
    first_step_peak_bytes: int = 0
    """Peak of the first step of a fresh run (see the module docstring)."""
    grad_placements: dict[str, tuple] = dataclasses.field(default_factory=dict)
    """Kept gradients (``TrainStep.grads_alive_at_start``) of DTensor parameters that the backward
    makes in other placements than the parameter's: {name: placements} (a vocabulary-sharded
    embedding's is replicated)."""

    @property
    def steady_peak_bytes(self) -> int:
        return self.module_info.peak_bytes

    @property
    def binding_step(self) -> str:
        """``"steady state"`` or ``"first step"``: which one has the larger peak."""
        return "first step" if self.first_step_peak_bytes > self.steady_peak_bytes else "steady state"


def _default_inputs(model: torch.nn.Module) -> Any:
    make = getattr(model, "example_inputs", None)
    if not callable(make):
        raise ValueError(
            f"no inputs given and {type(model).__name__} has no example_inputs() method; "
            "pass inputs=(batch,) — a tensor, a tuple of forward's positional args, or a dict of kwargs"
        )
    return make()


def _check_real_devices(model: torch.nn.Module, inputs: Any) -> None:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise TraceError(f"model parameters are on several devices {sorted(map(str, devices))}")
    if not devices:
        return
    dev = next(iter(devices))
    if dev.type == "meta":
        raise TraceError(
            "the model is on the meta device: real mode needs real tensors; use mode=TraceMode.FAKE"
        )
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor) and t.device != dev:
            raise TraceError(
                f"an input tensor is on {t.device} but the model is on {dev}; "
                f"move the inputs with .to({str(dev)!r}) (or trace in fake mode)"
            )


def as_train_step(model: torch.nn.Module, step: TrainStep | None) -> TrainStep:
    """``step`` checked and resolved: None is ``TrainStep()``, and a step without ``inputs`` takes
    ``model.example_inputs()``."""
    if step is None:
        step = TrainStep()
    elif not isinstance(step, TrainStep):
        raise TypeError(
            f"step must be a TrainStep, got {type(step).__name__}: describe the step as "
            "TrainStep(inputs=batch, loss_fn=..., optimizer=...)")
    if step.inputs is None:
        step = dataclasses.replace(step, inputs=_default_inputs(model))
    return step


def estimate(
    model: torch.nn.Module,
    step: TrainStep | None = None,
    *,
    device: str | DeviceSpec = DEFAULT_DEVICE,
    options: EstimateOptions = EstimateOptions(),
    prepare: Callable[[torch.nn.Module], Any] | None = None,
    prepare_on_stacks: Callable[[list[Stack]], bool] | None = None,
) -> Estimate:
    """Trace the steady-state training step of ``model``; estimate memory, runtime and SAC trade-offs.

    Args:
        model: the module to train; real, or on the meta device for fake mode.
        step: the training step (``TrainStep``: inputs, loss, optimizer, micro-batches, gradient
            reset, autocast); None: ``TrainStep()`` (``model.example_inputs()``, ``output.sum()``,
            no optimizer).
        device: DeviceSpec or its name (``"h100"``, ``"a100-80gb"``, ``"cpu"``...); default
            :data:`DEFAULT_DEVICE`.
        prepare: called with the module that is traced (the fake copy in fake mode) before the
            step, e.g. to apply a checkpointing plan to it.
        prepare_on_stacks: with ``prepare``, whether the repeated-block trace may run
            (``EstimateOptions.replicate_blocks``): called with the model's stacks, True where
            ``prepare`` does the same to blocks 1 to N-2 of each and nothing to a module holding a
            stack, and applies to the blocks the traced copy has (it then runs blocks 0, 1, 2 and
            the last; the others are laid in as copies of block 2). None: every block is traced.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    spec = get_device_spec(device)
    step = as_train_step(model, step)
    step.check_target(spec)
    if step.target is not None and step.stage is None:
        raise ValueError("TrainStep.target is the labels a pipeline's last stage hands to loss_fn(output, target) "
                         "(plan it with PlanOptions(pipeline=...)); for a whole model the loss gets (output, inputs): "
                         "close over the labels in loss_fn (they count as resident) or put them in the inputs")
    _check_held_is_not_the_model(model, step)
    if step.stage is not None:
        # Imported here, not first inside the trace: pipelining makes a module-level tensor on
        # import, which the fake mode would make fake (and report as leaked).
        importlib.import_module("torch.distributed.pipelining._backward")
    fake = options.mode is TraceMode.FAKE
    cuda_rules = options.cuda_semantics if options.cuda_semantics is not None else (spec.is_cuda and fake)
    t0 = time.perf_counter()
    # A model fully_shard sharded is copied unit by unit (estimators.tracing.sharded_model): traced
    # whole. A pipeline stage's marks (op positions) move with the blocks laid in (replicate).
    stacks = (find_stacks(model) if fake and options.replicate_blocks and not fsdp_units_of(model)
              and (prepare is None or prepare_on_stacks is not None) else [])
    if stacks and prepare is not None and not prepare_on_stacks(stacks):
        stacks = []
    trace, without_grad, stacks, placed = _trace(model, step, spec, options, prepare, cuda_rules, frozenset(), stacks)
    if (without_grad and (step.optimizer is not None or step.grads_alive_at_start)) or placed:
        # torch's optimizers create no state for (and do not step) a parameter whose .grad is
        # None, and a parameter the loss never reaches never gets one (an unused pooler, a frozen
        # part the optimizer was still given): trace again with the parameters as the loop has
        # them from step 2 on (without gradient or state; kept gradients as the backward made them).
        logger.info("traced again: %d parameter(s) get no gradient (%s), %d one in other placements",
                    len(without_grad), ", ".join(sorted(without_grad)[:3]), len(placed))
        trace, _, _, _ = _trace(model, step, spec, options, prepare, cuda_rules, without_grad, stacks, placed)
    with gc_paused():
        timeline = build_timeline(trace)
        info = build_module_info(trace, timeline, spec)
    dt = time.perf_counter() - t0
    logger.info("traced %d ops, %d module calls in %.2f s", len(trace.ops), len(trace.calls), dt)
    return Estimate(
        trace=trace, timeline=timeline, module_info=info, spec=spec, trace_time_s=dt, step=step,
        options=options, first_step_peak_bytes=first_step_peak(trace, timeline, step), grad_placements=placed,
    )


def _check_held_is_not_the_model(model: torch.nn.Module, step: TrainStep) -> None:
    """``TrainStep.held`` is what the loop holds besides the model: a tensor of the model there
    would be counted twice in fake mode (the trace's model is a copy) and once in real mode."""
    if not step.held:
        return
    own = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        own[id(t.untyped_storage())] = name
    for t in step.held_tensors():
        name = own.get(id(t.untyped_storage()))
        if name is not None:
            raise ValueError(
                f"TrainStep.held holds the model's own {name!r} (or a view of it): the model's "
                "parameters and buffers are counted already; hold only what the loop keeps besides "
                "the model, e.g. an EMA copy made with copy.deepcopy(model)"
            )


def _trace(
    model: torch.nn.Module, step: TrainStep, spec: DeviceSpec, options: EstimateOptions,
    prepare: Callable[[torch.nn.Module], Any] | None, cuda_rules: bool, without_grad: frozenset[str],
    stacks: list[Stack], grad_placements: dict[str, tuple] | None = None,
) -> tuple[StepTrace, frozenset[str], list[Stack], dict[str, tuple]]:
    """``_trace_step`` with the blocks of ``stacks`` traced once each (and the stacks used), or,
    where that trace cannot stand for the full one, of the full model (and no stacks)."""
    fake = options.mode is TraceMode.FAKE
    if stacks:
        out = _step_in_mode(fake, model, step, spec, options, prepare, cuda_rules, without_grad, stacks,
                            grad_placements, replicable=True)
        if not isinstance(out, str):
            trace, got_no_grad, placed = out
            return trace, got_no_grad, stacks, placed
        logger.debug("%s: every block traced (%s)", type(model).__name__, out)
    trace, got_no_grad, placed = _step_in_mode(fake, model, step, spec, options, prepare, cuda_rules,
                                               without_grad, (), grad_placements)
    return trace, got_no_grad, [], placed


class _AutocastSeen(Exception):
    """A trace without CUDA's autocast kernels saw CPU autocast on: it is traced again with them."""


def _step_in_mode(fake: bool, model, step, spec, options, prepare, cuda_rules, without_grad, stacks,
                  grad_placements, *, replicable: bool = False):
    """``_trace_step`` in a trace mode of its own; traced again with CUDA's autocast kernels
    registered from the start where the first trace, without them, saw CPU autocast on.

    ``replicable`` (stacks laid in): where the truncated trace cannot stand for the full one, the
    reason (a str) instead. Both are caught inside the mode: the exception's traceback (the
    trace's frames) is dropped before the mode ends, so the mode dies with it and its end needs
    no heap scan for caches holding its tensors (one per zero-bubble stage cost seconds)."""
    for kernels in (False, True):
        with _trace_mode(fake) as box:
            try:
                return _trace_step(model, step, spec, options, prepare, cuda_rules, without_grad, box.mode, stacks,
                                   grad_placements, autocast_kernels=kernels)
            except _AutocastSeen:
                if kernels:
                    raise
                continue
            except (NotReplicable, TraceError) as e:
                if not replicable or (not isinstance(e, NotReplicable) and not may_index_blocks(e)):
                    raise  # the model's own error: the full model raises it too
                why = f"{type(e).__name__}: {e}"
        return why
    raise AssertionError("unreachable: the second trace registers the autocast kernels")


def _trace_mode(fake: bool) -> contextlib.AbstractContextManager[fake_leaks.FakeTrace]:
    """The fake mode of one trace (``.mode``, None in real mode); what the trace leaves held in
    the process is cleared when it ends (``estimators.tracing.fake_leaks``)."""
    return fake_leaks.fake_trace_mode() if fake else contextlib.nullcontext(fake_leaks.FakeTrace(None))


def _trace_step(
    model: torch.nn.Module, step: TrainStep, spec: DeviceSpec, options: EstimateOptions,
    prepare: Callable[[torch.nn.Module], Any] | None, cuda_rules: bool, without_grad: frozenset[str],
    fake_mode: FakeTensorMode | None, stacks: list[Stack] = (), grad_placements: dict[str, tuple] | None = None,
    autocast_kernels: bool = False,
) -> tuple[StepTrace, frozenset[str], dict[str, tuple]]:
    """One traced step of the steady state, the trainable parameters that got no gradient in
    it, and the DTensor ones whose gradient the backward made in other placements than it had
    (-> those). ``without_grad``: parameters that start the step with neither gradient nor
    optimizer state; ``grad_placements``: gradients that start in these placements (both seen
    in a previous trace). ``fake_mode``: the mode of a fake trace, None for a real one. ``stacks``
    (fake mode): run four blocks of each and lay the others in (``estimators.tracing.replicate``).
    ``autocast_kernels``: register CUDA's autocast kernels for the whole step; otherwise they are
    registered only where the step may open CPU autocast in a way a watch could miss (its autocast
    dtype, a context of the user's, TorchScript, autocast on already), and a step that turns it on
    anyway raises _AutocastSeen (traced again with them): registering them updates every
    operator's dispatch table twice, a twentieth of a small model's trace."""
    fake = fake_mode is not None
    if fake:
        try:
            traced, mapping = fake_copy(model, fake_mode, stacks)
        except FakeCopyError as e:
            raise TraceError(str(e)) from e.__cause__
        step_inputs, step_target = tree_map(
            lambda t: fake_tensor(fake_mode, t) if isinstance(t, torch.Tensor) else t, (step.inputs, step.target)
        )
    else:
        _check_real_devices(model, step.inputs)
        if fsdp_units_of(model):
            raise TraceError(
                f"{type(model).__name__} is sharded with fully_shard: a real trace would run FSDP2's own "
                "all-gathers, which the FSDP rules count again; trace it in fake mode (the default), or "
                "trace the model before fully_shard")
        fake_mode, traced, mapping = None, model, {id(p): p for p in model.parameters()}
        step_inputs, step_target = step.inputs, step.target
    with contextlib.ExitStack() as restore:
        # The user's `random` / numpy streams go on where they were; what the step drew is noted.
        draws = restore.enter_context(host_rng.Draws())
        if not fake:
            restore.enter_context(restored(model))
        else:
            # Fake tensors draw nothing, but the model's Python code may touch the generators
            # itself (Reformer calls torch.seed() in train mode): planning leaves them as they were.
            cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
            restore.enter_context(torch_rng_restored(cuda))
        groups = param_groups(model, step.optimizer, mapping)
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            # Built in the mode: a constructor that makes state (Adagrad's step count) makes it
            # fake, with the value fake tensors keep for constants (a real one read by .item()
            # inside the fake step raised DataDependentOutputException).
            opt = resolve_optimizer(step.optimizer, groups, spec, fake)
            try:
                with MemoMode(fake_mode) if fake_mode is not None else contextlib.nullcontext():
                    steady_state(traced, opt, step, without_grad, fake=fake, grad_placements=grad_placements)
            except StepError as e:
                raise TraceError(str(e)) from e.__cause__
        runtime = make_runtime_model(options.runtime, spec)
        full_lists = FullListsRuntime(runtime, stacks, traced) if stacks else None
        tracer = StepTracer(
            traced, original_class_name(model), CollectivePricing.for_device(full_lists or runtime, spec),
            inputs=(step_inputs, step_target), optimizer=opt, device=spec.name if fake else get_device_spec("cpu").name,
            round_bytes=spec.round_bytes if (fake and spec.is_cuda) else (lambda n: n),
            progress=(lambda m: logger.info("trace: %s", m)) if options.progress else None,
            previous_output=step.keep_output, held=step.held_tensors() + step.loss_closure_tensors(model), fake_mode=fake_mode,
        )
        marks = TraceMarks(tracer)
        if full_lists is not None:
            full_lists.phase, full_lists.optimizer = functools.partial(getattr, tracer, "phase"), opt
        owners = [pre_step_owners(tracer.sid_of, traced, st, opt) for st in stacks]
        applied = prepare(traced) if prepare is not None else None
        if fake:  # the user's model itself must not train in the step (see model_calls)
            restore.callback(refuse_calls_of(model, _TheModelItself))
        graded: set[str] = set()
        trainable = {n: p for n, p in traced.named_parameters() if p.requires_grad}
        grad_hooks = [p.register_post_accumulate_grad_hook(lambda _, n=n: graded.add(n)) for n, p in trainable.items()]
        grad_hooks += grad_placement_hooks(trainable, placed := {}, kept=step.grads_alive_at_start)
        tracer.attach()
        watch = None
        try:
            with contextlib.ExitStack() as modes:
                # The step's eager ops are traced: compiled code runs eagerly in this thread (see thread_state)
                modes.enter_context(eager_in_this_thread())
                if fake_mode is not None:
                    modes.enter_context(hf_real_paths(step.inputs))  # HF's real-run code path
                    modes.enter_context(fake_mode)
                    # Below the tracer: it records outputs as the real kernels make them.
                    kernels = RealKernelsMode(cuda=bool(cuda_rules), values=_batch_values(step.inputs, step_inputs),
                                              fake_mode=fake_mode)
                    tracer.run_op = modes.enter_context(kernels.inline())
                tracer.run_op = stated_routing(options.expert_load, fake_mode, tracer.run_op)
                modes.enter_context(tracer)
                if options.local_foreach:
                    modes.enter_context(local_foreach())
                amp = options.cuda_autocast if options.cuda_autocast is not None else (cuda_rules and fake)
                watch = AutocastWatch() if amp and cuda_rules and not autocast_kernels and not (
                    step.autocast_dtype is not None or step.context is not None or torch.is_autocast_enabled("cpu")
                    or any(isinstance(m, torch.jit.ScriptModule) for m in traced.modules())) else None
                tracer.autocast_watch = watch
                if cuda_rules:
                    modes.enter_context(CudaSemanticsMode(watch=watch))
                autocast = modes.enter_context(CudaAutocast()) if amp and watch is None else None
                modes.enter_context(step_mode(traced, step.train_mode))
                with torch.autograd.graph.saved_tensors_hooks(tracer.pack_hook, tracer.unpack_hook):
                    on_phase = autocast.on_phase(tracer.set_phase) if autocast else tracer.set_phase
                    if step.stage is not None:  # one micro-batch of a pipeline stage
                        written = run_stage_microbatch(traced, step_inputs, step.loss_fn, step_target, opt,
                                                       step.stage, on_phase=on_phase, on_mark=marks.mark,
                                                       context=step.context)
                        graded.update(n for n, p in trainable.items() if id(p) in written)
                    else:
                        run_step(
                            traced, step_inputs, step.loss_fn, opt, on_phase=on_phase,
                            micro_batches=step.micro_batches, passes=1, autocast_dtype=step.autocast_dtype,
                            keep_output=step.keep_output, context=step.context,
                        )
        except Exception as e:
            if watch is not None and watch.seen:
                raise _AutocastSeen() from e  # the step may fail only without the kernels: retraced with them
            if isinstance(e, StepError):
                raise TraceError(str(e)) from e.__cause__
            if isinstance(e, (FakeKernelError, InplaceModifiedError)):
                raise TraceError(uneven_shards(model, str(e)) + str(e)) from e
            raise
        finally:
            tracer.detach()
            if full_lists is not None:
                full_lists.close()
            own = {id(p) for p in model.parameters()} if fake else set()
            read = [t for t in tracer.foreign_leaves() if id(t) in own]
            tracer.restore_foreign_grads()
            for h in grad_hooks:
                h.remove()
            undo(applied)
        if watch is not None and watch.seen:
            raise _AutocastSeen()
        if read:
            names = [n for n, p in model.named_parameters() if any(p is t for t in read)]
            raise _TheModelItself(f"reads the model's own parameters ({', '.join(names[:3])}"
                                  f"{', ...' if len(names) > 3 else ''}), from loss_fn or a hook")
        trace = marks.into(tracer.finish())
        if stacks:
            try:
                with gc_paused():
                    trace = expand_stacks(trace, stacks, owners, original_class_name(model))
            except NotReplicable:
                raise
            except Exception as e:  # noqa: BLE001 - a trace this code does not expect: trace it whole
                raise NotReplicable(f"{type(e).__name__}: {e}") from e
        apply_comm_overlap(trace)  # a collective costs the step what its compute stream waits for
        got_no_grad = frozenset(n for n in trainable if n not in graded)
        drawn_reads = tracer.random_value_reads
        del opt, tracer
        if fake:
            _refuse_unsized_workspaces(trace)
    if draws.drew:
        warnings.warn(
            "the traced step drew from Python's `random` or numpy's global RNG. Masks drawn that way "
            "are replayed and cost what the trace saw; control flow drawn that way (stochastic "
            "depth or LayerDrop by random.random()) followed the trace's one draw, and steps that "
            "skip fewer layers can peak higher (30 % measured). Plan such a model with every "
            "layer running (drop rate 0 while planning).", HostRandomnessWarning, stacklevel=3)
    if drawn_reads:
        where = ", ".join(drawn_reads[:4]) + (f" and {len(drawn_reads) - 4} more" if len(drawn_reads) > 4 else "")
        warnings.warn(
            f"the traced step branched on values drawn from torch's RNG ({where}: e.g. LayerDrop's "
            "`torch.rand([]) < layerdrop`): the trace followed its one draw, and steps that skip "
            "fewer layers peak higher (a Data2VecAudio with layerdrop 0.5: up to 36 % over). Plan "
            "such a model with every layer running (HF: config.layerdrop = 0.0 while planning).",
            DrawnControlFlowWarning, stacklevel=3)
    return trace, got_no_grad, placed


def _batch_values(real: Any, fake: Any) -> dict[int, torch.Tensor]:
    """``id(fake batch tensor) -> real one`` where the real one has values (not on the meta
    device): what ``RealKernelsMode`` checks token ids against."""
    pairs = zip(tree_flatten(real)[0], tree_flatten(fake)[0])
    return {id(f): r for r, f in pairs
            if isinstance(r, torch.Tensor) and isinstance(f, torch.Tensor) and r.device.type != "meta"}


class _TheModelItself(TraceError):
    """A fake trace runs a copy of the model; the step used the model itself (loss_fn holds it)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"the step {what}: a fake trace runs a copy of the model, so the user's model would "
            "run on fake tensors and the copy's figures would miss it (a SimCLR projection head "
            "called from loss_fn: 48 % under the measured peak). Compute it in the model's forward, "
            "or trace in real mode, which runs the model itself: solve_sac(..., options="
            "PlanOptions(trace=EstimateOptions(mode=TraceMode.REAL))), --mode real on the command line")


class HostRandomnessWarning(UserWarning):
    """The traced step drew from Python's ``random`` or numpy's global generator."""


class DrawnControlFlowWarning(UserWarning):
    """The traced step (real mode) read the value of a tensor drawn from torch's RNG: its control
    flow followed one draw."""


# Backward ops whose forward keeps a workspace that torch's fake (meta) kernel returns empty (the
# oneDNN LSTM/GRU layer's is a large share of such a step's peak). A fake trace cannot size it; a
# real one measures it.
_UNSIZED_WORKSPACE_BACKWARDS = {"aten.mkldnn_rnn_layer_backward.default": "LSTM/GRU/RNN (aten.mkldnn_rnn_layer)"}


def _refuse_unsized_workspaces(trace: StepTrace) -> None:
    unsized = {f for f in {op.func for op in trace.ops} if str(f) in _UNSIZED_WORKSPACE_BACKWARDS}
    for op in trace.ops:
        if op.func in unsized:
            what = _UNSIZED_WORKSPACE_BACKWARDS[str(op.func)]
            where = trace.calls[op.call].fqn if op.call >= 0 else "the model"
            raise TraceError(
                f"{where} runs {what}, whose workspace kept for the backward has 0 bytes under "
                "torch's fake tensors (its real size is the kernel library's choice), so a fake-mode "
                "trace would under-predict the peak; trace in real mode: solve_sac(..., "
                "options=PlanOptions(trace=EstimateOptions(mode=TraceMode.REAL))), --mode real on the command line"
            )
