"""Module-level SAC as a MILP: per-module discard ratios r that fit a memory budget at the least
recompute time.

    from solver import solve_milp
    res = solve_milp(info, budget_bytes=40 * 2**30)
    res.decisions          # {"GPT.blocks.3": 0.62, ...}  fqn -> discard ratio
    res.predicted_peak_bytes, res.recompute_ms

The maths (memory in GiB, or KiB / MiB for models under 1 GiB, converted once by
``_solver_unit``)::

    y_i in {0,1}          module i is checkpointed   (leaves / modules with nothing to discard: none)
    0 <= r_i <= y_i       fraction of sac_memory_bytes_i discarded
    d_i = S_i r_i         discarded memory
    sum_{i on a root-to-leaf path} y_i <= 1            no nested checkpoints
    mem(p) = base_p - sum_j d_j [fw_post_j <= t_p < bw_pre_j] + T_j y_j [p recomputes j]
             + sum_j R_j y_j [bw_pre_j <= t_p <= bw_post_j, p not j's recompute point] <= peak
    peak <= budget
    rct_i >= a_s r_i + b_s y_i  for each segment s of i's exact cost curve (convex envelope),
                                the module's recompute_fixed_ms included in b_s
    minimise  sum_i rct_i  (+ a tie-break below 1e-6 of the largest module's recompute time)

``base_p = ceil((param + grad + optimizer) / world_size) + activation + other`` of MemoryPoint p;
``R_j = checkpoint_retain_bytes``: the inputs j's checkpoint holds stay alive through j's own
backward, where the unplanned step had freed them.
The window sum is written with prefix sums over the modules sorted by ``fw_post_op`` and by
``bw_pre_op`` (``cum_fw_k = cum_fw_{k-1} + d_{j_k}``), so the model is linear in modules + points.

Tie-break: among plans of equal recompute time prefer fewer checkpointed modules, then modules
earlier in forward pre-order, then discarding less. It is a perturbation of the objective, so
plans that differ by less than the gap tolerance may still resolve by the backend's search order;
the backend runs single-threaded by default so the same input gives the same plan.

Backend: the model is written once into a ``solver.lp_model.LinearModel`` (arrays) and solved
by HiGHS through highspy directly (one ``passModel`` per solve, integrality tolerance 1e-8;
small models are checked by a second solve at 1e-6, see ``LinearModel._solve_highs``), or by CBC through PuLP where asked for or where highspy cannot
load. A solve changes only the budget row's bound and the objective.

The LP values come back rounded by the backend, so the plan is re-evaluated in exact integers:
``predicted_peak_bytes`` comes from ``solver.plan_cost.predict_peak_bytes`` (never the LP variable) and a plan
that overshoots the budget by rounding is repaired by discarding the missing bytes, and bytes
the exact peak does not need are given back (``solver.rounding.ExactPlans``).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import numbers
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from solver.count_branch import CountBrancher, kind_groups
from solver.errors import InfeasibleBudgetError, SolverError, SolverTimeoutError
from solver.graph import Graph, Node, is_submodule
from solver.lp_model import _CROSS_CHECK_COLS, EQ, GE, LE, LinearModel
from solver.prefix_dp import PrefixDP, ProgramTooLarge
from solver.rounding import ExactPlans
from solver.plan_cost import (
    MemoryModel,
    check_world_size,
    cost_envelope,
    fixed_discard_bytes,
    growth_hull_segments,
    has_window,
    module_recompute_ms,
    predict_peak_bytes,
    unknown_module_error,
)
from solver.options import Backend, SolveResult, SolverOptions, SolveStatus, options_until

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats, ModuleInfo

__all__ = [
    "SACMilp",
    "solve_milp",
    "min_reachable_peak_bytes",
    "predict_peak_bytes",
    "module_recompute_ms",
]

logger = logging.getLogger(__name__)

_UNITS = ((2**30, "gib"), (2**20, "mib"), (2**10, "kib"), (1, "bytes"))


def _solver_unit(peak_bytes: int) -> tuple[int, str]:
    """The one place bytes become solver units: GiB, or a smaller binary unit for models whose
    peak is under 1 GiB, so coefficients stay near 1 and well above the backend's tolerances."""
    return next(((u, name) for u, name in _UNITS if peak_bytes >= u), _UNITS[-1])

_LOUD_CANDIDATES = 300
"""Models of at least this many candidates (about 1,000 variables) log the start and end of
each solve at INFO (they may take seconds to the whole time limit; the CLI shows INFO as
progress)."""

_DP_CANDIDATES = 48
_DP_WORK = 20_000
_DP_WORK_PER_CANDIDATE = 2_000
"""The program (``solver/prefix_dp.py``) is tried first on every model of at most
``_DP_CANDIDATES`` candidates and on bigger ones without repeated blocks (stacks of blocks go to
HiGHS with count branching, which proves them faster: a 1,000-module synthetic decoder 0.1-0.3 s,
the program 0.4-0.5 s; and to the program where count branching gives up,
``_DP_STACK_WORK_PER_CANDIDATE``). It is given up past ``max(_DP_WORK,
_DP_WORK_PER_CANDIDATE * candidates)`` units of work (then HiGHS solves the model, and the
program is not tried again on it). Measured with functions held within ``_DP_REL_TOL``: random
module trees of 1,000 modules (617 candidates) need 250,000-350,000 units (0.5-0.65 s; HiGHS
2.7-4.9 s), of 2,000 modules 0.92-1.26 million (1.4-1.7 s; HiGHS 13-16 s); 100-module decoders,
exact, 2,700-6,900."""

