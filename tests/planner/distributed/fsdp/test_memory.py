"""planner/distributed/fsdp/memory.py: each FSDP2 memory rule on a hand-built ModuleInfo with hand-computed bytes;
unit validation (planner/distributed/fsdp/units.py); one code path for solve_sac and solve_sac_distributed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo
from planner.distributed.fsdp.memory import FSDPExtraBytes, fsdp_extra_bytes, fsdp_module_info
from planner.distributed.fsdp.units import FSDPUnitError
from solver import predict_peak_bytes
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep

# A hand-built step. Root "M" owns an embedding (100 B) and "M.head" (400 B); blocks "M.a" (300 B,
# of which its child "M.a.x" 100 B) and "M.b" (200 B). Gradients are parameter-sized.
#   op  0      M own forward (embedding)          op 10  loss backward (outside modules)
#   ops 1-3    M.a forward (2-3: M.a.x)           op 11  M.head backward
#   ops 4-6    M.b forward                        ops 12-14  M.b backward
#   ops 7-8    M.head forward                     ops 15-17  M.a backward (16-17: M.a.x)
#   op  9      loss (outside modules)             op 18  M own backward (embedding); op 19 optim
_SPANS = {  # fqn: (param bytes, fw_pre, fw_post, bw_pre, bw_post)
    "M": (1000, 0, 9, 11, 18),
    "M.a": (300, 1, 4, 15, 17),
    "M.a.x": (100, 2, 4, 16, 17),
    "M.b": (200, 4, 7, 12, 14),
    "M.head": (400, 7, 9, 11, 11),
}
_POINTS = [  # (op, phase, fqn, grad bytes alive)
    (0, "fw", "M", 0),
    (2, "fw", "M.a.x", 0),
    (5, "fw", "M.b", 0),
    (8, "fw", "M.head", 0),
    (9, "fw", "", 0),
    (10, "bw", "", 0),
    (11, "bw", "M.head", 400),
    (13, "bw", "M.b", 500),
    (16, "bw", "M.a.x", 700),  # head 400 + b 200 + a.x 100 so far
    (18, "bw", "M", 1000),
    (19, "optim", "", 1000),
]
_ACT, _OTHER, _OPT = 64, 8, 2000


def _info() -> ModuleInfo:
    stats = tuple(
        ModStats(fqn=f, is_leaf=f in ("M.a.x", "M.b", "M.head"), param_bytes=pb, grad_bytes=pb,
                 fw_pre_op=a, fw_post_op=b, bw_pre_op=c, bw_post_op=d)
        for f, (pb, a, b, c, d) in _SPANS.items()
    )
    points = tuple(
        MemoryPoint(op_index=op, phase=ph, fqn=f, param_bytes=1000, grad_bytes=g,
                    optimizer_bytes=_OPT if ph == "optim" else 0, activation_bytes=_ACT, other_bytes=_OTHER)
        for op, ph, f, g in _POINTS
    )
    names = tuple(_SPANS)
    order = ModOrder(fw_pre_order=names, fw_post_order=names, bw_pre_order=names, bw_post_order=names)
    return ModuleInfo(mod_order=order, mod_stats=stats, memory_points=points)


UNITS = ["M", "M.a", "M.b"]


def _extras(units=UNITS, world_size=2) -> dict[int, FSDPExtraBytes]:
    info = _info()
    return {p.op_index: e for p, e in zip(info.memory_points, fsdp_extra_bytes(info, units, world_size))}


def test_r1_sharded_state_stays_for_the_solver_and_only_other_bytes_grow():
    info = _info()
    new = fsdp_module_info(info, UNITS, 2)
    extras = fsdp_extra_bytes(info, UNITS, 2)
    for old, p, e in zip(info.memory_points, new.memory_points, extras):
        state = (p.param_bytes, p.grad_bytes, p.optimizer_bytes)
        assert state == (old.param_bytes, old.grad_bytes, old.optimizer_bytes)
        assert p.other_bytes == old.other_bytes + e.total_bytes
    # The optimizer step: everything 1/W, nothing added: (1000 + 1000 + 2000) / 2 + 64 + 8.
    assert extras[-1] == FSDPExtraBytes()
    assert new.mod_stats == info.mod_stats and new.peak_bytes == info.peak_bytes


def test_r2_root_stays_gathered_through_forward_and_backward():
    ex = _extras()
    root_own = 1000 - 300 - 200  # embedding 100 + head 400
    assert ex[9].unsharded_param_bytes == root_own  # the loss: outside every module
    assert ex[10].unsharded_param_bytes == root_own  # loss backward
    assert ex[18].unsharded_param_bytes == root_own
    assert ex[19].unsharded_param_bytes == 0  # resharded in the final backward callback


def test_r3_running_units_are_gathered_with_nested_units_counted_once():
    ex = _extras()
    assert ex[2].unsharded_param_bytes == 500 + 300  # root + M.a (M.a.x is not a unit)
    assert ex[5].unsharded_param_bytes == 500 + 200
    assert ex[13].unsharded_param_bytes == 500 + 200
    nested = _extras(["M", "M.a", "M.a.x", "M.b"])
    assert nested[2].unsharded_param_bytes == 500 + 200 + 100  # M.a owns 300 - 100
    assert nested[16].unsharded_param_bytes == 500 + 200 + 100


def test_r4_forward_keeps_the_last_all_gather_output_until_the_next_copy_out():
    ex = _extras()
    assert ex[0].all_gather_buffer_bytes == 500  # the root's own, until M.a's copy-out
    assert ex[2].all_gather_buffer_bytes == 300
    assert ex[8].all_gather_buffer_bytes == 200  # M.b's, until the root's post-forward
    assert ex[9].all_gather_buffer_bytes == 0
    assert all(e.all_gather_buffer_bytes == 0 for e in _extras(world_size=1).values())


def test_r5_backward_prefetches_the_previous_unit_in_post_forward_order():
    ex = _extras()
    assert ex[10].all_gather_buffer_bytes == 0  # before the root's pre-backward
    assert ex[11].all_gather_buffer_bytes == 200  # the root prefetched M.b
    assert ex[13].all_gather_buffer_bytes == 300  # M.b prefetched M.a
    assert ex[16].all_gather_buffer_bytes == 0  # M.a is first: nothing left to prefetch
    assert ex[18].all_gather_buffer_bytes == 0


def test_r6_reduce_scatter_input_is_held_until_the_next_post_backward():
    ex = _extras()
    assert ex[13].reduce_scatter_buffer_bytes == 0
    assert ex[16].reduce_scatter_buffer_bytes == 200  # M.b's gradients
    assert ex[18].reduce_scatter_buffer_bytes == 300  # M.a's, until the root's final callback
    assert _extras(world_size=1)[16].reduce_scatter_buffer_bytes == 200  # W = 1 still copies


def test_r7_gradients_are_unsharded_until_their_reduce_scatter():
    ex = _extras()
    assert ex[11].unsharded_grad_bytes == 400 - 400 // 2  # head (root) gradient
    assert ex[16].unsharded_grad_bytes == 500 - 500 // 2  # 700 traced, M.b's 200 already sharded
    assert ex[18].unsharded_grad_bytes == 500 - 500 // 2  # 1000 traced, M.a + M.b sharded
    assert _extras(world_size=3)[16].unsharded_grad_bytes == 500 - 500 // 3
    assert _extras(world_size=1)[16].unsharded_grad_bytes == 0
    assert ex[19].unsharded_grad_bytes == 0


def test_r7a_kept_gradients_are_sharded_and_the_new_ones_are_extra():
    info = _info()
    kept = dataclasses.replace(info, memory_points=tuple(
        dataclasses.replace(p, grad_bytes=1000) for p in info.memory_points))
    ex = {p.op_index: e for p, e in zip(kept.memory_points, fsdp_extra_bytes(kept, UNITS, 2))}
    assert ex[2].unsharded_grad_bytes == 0  # forward: only the kept (sharded) gradients
    assert ex[10].unsharded_grad_bytes == 0  # before the root's backward starts
    assert ex[11].unsharded_grad_bytes == 500  # the root's own, new, until the end of backward
    assert ex[13].unsharded_grad_bytes == 500 + 200  # and M.b's while its backward runs
    assert ex[16].unsharded_grad_bytes == 500 + 300
    assert ex[19].unsharded_grad_bytes == 0


def test_r7a_counts_the_gradients_written_so_far_less_the_units_reduced():
    """With the trace's written gradients recorded, R7a is exact: a unit's new gradients are
    extra once written, until its reduce-scatter; the root's until the end of backward."""
    info = _info()
    kept = dataclasses.replace(info, memory_points=tuple(
        dataclasses.replace(p, grad_bytes=1000, grad_written_bytes=g)
        for p, (_, _, _, g) in zip(info.memory_points, _POINTS)))
    ex = {p.op_index: e for p, e in zip(kept.memory_points, fsdp_extra_bytes(kept, UNITS, 2))}
    assert ex[2].unsharded_grad_bytes == 0
    assert ex[11].unsharded_grad_bytes == 400  # M.head's (the root's) written, the embedding's not yet
    assert ex[13].unsharded_grad_bytes == 500  # and 100 of M.b's so far
    assert ex[16].unsharded_grad_bytes == 700 - 200  # M.b reduced at op 14
    assert ex[18].unsharded_grad_bytes == 1000 - 200 - 300  # the root's own 500
    assert ex[19].unsharded_grad_bytes == 0


