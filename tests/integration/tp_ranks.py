"""Workers for the tensor-parallel rank tests (tests/integration/test_tensor_parallel_ranks.py):
top-level functions, so ``torch.multiprocessing.spawn`` can start them. Each writes its results
to ``<tmp>/rank<r>.json`` and leaves through ``tests.planner.spawned.leave_rank``."""

from __future__ import annotations

import datetime
import faulthandler
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from examples.llama import LlamaConfig, build_llama
from examples.tensor_parallel import fsdp_unit_names, parallelize_llama, shard_llama
from planner import PlanOptions, TrainStep, apply_plan, check_gradients, solve_sac
from planner.distributed.ranks import check_same_plan, plan_hash
from planner.format import GiB

DEADLINE_S = 900
"""A rank still running after this long prints its stack and exits (the test then fails): a
rank stuck outside a collective never outlives the test run (gloo's own timeout covers those inside)."""
CONFIG = LlamaConfig(vocab_size=512, seq_len=64, n_layers=2, dim=128, n_heads=8, n_kv_heads=4, ffn_dim=256)
BATCH = 4


def tp_llama(mesh, sequence_parallel: bool, *, loss_parallel_on: bool = True):
    """The decoder parallelized as torchtitan does, and its training step (AdamW, loss_parallel)."""
    model, inputs = build_llama(CONFIG, batch_size=BATCH)
    parallelize_llama(model, mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel_on)
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw",
                     context=loss_parallel if loss_parallel_on else None)
    return model, step


def init(rank: int, world: int, tmp: str) -> None:
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def write(tmp: str, rank: int, result: dict) -> None:
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))


def measured_peak(model, step) -> int:
    from planner.analysis import measure_steps

    return max(s.peak_bytes for s in measure_steps(model, step, n_steps=3)[1:])  # steady state


def trace_as_solve_sac(model, step, options: PlanOptions):
    """The estimate ``solve_sac(model, ..., step, options=options)`` traces: ``plan_estimate`` on it
    makes solve_sac's plan for any budget without tracing the step again."""
    from estimators.tracing.estimation import estimate
    from planner.applying.checkpointing import hf_cache_off

    with hf_cache_off(model):
        return estimate(model, step, device=options.spec, options=options.trace)


def plans_measured(model, step, budgets: list[int]) -> dict:
    """This rank's no-AC prediction and measurement, then its plan at each budget: predicted and
    measured peak, gradients against the unplanned run, its hash and the hash every rank agreed
    on. The first budget is planned by ``solve_sac`` itself, the others by ``plan_estimate`` on
    the estimate solve_sac traces (one trace per rank; the hashes show it is the same plan)."""
    from planner.planning.solve import plan_estimate

    options = PlanOptions(reserve_gib=0)
    est = trace_as_solve_sac(model, step, options)
    result = {"no_ac_predicted": est.module_info.peak_bytes, "no_ac_measured": measured_peak(model, step),
              "plans": []}
    for i, budget in enumerate(budgets):
        plan = (solve_sac(model, budget / GiB, step, options=options) if i == 0
                else plan_estimate(model, est, budget / GiB, options=options))
        same = check_same_plan(plan)  # all-gathers every rank's hash; raises if one differs
        with apply_plan(model, plan):
            measured = measured_peak(model, step)
        check = check_gradients(model, plan)
        result["plans"].append({"budget": budget, "predicted": plan.predicted_peak_bytes, "measured": measured,
                                "hash": plan_hash(plan), "common_hash": same, "checkpointed": list(plan.checkpointed),
                                "bitwise": check.equal, "note": check.note})
    return result