_DP_STACK_WORK_PER_CANDIDATE = 20_000
"""The program's work cap per candidate on a big stack of blocks, where count branching gave up
and HiGHS on the whole model is left (it ran into a 20 s limit, gap 0.17-0.48 %, on traced
GPT-2 / BERT stacks, and 60 s on a T5-large, gap 0.04 %). Measured, exact: GPT-2-medium (74
candidates) 33,000-88,000 units, 0.1-0.15 s; BERT-large (151) 42,000-79,000; Whisper (124)
76,000-103,000; T5-large (291) 236,000-950,000, 0.6-1.6 s."""

_DP_ROUNDING = 1e-12
"""Relative difference of the program's bound and its plan's cost that is float rounding (seen:
1e-16 to 4e-16 on exact programs; rel_gap 0 refused them)."""

_DP_REL_TOL = (1e-5, 1e-7)
"""Relative tolerances of the program's value functions (``PrefixDP.solve``'s ``rel_tol``), each
tried in turn until its plan is proven within ``rel_gap`` (the plan's cost against the bound):
rel_gap 1e-4 is reached at the first on every random tree and decoder of
benchmarks/solver_scaling.py (gaps of 1e-16 to 8e-9). A stack of repeated blocks is tried
exact first (``rel_tol`` 0): its convex runs are real jumps the hull cannot merge (a traced
T5-large keeps about 200 a function at 1e-5 as exact), so holding them looser only costs the
hull, 3.2 s against 1.5 s. A tree of distinct modules is not: its runs are near-ties within
1e-7 (a random 2,000-module tree: 7 a function exact, 2 at 1e-5), and 1e-5 is faster, 1.4 s
against 2.2 s."""

_R_NOISE = 1e-9
"""A discard ratio this close to 0 or to y is that bound: backend noise (1e-13 seen), not a plan."""

_TIE_Y = 1e-6
_TIE_R = 1e-7
"""Tie-break weights: all the y (r) terms together weigh at most this much (twice, with the
position weight) of the largest single-module recompute time. Summed over the modules, so the
tie-break stays far below the default rel_gap of 1e-4 whatever the model's size: a per-module
weight made it 0.2 % of the objective on the Llama-3-70B graph, and the backend spent its time
proving the order of equal plans."""


# ----------------------------------------------------------------------------- validation
def _check_budget(budget_bytes: float) -> int:
    ok = isinstance(budget_bytes, numbers.Real) and not isinstance(budget_bytes, bool)
    if not ok or not math.isfinite(budget_bytes) or budget_bytes <= 0:
        raise ValueError(
            "budget_bytes must be a positive, finite number of bytes per rank, e.g. "
            f"int(40 * 2**30) for 40 GiB; got {budget_bytes!r}"
        )
    return int(math.floor(budget_bytes))


def _check_units(units: Iterable[str] | None, graph: Graph, what: str) -> set[str] | None:
    if units is None:
        return None
    if isinstance(units, str):
        raise TypeError(f"{what} must be a list of module fqns, not the string {units!r}")
    names = set(units)
    for fqn in sorted(names):
        if fqn not in graph:
            raise unknown_module_error(fqn, (n.fqn for n in graph), what)
    return names


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class _Cand:
    """A module the MILP may checkpoint."""

    node: Node
    segments: tuple[tuple[float, float], ...]

    @property
    def stats(self) -> ModStats:
        return self.node.stats


def _candidates(graph: Graph, allowed: set[str] | None, fsdp: set[str] | None) -> list[_Cand]:
    blocked = {a.fqn for u in (fsdp or ()) for a in graph.ancestors(u)}
    out = []
    for node in graph:
        s = node.stats
        if s.is_leaf or s.sac_memory_bytes <= 0:
            continue
        if (allowed is not None and node.fqn not in allowed) or node.fqn in blocked:
            continue
        if getattr(s, "sac_blocker", ""):  # unsafe to recompute: every consumer of the MILP
            # (solve_sac, tradeoff_curve, step-time curves) must leave it out alike; a curve had
            # stated a floor only blocks that mutate their input reach, which solve_sac refused
            logger.info("%s: never checkpointed: %s", node.fqn, s.sac_blocker)
            continue
        if not has_window(s):
            logger.info("%s: empty fw_post_op..bw_pre_op window, never checkpointed", node.fqn)
            continue
        segs, convex = cost_envelope(s)
        if not convex:
            logger.warning("%s: trade-off curve is not convex; the MILP uses its convex envelope "
                           "and reports recompute_ms on the exact curve", node.fqn)
        out.append(_Cand(node, tuple(segs)))
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)


