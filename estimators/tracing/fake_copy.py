"""The fake copy of a model a fake trace runs: its parameters and buffers fake CPU tensors.

Shared tensors stay shared; tensors an earlier trace left in the process are shared, not copied
(``estimators.tracing.fake_leaks``); the blocks a truncated trace skips are never copied
(``estimators.tracing.truncation``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimators.tracing import fake_leaks
from estimators.tracing.stacks import Stack
from estimators.tracing.truncation import skipped_param_ids, truncate_in_memo

__all__ = ["FakeCopyError", "fake_copy", "fake_tensor"]


class FakeCopyError(RuntimeError):
    """The model could not be copied to fake tensors; the message says what to do."""


def fake_tensor(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a fake CPU tensor of ``mode`` (from a meta or other device: same shape, stride and
    dtype)."""
    if t.device.type == "cpu" and not isinstance(t, torch.nn.Parameter):
        return mode.from_tensor(t)
    with mode:  # meta / other devices: same shape, stride and dtype, on the fake CPU
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _fake_buffer(mode: FakeTensorMode, b: torch.Tensor) -> torch.Tensor:
    """A fake buffer; a one-element integer one (a counter) keeps a copy of its value, so code
    that reads it goes on as in the real step: ``BatchNorm2d(momentum=None)`` divides by
    ``float(num_batches_tracked)``, which a plain fake tensor refuses (torch's fake tensors run
    ops on such constants and keep the result; a copy, so the user's buffer never changes)."""
    if b.device.type == "cpu" and b.numel() == 1 and not b.is_floating_point() and not b.is_complex():
        return mode.fake_tensor_converter.from_real_tensor(mode, b.detach().clone(), make_constant=True)
    return fake_tensor(mode, b)


def fake_copy(
    model: torch.nn.Module, mode: FakeTensorMode, stacks: list[Stack] = ()
) -> tuple[torch.nn.Module, dict]:
    """Deep copy of ``model`` whose parameters and buffers are fake (shared ones stay shared);
    the blocks of ``stacks`` a truncated trace skips are left out (their parameters map to None)."""
    memo: dict[int, Any] = {}
    mapping: dict[int, torch.Tensor | None] = {}
    skipped = skipped_param_ids(model, stacks) if stacks else set()
    for p in model.parameters():
        if id(p) in skipped:
            mapping[id(p)] = None
        elif id(p) not in memo:
            fp = torch.nn.Parameter(fake_tensor(mode, p.detach()), requires_grad=p.requires_grad)
            memo[id(p)] = fp
            mapping[id(p)] = fp
    for b in model.buffers():
        if id(b) not in memo and id(b) not in skipped:
            memo[id(b)] = _fake_buffer(mode, b)
    left = fake_leaks.left_behind()  # held through the copy: their ids stay theirs
    for t in left:  # shared, not copied (see left_behind)
        memo.setdefault(id(t), t)
    try:
        if stacks:
            truncate_in_memo(model, stacks, memo)
        return copy.deepcopy(model, memo), mapping
    except Exception as e:  # noqa: BLE001 - user modules can hold anything
        raise FakeCopyError(
            f"could not copy {type(model).__name__} to fake tensors ({type(e).__name__}: {e}); "
            "give the model on the meta device, or trace in real mode"
        ) from e
