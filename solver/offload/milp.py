"""Keep, recompute or offload: one MILP whose objective is the step time on the timeline.

    from estimators.contract.timeline import step_layout
    layout = step_layout(info, blocks, comm=unit_comm)        # planner.planning.solve builds this
    m = OffloadMilp(info, layout, copy_bytes_per_s=spec.host_copy_bytes_per_s,
                    copy_latency_s=spec.host_copy_latency_s)
    res = m.solve(budget_bytes)
    res.discarded_bytes      # {"GPT.blocks.3.mlp": 123456, ...}  recomputed, as SACMilp's
    res.offloaded_bytes      # {"GPT.blocks.0": 7890123, ...}    saved outputs sent to host
    res.timeline.step_ms, res.timeline.exposed_copy_ms

The maths, on top of the memory model of ``solver/sac_milp.py`` / ``solver/plan_cost.py`` (read that first)::

    c_k in {0,1}, 0 <= r_k <= c_k      candidate k is checkpointed, discarding r_k S_k (+ F_k c_k)
    0 <= o_b <= 1                      block b offloads o_b H_b bytes (H_b: its offloadable bytes)
    sum_{candidates on a root-to-leaf path} c <= 1            no nested checkpoints
    o_b + c_k <= 1  for k = b, inside b or above b
        a block that offloads recomputes nothing, so no recompute ever reads an offloaded
        tensor (SACOp has no inputs to check op by op)
    mem(p) = base_p - sum_k d_k [fw_post_k <= t < bw_pre_k] - sum_b o_b H_b [fw_post_b <= t < back_b]
             + recompute growth of k at its recompute point            <= peak <= budget
    sum_b o_b H_b <= host budget      (all offloaded bytes are on host when the forward ends)
    the timeline of ``estimators/contract/timeline.py`` as linear constraints:
        E_i >= E_{i-1} + compute_i + sum_{k recomputed in i} rct_k      (segment ends)
        E_i >= X_t + compute_i + ...                 for each transfer t segment i waits for
        X_t >= E_{release_t - 1} + dur_t,  X_t >= X_{previous on its stream} + dur_t,
        X_t >= X_{t.after} + dur_t
        dur_b >= a_s o_b + b_s  for each segment s of the convex copy curve of block b
            (offload_curve: per op, largest first, bytes / copy B/s + copy latency; exact at
            whole ops, below them in between)
        T >= E_last,  T >= X_t (transfers the step end waits for)
    minimise  T  (+ tie-breaks below 1e-6 of the step: fewer planned modules, less offload)

``back_b`` is the first backward op of the block that runs just before b in backward order (the
H2D copy is issued there; for the first block in backward order, its own). The minimal T of a
max-plus system is its longest path, so the objective is exactly the step time of
``estimators.contract.timeline.simulate`` for the same decisions (rct on the convex envelope of each
curve, as in SACMilp; each copy's time on the convex envelope of its curve). Practice rules:
only saved, non-view, non-empty outputs are offloadable, and small ones are priced out, not
ruled out: each copy pays the device's fixed ``host_copy_latency_s``, so where the copy stream
is the bottleneck many small copies lose to recompute; the last block in forward order never
offloads (its backward starts right after the forward: no window to hide a copy).

The plan is re-evaluated exactly: the peak with ``predict_offload_peak_bytes``, the step on the
timeline with each module's exact ``module_recompute_ms``.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from estimators.contract.module_info import lower_hull_segments
from solver.errors import InfeasibleBudgetError, SolverTimeoutError
from solver.graph import Graph
from solver.sac_milp import _candidates, _check_budget, _check_units, _safe, _solver_unit
from solver.plan_cost import (
    MemoryModel,
    check_world_size,
    fixed_discard_bytes,
    growth_table,
    module_recompute_ms,
)
from solver.offload.cost import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    offload_curve,
    offload_ops,
    offload_take,
    offloadable_bytes,
    point_bytes,
    predict_offload_peak_bytes,
)
from solver.options import SolverOptions, SolveStatus, run_backend

if TYPE_CHECKING:  # only types
    from estimators.contract.module_info import ModStats, ModuleInfo
    from estimators.contract.timeline import StepLayout, StepTimeline

__all__ = ["OffloadMilp", "OffloadResult", "offloadable_bytes", "offload_ops", "offload_take",
           "offload_curve", "predict_offload_peak_bytes", "DEFAULT_MIN_OFFLOAD_BYTES"]

logger = logging.getLogger(__name__)


def _new_var(prob: Any, name: str, low: float | None, up: float | None = None,
             cat: str = "Continuous") -> Any:
    """PuLP >= 3.3 attaches variables to the problem; older PuLP builds them directly."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    import pulp

    return pulp.LpVariable(name, low, up, cat)


