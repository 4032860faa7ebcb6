"""Workers for tests/planner/integrations/test_torchtitan_tp.py: torchtitan's Llama3 (debugmodel
flavor, 2 layers) tensor-parallel on real gloo ranks, planned per rank and checkpointed through
torchtitan's own activation-checkpointing config. Top-level functions, so spawn can start them;
each rank runs every backend asked for, one after the other on one process group, writes
``<tmp>/rank<r>.json`` and leaves through ``tests.planner.spawned.leave_rank``."""

from __future__ import annotations

from pathlib import Path

import torch

SEQ, BATCH, LAYERS = 64, 4, 2
BACKENDS = ("spmd_types", "partial_dtensor")
"""torchtitan's SPMD backends for TP: ``spmd_types`` (its default: plain local tensors, functional
collectives) and ``partial_dtensor`` (DTensor parameters and activations on the TP axis)."""


def trainer_config(world: int, backend: str):
    """torchtitan's debugmodel Trainer.Config at TP=``world`` (sequence parallel on, its default),
    cut to LAYERS layers with SDPA inner attention (FlexAttention has no CPU backward), and the
    model config's sharding filled in from it as the Trainer does (``update_from_config``)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.tensor_parallel_degree = world
    config.parallelism.spmd_backend = backend
    config.training.seq_len, config.training.local_batch_size = SEQ, BATCH
    model_config = config.model_spec.model
    model_config.layers = model_config.layers[:LAYERS]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.update_from_config(config=config)
    return config


def parallel_dims_of(config, world: int):
    """torchtitan's ParallelDims and device mesh, on the CPU (its device type is read at import:
    "cuda" where no accelerator is found)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    return parallel_dims


def build(config, parallel_dims, context, ac_config=None):
    """The model as torchtitan's Trainer makes it: built on meta, TP-parallelized and given
    ``ac_config``'s checkpointing as ``parallelize_llama`` does (``model.parallelize``, then
    ``ac_config.build(dump_folder=...).apply(model)``), then materialized and initialized. The
    FSDP wrapping ``parallelize_llama`` ends with is left out: its FSDP degree here is 1."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=config.dump_folder).apply(model)
    model.to_empty(device="cpu")
    with torch.no_grad(), context():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def train_step(config, context):
    """torchtitan's step: its vocab-parallel cross-entropy on the Shard(-1) logits, normalized by
    the token count, its debugmodel AdamW, forward and backward inside the Trainer's train context."""
    from torchtitan.components.loss import cross_entropy_loss

    from estimators.step.train_step import TrainStep

    vocab = config.model_spec.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(2))
    (group,) = config.optimizer.param_groups  # debugmodel: one catch-all AdamW group
    assert group.optimizer_name == "AdamW", group.optimizer_name
    return TrainStep(
        inputs=(tokens,),
        loss_fn=lambda out, inputs: cross_entropy_loss(out, labels, global_vocab_size=vocab) / labels.numel(),
        optimizer=lambda groups: torch.optim.AdamW(groups, **group.optimizer_kwargs),
        context=context)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_grads(model, step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward: the loss and this rank's gradient shards by parameter name
    (FullAC's wrapper prefix dropped), then the gradients are cleared."""
    with step.context():
        loss = step.loss_fn(model(*step.inputs), step.inputs)
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): _local(p.grad).clone()
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach().clone(), grads


def worker(rank: int, world: int, tmp: str, backends: list[str]) -> None:
    """Each backend's case on this rank; writes ``{backend: result}``."""
    from tests.integration.tp_ranks import init, write
    from tests.planner.spawned import leave_rank

    init(rank, world, tmp)
    write(tmp, rank, {backend: case(rank, world, tmp, backend) for backend in backends})
    leave_rank()


def case(rank: int, world: int, tmp: str, backend: str) -> dict:
    """Plan this rank (no AC yet, as torchtitan applies AC after TP), save the plan, apply it
    through ``PlannedAC.Config``; measure 3 AdamW steps; compare gradients with FullAC's."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC

    from estimators.tracing.estimation import estimate
    from planner import PlanOptions
    from planner.analysis.measure import measure_steps
    from planner.distributed.ranks import check_same_plan
    from planner.format import GiB
    from planner.integrations.torchtitan import PlannedAC
    from planner.planning.solve import solve_sac
    from solver import SACMilp

    config = trainer_config(world, backend)
    parallel_dims = parallel_dims_of(config, world)
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    step = train_step(config, context)

    model = build(config, parallel_dims, context)
    info = estimate(model, step).module_info
    floor = SACMilp(info).min_reachable_peak_bytes()
    budget = (floor + info.peak_bytes) // 2
    plan = solve_sac(model, budget / GiB, step, options=PlanOptions(reserve_gib=0))
    common_hash = check_same_plan(plan)
    path = str(Path(tmp) / f"plan{rank}-{backend}.json")
    plan.save(path)
    del model

    config.activation_checkpoint = PlannedAC.Config(plan_path=path)
    planned = build(config, parallel_dims, context, config.activation_checkpoint)
    full = build(config, parallel_dims, context, FullAC.Config())
    none = build(config, parallel_dims, context)
    ref = {name: local_grads(m, step) for name, m in (("planned", planned), ("full", full), ("none", none))}
    del full, none
    peaks = [m.peak_bytes for m in measure_steps(planned, step, n_steps=3)]

    def equal(other: str) -> bool:
        (loss, grads), (other_loss, other_grads) = ref["planned"], ref[other]
        return (torch.equal(loss, other_loss) and grads.keys() == other_grads.keys()
                and all(torch.equal(g, other_grads[n]) for n, g in grads.items()))

    return {"floor": floor, "no_ac": info.peak_bytes, "budget": budget,
            "predicted_steady": plan.steady_peak_bytes, "predicted_first": plan.first_step_peak_bytes,
            "measured": peaks, "checkpointed": [m.fqn for m in plan.modules], "hash": common_hash,
            "equal_full": equal("full"), "equal_none": equal("none"), "n_grads": len(ref["planned"][1])}
