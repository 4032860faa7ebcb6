"""Module-level SAC: per-module discard ratios that fit a memory budget at the least recompute
time.

    from solver import solve_milp
    res = solve_milp(info, budget_bytes=40 * 2**30)
    res.decisions          # {"GPT.blocks.3": 0.62, ...}  fqn -> discard ratio
    res.predicted_peak_bytes, res.recompute_ms

The problem is one MILP (written out in ``solver/milp/model.py``). ``SACMilp.solve`` decides it
by the first of these strategies that gives a plan:

1. The budget fits the unplanned step: nothing to plan.
2. Count branching (``solver/milp/count_branch.py``), on a big stack of numbered blocks: HiGHS
   with the number of checkpointed modules of each kind fixed box by box, the fast proof where
   blocks are nearly identical. It hands the budget on where its search grows too wide.
3. The exact program (``solver/exact/``), where the step is a clean nest (every stack of blocks
   and tree the benchmarks draw, most traces): dynamic programming over the MILP's own
   candidates, costs and rows, proven within ``rel_gap`` by its own bound. It shares no code
   with the backend, so the two check each other in the tests. It hands the budget on where
   its work passes a cap, or its plan is not proven or does not settle in bytes.
4. The backend (HiGHS by default) on the whole MILP.

Every plan is re-evaluated in exact integers (``solver.plan_cost``): ``predicted_peak_bytes``
never comes from an LP variable. A backend plan that its rounding left over the budget is
repaired, and bytes the exact peak does not need are given back (``solver/rounding.py``); where
the repair cannot fit it, the backend solves again for a tighter target. Where HiGHS finds no
plan at a budget the least-peak plan meets (a sliver its tolerances decide), CBC's plan (small
models) or that least-peak plan is returned, the cheaper; below it, ``InfeasibleBudgetError``
names the smallest budget.

Tie-break: among plans of equal recompute time prefer fewer checkpointed modules, then modules
earlier in forward pre-order, then discarding less (``solver.candidates.tie_break_ms``). It is a
perturbation of the objective, so plans that differ by less than the gap tolerance may still
resolve by the search order; the backend runs single-threaded by default so the same input
gives the same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Iterable, Mapping

from solver.candidates import (
    Candidate,
    check_budget,
    check_units,
    find_candidates,
    nesting,
    tie_break_ms,
)
from solver.errors import InfeasibleBudgetError, SolverError, SolverTimeoutError
from solver.exact.prefix_dp import PrefixDP, ProgramTooLarge
from solver.graph import Graph
from solver.milp.backend import options_until
from solver.milp.count_branch import CountBrancher, kind_groups
from solver.milp.linear_model import CROSS_CHECK_COLS
from solver.milp.model import SacModel
from solver.options import Backend, SolveResult, SolverOptions, SolveStatus
from solver.plan_cost import (
    MemoryModel,
    check_world_size,
    fixed_discard_bytes,
    module_recompute_ms,
    predict_peak_bytes,
)
from solver.rounding import ExactPlans

if TYPE_CHECKING:
    from estimators.contract.module_info import ModuleInfo
    from solver.milp.linear_model import LpSolution

__all__ = [
    "SACMilp",
    "solve_milp",
    "min_reachable_peak_bytes",
    "predict_peak_bytes",
    "module_recompute_ms",
    "LOUD_CANDIDATES",
    "COUNT_BRANCHING_CANDIDATES",
]

logger = logging.getLogger(__name__)

LOUD_CANDIDATES = 300
"""Models of at least this many candidates log the start and end of each solve at INFO: they
may take seconds, up to the whole time limit (the CLI shows INFO as progress)."""

COUNT_BRANCHING_CANDIDATES = 48
"""Stacks of numbered blocks with more candidates than this go to count branching first; the
program decides smaller ones exactly (where HiGHS' tolerances can decide a small stack at its
smallest reachable peak)."""

_PROGRAM_WORK_PER_CANDIDATE = 20_000
"""The program is given up past ``_PROGRAM_WORK_PER_CANDIDATE * candidates`` units of work (breakpoints of its value functions, see ``PrefixDP.solve``): a count, not a
clock, so the same input takes the same path. Then the backend solves the model, and the
program is not tried on it again."""

_PROGRAM_REL_TOLS = (1e-5, 1e-7)
"""Tolerances the program's value functions are held within (``PrefixDP.solve``'s ``rel_tol``),
tried in turn until its plan is proven within ``rel_gap``. A model of repeated blocks (equal
curves) is tried exact first: its functions' convex runs are real jumps that holding them
looser cannot merge, so the tolerance only costs time there; on trees of distinct modules
the runs are near-ties that it merges."""

_PROGRAM_ROUNDING = 1e-12
"""Relative difference of the program's bound and its plan's cost that is float rounding (the
two are summed apart): still a proof, also at rel_gap 0."""

_RESOLVES = 3
"""Backend solves per budget: the first, and tighter targets where the repair of its rounding
cannot fit the plan."""


def _repeated_blocks(cands: tuple[Candidate, ...], groups: list[list[int]]) -> bool:
    """Whether the model repeats blocks: modules of one kind by name (``groups``) or by data
    (equal curves)."""
    curves = {(c.stats.sac_memory_bytes, c.segments) for c in cands}
    return bool(groups) or len(curves) < len(cands)


class SACMilp:
    """The module-level problem of one ModuleInfo, built once and solvable for any budget.

    >>> m = SACMilp(info, world_size=1)                  # doctest: +SKIP
    >>> [m.solve(int(f * m.no_ac_peak_bytes)) for f in (0.5, 0.7)]  # doctest: +SKIP
    """

    def __init__(
        self,
        info: ModuleInfo,
        *,
        world_size: int = 1,
        ac_units: Iterable[str] | None = None,
        fsdp_units: Iterable[str] | None = None,
        options: SolverOptions | None = None,
    ) -> None:
        t0 = time.perf_counter()
        check_world_size(world_size)
        self.info = info
        self.world_size = int(world_size)
        self.options = options if options is not None else SolverOptions()
        self.graph = Graph.from_module_info(info)
        allowed = check_units(ac_units, self.graph, "ac_units")
        fsdp = check_units(fsdp_units, self.graph, "fsdp_units")
        self.memory = MemoryModel(info, self.world_size)
        """The exact memory model every plan is evaluated in."""
        self.no_ac_peak_bytes: int = self.memory.peak({})
        self.candidates: tuple[Candidate, ...] = tuple(find_candidates(self.graph, allowed, fsdp))
        """The modules a plan may checkpoint, in forward pre-order."""
        self._exact = ExactPlans(self.memory, {n.fqn: n.index for n in self.graph})
        self._program: PrefixDP | str | None = None
        self._milp: SacModel | None = None
        self._min_peak: tuple[int, dict[str, int]] | None = None
        self._groups = kind_groups([c.fqn for c in self.candidates])
        """Candidates of one kind by name (numbered blocks)."""
        self._repeated = _repeated_blocks(self.candidates, self._groups)
        """Repeated blocks: the program is tried exact first."""
        self._by_counts = (self.options.count_branching and self.options.backend is Backend.HIGHS
                           and bool(self._groups) and len(self.candidates) > COUNT_BRANCHING_CANDIDATES)
        """A big stack of numbered blocks: count branching first (``solve``)."""
        self._counter: CountBrancher | None = None
        self.build_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ the program and the MILP
    def program(self) -> PrefixDP | str:
        """The exact program of this model, or why the step is not a clean nest (a sentence;
        also where its work outgrew the cap once). Built at the first call."""
        if self._program is None:
            if not self.candidates:
                self._program = "no candidates"
            else:
                tie_y, tie_r = self.tie_break_ms()
                _, below = nesting(self.graph, self.candidates)
                self._program = PrefixDP.build([c.stats for c in self.candidates], tie_y, tie_r,
                                               below, self.memory)
            if isinstance(self._program, str):
                logger.debug("no program: %s", self._program)
        return self._program

    def milp(self) -> SacModel:
        """The MILP for the backend (candidates needed), built at the first call."""
        if self._milp is None:
            self._milp = SacModel(self.candidates, self.memory, self.graph, n_modules=len(self.graph))
            if self._by_counts:
                self._counter = CountBrancher(self._milp.lp, self._milp.y, self._groups)
        return self._milp

    @property
    def n_variables(self) -> int:
        """Columns of the MILP (built by this call if it was not yet)."""
        return self.milp().n_variables if self.candidates else 0

    @property
    def n_constraints(self) -> int:
        """Rows of the MILP (built by this call if it was not yet)."""
        return self.milp().n_constraints if self.candidates else 0

    def tie_break_ms(self) -> tuple[list[float], list[float]]:
        """Per candidate, the objective's tie-break cost of checkpointing it and of discarding
        all it can (``solver.candidates.tie_break_ms``)."""
        return tie_break_ms(self.candidates, len(self.graph))

    # ------------------------------------------------------------------ solve
    def solve(self, budget_bytes: int) -> SolveResult:
        """Least-recompute plan whose exact predicted peak is <= ``budget_bytes`` (per rank)."""
        t0 = time.perf_counter()
        budget = check_budget(budget_bytes)
        if budget >= self.no_ac_peak_bytes:
            return self._result({}, budget, SolveStatus.OPTIMAL, 0.0, t0, "nothing to plan")
        if not self.candidates:
            raise InfeasibleBudgetError(budget, self.no_ac_peak_bytes, self.world_size)
        loud = len(self.candidates) >= LOUD_CANDIDATES
        if loud:  # big graphs can take the whole time limit: say so before, and how it ended
            logger.info("planning %d candidate modules for a %.2f GiB budget (%s, gap %g, time "
                        "limit %s s)", len(self.candidates), budget / 2**30,
                        self.options.backend.value, self.options.rel_gap, self.options.time_limit_s)
        res = self._solve_by_backend(budget, t0, by_counts=True) if self._by_counts else None
        if res is None and self.options.dynamic_program:
            res = self._solve_by_program(budget, t0)
        if res is None:
            res = self._solve_by_backend(budget, t0)
        if loud:
            unproven = res.status is not SolveStatus.OPTIMAL and res.gap is not None
            logger.info("SAC MILP: %s in %.2f s (%s), recompute %.3f ms%s", res.status.value,
                        res.solve_time_s, res.solved_by, res.recompute_ms,
                        f" (within {100 * res.gap:.2f} % of optimal: raise "
                        "SolverOptions.time_limit_s to prove it)" if unproven else "")
        return res

    def _solve_by_program(self, budget: int, t0: float) -> SolveResult | None:
        """The program's plan, proven within ``rel_gap`` and settled in bytes; None where the
        backend decides (no program, too much work, not proven, no plan, does not settle)."""
        if self.options.write_lp_path is not None:  # the model the program solves, as documented
            self.milp().write(budget, self.options)
        program = self.program()
        if not isinstance(program, PrefixDP):
            return None
        max_work = _PROGRAM_WORK_PER_CANDIDATE * len(self.candidates)
        for rel_tol in ((0.0,) if self._repeated else ()) + _PROGRAM_REL_TOLS:
            try:
                out = program.solve(budget, max_work=max_work, rel_tol=rel_tol)
            except ProgramTooLarge as e:
                logger.debug("program at rel_tol %g given up: %s", rel_tol, e)
                if rel_tol == 0.0:  # the exact functions outgrew the cap: hold them looser
                    continue
                if rel_tol == _PROGRAM_REL_TOLS[0]:  # too big held loosely: not tried again
                    self._program = str(e)
                return None
            if out is None:  # no plan fits: the backend path says so with the smallest budget
                return None
            gap = (out.objective - out.lower_bound) / max(abs(out.objective), 1e-12)
            if gap <= self.options.rel_gap + _PROGRAM_ROUNDING:
                break
            logger.debug("program at rel_tol %g: gap %g", rel_tol, gap)
        else:  # not proven (a varying recompute growth, or functions held too loosely)
            return None
        plan, short = self._exact.settle(self._plan_of(out.discarded), budget, budget)
        if short:
            return None
        res = self._result(plan, budget, SolveStatus.OPTIMAL, max(0.0, gap), t0, "program")
        return dataclasses.replace(res, milp_objective=out.objective)

    def _solve_by_backend(self, budget: int, t0: float, *, by_counts: bool = False) -> SolveResult | None:
        """The backend on the MILP (``by_counts``: by count branching), its plan settled in
        bytes; where the repair cannot fit it, solved again for a tighter target. None where
        count branching hands the budget on (too wide a search, or no plan in any box: the
        whole model may still have one within HiGHS' tolerances)."""
        milp = self.milp()
        target = budget
        for _ in range(_RESOLVES):
            if by_counts:
                milp.set_budget(target)
                sol = self._counter.solve(self.options, None, self._deadline(t0), self.options.rel_gap)
                if sol is None or sol.outcome.infeasible:
                    return None
            else:
                sol = milp.solve(target, self.options)
            if not sol.outcome.has_solution:
                return self._no_backend_plan(budget, t0, timed_out=not sol.outcome.infeasible)
            plan, short = self._exact.settle(self._plan_of(milp.read_plan(sol.values)), budget, target)
            if short == 0:
                return self._solved(plan, budget, sol, t0)
            target -= short + 1024
        return self._no_backend_plan(budget, t0, timed_out=False)

    def _deadline(self, t0: float) -> float | None:
        """When the time limit of a solve begun at ``t0`` runs out (perf_counter), or None."""
        limit = self.options.time_limit_s
        return None if limit is None else t0 + limit

    def _no_backend_plan(self, budget: int, t0: float, *, timed_out: bool) -> SolveResult:
        """No usable plan from the backend: the least-peak plan if it fits, else a clear error."""
        if timed_out:
            raise SolverTimeoutError(
                f"no plan found within time_limit_s={self.options.time_limit_s}; raise "
                "SolverOptions.time_limit_s or rel_gap, or restrict ac_units"
            )
        min_peak, plan = self._solve_min_peak()
        if min_peak > budget:
            raise InfeasibleBudgetError(budget, min_peak, self.world_size)
        # The least-peak plan discards all it can; the budget may need much less.
        plan = self._exact.polish(self._exact.trim(plan, budget, max(plan.values(), default=0)), budget)
        fallback = self._result(plan, budget, SolveStatus.FEASIBLE, None, t0, "min-peak plan")
        other = self._cbc_plan(budget, t0)
        if other is not None and other.recompute_ms < fallback.recompute_ms:
            logger.info("no plan from HiGHS at budget %d (within its tolerance of the smallest "
                        "reachable peak, %d); CBC's plan costs less than the least-peak plan",
                        budget, min_peak)
            return other
        logger.warning("no plan from the backend at budget %d, which is within its tolerance of the "
                       "smallest reachable peak (%d) or of the unplanned peak (%d); returning the "
                       "least-peak plan (less what the exact peak does not need)", budget, min_peak,
                       self.no_ac_peak_bytes)
        return fallback

    def _cbc_plan(self, budget: int, t0: float) -> SolveResult | None:
        """CBC's plan where HiGHS found none at a budget its tolerances decide, for a model small
        enough that HiGHS' own answers are cross-checked (``CROSS_CHECK_COLS``): a second backend
        with other tolerances, evaluated exactly like any plan. None where there is none."""
        milp = self.milp()
        if self.options.backend is not Backend.HIGHS or milp.n_variables > CROSS_CHECK_COLS:
            return None
        try:
            options = options_until(dataclasses.replace(self.options, backend=Backend.CBC),
                                    self._deadline(t0))
            sol = milp.solve(budget, options)
        except Exception as e:  # noqa: BLE001 - no CBC here: the least-peak plan stands
            logger.info("CBC could not check HiGHS' verdict: %s", e)
            return None
        if not sol.outcome.has_solution:
            return None
        plan, short = self._exact.settle(self._plan_of(milp.read_plan(sol.values)), budget, budget)
        return None if short else self._solved(plan, budget, sol, t0, Backend.CBC)

    def _solved(self, plan: dict[str, int], budget: int, sol: LpSolution, t0: float,
                backend: Backend | None = None) -> SolveResult:
        """The result of a backend solution's exact ``plan``: optimal where the backend proved
        its MILP, with the plan's MILP objective."""
        status = SolveStatus.OPTIMAL if sol.outcome.proven else SolveStatus.FEASIBLE
        res = self._result(plan, budget, status, sol.outcome.gap, t0,
                           (backend or self.options.backend).value)
        return dataclasses.replace(res, milp_objective=self.milp().objective_of(sol.values))

    def _plan_of(self, discarded: Mapping[int, float]) -> dict[str, int]:
        """{fqn: whole bytes} of checkpointed candidates (index -> bytes on the curve)."""
        plan = {}
        for k, d in discarded.items():
            st = self.candidates[k].stats
            d = min(st.sac_memory_bytes, max(0, round(d)))
            # Checkpointing that discards nothing only costs time and transients; at ratio 0 a
            # checkpoint still discards its forced bytes, which the budget may need.
            if d > 0 or fixed_discard_bytes(st) > 0:
                plan[self.candidates[k].fqn] = d
        return plan

    # ------------------------------------------------------------------ min peak
    def min_reachable_peak_bytes(self) -> int:
        """Smallest peak any allowed plan reaches (the smallest feasible budget), in bytes.

        The number is reached by a concrete plan. Where the program takes the model, no plan
        goes lower, to the byte (``PrefixDP.min_budget``); else that is proven up to the
        backend's tolerance, about 1e-6 of the peak."""
        return self._solve_min_peak()[0]

    def min_peak_plan(self) -> dict[str, int]:
        """A plan that reaches ``min_reachable_peak_bytes`` ({fqn: discarded bytes}): the one
        found while computing it, not the least-recompute one there (``solve`` at that budget)."""
        return dict(self._solve_min_peak()[1])

    def _solve_min_peak(self) -> tuple[int, dict[str, int]]:
        if self._min_peak is None:
            if not self.candidates:
                self._min_peak = (self.no_ac_peak_bytes, {})
            else:
                self._min_peak = self._min_peak_by_program() or self._min_peak_by_backend()
        return self._min_peak

    def _min_peak_by_program(self) -> tuple[int, dict[str, int]] | None:
        """(peak, plan) at the program's least budget, or None: the backend decides (a stack
        for count branching, no program, its two runs disagree, or its plan there does not
        settle in bytes)."""
        if self._by_counts or not self.options.dynamic_program or not isinstance(self.program(), PrefixDP):
            return None
        least = self.program().min_budget()
        if least is None or least >= self.no_ac_peak_bytes:
            return None
        res = self._solve_by_program(least, time.perf_counter())
        if res is None:
            logger.debug("the program's least budget %d did not settle; the backend decides", least)
            return None
        return res.predicted_peak_bytes, dict(res.discarded_bytes)

    def _min_peak_by_backend(self) -> tuple[int, dict[str, int]]:
        milp = self.milp()
        sol = milp.solve_min_peak(self.options)
        if not sol.outcome.has_solution and not sol.outcome.infeasible:
            raise SolverTimeoutError(
                f"could not compute the smallest reachable peak within time_limit_s="
                f"{self.options.time_limit_s}; raise SolverOptions.time_limit_s"
            )
        if not sol.outcome.has_solution:  # "infeasible": every solve refused a model with plans
            other = Backend.CBC if self.options.backend is Backend.HIGHS else Backend.HIGHS
            raise SolverError(
                f"the {self.options.backend.value} backend found no plan for the smallest-peak "
                "model, which has one (checkpointing nothing); try the other backend: "
                f"SolverOptions(backend=Backend.{other.name})"
            )
        plan = self._plan_of(milp.read_plan(sol.values))
        for f, d in plan.items():  # undo the backend's rounding of r = 1
            size = self.memory.stats[f].sac_memory_bytes
            if size - d <= max(1, size * 1e-6):
                plan[f] = size
        peak = self.memory.peak(plan)
        return (peak, plan) if peak < self.no_ac_peak_bytes else (self.no_ac_peak_bytes, {})

    # ------------------------------------------------------------------ result
    def _result(self, plan: dict[str, int], budget: int, status: SolveStatus, gap: float | None,
                t0: float, solved_by: str) -> SolveResult:
        order = sorted(plan, key=lambda f: self.graph.node(f).index)
        peak = self.memory.peak(plan)
        if peak > budget:  # guaranteed by ExactPlans.repair; a failure here is a bug, not bad input
            raise AssertionError(f"plan peak {peak} exceeds budget {budget}")
        ratios = {f: plan[f] / self.memory.stats[f].sac_memory_bytes for f in order}
        rct = sum(module_recompute_ms(self.memory.stats[f], plan[f]) for f in order)
        return SolveResult(
            status=status, decisions=ratios, discarded_bytes={f: plan[f] for f in order},
            checkpointed=tuple(order), predicted_peak_bytes=peak,
            no_ac_peak_bytes=self.no_ac_peak_bytes, recompute_ms=rct,
            solve_time_s=time.perf_counter() - t0, gap=gap, budget_bytes=budget,
            world_size=self.world_size, backend=self.options.backend,
            n_variables=self._milp.n_variables if self._milp is not None else 0,
            n_constraints=self._milp.n_constraints if self._milp is not None else 0,
            solved_by=solved_by,
        )


def solve_milp(
    info: ModuleInfo,
    budget_bytes: int,
    *,
    world_size: int = 1,
    ac_units: Iterable[str] | None = None,
    fsdp_units: Iterable[str] | None = None,
    options: SolverOptions | None = None,
) -> SolveResult:
    """Per-module discard ratios that fit ``budget_bytes`` per rank at the least recompute time.

    ``ac_units``: only these modules may be checkpointed. ``fsdp_units``: no checkpointed module
    may be a strict ancestor of one. Raises ``InfeasibleBudgetError`` (with the smallest budget
    this model can reach) when nothing fits.

    >>> res = solve_milp(info, budget_bytes=int(40 * 2**30))   # doctest: +SKIP
    """
    milp = SACMilp(info, world_size=world_size, ac_units=ac_units, fsdp_units=fsdp_units,
                   options=options)
    res = milp.solve(budget_bytes)
    return dataclasses.replace(res, solve_time_s=res.solve_time_s + milp.build_time_s)


def min_reachable_peak_bytes(
    info: ModuleInfo,
    *,
    world_size: int = 1,
    ac_units: Iterable[str] | None = None,
    fsdp_units: Iterable[str] | None = None,
    options: SolverOptions | None = None,
) -> int:
    """Smallest per-rank peak any allowed plan reaches: the smallest budget ``solve_milp`` accepts."""
    return SACMilp(info, world_size=world_size, ac_units=ac_units, fsdp_units=fsdp_units,
                   options=options).min_reachable_peak_bytes()