_TIE = 1e-6


@dataclass(frozen=True, kw_only=True)
class OffloadResult:
    """A keep / recompute / offload plan and what the models predict for it."""

    status: SolveStatus
    discarded_bytes: Mapping[str, int]
    """Checkpointed module -> bytes its recompute discards (as ``SolveResult.discarded_bytes``)."""
    offloaded_bytes: Mapping[str, int]
    """Offloading block -> bytes of saved outputs sent to host."""
    predicted_peak_bytes: int
    """Exact memory model at these decisions (per rank), <= budget."""
    no_ac_peak_bytes: int
    host_peak_bytes: int
    """Bytes on host at the end of the forward (all offloaded bytes)."""
    recompute_ms: float
    timeline: StepTimeline
    """The step on the timeline (exact recompute curves)."""
    baseline_timeline: StepTimeline
    """The step with nothing planned."""
    solve_time_s: float
    gap: float | None
    budget_bytes: int
    world_size: int
    milp_step_ms: float | None = None
    """The MILP's objective (step time on the envelopes), before rounding."""
    from_incumbent: bool = False
    """The backend's plan was slower than (or missing beside) the recompute-only incumbent
    passed to ``solve``, which is returned instead."""

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return tuple(self.discarded_bytes)

    @property
    def step_ms(self) -> float:
        return self.timeline.step_ms


@dataclass
class _Block:
    fqn: str
    stats: ModStats
    offload_bytes: int
    back_op: int
    """Op index at which the H2D copy brings the bytes back."""


def _offload_blocks(layout: StepLayout, stats: Mapping[str, ModStats], min_bytes: int,
                    blocked: set[str]) -> list[_Block]:
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
        out.append(_Block(b, s, h, back))
    return out


