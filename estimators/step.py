"""The training step every trace and measurement runs, so all of them count the same tensors.

    out = model(*args, **kwargs)
    loss = loss_fn(out, inputs)            # default: out.sum()
    del out                                # a loop that keeps only the loss
    loss.backward()
    optimizer.step()                       # when given
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Phase", "StepError", "split_inputs", "run_step"]


class Phase(enum.IntEnum):
    FW = 0  # model forward and the loss
    BW = 1
    OPTIM = 2


class StepError(RuntimeError):
    """The step could not run; the message says what to change."""


LossFn = Callable[[Any, Any], torch.Tensor]


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """A tensor, a tuple/list of positional args, or a dict of kwargs -> (args, kwargs)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def run_step(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    on_phase: Callable[[Phase], None] | None = None,
) -> float | None:
    """Run one step; returns the loss value when it can be read (None under fake tensors)."""
    args, kwargs = split_inputs(inputs)
    if on_phase:
        on_phase(Phase.FW)
    try:
        out = model(*args, **kwargs)
    except Exception as e:
        raise StepError(_forward_hint(model, e)) from e
    loss = loss_fn(out, inputs) if loss_fn is not None else _default_loss(out)
    _check_loss(loss)
    del out
    if on_phase:
        on_phase(Phase.BW)
    loss.backward()
    value = _value(loss)
    del loss
    if optimizer is not None:
        if on_phase:
            on_phase(Phase.OPTIM)
        optimizer.step()
    return value


def _value(loss: torch.Tensor) -> float | None:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(loss, FakeTensor) or loss.device.type == "meta":
        return None
    with torch._C._DisableTorchDispatch():  # reading the value is not part of the traced step
        return float(loss.detach())


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise StepError(
            f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) "
            "or pass loss_fn=lambda output, inputs: ... returning a scalar"
        )
    if not loss.requires_grad:
        raise StepError(
            "the loss does not require grad: no parameter took part in it "
            "(is the model in no_grad / are all parameters frozen?)"
        )


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


def _forward_hint(model: torch.nn.Module, e: Exception) -> str:
    name = type(e).__name__
    hint = "check that inputs match the model's forward signature"
    if "DataDependent" in name or "data-dependent" in str(e).lower():
        hint = "the forward reads tensor values (.item(), data-dependent shapes); trace in real mode"
    return f"{type(model).__name__}.forward raised {name}: {e} — {hint}"
