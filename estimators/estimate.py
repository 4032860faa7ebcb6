"""``estimate()``: trace one training step once and derive every estimate from that trace.

    est = estimate(model, (idx,), loss_fn=my_loss, optimizer="adamw", device="h100")
    est.module_info.peak_bytes           # step peak without checkpointing
    est.module_info.stats("GPT.blocks.0").act_fw_bytes

Fake mode (default) runs on a copy of the model whose parameters are fake CPU tensors: no memory
is allocated and nothing is computed, so a 70B model given on the meta device is planned on a
laptop. Real mode runs the step on the model itself (its gradients accumulate and the optimizer
steps): it is how the estimates are checked against measurements.

Step convention: ``out = model(*inputs)``; ``loss = loss_fn(out, inputs)`` (default
``out.sum()``); the output is released; ``loss.backward()``; ``optimizer.step()``.
"""

from __future__ import annotations

import copy
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from estimators.aggregate import build_module_info
from estimators.cuda_rules import CudaSemanticsMode
from estimators.device import DeviceSpec, get_device_spec
from estimators.memory import MemoryTimeline, build_timeline, classify_storages
from estimators.module_info import ModuleInfo
from estimators.runtime import RuntimeKind, make_runtime_model
from estimators.step import StepError, run_step
from estimators.trace import StepTrace, StepTracer, StorageKind

__all__ = ["TraceMode", "EstimateOptions", "Estimate", "estimate", "TraceError", "resolve_optimizer"]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, tuple], torch.Tensor]
_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class TraceError(StepError):
    """The step could not be traced; the message says what to change."""


class TraceMode(enum.Enum):
    FAKE = "fake"  # FakeTensorMode on a fake copy of the model: no memory, no compute
    REAL = "real"  # real tensors on the model's own device


@dataclass(frozen=True, kw_only=True)
class EstimateOptions:
    mode: TraceMode = TraceMode.FAKE
    """FAKE plans without allocating; REAL runs (and changes) the model, for validation."""
    runtime: RuntimeKind = RuntimeKind.ROOFLINE
    """ROOFLINE costs ops on the DeviceSpec; BENCHMARK times real kernels on this machine."""
    cuda_semantics: bool | None = None
    """Apply the CUDA memory rules (estimators/cuda_rules.py). Default: when the target is a CUDA
    device and the trace is fake."""
    progress: bool = False
    """Log progress (INFO on this module's logger) after each top-level module and phase."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TraceMode):
            object.__setattr__(self, "mode", TraceMode(self.mode))
        if not isinstance(self.runtime, RuntimeKind):
            object.__setattr__(self, "runtime", RuntimeKind(self.runtime))


@dataclass
class Estimate:
    """The trace and everything derived from it."""

    trace: StepTrace
    timeline: MemoryTimeline
    module_info: ModuleInfo
    spec: DeviceSpec
    trace_time_s: float


def resolve_optimizer(
    optimizer: Any, params_by_group: list[dict], spec: DeviceSpec, fake: bool
) -> torch.optim.Optimizer | None:
    """Build the optimizer over the traced parameters from a name, a class/factory or an instance."""
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        cls = _OPTIMIZERS.get(optimizer.lower())
        if cls is None:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; use one of {sorted(_OPTIMIZERS)}, "
                "an optimizer class, or a torch.optim.Optimizer instance"
            )
        kw = {"foreach": True} if spec.is_cuda and fake and cls is not torch.optim.SGD else {}
        return cls(params_by_group, **kw)
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for g, src in zip(params_by_group, optimizer.param_groups):
            hyper = {k: v for k, v in src.items() if k != "params"}
            if fake and spec.is_cuda and hyper.get("foreach") is None and "foreach" in hyper:
                hyper["foreach"] = True  # what torch picks for CUDA tensors
            groups.append({**hyper, "params": g["params"]})
        return type(optimizer)(groups, **optimizer.defaults) if fake else optimizer
    if callable(optimizer):
        return optimizer(params_by_group)
    raise TypeError(f"optimizer must be a name, a class, or an Optimizer, got {type(optimizer)}")


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


def _fake_tensor(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and not isinstance(t, torch.nn.Parameter):
        return mode.from_tensor(t)
    with mode:  # meta / other devices: same shape, stride and dtype, on the fake CPU
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _fake_copy(model: torch.nn.Module, mode: FakeTensorMode) -> tuple[torch.nn.Module, dict]:
    """Deep copy of ``model`` whose parameters and buffers are fake (shared ones stay shared)."""
    memo: dict[int, Any] = {}
    mapping: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) not in memo:
            fp = torch.nn.Parameter(_fake_tensor(mode, p.detach()), requires_grad=p.requires_grad)
            memo[id(p)] = fp
            mapping[id(p)] = fp
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = _fake_tensor(mode, b)
    try:
        return copy.deepcopy(model, memo), mapping
    except Exception as e:  # noqa: BLE001 - user modules can hold anything
        raise TraceError(
            f"could not copy {type(model).__name__} to fake tensors ({type(e).__name__}: {e}); "
            "give the model on the meta device, or trace in real mode"
        ) from e


def estimate(
    model: torch.nn.Module,
    inputs: Any = None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: Any = None,
    device: str | DeviceSpec = "cpu",
    options: EstimateOptions = EstimateOptions(),
    prepare: Callable[[torch.nn.Module], Any] | None = None,
) -> Estimate:
    """Trace one training step of ``model`` and estimate memory, runtime and SAC trade-offs.

    Args:
        model: the module to train; real, or on the meta device for fake mode.
        inputs: a tensor, a tuple of positional args, or a dict of kwargs for ``model``;
            default ``model.example_inputs()``.
        loss_fn: ``loss_fn(output, inputs) -> scalar``; default ``output.sum()``.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, an optimizer instance/class, or None.
        device: DeviceSpec or its name (``"h100"``, ``"a100-80gb"``, ``"cpu"``...).
        prepare: called with the module that is traced (the fake copy in fake mode) before the
            step, e.g. to apply a checkpointing plan to it.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    spec = get_device_spec(device)
    inputs = _default_inputs(model) if inputs is None else inputs
    fake = options.mode is TraceMode.FAKE
    cuda_rules = options.cuda_semantics if options.cuda_semantics is not None else (spec.is_cuda and fake)
    t0 = time.perf_counter()
    if fake:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        traced, mapping = _fake_copy(model, fake_mode)
        inputs = tree_map(lambda t: _fake_tensor(fake_mode, t) if isinstance(t, torch.Tensor) else t, inputs)
    else:
        _check_real_devices(model, inputs)
        fake_mode, traced, mapping = None, model, {id(p): p for p in model.parameters()}
    groups = _param_groups(model, optimizer, mapping)
    opt = resolve_optimizer(optimizer, groups, spec, fake)
    runtime = make_runtime_model(options.runtime, spec)
    round_bytes = spec.round_bytes if (fake and spec.is_cuda) else (lambda n: n)
    progress = (lambda m: logger.info("trace: %s", m)) if options.progress else None
    tracer = StepTracer(runtime, round_bytes=round_bytes, progress=progress)
    root = type(model).__name__
    _register_state(tracer, traced, inputs, opt)
    if prepare is not None:
        prepare(traced)
    tracer.attach(traced, root)
    try:
        with _maybe(fake_mode), tracer, _maybe(CudaSemanticsMode() if cuda_rules else None):
            with torch.autograd.graph.saved_tensors_hooks(tracer.pack_hook, tracer.unpack_hook):
                run_step(traced, inputs, loss_fn, opt, on_phase=tracer.set_phase)
    except StepError as e:
        raise TraceError(str(e)) from e.__cause__
    finally:
        tracer.detach()
    tracer.finish()
    step = _finish_trace(tracer, traced, opt, root, spec if fake else get_device_spec("cpu"))
    timeline = build_timeline(step)
    info = build_module_info(step, timeline)
    dt = time.perf_counter() - t0
    logger.info("traced %d ops, %d module calls in %.2f s", len(step.ops), len(step.calls), dt)
    return Estimate(trace=step, timeline=timeline, module_info=info, spec=spec, trace_time_s=dt)


