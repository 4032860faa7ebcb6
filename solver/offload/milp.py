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

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

from solver.candidates import check_budget, check_units, find_candidates, fsdp_blocked
from solver.errors import InfeasibleBudgetError, SolverTimeoutError
from solver.graph import Graph
from solver.offload.cost import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    offload_curve,
    offload_ops,
    offload_take,
    offloadable_bytes,
    point_bytes,
    predict_offload_peak_bytes,
)
from solver.offload.model import OffloadModel, offload_blocks
from solver.options import SolverOptions, SolveStatus
from solver.plan_cost import MemoryModel, check_world_size, module_recompute_ms

if TYPE_CHECKING:  # only types
    from estimators.contract.module_info import ModuleInfo
    from estimators.contract.timeline import StepLayout, StepTimeline

__all__ = ["OffloadMilp", "OffloadResult", "offloadable_bytes", "offload_ops", "offload_take",
           "offload_curve", "predict_offload_peak_bytes", "DEFAULT_MIN_OFFLOAD_BYTES"]

logger = logging.getLogger(__name__)


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
        allowed = check_units(ac_units, self.graph, "ac_units")
        fsdp = check_units(fsdp_units, self.graph, "fsdp_units")
        self._memory = MemoryModel(info, self.world_size)
        self.no_ac_peak_bytes = self._memory.peak({})
        stats = {s.fqn: s for s in info.mod_stats}
        blocked = fsdp_blocked(self.graph, fsdp)
        self._blocks = offload_blocks(layout, stats, min_offload_bytes, blocked) if offload else []
        self._model = OffloadModel(
            find_candidates(self.graph, allowed, fsdp), self._blocks, self._memory, self.graph,
            layout, copy_bytes_per_s=self.copy_bytes_per_s, copy_latency_s=self.copy_latency_s,
            min_offload_bytes=self.min_offload_bytes, host_budget_bytes=host_budget_bytes)
        self.baseline_timeline = layout.timeline()
        self._min_peak: int | None = None
        self.build_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ solve
    @property
    def n_offload_blocks(self) -> int:
        """Blocks that may offload (offloadable bytes, not the last, not under an FSDP unit)."""
        return len(self._blocks)

    @property
    def offload_blocks(self) -> tuple[str, ...]:
        """The blocks that may offload, in forward order."""
        return tuple(b.fqn for b in self._blocks)

    @property
    def n_variables(self) -> int:
        return self._model.n_variables

    @property
    def n_constraints(self) -> int:
        return self._model.n_constraints

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
        choices fixed (an LP); without it the whole MILP is re-solved for a tighter target."""
        t0 = time.perf_counter()
        budget = check_budget(budget_bytes)
        target = budget
        limit = self.options.time_limit_s
        model = self._model
        bound = None  # the first solve's dual bound (ms): a lower bound for the exact problem
        try:
            for _ in range(4):  # tighter targets where the backend's rounding overshoots
                # time_limit_s bounds the whole solve: a re-solve gets what the first left over.
                left = None if limit is None else max(0.1 * limit, limit - (time.perf_counter() - t0))
                start = incumbent if warm_start and not model.binaries_fixed else None
                out = model.solve(target, dataclasses.replace(self.options, time_limit_s=left),
                                  start=start)
                if not out.has_solution:
                    # At the floor the backend may call the budget infeasible within its
                    # tolerances where the incumbent, evaluated exactly, fits.
                    if incumbent is not None and self.peak_bytes(incumbent, {}) <= budget:
                        return self._incumbent(incumbent, budget, t0)
                    if out.infeasible and not model.binaries_fixed:
                        raise InfeasibleBudgetError(budget, self.min_reachable_peak_bytes(), self.world_size)
                    if model.binaries_fixed:
                        break
                    raise SolverTimeoutError(
                        f"no plan found within time_limit_s={self.options.time_limit_s}; raise "
                        "SolverOptions.time_limit_s or rel_gap")
                if bound is None and out.gap is not None and model.step_ms is not None:
                    bound = model.step_ms * (1.0 - out.gap)
                disc, off = model.read()
                peak = self.peak_bytes(disc, off)
                if peak <= budget:
                    gap, status = out.gap, SolveStatus.OPTIMAL if out.proven else SolveStatus.FEASIBLE
                    res = self._result(disc, off, peak, budget, status, gap, t0, model.step_ms)
                    if model.binaries_fixed:  # repaired: proven only against the first solve's bound
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
                if repair and not model.binaries_fixed:
                    model.fix_binaries()
                target -= peak - budget + 1024
        finally:
            model.release_binaries()
        if incumbent is not None:
            return self._incumbent(incumbent, budget, t0)
        raise InfeasibleBudgetError(budget, self.min_reachable_peak_bytes(), self.world_size)

    def _incumbent(self, disc: Mapping[str, int], budget: int, t0: float) -> OffloadResult:
        peak = self.peak_bytes(disc, {})
        if peak > budget:
            raise ValueError(f"the incumbent plan's peak {peak} exceeds the budget {budget}")
        return self._result(dict(disc), {}, peak, budget, SolveStatus.FEASIBLE, None, t0, None,
                            from_incumbent=True)

    def min_reachable_peak_bytes(self) -> int:
        """Smallest peak any plan of this MILP reaches (host budget included)."""
        if self._min_peak is None:
            out = self._model.solve_min_peak(self.options)
            if not out.has_solution:
                raise SolverTimeoutError("could not compute the smallest reachable peak within "
                                         f"time_limit_s={self.options.time_limit_s}")
            disc, off = self._model.read()
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
