"""The launch advisor on real ranks: search a small Llama for a 4-rank CPU "cluster", then run every
layout the search calls fits on 4 gloo ranks for 3 AdamW steps, each rank's steady-state peak
(MemTracker, steps 2-3) beside the search's prediction for that rank, and the gradients after the
steps beside those of the same layout run unplanned (bitwise).

    python benchmarks/search_ranks.py                      # every fitting layout, PASS/FAIL per rank
    python benchmarks/search_ranks.py --budget-mib 3.2     # another budget (more or less checkpointing)

The search runs with ``verify_all`` (every planned layout traced with its plan), so "fits" is the
verified per-rank peak. Layouts: FSDP2 / HSDP (``fully_shard`` of every layer and the root over the
shard mesh), TP (torchtitan's Llama plan, sequence parallel, loss_parallel), FSDP2 x TP, PP stages of
``torch.distributed.pipelining`` (with FSDP2 over the data-parallel ranks: parameters kept gathered
after forward, as torchtitan runs PP), and PP x TP (each stage parallelized over its TP group as
torchtitan does, loss_parallel around the schedule's step). Targets: measured
within 1 % of predicted on every rank, gradients bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.llama import LlamaConfig, build_llama  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, seq_len=32, n_layers=8, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128)
GLOBAL_BATCH = 8
TOLERANCE = 0.01


def small_llama(*, seq_len: int = CONFIG.seq_len, device: str = "meta"):
    """The searched model: 8 layers, dim 64, 8 / 4 heads, float32 (a factory taking ``seq_len=``)."""
    from dataclasses import replace

    return build_llama(replace(CONFIG, seq_len=seq_len), batch_size=1, device=device)


def search_cases(budget_mib: float, *, schedules=("1F1B", "InterleavedZeroBubble")):
    """The search, and every layout it calls fits as a picklable case for the ranks."""
    from planner.search import Cluster, SearchOptions, SearchSpace, search
    from planner.search.results import Status

    options = SearchOptions(space=SearchSpace(cp=(1,), micro_batches=(1, 2), schedules=schedules),
                            verify_all=True, bound=False, published=False)
    result = search(small_llama, Cluster.parse("4xcpu", budget_gib=budget_mib / 1024),
                    global_batch=GLOBAL_BATCH, seq_len=CONFIG.seq_len, options=options)
    cases = []
    for e in result.evaluations:
        if e.status is not Status.FITS:
            continue
        t = e.layout
        plans = [p.to_json() for p in e.plans]
        cases.append({"layout": {k: getattr(t, k) for k in ("tp", "cp", "pp", "dp_shard", "dp_replicate",
                                                             "micro_batch", "accumulation", "schedule")},
                      "describe": t.describe(), "plans": plans,
                      "peaks": list(e.rank_peaks) if t.pp > 1 else [e.peak_bytes]})
    return result, cases


# ----------------------------------------------------------------------------- the rank side
def _micro_batches(t, dp_index: int):
    """This data-parallel rank's micro-batches of one step, made one at a time."""
    g = torch.Generator().manual_seed(100 + dp_index)
    for _ in range(t.accumulation):
        yield torch.randint(0, CONFIG.vocab_size, (t.micro_batch, CONFIG.seq_len), generator=g)


def _local_grads(modules) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = []
    for m in modules:
        for p in m.parameters():
            g = p.grad
            out.append(torch.zeros(0) if g is None else (g.to_local() if isinstance(g, DTensor) else g).clone())
    return out


def _model_run(t, mesh, plan):
    """A whole-model layout: (modules, optimizer, one step)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from examples.tensor_parallel import parallelize_llama
    from planner import apply_plan

    torch.manual_seed(0)
    model, _ = small_llama(device="cpu")
    if t.tp > 1:
        parallelize_llama(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    if plan is not None:
        apply_plan(model, plan)  # torchtitan's order: parallelize, AC, then fully_shard
    if t.fsdp_size > 1:
        dp = mesh["dp_shard"] if t.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    dp_index = mesh.get_local_rank("dp_replicate") * t.dp_shard + mesh.get_local_rank("dp_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx = loss_parallel if t.tp > 1 else None

    def step():  # one micro-batch fetched at a time, as torchtitan's loop does (the search's step)
        for x in _micro_batches(t, dp_index):
            with ctx() if ctx else _null():
                loss = model.loss_fn(model(x), (x,)) / t.accumulation
                loss.backward()
        opt.step()

    return [model], opt, step


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _pipeline_run(t, mesh, plans):
    """A pipeline layout: this rank's stages (FSDP2 over the data-parallel ranks), its schedule."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    from examples.pipeline_stages import layer_ranges, LlamaStage, stage_loss
    from planner import apply_plan
    from planner.search.layouts import SCHEDULES

    cls_name, virtual = SCHEDULES[t.schedule]
    n = t.pp * virtual
    r = mesh.get_local_rank("pp")
    local = [r + v * t.pp for v in range(virtual)]
    torch.manual_seed(0)
    full, _ = small_llama(device="cpu")
    ranges = layer_ranges(CONFIG.n_layers, n)
    mods = [LlamaStage(full, ranges[s], first=s == 0, last=s == n - 1) for s in local]
    del full
    ctx = _null
    if t.tp > 1:  # torchtitan's order: split, then TP; loss_parallel around the schedule's step
        from torch.distributed.tensor.parallel import loss_parallel

        from examples.tensor_parallel import parallelize_llama

        for m in mods:
            parallelize_llama(m, mesh["tp"], sequence_parallel=True, loss_parallel=True)
        ctx = loss_parallel
    group = mesh["pp"].get_group()
    stages = [pipelining.PipelineStage(m, s, n, torch.device("cpu"), group=group) for m, s in zip(mods, local)]
    by_stage = {p.pipeline.stage_index: p for p in plans}
    for st, s in zip(stages, local):  # the plan before FSDP2, as torchtitan applies AC
        if s in by_stage:
            apply_plan(st, by_stage[s])
    if t.fsdp_size > 1:
        dp = mesh["dp_shard"] if t.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
        for m in mods:  # torchtitan under PP: every layer and the stage, gathered after forward
            for layer in m.layers.values():
                fully_shard(layer, mesh=dp, reshard_after_forward=False)
            fully_shard(m, mesh=dp, reshard_after_forward=False)
    sched = getattr(pipelining, cls_name)(stages[0] if virtual == 1 else stages, t.accumulation, loss_fn=stage_loss)
    dp_index = mesh.get_local_rank("dp_replicate") * t.dp_shard + mesh.get_local_rank("dp_shard")
    x = torch.cat(list(_micro_batches(t, dp_index)))
    first, last = 0 in local, n - 1 in local
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-3)

    def step():
        with ctx():
            sched.step(*((x,) if first else ()), **({"target": x} if last else {}), return_outputs=False)  # torchtitan
        opt.step()

    def held():
        from benchmarks._pipeline_ranks import receive_buffers

        return [*([x] if first or last else []), *receive_buffers(stages),
                *(c for st in stages for c in st.output_chunks)]

    return mods, opt, step, held


