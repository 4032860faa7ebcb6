"""The keep / recompute / offload MILP as a PuLP problem (the maths: ``solver/offload/milp.py``).

    model = OffloadModel(cands, blocks, memory, graph, layout, copy_bytes_per_s=...,
                         copy_latency_s=..., min_offload_bytes=..., host_budget_bytes=None)
    outcome = model.solve(budget_bytes, options)
    discarded, offloaded = model.read()              # {fqn: bytes}, rounded up
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from estimators.contract.module_info import lower_hull_segments
from solver.candidates import Candidate, nesting, safe_name, solver_unit
from solver.milp.backend import BackendOutcome, run_pulp
from solver.offload.cost import offload_curve, offloadable_bytes
from solver.plan_cost import MemoryModel, fixed_discard_bytes, growth_hull_segments

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats
    from estimators.contract.timeline import StepLayout
    from solver.graph import Graph
    from solver.options import SolverOptions

__all__ = ["OffloadModel", "OffloadBlock", "offload_blocks"]

_TIE = 1e-6
"""Tie-break weight: all planned modules and offloads together cost at most this much of the
unplanned step (fewer planned modules, less offload, among plans of equal step time)."""


def _new_var(prob: Any, name: str, low: float | None, up: float | None = None,
             cat: str = "Continuous") -> Any:
    """PuLP >= 3.3 attaches variables to the problem; older PuLP builds them directly."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    import pulp

    return pulp.LpVariable(name, low, up, cat)


@dataclass
class OffloadBlock:
    """A block that may send its saved outputs to host."""

    fqn: str
    stats: ModStats
    offload_bytes: int
    back_op: int
    """Op index at which the H2D copy brings the bytes back."""


def offload_blocks(layout: StepLayout, stats: Mapping[str, ModStats], min_bytes: int,
                    blocked: set[str]) -> list[OffloadBlock]:
    """The blocks of ``layout`` that may offload: offloadable bytes, not wrapping an FSDP unit
    (``blocked``), a window to copy in, and not the last in forward order (its backward starts
    right after the forward: no time to hide a copy)."""
    order = list(layout.blocks)  # forward order
    out = []
    for i, b in enumerate(order[:-1]):  # the last block keeps its activations
        s = stats[b]
        h = offloadable_bytes(s, min_bytes)
        if h <= 0 or b in blocked or s.fw_post_op < 0 or s.bw_pre_op < 0:
            continue
        back = stats[order[i + 1]].bw_pre_op
        if back <= s.fw_post_op:
            continue
        out.append(OffloadBlock(b, s, h, back))
    return out


