"""A Plan as the lines ``Plan.summary()`` prints.

Takes the plan as an argument and never imports ``planner.plan``, so the Plan can render itself
without an import cycle.
"""

from __future__ import annotations

from typing import Any

from planner.format import fmt_bytes

__all__ = ["plan_summary"]

MAX_ROWS = 200
"""Module rows printed; the rest are counted (``plan.modules`` holds them all)."""
MAX_NOTES = 20
MAX_NOTE_CHARS = 2_000
MAX_NAME_CHARS = 120
"""Names (module, model, device, solver status) printed up to this many characters: a plan file
from anywhere gives a summary of bounded size."""


def plan_summary(plan: Any) -> str:
    lines = [
        f"SAC plan for {_clip(plan.model_name)} on {_clip(plan.device)} (world_size {plan.world_size})",
        f"  budget           {fmt_bytes(plan.budget_bytes)}  (reserve {fmt_bytes(plan.reserve_bytes)},"
        f" usable {fmt_bytes(plan.usable_budget_bytes)})",
        f"  peak, no AC      {fmt_bytes(plan.baseline_peak_bytes)}",
        f"  peak, planned    {fmt_bytes(plan.predicted_peak_bytes)}  (MILP model: {fmt_bytes(plan.solver_peak_bytes)})",
        *_binding_line(plan),
        _recompute_line(plan),
        *_timeline_lines(plan),
        *_pipeline_lines(plan),
        f"  solver           {_clip(plan.solver_status)}"
        + (f", {plan.solve_time_s:.2f} s" if plan.solve_time_s else ""),
        "",
    ]
    if not plan.modules:
        cache = any(n.startswith("use_cache:") for n in plan.notes)
        lines.append("  nothing to checkpoint: the step fits as it is"
                     + (" once applied, with HF use_cache off (see the use_cache note)" if cache else ""))
    else:
        shown = plan.modules[:MAX_ROWS]
        w = max(len(_clip(m.fqn)) for m in shown)
        lines.append(f"  {'module':<{w}}  {'discard':>7}  {'freed':>10}  {'recompute':>10}  policy")
        for m in shown:
            policy = "full" if m.full else f"SAC: save {len(m.saved_ops)} ops, recompute {len(m.recomputed_ops)}"
            if m.offloaded_ops:
                host = f" ({fmt_bytes(m.offloaded_bytes)})" if m.offloaded_bytes else ""
                policy = f"offload {len(m.offloaded_ops)} ops{host} to host" + (
                    f"; recompute {len(m.recomputed_ops)}" if m.recomputed_ops else "")
            # Freed on the device: what the recompute discards plus what goes to host.
            lines.append(
                f"  {_clip(m.fqn):<{w}}  {m.discard_ratio:>7.1%}  {fmt_bytes(m.discarded_bytes + m.offloaded_bytes):>10}  "
                f"{m.recompute_ms:>7.3f} ms  {policy}"
            )
        if len(plan.modules) > MAX_ROWS:
            lines.append(f"  ... and {len(plan.modules) - MAX_ROWS:,} more modules (plan.modules lists them all)")
    for n in plan.notes[:MAX_NOTES]:
        lines.append(f"  note: {_clip(n, MAX_NOTE_CHARS)}")
    if len(plan.notes) > MAX_NOTES:
        lines.append(f"  ... and {len(plan.notes) - MAX_NOTES:,} more notes (plan.notes lists them all)")
    return "\n".join(lines)


def _clip(text: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """``text`` up to ``max_chars`` characters, the cut said; one line (a note's newlines kept
    the summary's lines from being counted)."""
    text = " ".join(text.split()) if "\n" in text or "\r" in text else text
    if len(text) <= max_chars:
        return text
    cut = f" ... ({len(text) - max_chars:,} more characters)"
    return text[:max_chars] + cut


def _recompute_line(plan: Any) -> str:
    """Recompute time against the step's. The trace is one micro-batch's: with several, the
    figures are per micro-batch (plus the optimizer once), and the step recomputes k times."""
    k = plan.step.micro_batches if plan.step is not None else 1
    if getattr(plan, "pipeline", None) is not None:
        k = plan.pipeline.n_microbatches
    pct = 100 * plan.recompute_ms / plan.baseline_step_ms if plan.baseline_step_ms else 0.0
    if k == 1:
        return (f"  recompute        {plan.recompute_ms:.3f} ms/step = {pct:.1f}% of the "
                f"{plan.baseline_step_ms:.3f} ms step")
    return (f"  recompute        {plan.recompute_ms:.3f} ms per micro-batch "
            f"({k * plan.recompute_ms:.3f} ms per step of {k}) = {pct:.1f}% of the "
            f"{plan.baseline_step_ms:.3f} ms of one micro-batch and the optimizer step")


def _timeline_lines(plan: Any) -> list[str]:
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


def _binding_line(plan: Any) -> list[str]:
    if not plan.binding_step:
        return []
    return [
        f"  binds            {plan.binding_step} (first step {fmt_bytes(plan.first_step_peak_bytes)}, "
        f"steady state {fmt_bytes(plan.steady_peak_bytes)})"
    ]


def _pipeline_lines(plan: Any) -> list[str]:
    """A pipeline stage's plan: where it holds and its schedule's timeline, every stage timed like
    this rank's (``planner.distributed.pipeline.pipeline_step`` takes every stage's plan)."""
    rec = getattr(plan, "pipeline", None)
    if rec is None:
        return []
    on_rank = ("stage" if len(rec.rank_stages) == 1 else "stages") + " " + ", ".join(map(str, rec.rank_stages))
    lines = [f"  pipeline         {rec.describe()}; the peaks are its rank's ({on_rank}) over its schedule"]
    if rec.makespan_ms:
        lines.append(f"  step (makespan)  {rec.makespan_ms:.3f} ms, this rank idle {rec.bubble_fraction:.0%} "
                     f"of it (every stage timed like this rank's: F {rec.fw_ms:.3f}, B {rec.bw_ms:.3f}"
                     + (f", W {rec.w_ms:.3f}" if rec.w_ms else "") + " ms per micro-batch)")
        try:
            from estimators.pipeline.summary import uniform_timeline_text

            rows = uniform_timeline_text(rec).splitlines()
            if len(rows) > 16:  # a rank per row: the first and last eight of a long pipeline
                rows = rows[:8] + [f"... {len(rows) - 16:,} more ranks"] + rows[-8:]
            lines += ["    " + row for row in rows]
        except Exception:  # noqa: BLE001 - a drawing: a plan from another torch still summarises
            pass
    return lines
