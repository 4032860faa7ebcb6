"""A ``torch.distributed.pipelining`` schedule as the planner reads it: which stages a rank runs
and the order of its compute actions, without a process group.

    layout = ScheduleLayout.of(Schedule1F1B, n_microbatches=8, n_stages=4)
    layout.actions(rank=0)        # [(0, "F", 0), (0, "F", 1), ..., (0, "B", 7)]
    layout.stages_of(rank=0)      # (0,)

Where the order comes from (torch 2.13):

* the runtime schedules (``_PipelineScheduleRuntime``: Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble) run ``pipeline_order_with_comms[rank]``: their ``pipeline_order``
  with communication inserted, the compute actions in the same order. The constructor computes
  ``pipeline_order`` from a few attributes of its stages, so it is built here over stand-in
  stages, once for every rank, without the lowering that inserts the communication (quadratic
  in the micro-batches); torch's own checks of the order run, and the order is played once with
  its dependencies (``makespan.simulate``), as the lowering plays it;
* GPipe and 1F1B (``PipelineScheduleSingle``) run the loop in their ``_step_microbatches``: GPipe
  every forward then every backward; 1F1B ``min(n, stages - stage)`` warm-up forwards, then
  backward/forward pairs, then the remaining backwards. Their ``pipeline_order`` is a drawing,
  and 1F1B's names micro-batches 1..n on the last rank, so it is not used;
* the V schedules (ZBV, DualPipeV) hand a stage's output to the next stage on the same rank
  without a receive buffer and overlap forward and backward: not modelled, refused.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["Runtime", "ScheduleLayout", "Action", "ScheduleError", "SCHEDULES", "MAX_MICROBATCHES",
           "MAX_STAGES", "MAX_STAGE_MICROBATCHES", "schedule_class"]

Action = tuple[int, str, int]
"""(stage index, ``"F"`` / ``"B"`` / ``"I"`` / ``"W"``, micro-batch index)."""

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble")
"""The schedules laid out here, by class name (the name a plan file records)."""

MAX_MICROBATCHES = 4096
"""Micro-batches per step, at most. torchtitan's configurations run tens to low hundreds
(its local batch over ``pipeline_parallel_microbatch_size``), and so do published large runs
(GPT-3 175B on Megatron-LM: a global batch of 1,536 over 8 data-parallel replicas, one sample per
micro-batch: 192); 4,096 is twenty times that. A rank's layout grows linearly with the count,
and so do a stage's receive buffers, one per micro-batch; a count far above the bound is a typo,
which would otherwise only exhaust memory."""

MAX_STAGES = 1024
"""Stages over all ranks, at most: 128 pipeline ranks of 8 virtual stages (large runs use 16
ranks of 1 to 8)."""

MAX_STAGE_MICROBATCHES = 2**16
"""``n_stages * n_microbatches``, at most: the pipeline's forwards, which its layout and
``pipeline_step`` play one by one (128 stages of 512 micro-batches, 16 of 4,096)."""


class ScheduleError(ValueError):
    """A schedule the planner cannot lay out; the message says what it supports."""


def schedule_class(name: Any) -> type:
    """The torch schedule class named ``name``, one of :data:`SCHEDULES` (a plan file's
    ``schedule``: nothing else is looked up)."""
    if not isinstance(name, str) or name not in SCHEDULES:
        shown = repr(name) if len(repr(name)) <= 60 else f"{repr(name)[:40]}..."
        raise ScheduleError(f"schedule {shown} is not one the planner lays out; known: {', '.join(SCHEDULES)}")
    from torch.distributed.pipelining import schedules

    return getattr(schedules, name)


class Runtime(enum.Enum):
    """Which of torch's loops runs the schedule: it decides how long sent tensors live."""

    GPIPE = "gpipe"
    """``ScheduleGPipe._step_microbatches``: keeps every send's Work to the step's end."""
    ONE_F_ONE_B = "1f1b"
    """``Schedule1F1B._step_microbatches``: keeps a send only until its variable is reassigned."""
    RUNTIME = "runtime"
    """``_PipelineScheduleRuntime``: keeps every send's Work in ``send_ops`` to the step's end."""


