"""A ``torch.distributed.pipelining`` schedule as the planner reads it: which stages a rank runs
and the order of its compute actions, without a process group.

    layout = ScheduleLayout.of(Schedule1F1B, n_microbatches=8, n_stages=4)
    layout.actions(rank=0)        # [(0, "F", 0), (0, "F", 1), ..., (0, "B", 7)]
    layout.stages_of(rank=0)      # (0,)

Where the order comes from (torch 2.13):

* the runtime schedules (``_PipelineScheduleRuntime``: Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble) run ``pipeline_order_with_comms[rank]`` as it is. The constructor
  computes it from a few attributes of its stages, so it is built here over stand-in stages;
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

__all__ = ["Runtime", "ScheduleLayout", "Action", "ScheduleError"]

Action = tuple[int, str, int]
"""(stage index, ``"F"`` / ``"B"`` / ``"I"`` / ``"W"``, micro-batch index)."""


class ScheduleError(ValueError):
    """A schedule the planner cannot lay out; the message says what it supports."""


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


@dataclass(frozen=True)
class ScheduleLayout:
    """A schedule class over ``n_stages`` stages on ``n_stages // virtual_stages`` ranks."""

    schedule_cls: type
    n_microbatches: int
    n_stages: int
    virtual_stages: int

    @classmethod
    def of(cls, schedule: Any, *, n_microbatches: int, n_stages: int, virtual_stages: int = 1) -> "ScheduleLayout":
        """``schedule``: a torch schedule class, or a schedule object (its class is used)."""
        from torch.distributed.pipelining import schedules as S

        sched_cls = schedule if isinstance(schedule, type) else type(schedule)
        if not issubclass(sched_cls, S._PipelineSchedule):
            raise ScheduleError(f"schedule must be a torch.distributed.pipelining schedule class or object "
                                f"(e.g. Schedule1F1B), got {sched_cls.__name__}")
        if issubclass(sched_cls, (S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV)):
            raise ScheduleError(f"{sched_cls.__name__} (a V schedule: adjacent stages on one rank hand over "
                                "without receive buffers) is not modelled yet; plan with ScheduleGPipe, "
                                "Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS or "
                                "ScheduleInterleavedZeroBubble")
        single = issubclass(sched_cls, S.PipelineScheduleSingle)
        if single and sched_cls not in (S.ScheduleGPipe, S.Schedule1F1B):
            raise ScheduleError(f"{sched_cls.__name__}: of the one-stage-per-rank schedules, ScheduleGPipe and "
                                "Schedule1F1B are modelled")
        if single and virtual_stages != 1:
            raise ScheduleError(f"{sched_cls.__name__} runs one stage per rank: virtual_stages must be 1")
        if n_stages % virtual_stages:
            raise ScheduleError(f"n_stages ({n_stages}) must be a multiple of virtual_stages ({virtual_stages})")
        if sched_cls is S.Schedule1F1B and n_microbatches < n_stages:
            raise ScheduleError(f"Schedule1F1B needs n_microbatches >= n_stages ({n_stages}), got {n_microbatches}")
        return cls(sched_cls, n_microbatches, n_stages, virtual_stages)

    @property
    def n_ranks(self) -> int:
        return self.n_stages // self.virtual_stages

    @property
    def runtime(self) -> Runtime:
        from torch.distributed.pipelining import schedules as S

        if self.schedule_cls is S.ScheduleGPipe:
            return Runtime.GPIPE
        if self.schedule_cls is S.Schedule1F1B:
            return Runtime.ONE_F_ONE_B
        return Runtime.RUNTIME

    @property
    def split_backward(self) -> bool:
        """The schedule runs input- and weight-gradient halves (I, W) apart."""
        return any(k in ("I", "W") for r in range(self.n_ranks) for _, k, _ in self.actions(r))

    def stage_to_rank(self) -> dict[int, int]:
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        return generate_stage_to_rank_mapping(self.n_ranks, self.n_stages, style="loop")

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(sorted(s for s, r in self.stage_to_rank().items() if r == rank))

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank()[stage]

    def actions(self, rank: int) -> list[Action]:
        """The rank's compute actions in the order torch runs them."""
        if not 0 <= rank < self.n_ranks:
            raise ScheduleError(f"rank must be in [0, {self.n_ranks}), got {rank}")
        if self.runtime is Runtime.GPIPE:
            n = self.n_microbatches
            return [(rank, "F", m) for m in range(n)] + [(rank, "B", m) for m in range(n)]
        if self.runtime is Runtime.ONE_F_ONE_B:
            return _one_f_one_b(rank, self.n_stages, self.n_microbatches)
        return list(_runtime_actions_by_rank(self)[rank])


    def actions_by_rank(self) -> dict[int, list[Action]]:
        """Every rank's ``actions``; a runtime schedule's order is built once for all of them (it
        is the same torch computation whichever rank asks)."""
        return {r: self.actions(r) for r in range(self.n_ranks)}


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


@functools.lru_cache(maxsize=64)
def _runtime_actions_by_rank(layout: ScheduleLayout) -> dict[int, tuple[Action, ...]]:
    """Every rank's compute actions from one construction of torch's schedule (its constructor
    lays out every rank: building it once per rank asked made a 16-rank interleaved schedule's
    order cost 16 constructions; planning every rank cost 16 x 16)."""
    stages = [_StandIn(s, layout.n_stages, layout.n_ranks, 0) for s in layout.stages_of(0)]
    order = layout.schedule_cls(stages, layout.n_microbatches).pipeline_order_with_comms
    return {r: tuple(_compute_actions(order[r])) for r in range(layout.n_ranks)}


def _compute_actions(order) -> list[Action]:
    out: list[Action] = []

    def add(a) -> None:
        if a.sub_actions:
            for sub in a.sub_actions:
                add(sub)
        elif a.computation_type.value in ("F", "B", "I", "W"):
            out.append((a.stage_index, a.computation_type.value, a.microbatch_index))

    for a in order:
        add(a)
    return out
