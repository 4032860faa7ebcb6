"""A model's module tree as a trace records it: its leaves, and the unique parameter and
gradient bytes of every module's subtree (a parameter shared by two modules counted once in each
subtree that holds it; a DTensor parameter: this rank's shard)."""

from __future__ import annotations

from typing import Callable

import torch

from estimators.tracing.subclasses import storage_of

__all__ = ["module_tree"]


def module_tree(model: torch.nn.Module, root_name: str, round_bytes: Callable[[int], int]
                ) -> tuple[set[str], dict[str, int], dict[str, int]]:
    """Leaf fqns, and unique parameter / gradient bytes of every module's subtree (fqns rooted
    at ``root_name``; each storage's bytes as the allocator rounds them)."""
    leaves: set[str] = set()
    param_bytes: dict[str, int] = {}
    grad_bytes: dict[str, int] = {}
    for name, mod in model.named_modules():
        fqn = f"{root_name}.{name}" if name else root_name
        if next(mod.children(), None) is None:
            leaves.add(fqn)
        seen: set[int] = set()
        pbytes = gbytes = 0
        for p in mod.parameters():
            st = storage_of(p)
            if st is None or id(st) in seen:
                continue
            seen.add(id(st))
            nb = round_bytes(st.nbytes())
            pbytes += nb
            gbytes += nb if p.requires_grad else 0
        param_bytes[fqn], grad_bytes[fqn] = pbytes, gbytes
    return leaves, param_bytes, grad_bytes
