"""Stacks of identical blocks, found before a fake trace so that it runs four blocks of each.

Most large models are a ``ModuleList`` (or ``Sequential``) of blocks that trace identically. A
fake trace of such a model runs only blocks ``0, 1, 2`` and the last one of each stack
(:func:`find_stacks` picks the stacks, :func:`kept_children` tells the copy what to keep); the
middle blocks are then laid into the trace as copies of block 2
(``estimators.tracing.replicate``), once blocks 1 and 2 are shown to trace alike.

A stack is a run of at least :data:`MIN_BLOCKS` consecutive children of a ``ModuleList`` or
``Sequential`` (all of them, or those after a first block that differs) that have alike:

* the same class at every submodule, the same parameter and buffer names, shapes, strides,
  dtypes and ``requires_grad``, and parameters owned by that child alone (a parameter shared
  with another block or the rest of the model is counted once in the full trace);
* the same plain attributes (numbers, strings, dtypes, tuples of them; the type of any other
  object), except integers that number the children (``layer_idx = i + c``): a Gemma-3 block whose
  ``sliding_window`` or ``attention_type`` differs from the next one's does not stack;
* the same hooks (their functions' names) on every submodule.

What the structure cannot show (code that branches on ``layer_idx`` at run time, a per-layer
value read from a shared config) shows in the trace: blocks 1 and 2 then differ and the full
model is traced instead (``estimators.tracing.replicate`` says why at DEBUG).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Stack", "find_stacks", "MIN_BLOCKS", "TRACED_POSITIONS"]

logger = logging.getLogger(__name__)

MIN_BLOCKS = 5
"""A stack shorter than this gains nothing: four of its blocks are traced anyway."""
TRACED_POSITIONS = (0, 1, 2, -1)
"""The blocks a truncated trace runs: the first (after the stack's entry), two middle ones that
are compared, and the last (before its exit)."""

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
"""torch's own bookkeeping in every module's ``__dict__`` (parameters, hooks...), compared elsewhere."""
_SIMPLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
"""Where blocks stack: torchtitan keeps its layers in a ``ModuleDict`` (keys ``"0"``...), run in order."""


@dataclass(frozen=True)
class Stack:
    """A run of identical blocks in a container; names are the model's module names."""

    container: str
    """The container's name in ``model.named_modules()`` (``"layers"``, ``"model.layers"``)."""
    keys: tuple[str, ...]
    """The run's children's keys, in order (``"0"`` ... ``"79"``)."""

    @property
    def n_blocks(self) -> int:
        return len(self.keys)

    @property
    def traced_keys(self) -> tuple[str, ...]:
        """The children a truncated trace runs, in order."""
        return tuple(self.keys[p] for p in TRACED_POSITIONS)

    @property
    def skipped_keys(self) -> tuple[str, ...]:
        """The children laid in as copies of the representative (``keys[3:-1]``)."""
        return self.keys[3:-1]

    def block_name(self, key: str) -> str:
        return f"{self.container}.{key}" if self.container else key


def find_stacks(model: torch.nn.Module) -> list[Stack]:
    """The stacks of ``model`` worth tracing once: runs of at least :data:`MIN_BLOCKS`
    consecutive identical children of a ``ModuleList`` / ``Sequential`` / ``ModuleDict`` (ResNet's stage whose
    first block downsamples has a run after it), outermost first, none inside another's blocks."""
    stacks: list[Stack] = []
    inside: list[str] = []
    owners = _param_owners(model)
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if not isinstance(mod, _CONTAINERS) or len(mod._modules) < MIN_BLOCKS:
            continue
        where = name or type(model).__name__
        for run in _identical_runs(where, mod, owners):
            if len(run) >= MIN_BLOCKS:
                stacks.append(Stack(container=name, keys=tuple(run)))
                inside.append(f"{name}." if name else "")
    return stacks


def _param_owners(model: torch.nn.Module) -> dict[int, int]:
    """How many places of ``model`` hold each parameter (a module shared by two blocks: 2)."""
    count: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    return count


def _identical_runs(where: str, container: torch.nn.Module, owners: dict[int, int]) -> list[list[str]]:
    """Maximal runs of consecutive children with one structure and the same attributes (but
    the ones that number them); each reason a run ends is said at DEBUG."""
    runs: list[list[tuple[str, torch.nn.Module]]] = []
    seen: set[int] = set()
    first: tuple | None = None  # the structure of the current run's first block
    for key, child in container._modules.items():
        fit = child is not None and id(child) not in seen and _params_own(child, owners)
        if child is not None:
            seen.add(id(child))
        if not fit:
            logger.debug("%s.%s: not a block of a stack (absent, repeated, or sharing a parameter)", where, key)
            runs.append([])
            first = None
            continue
        structure = _structure(child)
        if runs and runs[-1] and structure == first:
            runs[-1].append((key, child))
        else:
            if runs and runs[-1]:
                logger.debug("%s.%s: differs in structure from %s.%s", where, key, where, runs[-1][0][0])
            runs.append([(key, child)])
            first = structure
    out: list[list[str]] = []
    for run in runs:
        out += _split_by_attributes(where, run) if len(run) >= MIN_BLOCKS else []
    return out


def _split_by_attributes(where: str, run: list[tuple[str, torch.nn.Module]]) -> list[list[str]]:
    """``run`` cut where a plain attribute changes, numbering ones (``layer_idx``) aside."""
    attrs = [_attributes(m) for _, m in run]
    numbering = set()
    for key in set().union(*attrs):
        values = [a.get(key) for a in attrs]
        if any(v != values[0] for v in values) and _numbers_the_blocks(values):
            numbering.add(key)
    plain = [{k: v for k, v in a.items() if k not in numbering} for a in attrs]
    out: list[list[str]] = [[run[0][0]]]
    for i in range(1, len(run)):
        if plain[i] == plain[i - 1]:
            out[-1].append(run[i][0])
            continue
        key = next(k for k in {*plain[i], *plain[i - 1]} if plain[i].get(k) != plain[i - 1].get(k))
        logger.debug("%s.%s: attribute %s differs from the block before", where, run[i][0], ".".join(filter(None, key)))
        out.append([run[i][0]])
    return out


def _structure(block: torch.nn.Module) -> tuple:
    parts = []
    for sub_name, mod in block.named_modules(remove_duplicate=False):
        params = tuple(
            (n, tuple(p.shape), tuple(p.stride()), p.dtype, p.requires_grad, p.device.type, type(p))
            for n, p in mod._parameters.items() if p is not None)
        buffers = tuple(
            (n, tuple(b.shape), tuple(b.stride()), b.dtype, b.device.type)
            for n, b in mod._buffers.items() if b is not None)
        parts.append((sub_name, type(mod), params, buffers, _hooks(mod)))
    return tuple(parts)


def _params_own(block: torch.nn.Module, owners: dict[int, int]) -> bool:
    """Every parameter of ``block`` is registered once in the whole model (so in this block)."""
    return all(owners.get(id(p), 0) == 1 for _, p in block.named_parameters(remove_duplicate=False))


def _hooks(mod: torch.nn.Module) -> tuple:
    tables = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return tuple((t, tuple(_callable_name(h) for h in getattr(mod, t, {}).values())) for t in tables)


def _callable_name(f: Any) -> str:
    f = getattr(f, "__func__", f)
    return getattr(f, "__qualname__", type(f).__qualname__)


def _attributes(block: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """(submodule name, attribute) -> a comparable form of each plain attribute of the block."""
    out: dict[tuple[str, str], Any] = {}
    for sub_name, mod in block.named_modules(remove_duplicate=False):
        for key, value in vars(mod).items():
            if key in _MODULE_INTERNALS:
                continue
            out[(sub_name, key)] = _comparable(value)
    return out


def _comparable(value: Any, depth: int = 0) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list, frozenset)) and depth < 3 and len(value) <= 64:
        return (type(value).__name__, tuple(_comparable(v, depth + 1) for v in value))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if callable(value) and not isinstance(value, torch.nn.Module):
        return ("callable", _callable_name(value))
    return ("object", type(value).__qualname__)


def _numbers_the_blocks(values: list[Any]) -> bool:
    """Integers that number the children (``layer_idx``): ``values[i] - i`` the same for all."""
    if not all(type(v) is int for v in values):
        return False
    return len({v - i for i, v in enumerate(values)}) == 1