@pytest.mark.slow
def test_with_accumulation_the_chosen_points_hold_the_per_rank_peak_of_every_op():
    """A traced Llama with gradient accumulation, FSDP2 over every layer and the root on 4 ranks:
    the per-rank peak at the ModuleInfo's points equals the peak over every op of the trace
    (a unit's gradients grow op by op in its backward, so the points split there)."""
    from examples.llama import LlamaConfig, build_llama
    from estimators.tracing.aggregate import points_at
    from estimators.tracing.estimation import estimate

    model, _ = build_llama(LlamaConfig(vocab_size=256, seq_len=32, n_layers=3, dim=64, n_heads=8,
                                       n_kv_heads=4, ffn_dim=128), batch_size=1, device="meta")
    x = torch.zeros(1, 32, dtype=torch.long, device="meta")
    est = estimate(model, TrainStep(inputs=(x,), loss_fn=model.loss_fn, optimizer="adamw", micro_batches=2),
                   device="cpu")
    units = ["Llama", *(f"Llama.layers.{i}" for i in range(3))]
    every = dataclasses.replace(est.module_info, memory_points=tuple(
        points_at(est.trace, est.timeline, range(len(est.trace.ops)))))
    chosen, full = (predict_peak_bytes(fsdp_module_info(i, units, 4), {}, world_size=4)
                    for i in (est.module_info, every))
    assert chosen == full
    assert any(p.grad_written_bytes for p in est.module_info.memory_points)


