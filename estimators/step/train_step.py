"""The training step every trace and measurement runs, so all of them count the same tensors.

``TrainStep`` says what one optimizer step of the user's loop is::

    for _ in range(micro_batches):
        with torch.autocast(device_type, dtype=autocast_dtype):     # when autocast_dtype is set
            out = model(*args, **kwargs)
            loss = loss_fn(out, inputs) / micro_batches         # default loss: out.sum()
        del out                                                 # unless keep_output: see below
        loss.backward()                                         # grads accumulate across micro-batches
    optimizer.step()                                            # when given
    optimizer.zero_grad(set_to_none=...)                        # ZeroGrad.SET_TO_NONE: torch's default

With ``keep_output=True`` the loop holds the model's output through backward, as
``out = model(**batch); out.loss.backward(); optimizer.step()`` does: each micro-batch's output
lives until the next micro-batch's forward returns (the last one's through the optimizer step and,
in a loop, into the next step's first forward).

``run_step`` runs it (or, for a trace, one micro-batch of it and the optimizer step).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch
from torch.utils._pytree import tree_flatten

from estimators.contract.module_info import Phase
from estimators.step.errors import StepError, in_the_loss
from estimators.step.optimizer import check_optimizer_name

if TYPE_CHECKING:
    from estimators.runtime.device import DeviceSpec
    from estimators.step.stage_step import StageRole

__all__ = ["StepError", "TrainStep", "ZeroGrad", "split_inputs", "run_step", "step_mode", "mode_changes", "zero_grads",
           "values_read_in"]


LossFn = Callable[[Any, Any], torch.Tensor]

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


class ZeroGrad(enum.Enum):
    """How the loop resets gradients after the optimizer step."""

    SET_TO_NONE = "set_to_none"
    """``optimizer.zero_grad()`` / ``zero_grad(set_to_none=True)``, torch's default: gradients are
    freed between steps and allocated again by the first micro-batch's backward."""
    ZERO = "zero"
    """``zero_grad(set_to_none=False)``, or gradients never reset: they stay allocated (zeroed or
    not, the same memory) through the whole step."""


