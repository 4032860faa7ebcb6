"""The one place options become a backend run: PuLP models (CBC, or HiGHS through PuLP) solved and
their outcome classified, and the HiGHS process setup every HiGHS instance shares.

    outcome = run_pulp(prob, options)              # prob: a pulp.LpProblem
    outcome.has_solution, outcome.proven, outcome.gap

``op_milp``, ``offload.milp`` and the CBC path of ``milp.linear_model`` solve through
``run_pulp``; ``milp.linear_model`` hands its arrays to HiGHS directly (``new_highs``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from solver.options import Backend, SolverOptions, cbc_path

if TYPE_CHECKING:  # pulp is imported where a model is solved
    import pulp

__all__ = ["BackendOutcome", "run_pulp", "make_pulp_solver", "options_until", "new_highs",
           "prepare_highs"]

logger = logging.getLogger(__name__)

_TIGHT_TOL = 1e-9
"""Integrality / feasibility tolerance for models whose rows must be exact to the byte."""


@dataclass(frozen=True)
class BackendOutcome:
    """How a backend run ended."""

    has_solution: bool
    proven: bool
    """Optimal within the gap (True) or stopped early (False); meaningless without a solution."""
    infeasible: bool
    gap: float | None
    seconds: float
    stopped: bool = False
    """Stopped by a limit (time, nodes, interrupt) rather than by a verdict."""


def options_until(options: SolverOptions, deadline: float | None) -> SolverOptions:
    """``options`` with the time limit left until ``deadline`` (perf_counter; None: unchanged)."""
    if deadline is None:
        return options
    return dataclasses.replace(options, time_limit_s=max(0.05, deadline - time.perf_counter()))


# ----------------------------------------------------------------------------- HiGHS setup
@functools.cache
def prepare_highs() -> None:
    """Once per process, before the first HiGHS instance: join HiGHS' global worker threads when
    the interpreter exits (left running, their destructors call std::terminate: SIGABRT in a
    spawned planning rank), and make the first instance with stdout sent to /dev/null, since
    HiGHS prints its copyright banner there whatever its output_flag (it would land in the
    user's own output, and break ``--json``)."""
    import highspy

    atexit.register(highspy.Highs.resetGlobalScheduler, True)
    try:
        if sys.stdout is not None:  # None under pythonw and some services
            sys.stdout.flush()
        saved = os.dup(1)
    except Exception:  # noqa: BLE001 - no usable file descriptor 1: the banner is harmless
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    except Exception:  # noqa: BLE001 - no /dev/null (a sandbox): the banner is harmless
        pass
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def new_highs(options: SolverOptions) -> Any:
    """A HiGHS instance with the options every solve shares (log output, threads)."""
    import highspy

    prepare_highs()
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("threads", int(options.threads))
    return h


# ----------------------------------------------------------------------------- PuLP
def make_pulp_solver(options: SolverOptions, rel_gap: float, log_path: str | None,
                     tight: bool, start: Mapping[str, float] | None = None) -> Any:
    """The PuLP solver object ``run_pulp`` hands the problem to."""
    import pulp

    limit = options.time_limit_s
    if options.backend is Backend.CBC:
        # CBC's preprocessing and default tolerances accept x = 0.99999998, which on a row with
        # 1e8-byte coefficients is an overshoot of a few bytes (or a bogus "infeasible").
        extra = [f"integerT {_TIGHT_TOL}", f"primalT {_TIGHT_TOL}", "preprocess off"] if tight else []
        return pulp.COIN_CMD(
            path=cbc_path(), msg=options.verbose, timeLimit=limit, gapRel=rel_gap,
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


def run_pulp(prob: "pulp.LpProblem", options: SolverOptions, *, rel_gap: float | None = None,
             tight: bool = False, start: Mapping[str, float] | None = None) -> BackendOutcome:
    """Solve ``prob`` with the configured backend and classify the outcome.

    ``tight``: byte-exact rows (tight tolerances, no CBC preprocessing); for small models.
    ``start``: a known plan as ``{variable name: value}`` (HiGHS only; CBC ignores it)."""
    import pulp

    if options.write_lp_path is not None:
        prob.writeLP(str(options.write_lp_path))
    gap_req = options.rel_gap if rel_gap is None else rel_gap
    if options.backend is Backend.HIGHS:
        prepare_highs()  # PuLP makes its own HiGHS instance
    with tempfile.TemporaryDirectory(prefix="sac_milp_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = make_pulp_solver(options, gap_req, log_path, tight, start)
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
    return BackendOutcome(has_solution, proven, infeasible and not has_solution, gap, seconds)
