"""``search``: the fastest layout that fits, before launch.

    from examples.llama import llama3_70b
    from planner.search import search

    result = search(llama3_70b, "64xh100", global_batch=512, seq_len=8192)
    print(result.table_text())             # ranked layouts, rejected families, published configs
    result.winner.layout.describe()        # 'TP 8 x FSDP 8, mb 1 x 64'

Enumerates the layouts (``layouts``), rejects those that cannot divide or whose sharded state alone
is over the budget, traces each distinct per-rank program once (``programs``), plans every
candidate per rank at the device's budget and times it (``evaluate``, ``cost``), verifies the best
(``SearchOptions.verify_top``) by tracing them with their plans, and ranks them. Memory figures are
the planner's (exact where verified); times are modelled (roofline and collective model on the
device's datasheet; no GPU measured them).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.errors import PlanningError
from planner.search.evaluate import Evaluator
from planner.search.results import Evaluation, Status
from planner.search.workers import cpu_s
from planner.search.family import model_family
from planner.search.layouts import Cluster, Enumerated, Layout, SearchSpace, enumerate_layouts
from planner.search.published import Published, published_layouts
from solver import SolverOptions

__all__ = ["SearchOptions", "SearchResult", "search"]


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How the search runs."""

    space: SearchSpace = field(default_factory=SearchSpace)
    """The degrees tried (``SearchSpace``)."""
    verify_top: int = 1
    """Trace this many of the fastest planned layouts with their plans (only these can be called
    "fits" where their plan checkpoints anything; a layout that fits unplanned needs no trace)."""
    verify_all: bool = False
    """Trace every planned layout with its plan (every one that fits is then called so)."""
    bound: bool = True
    """Skip planning a layout that is proven slower than one planned before it: a whole-model
    layout that needs a MILP whose step with nothing recomputed is over the fastest planned step,
    a pipeline layout (not traced either) whose makespan with no recompute and no communication
    (from the whole-model program's layer times) is. The winner is the same; False plans every
    layout, and the table ranks them all."""
    published: bool = True
    """Also place the published configurations (torchtitan's recipes, the Llama 3 paper's layout)."""
    solver: SolverOptions = field(default_factory=SolverOptions)
    progress: bool = False
    """Progress lines on stderr (candidates evaluated / total, programs traced)."""
    workers: int | None = None
    """Processes that screen layouts of different (TP, CP), and pipeline splits, side by side
    (forked; the result does not depend on it). None: one per core, at most 4; 1: this process alone."""

    def __post_init__(self) -> None:
        if isinstance(self.verify_top, bool) or not isinstance(self.verify_top, int) or self.verify_top < 0:
            raise PlanningError(f"verify_top must be an int >= 0, got {self.verify_top!r}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise PlanningError(f"workers must be an int >= 1 or None, got {self.workers!r}")
        if not isinstance(self.space, SearchSpace):
            raise TypeError(f"space must be a SearchSpace, got {type(self.space).__name__}")


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """Every layout considered: ranked, rejected with a reason, or placed as published."""

    model: str
    model_config: Any
    """The model's shape (``LlamaConfig``)."""
    param_dtype: str = ""
    """The parameters' dtype as built (the optimizer state and every traced op run in it: a
    float32 model is priced at float32's roofline, not bf16's)."""
    cluster: Cluster
    global_batch: int
    seq_len: int
    evaluations: tuple[Evaluation, ...]
    enumerated: Enumerated
    published: tuple[tuple[Published, Evaluation, Evaluation | None], ...]
    """Each published configuration, its layout's evaluation (the planner's plan), and as
    published (every block checkpointed, where the recipe does so)."""
    flops_per_token: float
    wall_s: float
    cpu_s: float
    programs_traced: int
    trace_s: float
    max_rss_bytes: int
    load_average: tuple[float, float, float]

    @property
    def ranked(self) -> list[Evaluation]:
        """The layouts that run under the budget, fastest (modelled) first."""
        return sorted((e for e in self.evaluations if e.runs), key=lambda e: (e.step_ms, e.layout))

    @property
    def winner(self) -> Evaluation | None:
        """The fastest layout verified to fit, or None."""
        return next((e for e in self.ranked if e.status is Status.FITS), None)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def tokens_per_s(self, e: Evaluation) -> float:
        return e.time.tokens_per_s(self.tokens_per_step) if e.time is not None else 0.0

    def mfu(self, e: Evaluation) -> float:
        """Model FLOPs utilization (modelled): torchtitan's FLOPs per token x tokens/s over the
        cluster's dense bf16 peak."""
        import torch

        peak = self.cluster.spec.flops_per_s(torch.bfloat16) * self.cluster.n_gpus
        return self.flops_per_token * self.tokens_per_s(e) / peak if peak else 0.0

    def rank_of(self, layout: Layout) -> int | None:
        """1-based place of ``layout`` among the ranked layouts, or None."""
        return next((i for i, e in enumerate(self.ranked, 1) if e.layout == layout), None)

    def table_text(self, top: int = 20) -> str:
        from planner.search.report import result_text

        return result_text(self, top=top)


def search(model_fn: Callable[..., Any], cluster: Cluster | str, *, global_batch: int, seq_len: int,
           options: SearchOptions | None = None) -> SearchResult:
    """The ranked layouts of ``model_fn(seq_len=seq_len)`` on ``cluster`` (``"64xh100"`` or a
    ``Cluster``) for ``global_batch`` sequences per step (see the module docstring)."""
    t0, c0 = time.perf_counter(), cpu_s()
    options = options or SearchOptions()
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    for name, v in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanningError(f"{name} must be an int >= 1, got {v!r}")
    family = model_family(model_fn, seq_len=seq_len)
    found = enumerate_layouts(family, cluster, global_batch=global_batch, seq_len=seq_len, space=options.space)
    pubs = published_layouts(family, cluster, global_batch=global_batch, seq_len=seq_len) if options.published else []
    candidates = list(dict.fromkeys([*found.layouts, *(p.layout for p in pubs if p.layout is not None)]))
    ev = Evaluator(family, cluster, global_batch=global_batch, verify_top=options.verify_top,
                   verify_all=options.verify_all, bound=options.bound,
                   solver=options.solver, progress=options.progress,
                   full_ac={p.layout for p in pubs if p.full_ac and p.layout is not None},
                   workers=options.workers)
    evaluations = ev.verify(ev.screen(candidates))
    by_layout = {e.layout: e for e in evaluations}
    placed = tuple((p, by_layout[p.layout] if p.layout is not None else
                    Evaluation(layout=Layout(), status=Status.NOT_EVALUATED, why=p.note),
                    ev.full_ac_results.get(p.layout)) for p in pubs)
    return SearchResult(
        model=family.name, model_config=family.config, param_dtype=str(family.dtype).replace("torch.", ""),
        cluster=cluster, global_batch=global_batch, seq_len=seq_len,
        evaluations=tuple(evaluations), enumerated=found, published=placed,
        flops_per_token=family.flops_per_token(), wall_s=time.perf_counter() - t0,
        cpu_s=cpu_s() - c0, programs_traced=ev.traced, trace_s=ev.trace_s,
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        load_average=os.getloadavg())
