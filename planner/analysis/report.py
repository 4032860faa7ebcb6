"""Rendering: tables as strings. Library code returns data; this module only formats it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from planner.format import fmt_bytes

if TYPE_CHECKING:
    from planner.planning.baselines import BaselinePoint
    from planner.analysis.gradcheck import GradientCheck
    from planner.analysis.measure import MeasuredStep
    from planner.plan import Plan
    from planner.planning.tradeoff import StepTimeCurves, TradeoffTable

__all__ = [
    "prediction_vs_measurement",
    "tradeoff_table_text",
    "gradient_check_text",
    "steps_vs_prediction",
    "step_time_curves_text",
]


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


def steps_vs_prediction(plan: "Plan", measured: "Sequence[MeasuredStep]", comparable: bool = True) -> str:
    """Each real step's measured peak beside the prediction (step 1: the first step of a fresh
    run; later ones: the steady state). ``comparable`` False (a GPU plan or a per-rank one
    measured in this process): no verdict against the budget."""
    tracker = measured[0].tracker if measured else ""
    first = plan.first_step_peak_bytes
    lines = [
        f"  predicted peak   {fmt_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes:,} B)"
        + (f", {plan.binding_step} binds" if plan.binding_step else "")
        + (f"; first step {fmt_bytes(first)} ({first:,} B)" if first is not None else ""),
        f"  {'step':>4}  {'measured peak':>24}  {'vs predicted':>12}  {'vs usable budget':>16}  loss",
    ]
    for i, m in enumerate(measured, 1):
        # Step 1 against the first step's own prediction (no optimizer state before its update).
        want = first if i == 1 and first is not None else plan.predicted_peak_bytes
        err = (m.peak_bytes - want) / want
        within = ("within" if m.peak_bytes <= plan.usable_budget_bytes else "ABOVE") if comparable else "-"
        lines.append(
            f"  {i:>4}  {fmt_bytes(m.peak_bytes):>10} ({m.peak_bytes:>11,} B)  {err:>+12.2%}  "
            f"{within:>16}  {m.loss}"
        )
    lines.append(f"  measured by {tracker}")
    return "\n".join(lines)


def _pct(p: float | None) -> str:
    return f"{p:5.1f}%" if p is not None else "     -"


def tradeoff_table_text(
    table: "TradeoffTable", baselines: "Sequence[BaselinePoint] | None" = None
) -> str:
    """The sweep as a text table (``*``: on the Pareto frontier), then each baseline beside the
    cheapest sweep point whose peak is at or below the baseline's.

    >>> print(tradeoff_table_text(table, hand_made_baselines(info)))   # doctest: +SKIP
    """
    lines = [
        f"Trade-off sweep (world_size {table.world_size}): no-AC peak "
        f"{fmt_bytes(table.no_ac_peak_bytes)}, smallest reachable {fmt_bytes(table.min_reachable_peak_bytes)}, "
        f"step {table.step_ms:.3f} ms; built in {table.build_time_s:.2f} s, "
        f"{len(table.rows)} solves in {table.sweep_time_s:.2f} s",
        f"  {'budget':>11}  {'status':<10}  {'peak':>11}  {'recompute':>12}  {'of step':>7}  "
        f"{'ckpt':>4}  pareto",
    ]
    for r in table.rows:
        peak = fmt_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes is not None else "-"
        ms = f"{r.recompute_ms:9.3f} ms" if r.recompute_ms is not None else "-"
        lines.append(
            f"  {fmt_bytes(r.budget_bytes):>11}  {r.status.value:<10}  {peak:>11}  {ms:>12}  "
            f"{_pct(r.recompute_pct_of_step):>7}  {r.n_checkpointed:>4}  {'*' if r.on_pareto else ''}"
        )
    if baselines:
        lines += ["", _baseline_text(table, baselines)]
    return "\n".join(lines)


def _baseline_text(table: "TradeoffTable", baselines: "Sequence[BaselinePoint]") -> str:
    w = max(len(b.name) for b in baselines)
    lines = [f"  {'baseline':<{w}}  {'peak':>11}  {'recompute':>12}  {'of step':>7}  "
             "best sweep point at <= that peak"]
    for b in baselines:
        best = table.cheapest_under(b.predicted_peak_bytes)
        vs = (f"{best.recompute_ms:.3f} ms at {fmt_bytes(best.predicted_peak_bytes)}"
              if best is not None else "none (below the sweep's smallest point)")
        lines.append(f"  {b.name:<{w}}  {fmt_bytes(b.predicted_peak_bytes):>11}  "
                     f"{b.recompute_ms:9.3f} ms  {_pct(b.recompute_pct_of_step):>7}  {vs}")
    return "\n".join(lines)


def gradient_check_text(check: "GradientCheck") -> str:
    """The planned vs unplanned step, as lines for the CLI."""
    verdict = "bitwise EQUAL" if check.equal else "DIFFERENT"
    lines = [
        f"  gradients        {verdict}: loss and {check.n_params_compared} parameter gradients compared"
        f" (seed {check.seed}); max |diff| {check.max_abs_diff:.3g}",
    ]
    if check.loss_planned != check.loss_reference or not check.equal:
        lines.append(f"  loss             planned {check.loss_planned!r}, unplanned {check.loss_reference!r}")
    if check.differing:
        lines.append(f"  differing        {', '.join(check.differing[:8])}"
                     + (f" (+{len(check.differing) - 8} more)" if len(check.differing) > 8 else ""))
    if check.equal_with_cache_off is not None:
        lines.append(f"  use_cache off    {check.note}")
    return "\n".join(lines)


def step_time_curves_text(curves: "StepTimeCurves") -> str:
    """Recompute-only beside keep / recompute / offload, step time per budget, then baselines."""
    def ms(v: float | None) -> str:
        return f"{v:10.3f}" if v is not None else f"{'-':>10}"

    lines = [f"no AC: peak {fmt_bytes(curves.no_ac_peak_bytes)}, step {curves.no_ac_step_ms:.3f} ms",
             f"{'budget':>12}  {'recompute-only':>14}  {'three-way':>10}  {'exp. copy':>10}  {'host':>10}"]
    for r in curves.rows:
        host = fmt_bytes(r.three_way_host_bytes) if r.three_way_host_bytes is not None else "-"
        lines.append(f"{fmt_bytes(r.budget_bytes):>12}  {ms(r.recompute_only_step_ms):>14}  "
                     f"{ms(r.three_way_step_ms)}  {ms(r.three_way_exposed_copy_ms)}  {host:>10}")
    if curves.baselines:
        lines.append("hand-made baselines (step time on the same timeline):")
        for b in curves.baselines:
            lines.append(f"  {b.name:32s} peak {fmt_bytes(b.predicted_peak_bytes):>10}  step {b.step_ms:10.3f} ms")
    return "\n".join(lines)
