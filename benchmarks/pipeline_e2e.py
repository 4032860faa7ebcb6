"""Pipeline stages planned over their schedule, then run for real: ``torch.distributed.pipelining``
on gloo ranks of this CPU, every rank's peak measured by MemTracker beside the plan's prediction.

    python benchmarks/pipeline_e2e.py                                   # the full table (long)
    python benchmarks/pipeline_e2e.py --models llama --ranks 2 --schedules 1F1B --mbs 4
    python benchmarks/pipeline_e2e.py --models llama --ranks 4 --tp 2 --sp on off --mbs 4   # PP 2 x TP 2

For each model (a Llama-style decoder from examples/llama.py, an HF Qwen2 decoder from a tiny
config), 2 and 4 ranks, each schedule (GPipe, 1F1B, Interleaved1F1B and InterleavedZeroBubble with
2 stages per rank), 4 and 8 micro-batches: every rank is planned (``RankPlanner``: one trace per
local stage) at 3 budgets between its smallest reachable peak and its unplanned one, then the
pipeline runs 3 AdamW steps unplanned and with each level's plans (applied on the PipelineStages).
Checked on every rank: the measured peak of steps 2-3 within 2 % of the prediction and never above
the budget, gradients after step 3 bitwise equal to the unplanned run's. Then, for the 4-rank 1F1B
at 8 micro-batches: each stage's plan beside its in-flight count, and the predicted makespan
beside the measured step time (information: a tiny model's CPU step is Python and gloo overhead).
With ``--tp N`` the ranks are a (ranks / N, N) mesh: each stage's module is parallelized over its
TP group as torchtitan does (``examples.tensor_parallel.parallelize_llama``, loss_parallel around
the schedule's step), every rank is planned in this process on the fake process group
(``plan_tp_ranks``), and the gradients compared are each rank's local shards.
Exits 1 on any miss, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._pipeline_ranks import MB_SIZE, SCHEDULES, SEQ, RunConfig, build_model, build_stage, rank_worker, run_ranks  # noqa: E402

GiB = 2**30
TOLERANCE = 0.02
FRACTIONS = (0.25, 0.5, 0.75)
"""Budgets per rank: these fractions of the way from its smallest reachable peak to its unplanned one."""


class RankPlanners:
    """One ``RankPlanner`` per rank and stage layout (stages per rank, split backward or not),
    traced once; other schedules and micro-batch counts reuse its traces (``for_options``)."""

    def __init__(self, kind: str, n_ranks: int) -> None:
        self.kind, self.n_ranks, self._base = kind, n_ranks, {}
        self.model = build_model(kind)
        self.tokens = torch.randint(0, 256, (MB_SIZE, SEQ), generator=torch.Generator().manual_seed(0))

    def _stage_steps(self, n_stages: int, rank: int, virtual: int) -> dict:
        from examples.pipeline_stages import stage_loss
        from planner import TrainStep

        h, out = self.tokens, {}
        for s in range(n_stages):
            mod = build_stage(self.kind, self.model, s, n_stages)
            if s % self.n_ranks == rank:
                out[s] = (mod, TrainStep(inputs=h, loss_fn=stage_loss, optimizer="adamw",
                                         target=self.tokens if s == n_stages - 1 else None))
            with torch.no_grad():
                h = mod(h)
        return out

    def planner(self, schedule: str, n: int, rank: int):
        from torch.distributed import pipelining as pp

        from planner import PlanOptions
        from planner.distributed.pipeline import Pipeline, RankPlanner

        cls_name, virtual = SCHEDULES[schedule]
        pipe = Pipeline(getattr(pp, cls_name), n_microbatches=n, stage_index=rank, n_stages=self.n_ranks * virtual,
                        virtual_stages=virtual)
        options = PlanOptions(pipeline=pipe)
        key = (virtual, pipe.layout.split_backward, rank)
        if key not in self._base:
            self._base[key] = RankPlanner(self._stage_steps(self.n_ranks * virtual, rank, virtual), options=options)
            return self._base[key]
        return self._base[key].for_options(options)


def plan_ranks(planners: RankPlanners, schedule: str, n: int, fractions=FRACTIONS):
    """{rank: (unplanned, floor, [(budget, {stage: Plan}) per fraction])}."""
    return {rank: _levels(planners.planner(schedule, n, rank), fractions) for rank in range(planners.n_ranks)}


def _levels(rp, fractions) -> tuple[int, int, list]:
    """(unplanned, floor, [(budget, {stage: Plan}) per fraction]) of one rank's planner."""
    lo, hi = rp.min_peak_bytes(), rp.unplanned_peak_bytes
    levels = []
    for f in fractions:
        budget = int(lo + f * (hi - lo))
        levels.append((budget, {s: dataclasses.replace(p, train_step=None) for s, p in rp.plan(budget / GiB).items()}))
    return hi, lo, levels