def run_case(rank: int, world: int, case: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from planner.analysis import measure_run
    from planner.plan import Plan
    from planner.search.layouts import Layout

    t = Layout(**case["layout"])
    names = ("pp", "dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (t.pp, t.dp_replicate, t.dp_shard, t.tp), mesh_dim_names=names)
    plans = [Plan.from_dict(json.loads(p)) for p in case["plans"]]
    out = {}
    for planned in (False, True):
        if t.pp > 1:
            mods, opt, step, held = _pipeline_run(t, mesh, plans if planned else [])
        else:
            mods, opt, step = _model_run(t, mesh, plans[0] if planned and plans else None)
            held = list  # nothing: the step makes its micro-batches
        peaks = []
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            record = i == 2
            peaks.append(measure_run(step, modules=mods, optimizer=opt, held=held()).peak_bytes)
            if record:
                grads = _local_grads(mods)
        out["planned" if planned else "unplanned"] = {"peaks": peaks, "grads": grads}
        del mods, opt, step
        torch.distributed.barrier()
    bitwise = len(out["planned"]["grads"]) == len(out["unplanned"]["grads"]) and all(
        torch.equal(a, b) for a, b in zip(out["planned"]["grads"], out["unplanned"]["grads"]))
    predicted = case["peaks"][mesh.get_local_rank("pp")] if t.pp > 1 else case["peaks"][0]
    return {"layout": case["describe"], "rank": rank, "predicted": predicted,
            "measured": max(out["planned"]["peaks"][1:]), "unplanned": max(out["unplanned"]["peaks"][1:]),
            "bitwise": bitwise, "checkpointed": sum(len(p.modules) for p in plans)}


def rank_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [run_case(rank, world, c) for c in cases]


def main(argv=None) -> int:
    from benchmarks._pipeline_ranks import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-mib", type=float, default=3.0, help="memory per rank the search plans for (default 3)")
    p.add_argument("--timeout-s", type=float, default=3000)
    p.add_argument("--cases", help="a JSON file of cases: read it if it exists (no search), else write it")
    p.add_argument("--only", help="run only the layouts whose description contains this")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.cases and Path(args.cases).exists():
        cases = json.loads(Path(args.cases).read_text())
    else:
        result, cases = search_cases(args.budget_mib)
        print(result.table_text(top=40))
        if args.cases:
            Path(args.cases).write_text(json.dumps(cases))
    cases = [c for c in cases if not args.only or args.only in c["describe"]]
    print(f"\n{len(cases)} layouts fit (verified); running each on 4 gloo ranks, 3 AdamW steps", flush=True)
    rows = [r for per_rank in run_ranks(rank_worker, 4, cases, timeout_s=args.timeout_s) for r in per_rank]
    ok = bool(rows)
    print(f"{'layout':<44} {'rank':>4} {'ckpt':>4} {'predicted':>11} {'measured':>11} {'diff':>7} {'unplanned':>11} "
          f"{'grads':>7}")
    for r in sorted(rows, key=lambda r: (r["layout"], r["rank"])):
        diff = (r["measured"] - r["predicted"]) / r["predicted"]
        good = abs(diff) <= TOLERANCE and r["bitwise"]
        ok &= good
        print(f"{r['layout']:<44} {r['rank']:>4} {r['checkpointed']:>4} {r['predicted']:>11,} {r['measured']:>11,} "
              f"{100 * diff:>6.2f}% {r['unplanned']:>11,} {'bitwise' if r['bitwise'] else 'DIFFER':>7}"
              f"{'' if good else '  FAIL'}")
    print(f"\n{'PASS' if ok else 'FAIL'}: {len(rows)} rank rows, measured within {100 * TOLERANCE:g} % of predicted "
          f"and gradients bitwise; {time.perf_counter() - t0:.0f} s (load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
