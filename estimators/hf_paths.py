"""Keep a fake-mode trace of a Hugging Face model on the code path its real run takes.

transformers reads tensor *values* to pick a path, and under FakeTensorMode it cannot: then it
assumes the worst. ``masking_utils.find_packed_sequence_indices`` checks whether ``position_ids``
pack several sequences in a row; on a fake tensor it always answers "maybe", so the trace
materializes a causal mask, and attention then runs another path (a float mask, ``repeat_kv``
instead of SDPA's ``enable_gqa`` for grouped-query attention: Mistral, Phi-3, GPT-NeoX...). The
ops a plan names by ``(op, occurrence)`` then point at other tensors in the real run: an offload
plan moved 1,048,576 B where 1,245,184 B were predicted (tiny Mistral, bf16 autocast).

While tracing, :class:`hf_real_paths` answers that question as the real run would: "not packed"
when the step passes no ``position_ids`` (the model makes them with ``arange``, one sequence per
row) or passes ones that the real check finds not packed (evaluated once on the real values).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["hf_real_paths"]


def _position_ids(inputs: Any) -> list[torch.Tensor] | None:
    """The real ``position_ids`` the step passes (empty: none passed); None when unknowable."""
    if isinstance(inputs, dict):
        p = inputs.get("position_ids")
        if p is None:
            return []
        return [p] if isinstance(p, torch.Tensor) else None
    return []  # positional inputs: HF models take position_ids by keyword in practice


class hf_real_paths:
    """``with hf_real_paths(inputs):`` while a fake-mode trace runs, transformers' packed-sequence
    check answers on fake tensors what it answers on the real ``inputs`` (a no-op without
    transformers loaded, or when that answer is "packed" or unknowable)."""

    def __init__(self, inputs: Any) -> None:
        self.inputs = inputs
        self.module = None
        self.original = None

    def __enter__(self):
        mu = sys.modules.get("transformers.masking_utils")
        fn = getattr(mu, "find_packed_sequence_indices", None) if mu is not None else None
        if fn is None:
            return self
        given = _position_ids(self.inputs)
        if given is None or any(
            isinstance(t, torch.Tensor) and (t.device.type == "meta" or fn(t if t.dim() == 2 else t.view(1, -1)) is not None)
            for t in tree_flatten(given)[0]
        ):
            return self  # packed (or not readable): the fake trace's mask is the real run's too
        from torch._subclasses.fake_tensor import is_fake

        def not_packed_when_fake(position_ids: torch.Tensor):
            if is_fake(position_ids):
                return None  # what the real run finds: one sequence per row
            return fn(position_ids)

        self.module, self.original = mu, fn
        mu.find_packed_sequence_indices = not_packed_when_fake
        return self

    def __exit__(self, *exc) -> None:
        if self.module is not None:
            self.module.find_packed_sequence_indices = self.original
            self.module = None
