"""Plan a Llama-3-70B (or 3.1-405B) decoder for an 80 GiB H100, in fake mode, on this CPU machine.

    python benchmarks/plan_large.py                    # 70B, world_size 64 (FSDP), budget 80 GiB
    python benchmarks/plan_large.py --model 405b       # 126 layers, world_size 128
    python benchmarks/plan_large.py --compare-full     # also plan it tracing every block: same plan?
    python benchmarks/plan_large.py --world-size 1     # shows the smallest reachable budget
    python benchmarks/plan_large.py --layout 70b-fsdp8-tp8      # per rank of FSDP 8 x TP 8, seq 8192
    python benchmarks/plan_large.py --layout all                # 70B and 405B layouts (benchmarks/_layouts.py)
    python benchmarks/plan_large.py --pipeline         # Llama-3.1-405B, PP 8 x DP 8 x TP 8, per rank

``--layout``: a torchtitan-style layout planned per rank in this one process on torch's fake
process group (tensor + sequence parallel + loss_parallel, FSDP2 over the other ranks, context
parallel for 405B at 128k), printed beside the FSDP-only plan of the same ranks, with which share
of the rank's memory dominates and the time each plan took (target <= 60 s).

Model: 70B: 80 layers, hidden 8192, 64 heads / 8 KV heads, FFN 28672; 405B: 126 layers, hidden
16384, 128 / 8 heads, FFN 53248; vocab 128256, seq 4096, micro-batch 1, bf16, AdamW. FSDP2 units
as such a user shards: every layer and the root (``planner/distributed/fsdp/memory.py`` counts
the sharded state, the gathered parameters and the all-gather / reduce-scatter buffers per rank).
The step planned is the steady state (AdamW state alive from the start); the first step's
per-rank peak is printed beside it. The trace runs four of the identical layers and lays in the
others (``EstimateOptions.replicate_blocks``); ``--compare-full`` plans again tracing every
layer and compares the plans' hashes (``planner.distributed.ranks.plan_hash``) and times.

Prints wall and CPU time (this process; the machine may be shared: the load average is printed)
and max RSS against the targets (70B <= 5 s, 405B <= 8 s of planning, model build excluded;
<= 4 GiB) and whether the plan fits the steady state.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimators.step.train_step import TrainStep  # noqa: E402
from estimators.tracing.estimation import EstimateOptions  # noqa: E402
from examples.llama import llama3_70b, llama3_405b  # noqa: E402
from planner import PlanningError, solve_sac  # noqa: E402
from planner.distributed.ranks import plan_hash  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from solver import SolverOptions  # noqa: E402
from benchmarks._layouts import LAYOUTS, plan_rank  # noqa: E402

GiB = 2**30
MODELS = {"70b": (llama3_70b, 5.0, 64), "405b": (llama3_405b, 8.0, 128)}
"""Model factory, the planning-time target in seconds, and the default FSDP world size (405B's
state needs more than 64 ranks to fit 80 GiB: 93.9 GiB is its smallest reachable peak there)."""


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-gib", type=float, default=80.0, help="per-GPU budget (default 80)")
    p.add_argument("--world-size", type=int, default=None, help="FSDP ranks (default 64 for 70b, 128 for 405b)")
    p.add_argument("--device", default="h100", help="target DeviceSpec (default h100)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--model", choices=sorted(MODELS), default="70b", help="Llama 3 70B or 3.1 405B (default 70b)")
    p.add_argument("--compare-full", action="store_true",
                   help="plan again tracing every layer: print both times and whether the plans' hashes match")
    p.add_argument("--plan-out", help="write the plan JSON here")
    p.add_argument("--layout", choices=["all", *LAYOUTS], help="plan a parallel layout per rank instead")
    p.add_argument("--layers", type=int, help="with --layout: keep only this many layers (a quick look)")
    p.add_argument("--pipeline", action="store_true",
                   help="Llama-3.1-405B planned per pipeline stage instead (benchmarks/_plan_large_pipeline.py)")
    p.add_argument("--pp", type=int, default=8, help="--pipeline: pipeline stages (default 8)")
    p.add_argument("--tp", type=int, default=8, help="--pipeline: tensor-parallel degree inside a stage (default 8)")
    p.add_argument("--dp", type=int, default=8,
                   help="--pipeline: data-parallel ranks dividing the state, ZeRO-style (default 8)")
    p.add_argument("--microbatches", type=int, default=16, help="--pipeline: micro-batches per step (default 16)")
    args = p.parse_args(argv)
    if args.layout:
        return layouts_main(args)
    if args.pipeline:
        return pipeline_main(args)

    factory, target_s, world_size = MODELS[args.model]
    if args.world_size is None:
        args.world_size = world_size
    t0 = time.perf_counter()
    model, inputs = factory(seq_len=args.seq_len)
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.2f} B parameters on {next(model.parameters()).device}, built in {t_build:.1f} s")
    units = [type(model).__name__, *(f"{type(model).__name__}.layers.{i}" for i in range(len(model.layers)))]
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")

    def planned(replicate: bool):
        t, c = time.perf_counter(), time.process_time()
        options = PlanOptions(device=args.device, world_size=args.world_size,
                              fsdp_units=units if args.world_size > 1 else None,
                              solver=SolverOptions(time_limit_s=60.0),
                              trace=EstimateOptions(replicate_blocks=replicate))
        try:
            plan = solve_sac(model, args.budget_gib, step, options=options)
        except PlanningError as e:
            print(f"planning error: {e}")
            plan = None
        return plan, time.perf_counter() - t, time.process_time() - c

    plan, wall, cpu = planned(True)
    rss = max_rss_gib()
    fits = None
    if plan is not None:
        print(plan.summary())
        if args.plan_out:
            plan.save(args.plan_out)
        print()
        print(f"FSDP2 units: {len(units)} (root + {len(units) - 1} layers), world_size {args.world_size}")
        print(f"{'per-rank peak, first step':44s} {plan.first_step_peak_bytes / GiB:8.2f} GiB")
        print(f"{'per-rank peak, steady state (step 2 on)':44s} {plan.steady_peak_bytes / GiB:8.2f} GiB"
              f"   ({plan.binding_step} binds)")
        print(f"{'per-rank peak, no AC (steady state)':44s} {plan.baseline_peak_bytes / GiB:8.2f} GiB")
        fits = plan.predicted_peak_bytes <= plan.usable_budget_bytes
        print(f"{'usable budget (budget - reserve)':44s} {plan.usable_budget_bytes / GiB:8.2f} GiB"
              f"   steady state fits: {'PASS' if fits else 'FAIL'}")
    print()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{'wall time (trace + solve + op decisions)':44s} {wall:8.2f} s   target <= {target_s:.0f} s  "
          f"{'PASS' if wall <= target_s else 'FAIL'}   (CPU {cpu:.2f} s; load average {load} on "
          f"{os.cpu_count()} cores)")
    print(f"{'max RSS of this process':44s} {rss:8.2f} GiB target <= 4 GiB  {'PASS' if rss <= 4 else 'FAIL'}")
    same = True
    if args.compare_full:
        full, full_wall, full_cpu = planned(False)
        same = plan is not None and full is not None and plan_hash(plan) == plan_hash(full)
        print(f"{'every layer traced: wall time':44s} {full_wall:8.2f} s   (CPU {full_cpu:.2f} s): "
              f"{full_wall / wall:.1f}x the wall time, {full_cpu / cpu:.1f}x the CPU time")
        print(f"{'same plan (plan_hash)':44s} {'PASS' if same else 'FAIL'}"
              f"   {plan_hash(plan)[:16] if plan else '-'} / {plan_hash(full)[:16] if full else '-'}")
    return 0 if (wall <= target_s and rss <= 4 and fits and same) else 1


def layouts_main(args) -> int:
    """Each layout's per-rank plan beside the FSDP-only plan of the same ranks."""
    names = list(LAYOUTS) if args.layout == "all" else [args.layout]
    ok = True
    for name in names:
        layout = LAYOUTS[name]
        print(f"== {layout.title}: {layout.world_size} ranks, budget {args.budget_gib:g} GiB per rank, {args.device}")
        for tensor_parallel in (True, False):
            what = ("this layout" if tensor_parallel else f"FSDP2 over all {layout.world_size} ranks, no TP"
                    + (f" (CP {layout.cp} kept)" if layout.cp > 1 else ""))
            t0 = time.perf_counter()
            try:
                r = plan_rank(layout, args.budget_gib, args.device, layers=args.layers,
                              tensor_parallel=tensor_parallel)
            except PlanningError as e:
                print(f"  {what}: refused in {time.perf_counter() - t0:.1f} s: {e}")
                ok &= not tensor_parallel
                continue
            plan = r.plan
            print(f"  {what}: planned in {r.seconds:.1f} s "
                  f"{'PASS' if r.seconds <= 60 else 'FAIL'} (target <= 60 s)")
            print(f"    per-rank peak: no AC {plan.baseline_peak_bytes / GiB:.2f} GiB, planned "
                  f"{plan.predicted_peak_bytes / GiB:.2f} GiB ({len(plan.modules)} modules checkpointed, "
                  f"recompute {plan.recompute_ms:.0f} ms)")
            print(f"    at the no-AC peak: sharded state {r.state_bytes / GiB:.2f} GiB, activations "
                  f"{r.activation_bytes / GiB:.2f} GiB, FSDP2 gathered units, buffers and temporaries "
                  f"{r.other_bytes / GiB:.2f} GiB")
            print(f"    dominant: {r.dominant}")
            ok &= r.seconds <= 60 or not tensor_parallel
    return 0 if ok else 1


