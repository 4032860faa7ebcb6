"""A model already sharded with FSDP2's ``fully_shard``: its units, its layout, and how it looked before.

    fsdp_units_of(model)           # ['GPT', 'GPT.blocks.0', ...]: the units to plan for
    original_class_name(model)     # 'GPT' for FSDP2's swapped-in 'FSDPGPT'
    fsdp_layout(model)             # units, shard group size, precision, as fully_shard left them

The planner traces the program a rank runs *before* ``fully_shard`` (parameters at their tensor-
parallel local shapes, or whole) and adds FSDP2's per-rank memory with its rules
(``planner.distributed.fsdp``). For a model that is already sharded, :func:`unsharded_parts`
gives what a copy needs to look as it did before: for each sharded parameter its pre-FSDP layout
(FSDP2 keeps the tensor-parallel ``DTensorSpec`` of a DTensor parameter and the original size of
a plain one), and for each unit the ids of the forward hooks ``fully_shard`` installed.

These read FSDP2's own state (``fully_shard.state(module)._fsdp_param_groups``, ``FSDPParam``),
torch 2.13's; a torch whose FSDP2 keeps them elsewhere gets :class:`ShardedModelError`, which says
to plan before ``fully_shard``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "fsdp_units_of",
    "original_class_name",
    "FsdpLayout",
    "fsdp_layout",
    "ShardedModelError",
    "PreShardParam",
    "unsharded_parts",
    "uneven_shards",
]


class ShardedModelError(RuntimeError):
    """An FSDP2-sharded model whose FSDP state this planner cannot read."""


def original_class_name(module: torch.nn.Module) -> str:
    """The class name the module had before ``fully_shard`` (which swaps in ``FSDP<Name>``).

    >>> original_class_name(torch.nn.Linear(2, 2))
    'Linear'
    """
    cls = original_class(module)
    return cls.__name__


def original_class(module: torch.nn.Module) -> type:
    """The class the module had before ``fully_shard`` (its own class if it is not a unit)."""
    cls = type(module)
    fsdp_module = _fsdp_module_class()
    if fsdp_module is not None and isinstance(module, fsdp_module):
        bases = [b for b in cls.__bases__ if b is not fsdp_module]
        if len(bases) == 1 and cls.__name__ == f"FSDP{bases[0].__name__}":
            return bases[0]
    return cls


def _fsdp_module_class() -> type | None:
    """``FSDPModule`` if FSDP2 was imported (no module can be sharded otherwise); importing it
    here would cost a second on every fingerprint."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return []
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, fsdp_module)]


def fsdp_units_of(model: torch.nn.Module) -> list[str]:
    """Names (ModuleInfo style: root class name first) of the modules ``fully_shard`` was called on.

    Example::

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        fsdp_units_of(model)   # ['GPT', 'GPT.blocks.0', 'GPT.blocks.1', ...]
    """
    root = original_class_name(model)
    return [f"{root}.{name}" if name else root for name, _ in _units(model)]


@dataclass(frozen=True)
class FsdpLayout:
    """How ``fully_shard`` sharded a model, as the FSDP rules need it."""

    units: tuple[str, ...]
    """The units, ModuleInfo names (root class name first)."""
    shard_world_size: int
    """Ranks each parameter is sharded over (the mesh dim FSDP shards on)."""
    replicate_world_size: int
    """HSDP's replicas (1 for FSDP)."""
    param_dtype: torch.dtype | None
    """``MixedPrecisionPolicy.param_dtype`` (None: the parameters' own)."""
    reduce_dtype: torch.dtype | None
    """``MixedPrecisionPolicy.reduce_dtype``."""
    resharded_after_forward: tuple[bool, ...]
    """Per unit (as ``units``): whether its parameters are freed after its forward."""


def _state(module: torch.nn.Module) -> Any:
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    if state is None or not hasattr(state, "_fsdp_param_groups"):
        raise ShardedModelError(
            f"cannot read the FSDP2 state of {type(module).__name__} (this torch keeps it elsewhere): "
            "plan the model before fully_shard (torchtitan's order: parallelize, plan and apply, then shard)")
    return state