@dataclass(frozen=True, kw_only=True, eq=False)
class TrainStep:
    """One optimizer step of a training loop: what every trace, plan and measurement runs.

    Example::

        step = TrainStep(inputs=(tokens,), loss_fn=my_loss, optimizer="adamw",
                         micro_batches=4, autocast_dtype=torch.bfloat16)
        plan = solve_sac(model, budget_gib=40, step=step, options=PlanOptions(device="h100"))

    The plan is made for the steady state (step 2 on: optimizer state alive from the start,
    gradients as the loop keeps them) and checked against the first step; see
    ``estimators.tracing.estimation``.
    """

    inputs: Any = None
    """One micro-batch: a tensor, a tuple of forward's positional args or a dict of kwargs;
    None: ``model.example_inputs()``."""
    loss_fn: LossFn | None = None
    """``loss_fn(output, inputs) -> scalar``; None: ``output.sum()``."""
    optimizer: Any = None
    """``"adam"``, ``"adamw"``, ``"sgd"``, an optimizer class / factory ``f(param_groups)``, a
    ``torch.optim.Optimizer`` instance (its class and hyper-parameters are used, never the
    instance itself), or None (no optimizer step, no state)."""
    micro_batches: int = 1
    """Forward/backward passes per optimizer step (gradient accumulation), >= 1."""
    zero_grad: ZeroGrad = ZeroGrad.SET_TO_NONE
    """How gradients are reset between optimizer steps."""
    autocast_dtype: torch.dtype | None = None
    """Forward and loss under ``torch.autocast`` with this dtype (``torch.bfloat16`` or
    ``torch.float16``); backward and the optimizer step are not. None: no autocast."""
    keep_output: bool = False
    """The loop holds the model output through backward, e.g. ``out = model(**batch);
    out.loss.backward(); optimizer.step()``: every tensor of the output (a causal LM's
    full-vocabulary logits) stays alive through that micro-batch's backward and, for the last
    micro-batch, the optimizer step. False: the output is dropped once the loss is computed
    (``loss = model(**batch).loss``, HF's ``Trainer``)."""

    train_mode: bool | None = None
    """The modules' ``training`` flags during the step (dropout masks and BatchNorm batch
    statistics are part of a training step's memory). None: as the model is, except that a model
    whose root is in eval mode (``from_pretrained`` returns one) runs as ``model.train()`` leaves
    it, since that is what its training loop will run (dropout masks are saved in train mode
    only). True: always ``model.train()``; False:
    always the flags as they are (a loop that trains in eval mode). Every trace, measurement and
    gradient check runs so and puts each module's flag back afterwards."""

    context: Callable[[], ContextManager] | None = None
    """Called for each micro-batch; its context manager is entered around that micro-batch's
    forward, loss and backward (torchtitan's ``train_context``): ``loss_parallel`` for a loss over
    vocabulary-sharded logits, ``lambda: context_parallel(mesh, buffers=..., buffer_seq_dims=...)``.
    None: no context."""
    stage: "StageRole | None" = None
    """The step is one micro-batch of a pipeline stage (``estimators.step.stage_step``): the
    forward on the received activation, the loss on the last stage only, torch's stage backward
    (split into input and weight halves under zero-bubble schedules), then the optimizer step.
    Set by the planner from ``PlanOptions.pipeline``; None: an ordinary step."""
    target: Any = None
    """A pipeline's last stage: one micro-batch's target, which the schedule passes to
    ``loss_fn(output, target)`` (torch.distributed.pipelining's loss signature)."""

    held: Any = ()
    """Tensors and modules the loop holds through the step besides the model, its gradients,
    optimizer state and the batch: an EMA copy of the model (``ema = copy.deepcopy(model)``),
    a frozen teacher, a replay buffer. Counted as resident for the whole step by every trace and
    measurement (a module: its parameters, buffers and gradients). A tensor or a module, or a
    list / tuple of them; never the planned model itself or one of its tensors (already counted)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "held", _check_held(self.held))
        mb = self.micro_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ValueError(
                f"micro_batches must be an int >= 1 (forward/backward passes per optimizer step), "
                f"got {mb!r}"
            )
        if not isinstance(self.zero_grad, ZeroGrad):
            try:
                object.__setattr__(self, "zero_grad", ZeroGrad(self.zero_grad))
            except ValueError:
                raise ValueError(
                    f"zero_grad must be ZeroGrad.SET_TO_NONE ('set_to_none', torch's default) or "
                    f"ZeroGrad.ZERO ('zero'), got {self.zero_grad!r}"
                ) from None
        dt = self.autocast_dtype
        if dt is not None and dt not in AUTOCAST_DTYPES:
            raise ValueError(
                f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {dt!r}"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, inputs), got {type(self.loss_fn).__name__}")
        if self.context is not None and not callable(self.context):
            raise TypeError(f"context must be a callable returning a context manager (e.g. loss_parallel), "
                            f"got {type(self.context).__name__}")
        if self.train_mode is not None and not isinstance(self.train_mode, bool):
            raise TypeError(f"train_mode must be None, True or False, got {self.train_mode!r}")
        _check_loss_signature(self.loss_fn)
        if isinstance(self.optimizer, str):
            check_optimizer_name(self.optimizer)
        from estimators.step.stage_step import StageRole

        if self.stage is not None and not isinstance(self.stage, StageRole):
            raise TypeError(f"stage must be an estimators.step.stage_step.StageRole or None, got {type(self.stage).__name__}")
        if self.stage is not None and self.stage.is_last and self.target is None:
            raise ValueError("a pipeline's last stage computes the loss as loss_fn(output, target): pass "
                             "TrainStep(target=...) with one micro-batch's target (the labels)")
        if not isinstance(self.keep_output, bool):
            raise TypeError(f"keep_output must be True or False (does the loop hold the model output "
                            f"through backward?), got {self.keep_output!r}")

    def loss_closure_tensors(self, model: torch.nn.Module | None = None) -> list[torch.Tensor]:
        """The tensors ``loss_fn`` closes over (its closure cells, the module globals it names, its
        default arguments, a ``functools.partial``'s arguments, and the tensors of a list, tuple or
        dict held there) that are neither in ``inputs`` nor ``model``'s parameters or buffers: a
        classifier's labels. The loop holds them through the step, so traces and measurements count them as
        resident, as a GPU's allocator does (they were allocated before the step)."""
        fn, found = self.loss_fn, []
        if fn is None:
            return found
        values = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_full(c)]
        values += list(getattr(fn, "__defaults__", None) or ()) + list((getattr(fn, "__kwdefaults__", None) or {}).values())
        code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
        values += [names[n] for n in (code.co_names if code is not None else ()) if n in names]
        if isinstance(fn, functools.partial):
            values += [*fn.args, *fn.keywords.values()]
        for v in values:
            for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)):
                if type(t) is torch.Tensor and t.layout == torch.strided:  # a plain tensor, not a parameter
                    found.append(t)
        own = [t for t in tree_flatten(self.inputs)[0] if isinstance(t, torch.Tensor)]
        if model is not None:
            own += [*model.parameters(), *model.buffers()]
        known = {_storage_key(t) for t in own}
        out, seen = [], set()
        for t in found:
            key = _storage_key(t)
            if key not in known and key not in seen:
                seen.add(key)
                out.append(t)
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors of ``held``: tensors as given, modules' parameters, gradients and buffers."""
        found: list[torch.Tensor] = []
        for h in self.held:
            if isinstance(h, torch.nn.Module):
                for p in h.parameters():
                    found += [p] + ([p.grad] if p.grad is not None else [])
                found += list(h.buffers())
            else:
                found.append(h)
        return found

    @property
    def grads_alive_at_start(self) -> bool:
        """Whether the binding micro-batch starts with every gradient allocated: the loop keeps
        them (``ZeroGrad.ZERO``), or a micro-batch after the first accumulates into them."""
        return self.zero_grad is ZeroGrad.ZERO or self.micro_batches > 1

    def check_target(self, spec: "DeviceSpec") -> None:
        """Raise if the target cannot run this step (an autocast dtype it has no kernels for)."""
        dt = self.autocast_dtype
        if dt is not None and dt not in spec.peak_flops_per_s:
            can = [str(d).replace("torch.", "") for d in AUTOCAST_DTYPES if d in spec.peak_flops_per_s]
            raise ValueError(
                f"autocast_dtype={str(dt).replace('torch.', '')} cannot run on the target {spec.name!r} "
                f"(its DeviceSpec lists no {str(dt).replace('torch.', '')} compute); "
                + (f"use autocast_dtype=torch.{can[0]}" if can else "drop autocast_dtype")
                + " or plan for another device"
            )

    def describe(self) -> str:
        """One line for a plan's notes."""
        opt = self.optimizer
        name = opt if isinstance(opt, str) or opt is None else getattr(opt, "__name__", type(opt).__name__)
        name = "a factory function" if name == "<lambda>" else name
        amp = str(self.autocast_dtype).replace("torch.", "") if self.autocast_dtype else "off"
        return (
            f"step: optimizer {name}, {self.micro_batches} micro-batch(es), zero_grad "
            f"{self.zero_grad.value}, autocast {amp}" + (", output kept through backward" if self.keep_output else "")
            + (f", {len(self.held)} held object(s) ({_held_bytes(self):,} B) resident" if self.held else "")
            + {None: "", True: ", every module in train mode", False: ", training flags as they are"}[self.train_mode]
            + (f", each micro-batch in {_name_of(self.context)}" if self.context is not None else "")
        )


