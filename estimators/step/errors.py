"""The errors of the step a trace or measurement runs, and the loss's own explained."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["StepError", "in_the_loss"]


class StepError(RuntimeError):
    """The step could not run; the message says what to change."""


@contextlib.contextmanager
def in_the_loss(out: Any, inputs: Any):
    """A loss that looks up what is not there (``inputs[1]`` of a one-tensor batch,
    ``out["logits"]`` of a tensor) raised a bare IndexError / KeyError that did not say it came
    from the loss: said, with what the loss was given."""
    try:
        yield
    except (IndexError, KeyError, AttributeError) as e:
        raise StepError(f"the loss function raised {type(e).__name__}: {e} — it is called as loss_fn(output, "
                        f"inputs), output being what the model returned ({_shape_of(out)}) and inputs the batch "
                        f"as given ({_shape_of(inputs)})") from e


def _shape_of(x: Any) -> str:
    """``float32[8, 4]``, ``tuple of 1: (float32[8, 16])``, ``dict: input_ids, labels``."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
    if isinstance(x, dict) or hasattr(x, "keys"):
        return f"{type(x).__name__}: {', '.join(map(str, list(x.keys())[:8]))}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_shape_of(y) for y in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"{type(x).__name__} of {len(x)}: ({inner})"
    return type(x).__name__