class _maybe:
    """``with _maybe(ctx)``: enter ctx unless it is None."""

    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx is not None else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx is not None else False


def _param_groups(model: torch.nn.Module, optimizer: Any, mapping: dict) -> list[dict]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return [{"params": [mapping[id(p)] for p in g["params"] if id(p) in mapping]} for g in optimizer.param_groups]
    params = [mapping[id(p)] for p in model.parameters() if p.requires_grad]
    return [{"params": params}]


def _register_state(tracer: StepTracer, model: torch.nn.Module, inputs: Any, opt) -> None:
    for p in model.parameters():
        tracer.register(p, StorageKind.PARAM)
        if p.grad is not None:
            tracer.register(p.grad, StorageKind.GRAD)
    for b in model.buffers():
        tracer.register(b, StorageKind.BUFFER)
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor):
            tracer.register(t, StorageKind.INPUT)
    if opt is not None:
        for state in opt.state.values():
            for t in tree_flatten(state)[0]:
                if isinstance(t, torch.Tensor):
                    tracer.register(t, StorageKind.OPTIMIZER)


def _finish_trace(tracer: StepTracer, model: torch.nn.Module, opt, root: str, spec: DeviceSpec) -> StepTrace:
    grad_sids = {tracer.register(p.grad, StorageKind.GRAD) for p in model.parameters() if p.grad is not None}
    opt_sids: set[int | None] = set()
    if opt is not None:
        for state in opt.state.values():
            for t in tree_flatten(state)[0]:
                if isinstance(t, torch.Tensor):
                    opt_sids.add(tracer.register(t, StorageKind.OPTIMIZER))
    step = StepTrace(
        ops=tracer.ops,
        storages=tracer.storages,
        calls=tracer.calls,
        leaf_fqns=set(),
        param_bytes_by_module={},
        grad_bytes_by_module={},
        device=spec.name,
    )
    classify_storages(step, grad_sids - {None}, opt_sids - {None})
    for name, mod in model.named_modules():
        fqn = f"{root}.{name}" if name else root
        if next(mod.children(), None) is None:
            step.leaf_fqns.add(fqn)
        seen: set[int] = set()
        pbytes = gbytes = 0
        for p in mod.parameters():
            key = id(p.untyped_storage())
            if key in seen:
                continue
            seen.add(key)
            nb = tracer.round_bytes(p.untyped_storage().nbytes())
            pbytes += nb
            gbytes += nb if p.requires_grad else 0
        step.param_bytes_by_module[fqn] = pbytes
        step.grad_bytes_by_module[fqn] = gbytes
    return step
