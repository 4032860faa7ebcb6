"""The training step a plan was made for, held without holding its memory.

A plan lives as long as the run that applies it (the framework integrations keep ``.plan`` for
the whole fit), so it must not keep the planning batch alive: on a GPU that is device memory the
prediction does not count. ``StepRef`` keeps what describes the step (loss, autocast, flags) and
only weak references to what holds memory (the batch, the target, the held tensors and modules,
an optimizer instance): ``get()`` gives the step back while the caller still holds those, None
once they are gone.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from estimators.step.train_step import TrainStep

__all__ = ["StepRef"]

_MEMORY_FIELDS = ("inputs", "target", "held")


class _Strong:
    """A leaf that cannot be (or need not be) referenced weakly: a number, a string, None."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


_GONE = object()


def _ref(x: Any) -> Any:
    if isinstance(x, (bool, int, float, complex, str, bytes, type(None))):
        return _Strong(x)
    try:
        ref = weakref.ref(x)
    except TypeError:  # not weakly referable (a tuple subclass, a slotted object): nothing to free
        return _Strong(x)
    return lambda: _GONE if (v := ref()) is None else v


class StepRef:
    """A ``TrainStep`` without its memory: the step object itself weakly, the fields that hold no
    tensors (``loss_fn``, ``context``, dtypes, flags) strongly, and every leaf of ``inputs``,
    ``target`` and ``held`` and an optimizer instance weakly. What ``loss_fn`` closes over is the
    caller's code and stays as the caller made it."""

    __slots__ = ("_step", "_fields", "_leaves", "_spec")

    def __init__(self, step: TrainStep) -> None:
        self._step = weakref.ref(step)
        fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        memory = {name: fields.pop(name) for name in _MEMORY_FIELDS}
        if isinstance(fields["optimizer"], torch.optim.Optimizer):
            memory["optimizer"] = fields.pop("optimizer")
        leaves, self._spec = tree_flatten(memory)
        self._leaves = tuple(_ref(x) for x in leaves)
        self._fields = fields

    def get(self) -> TrainStep | None:
        """The step, or None where a tensor, module or optimizer it names was freed."""
        step = self._step()
        if step is not None:
            return step
        leaves = [ref() for ref in self._leaves]
        if any(x is _GONE for x in leaves):
            return None
        step = TrainStep(**self._fields, **tree_unflatten(leaves, self._spec))
        self._step = weakref.ref(step)
        return step