def plan_tp_ranks(pp: int, tp: int, sequence_parallel: bool, cases, fractions=FRACTIONS) -> dict:
    """PP x TP: {(schedule, n): {rank: (unplanned, floor, levels)}}, every rank of the (pp, tp)
    mesh planned in this process on the fake process group at its local shapes
    (``planner.distributed.pipeline.fake_layout_rank``): one trace per local stage and stage
    layout, shared by the schedules and micro-batch counts over the same stages."""
    from torch.distributed import pipelining as torch_pp

    from examples.pipeline_stages import llama_stage_builder
    from planner import PlanOptions
    from planner.distributed.pipeline import Pipeline, fake_layout_rank

    config = build_model("llama").config
    out: dict = {case: {} for case in cases}
    by_layout: dict = {}
    for schedule, n in cases:
        cls_name, virtual = SCHEDULES[schedule]
        split = "ZeroBubble" in cls_name
        by_layout.setdefault((virtual, split), []).append((schedule, n))
    for rank in range(pp * tp):
        for (virtual, _), group in by_layout.items():
            build = llama_stage_builder(config, n_stages=pp * virtual, micro_batch=MB_SIZE,
                                        sequence_parallel=sequence_parallel)
            first_cls = getattr(torch_pp, SCHEDULES[group[0][0]][0])
            with fake_layout_rank(build, mesh_shape={"pp": pp, "tp": tp}, rank=rank, schedule=first_cls,
                                  n_microbatches=group[0][1], virtual_stages=virtual,
                                  options=PlanOptions(device="cpu")) as (base, _):
                for schedule, n in group:
                    pipe = dataclasses.replace(base.pipeline, schedule=getattr(torch_pp, SCHEDULES[schedule][0]),
                                               n_microbatches=n)
                    rp = base.for_options(dataclasses.replace(base.options, pipeline=pipe))
                    out[(schedule, n)][rank] = _levels(rp, fractions)
    return out


