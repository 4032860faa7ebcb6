"""FSDP2 on a live model: the modules ``fully_shard`` was called on, and the class names it hides.

    fsdp_units_of(model)           # ['GPT', 'GPT.blocks.0', ...]: the units to plan for
    original_class_name(model)     # 'GPT' for FSDP2's swapped-in 'FSDPGPT'
"""

from __future__ import annotations

import sys

import torch

__all__ = ["fsdp_units_of", "original_class_name"]


def original_class_name(module: torch.nn.Module) -> str:
    """The class name the module had before ``fully_shard`` (which swaps in ``FSDP<Name>``).

    >>> original_class_name(torch.nn.Linear(2, 2))
    'Linear'
    """
    cls = type(module)
    fsdp_module = _fsdp_module_class()
    if fsdp_module is not None and isinstance(module, fsdp_module):
        bases = [b for b in cls.__bases__ if b is not fsdp_module]
        if len(bases) == 1 and cls.__name__ == f"FSDP{bases[0].__name__}":
            return bases[0].__name__
    return cls.__name__


def _fsdp_module_class() -> type | None:
    """``FSDPModule`` if FSDP2 was imported (no module can be sharded otherwise); importing it
    here would cost a second on every fingerprint."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def fsdp_units_of(model: torch.nn.Module) -> list[str]:
    """Names (ModuleInfo style: root class name first) of the modules ``fully_shard`` was called on.

    Example::

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        fsdp_units_of(model)   # ['GPT', 'GPT.blocks.0', 'GPT.blocks.1', ...]
    """
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return []
    root = original_class_name(model)
    return [
        f"{root}.{name}" if name else root
        for name, mod in model.named_modules()
        if isinstance(mod, fsdp_module)
    ]
