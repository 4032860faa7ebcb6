"""Tensor / sequence parallel plans on real gloo ranks (this CPU): every rank's predicted peak is
MemTracker's measured peak, the plan fits its budget, gradients (local shards) are bitwise those of
the unplanned parallel run, every rank holds the same plan, and the fake process group in one
process makes that same plan (same hash). FSDP2 x TP in torchtitan's order and on a model already
sharded. The workers are in tests/integration/tp_ranks.py; the layouts of one world size (the HF
decoder's among the world-2 ones) run on one spawn of ranks (module fixture), each test asserts
its own (``--dist loadfile`` keeps them on one worker: split over two, each would spawn the
ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from planner import PlanOptions, tradeoff_curve
from planner.distributed.fake_world import fake_process_group
from planner.distributed.ranks import plan_hash
from planner.format import GiB
from planner.planning.solve import plan_estimate
from tests.integration import tp_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.hf]  # the world-2 spawn plans the HF decoder too

FRACTIONS = (0.1, 0.5)
"""Budgets between the smallest reachable and the no-AC peak: a tight one (several modules
checkpointed) and a middle one. A third at 0.9 checkpointed the same modules as 0.5 (tp2-sp)."""


def _read(tmp: Path, world: int) -> list:
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _budgets_and_fake_hashes(model, step, options: PlanOptions) -> tuple[list[int], list[str]]:
    """Budgets at FRACTIONS between the smallest reachable peak and the no-AC peak of rank 0, and
    the hashes of the plans solve_sac makes for them in this process (one trace, as solve_sac's)."""
    est = tp_ranks.trace_as_solve_sac(model, step, options)
    table = tradeoff_curve(est)
    lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
    budgets = [int(lo + f * (hi - lo)) for f in FRACTIONS]
    return budgets, [plan_hash(plan_estimate(model, est, b / GiB, options=options)) for b in budgets]


def _tp_case(world: int, sp: bool) -> tuple[tuple, list[str]]:
    with fake_process_group(world_size=world, rank=0):
        model, step = tp_ranks.tp_llama(init_device_mesh("cpu", (world,)), sp)
        budgets, hashes = _budgets_and_fake_hashes(model, step, PlanOptions(reserve_gib=0))
    return ("tp", sp, budgets), hashes


def _fsdp_case(world: int, dp: int) -> tuple[tuple, list[str]]:
    """One per-rank budget halfway between the FSDP2 x TP floor and no-AC peak (the no-AC row is
    measured too), and the plan the fake process group makes for it in this process (rank 0)."""
    from planner.distributed.fsdp import fsdp_module_info
    from solver import SACMilp

    with fake_process_group(world_size=world, rank=0):
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        model, step = tp_ranks.tp_llama(mesh["tp"], True)
        units = tp_ranks.fsdp_unit_names(model)
        options = PlanOptions(reserve_gib=0, world_size=dp, fsdp_units=units)
        est = tp_ranks.trace_as_solve_sac(model, step, options)
        milp = SACMilp(fsdp_module_info(est.module_info, units, dp), world_size=dp, fsdp_units=units)
        lo, hi = milp.min_reachable_peak_bytes(), milp.no_ac_peak_bytes
        budgets = [int(lo + 0.5 * (hi - lo))]
        hashes = [plan_hash(plan_estimate(model, est, b / GiB, options=options)) for b in budgets]
    return ("fsdp", dp, budgets), hashes


def _hf_case(world: int) -> tuple[tuple, list[str]]:
    with fake_process_group(world_size=world, rank=0):
        model, step = tp_ranks.hf_llama(init_device_mesh("cpu", (world,)))
        budgets, hashes = _budgets_and_fake_hashes(model, step, PlanOptions(reserve_gib=0))
    return ("hf", None, budgets), hashes


_LAYOUTS = {2: {"tp2-sp": lambda: _tp_case(2, True), "tp2": lambda: _tp_case(2, False), "hf": lambda: _hf_case(2)},
            4: {"tp4-sp": lambda: _tp_case(4, True), "tp4": lambda: _tp_case(4, False),
                "fsdp2xtp2": lambda: _fsdp_case(4, 2)}}


@pytest.fixture(scope="module")
def ranks_of(tmp_path_factory):
    """world -> {layout: (per-rank results, fake hashes)}: each world size's layouts run on one
    spawn of ranks, the first time a test asks for them."""
    done = {}

    def run(world: int) -> dict:
        if world not in done:
            names = list(_LAYOUTS[world])
            cases, hashes = zip(*(_LAYOUTS[world][n]() for n in names))
            tmp = tmp_path_factory.mktemp(f"world{world}")
            mp.spawn(tp_ranks.layouts_worker, args=(world, str(tmp), list(cases)), nprocs=world)
            per_rank = _read(tmp, world)
            done[world] = {n: ([r[i] for r in per_rank], hashes[i]) for i, n in enumerate(names)}
        return done[world]

    return run


def _check_plans(results: list[dict], fake_hashes: list[str]) -> None:
    for rank, r in enumerate(results):
        print(f"rank {rank}: no-AC predicted {r['no_ac_predicted']:,} measured {r['no_ac_measured']:,}")
        assert r["no_ac_predicted"] == r["no_ac_measured"]
        assert len(r["plans"]) == len(fake_hashes)
        for p, fake_hash in zip(r["plans"], fake_hashes):
            print(f"  budget {p['budget']:,}: predicted {p['predicted']:,} measured {p['measured']:,} "
                  f"{p['checkpointed']} {p['note']} hash {p['hash']}")
            assert p["predicted"] == p["measured"] <= p["budget"]
            assert p["bitwise"], p["note"]
            assert p["hash"] == p["common_hash"] == fake_hash


@pytest.mark.parametrize("world, layout", [(2, "tp2-sp"), (2, "tp2"), (4, "tp4-sp"), (4, "tp4")],
                         ids=["tp2-sp", "tp2", "tp4-sp", "tp4"])
def test_every_tp_rank_gets_the_plan_it_measures(ranks_of, one_intra_op_thread, world, layout):
    results, fake_hashes = ranks_of(world)[layout]
    _check_plans(results, fake_hashes)
    assert any(p["checkpointed"] for p in results[0]["plans"]), "the budgets must bind"


@pytest.mark.hf
def test_an_hf_decoder_under_its_own_tp_plan(ranks_of, one_intra_op_thread):
    _check_plans(*ranks_of(2)["hf"])


def test_fsdp_x_tp_in_torchtitan_s_order_and_on_a_sharded_model(ranks_of, one_intra_op_thread):
    results, fake_hashes = ranks_of(4)["fsdp2xtp2"]
    for rank, r in enumerate(results):
        print(f"rank {rank}: no-AC predicted {r['no_ac_predicted']:,} measured {r['no_ac_measured']:,}")
        assert abs(r["no_ac_predicted"] - r["no_ac_measured"]) <= 0.01 * r["no_ac_measured"]
        assert len(r["plans"]) == len(fake_hashes)
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
