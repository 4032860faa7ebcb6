"""The per-rank programs the search traces, each once: a rank of a layout runs a program fixed by its
tensor- and context-parallel degrees, its micro-batch and (under PP) its stage's layers. FSDP's
degree, HSDP's replicas and the accumulation count change what the program's state shards into and
how often it runs, not the program: they are priced by numbers on the one trace
(``planner.distributed.fsdp``, ``planner.search.cost``).

    with World(family, cluster, tp=8, cp=1) as world:      # torch's fake process group, 8 x 1 ranks
        est = world.trace_model(micro_batch=1, accumulation=64)
        stages = world.trace_stages(StageSet(pp=4, virtual=1, split=False, micro_batch=1), n_microbatches=32)

A ``World`` builds the model once on the meta device, parallelizes it as torchtitan does, and
caches every trace made in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from estimators.step.stage_step import StageRole
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import Estimate, estimate

__all__ = ["World", "StageSet", "StageTraces"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class StageSet:
    """The stage programs of one pipeline split: every layout with these degrees (whatever its
    schedule of the same kind, micro-batch count or FSDP degree) runs these stages."""

    pp: int
    virtual: int
    split: bool
    """Zero-bubble schedules run the backward's input and weight halves apart: traced so."""
    micro_batch: int


@dataclass(frozen=True)
class StageTraces:
    """One traced micro-batch per stage of a split (middle stages: one trace, renamed)."""

    modules: dict[int, torch.nn.Module]
    steps: dict[int, TrainStep]
    estimates: dict[int, Estimate]
    traced: int
    """How many stage programs were traced (the rest are renames)."""


