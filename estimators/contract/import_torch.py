"""Import what ``torch.distributed._tools.ilp_utils.aggregate_stats`` returns as a ModuleInfo.

torch's MILP (``sac_ilp.sac_milp``) evaluates memory once per module i, at its backward::

    m_i = act_total_i + act_grad_i + (param_root + grad_total_i) / world_size - sum d_j
          over modules j whose forward ended before i's (fw post-order position)
    d_j = ACM_j r_j - (ACM_j - IA_j) y_j        ACM = sac_memory, IA = act_fw_per_module

i.e. ratio r of the module's op memory ACM is discarded, but the first ACM - IA of it was never
kept by autograd and frees nothing. The import reproduces that model exactly in our terms:

* one MemoryPoint per module i at op index ``3 pos_i + 1`` (``pos`` = fw post-order position)
  with param = root params, grad = grad_total_i, activation = act_total_i, other = act_grad_i;
* ``fw_post_op_j = 3 pos_j + 2`` (so j counts at i's point iff pos_j < pos_i) and every
  ``bw_pre_op`` after all points (torch never brings a discard back);
* ``sac_memory_bytes = IA`` and the exact curve ``bytes = ACM x - (ACM - IA)``,
  ``ms = sac_runtime f(x)``, where ``f`` is torch's ``tradeoff_curve`` (keys shifted back by the
  0.01 its SACEstimator adds) taken exactly, not its pwlf fit. Recomputing costs at least
  ``f((ACM - IA) / ACM)``, a zero-byte step at the start of our curve.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from estimators.contract.module_info import (
    MemoryPoint,
    ModOrder,
    ModStats,
    ModuleInfo,
    ModuleInfoFormatError,
    Phase,
    TradeoffCurve,
    finite_or_raise,
)

__all__ = ["module_info_from_torch_dict"]

_KEY_SHIFT = 1e-2
"""torch's SACEstimator adds this to every discard ratio it stores in ``tradeoff_curve``."""
_ORDERS = ("fw_pre_order", "fw_post_order", "bw_pre_order", "bw_post_order")
_STAT_KEYS = (
    "fqn", "param_per_module", "grad_per_module", "grad_total", "act_fw_per_module",
    "act_bw_per_module", "act_grad_per_module", "act_total", "input_per_module",
    "output_per_module", "fw_runtime_per_module", "bw_runtime_per_module", "is_leaf",
    "sac_runtime", "sac_memory", "tradeoff_curve",
)
_NUMBERS = tuple(k for k in _STAT_KEYS if k not in ("fqn", "is_leaf", "tradeoff_curve"))


def module_info_from_torch_dict(info: Mapping[str, Any]) -> ModuleInfo:
    """A ModuleInfo whose memory model equals torch's sac_milp model (see the module docstring)."""
    order = _mod_order(info)
    stats = _stat_dicts(info, order)
    post = {f: i for i, f in reversed(list(enumerate(order.fw_post_order)))}  # first occurrence
    n = len(stats)
    bw_pre = {f: i for i, f in reversed(list(enumerate(order.bw_pre_order)))}
    bw_post = {f: i for i, f in reversed(list(enumerate(order.bw_post_order)))}
    bw_base = 3 * n + 3  # every backward index lies after every memory point
    root_params = int(stats[0]["param_per_module"])
    mods, points = [], []
    for k, s in enumerate(stats):
        fqn, pos = s["fqn"], post[s["fqn"]]
        first = pos - _subtree_size(stats, k) + 1
        size, curve = _curve(s)
        mods.append(ModStats(
            fqn=fqn, is_leaf=bool(s["is_leaf"]),
            param_bytes=int(s["param_per_module"]), grad_bytes=int(s["grad_per_module"]),
            input_bytes=int(s["input_per_module"]), output_bytes=int(s["output_per_module"]),
            act_fw_bytes=int(s["act_fw_per_module"]), act_total_bytes=int(s["act_total"]),
            grad_total_bytes=int(s["grad_total"]), act_bw_peak_bytes=int(s["act_bw_per_module"]),
            act_grad_bytes=int(s["act_grad_per_module"]),
            fw_runtime_ms=float(s["fw_runtime_per_module"]),
            bw_runtime_ms=float(s["bw_runtime_per_module"]),
            sac_memory_bytes=size, sac_runtime_ms=curve.total_ms, tradeoff=curve,
            fw_pre_op=3 * first, fw_post_op=3 * pos + 2,
            bw_pre_op=bw_base + 3 * bw_pre[fqn] if fqn in bw_pre else -1,
            bw_post_op=bw_base + 3 * (len(order.bw_pre_order) + bw_post[fqn]) if fqn in bw_post else -1,
        ))
        points.append(MemoryPoint(
            op_index=3 * pos + 1, phase=Phase.BW, fqn=fqn, param_bytes=root_params,
            grad_bytes=int(s["grad_total"]), activation_bytes=int(s["act_total"]),
            other_bytes=int(s["act_grad_per_module"]),
        ))
    peak = max(points, key=lambda p: p.total_bytes)
    return ModuleInfo(
        mod_order=order, mod_stats=tuple(mods), memory_points=tuple(points),
        peak_bytes=peak.total_bytes, peak_op_index=peak.op_index, peak_op=f"backward of {peak.fqn}",
        fw_runtime_ms=float(stats[0]["fw_runtime_per_module"]),
        bw_runtime_ms=float(stats[0]["bw_runtime_per_module"]),
    )