def _name_of(fn: Any) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    return "a context function" if name == "<lambda>" else f"{name}()"


def _check_held(held: Any) -> tuple:
    if held is None:
        return ()
    items = tuple(held) if isinstance(held, (list, tuple)) else (held,)
    for i, h in enumerate(items):
        if not isinstance(h, (torch.Tensor, torch.nn.Module)):
            raise TypeError(
                f"held[{i}] must be a tensor or an nn.Module the loop keeps alive through the step "
                f"(e.g. an EMA copy of the model), got {type(h).__name__}"
            )
    return items


def _held_bytes(step: TrainStep) -> int:
    seen: dict[int, int] = {}
    for t in step.held_tensors():
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            continue
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """A tensor, a tuple/list of positional args, or a dict of kwargs -> (args, kwargs)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _autocast(model: torch.nn.Module, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    p = next(model.parameters(), None)
    device_type = p.device.type if p is not None and p.device.type != "meta" else "cpu"
    return torch.autocast(device_type, dtype=dtype)


def _cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def _storage_key(t: torch.Tensor) -> int | None:
    """Which storage ``t`` views (by the storage object's identity); None for tensors without
    one (sparse, wrapper subclasses)."""
    try:
        return id(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _check_loss_signature(loss_fn: Any) -> None:
    """``loss_fn`` is called as ``loss_fn(output, inputs)``: say so before a step fails on it."""
    import inspect

    if loss_fn is None:
        return
    try:
        # Not through __wrapped__: an adapter made with functools.wraps takes what it takes.
        sig = inspect.signature(loss_fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        sig.bind(None, None)
    except TypeError as e:
        raise TypeError(
            f"loss_fn is called as loss_fn(output, inputs) (the model's output and the batch it "
            f"was given) but takes {sig}: {e}; e.g. loss_fn=lambda out, inputs: out.logits.mean()"
        ) from None


def trains_in_train_mode(model: torch.nn.Module, train_mode: bool | None) -> bool:
    """Whether the step switches ``model`` to train mode (see ``TrainStep.train_mode``)."""
    return bool(train_mode) or (train_mode is None and not model.training)


@contextlib.contextmanager
def step_mode(model: torch.nn.Module, train_mode: bool | None):
    """The modules' training flags for the step (``TrainStep.train_mode``), each put back after:
    the root through its own ``train()`` (an override may do more than set flags, e.g. a LoRA
    layer's merge on ``eval()``), then every module's flag as it was."""
    if not trains_in_train_mode(model, train_mode):
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        yield
    finally:
        model.train(flags[0][1])
        for m, flag in flags:
            m.training = flag


def mode_changes(model: torch.nn.Module, train_mode: bool | None) -> int:
    """How many modules' flags ``step_mode`` switches."""
    if not trains_in_train_mode(model, train_mode):
        return 0
    return sum(1 for m in model.modules() if not m.training)


def run_step(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    on_phase: Callable[[Phase], None] | None = None,
    *,
    micro_batches: int = 1,
    passes: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    keep_output: bool = False,
    held_output: list | None = None,
    context: Callable[[], ContextManager] | None = None,
) -> float | None:
    """Run one optimizer step (``passes`` forward/backward passes, default ``micro_batches``; a
    trace runs one), each loss divided by ``micro_batches``; returns the last loss value when it
    can be read (None under fake tensors). ``keep_output``: see ``TrainStep.keep_output``.

    ``held_output``: a one-element list standing for the loop's ``out`` variable across steps
    (with ``keep_output``): the previous step's output in it is held until this step's first
    forward returns, and this step's last output is left in it."""
    check_batch(inputs)
    args, kwargs = split_inputs(inputs)
    value = None
    held = held_output[0] if held_output else None  # the output a keep_output loop still references
    if held_output:
        held_output[0] = None
    for _ in range(micro_batches if passes is None else passes):
        with context() if context is not None else contextlib.nullcontext():
            if on_phase:
                on_phase(Phase.FW)
            with _autocast(model, autocast_dtype):
                try:
                    out = model(*args, **kwargs)
                except Exception as e:
                    if type(e).__name__ == "FakeKernelError":
                        raise  # says itself which op failed and what to do
                    raise StepError(_forward_hint(model, e, kwargs)) from e
                held = out if keep_output else None  # `out = model(...)` lets go of the previous output
                with values_read_in("the loss function"), in_the_loss(out, inputs):
                    loss = loss_fn(out, inputs) if loss_fn is not None else _default_loss(out)
                _check_loss(loss)
                del out
                if micro_batches > 1:
                    loss = loss / micro_batches
            if on_phase:
                on_phase(Phase.BW)
            with values_read_in("the backward (a backward hook or a custom autograd Function)"):
                loss.backward()
        value = _value(loss)
        del loss
    if optimizer is not None:
        if on_phase:
            on_phase(Phase.OPTIM)
        with values_read_in(f"the optimizer step ({type(optimizer).__name__})"):
            optimizer.step()
    if held_output is not None and keep_output:
        held_output[0] = held  # the loop's `out` outlives the step, into the next one's forward
    del held  # the loop lets go of the last output only after the optimizer step
    return value


def zero_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, how: ZeroGrad) -> None:
    """What the loop does after the optimizer step."""
    set_to_none = how is ZeroGrad.SET_TO_NONE
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=set_to_none)
    else:
        model.zero_grad(set_to_none=set_to_none)


