"""What the search says of one layout: its status, per-rank peak and modelled step time."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from planner.search.cost import StepTime
from planner.search.layouts import Layout

__all__ = ["Status", "Evaluation"]


class Status(str, enum.Enum):
    FITS = "fits"
    """Planned and verified per rank: the plan traced with it applied fits the budget."""
    PLANNED = "planned"
    """The MILP's per-rank plan fits the budget; not traced yet (not called a fit)."""
    OVER = "over budget"
    """No plan reaches the budget on some rank."""
    BOUNDED = "bounded"
    """Not planned (a pipeline layout: not traced either): a lower bound of its step time is over
    the fastest planned layout's."""
    NOT_EVALUATED = "not evaluated"
    """A layout the planner cannot plan yet (the reason says which capability is missing)."""


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One layout's per-rank memory (exact where verified) and step time (modelled)."""

    layout: Layout
    status: Status
    peak_bytes: int = 0
    """The binding rank's peak: the plan's (MILP or traced, see ``status``), or the smallest
    reachable one where over budget."""
    binding: str = ""
    """Which rank binds (``"every rank"`` where all run the same program)."""
    rank_peaks: tuple[int, ...] = ()
    """Pipeline layouts: the peak of each pipeline rank (every data-parallel replica alike)."""
    checkpointed: int = 0
    """Modules the plan checkpoints (on the binding rank)."""
    time: StepTime | None = None
    why: str = ""
    """Over budget or not evaluated: which rank, what fills it / what is missing."""
    bound_ms: float | None = None
    """The lower bound of the step the screening ranked it by: a pipeline layout's before tracing
    (``cost.pipeline_bound``), a whole-model layout's before its MILP (its step, nothing recomputed)."""
    floor_bytes: int | None = None
    """Pipeline layouts: the lower bound of the largest rank's peak computed before tracing."""
    program: str = ""
    plans: tuple = field(default=(), compare=False)
    """Verified plans of the layout's distinct ranks (``Plan``), for plan files."""

    @property
    def step_ms(self) -> float:
        return self.time.step_ms if self.time is not None else float("inf")

    @property
    def runs(self) -> bool:
        """Planned or verified under the budget: it has a step time to rank."""
        return self.status in (Status.FITS, Status.PLANNED)
