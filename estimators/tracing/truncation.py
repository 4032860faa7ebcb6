"""The truncated fake copy of a model with stacks, and what its trace needs to stand for the full one.

* :func:`truncate_in_memo` makes ``copy.deepcopy(model, memo)`` build each stack's container with
  its four traced children only (``Stack.traced_keys``), under their own names: the skipped
  blocks are never copied, so their parameters never become fake tensors, get no optimizer state
  and run no op.
* :func:`pre_step_owners` names the traced block that owns each storage the step starts with:
  its parameters, their gradients and optimizer state, its buffers (one shared by several blocks
  belongs to none).
* :class:`FullListsRuntime` prices an optimizer ``_foreach`` op over the lists the full model
  would give it: each stack's block-2 tensors stand in once more for every skipped block, so the
  op's runtime is the full step's (the trace's op then gets the copies' tensors in its lists,
  ``estimators.tracing.replicate``).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from estimators.contract.module_info import Phase
from estimators.tracing.stacks import Stack
from estimators.tracing.subclasses import storage_of

__all__ = ["truncate_in_memo", "skipped_param_ids", "pre_step_owners", "FullListsRuntime",
           "may_index_blocks"]


def _container(model: torch.nn.Module, stack: Stack) -> torch.nn.Module:
    return model.get_submodule(stack.container) if stack.container else model


def skipped_param_ids(model: torch.nn.Module, stacks: list[Stack]) -> set[int]:
    """ids of the parameters (and buffers) of the blocks a truncated copy leaves out."""
    out: set[int] = set()
    for st in stacks:
        container = _container(model, st)
        for key in st.skipped_keys:
            block = container._modules[key]
            out.update(id(t) for t in block.parameters())
            out.update(id(t) for t in block.buffers())
    return out


def truncate_in_memo(model: torch.nn.Module, stacks: list[Stack], memo: dict[int, Any]) -> None:
    """Put into ``memo`` a copy of each stack's container without the blocks a truncated trace
    skips (see the module docstring); ``copy.deepcopy(model, memo)`` then uses it."""
    skipped: dict[str, set[str]] = {}
    for st in stacks:
        skipped.setdefault(st.container, set()).update(st.skipped_keys)
    for name, drop in skipped.items():
        container = model.get_submodule(name) if name else model
        twin = container.__class__.__new__(container.__class__)
        memo[id(container)] = twin
        state = copy.deepcopy({k: v for k, v in vars(container).items() if k != "_modules"}, memo)
        twin.__setstate__(state)
        twin.__dict__["_modules"] = {k: copy.deepcopy(m, memo) for k, m in container._modules.items() if k not in drop}


def _block_tensors(block: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in block.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
        if optimizer is not None and p in optimizer.state:
            out += [t for t in tree_flatten(optimizer.state[p])[0] if isinstance(t, torch.Tensor)]
    out += list(block.buffers())
    return out


def pre_step_owners(sid_of: Callable[[torch.Tensor], int | None], traced: torch.nn.Module, stack: Stack,
                    optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    """Storage id -> truncated position (0..3) of the traced block that owns it before the step."""
    claims: dict[int, set[int]] = {}
    container = _container(traced, stack)
    for j, key in enumerate(stack.traced_keys):
        for t in _block_tensors(container._modules[key], optimizer):
            sid = sid_of(t)
            if sid is not None:
                claims.setdefault(sid, set()).add(j)
    return {sid: js.pop() for sid, js in claims.items() if len(js) == 1}


class FullListsRuntime:
    """A RuntimeModel that prices optimizer ``_foreach`` ops over the full model's lists (see the
    module docstring); every other op goes to ``inner`` as it is."""

    def __init__(self, inner: Any, stacks: list[Stack], traced: torch.nn.Module) -> None:
        self.inner = inner
        self.name = inner.name
        self.phase: Callable[[], Phase] = lambda: Phase.FW
        """Set by the caller to the tracer's phase."""
        self.optimizer: torch.optim.Optimizer | None = None
        self._reps = [(_container(traced, st)._modules[st.traced_keys[2]], len(st.skipped_keys)) for st in stacks]
        self._marked: list[dict[int, weakref.ref]] | None = None

    def close(self) -> None:
        """Let go of the traced model, its optimizer and the tracer (the phase's owner)."""
        self.phase, self.optimizer, self._reps, self._marked = (lambda: Phase.FW), None, [], None

    def op_runtime_ms(self, func, args, kwargs, out) -> float:
        if self.phase() is not Phase.OPTIM or not str(func).startswith("aten._foreach_"):
            return self.inner.op_runtime_ms(func, args, kwargs, out)
        if self._marked is None:  # block 2's tensors as the optimizer step finds them
            self._marked = [{} for _ in self._reps]
            for marked, (block, _) in zip(self._marked, self._reps):
                for t in _block_tensors(block, self.optimizer):
                    _mark(marked, t)
        if not any(_is_tensor_list(a) for a in args):
            return self.inner.op_runtime_ms(func, args, kwargs, out)
        args, out = list(args), list(out) if _is_tensor_list(out) else out
        for marked, (_, copies) in zip(self._marked, self._reps):
            first = next(a for a in args if _is_tensor_list(a))
            n = len(first)
            flags = [_is_marked(marked, t) for t in first]
            if isinstance(out, list) and len(out) == n:  # outputs t belong where first[t] does
                for t, f in zip(out, flags):
                    if f and isinstance(t, torch.Tensor):
                        _mark(marked, t)
            if not any(flags) or copies <= 0:
                continue
            args = [_widen(a, flags, copies) if isinstance(a, (list, tuple)) and len(a) == n else a for a in args]
            if isinstance(out, list) and len(out) == n:
                out = _widen(out, flags, copies)
        return self.inner.op_runtime_ms(func, tuple(args), kwargs, out)


def _is_tensor_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and len(a) > 0 and isinstance(a[0], torch.Tensor)


def _mark(marked: dict[int, weakref.ref], t: torch.Tensor) -> None:
    st = storage_of(t)  # a DTensor's: its local shard's, which its local _foreach op gets
    if st is not None:
        marked[id(st)] = weakref.ref(st)


def _is_marked(marked: dict[int, weakref.ref], t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    st = storage_of(t)
    ref = marked.get(id(st)) if st is not None else None
    return ref is not None and ref() is st


def _widen(items, flags: list[bool], copies: int) -> list:
    """``items`` with each maximal run of flagged items repeated ``copies`` more times after it."""
    out: list = []
    run: list = []
    for item, f in zip(items, flags):
        if f:
            run.append(item)
            continue
        if run:
            out += run * (copies + 1)
            run = []
        out.append(item)
    out += run * (copies + 1)
    return out


def may_index_blocks(e: BaseException) -> bool:
    """The error may come from the truncated model: its code looked up a block it does not hold
    (``self.layers[40]``), which the full model has."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (IndexError, KeyError)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
