"""Workers for the expert-parallel rank tests (tests/integration/test_expert_parallel_ranks.py):
torchtitan's DeepSeek-V3 (examples/expert_parallel.py, TINY dims) under EP on real gloo ranks,
planned with ``plan_expert_parallel`` at the load each case states, measured over 3 AdamW steps
with its routing forced to that load. Top-level functions, so ``torch.multiprocessing.spawn`` can
start them; each rank writes ``<tmp>/rank<r>.json`` and leaves through
``tests.planner.spawned.leave_rank``."""

from __future__ import annotations

import torch

SEQ, BATCH = 64, 4
ROOT = "DeepSeekV3Model"
CASES = {
    # name: (the experts each rank's tokens pick (None: torchtitan's balanced round-robin), load)
    "balanced": ((None, None), (1.0, 1.0)),
    # rank 0's tokens pick experts 0 and 1 (both on rank 0), rank 1's 0 and 4 (one each): rank 0
    # receives 2 T + T = 1.5 x the balanced 2 T rows, rank 1 receives T = 0.5 x.
    "skewed": (((0, 1), (0, 4)), (1.5, 0.5)),
    # every token picks experts 0 and 1: rank 0 receives every row of the group, the worst case.
    "extreme": (((0, 1), (0, 1)), (2.0, 0.0)),
}
"""TINY: 8 experts, top_k 2, EP 2 (4 experts a rank), T = BATCH x SEQ tokens a rank."""


def _budget(model, step, load) -> int:
    """Halfway between the smallest reachable peak and the no-AC peak at the planned load."""
    from estimators.tracing.estimation import EstimateOptions, estimate
    from solver import SACMilp

    info = estimate(model, step, options=EstimateOptions(expert_load=load.planned())).module_info
    low = SACMilp(info).min_reachable_peak_bytes()
    return int(low + 0.5 * (info.peak_bytes - low))


