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
    from estimators.step.train_step import split_inputs
    from estimators.tracing.subclasses import local_tensor

    args, kwargs = split_inputs(step.inputs)
    loss = step.loss_fn(model(*args, **kwargs), step.inputs)
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
    planned = model()
    apply_plan(planned, ep.plan)
    grads = _local_grads(planned, step)
    return {"budget": budget, "predicted": ep.peak_bytes, "predicted_first": ep.first_step_peak_bytes,
            "plan_predicted": ep.plan.steady_peak_bytes, "worst": ep.worst_case_peak_bytes,
            "worst_factor": ep.worst_case_capacity_factor, "factor": ep.capacity_factor,
            "received_rows": ep.exchanges[0].received_rows, "measured": _steady_peak(planned, step),
            "checkpointed": list(ep.plan.checkpointed),
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


def hf_qwen2_moe(favoured: tuple[int, ...] | None) -> torch.nn.Module:
    """HF's Qwen2-MoE from a tiny config (2 layers, 8 experts top-2, a gated shared expert) with
    transformers' own expert parallel over the world (``apply_expert_parallelism``, its
    ``base_model_ep_plan``, the ``all_to_all`` implementation: counts exchanged in place with
    ``dist.all_to_all_single``). HF has no knob to force the routing: each router's top-k is taken
    of its logits plus a bias on the favoured experts (None: the balanced round-robin), its
    weights are the softmax at those experts, renormalized."""
    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    class ForcedRouter(Qwen2MoeTopKRouter):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, self.weight)
            probs = logits.softmax(-1, dtype=torch.float)
            _, index = torch.topk(logits.detach() + self.force, self.top_k, dim=-1)
            weights = probs.gather(-1, index)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), index

    config = T.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                              shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = T.Qwen2MoeForCausalLM(config)
    tokens, k, n = BATCH * SEQ, config.num_experts_per_tok, config.num_experts
    force = torch.zeros(tokens, n)
    for t in range(tokens):
        force[t, list(favoured or [(t * k + j) % n for j in range(k)])] = 1e4
    plan = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.__class__ = ForcedRouter
        layer.mlp.gate.register_buffer("force", force, persistent=False)
        plan.update({f"model.layers.{i}.mlp.experts.{w}": "grouped_gemm" for w in ("gate_up_proj", "down_proj")})
        plan[f"model.layers.{i}.mlp.experts"] = "ep_dispatch_experts"
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(), 1), mesh_dim_names=("ep", "tp"))
    return apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")


def hf_case(rank: int, name: str) -> dict:
    """HF's Qwen2-MoE (:func:`hf_qwen2_moe`) under its own EP, the case's routing and load: as
    :func:`ep_case`."""
    from planner import PlanOptions, TrainStep, apply_plan
    from planner.distributed.expert_parallel import ExpertLoad, plan_expert_parallel
    from planner.distributed.ranks import check_same_plan, plan_hash
    from planner.format import GiB

    favoured, factors = CASES[name]
    load = ExpertLoad(capacity_factor=factors)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    step = TrainStep(inputs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, batch: out.loss,
                     optimizer="adamw")
    unplanned = hf_qwen2_moe(favoured[rank])
    budget = _budget(unplanned, step, load)
    ep = plan_expert_parallel(unplanned, budget / GiB, step, options=PlanOptions(reserve_gib=0, expert_load=load))
    reference = _local_grads(unplanned, step)
    planned = hf_qwen2_moe(favoured[rank])
    apply_plan(planned, ep.plan)
    grads = _local_grads(planned, step)
    return {"budget": budget, "predicted": ep.peak_bytes, "worst": ep.worst_case_peak_bytes,
            "worst_factor": ep.worst_case_capacity_factor,
            "factor": ep.capacity_factor, "received_rows": [e.received_rows for e in ep.exchanges],
            "measured": _steady_peak(planned, step),
            "checkpointed": list(ep.plan.checkpointed),
            "bitwise": len(grads) == len(reference) and all(torch.equal(a, b) for a, b in zip(grads, reference)),
            "hash": plan_hash(ep.plan), "common_hash": check_same_plan(ep.plan)}


def worker(rank: int, world: int, tmp: str, names: list[str]) -> None:
    """Each case on this rank, one after the other on one process group: the names of CASES
    (EP = ``world``), "fsdp" (EP 2 x FSDP2), "hf_" and a name of CASES (HF's Qwen2-MoE, EP 2)."""
    from tests.integration.tp_ranks import init, write
    from tests.planner.spawned import leave_rank

    init(rank, world, tmp)
    cases = {"fsdp": lambda: ep_fsdp_case(rank, world)}
    cases.update({f"hf_{name}": (lambda name=name: hf_case(rank, name)) for name in CASES})
    write(tmp, rank, {name: cases[name]() if name in cases else ep_case(rank, world, name) for name in names})
    leave_rank()
