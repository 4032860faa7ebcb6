"""planner/distributed/ranks.py with the BENCHMARK runtime: two gloo ranks split the op benchmarks,
merge them, rank 0 plans from the merged timings without timing anything itself, and both ranks
hold the same plan. Workers write their results to files in tmp_path; the parent asserts."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from estimators.runtime.collectives import AnalyticCollectiveModel
from estimators.runtime.device import get_device_spec
from estimators.tracing.estimation import EstimateOptions, estimate
from estimators.runtime.models import RuntimeKind, benchmark_runtime_override
from examples.gpt import GPTConfig, build_gpt
from planner.distributed.fsdp.comm import fsdp_comm_ms
from planner.distributed.fsdp.memory import fsdp_module_info
from planner.format import GiB
from planner.planning.module_plans import module_plan
from solver import SACMilp
from tests.planner.spawned import leave_rank
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep

WORLD_SIZE = 2
CONFIG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, dim=64)
BATCH = 2
UNITS = ["GPT", *(f"GPT.blocks.{i}" for i in range(CONFIG.n_layer))]
BENCH = EstimateOptions(runtime=RuntimeKind.BENCHMARK)


def _init(rank: int, tmp: str) -> None:
    store = dist.FileStore(str(Path(tmp) / "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))


def _rank0_retrace(model, inputs, shared) -> dict:
    """Rank 0's planning trace, repeated with the merged timings: what it measured and priced."""
    runtime = shared.runtime(get_device_spec("cpu"))
    with benchmark_runtime_override(runtime):
        est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="cpu", options=BENCH)
    cached = set(shared.entries.values())
    priced = [op.runtime_ms for op in est.trace.ops if op.runtime_ms != 0.0]
    return {
        "misses": runtime.misses, "measurements": runtime.measurements, "hits": runtime.hits,
        "priced_ops": len(priced), "priced_from_cache": sum(ms in cached for ms in priced),
        "info": est.module_info,
    }


def _worker(rank: int, tmp: str, budget_gib: float) -> None:
    from planner import solve_sac_distributed
    from planner.distributed.ranks import plan_hash
    from planner.distributed.ranks import share_benchmarks

    _init(rank, tmp)
    model, inputs = build_gpt(CONFIG, BATCH)
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam")
    options = PlanOptions(device="cpu", fsdp_units=UNITS, trace=BENCH)
    shared = share_benchmarks(model, step, options=PlanOptions(device="cpu"))
    plan = solve_sac_distributed(model, budget_gib, step, options=options, benchmark=shared)
    result = {
        "signature_count": shared.signature_count,
        "timed_by_rank": [list(keys) for keys in shared.timed_by_rank],
        "entries": len(shared.entries),
        "hash": plan_hash(plan),
        "recompute_ms": plan.recompute_ms,
        "notes": list(plan.notes),
    }
    if rank == 0:
        retrace = _rank0_retrace(model, inputs, shared)
        info = retrace.pop("info")
        result.update(retrace)
        result["recompute_from_info_ms"] = sum(
            module_plan(info.stats(m.fqn), m.discarded_bytes).recompute_ms for m in plan.modules
        )
    # The whole protocol in one call: benchmark split, merge, plan, broadcast, hash check.
    plan2 = solve_sac_distributed(model, budget_gib, step, options=options)
    result["hash2"] = plan_hash(plan2)
    result["notes2"] = list(plan2.notes)
    result["recompute2_ms"] = plan2.recompute_ms
    # A device with a link: the notes carry FSDP's collective time per step (roofline runtime).
    h100 = solve_sac_distributed(model, 70.0, step, options=PlanOptions(device="h100", fsdp_units=UNITS))
    result["notes_h100"] = list(h100.notes)
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
    leave_rank()


def _budget_gib() -> float:
    """A binding per-rank budget: halfway between the smallest reachable and the no-AC peak."""
    model, inputs = build_gpt(CONFIG, BATCH)
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="cpu")
    milp = SACMilp(fsdp_module_info(est.module_info, UNITS, WORLD_SIZE), world_size=WORLD_SIZE,
                   fsdp_units=UNITS)
    high, low = milp.no_ac_peak_bytes, milp.min_reachable_peak_bytes()
    return (low + 0.5 * (high - low)) / GiB


