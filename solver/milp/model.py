"""The module-level MILP written for a backend: per-candidate discard ratios that fit a memory
budget at the least recompute time, as rows of a ``LinearModel``.

    model = SacModel(cands, memory, graph, n_modules=len(graph))
    sol = model.solve(budget_bytes, options)        # recompute objective, budget row at budget
    plan = model.read_plan(sol.values)              # {candidate index: discarded bytes (float)}

The maths (memory in solver units: GiB, or KiB / MiB for models under 1 GiB, converted once by
``solver.candidates.solver_unit``)::

    y_i in {0,1}          module i is checkpointed
    0 <= r_i <= y_i       fraction of sac_memory_bytes_i discarded
    d_i = S_i r_i + (F_i - R_i) y_i                    discarded memory, net of held inputs
    sum_{i on a root-to-leaf path} y_i <= 1            no nested checkpoints
    mem(p) = base_p - sum_j d_j [fw_post_j <= t_p < bw_pre_j] + extra_j [p recomputes j]
             + sum_j R_j y_j [bw_pre_j <= t_p <= bw_post_j, p not j's recompute point]
             - sum_g n_g(p) D_g <= peak
    D_g = sum_{j under g} d_j       a pipeline stage g's discard per micro-batch in flight
    peak <= budget
    rct_i >= a_s r_i + b_s y_i  for each segment s of i's cost envelope
    extra_i >= g_s r_i + h_s y_i  the lower hull of the recompute's memory change
    minimise  sum_i rct_i  (+ the tie-break of ``solver.candidates.tie_break_ms``)

``base_p = ceil((param + grad + optimizer) / world_size) + activation + other`` of MemoryPoint p;
``F_i`` the forced discards, ``R_i = checkpoint_retain_bytes``: the inputs i's checkpoint holds
stay alive through i's own backward, where the unplanned step had freed them. The window sum is
written with prefix sums over the candidates sorted by ``fw_post_op`` and by ``bw_pre_op``
(``cum_fw_k = cum_fw_{k-1} + d_{j_k}``), so the model is linear in candidates + points; points
that read the same prefixes and terms share one row (the highest base).

Pipeline schedules (``MemoryPoint.in_flight``): at a point where n_g more micro-batches of stage
g are in flight, each holds its activations less what the plan discards under g's root, the
same plan for every micro-batch: one free column D_g per stage (an equality row) and one term
per memory row. ``MemoryPoint.recompute_in_window``: a module recomputes while its discard still
holds (a split backward's input half), so the change there is the recompute's growth alone.

The values a backend returns are rounded by its tolerances: ``read_plan`` gives bytes on the
curves, which ``SACMilp`` settles in exact integers (``solver/rounding.py``).
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np

from solver.candidates import Candidate, nesting, safe_name, solver_unit, tie_break_ms
from solver.graph import is_submodule
from solver.milp.linear_model import EQ, GE, LE, LinearModel, LpSolution
from solver.plan_cost import MemoryModel, fixed_discard_bytes, growth_hull_segments

if TYPE_CHECKING:
    from solver.graph import Graph
    from solver.options import SolverOptions

__all__ = ["SacModel"]

logger = logging.getLogger(__name__)

_R_NOISE = 1e-9
"""A discard ratio this close to 0 or to y is that bound: backend noise, not a plan."""


class SacModel:
    """The MILP of ``cands`` against ``memory``, built once; each solve sets the budget row's
    bound and the objective (the recompute time, or the peak)."""

    def __init__(self, cands: Sequence[Candidate], memory: MemoryModel, graph: Graph, *,
                 n_modules: int) -> None:
        self.cands = list(cands)
        self.memory = memory
        self.graph = graph
        self.unit, self.unit_name = solver_unit(memory.peak({}))
        self.lp = LinearModel("sac_milp")
        self._add_variables()
        self._add_ratio_constraints()
        self._add_nesting_constraints()
        self._add_recompute_constraints()
        self._add_recompute_growth()
        self._add_memory_constraints()
        self._budget = self.lp.add_row([(self.peak, 1.0)], LE, self._units(memory.peak({})), "budget")
        tie_y, tie_r = tie_break_ms(self.cands, n_modules)
        self.recompute_objective = [(v, 1.0) for v in self.rct]
        for k in range(len(self.cands)):
            self.recompute_objective += [(self.y[k], tie_y[k]), (self.r[k], tie_r[k])]
        """The objective: recompute ms on the envelopes plus the tie-break, as (column, cost)."""

    @property
    def n_variables(self) -> int:
        return self.lp.n_cols

    @property
    def n_constraints(self) -> int:
        return self.lp.n_rows

    # ------------------------------------------------------------------ build
    def _units(self, nbytes: float) -> float:
        return nbytes / self.unit

    def _tag(self, k: int) -> str:
        c = self.cands[k]
        return f"{c.node.index}_{safe_name(c.fqn)}"

    def _add_variables(self) -> None:
        lp, n = self.lp, len(self.cands)
        self.y = [lp.add_var(f"y{self._tag(k)}", 0, 1, integer=True) for k in range(n)]
        """Column of each candidate's checkpoint choice (binary)."""
        self.r = [lp.add_var(f"r{self._tag(k)}", 0, 1) for k in range(n)]
        """Column of each candidate's discard ratio."""
        self.peak = lp.add_var(f"peak_{self.unit_name}", 0)
        # Prefix sums of discarded units in fw_post_op order and in bw_pre_op order.
        self._fw_order = sorted(range(n), key=lambda k: (self.cands[k].stats.fw_post_op, k))
        self._bw_order = sorted(
            (k for k in range(n) if self.cands[k].stats.bw_pre_op != -1),
            key=lambda k: (self.cands[k].stats.bw_pre_op, k),
        )
        # Free: a checkpoint that holds more inputs than it discards makes a prefix negative.
        self._cum_fw = [lp.add_var(f"cum_fw_{i + 1}", None) for i in range(len(self._fw_order))]
        self._cum_bw = [lp.add_var(f"cum_bw_{i + 1}", None) for i in range(len(self._bw_order))]

    def _add_ratio_constraints(self) -> None:
        for k in range(len(self.cands)):
            self.lp.add_row([(self.r[k], 1.0), (self.y[k], -1.0)], LE, 0.0,
                            f"discard_only_if_checkpointed_{k}")

    def _add_nesting_constraints(self) -> None:
        """One clique per maximal chain of candidates: tighter than pairwise y_i + y_j <= 1."""
        above, _ = nesting(self.graph, self.cands)
        inner = {a for anc in above for a in anc}
        for k, anc in enumerate(above):
            if anc and k not in inner:
                self.lp.add_row([(self.y[j], 1.0) for j in [k, *anc]], LE, 1.0, f"no_nesting_{k}")

    def _add_recompute_constraints(self) -> None:
        """rct_k >= a_s r_k + b_s y_k per segment of the envelope (its perspective): as fast to
        prove as any other form of the same envelope tried (a convex combination of vertices
        gave the same bound and slower proofs)."""
        self.rct = []
        """Column of each candidate's recompute ms."""
        for k, c in enumerate(self.cands):
            self.rct.append(self.lp.add_var(f"rct_ms{self._tag(k)}", 0))
            for s, (a, b) in enumerate(c.segments):
                self.lp.add_row([(self.rct[k], 1.0), (self.r[k], -a), (self.y[k], -b)],
                                GE, 0.0, f"recompute_seg{s}_{k}")

    def _add_recompute_growth(self) -> None:
        """extra_k >= a_s r_k + b_s y_k: the lower convex hull of the recompute's memory change
        (growth - discarded) at the curve's breakpoints; exact at every breakpoint where that
        change is convex in r (the exact evaluation of the plan catches the rest)."""
        self._extra: dict[int, int] = {}
        for k, c in enumerate(self.cands):
            segs = growth_hull_segments(c.stats, self.unit)
            if not segs:
                continue
            self._extra[k] = self.lp.add_var(f"recompute_extra{self._tag(k)}", None)
            for sidx, (a, b) in enumerate(segs):
                self.lp.add_row([(self._extra[k], 1.0), (self.r[k], -a), (self.y[k], -b)],
                                GE, 0.0, f"recompute_growth_seg{sidx}_{k}")

    def _recompute_terms(self, k: int) -> list[tuple[int, float]]:
        """Minus the memory change at candidate k's recompute point, as (column, coef) terms."""
        st = self.cands[k].stats
        if k in self._extra:
            fixed = self._units(fixed_discard_bytes(st))
            return [(self._extra[k], -1.0)] + ([(self.y[k], fixed)] if fixed else [])
        t = self._units(st.recompute_transient_bytes)
        return [(self.y[k], -t)] if t else []

    def _add_memory_constraints(self) -> None:
        for cum, order, what in ((self._cum_fw, self._fw_order, "fw"), (self._cum_bw, self._bw_order, "bw")):
            for i, k in enumerate(order):
                st = self.cands[k].stats
                size, fixed = self._units(st.sac_memory_bytes), self._units(fixed_discard_bytes(st))
                # cum_i = cum_{i-1} + r_k S_k + (F_k - R_k) y_k: discards, the forced ones
                # included, net of the inputs a checkpoint holds.
                terms = [(cum[i], 1.0), (self.r[k], -size)] + ([(cum[i - 1], -1.0)] if i else [])
                if fixed:
                    terms.append((self.y[k], -fixed))
                self.lp.add_row(terms, EQ, 0.0, f"cum_{what}_{i + 1}")
        stage_discard = self._add_stage_discards()
        for (a, b, k, held, in_flight, kw), (base, t) in self._point_groups().items():
            terms = [(self.peak, 1.0)]
            for h in held:  # inputs held through the backward of checkpointed candidate h
                terms.append((self.y[h], -self._units(self.cands[h].stats.checkpoint_retain_bytes)))
            if a:
                terms.append((self._cum_fw[a - 1], 1.0))
            if b:
                terms.append((self._cum_bw[b - 1], -1.0))
            if k >= 0:
                terms += self._recompute_terms(k)
            if kw >= 0:  # recompute while the discard holds: growth on top of it
                terms += self._recompute_terms(kw) + [
                    (self.r[kw], -self._units(self.cands[kw].stats.sac_memory_bytes)),
                    (self.y[kw], -self._units(fixed_discard_bytes(self.cands[kw].stats)))]
            terms += [(stage_discard[g], float(n)) for g, n in in_flight if g in stage_discard]
            # (a, b) follow from t, so t plus the recomputed candidate names the point uniquely.
            name = (f"mem_at_op_{t}" + (f"_recompute_{k}" if k >= 0 else "") + (f"_held{held[0]}" if held else "")
                    + (f"_recompute_in_window_{kw}" if kw >= 0 else "")
                    + "".join(f"_in_flight_{safe_name(g)}_x{n}" for g, n in in_flight))
            self.lp.add_row(terms, GE, self._units(base), name)

    def _add_stage_discards(self) -> dict[str, int]:
        """Pipeline schedules: per stage root g, a column D_g = sum of S r + (F - R) y over its
        candidates, what each of its micro-batches in flight no longer holds (one equality row)."""
        out = {}
        for g in self.memory.in_flight_roots:
            v = self.lp.add_var(f"stage_discard_{safe_name(g)}", None)
            terms = [(v, 1.0)]
            for k, c in enumerate(self.cands):
                if c.fqn == g or is_submodule(c.fqn, g):
                    st = c.stats
                    terms += [(self.r[k], -self._units(st.sac_memory_bytes)),
                              (self.y[k], -self._units(fixed_discard_bytes(st)))]
            self.lp.add_row(terms, EQ, 0.0, f"stage_discard_{safe_name(g)}")
            out[g] = v
        return out

    def _point_groups(self) -> dict[tuple, tuple[int, int]]:
        """Points keyed by (#fw_post <= t, #bw_pre <= t, recomputed candidate, candidates whose
        held inputs are alive at t, micro-batches in flight, candidate recomputing inside its
        window): max base each."""
        fw_keys = [self.cands[k].stats.fw_post_op for k in self._fw_order]
        bw_keys = [self.cands[k].stats.bw_pre_op for k in self._bw_order]
        index = {c.fqn: k for k, c in enumerate(self.cands)}
        held: dict[int, list[int]] = {}
        for k, c in enumerate(self.cands):
            for i in self.memory.held_points(c.fqn):
                held.setdefault(i, []).append(k)
        groups: dict[tuple, tuple[int, int]] = {}
        for i, (p, base) in enumerate(zip(self.memory.points, self.memory.base)):
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

    # ------------------------------------------------------------------ solve
    def set_budget(self, budget_bytes: float) -> None:
        """The budget row's bound and the recompute objective: the model ``solve`` runs."""
        self.lp.set_row_upper(self._budget, self._units(budget_bytes))
        self.lp.set_cost(self.recompute_objective)

    def solve(self, budget_bytes: float, options: SolverOptions) -> LpSolution:
        """The least-recompute plan whose modelled peak is at most ``budget_bytes``."""
        self.set_budget(budget_bytes)
        return self.lp.solve(options)

    def solve_min_peak(self, options: SolverOptions) -> LpSolution:
        """The least modelled peak, proven exactly (rel_gap 0); checkpointing nothing is a plan,
        so an "infeasible" verdict is the backend's error (see ``LinearModel.solve``)."""
        self.lp.set_row_upper(self._budget, self._units(self.memory.peak({})) + 1.0)  # not binding
        self.lp.set_cost([(self.peak, 1.0)])
        return self.lp.solve(options, rel_gap=0.0, feasible=True)

    def write(self, budget_bytes: float, options: SolverOptions) -> None:
        """The model at ``budget_bytes`` in LP format at ``options.write_lp_path``."""
        self.set_budget(budget_bytes)
        self.lp.write(options)

    def read_plan(self, values: np.ndarray) -> dict[int, float]:
        """{candidate index: bytes discarded on its curve} of the checkpointed candidates."""
        out = {}
        for k, c in enumerate(self.cands):
            if round(float(values[self.y[k]])) == 1:
                out[k] = min(1.0, max(0.0, float(values[self.r[k]]))) * c.stats.sac_memory_bytes
        return out

    def objective_of(self, values: np.ndarray) -> float:
        """The recompute objective of the plan in ``values`` (a backend solution): y rounded, r
        clipped to [0, y] with backend noise under ``_R_NOISE`` dropped, and each rct at its
        envelope. The backend's own value may carry slack its tolerances allow in the rct
        columns (a column above its envelope by 1e-6 ms), which two proofs of one plan need not
        share."""
        v = np.array(values, dtype=np.float64)
        for k, c in enumerate(self.cands):
            y = 1.0 if v[self.y[k]] >= 0.5 else 0.0
            r = min(max(float(v[self.r[k]]), 0.0), y)
            r = 0.0 if r < _R_NOISE else (y if y - r < _R_NOISE else r)
            v[self.y[k]], v[self.r[k]] = y, r
            v[self.rct[k]] = max([0.0] + [a * r + b * y for a, b in c.segments])
        cost = np.zeros(self.lp.n_cols)
        for j, w in self.recompute_objective:
            cost[j] += w
        return float(cost @ v)
