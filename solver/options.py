"""Solver options (what the user may tune) and results (what a solve returns).

Also the one place that turns options into a PuLP backend and reads back its status and gap, so
``milp`` and ``op_milp`` solve the same way.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from solver.errors import BackendUnavailableError

if TYPE_CHECKING:  # pulp is imported where a model is solved
    import pulp

__all__ = ["Backend", "SolverOptions", "SolveStatus", "SolveResult", "backend_available", "default_backend"]

logger = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    """MILP backend. HiGHS (highspy, a core dependency) is the default; the module-level MILP
    calls it directly (``solver/milp/linear_model.py``), the op-level one through PuLP. CBC (through PuLP,
    the binary PuLP bundles) stays selectable and is the fallback where highspy cannot load."""

    CBC = "cbc"
    HIGHS = "highs"


def _cbc_path() -> str | None:
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


def _highs_load_error() -> str | None:
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
        return _cbc_path() is not None
    return _highs_load_error() is None


def default_backend() -> Backend:
    """HiGHS; CBC (with a logged reason) where highspy cannot load."""
    why = _highs_load_error()
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
    """Relative optimality gap at which the backend may stop; 0 asks for exact optimality.

    1e-4 by default: plans are proven optimal, not approximately so. The symmetric choices among
    identical blocks that made closing the gap expensive are broken by the solver (see
    ``solver.symmetry``) and searched by count (``count_branching``); graphs without repeated
    blocks are proven by the program (``dynamic_program``). Measured on a 2-core CPU: the traced
    Llama-3-70B graph proves each of 20 sweep budgets in <= 0.49 s, 1000-module synthetic
    decoders in 0.1-0.3 s, random 1000-module trees (no repeated blocks) in 0.5-0.65 s. At
    ``time_limit_s`` the best plan found is returned with status FEASIBLE
    (benchmarks/solver_scaling.py, benchmarks/tradeoff_sweep.py)."""
    break_symmetry: bool = True
    """Order identical candidates (repeated blocks) with constraints that keep every optimal
    value (proof in ``solver/symmetry.py``); False solves the plain MILP."""
    count_branching: bool = True
    """Branch on how many modules of each kind are checkpointed (``solver/count_branch.py``):
    the fast way to prove stacks of nearly identical blocks (Llama-3-70B: every budget in about
    a second). HiGHS only; graphs with no two modules of a kind are solved by HiGHS alone.
    False solves every graph with HiGHS' own branch and bound (same optimum within rel_gap,
    tests/solver/test_count_branch.py)."""
    dynamic_program: bool = True
    """Solve models whose step is a clean nest by dynamic programming (``solver/exact/prefix_dp.py``)
    before asking the backend, proven within ``rel_gap`` by its own bound: every such model of
    at most 48 candidates (on small stacks of blocks HiGHS has called plans optimal that cost
    8.8 % and 15 % more than the optimum, tests/solver/exact/test_prefix_dp.py) and bigger ones
    without repeated blocks (random 1,000-module trees in 0.5-0.65 s, where HiGHS takes
    2.7-4.9 s). Stacks of blocks beyond 48 candidates go to count branching first and to the
    program where it gives up (traced GPT-2-medium, BERT-large, Whisper, T5-large: 0.2-1.7 s
    proven, where HiGHS on the whole model ran into a 20-60 s limit); models the program cannot take,
    and those that outgrow its work cap, go to the backend. False: the backend alone."""
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
        for name in ("break_symmetry", "count_branching", "dynamic_program"):
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


# ----------------------------------------------------------------------------- backend plumbing
@dataclass(frozen=True)
class _BackendOutcome:
    has_solution: bool
    proven: bool
    """Optimal within the gap (True) or stopped early (False); meaningless without a solution."""
    infeasible: bool
    gap: float | None
    seconds: float
    stopped: bool = False
    """Stopped by a limit (time, nodes, interrupt) rather than by a verdict."""


_TIGHT_TOL = 1e-9
"""Integrality / feasibility tolerance for models whose rows must be exact to the byte."""


def _make_pulp_solver(options: SolverOptions, rel_gap: float, log_path: str | None,
                      tight: bool, start: Mapping[str, float] | None = None) -> Any:
    import pulp

    limit = options.time_limit_s
    if options.backend is Backend.CBC:
        # CBC's preprocessing and default tolerances accept x = 0.99999998, which on a row with
        # 1e8-byte coefficients is an overshoot of a few bytes (or a bogus "infeasible").
        extra = [f"integerT {_TIGHT_TOL}", f"primalT {_TIGHT_TOL}", "preprocess off"] if tight else []
        return pulp.COIN_CMD(
            path=_cbc_path(), msg=options.verbose, timeLimit=limit, gapRel=rel_gap,
            threads=options.threads, logPath=None if options.verbose else log_path, options=extra,
        )
    params = ({"mip_feasibility_tolerance": _TIGHT_TOL, "primal_feasibility_tolerance": _TIGHT_TOL}
              if tight else {})
    highs = _highs_from_start(start) if start else pulp.HiGHS
    return highs(msg=options.verbose, timeLimit=limit, gapRel=rel_gap, threads=options.threads, **params)


def _highs_from_start(start: Mapping[str, float]) -> type:
    """PuLP's HiGHS, handed a (partial) start before it runs: ``{variable name: value}``. HiGHS
    completes it (the other columns solved with these fixed) and keeps it as its first incumbent
    where it is feasible; it only prunes the search, never changes the optimum."""
    import numpy as np
    import pulp

    class _HighsFromStart(pulp.HiGHS):
        def callSolver(self, lp):
            cols = [(v.index, start[v.name]) for v in lp.variables() if v.name in start]
            if cols:
                idx, val = zip(*cols)
                lp.solverModel.setSolution(len(idx), np.array(idx, dtype=np.int32),
                                           np.array(val, dtype=np.float64))
            lp.solverModel.run()

    return _HighsFromStart


_BOUND_RE = re.compile(r"^(?:Lower|Upper) bound:\s*(\S+)", re.M)
_OBJ_RE = re.compile(r"^Objective value:\s*(\S+)", re.M)


def _cbc_gap(log_text: str) -> float | None:
    obj, bound = _OBJ_RE.search(log_text), _BOUND_RE.search(log_text)
    if obj is None:
        return None
    if bound is None:  # CBC prints a bound only when it stopped before proving optimality
        return 0.0
    o, b = float(obj.group(1)), float(bound.group(1))
    return abs(o - b) / max(abs(o), 1e-12)


def run_backend(prob: "pulp.LpProblem", options: SolverOptions, *, rel_gap: float | None = None,
                tight: bool = False, start: Mapping[str, float] | None = None) -> _BackendOutcome:
    """Solve ``prob`` with the configured backend and classify the outcome.

    ``tight``: byte-exact rows (tight tolerances, no CBC preprocessing); for small models.
    ``start``: a known plan as ``{variable name: value}`` (HiGHS only; CBC ignores it)."""
    import pulp

    if options.write_lp_path is not None:
        prob.writeLP(str(options.write_lp_path))
    gap_req = options.rel_gap if rel_gap is None else rel_gap
    if options.backend is Backend.HIGHS:
        # PuLP makes its own HiGHS instance: the first one of the process prints HiGHS' banner
        # on stdout whatever its options (the CLI's --offload --json printed invalid JSON).
        from solver.milp.linear_model import _stop_highs_threads_at_exit

        _stop_highs_threads_at_exit()
    with tempfile.TemporaryDirectory(prefix="sac_milp_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = _make_pulp_solver(options, gap_req, log_path, tight, start)
        t0 = time.perf_counter()
        prob.solve(solver)
        seconds = time.perf_counter() - t0
        log_text = Path(log_path).read_text() if os.path.exists(log_path) else ""
    sol = prob.sol_status
    has_solution = sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    infeasible = prob.status == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible
    if options.backend is Backend.HIGHS and has_solution:
        gap = float(prob.solverModel.getInfo().mip_gap)
        gap = gap if math.isfinite(gap) else None
    else:
        gap = _cbc_gap(log_text) if has_solution else None
    proven = sol == pulp.LpSolutionOptimal
    logger.debug("backend %s: status=%s sol_status=%s gap=%s in %.3fs",
                 options.backend.value, prob.status, sol, gap, seconds)
    return _BackendOutcome(has_solution, proven, infeasible and not has_solution, gap, seconds)


def options_until(options: SolverOptions, deadline: float | None) -> SolverOptions:
    """``options`` with the time limit left until ``deadline`` (perf_counter; None: unchanged)."""
    if deadline is None:
        return options
    return replace(options, time_limit_s=max(0.05, deadline - time.perf_counter()))
