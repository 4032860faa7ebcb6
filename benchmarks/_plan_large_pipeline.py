"""The pipeline layout of ``benchmarks/plan_large.py``: Llama-3.1-405B planned per rank of a
torchtitan-style PP x DP x TP mesh, in this one process on torch's fake process group.

Each pipeline stage holds whole layers (the first + the embedding, the last + the final norm and
the output projection) and is parallelized over the ``tp`` dim as torchtitan does (tensor +
sequence parallel, vocabulary-sharded embedding and logits under ``loss_parallel``:
``examples.pipeline_stages.llama_stage_builder``); the rank runs its stage at its local shapes
with the collectives DTensor issues (``planner.distributed.pipeline.fake_layout_rank``). The
``dp`` dim divides the stage's parameters, gradients and optimizer state (ZeRO-style,
``PlanOptions.world_size``): FSDP2's own buffers under a pipeline are not modelled
(docs/pipeline.md#limits). The rank at ``(pp=s, dp=0, tp=0)`` is planned for every stage ``s``
(the other ranks of a stage run the same shapes); the first, one middle and the last stage are
traced, the other middle stages use the middle trace under their own layer names.
"""

from __future__ import annotations

import time

import torch

GiB = 2**30

LLAMA31_405B = dict(vocab_size=128_256, n_layers=126, dim=16_384, n_heads=128, n_kv_heads=8, ffn_dim=53_248)


def plan_405b(*, pp: int, tp: int, dp: int, n_microbatches: int, seq_len: int, budget_gib: float, device: str,
              schedule: str = "Schedule1F1B") -> dict:
    """Plan every stage's rank; returns figures per stage and the wall time."""
    import dataclasses

    from torch.distributed import pipelining

    from estimators.pipeline.stage_trace import renamed
    from examples.llama import LlamaConfig
    from examples.pipeline_stages import layer_ranges, llama_stage_builder
    from planner import PlanOptions, PlanningError
    from planner.distributed.pipeline import fake_layout_rank

    t0, cpu0 = time.perf_counter(), time.process_time()
    config = LlamaConfig(seq_len=seq_len, **LLAMA31_405B)
    build = llama_stage_builder(config, n_stages=pp, micro_batch=1, dtype=torch.bfloat16, sequence_parallel=True)
    ranges = layer_ranges(config.n_layers, pp)
    mesh = {"pp": pp, "dp": dp, "tp": tp}
    options = PlanOptions(device=device)
    middle = 1 if pp > 2 else None
    traced, rows, trace_s = {}, [], 0.0
    for s in range(pp):
        t_stage = time.perf_counter()
        estimates = None
        if s not in (0, pp - 1, middle):  # a middle stage: the traced one's modules under this stage's names
            shift = ranges[s].start - ranges[middle].start
            estimates = {s: renamed(traced[middle], lambda f, k=shift: _shift_layers(f, k))}
        with fake_layout_rank(build, mesh_shape=mesh, rank=s * dp * tp, schedule=getattr(pipelining, schedule),
                              n_microbatches=n_microbatches, options=options, estimates=estimates) as (rp, _):
            traced.setdefault(s, rp.traced[s])
            trace_s += rp.trace_time_s if estimates is None else 0.0
            try:
                plan = dataclasses.replace(rp.plan(budget_gib)[s], train_step=None)
                planned, n_mod, rct, makespan = (plan.predicted_peak_bytes, len(plan.modules), plan.recompute_ms,
                                                 plan.pipeline.makespan_ms)
            except PlanningError as e:  # a budget below the floor: report it per rank
                planned, n_mod, rct, makespan = None, 0, 0.0, None
                print(f"  stage {s}: {e}")
            rows.append(dict(stage=s, layers=len(ranges[s]), unplanned=rp.unplanned_peak_bytes,
                             floor=rp.min_peak_bytes(), planned=planned, modules=n_mod, recompute_ms=rct,
                             makespan_ms=makespan, seconds=time.perf_counter() - t_stage,
                             traced=estimates is None))
    return dict(rows=rows, wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0, trace_s=trace_s)


def _shift_layers(fqn: str, k: int) -> str:
    parts = fqn.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        parts[2] = str(int(parts[2]) + k)
    return ".".join(parts)
