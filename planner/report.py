"""Rendering: tables as strings. Library code returns data; this module only formats it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.measure import MeasuredStep
    from planner.plan import Plan

__all__ = ["plan_summary", "prediction_vs_measurement", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def plan_summary(plan: "Plan") -> str:
    lines = [
        f"SAC plan for {plan.model_name} on {plan.device} (world_size {plan.world_size})",
        f"  budget           {fmt_bytes(plan.budget_bytes)}  (reserve {fmt_bytes(plan.reserve_bytes)},"
        f" usable {fmt_bytes(plan.usable_budget_bytes)})",
        f"  peak, no AC      {fmt_bytes(plan.baseline_peak_bytes)}",
        f"  peak, planned    {fmt_bytes(plan.predicted_peak_bytes)}  (MILP model: {fmt_bytes(plan.solver_peak_bytes)})",
        f"  recompute        {plan.recompute_ms:.3f} ms/step = "
        f"{100 * plan.recompute_ms / plan.baseline_step_ms if plan.baseline_step_ms else 0:.1f}%"
        f" of the {plan.baseline_step_ms:.3f} ms step",
        f"  solver           {plan.solver_status}, {plan.solve_time_s:.2f} s",
        "",
    ]
    if not plan.modules:
        lines.append("  nothing to checkpoint: the step fits as it is")
    else:
        w = max(len(m.fqn) for m in plan.modules)
        lines.append(f"  {'module':<{w}}  {'discard':>7}  {'freed':>10}  {'recompute':>10}  policy")
        for m in plan.modules:
            policy = "full" if m.full else f"SAC: save {len(m.saved_ops)} ops, recompute {len(m.recomputed_ops)}"
            lines.append(
                f"  {m.fqn:<{w}}  {m.discard_ratio:>7.1%}  {fmt_bytes(m.discarded_bytes):>10}  "
                f"{m.recompute_ms:>7.3f} ms  {policy}"
            )
    for n in plan.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def prediction_vs_measurement(plan: "Plan", measured: "MeasuredStep") -> str:
    err = (measured.peak_bytes - plan.predicted_peak_bytes) / plan.predicted_peak_bytes
    within = "within" if measured.peak_bytes <= plan.usable_budget_bytes else "ABOVE"
    return "\n".join(
        [
            f"  predicted peak   {fmt_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes:,} B)",
            f"  measured peak    {fmt_bytes(measured.peak_bytes)} ({measured.peak_bytes:,} B)"
            f"  [{measured.tracker}]",
            f"  error            {err:+.2%}; measured is {within} the usable budget",
            f"  loss             {measured.loss}",
        ]
    )