def run_group(kind: str, n_ranks: int, schedules, mbs, timed, *, tp: int = 1,
              sequence_parallel: bool = True) -> tuple[list[dict], list[str]]:
    """Plan and run every configuration of one model on ``n_ranks`` ranks (``tp > 1``: a
    (n_ranks // tp, tp) mesh of tensor-parallel stages): one row per rank and level, and a miss
    per configuration that could not be planned (it is not run)."""
    from planner import PlanningError

    configs, meta, misses = [], [], []
    planners = RankPlanners(kind, n_ranks) if tp == 1 else None
    tp_planned = {}
    if tp > 1:
        t0 = time.perf_counter()
        tp_planned = plan_tp_ranks(n_ranks // tp, tp, sequence_parallel, [(s, n) for s in schedules for n in mbs])
        tp_plan_s = (time.perf_counter() - t0) / max(1, len(tp_planned))
    for schedule in schedules:
        for n in mbs:
            t0 = time.perf_counter()
            try:
                planned = plan_ranks(planners, schedule, n) if tp == 1 else tp_planned[(schedule, n)]
            except PlanningError as e:
                misses.append(f"MISS {kind} p={n_ranks} {schedule} n={n}: not planned: {e}")
                continue
            plan_s = time.perf_counter() - t0 if tp == 1 else tp_plan_s
            steps = 3 if (schedule, n) in timed else 0
            extra = dict(tp=tp, sequence_parallel=sequence_parallel)
            configs.append(RunConfig(schedule, n, None, steps, **extra))
            meta.append((schedule, n, None, planned, plan_s))
            for level in range(len(FRACTIONS)):
                plans = ({s: p for r in planned for s, p in planned[r][2][level][1].items()} if tp == 1 else
                         {r: planned[r][2][level][1] for r in planned})
                configs.append(RunConfig(schedule, n, plans, steps, **extra))
                meta.append((schedule, n, level, planned, plan_s))
    results = run_ranks(rank_worker, n_ranks, kind, configs, timeout_s=3600)
    rows = []
    layout = f"PP {n_ranks // tp} x TP {tp}{' SP' if sequence_parallel else ''}" if tp > 1 else f"PP {n_ranks}"
    for i, (schedule, n, level, planned, plan_s) in enumerate(meta):
        base = i - (0 if level is None else level + 1)
        for r in range(n_ranks):
            got = results[r][i]
            hi, lo, levels = planned[r]
            budget, plans = (None, None) if level is None else levels[level]
            plan = next(iter(plans.values())) if plans else None
            rows.append(dict(model=kind, ranks=n_ranks, layout=layout, schedule=schedule, n=n, level=level, rank=r,
                             budget=budget, predicted=plan.predicted_peak_bytes if plan else hi,
                             measured=max(got["peaks"][1:]), bitwise=got["grads"] == results[r][base]["grads"],
                             plans=plans, step_ms=got["step_ms"], plan_s=plan_s, floor=lo))
    return rows, misses


def check(row: dict) -> list[str]:
    misses = []
    err = (row["predicted"] - row["measured"]) / row["predicted"]
    if abs(err) > TOLERANCE:
        misses.append(f"measured {row['measured']:,} is {100 * -err:+.2f} % from the prediction")
    if row["budget"] is not None and row["measured"] > row["budget"]:
        misses.append(f"measured {row['measured']:,} above the budget {row['budget']:,}")
    if not row["bitwise"]:
        misses.append("gradients differ from the unplanned run's")
    return misses


def table(rows: list[dict]) -> str:
    head = (f"{'model':6} {'layout':14} {'schedule':16} {'n':>2} {'budget':>6} {'rank':>4} {'budget B':>11} "
            f"{'predicted B':>11} {'measured B':>11} {'diff %':>7} {'grads':>7} {'modules':>7}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        lvl = "none" if r["level"] is None else f"{FRACTIONS[r['level']]:.2f}"
        diff = 100 * (r["measured"] - r["predicted"]) / r["predicted"]
        n_mod = sum(len(p.modules) for p in r["plans"].values()) if r["plans"] else 0
        lines.append(f"{r['model']:6} {r['layout']:14} {r['schedule']:16} {r['n']:>2} {lvl:>6} {r['rank']:>4} "
                     f"{(r['budget'] or 0):>11,} {r['predicted']:>11,} {r['measured']:>11,} {diff:>+7.2f} "
                     f"{'bitwise' if r['bitwise'] else 'DIFFER':>7} {n_mod:>7}  {'PASS' if not check(r) else 'FAIL'}")
    return "\n".join(lines)


def one_f_one_b_report(rows: list[dict]) -> str:
    """The 4-rank 1F1B rows at the middle budget: plans per stage, makespan beside the CPU step."""
    from planner.distributed.pipeline import pipeline_step

    sel = [r for r in rows if r["schedule"] == "1F1B" and r["layout"] == "PP 4" and r["level"] == 1]
    if not sel:
        return ""
    out = []
    for kind in sorted({r["model"] for r in sel}):
        mine = sorted((r for r in sel if r["model"] == kind and r["n"] == max(x["n"] for x in sel)),
                      key=lambda r: r["rank"])
        plans = [p for r in mine for p in r["plans"].values()]
        step = pipeline_step(plans)
        measured = max((max(r["step_ms"]) for r in mine if r["step_ms"]), default=0.0)
        out.append(f"{kind}: 4-stage 1F1B, {mine[0]['n']} micro-batches, middle budgets")
        for r in mine:
            (s, plan), = r["plans"].items()
            held = min(4 - s, r["n"])
            names = ", ".join(m.fqn.split(".", 1)[1] + ("" if m.full else f"@{m.discard_ratio:.2f}") for m in plan.modules)
            out.append(f"  stage {s}: {held} micro-batches in flight, budget {r['budget']:,} B, predicted "
                       f"{r['predicted']:,} B, measured {r['measured']:,} B; checkpoints {names or 'nothing'}")
        ratio = measured / step.makespan_ms if step.makespan_ms else float("nan")
        out.append(f"  predicted makespan {step.makespan_ms:.2f} ms (device '{plans[0].device}' roofline, "
                   f"bubble {', '.join(f'{100 * b:.0f} %' for b in step.bubble_fractions.values())}); measured "
                   f"step {measured:.1f} ms on gloo; ratio measured/predicted {ratio:.1f} (information)")
        out += ["  " + line for line in step.timeline_text(80).splitlines()]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama", "qwen2"], choices=["llama", "qwen2"],
                    help="decoders to split into stages (default both)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="pipeline ranks (default 2 4)")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES),
                    help="schedules (default all four)")
    ap.add_argument("--mbs", nargs="+", type=int, default=[4, 8], help="micro-batches per step (default 4 8)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree inside each stage (llama only; --ranks counts every rank: "
                         "PP = ranks / tp; default 1)")
    ap.add_argument("--sp", nargs="+", default=["on"], choices=["on", "off"],
                    help="with --tp > 1: sequence parallelism on, off or both (default on)")
    args = ap.parse_args(argv)
    if args.tp > 1 and (args.models != ["llama"] or any(p % args.tp for p in args.ranks)):
        ap.error("--tp > 1 runs --models llama on ranks that --tp divides")
    rows, misses = [], []
    t0 = time.perf_counter()
    timed = {("1F1B", max(args.mbs))}
    for kind in args.models:
        for p in args.ranks:
            for sp in (args.sp if args.tp > 1 else ["on"]):
                group, not_planned = run_group(kind, p, args.schedules, args.mbs,
                                               timed if p == 4 and args.tp == 1 else set(), tp=args.tp,
                                               sequence_parallel=sp == "on")
                print(f"[{kind}, {group[0]['layout'] if group else p} done after {time.perf_counter() - t0:.0f} s; "
                      f"load average {os.getloadavg()[0]:.1f}]", flush=True)
                print(table(group), *not_planned, sep="\n", flush=True)
                rows += group
                misses += not_planned
    report = one_f_one_b_report(rows)
    if report:
        print()
        print(report)
    misses += [f"MISS {r['model']} {r['layout']} {r['schedule']} n={r['n']} level={r['level']} rank {r['rank']}: {m}"
               for r in rows for m in check(r)]
    print()
    print(*misses, sep="\n")
    print(f"{len(rows)} rank rows, {len(misses)} misses: {'PASS' if not misses else 'FAIL'} "
          f"(tolerance {100 * TOLERANCE:.0f} %, never above budget, gradients bitwise)")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
