"""A hand-built two-block step for the offload tests, whose best plans are worked out by hand.

Blocks b0 (ops 0-9, fw_post 10) and b1 (fw_post 20): 100 MiB saved each, full recompute 10 ms
(linear). Forward 10 ms per block, backward 20 ms; the copy link moves 1 MiB per ms. Memory:
300 MiB at op 25 (forward done), 200 MiB at op 35 (in b1's backward). b1 runs first in backward
(bw_pre 30), so b0's H2D is issued at 30 and b0's backward starts at 40.

Offloading o MiB of b0: D2H issued at t=10 ends at 10 + o; H2D issued at t=20 (bw:b1 starts)
after the D2H: ends at max(20, 10 + o) + o; bw:b0 would start at t=40 + the recompute b1 runs at
the start of its backward (rec ms). Hidden iff 10 + 2 o <= 40 + rec.
"""

from __future__ import annotations

from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, SACOp, TradeoffCurve
from estimators.contract.timeline import step_layout
from solver.offload.milp import OffloadMilp

__all__ = ["MiB", "RATE", "block", "info", "milp"]

MiB = 2**20
RATE = MiB * 1000.0  # 1 MiB per ms


def block(fqn, fw_post, bw_pre, *, size_mib=100, ms=10.0, small_op_bytes=0):
    size = size_mib * MiB
    ops = (SACOp(func="aten.mm.default", occurrence=0, runtime_ms=ms, memory_bytes=size, is_saved=True),)
    if small_op_bytes:
        ops += (SACOp(func="aten.relu.default", occurrence=0, runtime_ms=0.0,
                      memory_bytes=small_op_bytes, is_saved=True),)
    return ModStats(fqn=fqn, is_leaf=False, sac_memory_bytes=size, sac_runtime_ms=ms,
                    tradeoff=TradeoffCurve(discarded_bytes=(0, size), recompute_ms=(0.0, ms)),
                    ops=ops, fw_runtime_ms=10.0, bw_runtime_ms=20.0, fw_pre_op=fw_post - 10,
                    fw_post_op=fw_post, bw_pre_op=bw_pre, bw_post_op=bw_pre + 9)


def info(small_op_bytes=0):
    stats = (ModStats(fqn="M", is_leaf=False, fw_runtime_ms=20.0, bw_runtime_ms=40.0, fw_pre_op=0,
                      fw_post_op=20, bw_pre_op=30, bw_post_op=49),
             block("M.b.0", 10, 40, small_op_bytes=small_op_bytes), block("M.b.1", 20, 30))
    points = (MemoryPoint(op_index=25, phase="fw", activation_bytes=300 * MiB),
              MemoryPoint(op_index=35, phase="bw", activation_bytes=200 * MiB))
    names = tuple(s.fqn for s in stats)
    order = ModOrder(fw_pre_order=names, fw_post_order=names, bw_pre_order=names, bw_post_order=names)
    return ModuleInfo(mod_order=order, mod_stats=stats, memory_points=points, peak_bytes=300 * MiB,
                      fw_runtime_ms=20.0, bw_runtime_ms=40.0)


def milp(i=None, **kw):
    i = i or info()
    return OffloadMilp(i, step_layout(i, ["M.b.0", "M.b.1"]), copy_bytes_per_s=RATE, **kw)