class World:
    """A fake process group of ``tp x cp`` ranks with the model built and parallelized in it."""

    def __init__(self, family, cluster, *, tp: int, cp: int, progress: bool = False,
                 stage_cache: dict | None = None) -> None:
        """``stage_cache``: the stage traces of earlier Worlds of the search (kept across a
        (TP, CP) world closed and opened again, and across splits: see ``trace_stages``)."""
        self.family, self.cluster, self.tp, self.cp = family, cluster, tp, cp
        self.progress = progress
        self._models: dict[Any, Estimate] = {}
        cache = stage_cache if stage_cache is not None else {}
        self._stages: dict[Any, StageTraces] = cache.setdefault(("splits", tp, cp), {})
        self._programs: dict[tuple, tuple[Estimate, int]] = cache.setdefault(("programs", tp, cp), {})
        """(micro-batch, split backward, first, last, layers) -> (the stage's trace, its first layer)."""
        self.cache: dict[Any, Any] = {}
        """What an evaluator derives from this world's traces (per-rank points, MILPs)."""
        self.traced = 0
        self.trace_s = 0.0
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> "World":
        from torch.distributed.device_mesh import init_device_mesh

        from planner.distributed.fake_world import fake_process_group

        self._exit.enter_context(fake_process_group(world_size=self.tp * self.cp, rank=0))
        self.mesh = init_device_mesh("cpu", (self.cp, self.tp), mesh_dim_names=("cp", "tp"))
        self.model = self.family.build()
        if self.tp > 1:
            self.family.parallelize(self.model, self.mesh["tp"])
        self.units = self.family.fsdp_units(self.model)
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    @property
    def local_seq(self) -> int:
        return self.family.seq_len // self.cp

    def context(self):
        """What each micro-batch runs in: loss_parallel with TP, context_parallel over ``cp``."""
        if self.tp == 1 and self.cp == 1:
            return None
        from torch.distributed.tensor.parallel import loss_parallel

        if self.cp == 1:
            return loss_parallel
        from torch.distributed.tensor.experimental import context_parallel

        tp, mesh, seq = self.tp, self.mesh, self.family.seq_len

        def both():
            stack = contextlib.ExitStack()
            if tp > 1:
                stack.enter_context(loss_parallel())
            # The inputs are already this rank's chunk; a placeholder buffer satisfies the API.
            stack.enter_context(context_parallel(mesh["cp"], buffers=[torch.zeros(1, seq)], buffer_seq_dims=[1]))
            return stack

        return both

    # ------------------------------------------------------------------ whole model
    def model_step(self, micro_batch: int, accumulation: int) -> TrainStep:
        tokens = self.family.tokens(micro_batch, self.local_seq)
        return TrainStep(inputs=(tokens,), loss_fn=self.model.loss_fn, optimizer="adamw",
                         micro_batches=accumulation, context=self.context())

    def trace_model(self, *, micro_batch: int, accumulation: int) -> Estimate:
        """The whole model's step on one rank (cached)."""
        key = (micro_batch, accumulation)
        if key not in self._models:
            t0 = time.perf_counter()
            self._models[key] = estimate(self.model, self.model_step(micro_batch, accumulation),
                                         device=self.cluster.spec)
            self._note(t0, f"TP {self.tp} CP {self.cp} mb {micro_batch}: whole model")
        return self._models[key]

    def layer_times(self, micro_batch: int) -> Estimate:
        """A whole-model trace at ``micro_batch`` for its per-layer times: one already made (any
        accumulation runs the same ops), or one with accumulation."""
        made = [est for (mb, acc), est in self._models.items() if mb == micro_batch]
        return made[0] if made else self.trace_model(micro_batch=micro_batch, accumulation=2)

    # ------------------------------------------------------------------ pipeline stages
    @property
    def boundary_seq(self) -> int:
        """Tokens of the residual stream a stage hands over: a sequence shard under TP's
        sequence parallelism."""
        return self.local_seq // self.tp

    def stage_step(self, s: int, n_stages: int, micro_batch: int) -> TrainStep:
        seq = self.local_seq
        tokens = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
        return TrainStep(inputs=tokens if s == 0 else self.family.hidden(micro_batch, self.boundary_seq),
                         loss_fn=self.family.stage_loss, optimizer="adamw",
                         target=tokens if s == n_stages - 1 else None,
                         context=self.context() if self.tp > 1 else None)

    def stage_module(self, layer_ids: range, *, first: bool, last: bool) -> torch.nn.Module:
        """A stage of the model; under TP split from the unparallelized model, then parallelized
        as torchtitan does (split, then TP)."""
        if self.tp == 1:
            return self.family.stage(self.model, layer_ids, first=first, last=last)
        if not hasattr(self, "_plain"):
            self._plain = self.family.build()
        module = self.family.stage(self._plain, layer_ids, first=first, last=last)
        self.family.parallelize(module, self.mesh["tp"])
        return module

    def trace_stages(self, split: StageSet, *, options_for) -> StageTraces:
        """Every stage of ``split``, each distinct stage program traced once (cached across
        splits and across this (TP, CP)'s Worlds). A stage's program is fixed by its role (first,
        last, split backward), its layer count and the micro-batch: a stage of the same program
        under other layer names (a middle stage of 10 layers at layers 10-19 or 40-49, in a split
        of 8 stages or of 4 ranks x 2) is the traced one renamed. ``options_for(stage)``: the
        PlanOptions a RankPlanner of that stage uses (the trace must be the one it would make)."""
        if split in self._stages:
            return self._stages[split]
        from estimators.pipeline.stage_trace import renamed
        from planner.planning.pipeline_solve import trace_stage

        n = split.pp * split.virtual
        ranges = self.family.stage_layers(n)
        modules = {s: self.stage_module(ranges[s], first=s == 0, last=s == n - 1) for s in range(n)}
        steps = {s: self.stage_step(s, n, split.micro_batch) for s in range(n)}
        estimates: dict[int, Estimate] = {}
        traced = 0
        for s in range(n):
            key = (split.micro_batch, split.split, s == 0, s == n - 1, len(ranges[s]))
            if key in self._programs:
                est, start = self._programs[key]
                shift = ranges[s].start - start
                estimates[s] = renamed(est, lambda f, k=shift: _shift_layers(f, k)) if shift else est
                continue
            t0 = time.perf_counter()
            role = StageRole(is_first=s == 0, is_last=s == n - 1, split_backward=split.split)
            estimates[s] = trace_stage(modules[s], steps[s], role, options_for(s))
            self._programs[key] = (estimates[s], ranges[s].start)
            traced += 1
            self._note(t0, f"TP {self.tp} CP {self.cp} mb {split.micro_batch}: stage {s} of {n} "
                           f"({len(ranges[s])} layers{', split backward' if split.split else ''})")
        self._stages[split] = StageTraces(modules, steps, estimates, traced)
        return self._stages[split]

    def _note(self, t0: float, what: str) -> None:
        dt = time.perf_counter() - t0
        self.traced += 1
        self.trace_s += dt
        logger.info("traced %s in %.1f s", what, dt)
        if self.progress:
            print(f"[search] traced {what} in {dt:.1f} s", file=sys.stderr, flush=True)


def _shift_layers(fqn: str, k: int) -> str:
    """``Stage.layers.8.x`` -> ``Stage.layers.<8 + k>.x``: a middle stage's trace under another
    stage's layer names."""
    parts = fqn.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        parts[2] = str(int(parts[2]) + k)
    return ".".join(parts)


def replace_step(step: TrainStep, **changes) -> TrainStep:
    return dataclasses.replace(step, **changes)