def test_r8_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    full = _extras()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    info = _info()
    half = {p.op_index: e for p, e in zip(info.memory_points, fsdp_extra_bytes(info, UNITS, 2, mp_policy=bf16))}
    assert half[2].unsharded_param_bytes == (500 + 300) // 2
    assert half[13].all_gather_buffer_bytes == 300 // 2
    assert half[16].reduce_scatter_buffer_bytes == 200 // 2  # reduce_dtype defaults to param_dtype
    assert half[16].unsharded_grad_bytes == 500 // 2 - 500 // 2  # bf16 unsharded, solver counts 1/W
    fp32_reduce = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = {p.op_index: e for p, e in zip(info.memory_points, fsdp_extra_bytes(info, UNITS, 2, mp_policy=fp32_reduce))}
    assert mixed[16].reduce_scatter_buffer_bytes == full[16].reduce_scatter_buffer_bytes == 200
    assert fsdp_extra_bytes(info, UNITS, 2, mp_policy=MixedPrecisionPolicy()) == fsdp_extra_bytes(info, UNITS, 2)


def test_the_unchanged_solver_gets_the_per_rank_peak():
    info = fsdp_module_info(_info(), UNITS, 2)
    # Op 16: (1000 + 700) / 2 + 64 + 8 + root 500 + M.a 300 + RS(M.b) 200 + grads 250 = 2172.
    # Op 13: (1000 + 500) / 2 + 72 + 700 + prefetch 300 + grads (500 - 250) = 2072.
    assert predict_peak_bytes(info, {}, world_size=2) == 2172
    assert predict_peak_bytes(_info(), {}, world_size=2) == (1000 + 2000 + 1000) // 2 + 72


