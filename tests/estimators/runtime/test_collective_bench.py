"""estimators/runtime/collective_bench.py: real 2-rank gloo benchmarks, the cache file, failures, polling.

The gloo tests fork two processes (fork, not spawn: a spawned child re-imports torch, seconds on a
small machine) that rendezvous through a FileStore and talk over the loopback interface only.
"""

import datetime
import json
import math
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from estimators.runtime.collective_bench import (
    CollectiveBenchmark,
    CollectiveCacheError,
    CollectiveError,
    CollectiveTimeoutError,
    _poll,
    _PollTimeout,
)
from estimators.runtime.collectives import Collective, bucket_bytes

AR = Collective.ALL_REDUCE

# ----------------------------------------------------------------------------- benchmark, no group


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="timed_runs must be >= 1"):
        CollectiveBenchmark(timed_runs=0)


def test_no_process_group_gives_none():
    assert not dist.is_initialized(), "a test before this one left a process group behind"
    bench = CollectiveBenchmark()
    assert bench.time_ms(AR, 4096) is None
    assert (bench.hits, bench.misses, bench.runs, bench.skipped) == (0, 0, 0, 1)


def test_fake_process_group_gives_none_without_a_launch():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        bench = CollectiveBenchmark()
        assert all(bench.time_ms(c, 2**20) is None for c in Collective)
        assert (bench.misses, bench.runs, bench.skipped) == (0, 0, len(Collective))
    finally:
        dist.destroy_process_group()


def test_corrupt_or_foreign_cache_file_is_refused(tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    with pytest.raises(CollectiveCacheError, match="unreadable"):
        CollectiveBenchmark(cache_path=corrupt)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"format": "sac-planner/benchmark-cache", "version": 1}))
    with pytest.raises(CollectiveCacheError, match="not a collective benchmark cache"):
        CollectiveBenchmark(cache_path=foreign)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "sac-planner/collective-benchmark-cache", "version": 0}))
    with pytest.raises(CollectiveCacheError, match="version 0"):
        CollectiveBenchmark(cache_path=old)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "sac-planner/collective-benchmark-cache", "version": 1,
                               "entries": {"gloo:cpu:float32|all_gather|2|1024": -1}}))
    with pytest.raises(CollectiveCacheError, match="malformed"):
        CollectiveBenchmark(cache_path=bad)