@pytest.mark.multiproc
def test_benchmarks_are_split_merged_and_rank0_plans_from_them(tmp_path):
    # spawn, not fork: the workers run real kernels, and a child forked after the parent used
    # its OpenMP pool can deadlock in its first parallel op (seen in a full-suite run).
    mp.start_processes(_worker, args=(str(tmp_path), _budget_gib()), nprocs=WORLD_SIZE,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE))
    total = r0["signature_count"]
    assert total > 20 and r1["signature_count"] == total
    # Each rank timed about half the distinct signatures, no overlap, together all of them.
    assert r0["timed_by_rank"] == r1["timed_by_rank"]
    mine0, mine1 = map(set, r0["timed_by_rank"])
    assert not mine0 & mine1 and len(mine0) + len(mine1) == total
    assert abs(len(mine0) - len(mine1)) <= 1
    assert r0["entries"] == r1["entries"] <= total  # ops that cannot run alone are not timings
    # Rank 0's planning trace timed nothing: every op it priced came from the merged cache.
    assert r0["misses"] == 0 and r0["measurements"] == 0 and r0["hits"] > 0
    assert r0["priced_from_cache"] == r0["priced_ops"] > 0
    note = next(n for n in r0["notes"] if n.startswith("op timings benchmarked across 2 ranks"))
    assert re.search(r", 0 misses \(0 timed on rank 0, 0 roofline fallbacks\)", note), note
    # Same plan on both ranks; its recompute time is the merged timings' (the budget binds).
    assert r0["hash"] == r1["hash"]
    assert r0["recompute_ms"] > 0
    assert r0["recompute_ms"] == r0["recompute_from_info_ms"]
    # The same through solve_sac_distributed alone, plus the FSDP collective note (no link on cpu).
    assert r0["hash2"] == r1["hash2"] and r0["recompute2_ms"] > 0
    note2 = next(n for n in r0["notes2"] if n.startswith("op timings benchmarked across 2 ranks"))
    assert ", 0 misses (0 timed on rank 0" in note2
    assert any(n.startswith("FSDP collectives: not estimated (device 'cpu'") for n in r0["notes2"])
    # On a device with a link, the notes state FSDP's collective time per step, as fsdp_comm_ms.
    assert r0["notes_h100"] == r1["notes_h100"]
    assert _h100_comm_note() in r0["notes_h100"]


def _h100_comm_note() -> str:
    """The collective note for the h100 plan, computed here in one process."""
    model, inputs = build_gpt(CONFIG, BATCH)
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="h100")
    comm = fsdp_comm_ms(est.module_info, UNITS, WORLD_SIZE, AnalyticCollectiveModel.from_device("h100"))
    assert comm.all_gather_ms > 0 and comm.reduce_scatter_ms > 0
    assert "(analytic:nvlink4;" in comm.note()
    return comm.note()



def test_recorded_signatures_time_once_and_travel_as_timings():
    """The runtime hooks the split uses, in one process: record, time, export, import."""
    import torch

    from estimators.runtime.kernel_bench import BenchmarkRuntime
    from estimators.runtime.op_signatures import SignatureRecorder

    mm, a, b = torch.ops.aten.mm.default, torch.randn(8, 16), torch.randn(16, 4)
    recorder = SignatureRecorder()
    for _ in range(3):
        assert recorder.op_runtime_ms(mm, (a, b), {}, a @ b) == 0.0
    assert recorder.op_runtime_ms(torch.ops.aten.view.default, (a, [128]), {}, a.view(128)) == 0.0
    (sig,) = recorder.signatures()  # one distinct signature; views are free, not recorded
    timer = BenchmarkRuntime(timed_runs=1)
    ms = timer.benchmark_signature(sig)
    assert ms > 0 and timer.measurements == 1 and timer.export_cache() == {sig.key_repr: ms}
    assert timer.benchmark_signature(sig) == ms and timer.measurements == 1  # cached
    planner_rt = BenchmarkRuntime()
    planner_rt.import_cache(timer.export_cache())
    assert planner_rt.op_runtime_ms(mm, (a, b), {}, a @ b) == ms
    assert (planner_rt.hits, planner_rt.misses, planner_rt.measurements) == (1, 0, 0)
