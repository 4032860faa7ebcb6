"""Decoders split into pipeline stages by layers, as torchtitan splits them: each stage keeps its
layers' original names (``layers.4`` stays ``layers.4``), the first stage the embedding, the last
the final norm and the output projection.

    model, _ = llama_tiny()
    stage = llama_stage(model, stage_index=1, n_stages=4)     # examples.llama.Llama
    stage = hf_decoder_stage(hf_model, stage_index=1, n_stages=4)   # HF Llama / Qwen2 / Mistral

Run in sequence, the stages give the unsplit model's logits bitwise (tests/examples).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["layer_ranges", "LlamaStage", "llama_stage", "HFDecoderStage", "hf_decoder_stage",
           "stage_loss", "llama_pipeline_model", "qwen2_pipeline_model", "llama_stage_builder"]


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible; earlier stages take the extra layers."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"{n_stages} stages need 1 to {n_layers} (the layers), got {n_stages}")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        out.append(range(start, start + base + (s < extra)))
        start = out[-1].stop
    return out


class LlamaStage(nn.Module):
    """Layers ``layer_ids`` of an ``examples.llama.Llama`` (copies): the embedding on the first
    stage, the final norm and the output projection on the last. ``LlamaStage.on_meta`` builds
    one from a config alone (any size, no storage)."""

    def __init__(self, model: nn.Module, layer_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = copy.deepcopy(model.tok_embeddings) if first else None
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(model.layers[i]) for i in layer_ids})
        self.norm = copy.deepcopy(model.norm) if last else None
        self.output = copy.deepcopy(model.output) if last else None
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    @classmethod
    def on_meta(cls, config, layer_ids: range, *, first: bool, last: bool,
                dtype: torch.dtype = torch.float32) -> "LlamaStage":
        """The stage of an ``examples.llama.Llama`` of ``config`` built on the meta device, its
        parameters in ``dtype`` (the rotary tables float32, as ``Llama`` keeps them)."""
        from examples.llama import RMSNorm, TransformerBlock, rotary_tables

        stage = cls.__new__(cls)
        nn.Module.__init__(stage)
        with torch.device("meta"):
            stage.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, dtype=dtype) if first else None
            stage.layers = nn.ModuleDict({str(i): TransformerBlock(config).to(dtype) for i in layer_ids})
            stage.norm = RMSNorm(config.dim, config.norm_eps).to(dtype) if last else None
            stage.output = nn.Linear(config.dim, config.vocab_size, bias=False, dtype=dtype) if last else None
        cos, sin = rotary_tables(config.head_dim, config.seq_len, config.rope_theta)
        stage.register_buffer("rope_cos", cos, persistent=False)
        stage.register_buffer("rope_sin", sin, persistent=False)
        return stage

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h)) if self.output is not None else h  # last: (B, T, vocab)


def llama_stage(model: nn.Module, stage_index: int, n_stages: int) -> LlamaStage:
    ids = layer_ranges(len(model.layers), n_stages)[stage_index]
    return LlamaStage(model, ids, first=stage_index == 0, last=stage_index == n_stages - 1)


class HFDecoderStage(nn.Module):
    """Layers ``layer_ids`` of an HF Llama-like causal LM (``model.model.embed_tokens / layers /
    norm / rotary_emb``, ``model.lm_head``: Llama, Qwen2, Mistral), running what the HF model's
    forward runs around them (causal mask, rotary embeddings), cache off."""

    def __init__(self, hf_model: nn.Module, layer_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        inner = hf_model.model
        self.config = hf_model.config
        self.embed_tokens = copy.deepcopy(inner.embed_tokens) if first else None
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(inner.layers[i]) for i in layer_ids})
        self.norm = copy.deepcopy(inner.norm) if last else None
        self.lm_head = copy.deepcopy(hf_model.lm_head) if last else None
        self.rotary_emb = copy.deepcopy(inner.rotary_emb)

    def forward(self, x: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, hidden)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        pos = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pos, position_ids=position_ids, use_cache=False)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def hf_decoder_stage(hf_model: nn.Module, stage_index: int, n_stages: int) -> HFDecoderStage:
    ids = layer_ranges(len(hf_model.model.layers), n_stages)[stage_index]
    return HFDecoderStage(hf_model, ids, first=stage_index == 0, last=stage_index == n_stages - 1)


def stage_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy in float32 on logits (B, T, V) against the tokens (B, T): the
    schedule's ``loss_fn(output, target)`` with the batch as its own target."""
    logits = logits[:, :-1, :]  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))


def llama_pipeline_model(n_layers: int = 8, *, seed: int = 0) -> nn.Module:
    """A Llama small enough for pipeline runs on a CPU: dim 64, 4 / 2 heads, FFN 128, vocab 256,
    sequence 32."""
    from examples.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=256, seq_len=32, n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Llama(config)


def qwen2_pipeline_model(n_layers: int = 8, *, seed: int = 0) -> nn.Module:
    """An HF Qwen2ForCausalLM from a tiny config (the Llama above's sizes, SDPA attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).train()


def llama_stage_builder(config, *, n_stages: int, micro_batch: int, dtype: torch.dtype = torch.float32,
                        sequence_parallel: bool = True, optimizer: str = "adamw"):
    """``build(stage, mesh) -> (module, TrainStep)`` for
    ``planner.distributed.pipeline.plan_layout_rank``: stage ``stage`` of ``n_stages`` of a Llama
    of ``config`` (``examples.llama.LlamaConfig``), built on meta in ``dtype``, parallelized over
    ``mesh["tp"]`` as torchtitan does where the mesh has a ``tp`` dim over 1 (sequence parallel
    as asked, vocabulary-sharded logits under ``loss_parallel``), and one micro-batch of
    ``micro_batch`` sequences of ``config.seq_len`` tokens at the rank's local shapes."""
    from planner import TrainStep

    def build(stage: int, mesh) -> tuple[nn.Module, object]:
        first, last = stage == 0, stage == n_stages - 1
        module = LlamaStage.on_meta(config, layer_ranges(config.n_layers, n_stages)[stage], first=first, last=last,
                                    dtype=dtype)
        tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
        context = None
        if tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            from examples.tensor_parallel import parallelize_llama

            parallelize_llama(module, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=True)
            context = loss_parallel
        seq = config.seq_len // tp if tp > 1 and sequence_parallel else config.seq_len  # a sequence shard
        tokens = torch.zeros(micro_batch, config.seq_len, dtype=torch.long, device="meta")
        hidden = torch.empty(micro_batch, seq, config.dim, dtype=dtype, device="meta")  # (B, T / tp, dim)
        return module, TrainStep(inputs=tokens if first else hidden, loss_fn=stage_loss, optimizer=optimizer,
                                 target=tokens if last else None, context=context)

    return build