def _mod_order(info: Mapping[str, Any]) -> ModOrder:
    if not isinstance(info, Mapping) or "mod_order" not in info or "mod_stats" not in info:
        raise ModuleInfoFormatError(
            "not an aggregate_stats() result: need keys 'mod_order' and 'mod_stats' "
            "(for a SAC Planner JSON use ModuleInfo.from_dict)"
        )
    raw = info["mod_order"]
    missing = [k for k in _ORDERS if k not in raw]
    if missing:
        raise ModuleInfoFormatError(f"mod_order misses {missing}")
    return ModOrder(**{k: tuple(raw[k]) for k in _ORDERS})


def _stat_dicts(info: Mapping[str, Any], order: ModOrder) -> list[Mapping[str, Any]]:
    stats = list(info["mod_stats"])
    if not stats:
        raise ModuleInfoFormatError("mod_stats is empty")
    for s in stats:
        missing = [k for k in _STAT_KEYS if k not in s]
        if missing:
            raise ModuleInfoFormatError(f"module {s.get('fqn', '?')!r} misses keys {missing}")
        finite_or_raise((float(s[k]) for k in _NUMBERS), f"module {s['fqn']!r}")
        finite_or_raise((float(v) for kv in s["tradeoff_curve"].items() for v in kv),
                        f"tradeoff_curve of {s['fqn']!r}")
    pre = {f: i for i, f in reversed(list(enumerate(order.fw_pre_order)))}
    absent = [s["fqn"] for s in stats if s["fqn"] not in pre or s["fqn"] not in order.fw_post_order]
    if absent:
        raise ModuleInfoFormatError(f"modules missing from mod_order fw_pre/fw_post_order: {absent[:5]}")
    return sorted(stats, key=lambda s: pre[s["fqn"]])  # torch's parse_module_info does the same


def _subtree_size(stats: Sequence[Mapping[str, Any]], k: int) -> int:
    """Modules under stats[k] (itself included); in pre-order they follow it contiguously."""
    prefix, size = stats[k]["fqn"] + ".", 1
    while k + size < len(stats) and stats[k + size]["fqn"].startswith(prefix):
        size += 1
    return size


def _curve(s: Mapping[str, Any]) -> tuple[int, TradeoffCurve]:
    """(sac_memory_bytes, exact curve in bytes/ms) reproducing torch's d = ACM r - (ACM - IA)."""
    acm, ia, total_ms = float(s["sac_memory"]), float(s["act_fw_per_module"]), float(s["sac_runtime"])
    if s["is_leaf"] or acm <= 0 or ia <= 0 or not s["tradeoff_curve"]:
        return 0, TradeoffCurve()
    acm = max(acm, ia)  # sac_milp overrides a smaller ACM with IA
    pts = sorted((max(0.0, float(k) - _KEY_SHIFT), float(v)) for k, v in s["tradeoff_curve"].items())
    x_min = (acm - ia) / acm
    xs = [x_min] + [x for x, _ in pts if x_min < x < 1.0] + [1.0]
    bytes_ = [0] + [int(round(acm * x - (acm - ia))) for x in xs]
    # torch's curve at each ratio: flat before its first and after its last point, linear between.
    curve = np.interp(xs, [x for x, _ in pts], [y for _, y in pts])
    ms = [0.0] + [total_ms * float(y) for y in curve]
    for i in range(1, len(bytes_)):  # rounding must not make the curve step back
        bytes_[i] = max(bytes_[i], bytes_[i - 1])
    return bytes_[-1], TradeoffCurve(discarded_bytes=tuple(bytes_), recompute_ms=tuple(ms))