def fsdp_layout(model: torch.nn.Module) -> FsdpLayout | None:
    """The FSDP2 layout of ``model``; None when ``fully_shard`` was never called on it. Raises
    :class:`ShardedModelError` when its units shard over different groups or precisions (the
    FSDP rules assume one)."""
    units = _units(model)
    if not units:
        return None
    root = original_class_name(model)
    names, sizes, replicas, precisions, reshard = [], set(), set(), set(), []
    for name, mod in units:
        names.append(f"{root}.{name}" if name else root)
        for group in _state(mod)._fsdp_param_groups:
            info = group.mesh_info
            sizes.add(int(info.shard_mesh_size))
            replicas.add(int(getattr(info, "replicate_mesh_size", 1)))
            precisions.add((group.mp_policy.param_dtype, group.mp_policy.reduce_dtype))
            reshard.append(group.post_forward_mesh_info is not None)
    if len(sizes) > 1 or len(replicas) > 1 or len(precisions) > 1:
        raise ShardedModelError(
            f"the FSDP2 units of {root} shard over different group sizes {sorted(sizes)} or use different "
            "mixed-precision policies: the per-rank memory model assumes one for all units; shard every unit "
            "over one group with one policy (expert parallel: see examples.expert_parallel.shard)")
    ((param_dtype, reduce_dtype),) = precisions or {(None, None)}
    return FsdpLayout(units=tuple(names), shard_world_size=sizes.pop() if sizes else 1,
                      replicate_world_size=replicas.pop() if replicas else 1, param_dtype=param_dtype,
                      reduce_dtype=reduce_dtype, resharded_after_forward=tuple(reshard))


@dataclass(frozen=True)
class PreShardParam:
    """A sharded parameter as it was before ``fully_shard``."""

    spec: Any
    """Its tensor-parallel ``DTensorSpec`` (mesh, placements, global shape); None: a plain tensor."""
    size: torch.Size
    """Its shape before FSDP (the global shape for a DTensor)."""
    dtype: torch.dtype
    requires_grad: bool


def unsharded_parts(model: torch.nn.Module) -> tuple[dict[int, PreShardParam], dict[int, set[int]], list[Any]]:
    """For a copy of ``model`` without FSDP2: the pre-FSDP form of each sharded parameter (by the
    id of the parameter the module holds now), the FSDP forward hook ids of each unit (by the
    unit's id), and the FSDP states (to be shared, not copied)."""
    params: dict[int, PreShardParam] = {}
    hooks: dict[int, set[int]] = {}
    states = []
    for _, mod in _units(model):
        state = _state(mod)
        states.append(state)
        ids = set()
        for handle in (getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None)):
            for h in getattr(handle, "handles", (handle,)):  # a group of modules: several handles
                if h is not None:
                    ids.add(h.id)
        hooks[id(mod)] = ids
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                owner, name = fp._module_info.module, fp._module_info.param_name
                sharded = owner._parameters[name]
                spec = getattr(fp, "_unsharded_dtensor_spec", None)
                size = spec.shape if spec is not None else fp._orig_size
                params[id(sharded)] = PreShardParam(spec, torch.Size(size), sharded.dtype, sharded.requires_grad)
    return params, hooks, states


_RESHAPE_FAILED = ("is invalid for input of size", "view size is not compatible")


def uneven_shards(model: torch.nn.Module, error: str) -> str:
    """Where a reshape failed and a tensor-parallel degree does not divide a sharded dimension
    (HF's ``tp_plan`` at a degree that does not divide the heads): the parameters it splits
    unevenly, named, since the op that fails (a view by heads) names neither; "" for any other
    error (an uneven vocabulary shard is a layout that runs), an even layout or no DTensors."""
    if ("torch.distributed.tensor" not in sys.modules or fsdp_units_of(model)
            or not any(s in error for s in _RESHAPE_FAILED)):
        return ""
    from torch.distributed.tensor import DTensor

    uneven = []
    for name, p in model.named_parameters():
        for mesh_dim, placement in enumerate(getattr(p, "placements", ()) if isinstance(p, DTensor) else ()):
            size, ranks = (p.shape[placement.dim], p.device_mesh.size(mesh_dim)) if placement.is_shard() else (0, 1)
            if size % ranks:
                uneven.append(f"{name} ({size} along dim {placement.dim} over {ranks} ranks)")
    if not uneven:
        return ""
    more = f" and {len(uneven) - 3} more" if len(uneven) > 3 else ""
    return (f"the tensor-parallel layout splits {'; '.join(uneven[:3])}{more} unevenly, so a model that divides "
            "its heads or hidden size by the degree fails to reshape: use a degree that divides the attention "
            "and KV heads and the hidden, FFN and vocabulary sizes. The trace stopped here: ")