class SACMilp:
    """The module-level MILP, built once and re-solvable for any budget.

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
        allowed = _check_units(ac_units, self.graph, "ac_units")
        fsdp = _check_units(fsdp_units, self.graph, "fsdp_units")
        self._memory = MemoryModel(info, self.world_size)
        self.no_ac_peak_bytes: int = self._memory.peak({})
        self._unit, self._unit_name = _solver_unit(self.no_ac_peak_bytes)
        self._cands = _candidates(self.graph, allowed, fsdp)
        self._exact = ExactPlans(self._memory, {n.fqn: n.index for n in self.graph})
        self._min_peak: tuple[int, dict[str, int]] | None = None
        self._program: PrefixDP | str | None = None
        """The program of this model, or why there is none (built at the first solve)."""
        self._groups = kind_groups([c.node.fqn for c in self._cands])
        """Candidates of one kind by name (numbered blocks), for count branching."""
        curves = {(c.stats.sac_memory_bytes, c.segments) for c in self._cands}
        self._repeated = bool(self._groups) or len(curves) < len(self._cands)
        """Repeated blocks, by name or by data (equal curves): a stack, which the program
        solves slower than HiGHS does (26 equal blocks named a..z: 0.3 s against 0.05 s)."""
        self._prob: LinearModel | None = None
        """The MILP, built where a solve needs it (``_model``): not where the program solves."""
        self._counter: CountBrancher | None = None
        self._n_symmetry_pairs = 0
        self.build_time_s = time.perf_counter() - t0

    @property
    def n_symmetry_pairs(self) -> int:
        """Pairs of identical candidates ordered by symmetry-breaking constraints."""
        if self._cands:
            self._model()
        return self._n_symmetry_pairs

    # ------------------------------------------------------------------ build
    def _model(self) -> LinearModel:
        """The MILP (candidates needed), built at the first call (inside a solve, its time is
        the solve's; ``build_time_s`` is the constructor's)."""
        if self._prob is None:
            self._build()
        return self._prob

    def _build(self) -> None:
        self._prob = LinearModel("sac_milp")
        self._add_variables()
        self._add_ratio_constraints()
        self._add_nesting_constraints()
        self._add_recompute_constraints()
        self._add_recompute_growth()
        self._add_memory_constraints()
        if self.options.break_symmetry and not self._memory.pipelined:
            # a pipeline's rows tell stages apart that equal blocks in names and curves do not
            self._add_symmetry_constraints()
        if self.options.count_branching and self.options.backend is Backend.HIGHS and self._groups:
            self._counter = CountBrancher(self._prob, self._y, self._groups)
        self._add_budget_constraint()
        self._recompute_objective = self._make_recompute_objective()

    def _units(self, nbytes: float) -> float:
        return nbytes / self._unit

    def _add_variables(self) -> None:
        prob, n = self._prob, len(self._cands)
        self._y, self._r = [], []
        for c in self._cands:
            tag = f"{c.node.index}_{_safe(c.node.fqn)}"
            self._y.append(prob.add_var(f"y{tag}", 0, 1, integer=True))
            self._r.append(prob.add_var(f"r{tag}", 0, 1))
        self._peak = prob.add_var(f"peak_{self._unit_name}", 0)
        # Prefix sums of discarded GiB in fw_post_op order and in bw_pre_op order.
        self._fw_order = sorted(range(n), key=lambda k: (self._cands[k].stats.fw_post_op, k))
        self._bw_order = sorted(
            (k for k in range(n) if self._cands[k].stats.bw_pre_op != -1),
            key=lambda k: (self._cands[k].stats.bw_pre_op, k),
        )
        # Free: a checkpoint that holds more inputs than it discards makes a prefix negative.
        self._cum_fw = [prob.add_var(f"cum_fw_{i + 1}", None) for i in range(len(self._fw_order))]
        self._cum_bw = [prob.add_var(f"cum_bw_{i + 1}", None) for i in range(len(self._bw_order))]

    def _add(self, terms: Sequence[tuple[int, float]], sense: int, rhs: float, name: str) -> int:
        return self._prob.add_row(terms, sense, rhs, name)

    def _add_ratio_constraints(self) -> None:
        for k, c in enumerate(self._cands):
            self._add([(self._r[k], 1.0), (self._y[k], -1.0)], LE, 0.0,
                      f"discard_only_if_checkpointed_{k}")

    def _add_nesting_constraints(self) -> None:
        """One clique per maximal chain of candidates: tighter than pairwise y_i + y_j <= 1."""
        index = {c.node.fqn: k for k, c in enumerate(self._cands)}
        chains = {k: [index[a.fqn] for a in self.graph.ancestors(c.node.fqn) if a.fqn in index]
                  for k, c in enumerate(self._cands)}
        inner = {a for anc in chains.values() for a in anc}
        for k, anc in chains.items():
            if anc and k not in inner:
                terms = [(self._y[j], 1.0) for j in [k, *anc]]
                self._add(terms, LE, 1.0, f"no_nesting_{k}")

    def _add_recompute_constraints(self) -> None:
        """rct_k >= a_s r_k + b_s y_k per segment of the envelope (its perspective). Measured:
        the same envelope as a convex combination of its vertices (two rows per module) gave
        the same LP bound but 2-8x slower proofs with HiGHS, so the epigraph rows stay."""
        self._rct = []
        for k, c in enumerate(self._cands):
            tag = f"{c.node.index}_{_safe(c.node.fqn)}"
            self._rct.append(self._prob.add_var(f"rct_ms{tag}", 0))
            for s, (a, b) in enumerate(c.segments):
                self._add([(self._rct[k], 1.0), (self._r[k], -a), (self._y[k], -b)],
                          GE, 0.0, f"recompute_seg{s}_{k}")

    def _add_memory_constraints(self) -> None:
        for cum, order, what in ((self._cum_fw, self._fw_order, "fw"), (self._cum_bw, self._bw_order, "bw")):
            for i, k in enumerate(order):
                st = self._cands[k].stats
                size, fixed = self._units(st.sac_memory_bytes), self._units(fixed_discard_bytes(st))
                # cum_i = cum_{i-1} + r_k S_k + (F_k - R_k) y_k: discards, the forced ones
                # included, net of the inputs a checkpoint holds.
                terms = [(cum[i], 1.0), (self._r[k], -size)] + ([(cum[i - 1], -1.0)] if i else [])
                if fixed:
                    terms.append((self._y[k], -fixed))
                self._add(terms, EQ, 0.0, f"cum_{what}_{i + 1}")
        stage_discard = self._add_stage_discards()
        for (a, b, k, held, in_flight, kw), (base, t) in self._point_groups().items():
            terms = [(self._peak, 1.0)]
            for h in held:  # inputs held through the backward of checkpointed candidate h
                terms.append((self._y[h], -self._units(self._cands[h].stats.checkpoint_retain_bytes)))
            if a:
                terms.append((self._cum_fw[a - 1], 1.0))
            if b:
                terms.append((self._cum_bw[b - 1], -1.0))
            if k >= 0:
                terms += self._recompute_terms(k)
            if kw >= 0:  # recompute while the discard holds: growth on top of it
                terms += self._recompute_terms(kw) + [
                    (self._r[kw], -self._units(self._cands[kw].stats.sac_memory_bytes)),
                    (self._y[kw], -self._units(fixed_discard_bytes(self._cands[kw].stats)))]
            terms += [(stage_discard[g], float(n)) for g, n in in_flight if g in stage_discard]
            # (a, b) follow from t, so t plus the recomputed candidate names the point uniquely.
            name = (f"mem_at_op_{t}" + (f"_recompute_{k}" if k >= 0 else "") + (f"_held{held[0]}" if held else "")
                    + (f"_recompute_in_window_{kw}" if kw >= 0 else "")
                    + "".join(f"_in_flight_{_safe(g)}_x{n}" for g, n in in_flight))
            self._add(terms, GE, self._units(base), name)

    def _add_stage_discards(self) -> dict[str, Any]:
        """Pipeline schedules (``MemoryPoint.in_flight``): per stage root g, a variable D_g =
        sum of S r + (F - R) y over its candidates, what each of its micro-batches in flight no
        longer holds (one equality row per stage)."""
        out = {}
        for g in self._memory.in_flight_roots:
            v = self._prob.add_var(f"stage_discard_{_safe(g)}", None)
            terms = [(v, 1.0)]
            for k, c in enumerate(self._cands):
                if c.node.fqn == g or is_submodule(c.node.fqn, g):
                    st = c.stats
                    terms += [(self._r[k], -self._units(st.sac_memory_bytes)),
                              (self._y[k], -self._units(fixed_discard_bytes(st)))]
            self._add(terms, EQ, 0.0, f"stage_discard_{_safe(g)}")
            out[g] = v
        return out

    def _add_recompute_growth(self) -> None:
        """extra_k >= a_s r_k + b_s y_k: the lower convex hull of the recompute's memory change
        (growth - discarded) at the curve's breakpoints; exact at every breakpoint where that
        change is convex in r (the exact evaluation of the plan catches the rest)."""
        self._extra: dict[int, Any] = {}
        for k, c in enumerate(self._cands):
            segs = growth_hull_segments(c.stats, self._unit)
            if not segs:
                continue
            tag = f"{c.node.index}_{_safe(c.node.fqn)}"
            self._extra[k] = self._prob.add_var(f"recompute_extra{tag}", None)
            for sidx, (a, b) in enumerate(segs):
                self._add([(self._extra[k], 1.0), (self._r[k], -a), (self._y[k], -b)],
                          GE, 0.0, f"recompute_growth_seg{sidx}_{k}")

    def _recompute_terms(self, k: int) -> list[tuple[Any, float]]:
        """Minus the memory change at candidate k's recompute point, as (variable, coef) terms."""
        st = self._cands[k].stats
        if k in self._extra:
            fixed = self._units(fixed_discard_bytes(st))
            return [(self._extra[k], -1.0)] + ([(self._y[k], fixed)] if fixed else [])
        t = self._units(st.recompute_transient_bytes)
        return [(self._y[k], -t)] if t else []

    def _add_symmetry_constraints(self) -> None:
        """Order identical candidates (repeated blocks); exact, see ``solver/symmetry.py``."""
        from solver.symmetry import symmetry_pairs

        index = {c.node.fqn: k for k, c in enumerate(self._cands)}
        nested = []
        for c in self._cands:
            near = {index[a.fqn] for a in self.graph.ancestors(c.node.fqn) if a.fqn in index}
            near |= {index[d.fqn] for d in self.graph.descendants(c.node.fqn) if d.fqn in index}
            nested.append(near)
        rec: dict[int, list[int]] = {}
        for i, p in enumerate(self._memory.points):
            if p.recompute_of in index:
                rec.setdefault(index[p.recompute_of], []).append(i)
        pairs = symmetry_pairs(
            [c.stats for c in self._cands], nested,
            np.array([p.op_index for p in self._memory.points], dtype=np.int64),
            np.array(self._memory.base, dtype=np.float64), rec,
        )
        for pair in pairs:
            a, b = pair.outer, pair.inner
            if pair.ratio_order:
                self._add([(self._r[a], 1.0), (self._r[b], -1.0), (self._y[a], -1.0)],
                          GE, -1.0, f"symmetry_ratio_{a}_{b}")
            if pair.touched_order:
                terms = [(self._y[k], 1.0) for k in sorted(nested[a] | {a})] + [(self._y[b], -1.0)]
                self._add(terms, GE, 0.0, f"symmetry_touched_{a}_{b}")
        self._n_symmetry_pairs = len(pairs)

    def _point_groups(self) -> dict[tuple, tuple[int, int]]:
        """Points keyed by (#fw_post <= t, #bw_pre <= t, recomputed candidate, candidates whose
        held inputs are alive at t, micro-batches in flight, candidate recomputing inside its
        window): max base each."""
        fw_keys = [self._cands[k].stats.fw_post_op for k in self._fw_order]
        bw_keys = [self._cands[k].stats.bw_pre_op for k in self._bw_order]
        index = {c.node.fqn: k for k, c in enumerate(self._cands)}
        held: dict[int, list[int]] = {}
        for k, c in enumerate(self._cands):
            for i in self._memory.held_points(c.node.fqn):
                held.setdefault(i, []).append(k)
        groups: dict[tuple, tuple[int, int]] = {}
        for i, (p, base) in enumerate(zip(self._memory.points, self._memory.base)):
            t = p.op_index
            k = index.get(p.recompute_of, -1) if p.recompute_of is not None else -1
            if k >= 0 and not self._recompute_terms(k):
                k = -1
            kw = index.get(p.recompute_in_window, -1) if p.recompute_in_window is not None else -1
            key = (bisect.bisect_right(fw_keys, t), bisect.bisect_right(bw_keys, t), k,
                   tuple(sorted(held.get(i, ()))), p.in_flight, kw)
            if key not in groups or base > groups[key][0]:
                groups[key] = (base, t)
        return groups

    def _add_budget_constraint(self) -> None:
        self._budget = self._add([(self._peak, 1.0)], LE,
                                 self._units(self.no_ac_peak_bytes), "budget")

    def tie_break_ms(self) -> tuple[list[float], list[float]]:
        """Per candidate, the tie-break's cost of checkpointing it (y = 1) and of discarding all
        it can (r = 1), in the objective's ms: ``_TIE_Y`` / ``_TIE_R``, weighted by position."""
        scale = max((max(a + b for a, b in c.segments) for c in self._cands if c.segments), default=1.0)
        scale = scale if scale > 0 else 1.0
        n = len(self._cands)
        w = [1.0 + c.node.index / max(1, len(self.graph)) for c in self._cands]
        return ([_TIE_Y * scale * wk / n for wk in w], [_TIE_R * scale * wk / n for wk in w])

    def _make_recompute_objective(self) -> Any:
        tie_y, tie_r = self.tie_break_ms()
        terms = [(v, 1.0) for v in self._rct]
        for k in range(len(self._cands)):
            terms += [(self._y[k], tie_y[k]), (self._r[k], tie_r[k])]
        return terms

    # ------------------------------------------------------------------ solve
    @property
    def n_variables(self) -> int:
        """Columns of the MILP (built by this call if it was not yet)."""
        return self._model().n_cols if self._cands else 0

    @property
    def n_constraints(self) -> int:
        """Rows of the MILP (built by this call if it was not yet)."""
        return self._model().n_rows if self._cands else 0

    def _set_budget(self, budget_units: float) -> None:
        self._prob.set_row_upper(self._budget, budget_units)

    def _read_plan(self, values: Any) -> dict[str, int]:
        ratios = {k: min(1.0, max(0.0, float(values[self._r[k]])))
                  for k in range(len(self._cands)) if round(float(values[self._y[k]])) == 1}
        return self._plan_of({k: r * self._cands[k].stats.sac_memory_bytes for k, r in ratios.items()})

    def _plan_of(self, discarded: Mapping[int, float]) -> dict[str, int]:
        """{fqn: whole bytes} of checkpointed candidates (index -> bytes on the curve)."""
        plan = {}
        for k, d in discarded.items():
            st = self._cands[k].stats
            d = min(st.sac_memory_bytes, max(0, round(d)))
            # Checkpointing that discards nothing only costs time and transients; at ratio 0 a
            # checkpoint still discards its forced bytes, which the budget may need.
            if d > 0 or fixed_discard_bytes(st) > 0:
                plan[self._cands[k].node.fqn] = d
        return plan

    def objective_of(self, values: Any) -> float:
        """The recompute objective of the plan in ``values`` (a backend solution): y rounded, r
        clipped to [0, y] with backend noise under ``_R_NOISE`` dropped, and each rct at its
        envelope. The backend's own value may carry slack in the rct columns that its tolerances
        allow: an unchosen module at r = 1.6e-13 under a segment of slope 9.3e6 ms (4 ms for
        49 bytes of a 114 MB module) held rct = 1.46e-6 ms, and two proofs of one plan then
        differed by 3e-6 relative (tests/solver/test_count_branch.py)."""
        v = np.array(values, dtype=np.float64)
        for k, c in enumerate(self._cands):
            y = 1.0 if v[self._y[k]] >= 0.5 else 0.0
            r = min(max(float(v[self._r[k]]), 0.0), y)
            r = 0.0 if r < _R_NOISE else (y if y - r < _R_NOISE else r)
            v[self._y[k]], v[self._r[k]] = y, r
            v[self._rct[k]] = max([0.0] + [a * r + b * y for a, b in c.segments])
        return float(self._prob.cost @ v)

    def solve(self, budget_bytes: int) -> SolveResult:
        """Least-recompute plan whose exact predicted peak is <= ``budget_bytes`` (per rank)."""
        t0 = time.perf_counter()
        budget = _check_budget(budget_bytes)
        if budget >= self.no_ac_peak_bytes:
            return self._result({}, budget, SolveStatus.OPTIMAL, 0.0, t0, "nothing to plan")
        if not self._cands:
            raise InfeasibleBudgetError(budget, self.no_ac_peak_bytes, self.world_size)
        target = budget
        loud = len(self._cands) >= _LOUD_CANDIDATES
        if loud:  # big graphs can take the whole time limit: say so before, and how it ended
            logger.info("planning %d candidate modules for a %.2f GiB budget (%s, gap %g, time "
                        "limit %s s)", len(self._cands), budget / 2**30,
                        self.options.backend.value, self.options.rel_gap, self.options.time_limit_s)
        exact = self._solve_by_program(budget, t0)
        if exact is not None:
            if loud:
                logger.info("SAC MILP: %s in %.2f s (program), recompute %.3f ms",
                            exact.status.value, exact.solve_time_s, exact.recompute_ms)
            return exact
        if loud:
            logger.info("SAC MILP: %d variables, %d constraints", self.n_variables, self.n_constraints)
        self._model()
        stack_tried = False
        for _ in range(3):  # re-solve with a tighter target if rounding cannot be repaired
            self._set_budget(self._units(target))
            self._prob.set_cost(self._recompute_objective)
            sol = self._count_search(t0)
            if sol is None and not stack_tried:  # count branching found the search too wide
                stack_tried = True
                exact = self._solve_by_program(budget, t0, stack=True)
                if exact is not None:
                    if loud:
                        logger.info("SAC MILP: %s in %.2f s (program, after count branching), "
                                    "recompute %.3f ms", exact.status.value, exact.solve_time_s,
                                    exact.recompute_ms)
                    return exact
                self._set_budget(self._units(target))  # the program may have written the LP
                self._prob.set_cost(self._recompute_objective)
            if sol is None:
                sol = self._solve_whole(t0)
            out = sol.outcome
            if not out.has_solution:
                return self._fallback(budget, t0, timed_out=not out.infeasible)
            plan, short = self._exact_plan(sol.values, budget, target)
            if short == 0:
                res = self._solved(plan, budget, sol, t0)
                if loud:
                    logger.info("SAC MILP: %s in %.2f s, recompute %.3f ms%s", res.status.value,
                                res.solve_time_s, res.recompute_ms,
                                "" if out.proven else f" (within {100 * (out.gap or 0):.2f} % of "
                                "optimal: raise SolverOptions.time_limit_s to prove it)")
                return res
            target -= short + 1024
        return self._fallback(budget, t0, timed_out=False)

    def _program_of_model(self) -> PrefixDP | str:
        """The program of this model, or why there is none (built at the first call)."""
        if self._program is None:
            self._program = PrefixDP.from_milp(self)
            if isinstance(self._program, str):
                logger.debug("no program: %s", self._program)
        return self._program

    @property
    def _program_first(self) -> bool:
        """Whether the program is tried before the backend: small models and models without
        repeated blocks. Big stacks go to count branching first (tenths of a second where it
        proves them, the program 0.4-0.5 s on a 1,000-module synthetic decoder) and to the
        program only where count branching gives up (see ``_DP_CANDIDATES``)."""
        return len(self._cands) <= _DP_CANDIDATES or not self._repeated

    def _solve_by_program(self, budget: int, t0: float, *, stack: bool = False) -> SolveResult | None:
        """The plan of the exact program where this model is one it takes (see
        ``_DP_CANDIDATES``), proven within ``rel_gap``; None: the backend decides. ``stack``:
        the program's turn on a big stack of blocks, after count branching."""
        if not self.options.dynamic_program or not (stack or self._program_first):
            return None
        if self.options.write_lp_path is not None:  # the model the program solves, as documented
            self._model()
            self._set_budget(self._units(budget))
            self._prob.set_cost(self._recompute_objective)
            self._prob.write(self.options)
        if not isinstance(self._program_of_model(), PrefixDP):
            return None
        per = _DP_STACK_WORK_PER_CANDIDATE if stack else _DP_WORK_PER_CANDIDATE
        max_work = max(_DP_WORK, per * len(self._cands))
        for rel_tol in ((0.0,) if self._repeated else ()) + _DP_REL_TOL:
            try:
                out = self._program.solve(budget, max_work=max_work, rel_tol=rel_tol)
            except ProgramTooLarge as e:
                logger.debug("program at rel_tol %g given up: %s", rel_tol, e)
                if rel_tol == 0.0:  # the exact functions outgrew the cap: hold them looser
                    continue
                if rel_tol == _DP_REL_TOL[0]:  # too big held loosely: not tried again on it
                    self._program = str(e)
                return None
            if out is None:  # no plan fits: the backend path says so with the smallest budget
                return None
            gap = (out.objective - out.lower_bound) / max(abs(out.objective), 1e-12)
            # The plan's cost and the bound are summed apart: equal optima differ by rounding.
            if gap <= self.options.rel_gap + _DP_ROUNDING:
                break
            logger.debug("program at rel_tol %g: gap %g", rel_tol, gap)
        else:  # not proven (a varying recompute growth, or functions held too loosely)
            return None
        plan, short = self._exact.settle(self._plan_of(out.discarded), budget, budget)
        if short:
            return None
        res = self._result(plan, budget, SolveStatus.OPTIMAL, max(0.0, gap), t0, "program")
        return dataclasses.replace(res, milp_objective=out.objective)

    def _deadline(self, t0: float) -> float | None:
        """When the time limit of a solve begun at ``t0`` runs out (perf_counter), or None."""
        limit = self.options.time_limit_s
        return None if limit is None else t0 + limit

    def _count_search(self, t0: float) -> Any:
        """Count branching's solution for the current budget (measured: a 50-node HiGHS probe
        first cost 2.5-10 s on the Llama-3-70B graph, more than the whole count search, which
        proves easy budgets there in 0.4-0.6 s too); HiGHS' on the whole model where there is
        no count search; None where the search is too wide for count branching."""
        if self._counter is None:
            return self._prob.solve(self.options)
        sol = self._counter.solve(self.options, None, self._deadline(t0), self.options.rel_gap)
        # Every box refused: at a budget on the smallest reachable peak a fixed-count MILP may
        # refuse what HiGHS' tolerances accept on the whole model, which HiGHS then solves.
        return self._solve_whole(t0) if sol is not None and sol.outcome.infeasible else sol

    def _solve_whole(self, t0: float) -> Any:
        """HiGHS' branch and bound on the whole model, within what is left of the time limit."""
        return self._prob.solve(options_until(self.options, self._deadline(t0)))

    def _exact_plan(self, values: Any, budget: int, target: int) -> tuple[dict[str, int], int]:
        """The backend's plan in exact bytes: (plan, bytes still over ``budget``). Read, repaired
        where rounding left it over; then what the repair added, or a ``target`` under the
        budget asked for, beyond the exact peak's need is given back (``ExactPlans.settle``)."""
        return self._exact.settle(self._read_plan(values), budget, target)

    def _fallback(self, budget: int, t0: float, *, timed_out: bool) -> SolveResult:
        """No usable plan from the backend: the min-peak plan if it fits, else a clear error."""
        if timed_out:
            raise SolverTimeoutError(
                f"no plan found within time_limit_s={self.options.time_limit_s}; raise "
                "SolverOptions.time_limit_s or rel_gap, or restrict ac_units"
            )
        min_peak, plan = self._solve_min_peak()
        if min_peak > budget:
            raise InfeasibleBudgetError(budget, min_peak, self.world_size)
        # The min-peak plan discards all it can; the budget may need much less (a byte under
        # the unplanned peak: 1.0 ms where 0.6 ms fits a smaller budget).
        plan = self._exact.polish(self._exact.trim(plan, budget, max(plan.values(), default=0)), budget)
        fallback = self._result(plan, budget, SolveStatus.FEASIBLE, None, t0, "min-peak plan")
        other = self._cbc_plan(budget, t0)
        if other is not None and other.recompute_ms < fallback.recompute_ms:
            logger.info("no plan from HiGHS at budget %d (within its tolerance of the smallest "
                        "reachable peak, %d); CBC's plan costs less than the min-peak plan", budget, min_peak)
            return other
        logger.warning("no plan from the backend at budget %d, which is within its tolerance of the "
                       "smallest reachable peak (%d) or of the unplanned peak (%d); returning the "
                       "min-peak plan (less what the exact peak does not need)", budget, min_peak,
                       self.no_ac_peak_bytes)
        return fallback

    def _cbc_plan(self, budget: int, t0: float) -> SolveResult | None:
        """Where HiGHS found no plan at a budget its tolerances decide (within them of the
        smallest reachable peak), CBC's plan for a small model (as HiGHS' cross-check, at most
        ``_CROSS_CHECK_COLS`` columns), evaluated exactly; None where there is none. Seen on a
        stack of blocks at its smallest peak: HiGHS "infeasible" and the min-peak plan at
        19.53 ms, CBC 17.94 ms (tests/solver/test_symmetry.py)."""
        if self.options.backend is not Backend.HIGHS or self._prob.n_cols > _CROSS_CHECK_COLS:
            return None
        options = options_until(dataclasses.replace(self.options, backend=Backend.CBC),
                                self._deadline(t0))
        self._set_budget(self._units(budget))
        self._prob.set_cost(self._recompute_objective)
        try:
            sol = self._prob.solve(options)
        except Exception as e:  # noqa: BLE001 - no CBC here: the min-peak plan stands
            logger.info("CBC could not check HiGHS' verdict: %s", e)
            return None
        if not sol.outcome.has_solution:
            return None
        plan, short = self._exact_plan(sol.values, budget, budget)
        return None if short else self._solved(plan, budget, sol, t0, Backend.CBC)

    def _solved(self, plan: dict[str, int], budget: int, sol: Any, t0: float,
                backend: Backend | None = None) -> SolveResult:
        """The result of a backend solution's exact ``plan``: optimal where the backend proved
        its MILP, with the plan's MILP objective."""
        status = SolveStatus.OPTIMAL if sol.outcome.proven else SolveStatus.FEASIBLE
        res = self._result(plan, budget, status, sol.outcome.gap, t0,
                           (backend or self.options.backend).value)
        return dataclasses.replace(res, milp_objective=self.objective_of(sol.values))

    # ------------------------------------------------------------------ min peak
    def min_reachable_peak_bytes(self) -> int:
        """Smallest peak any allowed plan reaches (the smallest feasible budget), in bytes.

        The number is reached by a concrete plan. Where the program takes the model, no plan
        goes lower, to the byte (``PrefixDP.min_budget``, the plan: the least recompute there);
        else that is proven up to the backend's tolerance, about 1e-6 of the peak."""
        return self._solve_min_peak()[0]

    def _solve_min_peak(self) -> tuple[int, dict[str, int]]:
        if self._min_peak is not None:
            return self._min_peak
        if not self._cands:
            self._min_peak = (self.no_ac_peak_bytes, {})
            return self._min_peak
        by_program = self._min_peak_by_program()
        if by_program is not None:
            self._min_peak = by_program
            return self._min_peak
        self._model()
        self._set_budget(self._units(self.no_ac_peak_bytes) + 1.0)  # not binding
        self._prob.set_cost([(self._peak, 1.0)])
        sol = self._prob.solve(self.options, rel_gap=0.0, feasible=True)
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
        plan = self._read_plan(sol.values)
        for f, d in plan.items():  # undo the backend's rounding of r = 1
            size = self._memory.stats[f].sac_memory_bytes
            if size - d <= max(1, size * 1e-6):
                plan[f] = size
        peak = self._memory.peak(plan)
        self._min_peak = (peak, plan) if peak < self.no_ac_peak_bytes else (self.no_ac_peak_bytes, {})
        return self._min_peak

    def _min_peak_by_program(self) -> tuple[int, dict[str, int]] | None:
        """(peak, plan) at the program's least budget, or None: the backend decides (no
        program, its two runs disagree, or its plan there does not settle in bytes)."""
        if (not self.options.dynamic_program or not self._program_first
                or not isinstance(self._program_of_model(), PrefixDP)):
            return None
        least = self._program.min_budget()
        if least is None or least >= self.no_ac_peak_bytes:
            return None
        res = self._solve_by_program(least, time.perf_counter())
        if res is None:
            logger.debug("the program's least budget %d did not settle; HiGHS decides", least)
            return None
        return res.predicted_peak_bytes, dict(res.discarded_bytes)

    # ------------------------------------------------------------------ result
    def _result(self, plan: dict[str, int], budget: int, status: SolveStatus, gap: float | None,
                t0: float, solved_by: str) -> SolveResult:
        order = sorted(plan, key=lambda f: self.graph.node(f).index)
        peak = self._memory.peak(plan)
        if peak > budget:  # guaranteed by ExactPlans.repair; a failure here is a bug, not bad input
            raise AssertionError(f"plan peak {peak} exceeds budget {budget}")
        ratios = {f: plan[f] / self._memory.stats[f].sac_memory_bytes for f in order}
        rct = sum(module_recompute_ms(self._memory.stats[f], plan[f]) for f in order)
        return SolveResult(
            status=status, decisions=ratios, discarded_bytes={f: plan[f] for f in order},
            checkpointed=tuple(order), predicted_peak_bytes=peak,
            no_ac_peak_bytes=self.no_ac_peak_bytes, recompute_ms=rct,
            solve_time_s=time.perf_counter() - t0, gap=gap, budget_bytes=budget,
            world_size=self.world_size, backend=self.options.backend,
            n_variables=self._prob.n_cols if self._prob is not None else 0,
            n_constraints=self._prob.n_rows if self._prob is not None else 0, solved_by=solved_by,
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
