"""What the launch advisor must know of a model to lay it out: its shape, its tensor-parallel plan,
its pipeline split and its FSDP2 units. Today: Llama-style decoders (``examples.llama``), laid out
as torchtitan lays out Llama 3.

    family = model_family(llama3_70b, seq_len=8192)   # any factory taking seq_len= and returning a Llama
    family.param_bytes(tp=8, layer_ids=range(80), first=True, last=True)

A family builds the model on the meta device (planning never allocates), parallelizes it with
torchtitan's Llama TP plan (``examples.tensor_parallel``: sequence parallel, vocabulary-parallel
embedding and loss), splits it into pipeline stages of whole layers (``examples.pipeline_stages``:
the first stage holds the embedding, the last the final norm and output) and shards every layer
and the root with FSDP2.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from planner.errors import PlanningError

__all__ = ["LlamaFamily", "model_family"]


@dataclass(frozen=True)
class LlamaFamily:
    """A Llama-style decoder (``examples.llama.Llama``) and how torchtitan lays it out."""

    model_fn: Callable[..., Any]
    """Builds ``(model, inputs)`` for ``seq_len=`` on the meta device."""
    seq_len: int
    config: Any
    """The model's ``LlamaConfig``."""
    dtype: torch.dtype
    name: str

    optimizer_bytes_per_param_byte: int = 2
    """AdamW keeps two moments in the parameters' dtype."""
    spare: list = field(default_factory=list, compare=False, repr=False)
    """A model built already (for the family's own check), handed to the first ``build``."""

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    def tp_refusal(self, tp: int) -> str | None:
        """Why torchtitan's TP plan cannot shard this model over ``tp`` ranks, or None."""
        c = self.config
        for what, n in (("KV heads", c.n_kv_heads), ("query heads", c.n_heads), ("FFN width", c.ffn_dim),
                        ("vocabulary", c.vocab_size)):
            if n % tp:
                return f"TP {tp} does not divide the {n} {what}"
        return None

    def param_bytes(self, *, tp: int, layer_ids, first: bool, last: bool) -> int:
        """Bytes of the parameters one rank of a TP group holds for these layers (and the
        embedding on the first stage, the final norm and output on the last)."""
        c, e = self.config, torch.empty((), dtype=self.dtype).element_size()
        hd = c.dim // c.n_heads
        linear = (2 * c.dim * c.n_heads * hd + 2 * c.dim * c.n_kv_heads * hd + 3 * c.dim * c.ffn_dim) // tp
        per_layer = linear + 2 * c.dim  # the two norms are replicated
        total = len(layer_ids) * per_layer
        if first:
            total += c.vocab_size * c.dim // tp
        if last:
            total += c.vocab_size * c.dim // tp + c.dim
        return total * e

    def stage_layers(self, n_stages: int) -> list[range]:
        from examples.pipeline_stages import layer_ranges

        return layer_ranges(self.n_layers, n_stages)

    def rank_layer_sets(self, pp: int, virtual: int) -> list[tuple[list[int], bool, bool]]:
        """Per pipeline rank: (its layers, holds the embedding, holds the output); torch's loop
        layout puts stage ``s`` on rank ``s % pp``."""
        n = pp * virtual
        ranges = self.stage_layers(n)
        out = []
        for r in range(pp):
            stages = list(range(r, n, pp))
            out.append(([i for s in stages for i in ranges[s]], 0 in stages, n - 1 in stages))
        return out

    def flops_per_token(self) -> float:
        """Training FLOPs per token as torchtitan counts them for MFU
        (``get_num_flop_per_token``): 6 x the non-embedding parameters + the attention's
        12 x layers x heads x head_dim x sequence."""
        c = self.config
        hd = c.dim // c.n_heads
        n = self.param_bytes(tp=1, layer_ids=range(c.n_layers), first=True, last=True) // \
            torch.empty((), dtype=self.dtype).element_size() - c.vocab_size * c.dim
        return 6 * n + 12 * c.n_layers * c.n_heads * hd * self.seq_len

    # ------------------------------------------------------------------ building
    def build(self) -> torch.nn.Module:
        """A fresh model (on meta for the large factories): each World parallelizes its own."""
        return self.spare.pop() if self.spare else self.model_fn(seq_len=self.seq_len)[0]

    def parallelize(self, model: torch.nn.Module, tp_mesh) -> None:
        from examples.tensor_parallel import parallelize_llama

        parallelize_llama(model, tp_mesh, sequence_parallel=True, loss_parallel=True)

    def fsdp_units(self, model: torch.nn.Module) -> list[str]:
        from examples.tensor_parallel import fsdp_unit_names

        return fsdp_unit_names(model)

    def stage(self, model: torch.nn.Module, layer_ids: range, *, first: bool, last: bool) -> torch.nn.Module:
        from examples.pipeline_stages import LlamaStage

        return LlamaStage(model, layer_ids, first=first, last=last)

    def stage_builder(self, *, n_stages: int, micro_batch: int):
        """``build(stage, mesh) -> (module, TrainStep)`` for ``planner.distributed.pipeline``'s
        ``plan_layout_rank`` / ``fake_layout_rank``: stage ``stage`` of ``n_stages``, TP over the
        mesh's ``tp`` dim with sequence parallelism (``examples.pipeline_stages.llama_stage_builder``)."""
        from examples.pipeline_stages import llama_stage_builder

        return llama_stage_builder(self.config, n_stages=n_stages, micro_batch=micro_batch, dtype=self.dtype)

    @property
    def stage_loss(self):
        from examples.pipeline_stages import stage_loss

        return stage_loss

    def hidden(self, micro_batch: int, seq: int) -> torch.Tensor:
        """What a middle stage receives: the residual stream of one micro-batch (meta)."""
        return torch.empty(micro_batch, seq, self.config.dim, dtype=self.dtype, device="meta")

    def tokens(self, micro_batch: int, seq: int) -> torch.Tensor:
        return torch.randint(0, self.config.vocab_size, (micro_batch, seq))

    def stage_boundary_bytes(self, micro_batch: int, seq: int) -> int:
        """Bytes one pipeline hand-over sends (the residual stream of a micro-batch)."""
        return micro_batch * seq * self.config.dim * torch.empty((), dtype=self.dtype).element_size()


def model_family(model_fn: Callable[..., Any], *, seq_len: int) -> LlamaFamily:
    """The family of the model ``model_fn(seq_len=seq_len)`` builds, or a PlanningError naming
    what the search supports."""
    if not callable(model_fn):
        raise PlanningError(f"model_fn must be a callable that builds the model, got {type(model_fn).__name__}")
    if "seq_len" not in inspect.signature(model_fn).parameters:
        raise PlanningError("model_fn must take seq_len= (e.g. examples.llama.llama3_70b): the search builds "
                            "the model at the sequence length it lays out")
    from examples.llama import Llama

    model = model_fn(seq_len=seq_len)[0]
    if not isinstance(model, Llama):
        raise PlanningError(
            f"the launch advisor lays out Llama-style decoders (examples.llama.Llama: torchtitan's TP plan and "
            f"stage split are known for them); {type(model).__name__} is not one. For a decoder of that shape (HF "
            f"Llama, Mistral, Qwen2), search a factory returning examples.llama.build_llama(LlamaConfig(...)) of its "
            f"sizes (what it adds, e.g. QKV biases, is then not counted); plan the model itself for one layout "
            f"with solve_sac")
    dtype = next(model.parameters()).dtype
    name = getattr(model_fn, "__name__", type(model).__name__)
    return LlamaFamily(model_fn=model_fn, seq_len=seq_len, config=model.config, dtype=dtype, name=name, spare=[model])
