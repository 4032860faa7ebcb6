"""Solver options (what the user may tune), results (what a solve returns), and which backends
can run here. Running a backend is ``solver/milp/backend.py``'s."""

from __future__ import annotations

import enum
import importlib.util
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from solver.errors import BackendUnavailableError

__all__ = ["Backend", "SolverOptions", "SolveStatus", "SolveResult", "backend_available",
           "default_backend", "cbc_path", "highs_load_error"]

logger = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    """MILP backend. HiGHS (highspy, a core dependency) is the default; the module-level MILP
    calls it directly (``solver/milp/linear_model.py``), the op-level one through PuLP. CBC (through PuLP,
    the binary PuLP bundles) stays selectable and is the fallback where highspy cannot load."""

    CBC = "cbc"
    HIGHS = "highs"


def cbc_path() -> str | None:
    """A ``cbc`` on PATH (e.g. from ``pulp[cbc]``) or the binary bundled with PuLP < 4."""
    on_path = shutil.which("cbc")
    if on_path:
        return on_path
    try:
        import pulp
    except ImportError:
        return None
    legacy = getattr(pulp, "PULP_CBC_CMD", None)
    bundled = getattr(legacy, "pulp_cbc_path", None)
    if bundled and os.path.isfile(bundled) and os.access(bundled, os.X_OK):
        return str(bundled)
    return None


def highs_load_error() -> str | None:
    """Why highspy cannot be used here (None: it loads). Imported once, then remembered."""
    global _HIGHS_ERROR
    if _HIGHS_ERROR is _UNCHECKED:
        try:
            import highspy  # noqa: F401  (a broken wheel fails here, not at find_spec)

            _HIGHS_ERROR = None
        except Exception as e:  # ImportError, OSError from a missing shared library, ...
            _HIGHS_ERROR = f"{type(e).__name__}: {e}"
    return _HIGHS_ERROR  # type: ignore[return-value]


_UNCHECKED = object()
_HIGHS_ERROR: object = _UNCHECKED


def backend_available(backend: Backend) -> bool:
    """Whether ``backend`` can run here (no solve is attempted)."""
    if importlib.util.find_spec("pulp") is None:
        return False
    if backend is Backend.CBC:
        return cbc_path() is not None
    return highs_load_error() is None


def default_backend() -> Backend:
    """HiGHS; CBC (with a logged reason) where highspy cannot load."""
    why = highs_load_error()
    if why is None:
        return Backend.HIGHS
    logger.warning("highspy cannot load (%s); falling back to the CBC backend, which is slower "
                   "to prove optimality (reinstall highspy to use HiGHS)", why)
    return Backend.CBC


_INSTALL_HINT = {
    Backend.CBC: "pip install 'pulp[cbc]' (or put a `cbc` binary on PATH)",
    Backend.HIGHS: "pip install highspy (a dependency of sac-planner; reinstall it)",
}


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """How the MILP is solved. By default: HiGHS, plans proven optimal within a relative gap of
    1e-4, single-threaded (reproducible).

    >>> SolverOptions(time_limit_s=10, rel_gap=0.0)  # doctest: +ELLIPSIS
    SolverOptions(backend=<Backend.HIGHS: 'highs'>, time_limit_s=10, rel_gap=0.0, ...)
    """

    backend: Backend | None = None
    """MILP backend; a string ``"cbc"`` / ``"highs"`` is accepted and converted. ``None`` (the
    default) picks HiGHS, or CBC with a logged warning where highspy cannot load."""
    time_limit_s: float | None = 60.0
    """Wall-clock limit of one backend call; ``None`` for no limit. At the limit the best plan
    found so far is returned with status ``FEASIBLE``."""
    rel_gap: float = 1e-4
    """Relative optimality gap at which a solve may stop; 0 asks for exact optimality. 1e-4 by
    default: plans are proven optimal, not approximately so (the program and count branching
    make that affordable on stacks of blocks and trees of distinct modules; see ``SACMilp``). At
    ``time_limit_s`` the best plan found is returned with status FEASIBLE and its gap."""
    count_branching: bool = True
    """Prove big stacks of numbered blocks by branching on how many modules of each kind are
    checkpointed (``solver/milp/count_branch.py``; HiGHS only): where the blocks are nearly
    identical the plain branch and bound moves a fractional block from block to block without
    raising its bound, and the count search proves them fastest. False: such stacks go to the
    program and then to the plain branch and bound, with the same optimum within rel_gap."""
    dynamic_program: bool = True
    """Solve models whose step is a clean nest by the exact program (``solver/exact/``), proven
    within ``rel_gap`` by its own bound, before the backend: it shares no code with the backend,
    is exact where the backend's tolerances decide (small stacks at their smallest peak), and
    proves trees of distinct modules that the backend cannot in its time limit. False: the
    backend alone."""
    threads: int = 1
    """Backend threads. 1 keeps results reproducible run to run."""
    verbose: bool = False
    """Let the backend print its log."""
    write_lp_path: str | Path | None = None
    """If set, the model is written there in LP format before each solve (for reading the maths)."""

    def __post_init__(self) -> None:
        if self.backend is None:
            object.__setattr__(self, "backend", default_backend())
        if isinstance(self.backend, str) and not isinstance(self.backend, Backend):
            try:
                object.__setattr__(self, "backend", Backend(self.backend.lower()))
            except ValueError:
                valid = ", ".join(b.value for b in Backend)
                raise ValueError(f"unknown backend {self.backend!r}; use one of: {valid}") from None
        if not isinstance(self.backend, Backend):
            raise TypeError(f"backend must be a solver.Backend, got {type(self.backend).__name__}")
        if not backend_available(self.backend):
            raise BackendUnavailableError(
                f"MILP backend {self.backend.value!r} is not installed; "
                f"{_INSTALL_HINT[self.backend]}, or use backend=Backend."
                f"{'CBC' if self.backend is Backend.HIGHS else 'HIGHS'}"
            )
        if self.time_limit_s is not None and not (
            isinstance(self.time_limit_s, (int, float)) and math.isfinite(self.time_limit_s)
            and self.time_limit_s > 0
        ):
            raise ValueError(f"time_limit_s must be a positive number or None, got {self.time_limit_s!r}")
        if not (isinstance(self.rel_gap, (int, float)) and 0 <= self.rel_gap < 1):
            raise ValueError(f"rel_gap must be in [0, 1), got {self.rel_gap!r}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")
        for name in ("count_branching", "dynamic_program"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.verbose, bool):
            raise TypeError(f"verbose must be a bool, got {self.verbose!r}")


