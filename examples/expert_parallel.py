"""torchtitan's DeepSeek-V3 under expert parallel, at any size: what the planner's EP tests and
benchmarks plan and measure.

    config = trainer_config(TINY, world=2, ep=2, seq_len=64, batch=4)    # torchtitan's Trainer.Config
    parallel_dims = parallel_dims_of(config, world=2)                    # in a live or fake group
    model = build(config, parallel_dims)                                 # meta=True: on meta
    step = train_step(config)
    route(model, favoured=None)          # balanced routing (torchtitan's forced round-robin)

The model is torchtitan's own (``torchtitan.models.deepseek_v3``: MLA attention, routed experts
with top-k routing, a shared expert, dense first layers), built from its layer builder
(``build_mla_moe_layers``) at the dimensions of a :class:`MoEDims`, and parallelized by its own
``Module.parallelize``: the routed experts' weights are DTensors sharded on the expert dim over
the ``ep`` mesh dim, and each MoE layer dispatches and combines tokens with
``all_to_all_single``, its split sizes read from the router's counts. What differs from its
training setup, and why:

* the SPMD backend is ``partial_dtensor`` by default: torchtitan's default ``spmd_types`` sends
  tokens with the list form of ``all_to_all``, which gloo refuses for chunks of unequal size
  (``ProcessGroupGloo::alltoall: invalid tensor size``); NCCL and the fake group take both;
* attention runs torch's SDPA (causal): FlexAttention has no CPU backward;
* FSDP2 (:func:`shard`) is composed so that every unit shards over a group of one size (``ep``
  and ``efsdp`` of equal size): the routed experts over ``efsdp``, everything else HSDP-style,
  sharded over ``ep`` and replicated over ``efsdp``. torchtitan shards the dense part over all of
  ``dp_shard`` (``efsdp x ep``) and the experts over ``efsdp`` inside one unit: two group sizes,
  where the planner's FSDP rules take one ``world_size`` for every unit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["MoEDims", "TINY", "DEEPSEEK_V3", "trainer_config", "parallel_dims_of", "build", "train_step",
           "route", "shard", "fsdp_unit_names"]


@dataclass(frozen=True, kw_only=True)
class MoEDims:
    """The dimensions of a DeepSeek-V3 model (torchtitan's ``_671b`` flavor names them alike)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_dense_layers: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_hidden_dim: int
    moe_hidden_dim: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    score_func: str = "softmax"
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    route_scale: float = 1.0
    route_norm: bool = False


TINY = MoEDims(vocab_size=256, dim=64, n_layers=3, n_dense_layers=1, n_heads=2, q_lora_rank=0,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
               dense_hidden_dim=256, moe_hidden_dim=256, num_experts=8, num_shared_experts=1, top_k=2)
"""Small enough for gloo ranks on a CPU: routed experts' activations are most of the step."""

DEEPSEEK_V3 = MoEDims(vocab_size=129280, dim=7168, n_layers=61, n_dense_layers=3, n_heads=128,
                      q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, dense_hidden_dim=18432, moe_hidden_dim=2048, num_experts=256,
                      num_shared_experts=1, top_k=8, score_func="sigmoid", num_expert_groups=8,
                      num_limited_groups=4, route_scale=2.5, route_norm=True)
"""DeepSeek-V3 (671B): torchtitan's ``_671b`` flavor's dimensions (no multi-token prediction)."""


def _model_config(dims: MoEDims):
    from torch import nn
    from functools import partial

    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.deepseek_v3 import build_mla_moe_layers

    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm = {"weight": nn.init.ones_}

    def depth(layer_id: int) -> dict:
        return {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)), "bias": nn.init.zeros_}

    def experts(layer_id: int) -> dict:
        std = depth_scaled_std(0.02, layer_id)
        return {"w1_EFD": partial(nn.init.trunc_normal_, std=0.02), "w2_EDF": partial(nn.init.trunc_normal_, std=std),
                "w3_EFD": partial(nn.init.trunc_normal_, std=std)}

    layers = build_mla_moe_layers(
        n_layers=dims.n_layers, n_dense_layers=dims.n_dense_layers, dim=dims.dim, n_heads=dims.n_heads,
        q_lora_rank=dims.q_lora_rank, kv_lora_rank=dims.kv_lora_rank, qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim, v_head_dim=dims.v_head_dim, mscale=1.0,
        dense_hidden_dim=dims.dense_hidden_dim, moe_hidden_dim=dims.moe_hidden_dim, num_experts=dims.num_experts,
        num_shared_experts=dims.num_shared_experts, router_top_k=dims.top_k, router_score_func=dims.score_func,
        router_num_expert_groups=dims.num_expert_groups, router_num_limited_groups=dims.num_limited_groups,
        router_route_scale=dims.route_scale, router_route_norm=dims.route_norm, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None, linear_init=linear, norm_init=norm,
        depth_init=depth, depth_experts_init=experts,
        rope=ComplexRoPE.Config(dim=dims.qk_rope_head_dim, max_seq_len=4096 * 4, theta=10000.0, scaling="yarn",
                                rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096))
    for layer in layers:  # FlexAttention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    s = dims.dim ** -0.5
    return DeepSeekV3Model.Config(
        vocab_size=dims.vocab_size, dim=dims.dim, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=dims.vocab_size, embedding_dim=dims.dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dims.dim, param_init=norm),
        lm_head=Linear.Config(in_features=dims.dim, out_features=dims.vocab_size, param_init={
            "weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}))


def trainer_config(dims: MoEDims, *, world: int, ep: int, seq_len: int, batch: int,
                   backend: str = "partial_dtensor"):
    """torchtitan's DeepSeek-V3 ``Trainer.Config`` at ``dims``: EP ``ep`` inside FSDP over
    ``world`` ranks (``dp_shard = world``, as torchtitan borrows EP from it), the SPMD ``backend``
    (``partial_dtensor``, which gloo runs, or ``spmd_types``), and the model config's sharding
    filled in from it."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.parallelism.expert_parallel_degree = ep
    config.parallelism.data_parallel_shard_degree = world
    config.parallelism.spmd_backend = backend
    config.training.seq_len, config.training.local_batch_size = seq_len, batch
    config.model_spec = dataclasses.replace(config.model_spec, model=_model_config(dims), flavor="planner")
    config.model_spec.model.update_from_config(config=config)
    return config


def parallel_dims_of(config, world: int):
    """torchtitan's ParallelDims with its meshes built, on the CPU (its device type is read at
    import: "cuda" where no accelerator is found), in the default process group."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    return parallel_dims


def build(config, parallel_dims, *, meta: bool = False, seed: int = 0) -> torch.nn.Module:
    """The model as torchtitan's Trainer makes it: built on meta and parallelized
    (``model.parallelize``); then, unless ``meta``, materialized and initialized on the CPU."""
    from torchtitan.distributed import utils as dist_utils

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.parallelize(parallel_dims)
    if meta:
        return model
    model.to_empty(device="cpu")
    with torch.no_grad(), dist_utils.get_spmd_context(parallel_dims=parallel_dims)():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def train_step(config, parallel_dims=None, *, seed: int = 0) -> Any:
    """One rank's step: a batch of ``local_batch_size x seq_len`` tokens (from ``seed``), torchtitan's
    cross-entropy over the logits, AdamW as its debugmodel config sets it, run in torchtitan's SPMD
    context of ``parallel_dims`` as its Trainer runs it (the ``spmd_types`` backend needs it)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    from planner import TrainStep

    vocab = config.model_spec.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    shape = (config.training.local_batch_size, config.training.seq_len)
    tokens, labels = (torch.randint(0, vocab, shape, generator=g) for _ in range(2))
    (group,) = config.optimizer.param_groups

    def loss_fn(out, inputs):
        return cross_entropy_loss(out, labels, global_vocab_size=vocab) / labels.numel()

    context = None if parallel_dims is None else dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    return TrainStep(inputs=(tokens,), loss_fn=loss_fn, context=context,
                     optimizer=lambda groups: torch.optim.AdamW(groups, **group.optimizer_kwargs))


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "MoE"]


def route(model: torch.nn.Module, favoured: Sequence[int] | None) -> None:
    """Force every MoE layer's routing. None: torchtitan's balanced round-robin (token ``t``'s
    ``j``-th choice is expert ``(t * top_k + j) % E``). A tuple of ``top_k`` experts: every token
    picks those (the load-balancing bias, which only steers the choice, favours them)."""
    for moe in moe_layers(model):
        router = moe.router
        router._debug_force_load_balance = favoured is None
        if favoured is not None:
            if len(favoured) != router.top_k:
                raise ValueError(f"give {router.top_k} experts (the router's top_k), got {favoured!r}")
            with torch.no_grad():
                moe.expert_bias_E.zero_()
                moe.expert_bias_E[list(favoured)] = 1e4


def fsdp_unit_names(model: torch.nn.Module, root: str) -> list[str]:
    """The modules :func:`shard` makes FSDP units, named as a plan names them."""
    names = [root, *(f"{root}.layers.{i}" for i in model.layers)]
    names += [f"{root}.layers.{i}.moe.routed_experts" for i, b in model.layers.items()
              if getattr(b, "moe_enabled", False)]
    return names


def shard(model: torch.nn.Module, parallel_dims) -> None:
    """FSDP2 with one group size for every unit (see the module docstring): each MoE layer's
    routed experts (their weights EP-sharded over ``ep``) sharded over ``efsdp``, then every block
    and the root sharded over ``ep`` and replicated over ``efsdp`` (HSDP)."""
    from torch.distributed.fsdp import fully_shard

    sparse = parallel_dims.get_mesh(["efsdp", "ep"])
    for block in model.layers.values():
        if getattr(block, "moe_enabled", False):
            fully_shard(block.moe.routed_experts, mesh=sparse["efsdp"])
        fully_shard(block, mesh=sparse)
    fully_shard(model, mesh=sparse)
