"""The module-level MILP solved exactly by dynamic programming, where the step is a clean nest.

Why
---
In a step whose backward visits modules in the reverse order of their forward ends (every stack
of blocks, every tree the benchmarks draw, most traces), the modules whose discards are gone at a
memory point are always a *prefix* of the candidates sorted by ``fw_post_op``: in the forward,
those that have finished; in the backward, those whose backward has not begun. Every memory row
of the MILP then reads ``C_a >= need`` with ``C_a`` the bytes discarded by the first ``a``
candidates. Sorted that way (a post-order of the module tree), a candidate's checkpointable
descendants are the block of candidates just before it. So the MILP is a chain:

    G_a(C)  = least cost over the first a candidates discarding at least C bytes, every memory
              row of prefixes <= a met;
    G_i+1   = trunc_N(i+1)( min( G_i ,                                   candidate i not planned
                                 trunc_Q(i)(Gpre_s(i)) [+] f_i ) )       i planned, its block not

``trunc_N`` (``x -> G(max(x, N))``) holds a row's need ``N``; ``[+]`` is the infimal convolution
with i's cost (the lower hull of its curve plus the tie-break: the MILP's own objective), shifted
by its forced discards; ``s(i)`` is where i's block starts and ``Q(i)`` the needs of the rows
inside it with i planned: its recompute point with its recompute term, the points where the
inputs its checkpoint holds are alive. The functions are piecewise linear (``solver/exact/pwl.py``) and
computed exactly; the plan is read back from the stored functions.

It shares nothing with the backend, so the two check each other: on small stacks of blocks at
their smallest peak HiGHS' tolerances have decided plans dearer than the optimum this finds
(``tests/solver/exact/test_prefix_dp.py``).

Exact, and small. The value functions are lower envelopes of one convex piece per useful
combination of choices. Counted as computed they look exponential, but nearly all their points
are collinear but for rounding, which a slope test cannot see between points a fraction of a
byte apart (``solver.exact.pwl.simplified`` drops a point within a few ulps of its neighbours'
line); what is left stays in the hundreds of breakpoints (a test guards it). Where they still
outgrow the work cap, ``solve(rel_tol=)`` holds each function from below within ``rel_tol`` of
its value (``solver.exact.pwl.under_within``): every value stays a lower bound on the plans it
stands for, the plan read back is a plan of the MILP, and the distance between its cost and the
bound is the proof. Stacks of nearly identical blocks keep many distinct near-ties, which count
branching proves faster, so ``SACMilp`` gives big stacks of numbered blocks to it first.

Whether a budget has a plan depends only on the functions' domains, so ``min_budget`` finds the
smallest reachable peak by a scalar pass and bisection, to the byte.

When
----
``PrefixDP.build`` checks the structure on the data (each point's discards a prefix, each
candidate's descendants the block before it, each conditional row inside its candidate's block)
and says why not otherwise. A recompute growth that varies with the ratio
(``recompute_growth_bytes``) is handled by two runs: with its least value (a relaxation: a lower
bound) and with its greatest (a plan of the MILP); the first plan is taken where it meets the
real rows, else the second with the first's value as its bound.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from estimators.contract.module_info import lower_hull
from solver.plan_cost import fixed_discard_bytes, growth_hull_segments, module_recompute_ms
from solver.exact.pwl import Pwl, envelope, infconv_convex, point, truncate_left, under_within

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats
    from solver.plan_cost import MemoryModel

__all__ = ["PrefixDP", "DpOutcome", "ProgramTooLarge", "TIE_REL"]

logger = logging.getLogger(__name__)

_RUN_WORK = 40
"""Work units a convex run of a value function costs in the convolution (its numpy calls),
against one per breakpoint: a run costs a few numpy calls whatever its length, so a count of
breakpoints alone let functions of thousands of short runs take ten times their share."""

_EDGE = 1e-12
"""Distance past a value function's domain end that is float rounding, not outside: relative to
the largest memory point (1e-12 of 1e11 B is 0.1 B; plans are whole bytes, settled exactly)."""

TIE_REL = 1e-9
"""Relative slack under which two values of the program are equal when a plan is read back."""


class ProgramTooLarge(RuntimeError):
    """The value functions outgrew the caller's cap (one convex piece per useful combination of
    choices: near-ties of identical blocks keep many)."""


@dataclass(frozen=True)
class DpOutcome:
    discarded: dict[int, float]
    """Candidate index -> bytes discarded on its curve (the ratio times its size)."""
    objective: float
    """The MILP objective of the plan (recompute ms on the envelopes, tie-break included)."""
    lower_bound: float
    """No plan of the MILP costs less (equal to ``objective`` where exact)."""


@dataclass(frozen=True)
class _Extra:
    """Candidate k's recompute-point term as a convex function of its ratio: segments (a, b)."""

    segs: tuple[tuple[float, float], ...]

    def at(self, r: float) -> float:
        return max(a * r + b for a, b in self.segs)

    @property
    def low(self) -> float:
        pts = [0.0, 1.0] + [(b0 - b1) / (a1 - a0) for (a0, b0), (a1, b1) in zip(self.segs, self.segs[1:])
                            if a1 != a0]
        return min(self.at(min(1.0, max(0.0, r))) for r in pts)

    @property
    def high(self) -> float:
        return max(self.at(0.0), self.at(1.0))

    @property
    def constant(self) -> bool:
        return self.high == self.low


