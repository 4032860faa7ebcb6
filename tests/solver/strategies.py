"""Hypothesis strategies for the solver's property tests: module trees with a consistent step.

``module_infos``: random module trees (no repeated blocks) with a made-up training step run over
them: forward in pre-order (each module saves some bytes after its children ran), backward in
reverse (a module's saved bytes are freed by its own backward), memory points at every module
boundary, so discards never exceed what is live and the no-AC peak is the real one. Curves are
convex (parts sorted by ms per byte) and may start with a forced-recompute jump; some modules
have a fixed recompute cost or keep inputs alive when checkpointed. Child names include prefix
traps ("1" / "10", "a" / "ba").

``stacked_infos``: a root over a stack of 2-5 identical blocks (same stats, different
positions, so the memory points around each block differ), some with recompute growth and
forced discards, named ``M.blocks.<i>...``.
"""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from estimators.contract.module_info import MemoryPoint, ModOrder, ModStats, ModuleInfo, TradeoffCurve

__all__ = ["module_infos", "stacked_infos", "nbytes", "convex_curve", "PROPS"]

MiB = 2**20
PROPS = settings(max_examples=40, deadline=None, derandomize=not os.environ.get("SAC_PROPERTY_RANDOM"),
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""Derandomized, so CI sees the same graphs every run; ``SAC_PROPERTY_RANDOM=1`` draws new ones."""
_NAMES = ("1", "10", "a", "ba", "0", "11", "b", "ab")


def nbytes(draw, hi_mib: int) -> int:
    """Up to ``hi_mib`` MiB, not a whole number of them."""
    return draw(st.integers(0, hi_mib)) * MiB + draw(st.integers(0, 4095))


def convex_curve(draw, size: int) -> TradeoffCurve:
    """A convex trade-off curve over ``size`` bytes in 1-3 parts, maybe after a forced jump."""
    k = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, size - 1)), min_size=k - 1, max_size=k - 1)))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, size]) if b > a]
    ms = [draw(st.floats(0.05, 10.0)) for _ in parts]
    order = sorted(range(len(parts)), key=lambda i: ms[i] / parts[i])  # greedy => convex
    jump = draw(st.sampled_from([0.0, 0.0, 0.5]))
    xs, ys = [0], [0.0]
    if jump:
        xs, ys = [0, 0], [0.0, jump]
    for i in order:
        xs.append(xs[-1] + parts[i])
        ys.append(ys[-1] + ms[i])
    return TradeoffCurve(discarded_bytes=tuple(xs), recompute_ms=tuple(ys))


@st.composite
def module_infos(draw, max_modules: int = 10) -> ModuleInfo:
    n = draw(st.integers(2, max_modules))
    parent = [None] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parent[i]].append(i)
    if any(len(c) > len(_NAMES) for c in children):
        children = [c[: len(_NAMES)] for c in children]
    fqn = {0: "M"}
    for i in range(n):
        for j, c in enumerate(children[i]):
            fqn[c] = f"{fqn[i]}.{_NAMES[j]}"
    own = {i: nbytes(draw, 64) for i in fqn}
    return _simulate(draw, fqn, children, own)


def _simulate(draw, fqn: dict[int, str], children: list[list[int]], own: dict[int, int]) -> ModuleInfo:
    clock = itertools.count(1)
    act, grad = 0, 0
    param, opt = MiB + nbytes(draw, 32), nbytes(draw, 32)  # a step always holds something
    fw_post, bw_pre, pre_order, points = {}, {}, [], []

    def point(t: int, phase: str, rec: str | None = None, extra: int = 0) -> None:
        points.append(MemoryPoint(op_index=t, phase=phase, param_bytes=param, grad_bytes=grad,
                                  optimizer_bytes=opt, activation_bytes=act, other_bytes=extra,
                                  recompute_of=rec))

    def fw(i: int) -> None:
        nonlocal act
        pre_order.append(i)
        for c in children[i]:
            fw(c)
        act += own[i]
        point(next(clock), "fw", extra=nbytes(draw, 16))  # the module's last op, still inside
        fw_post[i] = next(clock)

    def bw(i: int) -> None:
        nonlocal act, grad
        bw_pre[i] = next(clock)
        point(bw_pre[i], "bw", rec=fqn[i] if children[i] else None, extra=nbytes(draw, 16))
        act -= own[i]
        grad += nbytes(draw, 8)
        for c in reversed(children[i]):
            bw(c)

    fw(0)
    point(next(clock), "fw", extra=nbytes(draw, 64))  # loss / logits
    bw(0)
    subtree = {i: own[i] for i in fqn}
    for i in reversed(pre_order):
        subtree[i] += sum(subtree[c] for c in children[i])
    stats = []
    for i in pre_order:
        leaf, size = not children[i], subtree[i] if children[i] else 0
        curve = convex_curve(draw, size) if size else TradeoffCurve()
        stats.append(ModStats(
            fqn=fqn[i], is_leaf=leaf, sac_memory_bytes=size, sac_runtime_ms=curve.total_ms,
            tradeoff=curve, fw_post_op=fw_post[i], bw_pre_op=bw_pre[i],
            recompute_fixed_ms=draw(st.sampled_from([0.0, 0.0, 0.3])) if size else 0.0,
            recompute_transient_bytes=nbytes(draw, 8) if size and draw(st.booleans()) else 0,
            checkpoint_retain_bytes=nbytes(draw, 4) if size and draw(st.booleans()) else 0,
        ))
    names = tuple(s.fqn for s in stats)
    order = ModOrder(fw_pre_order=names, fw_post_order=(), bw_pre_order=(), bw_post_order=())
    return ModuleInfo(mod_order=order, mod_stats=tuple(stats), memory_points=tuple(points),
                      peak_bytes=max(p.total_bytes for p in points))


@st.composite
def block_templates(draw) -> list[tuple[str, int, int]]:
    """A block's subtree as (relative name, parent index, own saved bytes), block first."""
    nodes = [("", -1, nbytes(draw, 32))]
    for i in range(draw(st.integers(0, 4))):
        parent = draw(st.integers(0, len(nodes) - 1))
        nodes.append((f"m{i}", parent, nbytes(draw, 32)))
    return nodes


@st.composite
def stacked_infos(draw) -> ModuleInfo:
    """Root -> [prologue] + n identical blocks + [epilogue], simulated like test_milp_properties."""
    template = draw(block_templates())
    n_blocks = draw(st.integers(2, 5))
    children = {i: [j for j, (_, p, _) in enumerate(template) if p == i] for i in range(len(template))}
    size = {}
    for i in reversed(range(len(template))):
        size[i] = template[i][2] + sum(size[c] for c in children[i])
    # One draw per template module: every copy gets the same numbers.
    shared = {}
    for i in range(len(template)):
        leaf = not children[i]
        s = 0 if leaf else size[i]
        curve = convex_curve(draw, s) if s else TradeoffCurve()
        growth = ()
        if s and draw(st.booleans()):  # the traced model's recompute growth (non-decreasing)
            steps = [draw(st.integers(0, 2 * MiB)) + b - a for a, b in zip(curve.discarded_bytes,
                                                                            curve.discarded_bytes[1:])]
            growth = tuple(itertools.accumulate([draw(st.integers(0, 4 * MiB)), *steps]))
        shared[i] = dict(
            is_leaf=leaf, sac_memory_bytes=s, sac_runtime_ms=curve.total_ms, tradeoff=curve,
            recompute_fixed_ms=draw(st.sampled_from([0.0, 0.3])) if s else 0.0,
            recompute_transient_bytes=nbytes(draw, 8) if s and draw(st.booleans()) else 0,
            checkpoint_retain_bytes=nbytes(draw, 2) if s and draw(st.booleans()) else 0,
            forced_discard_bytes=nbytes(draw, 2) if s and draw(st.booleans()) else 0,
            recompute_growth_bytes=growth,
        )
    clock = itertools.count(1)
    param, opt = MiB + nbytes(draw, 32), nbytes(draw, 16)
    state = {"act": 0, "grad": 0}
    points, fw_post, bw_pre, order = [], {}, {}, []
    # Per-position extras: the blocks are identical, their surroundings are not.
    extra_fw = [nbytes(draw, 8) for _ in range(n_blocks)]
    extra_bw = [nbytes(draw, 8) for _ in range(n_blocks)]
    grad_step = [nbytes(draw, 4) for _ in range(n_blocks)]

    def point(t, phase, rec=None, extra=0):
        points.append(MemoryPoint(op_index=t, phase=phase, param_bytes=param,
                                  grad_bytes=state["grad"], optimizer_bytes=opt,
                                  activation_bytes=state["act"], other_bytes=extra,
                                  recompute_of=rec))

    def fw(b, i, name):
        order.append((name, i))
        for c in children[i]:
            fw(b, c, f"{name}.{template[c][0]}")
        state["act"] += template[i][2]
        point(next(clock), "fw", extra=extra_fw[b])
        fw_post[name] = next(clock)

    def bw(b, i, name):
        bw_pre[name] = next(clock)
        point(bw_pre[name], "bw", rec=name if children[i] else None, extra=extra_bw[b])
        state["act"] -= template[i][2]
        state["grad"] += grad_step[b]
        for c in reversed(children[i]):
            bw(b, c, f"{name}.{template[c][0]}")

    blocks = [f"M.blocks.{b}" for b in range(n_blocks)]
    point(next(clock), "fw")
    for b, name in enumerate(blocks):
        fw(b, 0, name)
    fw_post["M"] = next(clock)
    point(fw_post["M"], "fw", extra=nbytes(draw, 32))  # loss
    bw_pre["M"] = next(clock)
    point(bw_pre["M"], "bw", rec="M", extra=nbytes(draw, 8))
    for b in reversed(range(n_blocks)):
        bw(b, 0, blocks[b])
    total = sum(size[0] for _ in blocks)
    root_curve = convex_curve(draw, total)
    stats = [ModStats(fqn="M", is_leaf=False, sac_memory_bytes=total, tradeoff=root_curve,
                      sac_runtime_ms=root_curve.total_ms, fw_post_op=fw_post["M"],
                      bw_pre_op=bw_pre["M"])]
    stats += [ModStats(fqn=name, fw_post_op=fw_post[name], bw_pre_op=bw_pre[name], **shared[i])
              for name, i in order]
    names = tuple(s.fqn for s in stats)
    return ModuleInfo(mod_order=ModOrder(fw_pre_order=names, fw_post_order=(), bw_pre_order=(),
                                         bw_post_order=()),
                      mod_stats=tuple(stats), memory_points=tuple(points),
                      peak_bytes=max(p.total_bytes for p in points))