def pipeline_main(args) -> int:
    from benchmarks._plan_large_pipeline import plan_405b

    seq = 8192 if args.seq_len == 4096 else args.seq_len  # Llama 3.1's training length unless given
    print(f"Llama-3.1-405B, Schedule1F1B, PP {args.pp} x DP {args.dp} x TP {args.tp} "
          f"({args.pp * args.tp * args.dp} GPUs; TP + sequence parallel + loss_parallel traced per rank on the fake "
          f"process group, DP dividing the state ZeRO-style), {args.microbatches} micro-batches of 1 x {seq}, bf16, "
          f"AdamW, budget {args.budget_gib} GiB per GPU on {args.device}")
    out = plan_405b(pp=args.pp, tp=args.tp, dp=args.dp, n_microbatches=args.microbatches, seq_len=seq,
                    budget_gib=args.budget_gib, device=args.device)
    print(f"{'stage':>5} {'rank':>5} {'layers':>6} {'unplanned GiB':>13} {'floor GiB':>9} {'planned GiB':>11} "
          f"{'modules':>7} {'recompute ms/mb':>15} {'makespan ms':>11} {'seconds':>7}")
    for r in out["rows"]:
        planned = f"{r['planned'] / GiB:11.2f}" if r["planned"] is not None else f"{'over':>11}"
        makespan = f"{r['makespan_ms']:11.0f}" if r["makespan_ms"] is not None else f"{'-':>11}"
        print(f"{r['stage']:>5} {r['stage'] * args.dp * args.tp:>5} {r['layers']:>6} {r['unplanned'] / GiB:13.2f} "
              f"{r['floor'] / GiB:9.2f} {planned} {r['modules']:>7} {r['recompute_ms']:15.1f} {makespan} "
              f"{r['seconds']:6.1f}{'' if r['traced'] else '*'}")
    print("  * the middle stage's trace under this stage's layer names")
    ok = out["wall_s"] <= 60 and all(r["planned"] is not None for r in out["rows"])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{'wall time (3 stage traces + one MILP per stage)':48s} {out['wall_s']:7.1f} s  (traces "
          f"{out['trace_s']:.1f} s)  target <= 60 s  {'PASS' if out['wall_s'] <= 60 else 'FAIL'}")
    print(f"{'CPU time of this process':48s} {out['cpu_s']:7.1f} s  (load average {load} on {os.cpu_count()} cores)")
    print(f"{'max RSS of this process':48s} {max_rss_gib():7.2f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