class PrefixDP:
    """The chain program of one MILP, built once and solved for any budget."""

    def __init__(self, n: int, order: np.ndarray, start: np.ndarray,
                 curves: list[tuple[np.ndarray, np.ndarray]], shift: np.ndarray, sizes: np.ndarray,
                 need: np.ndarray, point_cnt: np.ndarray,
                 point_base: np.ndarray, block_need: list[tuple[float, float]],
                 extras: list[_Extra | None], held: list[tuple[np.ndarray, float]],
                 recompute: list[np.ndarray]) -> None:
        self.n = n
        self.order = order
        """Candidate index at each position (forward-end order)."""
        self.start = start
        """Position where the block of each position's candidate begins (its descendants)."""
        self.curves = curves
        """Per position: (bytes discarded on the curve, MILP cost) at the envelope's vertices."""
        self.shift = shift
        """Per position: forced discards net of held inputs (bytes any checkpoint adds)."""
        self.sizes = sizes
        self.need = need
        """Per prefix length: the highest base of the points there (bytes; -inf: no point)."""
        self.point_cnt, self.point_base = point_cnt, point_base
        self.block_need = block_need
        """Per position: the highest base in its block with it planned, as (every point but its
        recompute points, held inputs added; its recompute points) -- the second gets the
        recompute term, which may be a range (``_Extra``)."""
        self.extras = extras
        self.held, self.recompute = held, recompute
        self.exact = all(e is None or e.constant for e in extras)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, stats: Sequence[ModStats], tie_y: Sequence[float], tie_r: Sequence[float],
              nested_below: Sequence[set[int]], memory: MemoryModel) -> PrefixDP | str:
        """The program for candidates ``stats`` (the MILP's, in its order) with their tie-break
        costs, ``nested_below[k]`` the candidates under k, or why the MILP is not a chain (a
        sentence)."""
        n = len(stats)
        if n == 0:
            return "no candidates"
        if memory.pipelined:
            return "a pipeline schedule's rows (micro-batches in flight) are not a chain"
        fw = np.array([s.fw_post_op for s in stats], dtype=np.int64)
        bw = np.array([s.bw_pre_op if s.bw_pre_op != -1 else np.iinfo(np.int64).max for s in stats],
                      dtype=np.int64)
        # A module ends with its last child (same op): children first, a post-order.
        order = np.array(sorted(range(n), key=lambda k: (fw[k], len(nested_below[k]), k)), dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n)
        t = np.array([p.op_index for p in memory.points], dtype=np.int64)
        active = (fw[order][None, :] <= t[:, None]) & (t[:, None] < bw[order][None, :])
        cnt = active.sum(axis=1)
        if not np.array_equal(active, np.arange(n)[None, :] < cnt[:, None]):
            return ("the modules whose discards are gone at some point are not the first ones to "
                    "end their forward")
        start = np.empty(n, dtype=np.int64)
        for k in range(n):
            below = sorted(int(pos[j]) for j in nested_below[k])
            i = int(pos[k])
            if below != list(range(i - len(below), i)):
                return f"the checkpointable modules under {stats[k].fqn} are not the ones just before it"
            start[i] = i - len(below)
        base = np.array(memory.base, dtype=np.float64)
        index = {s.fqn: k for k, s in enumerate(stats)}
        recompute: list[list[int]] = [[] for _ in range(n)]
        for p_i, p in enumerate(memory.points):
            k = index.get(p.recompute_of) if p.recompute_of is not None else None
            if k is not None:
                # Its own block may be partly back already (a child whose backward starts at the
                # same op, as residual blocks trace): with k planned that block discards nothing.
                if not start[pos[k]] <= cnt[p_i] <= pos[k]:
                    return f"the recompute point of {stats[k].fqn} sees other discards than its block's"
                recompute[k].append(p_i)
        held: list[tuple[np.ndarray, float]] = []
        for k, s in enumerate(stats):
            pts = np.array(memory.held_points(s.fqn), dtype=np.int64)
            if len(pts) and ((cnt[pts] < start[pos[k]]) | (cnt[pts] > pos[k])).any():
                return f"the inputs {s.fqn}'s checkpoint holds are alive outside its block"
            held.append((pts, float(s.checkpoint_retain_bytes)))
        extras = [_extra(s) if recompute[k] else None for k, s in enumerate(stats)]
        need = np.full(n + 1, -np.inf)
        np.maximum.at(need, cnt, base)
        block_need = []
        for i in range(n):
            k = int(order[i])
            inside = (cnt >= start[i]) & (cnt <= i)
            vals = base.copy()
            pts, retain = held[k]
            if len(pts):
                vals[pts] += retain
            rec = np.array(recompute[k], dtype=np.int64)
            rec_base = float(base[rec].max()) if len(rec) else -np.inf
            vals[rec] = -np.inf
            rest = float(vals[inside].max()) if inside.any() else -np.inf
            block_need.append((rest, rec_base))
        curves, shift, sizes = [], np.empty(n), np.empty(n)
        for i in range(n):
            k = int(order[i])
            curves.append(_curve(stats[k], tie_y[k], tie_r[k]))
            shift[i] = fixed_discard_bytes(stats[k])
            sizes[i] = stats[k].sac_memory_bytes
        return cls(n, order, start, curves, shift, sizes, need, cnt, base, block_need,
                   [extras[int(order[i])] for i in range(n)],
                   [held[int(order[i])] for i in range(n)],
                   [np.array(recompute[int(order[i])], dtype=np.int64) for i in range(n)])

    # ------------------------------------------------------------------ solve
    def solve(self, budget: float, max_work: int = 200_000, rel_tol: float = 0.0) -> DpOutcome | None:
        """The least-cost plan within ``budget`` bytes, or None where no plan fits.

        ``rel_tol`` 0: exact. Above 0, every value function is replaced by one under it by at
        most ``rel_tol`` of its value (``solver.exact.pwl.under_within``): ``lower_bound`` stays a
        bound on every plan, ``objective`` is the cost of the plan read back, and their distance
        is the proof. On trees of distinct modules the functions' convex runs are near-ties that
        this merges, so holding them within 1e-5 is faster than exact and still proves the plan.
        Where a recompute growth varies with the ratio, ``objective`` is the plan's and
        ``lower_bound`` the relaxation's (equal where the relaxation's plan meets the rows).
        Raises ``ProgramTooLarge`` when the work (breakpoints of the value functions and
        ``_RUN_WORK`` per convex run's worth convolved, summed over the candidates) passes ``max_work``:
        a count, not a clock, so the same input gives the same answer."""
        low = self._run(budget, "low", max_work, rel_tol)
        if low is None:
            return None  # even the relaxation has no plan
        bound, plan, cost = low
        if self.exact or self.model_peak(plan) <= budget:
            return DpOutcome(plan, cost, bound)
        high = self._run(budget, "high", max_work, rel_tol)
        if high is None:
            return DpOutcome({}, math.inf, bound)
        return DpOutcome(high[1], high[2], bound)

    def min_budget(self) -> int | None:
        """The least whole-byte budget at which the program has a plan, or None where its two
        runs disagree (a recompute growth that varies with the ratio: HiGHS decides).

        Whether a budget has a plan depends only on the domains of the value functions, which
        a scalar pass follows (each domain's end: the most a prefix can discard with its rows
        met), so the smallest budget is found by bisection, far faster than a min-peak MILP.
        Byte counts are whole numbers in float64, so the pass is exact."""
        hi = int(math.ceil(float(np.max(self.point_base))))
        out = []
        for which in ("low",) if self.exact else ("low", "high"):
            if not self._reaches(hi, which):
                return None  # the unplanned step itself does not fit its own peak: no program
            # No plan peaks under the lowest base less every byte any checkpoint can discard.
            lo = int(math.floor(float(np.min(self.point_base)) - float(np.sum(self.sizes))
                                - float(np.sum(np.maximum(0.0, self.shift))))) - 1
            while hi - lo > 1:  # invariant: lo has no plan, hi has one
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._reaches(mid, which) else (mid, hi)
            out.append(hi)
        return out[0] if len(set(out)) == 1 else None

    def _reaches(self, budget: float, which: str) -> bool:
        """Whether ``_run`` at ``budget`` ends with a nonempty function: the same recurrence on
        the functions' domain ends only (-inf: empty)."""
        need, qs, cap = self._rows(budget, which)
        ends_pre = [0.0]  # point(0, 0)
        end = 0.0 if need[0] <= 0.0 else -math.inf
        for i in range(self.n):  # a curve's domain ends at its size
            base = ends_pre[int(self.start[i])]
            yes = min(base + self.shift[i] + self.sizes[i], cap) if base >= qs[i] else -math.inf
            pre = max(end, yes)
            ends_pre.append(pre)
            end = pre if pre >= need[i + 1] else -math.inf
        return end > -math.inf

    def _rows(self, budget: float, which: str) -> tuple[np.ndarray, np.ndarray, float]:
        """At ``budget``: each prefix's need, each position's need with it planned (bytes to
        discard), and the cap past which no function needs to reach."""
        need = self.need - budget
        qs = np.array([self._block_need(i, which) for i in range(self.n)]) - budget
        top = max(float(np.max(need)), float(np.max(qs)))
        return need, qs, top + float(np.sum(np.maximum(0.0, -self.shift)))

    def _block_need(self, i: int, which: str) -> float:
        rest, rec_base = self.block_need[i]
        e = self.extras[i]
        if e is None or rec_base == -np.inf:
            return rest
        return max(rest, rec_base + (e.low if which == "low" else e.high))

    def _run(self, budget: float, which: str, max_work: int, rel_tol: float
             ) -> tuple[float, dict[int, float], float] | None:
        """(least value of the last function: a lower bound, the plan read back, its cost)."""
        n = self.n
        need, qs, cap = self._rows(budget, which)
        g_pre: list[Pwl] = [point(0.0, 0.0)]
        g = [truncate_left(g_pre[0], need[0])]
        work = 0
        for i in range(n):
            s = int(self.start[i])
            base = truncate_left(g_pre[s], qs[i])
            cx, cy = self.curves[i]
            yes, runs = infconv_convex(base, cx, cy, float(self.shift[i]), cap)
            pre = under_within(envelope([g[i], yes]), rel_tol)
            # A convex run's worth is a few numpy calls, about _RUN_WORK breakpoints' worth of time.
            work += len(pre.xs) + len(base.xs) + int(_RUN_WORK * runs)
            if work > max_work:
                raise ProgramTooLarge(f"{work} units of work by candidate {i + 1} of {n} "
                                      f"(cap {max_work})")
            g_pre.append(pre)
            g.append(truncate_left(pre, need[i + 1]))
        if g[n].empty:
            return None
        plan, cost = self._read_back(g_pre, g, need, qs, float(g[n].xs[0]))
        return g[n].lowest, plan, cost

    def _read_back(self, g_pre: list[Pwl], g: list[Pwl], need: np.ndarray, qs: np.ndarray,
                   target: float) -> tuple[dict[int, float], float]:
        """The plan behind ``g[n]`` at ``target`` and its cost: walk back through the stored
        functions, taking at each position the cheaper branch by their values (exact functions:
        the branch whose value is the function's; functions under the exact ones: still a plan
        that meets every row, since each step keeps what is left to discard inside the chosen
        branch's domain)."""
        plan: dict[int, float] = {}
        cost = 0.0
        # Byte counts near the peak's size are summed in different orders along the way.
        slack = _EDGE * max(1.0, float(np.max(np.abs(self.point_base))))
        a, c, truncated = self.n, target, True
        while a > 0:
            if truncated:  # G_a = Gpre_a held to the need of prefix a
                c = max(c, need[a])
            i = a - 1
            s = int(self.start[i])
            base = truncate_left(g_pre[s], qs[i])
            cx, cy = self.curves[i]
            shift = float(self.shift[i])
            # The best discard lies on a vertex of the curve or where the rest hits a vertex.
            ds = np.concatenate([cx, c - shift - base.xs])
            ds = ds[(ds >= cx[0]) & (ds <= cx[-1])]
            total = np.interp(ds, cx, cy) + _value_near(base, c - shift - ds, slack)
            yes = float(total.min()) if len(total) else math.inf
            no = float(_value_near(g[i], c, slack))
            if not math.isfinite(min(no, yes)):  # a bug, not an input: HiGHS decides
                logger.warning("program read-back left the value functions' domain at position "
                               "%d of %d; the backend solves this budget", i, self.n)
                return {}, math.inf
            if no <= yes + TIE_REL * max(1.0, abs(yes)):
                a, truncated = i, True  # not planned: G_i at c
                continue
            d = float(ds[int(np.argmin(total))])
            plan[int(self.order[i])] = d
            cost += float(np.interp(d, cx, cy))
            # planned: its block discards nothing, Gpre_s at what is left (its block's needs met)
            a, c, truncated = s, max(c - shift - d, qs[i]), False
        return plan, cost

    # ------------------------------------------------------------------ checks
    def model_peak(self, plan: dict[int, float]) -> float:
        """Highest memory of ``plan`` in the MILP's model (envelopes, hull of the growth)."""
        pos_of = {int(k): i for i, k in enumerate(self.order)}
        gone = np.zeros(self.n)
        for k, d in plan.items():
            i = pos_of[k]
            gone[i] = d + self.shift[i]
        prefix = np.concatenate([[0.0], np.cumsum(gone)])
        mem = self.point_base - prefix[self.point_cnt]
        for k, d in plan.items():
            i = pos_of[k]
            pts, retain = self.held[i]
            if len(pts):
                mem[pts] += retain
            e = self.extras[i]
            rec = self.recompute[i]
            if e is not None and len(rec):
                mem[rec] += e.at(d / self.sizes[i] if self.sizes[i] else 0.0)
        return float(mem.max())