class SolveStatus(str, enum.Enum):
    """How good the returned plan is proven to be."""

    OPTIMAL = "optimal"
    """Proven optimal within ``SolverOptions.rel_gap``."""
    FEASIBLE = "feasible"
    """Fits the budget, but the time limit stopped the search first; see ``SolveResult.gap``."""


@dataclass(frozen=True, kw_only=True)
class SolveResult:
    """A module-level SAC plan and what the memory model predicts for it."""

    status: SolveStatus
    decisions: Mapping[str, float]
    """Checkpointed module fqn -> discard ratio r in (0, 1]. r is the fraction of the module's
    ``sac_memory_bytes`` to discard; between breakpoints of its trade-off curve it stands for a
    fractional op (the planner rounds to whole ops along the greedy order)."""
    discarded_bytes: Mapping[str, int]
    """Checkpointed module fqn -> discarded bytes, ``round(r * sac_memory_bytes)``; the exact
    integers the memory model was evaluated with."""
    checkpointed: tuple[str, ...]
    """Checkpointed modules in forward pre-order."""
    predicted_peak_bytes: int
    """Peak of the memory model at these decisions, evaluated exactly in integers; <= budget."""
    no_ac_peak_bytes: int
    """Peak of the memory model with no checkpointing (same world_size)."""
    recompute_ms: float
    """Recompute time of the plan: each checkpointed module's ``recompute_fixed_ms`` plus its
    exact trade-off curve at the discarded bytes."""
    solve_time_s: float
    """Wall time of building (if not reused) and solving the MILP, and evaluating the plan."""
    gap: float | None
    """Relative optimality gap the backend reported (0 when it proved optimality outright); None
    when it did not report one."""
    budget_bytes: int
    world_size: int
    milp_objective: float | None = None
    """The MILP's objective for the backend's plan (recompute ms on the convex envelopes of the
    curves, plus the tie-break), before the ratios are rounded to bytes, with the slack the
    backend's tolerances leave in its epigraph columns removed (``SACMilp.objective_of``);
    None without a backend solve."""
    backend: Backend = Backend.HIGHS
    """The backend the options asked for (``solved_by`` says what made this plan)."""
    solved_by: str = ""
    """What made the plan: ``"program"`` (the dynamic program of ``solver/exact/prefix_dp.py``),
    ``"highs"`` or ``"cbc"`` (the backend on the MILP), ``"min-peak plan"`` (no plan from the
    backend, see ``SACMilp``), ``"nothing to plan"`` (the budget fits the unplanned step)."""
    n_variables: int = 0
    """Size of the MILP built for this ModuleInfo (0 when nothing can be checkpointed, or when
    the program made the plan before the MILP was needed)."""
    n_constraints: int = 0
