"""Per-rank plans of torchtitan-style layouts, planned in this one process on torch's fake process
group (``planner.distributed.fake_world``): the helper ``benchmarks/plan_large.py --layout`` runs.

A layout is a mesh (``dp`` x ``cp`` x ``tp``), the model built on meta, parallelized as torchtitan
does (``examples.tensor_parallel``: TP + sequence parallel + loss_parallel on ``tp``), FSDP2 over
``dp x cp`` (torchtitan shards over the data and context dims together), and, with ``cp > 1``,
``context_parallel`` over ``cp`` (the sequence split; ring attention traced for a CUDA target).
Rank 0 is planned: with the shapes here every rank of a TP group holds the same shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from estimators.step.train_step import TrainStep
from examples.llama import llama3_70b, llama3_405b
from planner.format import GiB

__all__ = ["Layout", "LAYOUTS", "plan_rank", "RankPlan"]


@dataclass(frozen=True)
class Layout:
    title: str
    build: Callable[..., tuple]
    seq_len: int
    dp: int
    tp: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp


LAYOUTS = {
    "70b-fsdp8-tp8": Layout("Llama-3-70B, FSDP 8 x TP 8 (64 H100s), seq 8192", llama3_70b, 8192, dp=8, tp=8),
    "405b-fsdp64-tp8": Layout("Llama-3.1-405B, FSDP 64 x TP 8 (512 H100s), seq 8192", llama3_405b, 8192,
                              dp=64, tp=8),
    "405b-fsdp4-cp16-tp8": Layout("Llama-3.1-405B, FSDP 4 x CP 16 x TP 8 (512 H100s), seq 131072",
                                  llama3_405b, 131072, dp=4, tp=8, cp=16),
}


@dataclass(frozen=True)
class RankPlan:
    plan: object
    state_bytes: int
    """Sharded parameters, gradients and optimizer state at the no-AC peak, per rank."""
    activation_bytes: int
    """Tensors saved for backward there."""
    other_bytes: int
    """The rest there: FSDP2's gathered units and buffers, temporaries, collective buffers."""
    seconds: float

    @property
    def dominant(self) -> str:
        shares = {
            "sharded state (parameters, gradients, AdamW; shrinks with FSDP x TP)": self.state_bytes,
            "activations (shrink with TP's sequence parallelism and CP; checkpointing discards them)":
                self.activation_bytes,
            "FSDP2's gathered units and buffers, temporaries (shrink with TP)": self.other_bytes,
        }
        return max(shares, key=shares.get)


def plan_rank(layout: Layout, budget_gib: float, device: str, *, layers: int | None = None,
              tensor_parallel: bool = True) -> RankPlan:
    """Plan rank 0 of ``layout`` (``tensor_parallel=False``: the FSDP-only layout of the same ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from estimators.tracing.estimation import estimate
    from examples.tensor_parallel import fsdp_unit_names, parallelize_llama
    from planner.distributed.fake_world import fake_process_group
    from planner.distributed.fsdp import fsdp_module_info
    from planner.planning.solve import default_reserve_bytes, plan_for_budget

    t0 = time.perf_counter()
    tp = layout.tp if tensor_parallel else 1
    dp = layout.world_size // (tp * layout.cp)
    with fake_process_group(world_size=layout.world_size, rank=0):
        mesh = init_device_mesh("cpu", (dp, layout.cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        model, _ = layout.build(seq_len=layout.seq_len)
        if layers is not None:  # a shorter stack of the same layers (for a quick look)
            model.layers = torch.nn.ModuleList(list(model.layers)[:layers])
        local_seq = layout.seq_len // layout.cp
        tokens = torch.randint(0, model.config.vocab_size, (1, local_seq))
        if tp > 1:
            parallelize_llama(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
        context = _context(mesh, layout, tp > 1, loss_parallel)
        step = TrainStep(inputs=(tokens,), loss_fn=model.loss_fn, optimizer="adamw", context=context)
        units = fsdp_unit_names(model)
        fsdp_ranks = dp * layout.cp
        est = estimate(model, step, device=device)
        budget = int(budget_gib * GiB)
        # The MILP's per-rank figure (verify=False): one trace per layout, as the time target asks.
        plan = plan_for_budget(model, est, budget, world_size=fsdp_ranks, fsdp_units=units,
                               reserve_bytes=default_reserve_bytes(est.spec, budget), verify=False)
    # The per-rank no-AC peak point of the memory model the plan was solved on, by share.
    info = fsdp_module_info(est.module_info, units, fsdp_ranks)

    def state(p) -> int:
        return -(-(p.param_bytes + p.grad_bytes + p.optimizer_bytes) // fsdp_ranks)

    top = max(info.memory_points, key=lambda p: state(p) + p.activation_bytes + p.other_bytes)
    return RankPlan(plan=plan, state_bytes=state(top), activation_bytes=top.activation_bytes,
                    other_bytes=top.other_bytes, seconds=time.perf_counter() - t0)


def _context(mesh, layout: Layout, tensor_parallel: bool, loss_parallel):
    """What each micro-batch runs in: loss_parallel with TP, and context_parallel over ``cp``."""
    if layout.cp == 1:
        return loss_parallel if tensor_parallel else None
    import contextlib

    from torch.distributed.tensor.experimental import context_parallel

    def both():
        stack = contextlib.ExitStack()
        if tensor_parallel:
            stack.enter_context(loss_parallel())
        # The inputs are already this rank's chunk; a placeholder buffer satisfies the API.
        stack.enter_context(context_parallel(mesh["cp"], buffers=[torch.zeros(1, layout.seq_len)],
                                             buffer_seq_dims=[1]))
        return stack

    return both
