"""planner/distributed/agreement.py: ranks compare what they were asked, and every rank raises
the same error, naming the ranks, within seconds (torch's default group timeout is 30 minutes).
Both tests of one world size read one spawn of ranks (``ranks_of``): ``agree`` alone, then
through ``solve_sac_distributed``, on one process group."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.planner.spawned import leave_rank, run_ranks

pytestmark = pytest.mark.multiproc


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int) -> None:
    # torch's default timeout (30 min): nothing here may rely on it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


_CASES = ("same", "budget", "refused")


def _agree_cases(rank: int, world_size: int) -> dict:
    from planner.distributed.agreement import agree

    results = {}
    for case in _CASES:  # one group: each failed agreement leaves nothing pending
        fields = {"budget_gib": "0.5", "model": "GPT (fingerprint abc)"}
        error = None
        if case == "budget" and rank in (1, 3):
            fields["budget_gib"] = {1: "0.25", 3: "0.125"}[rank]
        if case == "refused" and rank == world_size - 1:
            error = ValueError("budget_gib must be a positive finite number of GiB, got nan")
        dist.barrier()
        t0 = time.monotonic()
        try:
            agree("the arguments", fields, error, None)
            results[case] = None
        except Exception as e:  # noqa: BLE001 - recorded for the parent
            results[case] = [type(e).__name__, str(e), e.ranks, time.monotonic() - t0]
    return results


def _worker(rank: int, world_size: int, port: int, tmp: str) -> None:
    _init(rank, world_size, port)
    results = {"agree": _agree_cases(rank, world_size), "solve": _solve_cases(rank, world_size)}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))
    leave_rank()


@pytest.fixture(scope="module")
def ranks_of(tmp_path_factory):
    """world_size -> [per-rank {"agree": ..., "solve": ...}], from one spawn per world size."""
    done = {}

    def run(world_size: int) -> list[dict]:
        if world_size not in done:
            tmp = tmp_path_factory.mktemp(f"world{world_size}")
            run_ranks(_worker, world_size, (world_size, _port(), str(tmp)), timeout_s=420)
            done[world_size] = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
        return done[world_size]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_raises_the_same_error_at_once(ranks_of, world_size):
    per_rank = [r["agree"] for r in ranks_of(world_size)]
    assert [r["same"] for r in per_rank] == [None] * world_size
    for case in ("budget", "refused"):
        results = [r[case] for r in per_rank]
        assert len({(r[0], r[1]) for r in results}) == 1  # the same error on every rank
        assert results[0][0] == "RankDisagreementError" and all(r[3] < 30 for r in results)
    _, message, ranks, _ = per_rank[0]["budget"]
    assert ranks == ([1] if world_size == 2 else [1, 3])
    tail = "0.25 on rank 1" + ("; 0.125 on rank 3" if world_size == 4 else "")
    first = "0.5 on rank 0" if world_size == 2 else "0.5 on ranks 0, 2"
    assert f"budget_gib: {first}; {tail}" in message
    _, message, ranks, _ = per_rank[0]["refused"]
    last = world_size - 1
    assert ranks == [last]
    assert (f"the arguments failed on rank {last} (rank {last}: ValueError: budget_gib must be a "
            "positive finite number of GiB, got nan)") in message


# ------------------------------------------------------------------ through solve_sac_distributed
_DISAGREE = ("same", "budget", "nan budget", "optimizer", "model", "loss differs", "loss raises")
"""\"same\" first: it plans, so the traces after it do not pay the first trace's imports and set-up."""
_RAISE = False  # set on the rank whose loss raises


def _loss(out, batch):
    if _RAISE:  # the same function on every rank, raising on one (its data, say)
        raise ValueError("this rank's loss raises")
    return out.square().mean()


def _other_loss(out, batch):
    return out.abs().mean()


def _solve_cases(rank: int, world_size: int) -> dict:
    import torch

    from planner import PlanOptions, TrainStep
    from planner.distributed.ranks import plan_hash, solve_sac_distributed

    global _RAISE
    odd = rank == world_size - 1  # the rank that disagrees
    results = {}
    for case in _DISAGREE:
        _RAISE = case == "loss raises" and odd
        torch.manual_seed(0)
        width = 48 if case == "model" and odd else 32
        model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
        budget = {"budget": 0.25, "nan budget": float("nan")}.get(case, 0.5) if odd else 0.5
        step = TrainStep(inputs=(torch.randn(64, 16),), optimizer="sgd" if case == "optimizer" and odd else "adamw",
                         loss_fn=_other_loss if case == "loss differs" and odd else _loss)
        dist.barrier()
        t0 = time.monotonic()
        try:
            plan = solve_sac_distributed(model, budget, step, options=PlanOptions(device="cpu"))
            results[case] = ["plan", plan_hash(plan), None, time.monotonic() - t0]
        except Exception as e:  # noqa: BLE001 - recorded for the parent
            results[case] = [type(e).__name__, str(e), getattr(e, "ranks", None), time.monotonic() - t0]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_way_of_disagreeing_stops_every_rank_with_the_same_error(ranks_of, world_size):
    # Before: a rank given another budget (or NaN), optimizer or model silently got rank 0's
    # plan (another model then failed later, on that rank only); a rank whose loss raised, or
    # whose arguments were refused, left the others waiting for the group's timeout (30 min).
    per_rank = [r["solve"] for r in ranks_of(world_size)]
    odd = world_size - 1
    expected = {
        "budget": ("ranks were asked for different plans (the arguments): budget_gib: 0.5 on "
                   f"{'rank 0' if world_size == 2 else 'ranks 0, 1, 2'}; 0.25 on rank {odd}"),
        "nan budget": f"the arguments failed on rank {odd} (rank {odd}: PlanningError: budget_gib must be",
        "optimizer": f"step.optimizer: adamw on {'rank 0' if world_size == 2 else 'ranks 0, 1, 2'}; sgd on rank {odd}",
        "model": "model: Sequential (fingerprint ",
        "loss differs": "step.loss_fn: tests.planner.distributed.test_agreement._loss on ",
        "loss raises": f"the traced step failed on rank {odd} (rank {odd}: ValueError: this rank's loss raises)",
    }
    for case, text in expected.items():
        results = [r[case] for r in per_rank]
        assert len({(r[0], r[1]) for r in results}) == 1, case  # the same error on every rank
        name, message, ranks, _ = results[0]
        assert name == "RankDisagreementError" and ranks == [odd], (case, message)
        assert text in message, (case, message)
        assert max(r[3] for r in results) < 30, case
    assert "this rank's loss raises" in per_rank[0]["loss raises"][1]
    same = [r["same"] for r in per_rank]
    assert all(r[0] == "plan" for r in same) and len({r[1] for r in same}) == 1
