"""Measured gloo collectives on this machine beside the analytic ring model fitted to them.

    python benchmarks/collectives.py              # 2 ranks, 1 KiB .. 64 MiB in powers of 4
    python benchmarks/collectives.py --world-sizes 2 4 --timed-runs 3
    python benchmarks/collectives.py --max-size-kib 1024 --cache collectives_gloo.json

Each world size runs as that many local processes (rendezvous through a FileStore in a temporary
folder, traffic over the loopback interface, 127.0.0.1, only) that time all_gather,
reduce_scatter, all_reduce and broadcast with ``estimators.runtime.collective_bench.CollectiveBenchmark``: per
message size one warm-up, then the median of ``--timed-runs`` runs, a barrier before each, the
largest median over the ranks. ``message_bytes`` is the whole buffer (the gathered output of an
all_gather, the reduced input of a reduce_scatter).

``AnalyticCollectiveModel.fit`` then fits one latency and one bandwidth per collective
(relative-error least squares) to the points of each world size on its own (``--joint-fit``: to
all world sizes at once, which tests the ring factors' dependence on the group size; with more
ranks than cores that dependence is CPU contention, not the ring). Each row prints the
measurement, the model and ``(model - measured) / measured``; the summary gives the fitted
latency and bandwidth and the median absolute relative error per collective.

Runtime is bounded by ``--budget-s`` (split evenly over the world sizes): rank 0 stops starting
new message sizes once its share is spent (the ranks agree through a broadcast), so the run ends
in about that time plus one size per world size (the default stays under 3 minutes). Exit code 0
when every planned size was measured, 1 when the budget cut some off.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from estimators.runtime.collective_bench import CollectiveBenchmark  # noqa: E402
from estimators.runtime.collectives import (  # noqa: E402
    AnalyticCollectiveModel,
    Collective,
    CollectiveFitError,
    CollectivePoint,
)
from planner.format import fmt_bytes  # noqa: E402

KiB = 1024


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def _worker(rank: int, world_size: int, tmp: str, sizes: list[int], args: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    torch.set_num_threads(1)  # the ranks share this machine's cores
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args["timeout_s"]))
    bench = CollectiveBenchmark(timed_runs=args["timed_runs"], timeout_s=args["timeout_s"],
                                cache_path=args["cache"])
    start = time.monotonic()
    done = []
    for nbytes in sizes:
        if not _agree_to_continue(start, args["budget_s"]):
            break
        for c in Collective:
            bench.time_ms(c, nbytes)
        done.append(nbytes)
    if rank == 0:
        points = [p for p in bench.points()
                  if p.group_size == world_size and p.message_bytes in done]
        rows = [(p.collective.value, p.message_bytes, p.runtime_ms) for p in points]
        payload = {"rows": rows, "skipped": [s for s in sizes if s not in done],
                   "runs": bench.runs, "hits": bench.hits}
        Path(tmp, "result.json").write_text(json.dumps(payload))
    dist.destroy_process_group()


def _agree_to_continue(start: float, budget_s: float) -> bool:
    """Rank 0's clock decides for all ranks: a rank that stopped alone would hang the others."""
    flag = torch.tensor([1 if time.monotonic() - start < budget_s else 0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def measure(world_size: int, sizes: list[int], args: dict) -> dict:
    """Run the ranks of one world size; rank 0's measured rows."""
    with tempfile.TemporaryDirectory() as tmp:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, args=(world_size, tmp, sizes, args), nprocs=world_size,
                           start_method=method)
        return json.loads(Path(tmp, "result.json").read_text())


def fit_models(
    points: list[CollectivePoint], joint: bool
) -> dict[int | None, AnalyticCollectiveModel]:
    """One model per world size (key: the size), or one for all (key: None)."""
    if joint:
        return {None: AnalyticCollectiveModel.fit(points)}
    sizes = sorted({p.group_size for p in points})
    return {n: AnalyticCollectiveModel.fit([p for p in points if p.group_size == n]) for n in sizes}


def report(
    points: list[CollectivePoint], models: dict[int | None, AnalyticCollectiveModel]
) -> list[str]:
    lines = [f"{'collective':15s} {'ranks':>5s} {'message':>9s} {'measured ms':>12s} "
             f"{'model ms':>10s} {'rel err':>8s}"]
    errors: dict[tuple[int | None, Collective], list[float]] = {}
    for p in points:
        fit_key = p.group_size if p.group_size in models else None
        predicted = models[fit_key].time_ms(p.collective, p.message_bytes, p.group_size)
        rel = (predicted - p.runtime_ms) / p.runtime_ms
        errors.setdefault((fit_key, p.collective), []).append(abs(rel))
        lines.append(f"{p.collective.value:15s} {p.group_size:5d} "
                     f"{fmt_bytes(p.message_bytes, digits=0):>9s} {p.runtime_ms:12.4f} {predicted:10.4f} "
                     f"{rel:+8.1%}")
    lines += ["", f"{'fit':>5s} {'collective':15s} {'latency us':>11s} {'bandwidth GB/s':>15s} "
                  f"{'median |rel err|':>17s}"]
    for (fit_key, c), errs in errors.items():
        cost = models[fit_key].costs[c]
        label = "all" if fit_key is None else f"n={fit_key}"
        lines.append(f"{label:>5s} {c.value:15s} {cost.latency_s * 1e6:11.1f} "
                     f"{cost.bandwidth_bytes_per_s / 1e9:15.3f} {statistics.median(errs):17.1%}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2],
                   help="local process counts to run, one after another (default: 2)")
    p.add_argument("--min-size-kib", type=int, default=1, help="smallest message (default 1 KiB)")
    p.add_argument("--max-size-kib", type=int, default=64 * KiB,
                   help="largest message (default 65536 KiB = 64 MiB)")
    p.add_argument("--step", type=int, default=4, choices=(2, 4),
                   help="size ratio between rows: powers of 2 or of 4 (default 4)")
    p.add_argument("--timed-runs", type=int, default=5, help="timed runs per point (default 5)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="longest wait for one collective before giving up (default 60)")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="stop starting new sizes after this many seconds in all, split evenly "
                        "over the world sizes (default 120)")
    p.add_argument("--cache", help="JSON cache file of the timings (default: none, all measured)")
    p.add_argument("--joint-fit", action="store_true",
                   help="fit one model to all world sizes (default: one per world size)")
    args = p.parse_args(argv)

    sizes, n = [], args.min_size_kib * KiB
    while n <= args.max_size_kib * KiB:
        sizes.append(n)
        n *= args.step
    opts = {"timed_runs": args.timed_runs, "timeout_s": args.timeout_s,
            "budget_s": args.budget_s / len(args.world_sizes), "cache": args.cache}
    t0 = time.perf_counter()
    points, complete = [], True
    for world_size in args.world_sizes:
        result = measure(world_size, sizes, opts)
        points += [CollectivePoint(collective=Collective(c), message_bytes=b, group_size=world_size,
                                   runtime_ms=ms) for c, b, ms in result["rows"]]
        print(f"world size {world_size}: {result['runs']} collective launches, "
              f"{result['hits']} cache hits")
        if result["skipped"]:
            complete = False
            missed = [fmt_bytes(s, digits=0) for s in result["skipped"]]
            print(f"  budget spent: sizes not measured: {missed}")
    wall = time.perf_counter() - t0
    points.sort(key=lambda q: (list(Collective).index(q.collective), q.group_size, q.message_bytes))
    try:
        models = fit_models(points, args.joint_fit)
    except CollectiveFitError as exc:  # e.g. a budget so small that one size was measured
        print(f"no model: {exc}")
        for q in points:
            print(f"{q.collective.value:15s} {q.group_size:5d} {fmt_bytes(q.message_bytes, digits=0):>9s} "
                  f"{q.runtime_ms:12.4f}")
        return 1
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"gloo on {os.cpu_count()} CPU cores (load average {load}), torch {torch.__version__}, "
          f"loopback; median of {args.timed_runs} runs; model: relative least squares, "
          f"{'one fit for all rows' if args.joint_fit else 'one fit per world size'}")
    print()
    print("\n".join(report(points, models)))
    print(f"\nwall time {wall:.1f} s")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
