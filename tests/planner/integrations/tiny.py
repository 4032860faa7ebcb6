"""Tiny Hugging Face models built from configs (no weights), a fixed-length dataset, and a budget
that binds: what the framework integration tests train."""

from __future__ import annotations

import functools
import warnings

import torch

from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import estimate
from planner.format import GiB
from solver import SACMilp

VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 128, 32, 2, 16, 4
LONG_SEQ, IMAGE = 64, 64


def tiny_model(name: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "llama":
            return T.LlamaForCausalLM(T.LlamaConfig(
                vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ, attention_dropout=0.1))
        if name == "gpt2":
            return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=2,
                                                  n_positions=LONG_SEQ))
        if name == "convnext":
            return T.ConvNextForImageClassification(T.ConvNextConfig(
                num_channels=3, hidden_sizes=[16, 32], depths=[2, 1], num_stages=2, num_labels=4, image_size=IMAGE))
        if name == "bert":
            return T.BertForMaskedLM(T.BertConfig(
                vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ))
    raise ValueError(name)


def dataset(n: int = 32, seq: int = SEQ) -> list[dict]:
    """Fixed-length examples (no padding): input_ids, an all-ones attention mask, labels."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": ids})
    return out


def image_dataset(n: int = 32) -> list[dict]:
    """IMAGE x IMAGE RGB images and class labels, for ``tiny_model("convnext")``."""
    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g), "labels": torch.randint(0, 4, (), generator=g)}
            for _ in range(n)]


def examples_for(name: str, n: int = 32) -> list[dict]:
    """The dataset ``tiny_model(name)`` trains on: images for ConvNext, long sequences for
    GPT-2 (its attention is most of the step), the short ones otherwise."""
    return image_dataset(n) if name == "convnext" else dataset(n, LONG_SEQ if name == "gpt2" else SEQ)


def no_ac_peak_bytes(name: str, micro_batches: int, autocast_dtype: torch.dtype | None) -> int:
    """The no-checkpointing peak of a like step written by hand (AdamW, a batch of BATCH)."""
    rows = examples_for(name)[:BATCH]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    step = TrainStep(inputs=batch, optimizer="adamw", micro_batches=micro_batches, autocast_dtype=autocast_dtype)
    return estimate(tiny_model(name), step, device="cpu").module_info.peak_bytes


@functools.lru_cache(maxsize=None)
def midway_budget_gib(name: str, micro_batches: int, autocast_dtype: torch.dtype | None) -> float:
    """Halfway between the smallest reachable and the no-AC peak of a like step written by hand
    (AdamW): a budget that makes the planner checkpoint some modules and not all. Cached: the HF
    and Lightning tests ask for the same ones (the callers reseed before training)."""
    rows = dataset()[:BATCH]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    step = TrainStep(inputs=batch, optimizer="adamw", micro_batches=micro_batches, autocast_dtype=autocast_dtype)
    info = estimate(tiny_model(name), step, device="cpu").module_info
    return (SACMilp(info).min_reachable_peak_bytes() + info.peak_bytes) / 2 / GiB
