"""The rank side of ``benchmarks/pipeline_e2e.py``: real ``torch.distributed.pipelining`` runs on
gloo ranks at 127.0.0.1, each step's peak measured by MemTracker (``planner.analysis.measure_run``).

    results = run_ranks(rank_worker, 2, "llama", configs, timeout_s=1800)

Every process ends by itself: results go through a queue, then the group is destroyed and the
process leaves with ``os._exit(0)`` (gloo's threads can outlive ``destroy_process_group`` once
FakeTensorMode ran in the process: see tests/planner/spawned.py); the parent kills any rank still
alive at its deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch

MB_SIZE, SEQ = 2, 32
"""A micro-batch: 2 sequences of 32 tokens."""

SCHEDULES = {"GPipe": ("ScheduleGPipe", 1), "1F1B": ("Schedule1F1B", 1),
             "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2), "InterleavedZB": ("ScheduleInterleavedZeroBubble", 2)}
"""Name -> (torch schedule class, stages per rank)."""


@dataclass(frozen=True)
class RunConfig:
    schedule: str
    n_microbatches: int
    plans: dict | None = None
    """{stage: Plan} applied on the PipelineStages (None: unplanned); with ``tp > 1``
    {rank: {stage: Plan}}, each rank's own plans."""
    timed_steps: int = 0
    """Untracked steps timed after the measured ones."""
    tp: int = 1
    """Tensor-parallel degree inside each stage: the ranks are a (pp, tp) mesh, rank r runs
    pipeline rank r // tp, and each stage's module is parallelized over its ``tp`` group as
    torchtitan does (``examples.tensor_parallel.parallelize_llama``, loss_parallel; llama only)."""
    sequence_parallel: bool = True
    """With ``tp > 1``: sequence parallelism on (activations between stages are sequence shards)."""
    dp: int = 1
    """FSDP2 degree inside each stage: the ranks are a (pp, dp[, tp]) mesh, rank r runs pipeline
    rank r // (dp * tp) on the batch of its dp coordinate, and each stage's module is
    ``fully_shard``-ed over its ``dp`` group as torchtitan does under PP
    (``examples.pipeline_stages.shard_llama_stage``; llama only)."""
    plan_here_gib: dict[int, float] | None = None
    """{rank: budget}: before the run, each rank plans its stages on the live group at its
    budget (tracing them at its local shapes, as ``solve_sac`` does in a job) and returns the
    plans' hashes (``live_plan_hashes``)."""

    def plans_of(self, rank: int) -> dict:
        """The {stage: Plan} this rank applies."""
        if not self.plans:
            return {}
        return self.plans.get(rank, {}) if self.tp > 1 or self.dp > 1 else self.plans


def build_model(kind: str) -> torch.nn.Module:
    from examples.pipeline_stages import llama_pipeline_model, qwen2_pipeline_model

    return llama_pipeline_model() if kind == "llama" else qwen2_pipeline_model()


def build_stage(kind: str, model: torch.nn.Module, stage: int, n_stages: int) -> torch.nn.Module:
    from examples.pipeline_stages import hf_decoder_stage, llama_stage

    return (llama_stage if kind == "llama" else hf_decoder_stage)(model, stage, n_stages)


def batch(n_microbatches: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n_microbatches * MB_SIZE, SEQ), generator=g)


