"""Rendering: tables as strings. Library code returns data; this module only formats it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from planner.baselines import BaselinePoint
    from planner.floor import PeakBreakdown
    from planner.gradcheck import GradientCheck
    from planner.measure import MeasuredStep
    from planner.plan import Plan
    from planner.tradeoff import StepTimeCurves, TradeoffTable

__all__ = [
    "plan_summary",
    "prediction_vs_measurement",
    "fmt_bytes",
    "byte_unit",
    "tradeoff_table_text",
    "floor_text",
    "gradient_check_text",
    "steps_vs_prediction",
    "step_time_curves_text",
]


_BYTE_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def byte_unit(nbytes: float) -> tuple[int, str]:
    """(bytes per unit, name) of the largest binary unit that ``|nbytes|`` reaches; (1, "B") below
    1 KiB. The one place tables, messages and plot axes choose a unit.

    >>> byte_unit(3 * 2**30), byte_unit(-5 * 2**20), byte_unit(1023)
    ((1073741824, 'GiB'), (1048576, 'MiB'), (1, 'B'))
    """
    return next(((div, name) for div, name in _BYTE_UNITS if abs(nbytes) >= div), (1, "B"))


def fmt_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes in its :func:`byte_unit` with ``digits`` decimals; whole bytes below 1 KiB.

    >>> fmt_bytes(131_173_532), fmt_bytes(0), fmt_bytes(64 * 2**20, digits=0)
    ('125.10 MiB', '0 B', '64 MiB')
    """
    div, unit = byte_unit(n)
    return f"{int(n)} B" if div == 1 else f"{n / div:.{digits}f} {unit}"


def plan_summary(plan: "Plan") -> str:
    lines = [
        f"SAC plan for {plan.model_name} on {plan.device} (world_size {plan.world_size})",
        f"  budget           {fmt_bytes(plan.budget_bytes)}  (reserve {fmt_bytes(plan.reserve_bytes)},"
        f" usable {fmt_bytes(plan.usable_budget_bytes)})",
        f"  peak, no AC      {fmt_bytes(plan.baseline_peak_bytes)}",
        f"  peak, planned    {fmt_bytes(plan.predicted_peak_bytes)}  (MILP model: {fmt_bytes(plan.solver_peak_bytes)})",
        *_binding_line(plan),
        _recompute_line(plan),
        *_timeline_lines(plan),
        f"  solver           {plan.solver_status}"
        + (f", {plan.solve_time_s:.2f} s" if plan.solve_time_s else ""),
        "",
    ]
    if not plan.modules:
        cache = any(n.startswith("use_cache:") for n in plan.notes)
        lines.append("  nothing to checkpoint: the step fits as it is"
                     + (" once applied, with HF use_cache off (see the use_cache note)" if cache else ""))
    else:
        w = max(len(m.fqn) for m in plan.modules)
        lines.append(f"  {'module':<{w}}  {'discard':>7}  {'freed':>10}  {'recompute':>10}  policy")
        for m in plan.modules:
            policy = "full" if m.full else f"SAC: save {len(m.saved_ops)} ops, recompute {len(m.recomputed_ops)}"
            if m.offloaded_ops:
                host = f" ({fmt_bytes(m.offloaded_bytes)})" if m.offloaded_bytes else ""
                policy = f"offload {len(m.offloaded_ops)} ops{host} to host" + (
                    f"; recompute {len(m.recomputed_ops)}" if m.recomputed_ops else "")
            # Freed on the device: what the recompute discards plus what goes to host.
            lines.append(
                f"  {m.fqn:<{w}}  {m.discard_ratio:>7.1%}  {fmt_bytes(m.discarded_bytes + m.offloaded_bytes):>10}  "
                f"{m.recompute_ms:>7.3f} ms  {policy}"
            )
    for n in plan.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def _recompute_line(plan: "Plan") -> str:
    """Recompute time against the step's. The trace is one micro-batch's: with several, the
    figures are per micro-batch (plus the optimizer once), and the step recomputes k times."""
    k = plan.step.micro_batches if plan.step is not None else 1
    pct = 100 * plan.recompute_ms / plan.baseline_step_ms if plan.baseline_step_ms else 0.0
    if k == 1:
        return (f"  recompute        {plan.recompute_ms:.3f} ms/step = {pct:.1f}% of the "
                f"{plan.baseline_step_ms:.3f} ms step")
    return (f"  recompute        {plan.recompute_ms:.3f} ms per micro-batch "
            f"({k * plan.recompute_ms:.3f} ms per step of {k}) = {pct:.1f}% of the "
            f"{plan.baseline_step_ms:.3f} ms of one micro-batch and the optimizer step")


def _timeline_lines(plan: "Plan") -> list[str]:
    """The step on the timeline (absent from plans made before it existed: step_ms == 0)."""
    lines = []
    if plan.host_peak_bytes:
        per_step = (f", {fmt_bytes(plan.host_bytes_per_step)} copied per step"
                    if plan.host_bytes_per_step else "")
        lines.append(f"  host memory      {fmt_bytes(plan.host_peak_bytes)} of offloaded activations "
                     f"at once ({len(plan.offloading)} modules, one micro-batch{per_step})")
    if plan.step_ms:
        k = plan.step.micro_batches if plan.step is not None else 1
        lines.append(
            f"  step timeline    {plan.step_ms:.3f} ms = compute {plan.compute_ms:.3f} + recompute "
            f"{plan.recompute_ms:.3f} + exposed comm {plan.exposed_comm_ms:.3f} + exposed copies "
            f"{plan.exposed_copy_ms:.3f} ms"
            + (f" (one micro-batch of {k}, and the optimizer step)" if k > 1 else ""))
    return lines


def _binding_line(plan: "Plan") -> list[str]:
    if not plan.binding_step:
        return []
    return [
        f"  binds            {plan.binding_step} (first step {fmt_bytes(plan.first_step_peak_bytes)}, "
        f"steady state {fmt_bytes(plan.steady_peak_bytes)})"
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


def floor_text(b: "PeakBreakdown", *, top: int = 4) -> str:
    """One line: the peak op and its largest contributors, e.g. ``"... activations and
    temporaries made in GPT.lm_head: 32.00 MiB (aten.mm 32.00 MiB); parameters: 8.00 MiB; ..."``."""
    where = f"{b.op} in the {b.phase}" + (f" of {b.module}" if b.module else "")
    parts = []
    for c in b.contributors[:top]:
        ops = ", ".join(f"{op.removeprefix('aten.')} {fmt_bytes(n)}" for op, n in c.top_ops)
        parts.append(f"{c.what}: {fmt_bytes(c.memory_bytes)}" + (f" ({ops})" if ops else ""))
    rest = sum(c.memory_bytes for c in b.contributors[top:])
    if rest:
        parts.append(f"the rest: {fmt_bytes(rest)}")
    per_rank = " per rank" if b.world_size > 1 else ""
    return f"at its peak ({fmt_bytes(b.peak_bytes)}{per_rank}, at {where}) the step holds " + "; ".join(parts)


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
