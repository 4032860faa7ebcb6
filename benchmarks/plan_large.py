"""Plan a Llama-3-70B-shaped decoder for an 80 GiB H100, in fake mode, on this CPU machine.

    python benchmarks/plan_large.py                    # world_size 64 (FSDP), budget 80 GiB
    python benchmarks/plan_large.py --world-size 1     # shows the smallest reachable budget
    python benchmarks/plan_large.py --layout 70b-fsdp8-tp8      # per rank of FSDP 8 x TP 8, seq 8192
    python benchmarks/plan_large.py --layout all                # 70B and 405B layouts (benchmarks/_layouts.py)

``--layout``: a torchtitan-style layout planned per rank in this one process on torch's fake
process group (tensor + sequence parallel + loss_parallel, FSDP2 over the other ranks, context
parallel for 405B at 128k), printed beside the FSDP-only plan of the same ranks, with which share
of the rank's memory dominates and the time each plan took (target <= 60 s).

Model: 80 layers, hidden 8192, 64 heads / 8 KV heads, FFN 28672, vocab 128256, seq 4096,
micro-batch 1, bf16, AdamW. FSDP2 units as a 70B user shards: every layer and the root
(``planner/distributed/fsdp/memory.py`` counts the sharded state, the gathered parameters and the all-gather /
reduce-scatter buffers per rank). The step planned is the steady state (AdamW state alive from
the start); the first step's per-rank peak is printed beside it. Prints wall time and max RSS
against the targets (<= 120 s, <= 4 GiB) and whether the plan fits the steady state.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimators.step.train_step import TrainStep  # noqa: E402
from examples.llama import llama3_70b  # noqa: E402
from planner import PlanningError, solve_sac  # noqa: E402
from solver import SolverOptions  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from benchmarks._layouts import LAYOUTS, plan_rank  # noqa: E402

GiB = 2**30


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-gib", type=float, default=80.0, help="per-GPU budget (default 80)")
    p.add_argument("--world-size", type=int, default=64, help="FSDP ranks (default 64)")
    p.add_argument("--device", default="h100", help="target DeviceSpec (default h100)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--plan-out", help="write the plan JSON here")
    p.add_argument("--layout", choices=["all", *LAYOUTS], help="plan a parallel layout per rank instead")
    p.add_argument("--layers", type=int, help="with --layout: keep only this many layers (a quick look)")
    args = p.parse_args(argv)
    if args.layout:
        return layouts_main(args)

    t0 = time.perf_counter()
    model, inputs = llama3_70b(seq_len=args.seq_len)
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.2f} B parameters on {next(model.parameters()).device}, built in {t_build:.1f} s")
    t1 = time.perf_counter()
    units = [type(model).__name__, *(f"{type(model).__name__}.layers.{i}" for i in range(len(model.layers)))]
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")
    try:
        plan = solve_sac(
            model, args.budget_gib, step, options=PlanOptions(device=args.device, world_size=args.world_size, fsdp_units=units if args.world_size > 1 else None, solver=SolverOptions(time_limit_s=60.0)))
    except PlanningError as e:
        print(f"planning error: {e}")
        plan = None
    wall = time.perf_counter() - t1
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
    print(f"{'wall time (trace + solve + op decisions)':44s} {wall:8.1f} s   target <= 120 s  "
          f"{'PASS' if wall <= 120 else 'FAIL'}")
    print(f"{'max RSS of this process':44s} {rss:8.2f} GiB target <= 4 GiB  {'PASS' if rss <= 4 else 'FAIL'}")
    return 0 if (wall <= 120 and rss <= 4 and fits) else 1


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
            try:
                r = plan_rank(layout, args.budget_gib, args.device, layers=args.layers,
                              tensor_parallel=tensor_parallel)
            except PlanningError as e:
                print(f"  {what}: {e}")
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


if __name__ == "__main__":
    sys.exit(main())