def receive_buffers(stages) -> list[torch.Tensor]:
    out = []
    for st in stages:
        for table in (st.args_recv_info, st.grad_recv_info):
            for infos in table.values():
                out += [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return out


def _grad_digest(modules) -> str:
    """The rank's gradients (its local shards under tensor parallelism), bit for bit."""
    h = hashlib.sha256()
    for m in modules:
        for name, p in m.named_parameters():
            h.update(name.encode())
            g = p.grad
            g = g.to_local() if hasattr(g, "to_local") else g
            h.update(b"none" if g is None else g.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


_MESHES: dict = {}


def pp_tp_mesh(world: int, tp: int, dp: int = 1):
    """The (pp[, dp][, tp]) mesh of ``world`` ranks, dims over 1 only besides pp (made once per
    process: each makes process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if (world, tp, dp) not in _MESHES:
        dims = {"pp": world // (dp * tp), "dp": dp, "tp": tp}
        dims = {k: v for k, v in dims.items() if k == "pp" or v > 1}
        _MESHES[(world, tp, dp)] = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    return _MESHES[(world, tp, dp)]


def tp_stage(kind: str, model: torch.nn.Module, stage: int, n_stages: int, tp_mesh, sequence_parallel: bool):
    """Stage ``stage``'s module parallelized over ``tp_mesh`` (torchtitan's order: split, then TP)."""
    from examples.tensor_parallel import parallelize_llama

    if kind != "llama":
        raise ValueError(f"tensor parallel stages are built for the llama decoder only, not {kind!r}")
    return parallelize_llama(build_stage(kind, model, stage, n_stages), tp_mesh,
                             sequence_parallel=sequence_parallel, loss_parallel=True)


def run_config(rank: int, world: int, kind: str, cfg: RunConfig, n_steps: int = 3) -> dict:
    from torch.distributed import pipelining as pp

    from examples.pipeline_stages import stage_loss
    from planner import apply_plan
    from planner.analysis import measure_run

    cls_name, virtual = SCHEDULES[cfg.schedule]
    pp_size, pp_rank, group, context, dp_rank = world, rank, None, contextlib.nullcontext, 0
    full = build_model(kind)
    if cfg.tp > 1 or cfg.dp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = pp_tp_mesh(world, cfg.tp, cfg.dp)
        per_stage = cfg.tp * cfg.dp
        pp_size, pp_rank, group = world // per_stage, rank // per_stage, mesh["pp"].get_group()
        context = loss_parallel if cfg.tp > 1 else contextlib.nullcontext
        dp_rank = (rank // cfg.tp) % cfg.dp
    n_stages = pp_size * virtual
    local = [pp_rank + v * pp_size for v in range(virtual)]
    mods = [build_stage(kind, full, s, n_stages) if cfg.tp == 1 else
            tp_stage(kind, full, s, n_stages, mesh["tp"], cfg.sequence_parallel) for s in local]
    del full
    if cfg.dp > 1:
        from examples.pipeline_stages import shard_llama_stage

        mods = [shard_llama_stage(m, mesh["dp"]) for m in mods]
    live = _plan_here(cfg, cfg.plan_here_gib[rank], mods, local, n_stages, context) if cfg.plan_here_gib else None
    stages = [pp.PipelineStage(m, s, n_stages, torch.device("cpu"), group=group) for m, s in zip(mods, local)]
    plans = cfg.plans_of(rank)
    handles = [apply_plan(st, plans[s]) for st, s in zip(stages, local) if s in plans]
    cls = getattr(pp, cls_name)
    sched = cls(stages[0] if virtual == 1 else stages, cfg.n_microbatches, loss_fn=stage_loss)
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-3)
    x = batch(cfg.n_microbatches, seed=1 + dp_rank)  # each data-parallel replica its own batch
    first, last = 0 in local, n_stages - 1 in local
    args, kw = ((x,) if first else ()), ({"target": x} if last else {})
    torch.manual_seed(1234 + rank)
    peaks, digest = [], None

    def step(record: bool = False):
        nonlocal digest
        with context():  # loss_parallel around the schedule's step, as torchtitan's train_context
            sched.step(*args, **kw)
        if record:
            digest = _grad_digest(mods)
        opt.step()

    for i in range(n_steps):
        opt.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        # held is built in the call: a list kept here would keep last step's output chunks alive
        peaks.append(measure_run(lambda: step(record=i == n_steps - 1), modules=mods, optimizer=opt,
                                 held=[*([x] if first or last else []), *receive_buffers(stages),
                                       *(c for st in stages for c in st.output_chunks)]).peak_bytes)
    times = []
    for _ in range(cfg.timed_steps):
        opt.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    for h in handles:
        h.remove()
    torch.distributed.barrier()
    return {"peaks": peaks, "grads": digest, "step_ms": times, "live_plan_hashes": live}


def _plan_here(cfg: RunConfig, budget_gib: float, mods, local: list[int], n_stages: int, context) -> dict[int, str]:
    """{stage: plan hash} of this rank's stages planned on the live group (``plan_here_gib``)."""
    from torch.distributed import pipelining as pp

    from examples.pipeline_stages import stage_loss
    from planner import PlanOptions, TrainStep
    from planner.distributed.pipeline import Pipeline, solve_pipeline_rank
    from planner.distributed.ranks import plan_hash

    cls_name, virtual = SCHEDULES[cfg.schedule]
    tokens = batch(1)[:MB_SIZE]  # one micro-batch: (MB_SIZE, SEQ)
    seq = SEQ // cfg.tp if cfg.tp > 1 and cfg.sequence_parallel else SEQ  # a sequence shard between stages
    hidden = torch.empty(MB_SIZE, seq, build_model("llama").config.dim, device="meta")
    steps = {s: (m, TrainStep(inputs=tokens if s == 0 else hidden, loss_fn=stage_loss, optimizer="adamw",
                              target=tokens if s == n_stages - 1 else None,
                              context=context if cfg.tp > 1 else None)) for m, s in zip(mods, local)}
    pipe = Pipeline(getattr(pp, cls_name), n_microbatches=cfg.n_microbatches, stage_index=local[0],
                    n_stages=n_stages, virtual_stages=virtual)
    plans = solve_pipeline_rank(steps, budget_gib, options=PlanOptions(device="cpu", pipeline=pipe))
    return {s: plan_hash(p) for s, p in plans.items()}


def rank_worker(rank: int, world: int, kind: str, configs: list[RunConfig]) -> list[dict]:
    return [run_config(rank, world, kind, c) for c in configs]


# ----------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, q, timeout_s):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        q.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        q.put((rank, "error", traceback.format_exc()))
    q.close()
    q.join_thread()  # the queue's feeder thread must flush before os._exit, which skips it
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 1800.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; its results by rank, or RuntimeError."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q, timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < world and time.monotonic() < deadline:
        try:
            r, status, out = q.get(timeout=2)
            results[r] = (status, out)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: o for r, (s, o) in results.items() if s == "error"}
    if errors or len(results) < world:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items())
        raise RuntimeError(f"ranks failed: {sorted(errors)}; finished {sorted(results)}\n{detail}")
    return [results[r][1] for r in range(world)]