# ----------------------------------------------------------------------------- benchmark, gloo


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def _init_gloo(rank: int, tmp: str, timeout_s: float) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # 127.0.0.1 only
    torch.set_num_threads(1)  # as DataLoader workers do: the parent's OpenMP pool died in the fork
    store = dist.FileStore(os.path.join(tmp, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _run_ranks(worker, tmp, *args, limit_s: float = 60.0) -> list[dict]:
    """Run ``worker(rank, tmp, *args)`` on 2 forked ranks; what each wrote to rank{r}.json."""
    ctx = mp.start_processes(worker, args=(str(tmp), *args), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"2-rank gloo test still running after {limit_s} s")
    files = [tmp / f"rank{r}.json" for r in range(2)]
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


SIZES = (1000, 70_000, 1_000_000)  # buckets 1 KiB, 128 KiB, 1 MiB
TIMED_RUNS = 3


def _benchmark_worker(rank: int, tmp: str) -> None:
    _init_gloo(rank, tmp, timeout_s=30)
    cache = os.path.join(tmp, "cache.json")
    bench = CollectiveBenchmark(timed_runs=TIMED_RUNS, timeout_s=20, cache_path=cache)
    measured = {f"{c.value}/{b}": bench.time_ms(c, b) for c in Collective for b in SIZES}
    after_misses = (bench.hits, bench.misses, bench.runs)
    # Same power-of-two buckets (1024, 131072, 1048576): answered without a launch.
    again = {f"{c.value}/{b}": bench.time_ms(c, bucket_bytes(b) - 3) for c in Collective
             for b in SIZES}
    after_hits = (bench.hits, bench.misses, bench.runs)
    dist.barrier()  # both ranks saved before anyone reloads
    reloaded = CollectiveBenchmark(timed_runs=TIMED_RUNS, timeout_s=20, cache_path=cache)
    from_disk = {f"{c.value}/{b}": reloaded.time_ms(c, b) for c in Collective for b in SIZES}
    result = {
        "measured": measured, "again": again, "from_disk": from_disk,
        "after_misses": after_misses, "after_hits": after_hits,
        "reloaded": (reloaded.hits, reloaded.misses, reloaded.runs),
        "points": len(reloaded.points()),
    }
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_gloo_two_ranks_benchmark_cache_and_disk_round_trip(tmp_path):
    results = _run_ranks(_benchmark_worker, tmp_path)
    n_keys = len(Collective) * len(SIZES)
    for r in results:
        assert all(ms > 0 and math.isfinite(ms) for ms in r["measured"].values())
        # One warm-up and TIMED_RUNS timed launches per miss, nothing else counted.
        assert r["after_misses"] == [0, n_keys, n_keys * (1 + TIMED_RUNS)]
        assert r["after_hits"] == [n_keys, n_keys, n_keys * (1 + TIMED_RUNS)]
        assert r["again"] == r["measured"]
        assert r["reloaded"] == [n_keys, 0, 0]
        assert r["from_disk"] == r["measured"]
        assert r["points"] == n_keys
    # The ranks agree (largest median), so every rank prices the plan alike.
    assert results[0]["measured"] == results[1]["measured"]
    saved = json.loads((tmp_path / "cache.json").read_text())
    assert saved["format"] == "sac-planner/collective-benchmark-cache" and saved["version"] == 1
    assert "gloo:cpu:float32|all_gather|2|1024" in saved["entries"]


def _absent_peer_worker(rank: int, tmp: str, peer: str) -> None:
    _init_gloo(rank, tmp, timeout_s=30)  # the group's own timeout is long: ours must fire
    done, ready = os.path.join(tmp, "rank0.json"), os.path.join(tmp, "rank0_ready")
    if rank == 0:
        _write_json(ready, {})
    if rank == 1:
        if peer == "exits":
            # Die only once rank 0's side of the group is up: dying during gloo's connect makes
            # rank 0's init fail instead (seen 1 run in 12 before this wait).
            _wait_for(ready)
            os._exit(0)
        deadline = time.monotonic() + 30  # alive but never joining, until rank 0 has its answer
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    bench = CollectiveBenchmark(timed_runs=2, timeout_s=2.0)
    start = time.monotonic()
    try:
        bench.time_ms(AR, 4096)
        outcome = {"error": None}
    except CollectiveError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["elapsed_s"] = time.monotonic() - start
    _write_json(done, outcome)
    os._exit(0)  # the group is broken: skip its teardown


def _wait_for(path: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


@pytest.mark.multiproc
def test_rank_that_never_joins_times_out(tmp_path):
    outcome = _run_ranks(_absent_peer_worker, tmp_path, "sleeps")[0]
    assert outcome["error"] == CollectiveTimeoutError.__name__
    assert 1.5 < outcome["elapsed_s"] < 6.0
    for word in ("all_reduce", "4096-byte", "2 ranks", "timeout of 2 s"):
        assert word in outcome["message"]


@pytest.mark.multiproc
def test_rank_that_dies_fails_fast(tmp_path):
    outcome = _run_ranks(_absent_peer_worker, tmp_path, "exits")[0]
    # gloo sees the closed connection at once (a CollectiveError), or the wait times out.
    assert outcome["error"] in (CollectiveError.__name__, CollectiveTimeoutError.__name__)
    assert outcome["elapsed_s"] < 6.0
    assert "all_reduce" in outcome["message"]


class _WorkDoneAt:
    """A Work whose collective completes at a given monotonic time."""

    def __init__(self, done_at: float):
        self.done_at, self.checks = done_at, 0

    def is_completed(self) -> bool:
        self.checks += 1
        return time.monotonic() >= self.done_at

    def wait(self) -> None:
        pass


class _FakeClock:
    """time.monotonic / time.sleep on a simulated clock: each reading costs ``tick_s`` (a spin
    check), each sleep advances it by exactly what was asked. The poll's schedule is then checked
    without depending on how busy the machine is."""

    def __init__(self, tick_s: float = 1e-6):
        self.now, self.tick_s, self.sleeps = 1000.0, tick_s, []

    def monotonic(self) -> float:
        self.now += self.tick_s
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_poll_sleeps_instead_of_spinning_and_returns_soon_after_completion(monkeypatch):
    import estimators.runtime.collective_bench as cb

    clock = _FakeClock()
    monkeypatch.setattr(cb.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(cb.time, "sleep", clock.sleep)
    wait_s = 0.3
    start = clock.now
    work = _WorkDoneAt(start + wait_s)
    monkeypatch.setattr(time, "monotonic", clock.monotonic)  # the work reads the same clock
    _poll(work, timeout_s=5.0)
    late_s = clock.now - work.done_at
    # Spins only for the first few ms (one check per tick), then sleeps 1/64 of the time waited,
    # at most 10 ms: a handful of sleeps, each within that bound, and it notices within one sleep.
    spin_checks = cb._SPIN_S / (2 * clock.tick_s)
    # A spin over the whole wait would check wait_s / (2 * tick_s) = 150,000 times.
    assert work.checks < spin_checks + 400 and 0 < len(clock.sleeps) < 400
    assert all(s <= min(wait_s * cb._SLEEP_FRACTION, cb._SLEEP_MAX_S) + 1e-12 for s in clock.sleeps)
    assert 0 <= late_s <= min(wait_s * cb._SLEEP_FRACTION, cb._SLEEP_MAX_S) + 1e-3


def test_poll_times_out():
    with pytest.raises(_PollTimeout):
        _poll(_WorkDoneAt(time.monotonic() + 60), timeout_s=0.05)
