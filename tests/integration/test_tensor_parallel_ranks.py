"""Tensor / sequence parallel plans on real gloo ranks (this CPU): every rank's predicted peak is
MemTracker's measured peak, the plan fits its budget, gradients (local shards) are bitwise those of
the unplanned parallel run, every rank holds the same plan, and the fake process group in one
process makes that same plan (same hash). FSDP2 x TP in torchtitan's order and on a model already
sharded. The workers are in tests/integration/tp_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from estimators.tracing.estimation import estimate
from planner import PlanOptions, solve_sac, tradeoff_curve
from planner.distributed.fake_world import fake_process_group
from planner.distributed.ranks import plan_hash
from planner.format import GiB
from tests.integration import tp_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _read(tmp: Path, world: int) -> list[dict]:
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _budgets_and_fake_hashes(world: int, sp: bool) -> tuple[list[int], list[str]]:
    """Three budgets between the smallest reachable peak and the no-AC peak of rank 0, and the
    plans the fake process group makes for them in this process."""
    with fake_process_group(world_size=world, rank=0):
        model, step = tp_ranks.tp_llama(init_device_mesh("cpu", (world,)), sp)
        table = tradeoff_curve(estimate(model, step))
        lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
        budgets = [int(lo + f * (hi - lo)) for f in (0.1, 0.5, 0.9)]
        hashes = [plan_hash(solve_sac(model, b / GiB, step, options=PlanOptions(reserve_gib=0))) for b in budgets]
    return budgets, hashes


@pytest.mark.parametrize("world, sp", [(2, True), (2, False), (4, True), (4, False)],
                         ids=["tp2-sp", "tp2", "tp4-sp", "tp4"])
def test_every_tp_rank_gets_the_plan_it_measures(tmp_path, one_intra_op_thread, world, sp):
    budgets, fake_hashes = _budgets_and_fake_hashes(world, sp)
    mp.spawn(tp_ranks.tp_worker, args=(world, str(tmp_path), sp, budgets), nprocs=world)
    results = _read(tmp_path, world)
    for rank, r in enumerate(results):
        print(f"rank {rank}: no-AC predicted {r['no_ac_predicted']:,} measured {r['no_ac_measured']:,}")
        assert r["no_ac_predicted"] == r["no_ac_measured"]
        for p, fake_hash in zip(r["plans"], fake_hashes):
            print(f"  budget {p['budget']:,}: predicted {p['predicted']:,} measured {p['measured']:,} "
                  f"{p['checkpointed']} {p['note']} hash {p['hash']}")
            assert p["predicted"] == p["measured"] <= p["budget"]
            assert p["bitwise"], p["note"]
            assert p["hash"] == p["common_hash"] == fake_hash
    assert any(p["checkpointed"] for p in results[0]["plans"]), "the budgets must bind"


@pytest.mark.hf
def test_an_hf_decoder_under_its_own_tp_plan(tmp_path, one_intra_op_thread):
    world = 2
    with fake_process_group(world_size=world, rank=0):
        model, step = tp_ranks.hf_llama(init_device_mesh("cpu", (world,)))
        table = tradeoff_curve(estimate(model, step))
        lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
        budgets = [int(lo + f * (hi - lo)) for f in (0.1, 0.5, 0.9)]
        fake_hashes = [plan_hash(solve_sac(model, b / GiB, step, options=PlanOptions(reserve_gib=0))) for b in budgets]
    mp.spawn(tp_ranks.hf_worker, args=(world, str(tmp_path), budgets), nprocs=world)
    for rank, r in enumerate(_read(tmp_path, world)):
        print(f"rank {rank}: no-AC predicted {r['no_ac_predicted']:,} measured {r['no_ac_measured']:,}")
        assert r["no_ac_predicted"] == r["no_ac_measured"]
        for p, fake_hash in zip(r["plans"], fake_hashes):
            print(f"  budget {p['budget']:,}: predicted {p['predicted']:,} measured {p['measured']:,} {p['note']} "
                  f"hash {p['hash']}")
            assert p["predicted"] == p["measured"] <= p["budget"]
            assert p["bitwise"], p["note"]
            assert p["hash"] == p["common_hash"] == fake_hash


def _fsdp_budgets(world: int, dp: int) -> tuple[list[int], list[str]]:
    """Three per-rank budgets between the FSDP2 x TP floor and no-AC peak, and the plans the fake
    process group makes for them in this process (rank 0)."""
    from planner.distributed.fsdp import fsdp_module_info
    from solver import SACMilp

    with fake_process_group(world_size=world, rank=0):
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        model, step = tp_ranks.tp_llama(mesh["tp"], True)
        units = tp_ranks.fsdp_unit_names(model)
        milp = SACMilp(fsdp_module_info(estimate(model, step).module_info, units, dp), world_size=dp,
                       fsdp_units=units)
        lo, hi = milp.min_reachable_peak_bytes(), milp.no_ac_peak_bytes
        budgets = [int(lo + f * (hi - lo)) for f in (0.1, 0.5, 0.9)]
        options = PlanOptions(reserve_gib=0, world_size=dp, fsdp_units=units)
        hashes = [plan_hash(solve_sac(model, b / GiB, step, options=options)) for b in budgets]
    return budgets, hashes


def test_fsdp_x_tp_in_torchtitan_s_order_and_on_a_sharded_model(tmp_path, one_intra_op_thread):
    world, dp = 4, 2
    budgets, fake_hashes = _fsdp_budgets(world, dp)
    mp.spawn(tp_ranks.fsdp_tp_worker, args=(world, str(tmp_path), dp, budgets), nprocs=world)
    results = _read(tmp_path, world)
    for rank, r in enumerate(results):
        print(f"rank {rank}: no-AC predicted {r['no_ac_predicted']:,} measured {r['no_ac_measured']:,}")
        assert abs(r["no_ac_predicted"] - r["no_ac_measured"]) <= 0.01 * r["no_ac_measured"]
        for p, fake_hash in zip(r["plans"], fake_hashes):
            print(f"  budget {p['budget']:,}: predicted {p['predicted']:,} measured {p['measured']:,} "
                  f"(applied after fully_shard: {p['measured_applied_after_sharding']:,}) "
                  f"{p['checkpointed']} bitwise {p['bitwise']} hash {p['hash']}")
            assert p["predicted"] <= p["budget"]
            for measured in (p["measured"], p["measured_applied_after_sharding"]):
                assert abs(p["predicted"] - measured) <= 0.01 * measured
            assert p["bitwise"], "gradient shards differ from the unplanned FSDP2 x TP run"
            assert p["hash"] == p["common_hash"] == p["hash_from_sharded"] == fake_hash
    assert any(p["checkpointed"] for p in results[0]["plans"]), "the budgets must bind"