def _value_near(f: Pwl, q: np.ndarray | float, slack: float) -> np.ndarray:
    """``f`` at ``q``, arguments past the domain's end by at most ``slack`` (float rounding)
    taken at the end: a plan at the smallest reachable peak runs along the ends of the domains,
    where a sum of byte counts near 1e10 comes out a fraction of a byte short of the same sum
    taken in another order, and every branch would read +inf."""
    q = np.asarray(q, dtype=np.float64)
    if f.empty:
        return f.value(q)
    end = f.xs[-1]
    return f.value(np.where((q > end) & (q - end <= slack), end, q))


def _curve(stats: ModStats, tie_y: float, tie_r: float) -> tuple[np.ndarray, np.ndarray]:
    """Vertices (bytes, ms) of the MILP's cost of a candidate: the lower convex hull of its curve
    as ``solver.plan_cost.cost_envelope`` takes it, plus the tie-break (``tie_y`` once, ``tie_r``
    per unit of ratio). Taken from the curve's own points, not from the envelope's lines: a
    steep line evaluated at its end loses digits to cancellation, and that error would spread
    over the segment before it."""
    size, curve = stats.sac_memory_bytes, stats.tradeoff
    fixed = getattr(stats, "recompute_fixed_ms", 0.0)
    pts = {0: module_recompute_ms(stats, 0), size: module_recompute_ms(stats, size)}
    for x, ms in zip(curve.discarded_bytes, curve.recompute_ms):
        if 0 < x < size:
            pts[x] = min(pts.get(x, math.inf), fixed + ms)
    hull = lower_hull(pts.items())
    xs = np.array([x for x, _ in hull], dtype=np.float64)
    ys = np.array([y for _, y in hull]) + tie_y + tie_r * xs / size
    return xs, ys


def _extra(s: ModStats) -> _Extra:
    """The MILP's term at the recompute point: the legacy transient, or the lower hull of the
    recompute growth less what was discarded, net of the forced discards (``SACMilp``)."""
    segs = growth_hull_segments(s)
    if not segs:
        return _Extra(((0.0, float(s.recompute_transient_bytes)),))
    fixed = fixed_discard_bytes(s)
    return _Extra(tuple((a, b - fixed) for a, b in segs))