def _local_grads(model, step) -> list[torch.Tensor]:
    """One forward and backward: the loss and this rank's gradient shards (then cleared)."""
    from estimators.tracing.subclasses import local_tensor

    loss = step.loss_fn(model(*step.inputs), step.inputs)
    loss.backward()
    grads = [local_tensor(p.grad).clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [loss.detach().clone(), *grads]


def _steady_peak(model, step) -> int:
    from planner.analysis.measure import measure_steps

    return max(s.peak_bytes for s in measure_steps(model, step, n_steps=3)[1:])


def ep_case(rank: int, world: int, name: str) -> dict:
    """EP = ``world``: the plan for the case's load, this rank's predicted peak, worst case,
    measured steady peak with the routing forced, gradients against the unplanned run."""
    from examples.expert_parallel import TINY, build, parallel_dims_of, route, train_step, trainer_config
    from planner import PlanOptions, apply_plan
    from planner.distributed.expert_parallel import ExpertLoad, plan_expert_parallel
    from planner.distributed.ranks import check_same_plan, plan_hash
    from planner.format import GiB

    favoured, factors = CASES[name]
    load = ExpertLoad(capacity_factor=factors)
    config = trainer_config(TINY, world=world, ep=world, seq_len=SEQ, batch=BATCH)
    parallel_dims = parallel_dims_of(config, world)
    step = train_step(config, seed=rank)  # each rank its own batch, as data parallel feeds EP

    def model():
        m = build(config, parallel_dims)
        route(m, favoured[rank])
        return m

    unplanned = model()
    budget = _budget(unplanned, step, load)
    ep = plan_expert_parallel(unplanned, budget / GiB, step, options=PlanOptions(reserve_gib=0, expert_load=load))
    reference = _local_grads(unplanned, step)
    no_ac = _steady_peak(unplanned, step)
    planned = model()
    apply_plan(planned, ep.plan)
    grads = _local_grads(planned, step)
    return {"budget": budget, "predicted": ep.peak_bytes, "predicted_first": ep.first_step_peak_bytes,
            "plan_predicted": ep.plan.steady_peak_bytes, "worst": ep.worst_case_peak_bytes,
            "worst_factor": ep.worst_case_capacity_factor, "factor": ep.capacity_factor,
            "received_rows": ep.exchanges[0].received_rows, "measured": _steady_peak(planned, step),
            "no_ac_measured": no_ac, "checkpointed": list(ep.plan.checkpointed),
            "bitwise": len(grads) == len(reference) and all(torch.equal(a, b) for a, b in zip(grads, reference)),
            "hash": plan_hash(ep.plan), "common_hash": check_same_plan(ep.plan)}


def ep_fsdp_case(rank: int, world: int) -> dict:
    """EP 2 x FSDP2 over ``world`` ranks (examples.expert_parallel.shard: every unit sharded over
    2), balanced routing, in torchtitan's order: parallelize, plan and apply, then fully_shard.
    MemTracker's steady peak per rank against the plan; gradient shards against the unplanned
    EP x FSDP2 run."""
    from examples.expert_parallel import (TINY, build, fsdp_unit_names, parallel_dims_of, route, shard,
                                          train_step, trainer_config)
    from planner import PlanOptions, apply_plan
    from planner.distributed.expert_parallel import ExpertLoad, plan_expert_parallel
    from planner.distributed.fsdp import fsdp_module_info
    from planner.distributed.ranks import check_same_plan, plan_hash
    from planner.format import GiB
    from estimators.tracing.estimation import EstimateOptions, estimate
    from solver import SACMilp

    ep = 2
    config = trainer_config(TINY, world=world, ep=ep, seq_len=SEQ, batch=BATCH)
    parallel_dims = parallel_dims_of(config, world)
    step = train_step(config, seed=rank)
    load = ExpertLoad()

    def model():
        m = build(config, parallel_dims)
        route(m, None)
        return m

    unplanned = model()
    units, fsdp_world = fsdp_unit_names(unplanned, ROOT), world // ep
    info = estimate(unplanned, step, options=EstimateOptions(expert_load=load)).module_info
    milp = SACMilp(fsdp_module_info(info, units, fsdp_world), world_size=fsdp_world, fsdp_units=units)
    low, high = milp.min_reachable_peak_bytes(), milp.no_ac_peak_bytes
    budget = int(low + 0.5 * (high - low))
    options = PlanOptions(reserve_gib=0, expert_load=load, world_size=fsdp_world, fsdp_units=units)
    plan = plan_expert_parallel(unplanned, budget / GiB, step, options=options)
    shard(unplanned, parallel_dims)
    reference = _local_grads(unplanned, step)
    no_ac = _steady_peak(unplanned, step)
    planned = model()
    apply_plan(planned, plan.plan)  # torchtitan's order: parallelize, AC, then fully_shard
    shard(planned, parallel_dims)
    grads = _local_grads(planned, step)
    return {"budget": budget, "no_ac_predicted": high, "no_ac_measured": no_ac, "predicted": plan.peak_bytes,
            "worst": plan.worst_case_peak_bytes, "measured": _steady_peak(planned, step),
            "checkpointed": list(plan.plan.checkpointed),
            "bitwise": len(grads) == len(reference) and all(torch.equal(a, b) for a, b in zip(grads, reference)),
            "hash": plan_hash(plan.plan), "common_hash": check_same_plan(plan.plan)}


def worker(rank: int, world: int, tmp: str, names: list[str]) -> None:
    """Each case on this rank, one after the other on one process group: the names of CASES
    (EP = ``world``), "fsdp" (EP 2 x FSDP2)."""
    from tests.integration.tp_ranks import init, write
    from tests.planner.spawned import leave_rank

    init(rank, world, tmp)
    write(tmp, rank, {name: ep_fsdp_case(rank, world) if name == "fsdp" else ep_case(rank, world, name)
                      for name in names})
    leave_rank()
