"""How a planned module's recompute gets the state its forward had: the function handed to
``checkpoint`` (``StateKeeper``) notes what the forward changed -- buffers mutated in place,
rebound, registered or deleted; Python's and numpy's random states; containers and repeated
tensors among its arguments -- and gives the recompute the forward's start, then puts back what
the step has since. ``planner.applying.planned_forward`` builds on it; the module docstring there says
why a recompute must see exactly what the forward saw."""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch

from estimators.step.host_rng import HostRng
from planner.applying import offload

__all__ = ["Bookkeeping", "StateKeeper", "in_bookkeeping"]

_bookkeeping = threading.local()  # ops of our own state handling: not part of the module's ops


def in_bookkeeping() -> bool:
    return getattr(_bookkeeping, "on", False)


class Bookkeeping:
    def __enter__(self):
        self.prev = in_bookkeeping()
        _bookkeeping.on = True

    def __exit__(self, *exc):
        _bookkeeping.on = self.prev



class StateKeeper:
    """The function handed to ``checkpoint``: first call is the forward, later ones recomputes.

    The forward notes which buffers it mutates in place (by version counter, plus BatchNorm's
    running statistics, see :func:`_silently_mutated`) and which it rebinds (``self.mu = ...``);
    a recompute copies the mutated ones at its entry, starts from the values (and the tensors)
    the forward started from and puts back at its exit what the step had since. So
    BatchNorm statistics change once per step, as without a plan, the recompute computes the
    forward's output, and a module nested in a planned one (re-run by the outer recompute) is
    restored the same way. Held between forward and backward: the start values of the buffers
    the forward mutated, BatchNorm's statistics excepted, and Python's / numpy's random states
    where the forward drew from them (:mod:`estimators.step.host_rng`: the recompute replays those
    draws, as torch's checkpoint does for torch's generators). And which positional arguments
    were one tensor (``_same_tensor_links``) and the lists, tuples and dicts it was given
    (``_container_copies``): the recompute gets them as the forward got them."""

    def __init__(self, module: torch.nn.Module, forward: Callable) -> None:
        self.module = module
        self.forward = forward
        self.calls = 0
        self.links: list[tuple[int, int | str]] = []
        self.containers: dict[int | str, Any] = {}
        self.mutated: list[torch.Tensor] = []
        self.at_forward: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rebound: list[tuple[dict, str, Any]] = []
        self.host_rng = HostRng()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)  # the compiled graph replays state ops itself
        if self.calls == 1:
            self.links = _same_tensor_links(args, kwargs)
            self.containers = _container_copies(args, kwargs)
            bufs = list(self.module.buffers())
            tables = [m._buffers for m in self.module.modules()]
            slots = [(d, dict(d)) for d in tables]
            versions = [b._version for b in bufs]
            quiet = _silently_mutated(self.module)
            # A buffer the forward mutates and reads (spectral norm's power-iteration vectors)
            # must be what it was at the forward's start when the recompute reads it, or the
            # recompute computes another output (a full checkpoint of a spectral-norm conv gave
            # gradients 8.5e-4 off). Copies are kept only of buffers that were mutated; BatchNorm's
            # running statistics do not feed its training-mode output.
            unread = _batchnorm_statistics(self.module)
            with Bookkeeping(), torch.no_grad():
                start = [None if id(b) in unread else b.detach().clone() for b in bufs]
            with self.host_rng.forward(self.module):
                out = self.forward(*args, **kwargs)
            self.mutated = [b for b, v in zip(bufs, versions) if b._version != v or id(b) in quiet]
            self.at_forward = [(b, c) for b, v, c in zip(bufs, versions, start)
                               if c is not None and b._version != v]
            # Buffers the forward rebinds (``self.mu = 0.9 * self.mu + ...``), registers or
            # deletes rather than mutates: the recompute must see the buffers the forward started
            # from (a reassigned running mean read after its update: gradients 3.26 off, and the
            # counter beside it stepped twice). The start tensors are held until the backward,
            # which costs their bytes where the unplanned step frees them (the traced peak
            # counts them).
            self.rebound = [(d, name, at_start.get(name, _ABSENT)) for d, at_start in slots
                            for name in {*at_start, *d} if d.get(name, _ABSENT) is not at_start.get(name, _ABSENT)]
            return out
        if self.links or self.containers:
            args, kwargs = list(args), dict(kwargs)
            for i, src in self.links:
                args[i] = kwargs[src] if isinstance(src, str) else args[src]
            for k, copied in self.containers.items():
                if isinstance(k, str):
                    kwargs[k] = copied
                else:
                    args[k] = copied
        with Bookkeeping(), torch.no_grad():
            before = [(b, b.detach().clone()) for b in self.mutated]
            for b, value in self.at_forward:
                b.data.copy_(value)
        bound_now = [(d, name, d.get(name, _ABSENT)) for d, name, _ in self.rebound]
        _bind(self.rebound)
        try:
            with offload.recompute_scope(), self.host_rng.recompute():
                return self.forward(*args, **kwargs)
        finally:
            with Bookkeeping(), torch.no_grad():
                for b, value in before:
                    # Through .data: no version bump, so tensors the recompute saved stay valid.
                    b.data.copy_(value)
            _bind(bound_now)  # what the step bound since the forward stays bound


