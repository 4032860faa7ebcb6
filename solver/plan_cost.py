"""What a module-level plan costs, evaluated exactly: the memory at every point of the step when
some modules are checkpointed (each discarding some bytes), and their recompute time.

    from solver.plan_cost import predict_peak_bytes, module_recompute_ms
    predict_peak_bytes(info, {"GPT.blocks.3": 123456})        # bytes, exact integers
    module_recompute_ms(info.stats("GPT.blocks.3"), 123456)    # ms, on the exact curve

The MILPs (``solver/sac_milp.py``, ``solver/offload/milp.py``) are linear models of these numbers;
every plan they return is re-evaluated here, so a reported peak never comes from an LP variable.
"""

from __future__ import annotations

import bisect
import numbers
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from estimators.contract.module_info import lower_hull_segments
from solver.errors import UnknownModuleError
from solver.graph import close_names, is_submodule

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats, ModuleInfo

__all__ = [
    "MemoryModel", "predict_peak_bytes", "recompute_extra_bytes", "module_recompute_ms",
    "cost_envelope", "has_window", "fixed_discard_bytes", "growth_table", "growth_hull_segments",
    "prefix_sums",
    "check_world_size", "unknown_module_error",
]


# ----------------------------------------------------------------------------- exact memory model
def has_window(s: ModStats) -> bool:
    """A discard can lower memory only between fw_post_op and bw_pre_op (-1: never ends)."""
    return s.fw_post_op >= 0 and (s.bw_pre_op == -1 or s.bw_pre_op > s.fw_post_op)


