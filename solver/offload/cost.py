"""What a module can offload and what it costs: the ops whose saved outputs may go to host, in the
order they are taken, the copy time of the first x bytes (convex), and the peak of the memory
model with offloads beside checkpoints. Torch-free, like the rest of the solver; the three-way
MILP (``solver.offload.milp``) and the planner (``planner.planning.offload_solve``) both price offloads here."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Mapping

from estimators.contract.sac_groups import cached_if_saved
from solver.plan_cost import MemoryModel, prefix_sums

if TYPE_CHECKING:  # only types
    from estimators.contract.module_info import ModStats, ModuleInfo, SACOp

__all__ = ["DEFAULT_MIN_OFFLOAD_BYTES", "offload_ops", "offloadable_bytes", "offload_take", "offload_curve",
           "predict_offload_peak_bytes", "point_bytes"]

DEFAULT_MIN_OFFLOAD_BYTES = 1
"""Empty outputs are never offloaded (nothing to free). Small ones are not excluded by a size
rule: each copy pays ``DeviceSpec.host_copy_latency_s`` on the copy stream, so the MILP takes
them only where the copy window hides that cost, and last (``offload_ops``'s order)."""



def offload_ops(s: ModStats, min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> list[SACOp]:
    """Ops of ``s`` whose saved outputs may go to host (saved, not views, not cached-only, at
    least ``min_offload_bytes``), largest first (forward order among equals): with a fixed
    latency per copy, the order that moves the most bytes per ms of copy stream, so the copy
    time of the first x bytes is a convex function of x (``offload_curve``)."""
    ops = [op for op in s.ops if cached_if_saved(op) and op.memory_bytes >= min_offload_bytes]
    return sorted(ops, key=lambda op: -op.memory_bytes)  # stable: forward order among equals


def offloadable_bytes(s: ModStats, min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> int:
    """Bytes of ``s``'s saved outputs that may go to host (``offload_ops``), over all its calls."""
    return sum(op.memory_bytes for op in offload_ops(s, min_offload_bytes)) * max(1, s.n_calls)


def offload_take(s: ModStats, nbytes: int, min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
                 cap_bytes: int | None = None) -> tuple[list[SACOp], int]:
    """The ops ``offload_ops`` takes first to offload at least ``nbytes`` (over all calls),
    skipping any that would pass ``cap_bytes`` (what is left of a host budget), and the bytes
    they really offload."""
    calls, out, total = max(1, s.n_calls), [], 0
    for op in offload_ops(s, min_offload_bytes):
        if total >= nbytes:
            break
        if cap_bytes is not None and total + op.memory_bytes * calls > cap_bytes:
            continue
        out.append(op)
        total += op.memory_bytes * calls
    return out, total


def offload_curve(s: ModStats, copy_bytes_per_s: float, copy_latency_s: float,
                  min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> list[tuple[int, float]]:
    """Breakpoints (bytes, ms) of one direction's copy time as ``s`` offloads more bytes in
    ``offload_ops`` order, over all calls (one copy per op and call); starts at (0, 0), convex."""
    calls = max(1, s.n_calls)
    pts, x, t = [(0, 0.0)], 0, 0.0
    for op in offload_ops(s, min_offload_bytes):
        x += op.memory_bytes * calls
        t += calls * 1e3 * (op.memory_bytes / copy_bytes_per_s + copy_latency_s)
        pts.append((x, t))
    return pts


def predict_offload_peak_bytes(
    info: ModuleInfo,
    discarded_bytes: Mapping[str, int],
    offloaded: Mapping[str, tuple[int, int, int]],
    *,
    world_size: int = 1,
) -> int:
    """Peak of the memory model with checkpoints ``discarded_bytes`` and offloads
    ``{fqn: (bytes, fw_post_op, back_op)}``: the bytes are gone from ``fw_post_op`` (inclusive)
    to ``back_op`` (exclusive)."""
    return max(point_bytes(MemoryModel(info, world_size), discarded_bytes, offloaded), default=0)


def point_bytes(model: MemoryModel, discarded: Mapping[str, int],
                 offloaded: Mapping[str, tuple[int, int, int]]) -> list[int]:
    mem = model.point_bytes(discarded)
    starts = sorted((a, nb) for nb, a, _ in offloaded.values())
    ends = sorted((b, nb) for nb, _, b in offloaded.values())
    sk, sc = prefix_sums(starts)
    ek, ec = prefix_sums(ends)
    return [m - sc[bisect.bisect_right(sk, p.op_index)] + ec[bisect.bisect_right(ek, p.op_index)]
            for m, p in zip(mem, model.points)]