_ABSENT = object()
"""A buffer name not in its module's table (deleted, or not registered yet)."""


def _bind(slots: list[tuple[dict, str, Any]]) -> None:
    """Put each buffer table entry as given; ``_ABSENT`` removes it."""
    for d, name, value in slots:
        if value is _ABSENT:
            d.pop(name, None)
        else:
            d[name] = value


def _container_copies(args: tuple, kwargs: dict) -> dict[int | str, Any]:
    """Lists, tuples and dicts among the arguments, copied (their tensors shared) as the forward
    got them: the recompute gets these. torch's checkpoint hands the recompute the caller's own
    objects, and a caller may add to them after the call: DenseNet (torchvision) passes its
    growing list of feature maps to each layer and appends the layer's output, so the recompute
    concatenated one map more ("running_mean should contain 30 elements not 24")."""
    out: dict[int | str, Any] = {i: _copied(a) for i, a in enumerate(args) if _mutable_inside(a)}
    out.update({k: _copied(v) for k, v in kwargs.items() if _mutable_inside(v)})
    return out


def _mutable_inside(v: Any) -> bool:
    """A list or dict, or a plain tuple holding one (``torch.Size`` and other tuples of values
    stay as they are: a copy through pytree made a Size a plain tuple)."""
    if isinstance(v, (list, dict)):
        return True
    return type(v) is tuple and any(_mutable_inside(e) for e in v)


def _copied(v: Any) -> Any:
    """``v`` with its lists and dicts copied (their subclasses too), everything else shared."""
    if isinstance(v, list):
        c = copy.copy(v)
        c[:] = [_copied(e) for e in v]
        return c
    if isinstance(v, dict):
        c = copy.copy(v)
        c.update({k: _copied(e) for k, e in v.items()})
        return c
    if type(v) is tuple:
        return tuple(_copied(e) for e in v)
    return v


def _same_tensor_links(args: tuple, kwargs: dict) -> list[tuple[int, int | str]]:
    """(position, first position or keyword of the same tensor object) for every positional
    tensor argument passed twice. torch's checkpoint saves positional tensors one by one and,
    where saved-tensor hooks are active (torch's own ``save_on_cpu``, the planner's trace), hands
    the recompute a new tensor object for each: ``nn.MultiheadAttention`` called as
    ``attn(x, x, x)`` then saw ``query is key`` false and ran three projections where the
    forward ran one packed projection (a CheckpointError in the planning trace of every
    ``nn.TransformerEncoderLayer`` whose ``self_attn`` was planned)."""
    first: dict[int, int | str] = {id(v): k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    links = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            src = first.setdefault(id(a), i)
            if src != i:
                links.append((i, src))
    return links


def _batchnorm_statistics(module: torch.nn.Module) -> set[int]:
    """Buffers of training-mode batch norms: updated by the forward, never read for its output."""
    from torch.nn.modules.batchnorm import _NormBase

    return {
        id(b)
        for m in module.modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats
        for b in (m.running_mean, m.running_var, m.num_batches_tracked)
        if b is not None
    }


def _silently_mutated(module: torch.nn.Module) -> set[int]:
    """Buffers mutated without a version bump: ``native_batch_norm`` updates the running
    statistics in place but its schema does not mark them as written."""
    from torch.nn.modules.batchnorm import _NormBase

    return {
        id(b)
        for m in module.modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats
        for b in (m.running_mean, m.running_var)
        if b is not None
    }