def _value(loss: torch.Tensor) -> float | None:
    from torch._subclasses.fake_tensor import FakeTensor

    loss = _local_loss(loss)
    if isinstance(loss, FakeTensor) or loss.device.type == "meta":
        return None
    with torch._C._DisableTorchDispatch():  # reading the value is not part of the traced step
        return float(loss.detach())


def _local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's loss: a DTensor's local value (``loss_parallel`` returns a
    replicated DTensor), an AsyncCollectiveTensor's waited result."""
    if type(loss) is torch.Tensor or not hasattr(type(loss), "__tensor_flatten__"):
        return loss
    to_local = getattr(loss, "to_local", None)
    loss = to_local() if callable(to_local) else loss
    wait = getattr(loss, "wait", None)
    return wait() if callable(wait) else loss


def _check_loss(loss: Any) -> None:
    """A loss a step can train on: a real scalar that requires grad and, where it has a value
    (real tensors: a real-mode trace, ``measure_steps``, ``check_gradients``), is finite. A NaN
    or infinite loss trains nothing, and gradients compared against it say nothing ("bitwise
    equal, max diff nan"); a fake trace cannot see values, so the real runs catch it."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise StepError(
            f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) "
            "or pass loss_fn=lambda output, inputs: ... returning a scalar"
        )
    if loss.is_complex():
        raise StepError(
            f"the loss is complex ({str(loss.dtype).replace('torch.', '')}); backward needs a real "
            "scalar: return a real one from the loss (e.g. loss.abs() or loss.real)"
        )
    if not loss.requires_grad:
        raise StepError(
            "the loss does not require grad: no parameter took part in it "
            "(is the model in no_grad / are all parameters frozen?)"
        )
    value = _value(loss)
    if value is not None and not math.isfinite(value) and not _collectives_are_fake():
        raise StepError(
            f"the loss is {value}: a step on it trains nothing and its gradients "
            "mean nothing; check the batch (token ids within the vocabulary and >= 0, no NaN or "
            "inf in the data, labels the loss accepts) and the loss function"
        )


def _collectives_are_fake() -> bool:
    """The default process group is torch's fake one (``planner.distributed.fake_world``): its
    collectives move no data, so a loss computed through them (``loss_parallel``'s reductions)
    has no meaningful value, only its shape and its memory."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def check_batch(inputs: Any) -> None:
    """Refuse a batch with no rows: every tensor in it is empty along its first dimension (a
    loss over it is NaN, and a fake trace, which sees shapes only, would plan it)."""
    tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if tensors and all(t.shape[0] == 0 for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors[:3])
        raise StepError(f"the batch has no rows (tensors of shape {shapes}); plan with a batch "
                        "of the size the loop trains on")


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.sum()
    loss = getattr(out, "loss", None)  # HF ModelOutput: the model computed its loss (labels given)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if len(tensors) == 1:
        return tensors[0].sum()
    raise StepError(
        f"the model returned {type(out).__name__} with {len(tensors)} tensors; "
        "pass loss_fn=lambda output, inputs: <scalar> to say how the loss is computed"
    )


_REAL_MODE = ("trace in real mode: solve_sac(..., options=PlanOptions(trace=EstimateOptions(mode=TraceMode.REAL))) "
              "(estimators.tracing.estimation), --mode real on the command line")


def _reads_values(e: Exception) -> bool:
    """A fake-mode trace met code that needs a tensor's value (``.item()``, ``nonzero``)."""
    name = type(e).__name__
    return "DataDependent" in name or "DynamicOutputShape" in name or "data-dependent" in str(e).lower()


@contextlib.contextmanager
def values_read_in(where: str):
    """Only the forward's errors were explained; a ``.item()`` in a backward hook (gradient-norm
    logging), the loss or the optimizer surfaced as torch's bare DataDependentOutputException."""
    try:
        yield
    except Exception as e:
        if not _reads_values(e):
            raise
        raise StepError(f"{where} raised {type(e).__name__}: {e} — it reads tensor values (.item(), "
                        f"data-dependent shapes), which fake tensors do not have; {_REAL_MODE}") from e


def _forward_hint(model: torch.nn.Module, e: Exception, kwargs: dict | None = None) -> str:
    name = type(e).__name__
    if _reads_values(e):
        # Before the encoder-decoder hint: a time-series model (no labels argument) that reads a
        # value was told to pass labels.
        hint = f"the forward reads tensor values (.item(), data-dependent shapes); {_REAL_MODE}"
        drop = _layerdrop_of(model)
        if drop:
            hint += (f". LayerDrop is on ({drop}): it reads a draw of torch's RNG, and a real-mode "
                     "trace follows that one draw; set it to 0.0 while planning to count every layer")
    elif "does not have a sharding strategy registered" in str(e):
        hint = ("DTensor has no rule for this op here; context parallel's ring attention covers only the "
                "CUDA attention kernels (flash / efficient / cuDNN), so a context-parallel step traces "
                "only for a CUDA target: plan with device='h100' (or another CUDA DeviceSpec)")
    else:
        hint = (_encoder_decoder_hint(model, kwargs or {})
                or "check that the inputs match the model's forward signature; if the model alone "
                   "raises this on them (model(**inputs)), its config or code is at fault, not the planner")
    return f"{type(model).__name__}.forward raised {name}: {e} — {hint}"


def _layerdrop_of(model: torch.nn.Module) -> str:
    """An HF model's non-zero LayerDrop rates (``config.layerdrop = 0.1, ...``); "" if none."""
    config = getattr(model, "config", None)
    rates = [(name, getattr(config, name, 0.0)) for name in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")]
    return ", ".join(f"config.{name} = {rate}" for name, rate in rates
                     if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0)


def _encoder_decoder_hint(model: torch.nn.Module, kwargs: dict) -> str:
    """What an HF encoder-decoder (T5, BART, ...) lacks to run its decoder; "" if nothing.

    Without ``decoder_input_ids`` it builds them from ``labels``, shifted right behind
    ``config.decoder_start_token_id``; a config built without that token (``T5Config()`` in
    transformers 5 has no such attribute) failed with T5's AttributeError or BART's "can't
    assign a NoneType to a torch.LongTensor", and the hint said to check the inputs' signature."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or {"decoder_input_ids", "decoder_inputs_embeds"} & set(kwargs):
        return ""
    if "labels" not in kwargs:
        return ("an encoder-decoder model needs inputs for its decoder: pass labels (it builds its "
                "decoder inputs from them; the output then has a loss) or decoder_input_ids")
    if getattr(config, "decoder_start_token_id", None) is not None:
        return ""
    # The token differs by family: T5's decoder starts from its pad token, BART's from its eos.
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    if "t5" in str(getattr(config, "model_type", "")) and pad is not None:
        start = f"model.config.decoder_start_token_id = {pad} (its pad_token_id, as T5 starts)"
    elif eos is not None:
        start = (f"model.config.decoder_start_token_id to the token its decoder starts from (BART's is "
                 f"its eos_token_id, {eos}; T5's its pad_token_id)")
    else:
        start = "model.config.decoder_start_token_id to the token its decoder starts from"
    return (f"{type(model).__name__} builds its decoder inputs by shifting labels right behind "
            f"config.decoder_start_token_id, which its config does not set ({type(config).__name__}"
            f"(..., decoder_start_token_id=...) was not given one): set {start}, or pass "
            "decoder_input_ids with the inputs")