class OffloadMilp:
    """The three-way MILP, built once, re-solvable for any budget (see the module docstring).

    ``offload=False`` builds the same model without offload variables: the recompute-only plan
    of least step time on the same timeline."""

    def __init__(
        self,
        info: ModuleInfo,
        layout: StepLayout,
        *,
        copy_bytes_per_s: float,
        copy_latency_s: float = 0.0,
        world_size: int = 1,
        host_budget_bytes: int | None = None,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        offload: bool = True,
        ac_units: Iterable[str] | None = None,
        fsdp_units: Iterable[str] | None = None,
        options: SolverOptions | None = None,
    ) -> None:
        t0 = time.perf_counter()
        check_world_size(world_size)
        if offload and not copy_bytes_per_s > 0:
            raise ValueError("offload needs a host link: the device's host_link_bytes_per_s is 0; "
                             "pass a DeviceSpec with one, or plan with offload=False")
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0 or None, got {host_budget_bytes}")
        self.info, self.layout = info, layout
        self.world_size = int(world_size)
        self.copy_bytes_per_s = float(copy_bytes_per_s)
        if not (math.isfinite(copy_latency_s) and copy_latency_s >= 0):
            raise ValueError(f"copy_latency_s must be finite and >= 0, got {copy_latency_s}")
        self.copy_latency_s = float(copy_latency_s)
        self.min_offload_bytes = int(min_offload_bytes)
        self.host_budget_bytes = host_budget_bytes
        self.options = options if options is not None else SolverOptions()
        self.graph = Graph.from_module_info(info)
        allowed = _check_units(ac_units, self.graph, "ac_units")
        fsdp = _check_units(fsdp_units, self.graph, "fsdp_units")
        self._memory = MemoryModel(info, self.world_size)
        self.no_ac_peak_bytes = self._memory.peak({})
        self._unit, _ = _solver_unit(self.no_ac_peak_bytes)
        self._cands = _candidates(self.graph, allowed, fsdp)
        blocked = {a.fqn for u in (fsdp or ()) for a in self.graph.ancestors(u)}
        stats = {s.fqn: s for s in info.mod_stats}
        self._blocks = _offload_blocks(layout, stats, min_offload_bytes, blocked) if offload else []
        self.baseline_timeline = layout.timeline()
        self._min_peak: int | None = None
        self._build()
        self.build_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ build
    def _u(self, nbytes: float) -> float:
        return nbytes / self._unit

    def _add(self, terms, sense, rhs, name):
        import pulp

        con = pulp.LpConstraint(pulp.LpAffineExpression(list(terms)), sense, name, rhs)
        self._prob.addConstraint(con)
        return con

    def _build(self) -> None:
        import pulp

        self._prob = pulp.LpProblem("offload_milp", pulp.LpMinimize)
        self._add_variables()
        self._add_nesting_constraints()
        self._add_memory_constraints()
        self._add_host_constraint()
        self._add_timeline_constraints()
        self._budget = self._add([(self._peak, 1.0)], pulp.LpConstraintLE,
                                 self._u(self.no_ac_peak_bytes), "budget")
        self._objective = self._make_objective()

    def _add_variables(self) -> None:
        import pulp

        p = self._prob
        self._c, self._r, self._rct, self._extra = [], [], [], {}
        for k, cand in enumerate(self._cands):
            tag = f"{cand.node.index}_{_safe(cand.node.fqn)}"
            c = _new_var(p, f"c{tag}", 0, 1, "Integer")
            r = _new_var(p, f"r{tag}", 0, 1)
            rct = _new_var(p, f"rct_ms{tag}", 0)
            self._c.append(c), self._r.append(r), self._rct.append(rct)
            self._add([(r, 1.0), (c, -1.0)], pulp.LpConstraintLE, 0.0, f"discard_if_ckpt_{k}")
            for s, (a, b) in enumerate(cand.segments):
                self._add([(rct, 1.0), (r, -a), (c, -b)], pulp.LpConstraintGE, 0.0, f"rct_seg{s}_{k}")
            growth = growth_table(cand.stats)
            if growth:
                size = cand.stats.sac_memory_bytes
                pts = [(x / size, self._u(g - x)) for x, g in zip(cand.stats.tradeoff.discarded_bytes, growth)]
                segs = lower_hull_segments(pts) or [(0.0, pts[0][1])]
                self._extra[k] = _new_var(p, f"rextra{tag}", None)
                for s, (a, b) in enumerate(segs):
                    self._add([(self._extra[k], 1.0), (r, -a), (c, -b)], pulp.LpConstraintGE, 0.0,
                              f"rgrowth_seg{s}_{k}")
        # o_j: fraction of block j's offloadable bytes sent to host; dur_j: one direction's copy
        # time, on the convex envelope of offload_curve (exact at whole ops).
        self._o, self._dur = [], []
        for j, blk in enumerate(self._blocks):
            o = _new_var(p, f"o{j}_{_safe(blk.fqn)}", 0, 1)
            dur = _new_var(p, f"copy_ms{j}_{_safe(blk.fqn)}", 0)
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

        index = {c.node.fqn: k for k, c in enumerate(self._cands)}
        chains = {k: [index[a.fqn] for a in self.graph.ancestors(c.node.fqn) if a.fqn in index]
                  for k, c in enumerate(self._cands)}
        inner = {a for anc in chains.values() for a in anc}
        for k, anc in chains.items():
            if anc and k not in inner:
                self._add([(self._c[j], 1.0) for j in [k, *anc]], pulp.LpConstraintLE, 1.0,
                          f"no_nesting_{k}")
        # Per offload block a mode m_b (1: it may recompute, 0: it may offload): branching on
        # it splits the search cleanly, where pairwise o_b + c_k <= 1 rows left HiGHS mixing.
        self._m = []
        for j, blk in enumerate(self._blocks):
            m = _new_var(self._prob, f"m{j}_{_safe(blk.fqn)}", 0, 1, "Integer")
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
        for k, cand in enumerate(self._cands):
            st = cand.stats
            terms = [(self._r[k], self._u(st.sac_memory_bytes))]
            fixed = self._u(fixed_discard_bytes(st))
            if fixed:
                terms.append((self._c[k], fixed))
            leave.append((st.fw_post_op, terms))
            if st.bw_pre_op != -1:
                back.append((st.bw_pre_op, terms))
        for j, blk in enumerate(self._blocks):
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
        index = {c.node.fqn: k for k, c in enumerate(self._cands)}
        groups: dict[tuple[int, int, int], tuple[int, int]] = {}
        for p, base in zip(self._memory.points, self._memory.base):
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
                st = self._cands[k].stats
                if k in self._extra:
                    fixed = self._u(fixed_discard_bytes(st))
                    terms += [(self._extra[k], -1.0)] + ([(self._c[k], fixed)] if fixed else [])
                elif st.recompute_transient_bytes:
                    terms.append((self._c[k], -self._u(st.recompute_transient_bytes)))
            name = f"mem_at_op_{t}" + (f"_recompute_{k}" if k >= 0 else "")
            self._add(terms, pulp.LpConstraintGE, self._u(base), name)

    def _add_host_constraint(self) -> None:
        import pulp

        if self.host_budget_bytes is None or not self._blocks:
            return
        terms = [(o, self._u(b.offload_bytes)) for o, b in zip(self._o, self._blocks)]
        self._add(terms, pulp.LpConstraintLE, self._u(self.host_budget_bytes), "host_budget")

    def _add_timeline_constraints(self) -> None:
        """The recurrences of ``estimators/contract/timeline.py``, one variable per segment end and per
        transfer end (ms)."""
        import pulp

        lay = self.layout
        n = len(lay.segments)
        rec: dict[int, list[Any]] = {}
        for k, cand in enumerate(self._cands):
            rec.setdefault(lay.segment_of_backward(cand.stats), []).append(self._rct[k])
        self._seg_end = [_new_var(self._prob, f"seg_end_{i}", 0) for i in range(n)]
        # Transfers: the collectives (fixed) and each block's D2H / H2D (duration linear in o).
        transfers = []  # (name, stream, release, needed_by, after, const_ms, [(var, coef)])
        for t in lay.comm:
            transfers.append((t.name, t.stream.value, t.release, t.needed_by, t.after, t.duration_ms, []))
        for j, blk in enumerate(self._blocks):
            dur = [(self._dur[j], 1.0)]
            transfers.append((f"d2h:{blk.fqn}", "d2h", lay.fw_segment[blk.fqn] + 1, None, None, 0.0, dur))
            transfers.append((f"h2d:{blk.fqn}", "h2d", lay.prefetch_segment[blk.fqn],
                              lay.bw_segment[blk.fqn], f"d2h:{blk.fqn}", 0.0, dur))
        ends = {name: _new_var(self._prob, f"x_{i}_{_safe(name)}", 0)
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
                          f"segment_{i}_waits_{_safe(name)}")
        self._step = _new_var(self._prob, "step_ms", 0)
        self._add([(self._step, 1.0), (self._seg_end[-1], -1.0)], pulp.LpConstraintGE, 0.0, "step_end")
        for name in tail:
            self._add([(self._step, 1.0), (ends[name], -1.0)], pulp.LpConstraintGE, 0.0,
                      f"step_end_waits_{_safe(name)}")

    def _make_objective(self) -> Any:
        import pulp

        scale = max(self.baseline_timeline.step_ms, 1e-9) * _TIE
        terms = [(self._step, 1.0)]
        n = max(1, len(self._c) + len(self._o))
        terms += [(v, scale / n) for v in self._c + self._o]
        return pulp.LpAffineExpression(terms)

    # ------------------------------------------------------------------ solve
    @property
    def n_offload_blocks(self) -> int:
        """Blocks that may offload (offloadable bytes, not the last, not under an FSDP unit)."""
        return len(self._blocks)

    @property
    def n_variables(self) -> int:
        return self._prob.numVariables()

    @property
    def n_constraints(self) -> int:
        return self._prob.numConstraints()

    def _set_budget(self, budget_units: float) -> None:
        self._budget.constant = -budget_units

    def _read(self) -> tuple[dict[str, int], dict[str, int]]:
        disc, off = {}, {}
        for k, cand in enumerate(self._cands):
            if round(self._c[k].varValue or 0.0) == 1:
                # Up, not to nearest: a byte short at a tight point is a re-solve.
                d = math.ceil(min(1.0, max(0.0, self._r[k].varValue or 0.0)) * cand.stats.sac_memory_bytes)
                if d > 0:
                    disc[cand.node.fqn] = d
        for j, blk in enumerate(self._blocks):
            h = math.ceil(min(1.0, max(0.0, self._o[j].varValue or 0.0)) * blk.offload_bytes)
            if h > 0:
                off[blk.fqn] = h
        return disc, off

    def _offload_windows(self, off: Mapping[str, int]) -> dict[str, tuple[int, int, int]]:
        blocks = {b.fqn: b for b in self._blocks}
        return {f: (h, blocks[f].stats.fw_post_op, blocks[f].back_op) for f, h in off.items()}

    def back_op(self, fqn: str) -> int:
        """Op index at which an offloading block's bytes are back on the device."""
        return next(b.back_op for b in self._blocks if b.fqn == fqn)

    def peak_bytes(self, discarded: Mapping[str, int], offloaded: Mapping[str, int]) -> int:
        """Exact peak of the memory model for a plan of this MILP's candidates."""
        return max(point_bytes(self._memory, discarded, self._offload_windows(offloaded)), default=0)

    def timeline(self, discarded: Mapping[str, int], offloaded: Mapping[str, int]) -> StepTimeline:
        """The step on the timeline with each module's exact recompute curve."""
        rec: dict[int, float] = {}
        for f, d in discarded.items():
            st = self.graph.node(f).stats
            seg = self.layout.segment_of_backward(st)
            rec[seg] = rec.get(seg, 0.0) + module_recompute_ms(st, d)
        stats = {b.fqn: b.stats for b in self._blocks}
        copies = {f: len(offload_take(stats[f], h, self.min_offload_bytes)[0]) * max(1, stats[f].n_calls)
                  for f, h in offloaded.items()}
        return self.layout.timeline(recompute_ms_by_segment=rec, offload_bytes=offloaded,
                                    copy_bytes_per_s=self.copy_bytes_per_s, offload_copies=copies,
                                    copy_latency_s=self.copy_latency_s)

    def solve(self, budget_bytes: int, *, incumbent: Mapping[str, int] | None = None,
              warm_start: bool = True, repair: bool = True) -> OffloadResult:
        """Least step time plan whose exact peak is <= ``budget_bytes`` (per rank).

        ``incumbent``: a recompute-only plan (``SolveResult.discarded_bytes`` of ``SACMilp``),
        returned instead when it is faster on the timeline than what the backend found within
        its time limit (it is a plan of this MILP too: no offload); with ``warm_start`` (HiGHS)
        the backend also starts its search from it. Where the backend's plan overshoots the
        budget once evaluated exactly, ``repair`` re-solves its fractions with its binary
        choices fixed (an LP); without it the whole MILP is re-solved for a tighter target.
        ``warm_start=False, repair=False`` is the solve as it was before either existed."""
        t0 = time.perf_counter()
        budget = _check_budget(budget_bytes)
        target = budget
        limit = self.options.time_limit_s
        fixed: list[tuple[Any, Any, Any]] = []  # (variable, low, up) to restore
        bound = None  # the first solve's dual bound (ms): a lower bound for the exact problem
        try:
            for _ in range(4):  # tighter targets where the backend's rounding overshoots
                self._set_budget(self._u(target))
                self._prob.setObjective(self._objective)
                # time_limit_s bounds the whole solve: a re-solve gets what the first left over.
                left = None if limit is None else max(0.1 * limit, limit - (time.perf_counter() - t0))
                start = self._start(incumbent) if incumbent is not None and warm_start and not fixed else None
                out = run_backend(self._prob, dataclasses.replace(self.options, time_limit_s=left),
                                  start=start)
                if not out.has_solution:
                    # At the floor the backend may call the budget infeasible within its
                    # tolerances where the incumbent, evaluated exactly, fits.
                    if incumbent is not None and self.peak_bytes(incumbent, {}) <= budget:
                        return self._incumbent(incumbent, budget, t0)
                    if out.infeasible and not fixed:
                        raise InfeasibleBudgetError(budget, self.min_reachable_peak_bytes(), self.world_size)
                    if fixed:
                        break
                    raise SolverTimeoutError(
                        f"no plan found within time_limit_s={self.options.time_limit_s}; raise "
                        "SolverOptions.time_limit_s or rel_gap")
                if bound is None and out.gap is not None and self._step.varValue is not None:
                    bound = self._step.varValue * (1.0 - out.gap)
                disc, off = self._read()
                peak = self.peak_bytes(disc, off)
                if peak <= budget:
                    gap, status = out.gap, SolveStatus.OPTIMAL if out.proven else SolveStatus.FEASIBLE
                    res = self._result(disc, off, peak, budget, status, gap, t0, self._step.varValue)
                    if fixed:  # repaired: proven only against the first solve's bound
                        gap = None if bound is None else max(0.0, 1.0 - bound / res.step_ms)
                        res = dataclasses.replace(res, status=SolveStatus.FEASIBLE, gap=gap)
                    if incumbent is not None:
                        alt = self._incumbent(incumbent, budget, t0)
                        if alt.step_ms < res.step_ms:
                            return alt
                    return res
                # The exact peak is above the budget (the recompute growth between breakpoints
                # of a curve lies above its envelope). Keep the backend's binary choices and
                # re-solve the fractions alone for a tighter target: an LP, fast, where a full
                # re-solve had only what the first left of the time limit.
                if repair and not fixed:
                    for v in self._c + self._m:
                        fixed.append((v, v.lowBound, v.upBound))
                        val = float(round(v.varValue or 0.0))
                        v.bounds(val, val)
                target -= peak - budget + 1024
        finally:
            for v, lo, up in fixed:
                v.bounds(lo, up)
        if incumbent is not None:
            return self._incumbent(incumbent, budget, t0)
        raise InfeasibleBudgetError(budget, self.min_reachable_peak_bytes(), self.world_size)

    def _start(self, disc: Mapping[str, int]) -> dict[str, float]:
        """The recompute-only plan ``disc`` as a start for the backend (its decisions; HiGHS
        solves for the rest): the search begins from a plan at least that fast, which prunes
        it and, at a time limit, leaves no worse a plan than the incumbent (measured on the
        70B step: at the smallest budget 4577 ms found in 4 s where the cold start had 4614)."""
        start: dict[str, float] = {}
        for k, cand in enumerate(self._cands):
            d, size = disc.get(cand.node.fqn, 0), cand.stats.sac_memory_bytes
            start[self._c[k].name] = 1.0 if cand.node.fqn in disc else 0.0
            start[self._r[k].name] = min(1.0, d / size) if size else 0.0
        for o, m in zip(self._o, self._m):
            start[o.name], start[m.name] = 0.0, 1.0
        return start

    def _incumbent(self, disc: Mapping[str, int], budget: int, t0: float) -> OffloadResult:
        peak = self.peak_bytes(disc, {})
        if peak > budget:
            raise ValueError(f"the incumbent plan's peak {peak} exceeds the budget {budget}")
        return self._result(dict(disc), {}, peak, budget, SolveStatus.FEASIBLE, None, t0, None,
                            from_incumbent=True)

    def min_reachable_peak_bytes(self) -> int:
        """Smallest peak any plan of this MILP reaches (host budget included)."""
        if self._min_peak is None:
            import pulp

            self._set_budget(self._u(self.no_ac_peak_bytes) + 1.0)
            self._prob.setObjective(pulp.LpAffineExpression([(self._peak, 1.0)]))
            out = run_backend(self._prob, self.options, rel_gap=0.0)
            if not out.has_solution:
                raise SolverTimeoutError("could not compute the smallest reachable peak within "
                                         f"time_limit_s={self.options.time_limit_s}")
            disc, off = self._read()
            self._min_peak = min(self.no_ac_peak_bytes, self.peak_bytes(disc, off))
        return self._min_peak

    def _result(self, disc, off, peak, budget, status, gap, t0, milp_step, *,
                from_incumbent: bool = False) -> OffloadResult:
        order = {n.fqn: n.index for n in self.graph}
        disc = dict(sorted(disc.items(), key=lambda kv: order[kv[0]]))
        off = dict(sorted(off.items(), key=lambda kv: order[kv[0]]))
        tl = self.timeline(disc, off)
        return OffloadResult(
            status=status, discarded_bytes=disc, offloaded_bytes=off, predicted_peak_bytes=peak,
            no_ac_peak_bytes=self.no_ac_peak_bytes, host_peak_bytes=sum(off.values()),
            recompute_ms=tl.recompute_ms, timeline=tl, baseline_timeline=self.baseline_timeline,
            solve_time_s=time.perf_counter() - t0, gap=gap, budget_bytes=budget,
            world_size=self.world_size, milp_step_ms=milp_step, from_incumbent=from_incumbent,
        )
