"""planner/distributed/expert_parallel.py on torch's fake process group: one plan for every rank
of the expert-parallel group, each rank's peak at its own stated load, the worst case beside it;
torchtitan's DeepSeek-V3 at its own dimensions planned per rank in seconds of CPU time."""

from __future__ import annotations

import functools
import os
import time

import pytest

pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan is not installed")

from planner import PlanOptions  # noqa: E402
from planner.distributed.expert_parallel import ExpertLoad, plan_expert_parallel  # noqa: E402
from planner.distributed.fake_world import fake_process_group  # noqa: E402
from planner.distributed.ranks import plan_hash  # noqa: E402
from planner.format import GiB  # noqa: E402

pytestmark = [pytest.mark.slow]


def _plan_rank(dims, world: int, ep: int, rank: int, budget_gib: float, options: PlanOptions, *,
               seq_len: int, batch: int, units: bool = False):
    """Rank ``rank`` of torchtitan's DeepSeek-V3 at ``dims`` (EP ``ep`` of ``world``), built on meta
    and planned; (the result, this process's CPU seconds and wall seconds of the planning alone)."""
    from examples.expert_parallel import build, fsdp_unit_names, parallel_dims_of, train_step, trainer_config

    with fake_process_group(world_size=world, rank=rank):
        config = trainer_config(dims, world=world, ep=ep, seq_len=seq_len, batch=batch)
        model = build(config, parallel_dims_of(config, world), meta=True)
        if units:  # every unit sharded over efsdp (examples.expert_parallel.shard)
            options = options.replace(fsdp_units=fsdp_unit_names(model, "DeepSeekV3Model"), world_size=world // ep)
        cpu, wall = time.thread_time(), time.perf_counter()
        result = plan_expert_parallel(model, budget_gib, train_step(config), options=options)
        return result, time.thread_time() - cpu, time.perf_counter() - wall


@functools.lru_cache(maxsize=None)
def _tiny_rank(rank: int, verify: bool = True):
    """Rank ``rank`` of TINY on EP 2, loads (1.5, 0.5), at 15.5 MB: planned once for the module
    (rank 1's verified plan is both tests' own)."""
    from examples.expert_parallel import TINY

    load = ExpertLoad(capacity_factor=(1.5, 0.5))
    result, _, _ = _plan_rank(TINY, 2, 2, rank, 15_500_000 / GiB,
                              PlanOptions(reserve_gib=0, expert_load=load, verify=verify), seq_len=64, batch=4)
    return result


def test_one_plan_for_every_rank_each_rank_its_own_peak():
    hot, cold = _tiny_rank(0), _tiny_rank(1)
    print(hot.summary(), cold.summary(), sep="\n")
    assert plan_hash(hot.plan) == plan_hash(cold.plan) and hot.plan.checkpointed
    assert hot.planned_capacity_factor == cold.planned_capacity_factor == 1.5
    assert (hot.capacity_factor, cold.capacity_factor) == (1.5, 0.5)
    assert hot.peak_bytes == hot.plan.steady_peak_bytes <= hot.plan.budget_bytes  # planned at its load
    assert cold.peak_bytes < hot.peak_bytes <= hot.worst_case_peak_bytes == cold.worst_case_peak_bytes
    assert hot.worst_case_capacity_factor == 2.0  # EP 2, top-2 of 4 local experts: every row of the group
    assert hot.exchanges[0].received_rows == 3 * cold.exchanges[0].received_rows


def test_without_verification_the_figures_are_the_milp_s():
    traced, milp = _tiny_rank(1), _tiny_rank(1, verify=False)
    print(f"rank 1 at 0.5: traced {traced.peak_bytes:,} MILP {milp.peak_bytes:,}; worst traced "
          f"{traced.worst_case_peak_bytes:,} MILP {milp.worst_case_peak_bytes:,}")
    assert abs(milp.peak_bytes - traced.peak_bytes) <= 0.02 * traced.peak_bytes
    assert abs(milp.worst_case_peak_bytes - traced.worst_case_peak_bytes) <= 0.02 * traced.worst_case_peak_bytes


@pytest.mark.filterwarnings("ignore::estimators.tracing.estimation.HostRandomnessWarning")  # c10d's fake work ids
def test_torchtitan_s_two_backends_trace_alike():
    """``spmd_types`` (torchtitan's default: c10d's list all-to-all, which gloo cannot run unevenly)
    and ``partial_dtensor`` (functional all-to-all) give one peak for each load."""
    from estimators.tracing.estimation import EstimateOptions, estimate
    from examples.expert_parallel import TINY, build, parallel_dims_of, train_step, trainer_config

    peaks = {}
    for backend in ("partial_dtensor", "spmd_types"):
        with fake_process_group(world_size=2, rank=0):
            config = trainer_config(TINY, world=2, ep=2, seq_len=64, batch=4, backend=backend)
            parallel_dims = parallel_dims_of(config, 2)
            model, step = build(config, parallel_dims, meta=True), train_step(config, parallel_dims)
            loads = [EstimateOptions(expert_load=ExpertLoad(capacity_factor=f)) for f in (0.0, 1.5)]
            peaks[backend] = [estimate(model, step, options=o).module_info.peak_bytes for o in loads]
    print(peaks)
    assert peaks["partial_dtensor"] == peaks["spmd_types"] and peaks["spmd_types"][0] < peaks["spmd_types"][1]


def test_deepseek_v3_dims_per_rank_in_seconds():
    """DeepSeek-V3 (61 layers, 256 routed experts, top-8 with group-limited routing, a shared
    expert, MLA) at seq 4096, one sequence a rank, EP 64 x FSDP2 64 (4096 ranks), for an H200 (141 GiB):
    ranks 0 and 4095 planned on the fake group (the MILP's per-rank figures, as benchmarks/
    plan_large.py --layout plans), model build excluded from the time."""
    from examples.expert_parallel import DEEPSEEK_V3

    options = PlanOptions(device="h200", expert_load=ExpertLoad(capacity_factor=1.25), verify=False)
    results = [_plan_rank(DEEPSEEK_V3, 4096, 64, r, 141, options, seq_len=4096, batch=1, units=True)
               for r in (0, 4095)]
    load = os.getloadavg()[0]
    for rank, (r, cpu, wall) in zip((0, 4095), results):
        ex = r.exchanges[0]
        print(f"rank {rank}: {ex.local_experts} of {ex.experts} experts, {ex.routed_rows:,} rows routed, "
              f"{ex.received_rows:,} received; peak {r.peak_bytes / GiB:.2f} GiB (no AC "
              f"{r.plan.baseline_peak_bytes / GiB:.2f}), worst case {r.worst_case_peak_bytes / GiB:.2f} GiB "
              f"(factor {r.worst_case_capacity_factor:g}); planned in {cpu:.1f} s CPU, {wall:.1f} s wall "
              f"(load average {load:.1f})")
        assert ex.received_rows == 1.25 * ex.routed_rows == 1.25 * 4096 * 8
        assert r.peak_bytes <= r.plan.usable_budget_bytes < r.worst_case_peak_bytes
        assert r.worst_case_capacity_factor == 64 * 4 / 8  # top-8, 4 local experts: 4 rows a token
        assert cpu < 60
    assert plan_hash(results[0][0].plan) == plan_hash(results[1][0].plan)