class MemoryModel:
    """Evaluates the memory model of ``estimators/contract/module_info.py`` in exact integers."""

    def __init__(self, info: ModuleInfo, world_size: int) -> None:
        self.stats = {s.fqn: s for s in info.mod_stats}
        self.points = info.memory_points
        self.in_flight_roots = sorted({g for p in self.points for g, _ in p.in_flight})
        self.pipelined = bool(self.in_flight_roots) or any(p.recompute_in_window for p in self.points)
        """A pipeline stage's schedule (``MemoryPoint.in_flight`` / ``recompute_in_window``)."""
        self.base = [
            -(-(p.param_bytes + p.grad_bytes + p.optimizer_bytes) // world_size)
            + p.activation_bytes
            + p.other_bytes
            for p in self.points
        ]

    def point_bytes(self, discarded: Mapping[str, int]) -> list[int]:
        """Memory at every point when each module in ``discarded`` is checkpointed."""
        # Net of the inputs each checkpoint holds, plus what it always discards.
        live = [(f, d + fixed_discard_bytes(self.stats[f])) for f, d in discarded.items()
                if has_window(self.stats[f])]
        fw = sorted((self.stats[f].fw_post_op, d) for f, d in live)
        bw = sorted((self.stats[f].bw_pre_op, d) for f, d in live if self.stats[f].bw_pre_op != -1)
        fw_keys, fw_cum = prefix_sums(fw)
        bw_keys, bw_cum = prefix_sums(bw)
        stage_discard = self._stage_discards(live) if self.pipelined else {}
        out = []
        for p, base in zip(self.points, self.base):
            t = p.op_index
            # Modules whose backward began by t also ended their forward by t (window check).
            gone = fw_cum[bisect.bisect_right(fw_keys, t)] - bw_cum[bisect.bisect_right(bw_keys, t)]
            extra = 0
            if p.recompute_of is not None and p.recompute_of in discarded:
                extra = recompute_extra_bytes(self.stats[p.recompute_of], discarded[p.recompute_of])
            f = p.recompute_in_window
            if f is not None and f in discarded:  # growth on top of a discard that still holds
                extra += (recompute_extra_bytes(self.stats[f], discarded[f]) + discarded[f]
                          + fixed_discard_bytes(self.stats[f]))
            gone += sum(n * stage_discard.get(g, 0) for g, n in p.in_flight)
            out.append(base - gone + extra)
        for f in discarded:
            for i in self.held_points(f):
                out[i] += self.stats[f].checkpoint_retain_bytes
        return out

    def _stage_discards(self, live: list[tuple[str, int]]) -> dict[str, int]:
        """Per in-flight root (``MemoryPoint.in_flight``): what one micro-batch of that stage
        no longer holds under the plan, forced discards net of retained inputs included."""
        out: dict[str, int] = {}
        for g in self.in_flight_roots:
            out[g] = sum(d for f, d in live if f == g or is_submodule(f, g))
        return out

    def discard_weight(self, fqn: str, i: int) -> int:
        """How many copies of ``fqn``'s discard point ``i`` is without: 1 inside its window, plus
        the micro-batches of its stage in flight there (``MemoryPoint.in_flight``)."""
        s, p = self.stats[fqn], self.points[i]
        t = p.op_index
        w = 1 if s.fw_post_op <= t and (s.bw_pre_op == -1 or t < s.bw_pre_op) else 0
        return w + sum(n for g, n in p.in_flight if fqn == g or is_submodule(fqn, g))

    def held_points(self, fqn: str) -> list[int]:
        """Points during ``fqn``'s backward (bw_pre_op..bw_post_op) other than its recompute
        point: the inputs its checkpoint holds are still alive there, and the unplanned step freed
        them before that backward (that is what ``checkpoint_retain_bytes`` counts). Without
        this term a checkpoint whose own backward holds the peak is priced low."""
        s = self.stats[fqn]
        if s.checkpoint_retain_bytes <= 0 or s.bw_pre_op < 0 or not has_window(s):
            return []
        end = s.bw_post_op if s.bw_post_op >= s.bw_pre_op else s.bw_pre_op
        return [i for i, p in enumerate(self.points)
                if s.bw_pre_op <= p.op_index <= end and p.recompute_of != fqn]

    def peak(self, discarded: Mapping[str, int]) -> int:
        return max(self.point_bytes(discarded), default=0)


def fixed_discard_bytes(s: ModStats) -> int:
    """Bytes any checkpoint of ``s`` discards beyond the curve, net of the inputs it holds."""
    return getattr(s, "forced_discard_bytes", 0) - s.checkpoint_retain_bytes


def growth_table(s: ModStats) -> tuple[int, ...]:
    g = tuple(getattr(s, "recompute_growth_bytes", ()) or ())
    return g if len(g) == len(s.tradeoff.discarded_bytes) else ()


def growth_hull_segments(s: ModStats, unit: float = 1.0) -> list[tuple[float, float]]:
    """(slope, intercept) over the ratio of the lower convex hull of the recompute's memory
    change (growth less what was discarded) at the curve's breakpoints, in ``unit`` bytes; [] for
    stats without a growth table. A single breakpoint gives the flat line through it."""
    growth = growth_table(s)
    if not growth:
        return []
    size = s.sac_memory_bytes
    pts = [(x / size, (g - x) / unit) for x, g in zip(s.tradeoff.discarded_bytes, growth)]
    return lower_hull_segments(pts) or [(0.0, pts[0][1])]


def recompute_extra_bytes(s: ModStats, discarded_bytes: int) -> int:
    """Memory at the start of a checkpointed module's backward, relative to the unplanned step.

    The unplanned step holds all the module's activations there; a checkpoint has discarded
    ``discarded_bytes`` (and its forced discards), holds its inputs, and the recompute brings back
    ``recompute_growth_bytes`` at its highest (linear between breakpoints of the curve).
    Stats without a growth table (e.g. imported from torch) add ``recompute_transient_bytes``."""
    growth = growth_table(s)
    if not growth:
        return s.recompute_transient_bytes
    xs = s.tradeoff.discarded_bytes
    j = bisect.bisect_left(xs, discarded_bytes)
    if j >= len(xs):
        g = growth[-1]
    elif xs[j] == discarded_bytes or j == 0:
        g = growth[j]
    else:  # linear between breakpoints j - 1 and j, rounded up (never optimistic)
        span = xs[j] - xs[j - 1]
        g = growth[j - 1] + -(-(growth[j] - growth[j - 1]) * (discarded_bytes - xs[j - 1]) // span)
    return g - discarded_bytes - fixed_discard_bytes(s)


def prefix_sums(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    keys, cum = [], [0]
    for k, d in pairs:
        keys.append(k)
        cum.append(cum[-1] + d)
    return keys, cum


def predict_peak_bytes(
    info: ModuleInfo, discarded_bytes: Mapping[str, int], *, world_size: int = 1
) -> int:
    """Peak of the exact memory model when each module in ``discarded_bytes`` is checkpointed
    and discards that many bytes (``{}``: no checkpointing)."""
    check_world_size(world_size)
    model = MemoryModel(info, world_size)
    for fqn, d in discarded_bytes.items():
        s = model.stats.get(fqn)
        if s is None:
            raise unknown_module_error(fqn, model.stats, "discarded_bytes")
        if not 0 <= d <= s.sac_memory_bytes:
            raise ValueError(f"{fqn}: discarded bytes {d} not in [0, {s.sac_memory_bytes}]")
    return model.peak(discarded_bytes)


# ----------------------------------------------------------------------------- cost curves
def module_recompute_ms(s: ModStats, discarded_bytes: int) -> float:
    """Recompute time of checkpointing ``s`` with ``discarded_bytes`` discarded: its fixed cost
    plus the exact curve, linear between breakpoints. At 0 the checkpoint still discards its
    forced bytes and recomputes the curve's zero-byte steps (the envelope's cost at 0+); a
    module that is not checkpointed is simply not in the plan. Discarding everything, a plain
    (full) checkpoint is taken where it is cheaper (``ModStats.full_recompute_ms``: no selective
    policy), as ``planner.planning.module_plans.module_plan`` applies it."""
    curve = s.tradeoff
    fixed = getattr(s, "recompute_fixed_ms", 0.0)
    if discarded_bytes <= 0:
        at_zero = [ms for b, ms in zip(curve.discarded_bytes, curve.recompute_ms) if b == 0]
        return fixed + (at_zero[-1] if at_zero else 0.0)
    selective = fixed + curve.recompute_ms_at(discarded_bytes)
    full = getattr(s, "full_recompute_ms", 0.0)
    if full > 0 and discarded_bytes >= s.sac_memory_bytes:
        return min(selective, full)
    return selective


def cost_envelope(s: ModStats) -> tuple[list[tuple[float, float]], bool]:
    """Segments (a, b) with cost_ms(r) = max_s(a r + b) for r in (0, 1], and whether that is the
    curve itself (convex). b of the first segment is the cost at r -> 0+: the fixed recompute
    cost plus any zero-byte step at the start of the curve."""
    size, curve = s.sac_memory_bytes, s.tradeoff
    fixed = getattr(s, "recompute_fixed_ms", 0.0)
    pts = [(0.0, module_recompute_ms(s, 0))]  # recompute_ms_at(0+): the last zero-byte step
    pts += [(b / size, fixed + ms) for b, ms in zip(curve.discarded_bytes, curve.recompute_ms)
            if 0 < b < size]
    # A full checkpoint below the selective curve's end is a vertex the envelope takes; the
    # curve is convex where the selective points are (the ratios just under 1 are then priced
    # below their selective cost: the plan's recompute_ms is the exact one).
    selective_end = (1.0, fixed + curve.recompute_ms_at(size))
    pts.append((1.0, module_recompute_ms(s, size)))
    segs = lower_hull_segments(pts)
    return segs, _all_on_envelope(lower_hull_segments([*pts[:-1], selective_end]), [*pts[:-1], selective_end])


def _all_on_envelope(segs: list[tuple[float, float]], pts: list[tuple[float, float]]) -> bool:
    """Every point on the envelope ``max_s(a x + b)`` (its lower convex hull: none lies under
    it), within 1e-9 relative: the curve is convex. Every segment at every point, as arrays in
    blocks of about a million products (a module of a thousand ops has a million pairs)."""
    slopes = np.array([a for a, _ in segs])
    icepts = np.array([b for _, b in segs])
    xs, ys = np.array([x for x, _ in pts]), np.array([y for _, y in pts])
    rows = max(1, 2**20 // max(1, len(segs)))
    for i in range(0, len(xs), rows):
        x, y = xs[i:i + rows], ys[i:i + rows]
        env = (np.outer(x, slopes) + icepts).max(axis=1)
        if np.any(env < y - 1e-9 * np.maximum(1.0, np.abs(y))):
            return False
    return True


# ----------------------------------------------------------------------------- validation
def check_world_size(world_size: int) -> None:
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (number of ranks), got {world_size!r}")


def unknown_module_error(fqn: str, known: Iterable[str], what: str) -> UnknownModuleError:
    hint = close_names(fqn, known)
    more = f"; close names: {', '.join(map(repr, hint))}" if hint else ""
    return UnknownModuleError(f"{what} names a module that does not exist: {fqn!r}{more}")
