"""A MILP held as arrays, solved by HiGHS directly (highspy) or by CBC through PuLP.

``SacModel`` (``solver/milp/model.py``) writes its model once into a ``LinearModel`` (columns
with bounds, integrality and names; rows as sparse index / value lists). Each solve then only
changes a row bound or the objective:

* HiGHS (default): the arrays are handed to ``highspy`` in one ``passModel`` call (a CSR matrix),
  no per-variable Python objects and no model file. A fresh ``Highs`` instance per solve, so a
  solve never depends on what was solved before (same input, same plan).
* CBC (fallback where highspy cannot load, or asked for): the PuLP problem is built from the
  arrays and solved through ``solver.milp.backend.run_pulp``.

Why not PuLP for HiGHS too: PuLP rebuilds the HiGHS model variable by variable and row by row
in Python on every solve, which on big graphs costs as much as the solve.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from solver.milp.backend import BackendOutcome, new_highs, options_until, run_pulp
from solver.options import Backend, SolverOptions

__all__ = ["LinearModel", "LE", "GE", "EQ", "LpSolution", "CROSS_CHECK_COLS"]

logger = logging.getLogger(__name__)

LE, GE, EQ = -1, 1, 0
"""Row senses (PuLP's numbering, so the PuLP path needs no table)."""

_INF = math.inf
_INT_TOL = 1e-8
"""Integrality a plan must meet (``mip_feasibility_tolerance`` of the tight solve; HiGHS'
default is 1e-6, see ``LinearModel._solve_highs``); tighter, HiGHS fails with solve errors on
some graphs."""
_DEFAULT_TOL = 1e-6
_REFEREE_TOL = 1e-7
"""The referee's last try where every 1e-8 solve ended in HiGHS' "Solve error" (no verdict): a
model 10x looser than 1e-8 that still holds a module's discarded share to 1e-7 of itself, so its
plans meet 1e-8 where 1e-6's slack would decide the optimum (see ``LinearModel._solve_highs``)."""
CROSS_CHECK_COLS = 600
"""Models up to this many columns (about 200 checkpointable modules) are solved at both
tolerances (see ``LinearModel._solve_highs``); the second solve costs about what the first did,
so bigger models keep one."""
_ROW_TOL = 1e-9
"""Row violation ``exact_enough`` allows by default (count branching's integral LPs)."""


def _slack(value: float) -> float:
    """Objective values this close are the same value: two proofs of one optimum differ by the
    rows' 1e-8 tolerance at work."""
    return 1e-7 * max(1.0, abs(value))


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@dataclass(frozen=True)
class LpSolution:
    outcome: BackendOutcome
    values: np.ndarray | None
    """Column values (None without a solution)."""
    objective: float | None


class LinearModel:
    """Columns and rows of a MILP, minimised; built once, re-solved with new bounds / costs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.col_names: list[str] = []
        self.col_lower: list[float] = []
        self.col_upper: list[float] = []
        self.col_integer: list[bool] = []
        self.row_names: list[str] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_index: list[list[int]] = []
        self.row_value: list[list[float]] = []
        self.cost = np.zeros(0)
        self._lp: Any = None
        self._pulp: Any = None
        self._csr: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._relax: list[Any] | None = None
        """[HiGHS instance, the HighsLp it was given, row lower, row upper, cost] as last pushed."""

    # ------------------------------------------------------------------ building
    def add_var(self, name: str, low: float | None, up: float | None = None,
                integer: bool = False) -> int:
        self.col_names.append(name)
        self.col_lower.append(-_INF if low is None else float(low))
        self.col_upper.append(_INF if up is None else float(up))
        self.col_integer.append(integer)
        self._lp = self._pulp = None
        return len(self.col_names) - 1

    def add_row(self, terms: Sequence[tuple[int, float]], sense: int, rhs: float, name: str) -> int:
        merged: dict[int, float] = {}
        for j, v in terms:
            merged[j] = merged.get(j, 0.0) + float(v)
        self.row_index.append(list(merged))
        self.row_value.append(list(merged.values()))
        self.row_names.append(name)
        self.row_lower.append(rhs if sense in (GE, EQ) else -_INF)
        self.row_upper.append(rhs if sense in (LE, EQ) else _INF)
        self._lp = self._pulp = self._csr = None
        return len(self.row_names) - 1

    def set_row_upper(self, row: int, up: float) -> None:
        self.row_upper[row] = up
        if self._lp is not None:  # highspy hands out copies: assign the whole array
            self._lp.row_upper_ = np.array(self.row_upper)
        self._pulp = None

    def set_row_bounds(self, row: int, low: float, up: float) -> None:
        self.row_lower[row], self.row_upper[row] = float(low), float(up)
        if self._lp is not None:
            self._lp.row_lower_ = np.array(self.row_lower)
            self._lp.row_upper_ = np.array(self.row_upper)
        self._pulp = None

    def set_cost(self, cost: Sequence[tuple[int, float]]) -> None:
        c = np.zeros(len(self.col_names))
        for j, v in cost:
            c[j] += v
        self.cost = c
        if self._lp is not None:
            self._lp.col_cost_ = c
        self._pulp = None

    @property
    def n_cols(self) -> int:
        return len(self.col_names)

    @property
    def n_rows(self) -> int:
        return len(self.row_names)

    def _matrix(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows as CSR ``(start, index, value)``: handed to HiGHS and used to check plans."""
        if self._csr is None:
            start = np.concatenate([[0], np.cumsum([len(ix) for ix in self.row_index])]).astype(np.int64)
            index = np.array([j for ix in self.row_index for j in ix], dtype=np.int64)
            value = np.array([v for vs in self.row_value for v in vs], dtype=np.float64)
            self._csr = (start, index, value)
        return self._csr

    # ------------------------------------------------------------------ HiGHS
    def highs_lp(self) -> Any:
        import highspy

        if self._lp is None:
            lp = highspy.HighsLp()
            lp.num_col_, lp.num_row_ = self.n_cols, self.n_rows
            lp.col_cost_ = self.cost if len(self.cost) == self.n_cols else np.zeros(self.n_cols)
            lp.col_lower_ = np.array(self.col_lower)
            lp.col_upper_ = np.array(self.col_upper)
            lp.row_lower_ = np.array(self.row_lower)
            lp.row_upper_ = np.array(self.row_upper)
            lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
            lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = self.n_cols, self.n_rows
            start, index, value = self._matrix()
            lp.a_matrix_.start_ = start.astype(np.int32)
            lp.a_matrix_.index_ = index.astype(np.int32)
            lp.a_matrix_.value_ = value
            lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                               for i in self.col_integer]
            lp.col_names_ = list(self.col_names)
            lp.row_names_ = list(self.row_names)
            self._lp = lp
        return self._lp

    def _solve_highs(self, options: SolverOptions, rel_gap: float, feasible: bool = False) -> LpSolution:
        """Solve at ``_INT_TOL``; check the answer with a solve at HiGHS' own tolerance (1e-6)
        where the model is small or the first solve found no plan, and with a third solve where
        the two contradict each other.

        Why: HiGHS 1.16 answers some small models wrongly at either tolerance, each time right
        at the other: "infeasible" beside a plan, or "optimal" above the optimum
        (tests/solver/milp/test_linear_model.py pins such stacks). 1e-6 alone is too loose
        (its slack, y = 1e-6 discarding 1e-6 of a module at 1e-6 of its cost, decides optima at
        the smallest reachable peak), and no single setting answers all.

        HiGHS holds a MIP's rows and integrality to ``mip_feasibility_tolerance``, so the 1e-6
        model contains the 1e-8 one: a 1e-6 plan that meets 1e-8 in its integer columns and
        rows is a plan of the 1e-8 model, and if it beats the 1e-8 solve's lower bound, that
        "optimal" was wrong. A contradiction (that, a 1e-8 "infeasible" beside any 1e-6 plan,
        or a 1e-8 solve that neither proves nor refutes) gets a third solve at 1e-8 with the
        light presolve (without presolve, then at ``_REFEREE_TOL`` if neither gives a verdict:
        HiGHS ends some 1e-8 solves in "Solve error" whatever the presolve). The lowest plan of the
        1e-8 model found wins; it counts as proven if it is, or if it equals the third
        solve's proven value. A contradiction the third solve cannot decide (out of time, no
        plan) leaves the 1e-8 answer as it was. Models over ``CROSS_CHECK_COLS`` columns keep
        one solve unless it finds no plan; a solve the time limit stopped is returned as it is.

        ``feasible`` (a model known to have a plan, such as the min-peak model): "infeasible"
        is no verdict, even from the full and the light presolve at 1e-8; the referee then goes
        on to the solve without presolve, and where no 1e-8 plan is found the 1e-6 plan is
        returned for the caller to evaluate exactly."""
        limit = options.time_limit_s
        deadline = None if limit is None else time.perf_counter() + limit
        tight = self._run_highs(options, rel_gap, _INT_TOL)
        t_out = tight.outcome
        small = self.n_cols <= CROSS_CHECK_COLS
        if (t_out.has_solution and not small) or t_out.stopped:
            return tight  # big and solved; or out of time, with no time left to check it
        found = [tight] if t_out.has_solution else []
        # The 1e-8 solve's lower bound: a 1e-6 plan above it (within rel_gap) is no contradiction.
        bound = (tight.objective - max(t_out.gap or 0.0, 0.0) * abs(tight.objective)
                 - _slack(tight.objective)) if t_out.proven else None
        seconds = t_out.seconds
        loose = self._run_highs(options_until(options, deadline), rel_gap, _DEFAULT_TOL,
                                cutoff=bound, write=False)
        l_out = loose.outcome
        seconds += l_out.seconds
        as_tight = self._as_tight_plan(loose, options_until(options, deadline), rel_gap)
        seconds += as_tight.outcome.seconds if as_tight is not loose else 0.0
        if as_tight.outcome.has_solution:
            found.append(as_tight)
        if t_out.proven:  # any 1e-6 plan under the bound is a contradiction (its slack or not)
            settled = not l_out.has_solution or loose.objective >= bound
        else:  # "infeasible" stands where the 1e-6 solve, with its slack, finds no plan either
            # (unless the model is known to have one)
            settled = t_out.infeasible and not l_out.has_solution and not feasible
        referee = None
        if not settled and (small or feasible):
            for presolve, tol in (("light", _INT_TOL), ("off", _INT_TOL), ("full", _REFEREE_TOL)):
                referee = self._run_highs(options_until(options, deadline), rel_gap, tol,
                                          presolve=presolve, write=False)
                seconds += referee.outcome.seconds
                if tol != _INT_TOL:  # a looser model: its plan counts where it is one at 1e-8
                    plan = self._as_tight_plan(referee, options_until(options, deadline), rel_gap)
                    seconds += plan.outcome.seconds if plan is not referee else 0.0
                    referee = plan
                r_out = referee.outcome
                if r_out.has_solution or (r_out.infeasible and not feasible) or r_out.stopped:
                    break
            logger.debug("HiGHS: %s at %g, %s at %g; %s presolve at %g: %s", tight.objective,
                         _INT_TOL, loose.objective, _DEFAULT_TOL, presolve, tol, referee.objective)
            if referee.outcome.has_solution:
                found.append(referee)
        if found:
            # Equal values: the proven plan (a 1e-6 proof covers the 1e-8 model, see above).
            best = min(found, key=lambda sol: (sol.objective, not sol.outcome.proven))
            if (not best.outcome.proven and referee is not None and referee.outcome.proven
                    and abs(best.objective - referee.objective) <= _slack(referee.objective)):
                best = referee  # the same value, proven
        elif feasible and any(sol is not None and sol.outcome.stopped for sol in (loose, referee)):
            best = loose if l_out.stopped else referee  # out of time, not "infeasible"
        elif (t_out.infeasible or l_out.infeasible) and not (feasible and l_out.has_solution):
            # No plan of the 1e-8 model: "infeasible" holds for it (a plan only the 1e-6 slack
            # allows is no plan).
            best = tight if t_out.infeasible else loose
        elif l_out.has_solution:
            # No verdict at 1e-8 (numerical trouble): the 1e-6 plan,
            # which the caller evaluates exactly and repairs, rather than a timeout that did not
            # happen.
            best = loose
        else:
            best = tight
        return dataclasses.replace(best, outcome=dataclasses.replace(best.outcome, seconds=seconds))

    def _as_tight_plan(self, sol: LpSolution, options: SolverOptions, rel_gap: float) -> LpSolution:
        """``sol`` (a solve of a looser model) as a plan of the 1e-8 model: itself where its
        integers and rows meet 1e-8, else the best plan with its integer columns, else no plan
        with ``sol``'s verdict ("infeasible", out of time) kept."""
        if not sol.outcome.has_solution or self.exact_enough(sol.values, _INT_TOL, _INT_TOL):
            return sol
        fixed = self._with_integers_of(sol, options, rel_gap)
        if fixed.outcome.has_solution:
            return fixed
        return dataclasses.replace(fixed, outcome=dataclasses.replace(
            fixed.outcome, infeasible=sol.outcome.infeasible, stopped=sol.outcome.stopped))

    def _with_integers_of(self, loose: LpSolution, options: SolverOptions, rel_gap: float) -> LpSolution:
        """The best plan of the 1e-8 model with ``loose``'s integer columns (a 1e-6 plan that
        passes a row by more than 1e-8): the LP over the rest, solved at 1e-8. Proven where
        ``loose`` was proven and this is within ``rel_gap`` of its bound (the 1e-6 model
        contains the 1e-8 one, so its bound holds for both).

        Why: where HiGHS at 1e-8 calls a model "infeasible" (light presolve too) and the 1e-6
        solve proves a plan whose rows are off by float64's rounding of big terms, those
        integers at 1e-8 are a plan, and the optimum would be lost without it
        (tests/solver/data/highs_above_the_optimum_stack.json)."""
        import highspy

        ints = np.flatnonzero(np.asarray(self.col_integer, dtype=bool))
        lower, upper = np.array(self.col_lower), np.array(self.col_upper)
        lower[ints] = upper[ints] = np.round(loose.values[ints])
        h = self._relaxed_highs(options)
        h.changeColsBounds(len(ints), ints.astype(np.int32), lower[ints], upper[ints])
        h.setOptionValue("primal_feasibility_tolerance", _INT_TOL)
        if options.time_limit_s is not None:
            h.setOptionValue("time_limit", float(options.time_limit_s))
        t0 = time.perf_counter()
        h.run()
        seconds = time.perf_counter() - t0
        none = LpSolution(BackendOutcome(False, False, False, None, seconds), None, None)
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return none
        values = np.array(h.getSolution().col_value)
        if not self.exact_enough(values, _INT_TOL, _INT_TOL, relative=True):
            return none
        obj = float(h.getInfo().objective_function_value)
        bound = loose.objective - max(loose.outcome.gap or 0.0, 0.0) * abs(loose.objective)
        gap = max(0.0, (obj - bound) / max(abs(obj), 1e-12))
        proven = loose.outcome.proven and gap <= rel_gap + _slack(obj) / max(abs(obj), 1e-12)
        logger.debug("HiGHS: the 1e-6 plan's integers at 1e-8: %s (1e-6: %s)", obj, loose.objective)
        return LpSolution(BackendOutcome(True, proven, False, gap, seconds), values, obj)

    def _relaxed_highs(self, options: SolverOptions) -> Any:
        """A HiGHS instance holding the model without its integrality (the cached ``HighsLp``
        keeps its integers whatever happens)."""
        lp = self.highs_lp()
        h = new_highs(options)
        integrality, lp.integrality_ = lp.integrality_, []
        try:
            h.passModel(lp)
        finally:
            lp.integrality_ = integrality
        return h

    def _run_highs(self, options: SolverOptions, rel_gap: float, tol: float,
                   presolve: str = "full", cutoff: float | None = None, write: bool = True) -> LpSolution:
        import highspy

        h = new_highs(options)
        if cutoff is not None:  # only plans below it are of interest
            h.setOptionValue("objective_bound", float(cutoff))
        if presolve == "light":
            h.setOptionValue("presolve_mode", 2)
        elif presolve == "off":
            h.setOptionValue("presolve", "off")
        h.setOptionValue("mip_rel_gap", float(rel_gap))
        # RINS / RENS sub-MIPs: on stacks of blocks they take over half the solve, where the
        # best plan is found at the root; off, the same nodes in about half the time.
        h.setOptionValue("mip_heuristic_run_rins", False)
        h.setOptionValue("mip_heuristic_run_rens", False)
        # Restarts after root reduced-cost fixing: on trees of distinct modules HiGHS restarts
        # the root many times, re-solving each smaller model's LP and cuts, and then proves at
        # node 1 all the same; off, such trees solve markedly faster, stacks alike.
        if h.setOptionValue("mip_allow_restart", False) != highspy.HighsStatus.kOk:
            _warn_once("this highspy has no mip_allow_restart option: trees of distinct modules "
                       "solve slower with it (upgrade highspy)")
        if rel_gap == 0:  # HiGHS stops 1e-6 short by default: tie-break-sized optima differ
            h.setOptionValue("mip_abs_gap", 0.0)
        # HiGHS' MIP solver holds rows to this tolerance too (its LPs take it as their primal
        # feasibility tolerance, and solutions are checked against it).
        h.setOptionValue("mip_feasibility_tolerance", tol)
        if options.time_limit_s is not None:
            h.setOptionValue("time_limit", float(options.time_limit_s))
        h.passModel(self.highs_lp())
        if write and options.write_lp_path is not None:
            self.write(options, h)
        t0 = time.perf_counter()
        h.run()
        seconds = time.perf_counter() - t0
        status = h.getModelStatus()
        info = h.getInfo()
        ms = highspy.HighsModelStatus
        has = info.primal_solution_status == 2  # kSolutionStatusFeasible
        # Both objectives (recompute ms, peak) are bounded below, so "unbounded or
        # infeasible" from presolve means infeasible.
        infeasible = status in (ms.kInfeasible, ms.kUnboundedOrInfeasible)
        proven = status == ms.kOptimal and has
        gap = float(info.mip_gap) if has else None
        gap = gap if gap is None or math.isfinite(gap) else None
        if proven and gap is not None and gap < 0:
            gap = 0.0
        logger.debug("backend highs (tolerance %g): status=%s gap=%s nodes=%d lp_iterations=%d "
                     "in %.3fs", tol, h.modelStatusToString(status), gap, int(info.mip_node_count),
                     int(info.simplex_iteration_count), seconds)
        stopped = status in (ms.kTimeLimit, ms.kInterrupt, ms.kSolutionLimit, ms.kIterationLimit)
        values = np.array(h.getSolution().col_value) if has else None
        obj = float(info.objective_function_value) if has else None
        return LpSolution(BackendOutcome(has, proven, infeasible and not has, gap, seconds,
                                          stopped=stopped), values, obj)

    def write(self, options: SolverOptions, h: Any = None) -> None:
        """The model in LP format at ``options.write_lp_path`` (through HiGHS)."""
        if h is None:
            h = new_highs(options)
            h.passModel(self.highs_lp())
        h.writeModel(str(options.write_lp_path))

    def integral(self, values: np.ndarray, tol: float) -> bool:
        """Every integer column within ``tol`` of an integer."""
        ints = np.flatnonzero(np.asarray(self.col_integer, dtype=bool))
        return not np.any(np.abs(values[ints] - np.round(values[ints])) > tol)

    def exact_enough(self, values: np.ndarray, tol: float, row_tol: float = _ROW_TOL,
                     relative: bool = False) -> bool:
        """Integer columns integral within ``tol`` and every row within ``row_tol`` (times the
        row's largest term, where ``relative``: a row summing terms of 1e8 is only computed to
        about 3e-8, float64's own rounding)."""
        if not self.integral(values, tol):
            return False
        start, index, value = self._matrix()
        rows = np.repeat(np.arange(self.n_rows), np.diff(start))
        terms = values[index] * value
        act = np.bincount(rows, weights=terms, minlength=self.n_rows)
        if relative:
            big = np.zeros(self.n_rows)
            np.maximum.at(big, rows, np.abs(terms))
            row_tol = row_tol * np.maximum(1.0, big)
        return not np.any((act < np.asarray(self.row_lower) - row_tol)
                          | (act > np.asarray(self.row_upper) + row_tol))

    # ------------------------------------------------------------------ CBC via PuLP
    def _pulp_problem(self) -> tuple[Any, list[Any]]:
        import pulp

        if self._pulp is None:
            prob = pulp.LpProblem(self.name, pulp.LpMinimize)
            cols = []
            for name, lo, up, integer in zip(self.col_names, self.col_lower, self.col_upper,
                                             self.col_integer):
                lo_, up_ = (None if lo == -_INF else lo), (None if up == _INF else up)
                cat = "Integer" if integer else "Continuous"
                if hasattr(prob, "add_variable"):
                    cols.append(prob.add_variable(name, lo_, up_, cat=cat))
                else:
                    cols.append(pulp.LpVariable(name, lo_, up_, cat))
            for name, lo, up, ix, vs in zip(self.row_names, self.row_lower, self.row_upper,
                                            self.row_index, self.row_value):
                expr = pulp.LpAffineExpression([(cols[j], v) for j, v in zip(ix, vs)])
                if lo == up:
                    prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintEQ, name, lo))
                    continue
                if lo != -_INF:
                    prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE,
                                                         name if up == _INF else name + "_lo", lo))
                if up != _INF:
                    prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintLE, name, up))
            prob.setObjective(pulp.LpAffineExpression(
                [(cols[j], float(v)) for j, v in enumerate(self.cost) if v]))
            self._pulp = (prob, cols)
        return self._pulp

    def _solve_pulp(self, options: SolverOptions, rel_gap: float) -> LpSolution:
        prob, cols = self._pulp_problem()
        out = run_pulp(prob, options, rel_gap=rel_gap)
        if not out.has_solution:
            return LpSolution(out, None, None)
        values = np.array([c.varValue or 0.0 for c in cols])
        return LpSolution(out, values, float(self.cost @ values))

    # ------------------------------------------------------------------ solve
    def solve(self, options: SolverOptions, *, rel_gap: float | None = None,
              feasible: bool = False) -> LpSolution:
        """``feasible``: the caller knows the model has a plan (the min-peak model: checkpointing
        nothing is one), so an "infeasible" verdict is the backend's error (see _solve_highs)."""
        gap = options.rel_gap if rel_gap is None else rel_gap
        if options.backend is Backend.HIGHS:
            return self._solve_highs(options, gap, feasible=feasible)
        return self._solve_pulp(options, gap)

    def reset_relaxation(self) -> None:
        """Forget the warm relaxation's basis: the next ``solve_relaxation`` starts cold, so a
        search that starts with this call takes the same path every time (determinism)."""
        self._relax = None

    def solve_relaxation(self, options: SolverOptions) -> LpSolution:
        """The LP relaxation (HiGHS): integrality dropped, everything else as in ``solve``.

        One HiGHS instance serves the relaxations since the last ``reset_relaxation``: the row
        bounds and costs that changed since the last call are pushed and the dual simplex starts
        from the last basis (among tied optima the basis picks one, hence the reset).
        From scratch each box's LP takes a thousand-odd simplex iterations on a big stack;
        warm, a few dozen."""
        import highspy

        lp = self.highs_lp()
        lower, upper = np.array(self.row_lower), np.array(self.row_upper)
        if self._relax is None or self._relax[1] is not lp:
            h = self._relaxed_highs(options)
            self._relax = [h, lp, lower, upper, self.cost.copy()]
        else:
            h, _, old_lower, old_upper, old_cost = self._relax
            rows = np.flatnonzero((lower != old_lower) | (upper != old_upper)).astype(np.int32)
            if len(rows):
                h.changeRowsBounds(len(rows), rows, lower[rows], upper[rows])
            cols = np.flatnonzero(self.cost != old_cost).astype(np.int32)
            if len(cols):
                h.changeColsCost(len(cols), cols, self.cost[cols])
            self._relax[2:] = [lower, upper, self.cost.copy()]
        # HiGHS' run clock may accumulate over runs of one instance: the limit is set past it.
        h.setOptionValue("time_limit", h.getRunTime() + float(options.time_limit_s)
                         if options.time_limit_s is not None else math.inf)
        t0 = time.perf_counter()
        h.run()
        seconds = time.perf_counter() - t0
        status = h.getModelStatus()
        ms = highspy.HighsModelStatus
        logger.debug("backend highs (warm LP): status=%s lp_iterations=%d in %.3fs",
                     h.modelStatusToString(status), int(h.getInfo().simplex_iteration_count), seconds)
        if status != ms.kOptimal:  # only an optimal LP value is a bound
            infeasible = status in (ms.kInfeasible, ms.kUnboundedOrInfeasible)
            return LpSolution(BackendOutcome(False, False, infeasible, None, seconds), None, None)
        values = np.array(h.getSolution().col_value)
        obj = float(h.getInfo().objective_function_value)
        return LpSolution(BackendOutcome(True, True, False, 0.0, seconds), values, obj)
