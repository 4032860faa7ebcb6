"""The hot path of the step tracer: an op's tensors and a fake tensor's device, cheaply, and the
base of the dispatch modes on that path.

The tracer runs for every aten op of a step; what it asks of each op's arguments is here, written
for the shapes aten schemas take (tensors nested in tuples, lists and the kwargs dict), not
pytree's general ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import _guards
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PRIM_DEVICE", "HotPathMode", "active_fake_mode", "fake_device", "op_tensors"]

PRIM_DEVICE = torch.ops.prim.device.default
"""The query C++ makes of a fake tensor's device for nearly every op (the autograd engine,
``_foreach`` grouping)."""


_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE


class HotPathMode(TorchDispatchMode):
    """A dispatch mode every op of a traced step goes through. torch wraps a mode's
    ``__torch_dispatch__`` in ``_disable_dynamo`` (a cost on each call) unless
    ``_should_skip_dynamo`` says False; the traced step runs with compiled code eager in its
    thread (``thread_state.eager_in_this_thread``, entered by ``estimation._trace_step``), so no
    frame below it is compiled anyway."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def fake_device(t: Any) -> torch.device | None:
    """What ``FakeTensor`` answers to ``prim.device`` (None for other tensors)."""
    mode = getattr(t, "fake_mode", None)
    if mode is None or not isinstance(t, FakeTensor):
        return None
    return torch.device("meta") if mode.in_kernel_invocation else t.fake_device


def active_fake_mode(expected: Any) -> Any:
    """``torch._guards.active_fake_mode()`` (the innermost FakeTensorMode on the dispatch mode
    stack), read from the mode stack when it holds only ``expected`` (a fake trace's mode, or
    None: nothing), as it does below the tracer; asked of torch otherwise."""
    fake = torch._C._get_dispatch_mode(_FAKE_KEY)
    if fake is expected and torch._C._len_torch_dispatch_stack() == (fake is not None):
        return fake
    return _guards.active_fake_mode()


def op_tensors(args: Any, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors of an aten op's arguments (or outputs), in pytree's order: an op's schema
    nests them in tuples, lists and the kwargs dict only (a faster ``tree_flatten``)."""
    out: list[torch.Tensor] = []
    _collect(args, out)
    if kwargs:
        _collect(kwargs.values(), out)
    return out


def _collect(items: Any, out: list) -> None:
    # Not a closure: a recursive one is a reference cycle that kept ``out``'s tensors alive
    # until the garbage collector ran, and the trace saw them freed late.
    for x in items:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif type(x) in (tuple, list):
            _collect(x, out)
        elif type(x) is dict:
            _collect(x.values(), out)
