"""planner/distributed/ranks.py: two gloo ranks on CPU plan once, hold the same plan, and train with it
under FSDP2: same loss as one unsharded process, measured per-rank peak within 10% of the plan's.

One spawn of two ranks (the ``ranks`` fixture) trains, then tries the bad input; each writes its
results to a file in tmp_path; the parent asserts. The peak is measured with
torch's FSDPMemTracker: like MemTracker it follows DTensor shards (their local storages) and the
``resize_`` calls FSDP2 uses to allocate and free gathered parameters, and it also registers the
unsharded parameters at every pre-forward and labels all-gather / reduce-scatter buffers, which is
what the per-rank model counts (both trackers measured the same peak, to the byte, here).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from estimators.tracing.estimation import estimate
from examples.gpt import GPTConfig, build_gpt
from planner.distributed.fsdp.memory import fsdp_module_info
from planner.format import GiB
from solver import SACMilp
from tests.planner.spawned import leave_rank
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep

WORLD_SIZE = 2
SEED = 1234
# Parameters, gradients and Adam state weigh as much as the activations here, so the per-rank
# peak depends on FSDP's sharding and buffers (without planner/distributed/fsdp/memory.py's rules the prediction
# is 11% low at this budget).
CONFIG = GPTConfig(vocab_size=2048, seq_len=64, n_layer=4, n_head=4, dim=256)
BATCH = 4
UNITS = ["GPT", *(f"GPT.blocks.{i}" for i in range(CONFIG.n_layer))]


def _init(rank: int, tmp: str) -> None:
    store = dist.FileStore(str(Path(tmp) / "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))


def _write(tmp: str, rank: int, result: dict) -> None:
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))


def _read(tmp: Path) -> list[dict]:
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


# ------------------------------------------------------------------------------ the training step
def _train_case(rank: int, tmp: str, budget_gib: float) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    from planner import apply_plan, solve_sac_distributed
    from planner.distributed.fsdp import fsdp_units_of
    from planner.distributed.ranks import plan_hash
    from planner.plan import model_fingerprint

    model, inputs = build_gpt(CONFIG, BATCH)
    plan = solve_sac_distributed(model, budget_gib, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), options=PlanOptions(device="cpu", fsdp_units=UNITS, world_size=WORLD_SIZE))
    fingerprint = model_fingerprint(model)
    # The plan goes on before fully_shard (torchtitan's order): apply_plan resolves module names
    # from type(model).__name__, which fully_shard changes to "FSDPGPT".
    apply_plan(model, plan)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs(inputs)
    torch.manual_seed(SEED)  # same dropout masks as the single-process reference
    peaks = []
    with tracker:
        for i in range(3):  # step 1, then the steady state (Adam's state alive) the plan is made for
            if i:
                opt.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()  # its peak stays; per-module stats refuse a 2nd forward
            out = model(*inputs)
            loss = model.loss_fn(out, inputs)
            del out
            loss.backward()
            opt.step()
            peaks.append(int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
            if i == 0:
                first_loss = loss.detach()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    torch.save(first_loss, Path(tmp) / f"loss{rank}.pt")
    return {
        "hash": plan_hash(plan),
        "checkpointed": list(plan.checkpointed),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": int(peak["Total"]),
        "first_step_peak_bytes": plan.first_step_peak_bytes,
        "measured_first_step_bytes": peaks[0],
        "peak_by_kind": {getattr(k, "value", str(k)): int(v) for k, v in peak.items()},
        "fingerprint_before": fingerprint,
        "fingerprint_after": model_fingerprint(model),
        "units_of": fsdp_units_of(model),
    }


def _budget_and_reference() -> tuple[float, torch.Tensor, int]:
    """A binding per-rank budget (halfway between the smallest reachable and the no-AC peak) and
    the loss of one unsharded, unplanned process with the same seed."""
    model, inputs = build_gpt(CONFIG, BATCH)
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="cpu")
    milp = SACMilp(fsdp_module_info(est.module_info, UNITS, WORLD_SIZE), world_size=WORLD_SIZE,
                   fsdp_units=UNITS)
    high, low = milp.no_ac_peak_bytes, milp.min_reachable_peak_bytes()
    torch.manual_seed(SEED)
    ref = model.loss_fn(model(*inputs), inputs).detach()
    return (low + 0.5 * (high - low)) / GiB, ref, high


def _worker(rank: int, tmp: str, budget_gib: float) -> None:
    _init(rank, tmp)
    result = {"train": _train_case(rank, tmp, budget_gib)}  # first: its peaks are measured on a fresh process
    result["bad_input"] = _bad_input_case(rank)
    _write(tmp, rank, result)
    leave_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """(tmp folder, per-rank results, budget GiB, reference loss, no-AC peak): one spawn of both ranks."""
    tmp = tmp_path_factory.mktemp("ranks")
    budget_gib, ref_loss, no_ac_peak = _budget_and_reference()
    mp.spawn(_worker, args=(str(tmp), budget_gib), nprocs=WORLD_SIZE)
    return tmp, _read(tmp), budget_gib, ref_loss, no_ac_peak


@pytest.mark.multiproc
def test_same_plan_on_every_rank_and_the_prediction_holds(ranks):
    tmp_path, per_rank, budget_gib, ref_loss, no_ac_peak = ranks
    results = [r["train"] for r in per_rank]
    assert len({r["hash"] for r in results}) == 1
    assert results[0]["checkpointed"], "the budget must bind"
    for rank, r in enumerate(results):
        assert r["fingerprint_after"] == r["fingerprint_before"]
        assert r["units_of"] == UNITS
        # The all-gather copies parameters exactly and reduce-scatter runs after the loss.
        assert torch.equal(torch.load(tmp_path / f"loss{rank}.pt"), ref_loss)
        predicted, measured = r["predicted_peak_bytes"], r["measured_peak_bytes"]
        assert predicted <= budget_gib * GiB < no_ac_peak
        print(f"rank {rank} steady {measured} vs {predicted}; first {r['measured_first_step_bytes']} "
              f"vs {r['first_step_peak_bytes']}")
        # Measured on both ranks: usually the prediction is above FSDPMemTracker's peak by 13,202 B
        # in the steady state and 13,312 B in step 1 (0.02 %), from the FSDP rules' stated upper
        # bounds (planner/distributed/fsdp/memory.py). But the measured peaks are not repeatable: in some
        # full-suite runs the steady step measured 57,207,008 B (+277,102 B, 0.49 % OVER the
        # prediction 56,929,906 B) and step 1 40,308,744 B (+290,304 B). The cause is not
        # attributed; asserted: within that measured spread.
        assert -300 * 1024 <= predicted - measured <= 16 * 1024, (rank, predicted, measured, r["peak_by_kind"])
        first, measured_first = r["first_step_peak_bytes"], r["measured_first_step_bytes"]
        # Step 1 (prediction 40,031,752 B) measured 40,018,440 B or 40,308,744 B; asserted within
        # that spread, and below the steady peak that binds the plan.
        assert -300 * 1024 <= first - measured_first <= 16 * 1024, (rank, first, measured_first)
        assert first < predicted and measured_first < measured


# ------------------------------------------------------------------------------ bad input
def _raised(fn) -> list[str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test records what each rank raised
        return [type(e).__name__, str(e), getattr(e, "ranks", None)]
    return None


def _bad_input_case(rank: int) -> dict:
    from planner import solve_sac_distributed
    from planner.distributed.ranks import check_same_plan

    model, inputs = build_gpt(dataclasses.replace(CONFIG, n_layer=2, dim=64, vocab_size=256), 2)

    units = UNITS[:3]  # the root and both blocks

    def solve(budget_gib=1.0, **kw):
        return solve_sac_distributed(model, budget_gib, TrainStep(inputs=inputs, loss_fn=model.loss_fn),
                                     options=PlanOptions(device="cpu", **kw))

    results = {
        "world_size": _raised(lambda: solve(fsdp_units=units, world_size=4)),
        "unknown_unit": _raised(lambda: solve(fsdp_units=["GPT", "GPT.block.0"], world_size=2)),
        "infeasible": _raised(lambda: solve(1e-6, fsdp_units=units)),
    }
    plan = solve(fsdp_units=units)
    edited = dataclasses.replace(plan, budget_bytes=plan.budget_bytes + rank)  # rank 1 edits its copy
    results["hash_mismatch"] = _raised(lambda: check_same_plan(edited))
    dist.barrier()  # every collective above was matched: nothing is left waiting
    return results


@pytest.mark.multiproc
def test_bad_input_raises_the_same_clear_error_on_every_rank(ranks):
    r0, r1 = (r["bad_input"] for r in ranks[1])
    # Checked on every rank, then told to every rank in one all-gather (planner.distributed.agreement).
    assert r0["world_size"] == r1["world_size"] and r0["world_size"][0] == "RankDisagreementError"
    assert r0["world_size"][2] == [0, 1]
    assert "world_size=4 does not match the process group, which has 2 ranks" in r0["world_size"][1]
    # Raised on rank 0 while planning; the other rank gets the same message.
    assert r0["unknown_unit"][0] == "FSDPUnitError" and r1["unknown_unit"][0] == "RemotePlanningError"
    assert r0["unknown_unit"][1] == r1["unknown_unit"][1]
    assert "'GPT.block.0'" in r0["unknown_unit"][1] and "did you mean 'GPT.blocks.0'" in r0["unknown_unit"][1]
    assert r0["infeasible"][0] == "PlanningError" and r1["infeasible"][0] == "RemotePlanningError"
    assert r0["infeasible"][1] == r1["infeasible"][1] and "smallest budget" in r0["infeasible"][1]
    for r in (r0, r1):
        assert r["hash_mismatch"][0] == "PlanHashMismatchError" and r["hash_mismatch"][2] == [1]
        assert "ranks [1] hold a different SAC plan than rank 0" in r["hash_mismatch"][1]


def test_needs_an_initialised_job():
    from planner import solve_sac_distributed

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed job"):
        solve_sac_distributed(torch.nn.Linear(2, 2), 1.0, options=PlanOptions(world_size=2))