def test_unknown_units_name_the_close_ones():
    with pytest.raises(FSDPUnitError, match=r"'M\.c'.*not a module.*did you mean 'M\.b', 'M\.a'"):
        fsdp_module_info(_info(), ["M", "M.c"], 2)
    with pytest.raises(FSDPUnitError, match="must include the root 'M'"):
        fsdp_module_info(_info(), ["M.a", "M.b"], 2)
    with pytest.raises(FSDPUnitError, match="not the string"):
        fsdp_module_info(_info(), "M", 2)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        fsdp_module_info(_info(), UNITS, bad)


# ------------------------------------------------------------------------------ one code path
_SPAWN_UNITS = ["GPT", "GPT.blocks.0", "GPT.blocks.1"]


def _planning_worker(rank: int, tmp: str, budget_gib: float) -> None:
    import datetime
    import json
    from pathlib import Path

    import torch.distributed as dist

    from examples import EXAMPLES
    from planner import solve_sac_distributed
    from tests.planner.spawned import leave_rank

    store = dist.FileStore(str(Path(tmp) / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model, inputs = EXAMPLES["gpt_tiny"]()
    plan = solve_sac_distributed(model, budget_gib, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"), options=PlanOptions(fsdp_units=_SPAWN_UNITS))
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(plan.to_dict()))
    dist.barrier()  # neither rank tears gloo down while the other may still use the connection
    leave_rank()  # destroys the group; see tests/planner/spawned.py


@pytest.mark.multiproc
def test_solve_sac_counts_fsdp_like_solve_sac_distributed(tmp_path):
    import json

    import torch.multiprocessing as mp

    from estimators.tracing.estimation import estimate
    from examples import EXAMPLES
    from planner import solve_sac
    from planner.format import GiB
    from solver import SACMilp

    model, inputs = EXAMPLES["gpt_tiny"]()
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"))
    milp = SACMilp(fsdp_module_info(est.module_info, _SPAWN_UNITS, 2), world_size=2, fsdp_units=_SPAWN_UNITS)
    budget_gib = (milp.min_reachable_peak_bytes() + milp.no_ac_peak_bytes) / 2 / GiB
    mp.spawn(_planning_worker, args=(str(tmp_path), budget_gib), nprocs=2)
    distributed = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    local = solve_sac(model, budget_gib, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"), options=PlanOptions(world_size=2, fsdp_units=_SPAWN_UNITS))
    assert local.modules, "the budget must bind"
    for d in distributed:
        assert d["predicted_peak_bytes"] == local.predicted_peak_bytes
        assert (d["first_step_peak_bytes"], d["steady_peak_bytes"]) == (local.first_step_peak_bytes, local.steady_peak_bytes)
        assert [m["fqn"] for m in d["modules"]] == list(local.checkpointed)
    # The units are counted, not only used to restrict candidates: FSDP2's gathered parameters
    # and buffers make the per-rank no-AC peak higher than sharding alone.
    sharded_only = SACMilp(est.module_info, world_size=2).no_ac_peak_bytes
    assert local.baseline_peak_bytes == milp.no_ac_peak_bytes > sharded_only