def layouts_worker(rank: int, world: int, tmp: str, cases: list[tuple]) -> None:
    """Several layouts on one spawn of ranks (the spawn and imports cost as much as a layout):
    ``("tp", sequence_parallel, budgets)`` plans a TP decoder on all ``world`` ranks,
    ``("fsdp", dp, budgets)`` FSDP2 x TP on a (dp, world // dp) mesh, ``("hf", None, budgets)``
    the HF decoder under its own tp_plan. Writes one result per case, in order."""
    from tests.planner.spawned import leave_rank

    init(rank, world, tmp)
    results = []
    for kind, arg, budgets in cases:
        if kind == "tp":
            results.append(plans_measured(*tp_llama(init_device_mesh("cpu", (world,)), arg), budgets))
        elif kind == "hf":
            results.append(plans_measured(*hf_llama(init_device_mesh("cpu", (world,))), budgets))
        else:
            results.append(fsdp_tp_case(world, arg, budgets))
    write(tmp, rank, results)
    leave_rank()


def fsdp_tp_case(world: int, dp: int, budgets: list[int]) -> dict:
    """FSDP2 x TP in torchtitan's order (TP, then the plan, then fully_shard); the same plan made
    again from the sharded model; FSDPMemTracker's steady-state peak per rank."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from estimators.tracing.estimation import estimate

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)

    def measure(model, step) -> int:
        opt = torch.optim.AdamW(model.parameters())
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(step.inputs)
        with tracker:
            for i in range(3):
                if i:
                    opt.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
                with loss_parallel():
                    step.loss_fn(model(*step.inputs), step.inputs).backward()
                opt.step()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])

    def local_grads(model, step) -> list:
        """One forward and backward: the loss and this rank's gradient shards (then dropped)."""
        with loss_parallel():
            loss = step.loss_fn(model(*step.inputs), step.inputs)
            loss.backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [loss.to_local().detach().clone(), *grads]

    unplanned, step = tp_llama(mesh["tp"], True)
    shard_llama(unplanned, mesh["dp"])
    reference = local_grads(unplanned, step)
    result = {"plans": []}
    for budget in [None, *budgets]:
        model, step = tp_llama(mesh["tp"], True)
        units = fsdp_unit_names(model)
        options = PlanOptions(reserve_gib=0, world_size=dp, fsdp_units=units)
        if budget is None:  # no AC: the trace with the FSDP rules
            from planner.distributed.fsdp import fsdp_module_info
            from solver import predict_peak_bytes

            info = fsdp_module_info(estimate(model, step).module_info, units, dp)
            result["no_ac_predicted"] = predict_peak_bytes(info, {}, world_size=dp)
            shard_llama(model, mesh["dp"])
            result["no_ac_measured"] = measure(model, step)
            continue
        plan = solve_sac(model, budget / GiB, step, options=options)  # before fully_shard
        apply_plan(model, plan)  # torchtitan's order: parallelize, AC, then fully_shard
        shard_llama(model, mesh["dp"])
        grads = local_grads(model, step)
        measured = measure(model, step)
        sharded, _ = tp_llama(mesh["tp"], True)
        shard_llama(sharded, mesh["dp"])
        again = solve_sac(sharded, budget / GiB, step, options=PlanOptions(reserve_gib=0))  # units read from it
        apply_plan(sharded, plan)  # a plan applied to a model already sharded
        result["plans"].append({"budget": budget, "predicted": plan.predicted_peak_bytes, "measured": measured,
                                "measured_applied_after_sharding": measure(sharded, step),
                                "bitwise": len(grads) == len(reference) and all(
                                    torch.equal(a, b) for a, b in zip(grads, reference)),
                                "checkpointed": list(plan.checkpointed),
                                "hash": plan_hash(plan), "hash_from_sharded": plan_hash(again),
                                "common_hash": check_same_plan(plan)})
    return result


def hf_llama(mesh):
    """An HF transformers Llama from a small config, parallelized by its own ``tp_plan`` (what
    ``from_pretrained(..., tp_plan=...)`` applies), and its training step."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = HFLlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=mesh.size()))
    apply_tensor_parallelism(model, mesh, tp_plan)
    ids = torch.randint(0, config.vocab_size, (BATCH, 64), generator=torch.Generator().manual_seed(1))
    return model, TrainStep(inputs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss,
                            optimizer="adamw")
