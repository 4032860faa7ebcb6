"""The optimizer a trace or a measurement runs: built from a name, a class, a factory or the
user's instance (never the instance itself: its state and step count stay as they are), over the
parameters being traced, with the user's param groups and hyper-parameters."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from estimators.runtime.device import DeviceSpec

__all__ = ["resolve_optimizer", "check_optimizer_params", "check_optimizer_name", "param_groups"]

_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def check_optimizer_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is an optimizer the step can build by name."""
    if name.lower() not in _OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {name!r}; use one of {sorted(_OPTIMIZERS)}, "
            "an optimizer class, or a torch.optim.Optimizer instance"
        )


def resolve_optimizer(
    optimizer: Any, params_by_group: list[dict], spec: DeviceSpec, fake: bool
) -> torch.optim.Optimizer | None:
    """Build the optimizer over the traced parameters from a name, a class/factory or an instance."""
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        check_optimizer_name(optimizer)
        cls = _OPTIMIZERS[optimizer.lower()]
        kw = {"foreach": True} if spec.is_cuda and fake and cls is not torch.optim.SGD else {}
        return cls(params_by_group, **kw)
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for g, src in zip(params_by_group, optimizer.param_groups):
            hyper = {k: v for k, v in src.items() if k != "params"}
            if fake and spec.is_cuda and hyper.get("foreach") is None and "foreach" in hyper:
                hyper["foreach"] = True  # what torch picks for CUDA tensors
            groups.append({**hyper, "params": g["params"]})
        # Never the user's instance: its state and step count stay as they are. The groups carry
        # every hyper-parameter; defaults go only where the constructor takes them (AdamW's
        # defaults hold ``decoupled_weight_decay``, which its __init__ does not accept).
        accepted = inspect.signature(type(optimizer).__init__).parameters
        kw = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return type(optimizer)(groups, **kw)
    if callable(optimizer):
        return optimizer(params_by_group)
    raise TypeError(f"optimizer must be a name, a class, or an Optimizer, got {type(optimizer)}")


def check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer, known: Any,
                           use: str, why: str = "") -> None:
    """Raise if ``optimizer`` holds parameters whose ``id`` is not in ``known`` (the model's): an
    optimizer built over another copy of the model. ``use``: what is done with the model ("plan",
    "measure"); ``why``: what would go wrong, said after the fix."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in known for p in held)
    if foreign:
        raise ValueError(
            f"the optimizer instance holds {foreign} of its {len(held)} parameters that are not "
            f"this {type(model).__name__}'s parameters; build it over model.parameters() (of "
            f"the model you {use}), or pass its name (\"adamw\") or class{why}"
        )


def param_groups(model: torch.nn.Module, optimizer: Any, mapping: dict) -> list[dict]:
    if isinstance(optimizer, torch.optim.Optimizer):
        # Their state would silently go uncounted.
        check_optimizer_params(model, optimizer, mapping, "plan")
        return [{"params": [mapping[id(p)] for p in g["params"] if mapping[id(p)] is not None]}
                for g in optimizer.param_groups]
    # A parameter mapped to None is not traced (a block a truncated trace skips).
    params = [mapping[id(p)] for p in model.parameters() if p.requires_grad and mapping[id(p)] is not None]
    return [{"params": params}]
