"""The user's model called during a fake trace, which runs a copy of it: refused where it would
train outside the trace, let through (its buffers put back) where it only reads."""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["refuse_calls_of"]


def refuse_calls_of(model: torch.nn.Module, error: Callable[[str], Exception]) -> Callable[[], None]:
    """Forward pre-hooks on the user's modules, for the step's calls outside the traced copy:
    one that holds parameters is refused before its forward runs with grad on (its gradients and
    optimizer state would be the user's, not the copy's, and missing from the trace); under
    no_grad it runs, its parameters counted as the step's inputs (FixMatch's pseudo-label
    forward: counted high, where a refusal would leave no plan at all). One that holds only
    buffers runs as the copy's would (``CrossEntropyLoss(weight=...)`` kept on the model, a plain
    criterion), its buffers put back afterwards (a no-grad forward of a BatchNorm counts a batch
    into its statistics). Other threads' calls pass: the hooks are on the user's model, which
    another thread may train meanwhile. ``error(what)`` is the exception a refusal raises.
    Returns the removal of the hooks."""
    names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    tracing = threading.get_ident()

    def refuse(module, args):
        if threading.get_ident() != tracing or not torch.is_grad_enabled():  # another thread's, or a
            return keep_buffers(module, args)  # no-grad forward (FixMatch's pseudo-labels): inputs (high)
        raise error(f"calls {names[id(module)]} of the model itself, from loss_fn, a hook, or a "
                    "reference the model's code keeps to itself (deepcopy shares functions and their closures)")

    def keep_buffers(module, _args):
        if id(module) not in kept and threading.get_ident() == tracing:
            with torch.no_grad(), unset_fake_temporarily():
                kept[id(module)] = [(b, b.detach().clone()) for b in module.buffers()]

    hooks = []
    for m in model.modules():
        if next(m.parameters(), None) is not None:
            hooks.append(m.register_forward_pre_hook(refuse))
        elif next(m.buffers(), None) is not None:
            hooks.append(m.register_forward_pre_hook(keep_buffers))

    def remove() -> None:
        for h in hooks:
            h.remove()
        with torch.no_grad(), unset_fake_temporarily():
            for pairs in kept.values():
                for b, value in pairs:
                    b.copy_(value)

    return remove