class _StandIn:
    """What a runtime schedule's constructor reads of a stage."""

    def __init__(self, stage_index: int, n_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index, self.num_stages = stage_index, n_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.is_first, self.is_last = stage_index == 0, stage_index == n_stages - 1


def _count(name: str, v: Any, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
        raise ScheduleError(f"{name} must be an int in [1, {high:,}], got {v!r}"[:200])
    return v


@dataclass(frozen=True)
class ScheduleLayout:
    """A schedule class over ``n_stages`` stages on ``n_stages // virtual_stages`` ranks."""

    schedule_cls: type
    n_microbatches: int
    n_stages: int
    virtual_stages: int

    @classmethod
    def of(cls, schedule: Any, *, n_microbatches: int, n_stages: int, virtual_stages: int = 1) -> "ScheduleLayout":
        """``schedule``: a torch schedule class, or a schedule object (its class is used). The
        schedule is checked as torch's constructor checks it, and its order laid out once."""
        sched_cls = schedule if isinstance(schedule, type) else type(schedule)
        _count("n_microbatches", n_microbatches, MAX_MICROBATCHES)
        _count("n_stages", n_stages, MAX_STAGES)
        _count("virtual_stages", virtual_stages, n_stages)
        if n_stages * n_microbatches > MAX_STAGE_MICROBATCHES:
            raise ScheduleError(f"{n_stages} stages of {n_microbatches} micro-batches: at most "
                                f"{MAX_STAGE_MICROBATCHES:,} stage micro-batches are laid out (n_stages * n_microbatches)")
        return _checked(sched_cls, n_microbatches, n_stages, virtual_stages)

    @property
    def n_ranks(self) -> int:
        return self.n_stages // self.virtual_stages

    @property
    def runtime(self) -> Runtime:
        name = self.schedule_cls.__name__
        return {"ScheduleGPipe": Runtime.GPIPE, "Schedule1F1B": Runtime.ONE_F_ONE_B}.get(name, Runtime.RUNTIME)

    @functools.cached_property
    def split_backward(self) -> bool:
        """The schedule runs input- and weight-gradient halves (I, W) apart."""
        return any(k in ("I", "W") for acts in self._orders.values() for _, k, _ in acts)

    @functools.cached_property
    def _stage_rank(self) -> dict[int, int]:
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        return generate_stage_to_rank_mapping(self.n_ranks, self.n_stages, style="loop")

    def stage_to_rank(self) -> dict[int, int]:
        return dict(self._stage_rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(sorted(s for s, r in self._stage_rank.items() if r == rank))

    def rank_of(self, stage: int) -> int:
        return self._stage_rank[stage]

    def actions(self, rank: int) -> list[Action]:
        """The rank's compute actions in the order torch runs them."""
        if not 0 <= rank < self.n_ranks:
            raise ScheduleError(f"rank must be in [0, {self.n_ranks}), got {rank}")
        return list(self._orders[rank])

    @functools.cached_property
    def _orders(self) -> dict[int, tuple[Action, ...]]:
        n = self.n_microbatches
        if self.runtime is Runtime.GPIPE:
            return {r: tuple([(r, "F", m) for m in range(n)] + [(r, "B", m) for m in range(n)])
                    for r in range(self.n_ranks)}
        if self.runtime is Runtime.ONE_F_ONE_B:
            return {r: tuple(_one_f_one_b(r, self.n_stages, n)) for r in range(self.n_ranks)}
        return _runtime_orders(self)


@functools.lru_cache(maxsize=64)
def _checked(sched_cls: type, n_microbatches: int, n_stages: int, virtual_stages: int) -> ScheduleLayout:
    """The layout, refused where torch's constructor refuses it or its order cannot run (one
    instance per schedule: its order is laid out once)."""
    from torch.distributed.pipelining import schedules as S

    name = getattr(sched_cls, "__name__", repr(sched_cls))
    if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") and getattr(S, name, None) is sched_cls:
        raise ScheduleError(f"{name} (a V schedule: adjacent stages on one rank hand over "
                            "without receive buffers) is not modelled yet; plan with ScheduleGPipe, "
                            "Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS or "
                            "ScheduleInterleavedZeroBubble")
    if name not in SCHEDULES or getattr(S, name) is not sched_cls:
        raise ScheduleError(f"schedule must be a torch.distributed.pipelining schedule class or object, one of "
                            f"{', '.join(SCHEDULES)}; got {name[:60]}")
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    if single and virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per rank: virtual_stages must be 1")
    if n_stages % virtual_stages:
        raise ScheduleError(f"n_stages ({n_stages}) must be a multiple of virtual_stages ({virtual_stages})")
    if name == "Schedule1F1B" and n_microbatches < n_stages:
        raise ScheduleError(f"Schedule1F1B needs n_microbatches >= n_stages ({n_stages}), got {n_microbatches}")
    layout = ScheduleLayout(sched_cls, n_microbatches, n_stages, virtual_stages)
    if not single:  # torch's order, played as its lowering plays it (GPipe's and 1F1B's are ours)
        from estimators.pipeline.makespan import DeadlockError, simulate

        try:
            simulate(layout._orders, layout._stage_rank, lambda _s, _k: 0.0)
        except DeadlockError as e:
            raise ScheduleError(f"{name} with {n_microbatches} micro-batches over {n_stages} stages: {e}") from None
    return layout


def _one_f_one_b(stage: int, n_stages: int, n: int) -> list[Action]:
    warm = min(n, n_stages - stage)
    out: list[Action] = [(stage, "F", m) for m in range(warm)]
    f, b = warm, 0
    while True:
        out.append((stage, "B", b))
        b += 1
        if f == n:
            break
        out.append((stage, "F", f))
        f += 1
    return out + [(stage, "B", m) for m in range(b, n)]


@functools.cache
def _order_only(sched_cls: type) -> type:
    """``sched_cls`` whose constructor stops at ``pipeline_order``: torch's checks of the order
    run, the lowering that inserts communication (quadratic in the micro-batches, and it moves
    no compute action) does not."""

    def _prepare_schedule_with_comms(self, actions, format="compute_only"):
        self._validate_and_set_stage_mapping(actions)

    return type(f"{sched_cls.__name__}Order", (sched_cls,), {"_prepare_schedule_with_comms": _prepare_schedule_with_comms})


def _runtime_orders(layout: ScheduleLayout) -> dict[int, tuple[Action, ...]]:
    stages = [_StandIn(s, layout.n_stages, layout.n_ranks, 0) for s in layout.stages_of(0)]
    name = layout.schedule_cls.__name__
    try:
        sched = _order_only(layout.schedule_cls)(stages, layout.n_microbatches)
    except (ValueError, AssertionError) as e:  # torch's own checks (its messages can hold the whole order)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ScheduleError(f"{name} with {layout.n_microbatches} micro-batches on {layout.n_ranks} ranks: torch "
                            f"refuses it ({first[:300]})") from None
    out: dict[int, tuple[Action, ...]] = {}
    for rank in range(layout.n_ranks):
        acts: list[Action] = []
        for a in sched.pipeline_order[rank]:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                if sub.computation_type.value in ("F", "B", "I", "W"):
                    acts.append((sub.stage_index, sub.computation_type.value, sub.microbatch_index))
        out[rank] = tuple(acts)
    return out
