"""Recompute-only vs keep / recompute / offload on the traced Llama-3-70B step (fake mode).

    python benchmarks/offload_70b.py                        # 64 ranks, h100, 10 budgets
    python benchmarks/offload_70b.py --info-cache /tmp/70b.json   # trace once, reuse after

Model and FSDP2 units as ``benchmarks/plan_large.py`` (80 layers + root, steady state, AdamW,
seq 4096, bf16). For 10 budgets between the smallest reachable peak and the no-AC peak it prints,
side by side:

* recompute-only, as the planner solves it today (``SACMilp``: least recompute time), costed on
  the step timeline (``estimators/contract/timeline.py``: compute, FSDP2 collectives, copies);
* keep / recompute / offload (``solver/offload/milp.py``: least step time on that timeline,
  within ``--three-way-time-limit-s``, with the recompute-only plan as its incumbent as
  ``planner.planning.offload_solve`` does: HiGHS starts from it, an overshooting plan is repaired with
  its binaries fixed; where the backend's best plan is slower, or none was found in time, the
  incumbent is returned and marked); ``--compare-cold`` also solves each budget as before
  the warm start and the repair existed, printed above it;

with each plan's predicted step time, recompute, exposed copy and exposed comm time, bytes on
host, and solve time per budget (the model build, shared by all budgets, printed once). PASS
lines: three-way step <= recompute-only step at every budget; solve <= 5 s per budget.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimators.runtime.collectives import AnalyticCollectiveModel  # noqa: E402
from estimators.runtime.device import get_device_spec  # noqa: E402
from estimators.contract.module_info import ModuleInfo  # noqa: E402
from estimators.contract.timeline import UnitComm, step_layout  # noqa: E402
from planner.planning.baselines import find_blocks  # noqa: E402
from planner.distributed.fsdp import fsdp_comm_ms, fsdp_module_info  # noqa: E402
from solver import SACMilp, SolverOptions  # noqa: E402
from solver.errors import InfeasibleBudgetError  # noqa: E402
from solver.offload.milp import OffloadMilp  # noqa: E402

GiB = 2**30


def traced_info(seq_len: int, device: str, cache: str | None) -> ModuleInfo:
    if cache and Path(cache).exists():
        return ModuleInfo.from_json(cache)
    from estimators import estimate
    from estimators.step.train_step import TrainStep
    from examples.llama import llama3_70b

    model, inputs = llama3_70b(seq_len=seq_len)
    t0 = time.perf_counter()
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"), device=device)
    print(f"traced in {time.perf_counter() - t0:.1f} s")
    if cache:
        est.module_info.to_json(cache)
    return est.module_info


def unit_comm(info: ModuleInfo, units: list[str], world_size: int, spec) -> list[UnitComm]:
    est = fsdp_comm_ms(info, units, world_size, AnalyticCollectiveModel.from_device(spec))
    return [UnitComm(fqn=u.fqn, all_gather_ms=u.all_gather_ms / max(1, u.all_gathers),
                     all_gathers=u.all_gathers, reduce_scatter_ms=u.reduce_scatter_ms)
            for u in est.units]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=64, help="FSDP ranks (default 64)")
    p.add_argument("--device", default="h100", help="target DeviceSpec (default h100)")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--host-budget-gib", type=float, default=128.0,
                   help="host memory per rank for offloaded activations (default 128)")
    p.add_argument("--points", type=int, default=10, help="budgets (default 10)")
    p.add_argument("--info-cache", help="ModuleInfo JSON: read if it exists, else written")
    p.add_argument("--time-limit-s", type=float, default=60.0,
                   help="recompute-only solver limit per budget (default 60)")
    p.add_argument("--three-way-time-limit-s", type=float, default=4.0,
                   help="three-way solver limit per budget (default 4: the 5 s target with the "
                        "exact re-evaluation); the best plan found by then is used, its gap printed")
    p.add_argument("--compare-cold", action="store_true",
                   help="also solve each budget as before the warm start (the recompute-only plan "
                        "handed to HiGHS as its first incumbent) and the repair of an overshooting "
                        "plan (its binaries fixed, fractions re-solved) existed: side by side, same limit")
    p.add_argument("--no-incumbent", dest="incumbent", action="store_false",
                   help="do not give the three-way solve the recompute-only plan as its fallback "
                        "(the planner always does)")
    args = p.parse_args(argv)

    spec = get_device_spec(args.device)
    raw = traced_info(args.seq_len, spec.name, args.info_cache)
    root = raw.mod_stats[0].fqn
    blocks = list(find_blocks(raw))
    units = [root, *blocks]
    ws = args.world_size
    info = fsdp_module_info(raw, units, ws) if ws > 1 else raw
    comm = unit_comm(raw, units, ws, spec) if ws > 1 else []
    layout = step_layout(info, blocks, comm=comm)
    opts = SolverOptions(time_limit_s=args.time_limit_s)
    fsdp = units if ws > 1 else None

    t0 = time.perf_counter()
    rec = SACMilp(info, world_size=ws, fsdp_units=fsdp, options=opts)
    t_rec = time.perf_counter() - t0
    t0 = time.perf_counter()
    three = OffloadMilp(info, layout, copy_bytes_per_s=spec.host_copy_bytes_per_s,
                        copy_latency_s=spec.host_copy_latency_s, world_size=ws,
                        host_budget_bytes=int(args.host_budget_gib * GiB), fsdp_units=fsdp,
                        options=SolverOptions(time_limit_s=args.three_way_time_limit_s))
    t_three = time.perf_counter() - t0
    base = three.baseline_timeline
    lo_rec = rec.min_reachable_peak_bytes()
    lo3 = three.min_reachable_peak_bytes()
    hi = rec.no_ac_peak_bytes
    print(f"Llama-3-70B, {ws} ranks, {spec.name}, host link {spec.host_copy_bytes_per_s / 1e9:.1f} GB/s "
          f"per direction, host budget {args.host_budget_gib:g} GiB/rank")
    print(f"no-AC step: {base.step_ms:.1f} ms (compute {base.compute_ms:.1f}, exposed comm "
          f"{base.exposed_comm_ms:.2f} of {base.comm_ms:.1f} ms collectives); no-AC peak {hi / GiB:.2f} GiB")
    print(f"smallest reachable peak: recompute-only {lo_rec / GiB:.2f} GiB, three-way {lo3 / GiB:.2f} GiB")
    print(f"model build: recompute-only {t_rec:.2f} s ({rec.n_variables} vars), three-way {t_three:.2f} s "
          f"({three.n_variables} vars, {three.n_constraints} rows)")
    lo = max(lo_rec, lo3)
    budgets = [int(lo + (hi - lo) * i / (args.points - 1)) for i in range(args.points)]
    print()
    print(f"{'budget':>9} | {'recompute-only':^44} | {'keep/recompute/offload':^58}")
    print(f"{'GiB':>9} | {'step ms':>9} {'recomp':>8} {'exp.comm':>8} {'solve s':>8}    | "
          f"{'step ms':>9} {'recomp':>8} {'exp.copy':>8} {'exp.comm':>8} {'host GiB':>8} {'solve s':>8} {'gap':>7}")
    ok_time, ok_step, worst, n_fallback = True, True, 0.0, 0
    cold = []
    for b in budgets:
        try:
            r = rec.solve(b)
        except InfeasibleBudgetError:
            print(f"{b / GiB:9.2f} | infeasible")
            continue
        tl = three.timeline(r.discarded_bytes, {})
        if args.compare_cold:
            c = three.solve(b, incumbent=r.discarded_bytes if args.incumbent else None,
                            warm_start=False, repair=False)
            cold.append(c)
            print(f"{b / GiB:9.2f} | before: step {c.step_ms:9.1f} host {c.host_peak_bytes / GiB:6.2f} GiB "
                  f"solve {c.solve_time_s:5.2f} s " + (f"gap {100 * c.gap:.2f}%" if c.gap is not None else "gap n/a")
                  + (" (incumbent)" if c.from_incumbent else "") + f" {c.status.value}")
        t = three.solve(b, incumbent=r.discarded_bytes if args.incumbent else None)
        n_fallback += t.from_incumbent
        t3 = t.timeline
        ok_step &= t3.step_ms <= tl.step_ms * (1 + 1e-9)
        ok_time &= t.solve_time_s <= 5.0
        worst = max(worst, t.solve_time_s)
        print(f"{b / GiB:9.2f} | {tl.step_ms:9.1f} {tl.recompute_ms:8.1f} {tl.exposed_comm_ms:8.2f} "
              f"{r.solve_time_s:8.2f}    | {t3.step_ms:9.1f} {t3.recompute_ms:8.1f} {t3.exposed_copy_ms:8.2f} "
              f"{t3.exposed_comm_ms:8.2f} {t.host_peak_bytes / GiB:8.2f} {t.solve_time_s:8.2f} "
              + (f"{100 * t.gap:6.2f}%" if t.gap is not None else "   n/a ")
              + (" (incumbent)" if t.from_incumbent else "") + f" {t.status.value}")
    print()
    if args.incumbent:
        print(f"budgets where the recompute-only incumbent was returned: {n_fallback}")
    print(f"three-way step time <= recompute-only at every budget: {'PASS' if ok_step else 'FAIL'}")
    print(f"solve <= 5 s per budget (three-way worst {worst:.2f} s; the recompute-only column is "
          f"SACMilp as it is today, not part of this target): {'PASS' if ok_time else 'FAIL'}")
    return 0 if ok_step and ok_time else 1


if __name__ == "__main__":
    sys.exit(main())
