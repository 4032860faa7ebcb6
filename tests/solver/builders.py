"""Hand-built ModuleInfos for the solver's tests, whose optimal plans are worked out by hand.

Op indices: forward posts at 10, 20, ...; backward starts later in reverse order (MiB = 2**20
bytes). ``chain`` and ``nested`` say in their docstrings what their memory is at each point.
"""

from __future__ import annotations

from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, TradeoffCurve

__all__ = ["MiB", "mod", "pt", "make_info", "chain", "nested"]

MiB = 2**20


def mod(fqn: str, *, size_mib: float = 0, ms: float = 0.0, fw_post: int = -1, bw_pre: int = -1,
        leaf: bool = False, transient_mib: float = 0, fixed_ms: float = 0.0, retain_mib: float = 0,
        curve: tuple[tuple[float, float], ...] | None = None) -> ModStats:
    """A module with a linear (or the given piecewise, in (MiB, ms)) trade-off curve."""
    size = int(size_mib * MiB)
    pts = curve if curve is not None else ((0, 0.0), (size_mib, ms))
    tc = TradeoffCurve(discarded_bytes=tuple(int(b * MiB) for b, _ in pts),
                       recompute_ms=tuple(float(m) for _, m in pts))
    return ModStats(fqn=fqn, is_leaf=leaf, sac_memory_bytes=size, sac_runtime_ms=tc.total_ms,
                    tradeoff=tc, fw_post_op=fw_post, bw_pre_op=bw_pre, recompute_fixed_ms=fixed_ms,
                    recompute_transient_bytes=int(transient_mib * MiB),
                    checkpoint_retain_bytes=int(retain_mib * MiB))


def pt(t: int, act_mib: float, *, other_mib: float = 0, param_mib: float = 0, grad_mib: float = 0,
       opt_mib: float = 0, rec: str | None = None) -> MemoryPoint:
    return MemoryPoint(op_index=t, phase="bw", activation_bytes=int(act_mib * MiB),
                       other_bytes=int(other_mib * MiB), param_bytes=int(param_mib * MiB),
                       grad_bytes=int(grad_mib * MiB), optimizer_bytes=int(opt_mib * MiB),
                       recompute_of=rec)


def make_info(stats: list[ModStats], points: list[MemoryPoint]) -> ModuleInfo:
    names = tuple(s.fqn for s in stats)
    order = ModOrder(fw_pre_order=names, fw_post_order=(), bw_pre_order=(), bw_post_order=())
    return ModuleInfo(mod_order=order, mod_stats=tuple(stats), memory_points=tuple(points),
                      peak_bytes=max(p.total_bytes for p in points))


def chain() -> ModuleInfo:
    """M -> b0, b1, b2 (each 100 MiB discardable; full recompute 10, 20, 5 ms).

    windows: b0 [10, 60), b1 [20, 50), b2 [30, 40). No-AC memory (param 100 MiB):
    t=35: 400, t=40: 450 (b2's backward starts), t=50: 350, t=60: 250.
    """
    stats = [mod("M"), mod("M.b0", size_mib=100, ms=10, fw_post=10, bw_pre=60),
             mod("M.b0.fc", leaf=True), mod("M.b1", size_mib=100, ms=20, fw_post=20, bw_pre=50),
             mod("M.b1.fc", leaf=True), mod("M.b2", size_mib=100, ms=5, fw_post=30, bw_pre=40),
             mod("M.b2.fc", leaf=True)]
    points = [pt(35, 300, param_mib=100), pt(40, 300, other_mib=50, param_mib=100),
              pt(50, 200, other_mib=50, param_mib=100), pt(60, 100, other_mib=50, param_mib=100)]
    return make_info(stats, points)


def nested(*, backward_binds: bool) -> ModuleInfo:
    """M -> B -> (attn, mlp). B discards 200 MiB for 12 ms; attn 100 MiB/10 ms; mlp 100 MiB/8 ms.

    windows: attn [10, 40), mlp [20, 31), B [21, 30). Saved activations: 200 MiB until mlp's
    backward (t=31) ends, then attn's 100. Points: t=25 end of forward (+150 MiB logits when the
    forward binds), t=30 B's backward starts, t=31 mlp's, t=35 after mlp's backward.
    """
    stats = [mod("M"), mod("M.B", size_mib=200, ms=12, fw_post=21, bw_pre=30),
             mod("M.B.attn", size_mib=100, ms=10, fw_post=10, bw_pre=40), mod("M.B.attn.q", leaf=True),
             mod("M.B.mlp", size_mib=100, ms=8, fw_post=20, bw_pre=31), mod("M.B.mlp.fc", leaf=True)]
    logits, grads = (0, 10) if backward_binds else (150, 0)
    points = [pt(25, 200, other_mib=logits), pt(30, 200, other_mib=grads, rec="M.B"),
              pt(31, 200, other_mib=grads, rec="M.B.mlp"), pt(35, 100, other_mib=20)]
    return make_info(stats, points)