class OffloadModel:
    """The three-way MILP of ``cands`` and ``blocks``, built once; each solve sets the budget
    row's bound and the objective (the step time, or the peak)."""

    def __init__(self, cands: Sequence[Candidate], blocks: Sequence[OffloadBlock], memory: MemoryModel,
                 graph: Graph, layout: StepLayout, *, copy_bytes_per_s: float, copy_latency_s: float,
                 min_offload_bytes: int, host_budget_bytes: int | None) -> None:
        import pulp

        self.cands, self.blocks, self.memory, self.graph, self.layout = list(cands), list(blocks), memory, graph, layout
        self.copy_bytes_per_s, self.copy_latency_s = copy_bytes_per_s, copy_latency_s
        self.min_offload_bytes, self.host_budget_bytes = min_offload_bytes, host_budget_bytes
        self.no_ac_peak_bytes = memory.peak({})
        self._unit, _ = solver_unit(self.no_ac_peak_bytes)
        self.baseline_step_ms = layout.timeline().step_ms
        self._prob = pulp.LpProblem("offload_milp", pulp.LpMinimize)
        self._add_variables()
        self._add_nesting_constraints()
        self._add_memory_constraints()
        self._add_host_constraint()
        self._add_timeline_constraints()
        self._budget = self._add([(self._peak, 1.0)], pulp.LpConstraintLE,
                                 self._u(self.no_ac_peak_bytes), "budget")
        self._objective = self._make_objective()
        self._fixed: list[tuple[Any, Any, Any]] = []

    def _u(self, nbytes: float) -> float:
        return nbytes / self._unit

    def _add(self, terms, sense, rhs, name):
        import pulp

        con = pulp.LpConstraint(pulp.LpAffineExpression(list(terms)), sense, name, rhs)
        self._prob.addConstraint(con)
        return con

    def _add_variables(self) -> None:
        import pulp

        p = self._prob
        self._c, self._r, self._rct, self._extra = [], [], [], {}
        for k, cand in enumerate(self.cands):
            tag = f"{cand.node.index}_{safe_name(cand.fqn)}"
            c = _new_var(p, f"c{tag}", 0, 1, "Integer")
            r = _new_var(p, f"r{tag}", 0, 1)
            rct = _new_var(p, f"rct_ms{tag}", 0)
            self._c.append(c), self._r.append(r), self._rct.append(rct)
            self._add([(r, 1.0), (c, -1.0)], pulp.LpConstraintLE, 0.0, f"discard_if_ckpt_{k}")
            for s, (a, b) in enumerate(cand.segments):
                self._add([(rct, 1.0), (r, -a), (c, -b)], pulp.LpConstraintGE, 0.0, f"rct_seg{s}_{k}")
            segs = growth_hull_segments(cand.stats, self._unit)
            if segs:
                self._extra[k] = _new_var(p, f"rextra{tag}", None)
                for s, (a, b) in enumerate(segs):
                    self._add([(self._extra[k], 1.0), (r, -a), (c, -b)], pulp.LpConstraintGE, 0.0,
                              f"rgrowth_seg{s}_{k}")
        # o_j: fraction of block j's offloadable bytes sent to host; dur_j: one direction's copy
        # time, on the convex envelope of offload_curve (exact at whole ops).
        self._o, self._dur = [], []
        for j, blk in enumerate(self.blocks):
            o = _new_var(p, f"o{j}_{safe_name(blk.fqn)}", 0, 1)
            dur = _new_var(p, f"copy_ms{j}_{safe_name(blk.fqn)}", 0)
            self._o.append(o), self._dur.append(dur)
            pts = offload_curve(blk.stats, self.copy_bytes_per_s, self.copy_latency_s,
                                self.min_offload_bytes)
            h = pts[-1][0]
            for s, (a, b) in enumerate(lower_hull_segments([(x / h, t) for x, t in pts])):
                self._add([(dur, 1.0), (o, -a)], pulp.LpConstraintGE, b, f"copy_seg{s}_{j}")
        self._peak = _new_var(p, "peak", 0)

    def _add_nesting_constraints(self) -> None:
        """No nested checkpoints (one clique per maximal chain, as SACMilp), and a block that
        offloads recomputes nothing in it: o_b + c_k <= 1 for every candidate k in b or above
        it (no binary for offloading: these rows are all it would be used for)."""
        import pulp

        index = {c.fqn: k for k, c in enumerate(self.cands)}
        above, _ = nesting(self.graph, self.cands)
        inner = {a for anc in above for a in anc}
        for k, anc in enumerate(above):
            if anc and k not in inner:
                self._add([(self._c[j], 1.0) for j in [k, *anc]], pulp.LpConstraintLE, 1.0,
                          f"no_nesting_{k}")
        # Per offload block a mode m_b (1: it may recompute, 0: it may offload): branching on
        # it splits the search cleanly, where pairwise o_b + c_k <= 1 rows left HiGHS mixing.
        self._m = []
        for j, blk in enumerate(self.blocks):
            m = _new_var(self._prob, f"m{j}_{safe_name(blk.fqn)}", 0, 1, "Integer")
            self._m.append(m)
            self._add([(self._o[j], 1.0), (m, 1.0)], pulp.LpConstraintLE, 1.0, f"offload_mode_{j}")
            near = {index[a.fqn] for a in self.graph.ancestors(blk.fqn) if a.fqn in index}
            near |= {index[d.fqn] for d in self.graph.descendants(blk.fqn) if d.fqn in index}
            near |= {index[blk.fqn]} if blk.fqn in index else set()
            for k in sorted(near):
                self._add([(self._c[k], 1.0), (m, -1.0)], pulp.LpConstraintLE, 0.0,
                          f"recompute_mode_{j}_{k}")

    def _events(self) -> tuple[list[tuple[int, list]], list[tuple[int, list]]]:
        """(op index, terms) of memory leaving (fw_post) and coming back (bw_pre / back_op)."""
        leave, back = [], []
        for k, cand in enumerate(self.cands):
            st = cand.stats
            terms = [(self._r[k], self._u(st.sac_memory_bytes))]
            fixed = self._u(fixed_discard_bytes(st))
            if fixed:
                terms.append((self._c[k], fixed))
            leave.append((st.fw_post_op, terms))
            if st.bw_pre_op != -1:
                back.append((st.bw_pre_op, terms))
        for j, blk in enumerate(self.blocks):
            terms = [(self._o[j], self._u(blk.offload_bytes))]
            leave.append((blk.stats.fw_post_op, terms))
            back.append((blk.back_op, terms))
        return sorted(leave, key=lambda e: e[0]), sorted(back, key=lambda e: e[0])

    def _cum(self, events, what: str) -> tuple[list[int], list[Any]]:
        import pulp

        keys, cums = [], []
        for i, (t, terms) in enumerate(events):
            v = _new_var(self._prob, f"cum_{what}_{i + 1}", None)
            row = [(v, 1.0)] + [(x, -a) for x, a in terms] + ([(cums[-1], -1.0)] if cums else [])
            self._add(row, pulp.LpConstraintEQ, 0.0, f"cum_{what}_{i + 1}")
            keys.append(t)
            cums.append(v)
        return keys, cums

    def _add_memory_constraints(self) -> None:
        import pulp

        leave, back = self._events()
        lk, lc = self._cum(leave, "leave")
        bk, bc = self._cum(back, "back")
        index = {c.fqn: k for k, c in enumerate(self.cands)}
        groups: dict[tuple[int, int, int], tuple[int, int]] = {}
        for p, base in zip(self.memory.points, self.memory.base):
            t = p.op_index
            k = index.get(p.recompute_of, -1) if p.recompute_of is not None else -1
            key = (bisect.bisect_right(lk, t), bisect.bisect_right(bk, t), k)
            if key not in groups or base > groups[key][0]:
                groups[key] = (base, t)
        for (a, b, k), (base, t) in groups.items():
            terms = [(self._peak, 1.0)]
            if a:
                terms.append((lc[a - 1], 1.0))
            if b:
                terms.append((bc[b - 1], -1.0))
            if k >= 0:
                st = self.cands[k].stats
                if k in self._extra:
                    fixed = self._u(fixed_discard_bytes(st))
                    terms += [(self._extra[k], -1.0)] + ([(self._c[k], fixed)] if fixed else [])
                elif st.recompute_transient_bytes:
                    terms.append((self._c[k], -self._u(st.recompute_transient_bytes)))
            name = f"mem_at_op_{t}" + (f"_recompute_{k}" if k >= 0 else "")
            self._add(terms, pulp.LpConstraintGE, self._u(base), name)

    def _add_host_constraint(self) -> None:
        import pulp

        if self.host_budget_bytes is None or not self.blocks:
            return
        terms = [(o, self._u(b.offload_bytes)) for o, b in zip(self._o, self.blocks)]
        self._add(terms, pulp.LpConstraintLE, self._u(self.host_budget_bytes), "host_budget")

    def _add_timeline_constraints(self) -> None:
        """The recurrences of ``estimators/contract/timeline.py``, one variable per segment end and per
        transfer end (ms)."""
        import pulp

        lay = self.layout
        n = len(lay.segments)
        rec: dict[int, list[Any]] = {}
        for k, cand in enumerate(self.cands):
            rec.setdefault(lay.segment_of_backward(cand.stats), []).append(self._rct[k])
        self._seg_end = [_new_var(self._prob, f"seg_end_{i}", 0) for i in range(n)]
        # Transfers: the collectives (fixed) and each block's D2H / H2D (duration linear in o).
        transfers = []  # (name, stream, release, needed_by, after, const_ms, [(var, coef)])
        for t in lay.comm:
            transfers.append((t.name, t.stream.value, t.release, t.needed_by, t.after, t.duration_ms, []))
        for j, blk in enumerate(self.blocks):
            dur = [(self._dur[j], 1.0)]
            transfers.append((f"d2h:{blk.fqn}", "d2h", lay.fw_segment[blk.fqn] + 1, None, None, 0.0, dur))
            transfers.append((f"h2d:{blk.fqn}", "h2d", lay.prefetch_segment[blk.fqn],
                              lay.bw_segment[blk.fqn], f"d2h:{blk.fqn}", 0.0, dur))
        ends = {name: _new_var(self._prob, f"x_{i}_{safe_name(name)}", 0)
                for i, (name, *_rest) in enumerate(transfers)}
        last_on: dict[str, str] = {}
        waits: dict[int, list[str]] = {}
        tail: list[str] = []
        for i, (name, stream, rel, need, after, const, dur) in sorted(
                enumerate(transfers), key=lambda e: (e[1][2], e[0])):  # FIFO issue order
            x = ends[name]
            body = [(x, 1.0)] + [(v, -a) for v, a in dur]
            ready = [(self._seg_end[rel - 1], -1.0)] if rel > 0 else []
            self._add(body + ready, pulp.LpConstraintGE, const, f"issue_{i}")
            for dep, what in ((last_on.get(stream), "fifo"), (after, "after")):
                if dep is not None:
                    self._add(body + [(ends[dep], -1.0)], pulp.LpConstraintGE, const, f"{what}_{i}")
            last_on[stream] = name
            (waits.setdefault(need, []) if need is not None else tail).append(name)
        for i, seg in enumerate(lay.segments):
            body = [(self._seg_end[i], 1.0)] + [(v, -1.0) for v in rec.get(i, [])]
            self._add(body + ([(self._seg_end[i - 1], -1.0)] if i else []), pulp.LpConstraintGE,
                      seg.compute_ms, f"segment_{i}")
            for name in waits.get(i, []):
                self._add(body + [(ends[name], -1.0)], pulp.LpConstraintGE, seg.compute_ms,
                          f"segment_{i}_waits_{safe_name(name)}")
        self._step = _new_var(self._prob, "step_ms", 0)
        self._add([(self._step, 1.0), (self._seg_end[-1], -1.0)], pulp.LpConstraintGE, 0.0, "step_end")
        for name in tail:
            self._add([(self._step, 1.0), (ends[name], -1.0)], pulp.LpConstraintGE, 0.0,
                      f"step_end_waits_{safe_name(name)}")

    def _make_objective(self) -> Any:
        import pulp

        scale = max(self.baseline_step_ms, 1e-9) * _TIE
        terms = [(self._step, 1.0)]
        n = max(1, len(self._c) + len(self._o))
        terms += [(v, scale / n) for v in self._c + self._o]
        return pulp.LpAffineExpression(terms)

    # ------------------------------------------------------------------ solve
    @property
    def n_variables(self) -> int:
        return self._prob.numVariables()

    @property
    def n_constraints(self) -> int:
        return self._prob.numConstraints()

    @property
    def step_ms(self) -> float | None:
        """The step time (ms) of the last solution, on the envelopes; None without one."""
        return self._step.varValue

    def solve(self, budget_bytes: float, options: SolverOptions, *,
              start: Mapping[str, int] | None = None) -> BackendOutcome:
        """The least step time whose modelled peak is at most ``budget_bytes``; ``start``: a
        recompute-only plan the backend starts its search from."""
        self._budget.constant = -self._u(budget_bytes)
        self._prob.setObjective(self._objective)
        return run_pulp(self._prob, options, start=self._start(start) if start is not None else None)

    def solve_min_peak(self, options: SolverOptions) -> BackendOutcome:
        """The least modelled peak, proven exactly (rel_gap 0)."""
        import pulp

        self._budget.constant = -(self._u(self.no_ac_peak_bytes) + 1.0)  # not binding
        self._prob.setObjective(pulp.LpAffineExpression([(self._peak, 1.0)]))
        return run_pulp(self._prob, options, rel_gap=0.0)

    def fix_binaries(self) -> None:
        """Hold every binary at its value in the last solution: later solves re-solve the
        fractions alone (an LP), until ``release_binaries``."""
        for v in self._c + self._m:
            self._fixed.append((v, v.lowBound, v.upBound))
            val = float(round(v.varValue or 0.0))
            v.bounds(val, val)

    def release_binaries(self) -> None:
        for v, lo, up in self._fixed:
            v.bounds(lo, up)
        self._fixed = []

    @property
    def binaries_fixed(self) -> bool:
        return bool(self._fixed)

    def read(self) -> tuple[dict[str, int], dict[str, int]]:
        """The last solution's plan: ({checkpointed fqn: discarded bytes}, {block: offloaded
        bytes}), rounded up (a byte short at a tight point is a re-solve)."""
        disc, off = {}, {}
        for k, cand in enumerate(self.cands):
            if round(self._c[k].varValue or 0.0) == 1:
                # Up, not to nearest: a byte short at a tight point is a re-solve.
                d = math.ceil(min(1.0, max(0.0, self._r[k].varValue or 0.0)) * cand.stats.sac_memory_bytes)
                if d > 0:
                    disc[cand.fqn] = d
        for j, blk in enumerate(self.blocks):
            h = math.ceil(min(1.0, max(0.0, self._o[j].varValue or 0.0)) * blk.offload_bytes)
            if h > 0:
                off[blk.fqn] = h
        return disc, off

    def _start(self, disc: Mapping[str, int]) -> dict[str, float]:
        """The recompute-only plan ``disc`` as a start for the backend (its decisions; HiGHS
        solves for the rest): the search begins from a plan at least that fast, which prunes
        it and, at a time limit, leaves no worse a plan than the incumbent."""
        start: dict[str, float] = {}
        for k, cand in enumerate(self.cands):
            d, size = disc.get(cand.fqn, 0), cand.stats.sac_memory_bytes
            start[self._c[k].name] = 1.0 if cand.fqn in disc else 0.0
            start[self._r[k].name] = min(1.0, d / size) if size else 0.0
        for o, m in zip(self._o, self._m):
            start[o.name], start[m.name] = 0.0, 1.0
        return start
