"""Published layouts for the model searched, scaled to the cluster asked, so the table can say where
each ranks and why.

* torchtitan 0.3.0's Llama 3 recipes (``torchtitan/models/llama3/config_registry.py``:
  ``llama3_8b``, ``llama3_70b``, ``llama3_405b``): tensor parallel 8 (1 for 8B), FSDP over the rest
  (``data_parallel_shard_degree=-1``), no PP or CP, ``local_batch_size`` sequences per forward,
  sequence 8192, full activation checkpointing (``FullAC``; 8B: op-level ``SelectiveAC``); 405B
  also float8 linears and
  torch.compile with async TP, which a bf16 trace does not model. Scaled: the same degrees and
  local batch, FSDP over ``n_gpus / TP`` ranks, as many accumulation steps as the global batch asks.
* The Llama 3 paper's 405B layout (Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3):
  TP 8 x CP 1 x PP 16 x DP 128 on 16,384 H100s at sequence 8192, with an interleaved pipeline
  schedule and FSDP over the data-parallel ranks. Scaled: one model replica is TP 8 x PP 16 = 128
  GPUs, kept; DP is ``n_gpus / 128``; torch's ``ScheduleInterleaved1F1B`` (2 stages per rank)
  stands for the paper's own interleaved schedule, one sequence per micro-batch.

The values are copied from those sources (importing torchtitan's registry takes seconds and its
405B recipe needs torchao); ``tests/planner/search/test_published.py`` reads the registry's
source and checks they still agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.search.layouts import Cluster, Layout

__all__ = ["Published", "published_layouts", "TORCHTITAN_RECIPES"]


@dataclass(frozen=True)
class Published:
    """A published configuration and the layout that stands for it on the cluster asked."""

    name: str
    as_published: str
    layout: Layout | None
    """None where it cannot be laid out on this cluster (``note`` says why)."""
    note: str
    full_ac: bool = False
    """The recipe checkpoints every layer (torchtitan's ``FullAC``)."""


LLAMA3_VOCAB = 128_256
"""Llama 3's tokenizer: a model of a recipe's depth and width with another vocabulary is not it."""

TORCHTITAN_RECIPES = {
    # (layers, dim) -> (recipe, TP, local batch, seq len, activation checkpointing, what else it sets)
    (32, 4096): ("llama3_8b", 1, 1, 8192, "SelectiveAC", ""),
    (80, 8192): ("llama3_70b", 8, 8, 8192, "FullAC", ""),
    (126, 16384): ("llama3_405b", 8, 2, 8192, "FullAC",
                   "; float8 linears, torch.compile and async TP are not modelled (bf16 traced)"),
}


def _torchtitan(config, cluster: Cluster, global_batch: int, seq_len: int) -> Published | None:
    recipe = TORCHTITAN_RECIPES.get((config.n_layers, config.dim))
    if recipe is None or config.vocab_size != LLAMA3_VOCAB:  # e.g. Mistral-7B has Llama 3 8B's layers and width
        return None
    name, tp, local, seq, ac, extra = recipe
    what = (f"TP {tp}, FSDP over the rest, local batch {local}, seq {seq}, {ac} "
            f"(torchtitan 0.3.0 {name}){extra}")
    n = cluster.n_gpus
    if n % tp or global_batch % (n // tp * local):
        return Published(f"torchtitan {name}", what, None,
                         f"{n} GPUs x global batch {global_batch} do not split as TP {tp} x FSDP x local batch {local}")
    dp = n // tp
    layout = Layout(tp=tp, dp_shard=dp, micro_batch=local, accumulation=global_batch // (dp * local))
    note = f"scaled: FSDP {dp}, {layout.accumulation} accumulation steps for the global batch"
    if seq != seq_len:
        note += f"; run at seq {seq_len} (the recipe's is {seq})"
    if ac != "FullAC":
        note += f"; its {ac} (op-level) is not costed here, the planner's plan is"
    return Published(f"torchtitan {name}", what, layout, note, full_ac=ac == "FullAC")


def _llama3_paper(config, cluster: Cluster, global_batch: int) -> Published | None:
    if (config.n_layers, config.dim, config.vocab_size) != (126, 16384, LLAMA3_VOCAB):
        return None
    what = "TP 8 x CP 1 x PP 16 x DP 128 on 16,384 H100, seq 8192, interleaved schedule (Llama 3 paper, sec. 3.3)"
    n = cluster.n_gpus
    if n % 128 or global_batch % (n // 128):
        return Published("Llama 3 paper, 405B", what, None,
                         f"a model replica is TP 8 x PP 16 = 128 GPUs: {n} GPUs / global batch {global_batch} do not split")
    dp = n // 128
    layout = Layout(tp=8, pp=16, dp_shard=dp, micro_batch=1, accumulation=global_batch // dp,
                    schedule="Interleaved1F1B")
    return Published("Llama 3 paper, 405B", what, layout,
                     f"scaled: TP 8 x PP 16 kept, DP {dp}; torch's Interleaved1F1B (2 stages per rank) for the "
                     "paper's schedule, 1 sequence per micro-batch")


def published_layouts(family, cluster: Cluster, *, global_batch: int, seq_len: int) -> list[Published]:
    """The published configurations of ``family``'s model (module docstring), scaled."""
    out = [_torchtitan(family.config, cluster, global_batch, seq_len),
           _llama3_paper(family.config, cluster, global_batch)]
    return [p for p in out if p is not None]
