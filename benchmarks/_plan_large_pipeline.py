"""The pipeline layout of ``benchmarks/plan_large.py``: Llama-3.1-405B planned per stage.

torchtitan-style 3-D layout: PP stages of whole layers (first stage + embedding, last + norm and
output), each rank running its stage at TP-local shapes (heads, KV heads, FFN width and vocabulary
divided by the TP degree), its parameters, gradients and optimizer state divided over the FSDP
ranks (``PlanOptions.world_size``: ZeRO-style, no gathered-parameter buffers added). TP runs here
at local shapes without its collectives (the parallel-layout issue traces them); the figures are
per rank. Three stages are traced (the first, one middle stage for all middle stages, renamed,
the last); every rank gets its own MILP over its schedule.
"""

from __future__ import annotations

import time

import torch

GiB = 2**30

LLAMA31_405B = dict(vocab_size=128_256, n_layers=126, dim=16_384, n_heads=128, n_kv_heads=8, ffn_dim=53_248)


def _meta_stage(config, layer_ids: range, *, first: bool, last: bool):
    """A ``LlamaStage`` built on the meta device (bf16, rotary tables float32)."""
    from examples.llama import RMSNorm, TransformerBlock, rotary_tables
    from examples.pipeline_stages import LlamaStage

    stage = LlamaStage.__new__(LlamaStage)
    torch.nn.Module.__init__(stage)
    with torch.device("meta"):
        stage.tok_embeddings = torch.nn.Embedding(config.vocab_size, config.dim, dtype=torch.bfloat16) if first else None
        stage.layers = torch.nn.ModuleDict({str(i): TransformerBlock(config).to(torch.bfloat16) for i in layer_ids})
        stage.norm = RMSNorm(config.dim, config.norm_eps).to(torch.bfloat16) if last else None
        stage.output = (torch.nn.Linear(config.dim, config.vocab_size, bias=False, dtype=torch.bfloat16)
                        if last else None)
    cos, sin = rotary_tables(config.head_dim, config.seq_len, config.rope_theta)
    stage.register_buffer("rope_cos", cos, persistent=False)
    stage.register_buffer("rope_sin", sin, persistent=False)
    return stage


def plan_405b(*, pp: int, tp: int, dp: int, n_microbatches: int, seq_len: int, budget_gib: float, device: str,
              schedule: str = "Schedule1F1B") -> dict:
    """Plan every stage; returns figures per rank and the wall time."""
    from torch.distributed import pipelining

    from estimators.pipeline.stage_trace import renamed
    from estimators.step.stage_step import StageRole
    from examples.llama import LlamaConfig
    from examples.pipeline_stages import layer_ranges, stage_loss
    from planner import PlanOptions, TrainStep
    from planner.distributed.pipeline import Pipeline, RankPlanner
    from planner.planning.pipeline_solve import trace_stage

    t0, cpu0 = time.perf_counter(), time.process_time()
    c = LLAMA31_405B
    config = LlamaConfig(vocab_size=c["vocab_size"] // tp, seq_len=seq_len, n_layers=c["n_layers"], dim=c["dim"],
                         n_heads=c["n_heads"] // tp, n_kv_heads=max(1, c["n_kv_heads"] // tp), ffn_dim=c["ffn_dim"] // tp)
    ranges = layer_ranges(c["n_layers"], pp)
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    hidden = torch.empty(1, seq_len, c["dim"], dtype=torch.bfloat16, device="meta")

    def steps(s: int):
        stage = _meta_stage(config, ranges[s], first=s == 0, last=s == pp - 1)
        return stage, TrainStep(inputs=tokens if s == 0 else hidden, loss_fn=stage_loss, optimizer="adamw",
                                target=tokens if s == pp - 1 else None)

    def options(s: int) -> PlanOptions:
        return PlanOptions(device=device, world_size=dp, pipeline=Pipeline(
            getattr(pipelining, schedule), n_microbatches=n_microbatches, stage_index=s, n_stages=pp))

    middle = 1 if pp > 2 else None
    traces, t_trace = {}, time.perf_counter()
    for s in sorted({0, pp - 1} | ({middle} if middle is not None else set())):
        stage, step = steps(s)
        role = StageRole(is_first=s == 0, is_last=s == pp - 1, split_backward=options(s).pipeline.layout.split_backward)
        traces[s] = trace_stage(stage, step, role, options(s))
    t_trace = time.perf_counter() - t_trace
    rows = []
    for s in range(pp):
        stage, step = steps(s)
        est = traces.get(s)
        if est is None:  # a middle stage: the traced one's modules under this stage's layer names
            shift = ranges[s].start - ranges[middle].start
            est = renamed(traces[middle], lambda f, k=shift: _shift_layers(f, k))
        rp = RankPlanner({s: (stage, step)}, options=options(s), estimates={s: est})
        floor = rp.min_peak_bytes()
        try:
            plan = rp.plan(budget_gib)[s]
            planned, n_mod, rct = plan.predicted_peak_bytes, len(plan.modules), plan.recompute_ms
        except Exception as e:  # noqa: BLE001 - a budget below the floor: report it per rank
            planned, n_mod, rct = None, 0, 0.0
            print(f"  stage {s}: {e}")
        rows.append(dict(stage=s, layers=len(ranges[s]), unplanned=rp.unplanned_peak_bytes, floor=floor,
                         planned=planned, modules=n_mod, recompute_ms=rct))
    return dict(rows=rows, wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0, trace_s=t_trace)


def _shift_layers(fqn: str, k: int) -> str:
    parts = fqn.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        parts[2] = str(int(parts[2]) + k)
    return ".".join(parts)
