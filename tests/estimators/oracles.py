"""Independent measurements the estimators are checked against (test helpers, not library code)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def saved_bytes_per_module(model: torch.nn.Module, inputs: tuple, root: str) -> dict[str, int]:
    """Bytes autograd saves while each module's forward runs: unique storages (by data pointer),
    parameters excluded, measured with torch.autograd.graph.saved_tensors_hooks."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    saved: dict[str, dict[int, int]] = {}
    hooks = []
    for name, mod in model.named_modules():
        fqn = f"{root}.{name}" if name else root
        saved.setdefault(fqn, {})
        hooks.append(mod.register_forward_pre_hook(lambda m, a, fqn=fqn: stack.append(fqn) and None))
        hooks.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            for fqn in stack:
                saved[fqn][st.data_ptr()] = st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        del tensors, out
    finally:
        for h in hooks:
            h.remove()
    return {fqn: sum(d.values()) for fqn, d in saved.items()}
