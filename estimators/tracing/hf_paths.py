"""Keep a fake-mode trace of a Hugging Face model on the code path its real run takes.

transformers reads tensor *values* to pick a path, and under FakeTensorMode it cannot: then it
assumes the worst. ``masking_utils.find_packed_sequence_indices`` checks whether ``position_ids``
pack several sequences in a row; on a fake tensor it always answers "maybe", so the trace
materializes a causal mask, and attention then runs another path (a float mask, ``repeat_kv``
instead of SDPA's ``enable_gqa`` for grouped-query attention: Mistral, Phi-3, GPT-NeoX...). The
ops a plan names by ``(op, occurrence)`` then point at other tensors in the real run, and an
offload plan moves other bytes than it predicted.

While tracing, :class:`hf_real_paths` answers that question as the real run would: "not packed"
when the step passes no ``position_ids`` (the model makes them with ``arange``, one sequence per
row) or passes ones that the real check finds not packed (evaluated once on the real values).

The same holds for SDPA's mask skip: with no padding (an attention mask of ones, or none) the
real run passes no mask to SDPA (``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa``
read ``padding_mask.all()``), but ``is_tracing`` is true for a fake tensor, so the trace built a
boolean mask that a checkpointed layer keeps as an input through its backward, which the real
run never makes. While tracing those two
checks are asked about an all-ones mask of the fake mask's shape, as the real run is, where the
fake mask stands for ones: the step passes no mask, or the fake mask has the shape of passed masks
that are all ones in their real values; so is Mamba-2's ``create_recurrent_attention_mask`` (None
for all ones: no padding multiply). A mask of another shape is one the model built from other
inputs (Pix2Struct's decoder mask from labels padded with -100): it is asked about as it is, and
the trace builds it (answering "ones" for it would count too little where it has zeros; where the
real one is all ones, as Pix2Struct's with unpadded labels, or a passed mask the model extends,
BLIP-2's query tokens, the trace is over by the mask). Still low: a mask the model
builds with zeros in the shape of a passed all-ones mask (equal encoder and decoder lengths), or
with no mask passed at all; the shape is what the trace can tell, not where values came from.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from estimators.tracing.thread_state import original, patched_in_this_thread

__all__ = ["hf_real_paths"]


def _by_name(inputs: Any, match: Callable[[str], bool]) -> list[Any]:
    """Values of the dict entries whose key ``match``es, at any depth of ``inputs`` (dicts, lists
    and tuples searched; a matched value is taken as it is)."""
    if isinstance(inputs, dict):
        found = []
        for key, value in inputs.items():
            found += [value] if isinstance(key, str) and match(key) else _by_name(value, match)
        return found
    if isinstance(inputs, (list, tuple)):
        return [v for item in inputs for v in _by_name(item, match)]
    return []


def _position_ids(inputs: Any) -> list[torch.Tensor] | None:
    """The real ``position_ids`` the step passes by name, at any depth of the inputs (empty:
    none passed); None when unknowable (passed as something other than a tensor). Positional
    inputs carry none: HF models take position_ids by keyword in practice."""
    given = [p for p in _by_name(inputs, lambda key: key == "position_ids") if p is not None]
    return given if all(isinstance(p, torch.Tensor) for p in given) else None


class _AnyShape(frozenset):
    """Every shape: the step passes no mask."""

    def __contains__(self, shape: object) -> bool:
        return True

    def __bool__(self) -> bool:
        return True


_ANY = _AnyShape()


def _all_ones_shapes(inputs: Any) -> set[tuple[int, ...]] | None:
    """Shapes of the attention masks the step passes, where every passed mask of that shape is all
    ones in its real values; None when that cannot be known (meta tensors, 4D custom masks,
    masks passed positionally).

    A mask is passed by name: a dict key containing ``attention_mask``, at any depth of the
    inputs, so a batch dict inside positional arguments counts (Lightning's step is
    ``training_step(batch, batch_idx)``: read only at the top level, the fake trace would build
    the 4-D mask the real run skips). Tensors outside any dict are
    positional; beside another tensor they cannot be told from a mask."""
    tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    in_dicts = [t for t in tree_flatten(_by_name(inputs, lambda key: True))[0] if isinstance(t, torch.Tensor)]
    if len(in_dicts) < len(tensors) and len(tensors) > 1:
        return None  # a positional mask cannot be told from other inputs
    masks = [m for m in _by_name(inputs, lambda key: "attention_mask" in key) if m is not None]
    if not masks:
        return _ANY  # none passed: every mask the model makes is its own, of ones
    ones: dict[tuple[int, ...], bool] = {}
    for m in masks:
        if not isinstance(m, torch.Tensor) or m.device.type == "meta" or m.dim() != 2:
            return None  # a 4D custom mask, or values unknown
        shape = tuple(m.shape)
        ones[shape] = ones.get(shape, True) and bool(m.bool().all())
    return {shape for shape, all_ones in ones.items() if all_ones}


def _answered_as_ones(mask: Any, shapes: set[tuple[int, ...]]) -> bool:
    """A fake mask the check is asked about stands for real ones: no mask passed at all (the
    model's own ones), or a passed mask's shape whose passed masks are all ones. A mask of
    another shape is one the model built (Pix2Struct's decoder mask from labels padded with
    -100: answering "ones" for it left out a mask the real run builds, 256 B under), so the
    check is asked about the fake mask itself: it builds the mask, high rather than low."""
    from torch._subclasses.fake_tensor import is_fake

    if not (isinstance(mask, torch.Tensor) and is_fake(mask)):
        return False
    return tuple(mask.shape) in shapes


class hf_real_paths:
    """``with hf_real_paths(inputs):`` while a fake-mode trace runs, transformers' checks that read
    mask and position values answer on fake tensors what they answer on the real ``inputs`` (a
    no-op without transformers loaded, or where that answer is unknowable)."""

    def __init__(self, inputs: Any) -> None:
        self.inputs = inputs
        self.restore = contextlib.ExitStack()

    def _patch(self, module: Any, name: str, replacement: Any) -> None:
        # In this thread only: transformers' functions are the process's (another thread's model
        # runs the originals, and two traces in two threads restore nothing of each other's).
        self.restore.enter_context(patched_in_this_thread(module, name, replacement))

    def __enter__(self):
        mu = sys.modules.get("transformers.masking_utils")
        if mu is None:
            return self
        from torch._subclasses.fake_tensor import is_fake

        fn = original(mu, "find_packed_sequence_indices") if hasattr(mu, "find_packed_sequence_indices") else None
        given = _position_ids(self.inputs)
        if fn is not None and given is not None and not any(
            isinstance(t, torch.Tensor) and (t.device.type == "meta" or fn(t if t.dim() == 2 else t.view(1, -1)) is not None)
            for t in given
        ):
            # Not packed in the real run (packed or unreadable: left alone, the fake trace's
            # mask is the real run's too).
            def not_packed_when_fake(position_ids: torch.Tensor, _fn=fn):
                if is_fake(position_ids):
                    return None  # what the real run finds: one sequence per row
                return _fn(position_ids)

            self._patch(mu, "find_packed_sequence_indices", not_packed_when_fake)
        shapes = _all_ones_shapes(self.inputs)
        if shapes:  # None (unknowable) or no all-ones shape: nothing to answer
            for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
                if callable(getattr(mu, name, None)):
                    self._patch(mu, name, _asked_of_ones(original(mu, name), shapes))
            if callable(getattr(mu, "create_recurrent_attention_mask", None)):
                recurrent = original(mu, "create_recurrent_attention_mask")
                # Mamba-2 / linear-attention models import it by name: patch every holder.
                replacement = _no_mask_when_ones(recurrent, shapes)
                for module in list(sys.modules.values()):
                    if hasattr(module, "create_recurrent_attention_mask") and \
                            original(module, "create_recurrent_attention_mask") is recurrent:
                        self._patch(module, "create_recurrent_attention_mask", replacement)
        return self

    def __exit__(self, *exc) -> None:
        self.restore.close()


def _asked_of_ones(check: Any, shapes: set[tuple[int, ...]]) -> Any:
    """``check(padding_mask, ...)`` asked, for a fake mask that stands for ones
    (``_answered_as_ones``), about real ones of its shape."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def on_real_ones(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if _answered_as_ones(padding_mask, shapes):
            with unset_fake_temporarily():
                ones = torch.ones(tuple(padding_mask.shape), dtype=torch.bool)
                return check(ones, *args, **kwargs)
        return check(padding_mask, *args, **kwargs)

    return on_real_ones


def _no_mask_when_ones(create: Any, shapes: set[tuple[int, ...]]) -> Any:
    """``create_recurrent_attention_mask(config, inputs_embeds, attention_mask, ...)`` returns None
    for an all-ones 2D mask in the real run (the consumer then skips the multiply); asked about a
    fake mask of a step whose masks are all ones, it answers as for real ones of its shape."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def as_for_ones(config: Any, inputs_embeds: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if _answered_as_ones(attention_mask, shapes) and attention_mask.ndim == 2:
            with unset_fake_temporarily():
                ones = torch.ones(tuple(attention_mask.shape), dtype=attention_mask.dtype)
            seq = int(inputs_embeds.shape[1])
            if seq > 1:  # (a single-token step gets None either way)
                with unset_fake_temporarily():
                    real = create(config, torch.empty(1, seq, 1), ones, *args, **kwargs)
                if real is None:
                    return None
        return create(config, inputs_embeds, attention_mask, *args, **kwargs)

    return as_for_ones
