"""The leaves outside the model that a traced step's backward reaches, and their ``.grad`` put back.

Another module the loss runs (a GAN's discriminator in the generator's step) has leaves that
require grad; the trace's backward accumulates into them (fake tensors in a fake trace; in a real
trace the user's next real step would train on them). :class:`ForeignLeaves` notes each such leaf
the first time an op reads it (by weak reference: a strong one kept the step's own leaves alive,
and the trace counted them longer), with the ``.grad`` it had and, in a real trace (whose backward
adds into it in place), a copy of its values; :meth:`ForeignLeaves.restore` puts them back.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["ForeignLeaves"]


class ForeignLeaves:
    """Leaves other than ``own`` (ids of the model's parameters) that the step's ops read."""

    def __init__(self, own: set[int], *, real: bool) -> None:
        self._own, self._real = own, real
        self._seen: dict[int, tuple[weakref.ref, torch.Tensor | None, torch.Tensor | None]] = {}

    def note(self, flat: list) -> None:
        """Note the leaves among ``flat`` (an op's arguments) that an op reads with grad on."""
        if not torch.is_grad_enabled():  # under no_grad nothing accumulates into them
            return
        for t in flat:
            if (isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and id(t) not in self._own
                    and id(t) not in self._seen):
                grad = t.grad
                values = grad.detach().clone() if grad is not None and self._real else None
                self._seen[id(t)] = (weakref.ref(t), grad, values)

    def alive(self) -> list[torch.Tensor]:
        """The noted leaves still alive."""
        return [t for t in (ref() for ref, _, _ in self._seen.values()) if t is not None]

    def restore(self) -> None:
        """Put back each noted leaf's ``.grad`` as it was before the step, then forget them."""
        for ref, grad, values in self._seen.values():
            t = ref()
            if t is None:
                continue
            if values is not None:
                with torch.no_grad():
                    grad.copy_(values)
            t.grad = grad
        self._seen.clear()
