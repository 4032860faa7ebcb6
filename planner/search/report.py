"""The search's result for a reader: the ranked table, the families left out and why, the published
configurations beside, a plot, and the winner as a torchtitan job and plan files.

    print(result_text(result, top=20))
    write_outputs(result, "out/")      # search.txt, search.png (matplotlib), torchtitan_job.py, plans/
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

from planner.format import GiB, byte_unit, fmt_bytes
from planner.search.results import Evaluation, Status

__all__ = ["result_text", "write_outputs", "torchtitan_job", "plot_result"]

logger = logging.getLogger(__name__)

_STATUS = {Status.FITS: "fits", Status.PLANNED: "planned", Status.OVER: "over", Status.NOT_EVALUATED: "n/e",
           Status.BOUNDED: "bounded"}


class _Units:
    """The table's units: memory in the budget's unit, time in s (ms where steps are under 1 s)."""

    def __init__(self, result) -> None:
        self.mem_div, self.mem = byte_unit(result.cluster.usable_bytes)
        steps = sorted(e.step_ms for e in result.ranked) or [0.0]
        self.t_div, self.t = (1e3, "s") if steps[len(steps) // 2] >= 1e3 else (1.0, "ms")

    def time(self, ms: float) -> str:
        return f"{ms / self.t_div:.2f}"

    def header(self) -> str:
        return (f"{'#':>4} {'layout (degrees > 1, micro-batch x accumulation)':<44} {'status':<7} "
                f"{'peak ' + self.mem:>9} {'ckpt':>5} {'recomp ' + self.t:>9} {'comm ' + self.t:>8} "
                f"{'bubble':>7} {'step ' + self.t:>8} {'tokens/s':>10} {'MFU*':>6}")

    def row(self, result, i, e: Evaluation) -> str:
        t = e.time
        peak = f"{e.peak_bytes / self.mem_div:9.2f}" if e.peak_bytes else f"{'-':>9}"
        mark = "+" if _fsdp_under_pp(e.layout) else ""
        head = f"{i:>4} {e.layout.describe() + mark:<44} {_STATUS[e.status]:<7} {peak}"
        if t is None:
            return head
        return (f"{head} {e.checkpointed:>5} {self.time(t.recompute_ms):>9} {self.time(t.exposed_comm_ms):>8} "
                f"{self.time(t.bubble_ms):>7} {self.time(t.step_ms):>8} {result.tokens_per_s(e):>10,.0f} "
                f"{100 * result.mfu(e):>5.1f}%")


def result_text(result, *, top: int = 20) -> str:
    """The whole report as text (see the module docstring)."""
    c = result.cluster
    ranked = result.ranked
    units = _Units(result)
    lines = [
        f"{result.model} ({result.param_dtype} parameters and AdamW state, traced in that dtype): global batch "
        f"{result.global_batch} x {result.seq_len} tokens on {c.describe()} "
        f"(usable {fmt_bytes(c.usable_bytes)} per GPU after the reserve)",
        f"{result.enumerated.raw_count} layouts enumerated, {len(result.enumerated.rejected)} rejected before "
        f"planning, {len(result.evaluations)} evaluated ({len(ranked)} run under the budget, "
        f"{sum(e.status is Status.FITS for e in ranked)} verified, {_bounded(result)} proven slower than the "
        f"fastest by a lower bound of their step and not ranked); {result.programs_traced} per-rank programs "
        f"traced in {result.trace_s:.1f} s; search {result.wall_s:.1f} s wall, {result.cpu_s:.1f} s CPU "
        f"(load average {', '.join(f'{x:.1f}' for x in result.load_average)})",
        "",
        units.header(),
    ]
    lines += [units.row(result, i, e) for i, e in enumerate(ranked[:top], 1)]
    if len(ranked) > top:
        lines.append(f"{'':>4} ... {len(ranked) - top} more")
    lines += _headroom(result)
    lines += ["", *_legend(result, units), "", *_left_out(result), "", *_published(result, units)]
    return "\n".join(lines)


def _bounded(result) -> int:
    return sum(e.status is Status.BOUNDED for e in result.evaluations)


def _legend(result, units: _Units) -> list[str]:
    from estimators.runtime.device import get_interconnect

    link = result.cluster.spec.collective_link
    inter = get_interconnect(result.cluster.inter_node_link).name
    within = f"ring collectives on {link.name} within a node and" if link else \
        f"{result.cluster.spec.name} names no link: collectives on"
    return [
        "status: fits = the plan traced with it applied (or the unplanned step) is within the budget on every rank;",
        "        planned = the MILP's per-rank plan is within the budget, not traced (not called a fit).",
        f"peak {units.mem}: the binding rank's per-rank peak (the planner's figure: exact where it fits). ckpt: modules",
        f"        checkpointed. recomp / comm / bubble / step: {units.t} per optimizer step; comm = collective time",
        "        the compute stream waits for (FSDP2/HSDP, TP/SP/CP, PP hand-overs).",
        f"* Times, tokens/s and MFU are MODELLED, not measured: roofline on {result.cluster.spec.name}'s datasheet, "
        + within,
        f"  {inter} between nodes; no GPU has run these layouts. MFU = torchtitan's FLOPs per token x tokens/s",
        "  / dense bf16 peak.",
    ] + ([
        "+ FSDP2 under PP by a rule, not traced: each pipeline rank planned holding its stages whole, its peak",
        "  shifted by + its parameter shard - the optimizer state other ranks hold (docs/search.md).",
    ] if any(_fsdp_under_pp(e.layout) for e in result.evaluations) else [])


def _headroom(result) -> list[str]:
    """A hint where the winner runs the largest micro-batch tried, accumulates, and keeps less than
    half the budget: twice its micro-batch would likely fit and may be faster (fewer, larger
    micro-batches expose less communication), but the search did not try it."""
    win = result.winner
    if win is None or win.layout.pp > 1 or win.layout.accumulation < 2 or not win.peak_bytes:
        return []
    largest = max(e.layout.micro_batch for e in result.evaluations)
    usable = result.cluster.usable_bytes
    if win.layout.micro_batch < largest or 2 * win.peak_bytes > usable:
        return []
    tried = sorted({e.layout.micro_batch for e in result.evaluations})
    more = ",".join(map(str, [*tried, 2 * largest]))
    return [f"{'':>4} the winner runs the largest micro-batch tried ({largest}) at {fmt_bytes(win.peak_bytes)} of "
            f"{fmt_bytes(usable)}: a larger one may be faster; try --micro-batches {more} (SearchSpace.micro_batches)"]


def _fsdp_under_pp(layout) -> bool:
    return layout.pp > 1 and layout.fsdp_size > 1


def _left_out(result) -> list[str]:
    """Families with no layout under the budget, or not evaluated, and why."""
    out = ["Left out, by family (which rank, what fills it):"]
    by_family: dict[str, list] = defaultdict(list)
    for r in result.enumerated.rejected:
        by_family[r.layout.family].append(("rejected: " + r.reason, r.detail, r.layout, None))
    for e in result.evaluations:
        if not e.runs:
            by_family[e.layout.family].append((e.status.value, e.why, e.layout, e.peak_bytes))
    running = {e.layout.family for e in result.ranked}
    for fam in sorted(by_family, key=lambda f: (f in running, f)):
        items = by_family[fam]
        head = f"  {fam}: " + ("no layout runs" if fam not in running else "some layouts left out")
        out.append(head + f" ({len(items)} left out)")
        kinds: dict[str, list] = defaultdict(list)
        for kind, why, layout, peak in items:
            kinds[kind].append((peak or 0, why, layout))
        for kind, xs in sorted(kinds.items()):
            peak, why, layout = min(xs, key=lambda x: (x[0] or float("inf"), x[2]))
            out.append(f"    {kind} x{len(xs)}; e.g. {layout.describe()}: {why}")
    return out


def _published(result, units: _Units) -> list[str]:
    if not result.published:
        return ["Published configurations: none known for this model."]
    out = ["Published configurations, placed on this cluster:"]
    win = result.ranked[0] if result.ranked else None
    for pub, e, full in result.published:
        out.append(f"  {pub.name}: {pub.as_published}")
        if pub.layout is None:
            out.append(f"    not placed: {pub.note}")
            continue
        out.append(f"    as {pub.layout.describe()} ({pub.note})")
        rank = result.rank_of(pub.layout)
        if e.runs:
            out.append(f"    with the planner's plan: ranks {rank} of {len(result.ranked)}, {units.time(e.step_ms)} {units.t} "
                       f"per step, peak {fmt_bytes(e.peak_bytes)} ({e.status.value}){_versus(e, win, units)}")
        else:
            out.append(f"    with the planner's plan: {e.status.value}: {e.why}")
        if full is not None:
            verdict = "within" if full.runs else "over"
            out.append(f"    as published (every block checkpointed): {units.time(full.step_ms)} {units.t} per step, peak "
                       f"{fmt_bytes(full.peak_bytes)} ({verdict} the budget, the MILP's figure), recompute "
                       f"{units.time(full.time.recompute_ms)} {units.t}")
    return out


def _versus(e: Evaluation, win: Evaluation | None, units: _Units) -> str:
    if win is None or e.layout == win.layout or e.time is None:
        return "; the search's fastest" if win is not None and e.layout == win.layout else ""
    a, b = e.time, win.time
    parts = [(n, x - y) for n, x, y in (("compute", a.compute_ms, b.compute_ms), ("recompute", a.recompute_ms, b.recompute_ms),
                                        ("exposed comm", a.exposed_comm_ms, b.exposed_comm_ms), ("bubble", a.bubble_ms, b.bubble_ms))]
    parts = [f"{n} {d / units.t_div:+.2f} {units.t}" for n, d in sorted(parts, key=lambda p: -abs(p[1]))
             if abs(d) >= 0.005 * b.step_ms]
    return f"; vs the fastest ({win.layout.describe()}): " + (", ".join(parts) or "the same")


def plot_result(result, path: str | Path) -> bool:
    """Step time vs per-rank peak, one marker per family, the usable budget marked; False without
    matplotlib (``pip install -e ".[plot]"``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    fams: dict[str, list[Evaluation]] = defaultdict(list)
    for e in result.evaluations:
        if e.time is not None:
            fams[e.layout.family].append(e)
    for fam, es in sorted(fams.items()):
        ax.scatter([e.peak_bytes / GiB for e in es], [e.step_ms / 1e3 for e in es], label=fam, s=18)
    ax.axvline(result.cluster.usable_bytes / GiB, color="k", linestyle="--", label="usable budget")
    if result.winner is not None:
        w = result.winner
        ax.scatter([w.peak_bytes / GiB], [w.step_ms / 1e3], marker="*", s=200, color="gold", edgecolor="k",
                   label=f"fastest that fits: {w.layout.describe()}")
    ax.set_xlabel("per-rank peak (GiB)")
    ax.set_ylabel("step time (s, modelled)")
    ax.set_title(f"{result.model} on {result.cluster.n_gpus} x {result.cluster.spec.name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def torchtitan_job(result, plan_dir: str = "plans") -> str:
    """The winner as a torchtitan 0.3.0 config registry module (``--module <file> --config sac_advisor``)."""
    from planner.search.published import TORCHTITAN_RECIPES

    w = result.winner
    if w is None:
        raise ValueError("no layout fits: nothing to write")
    t = w.layout
    cfg = getattr(result, "model_config", None)
    recipe = TORCHTITAN_RECIPES[(cfg.n_layers, cfg.dim)][0] if cfg is not None and \
        (cfg.n_layers, cfg.dim) in TORCHTITAN_RECIPES else "llama3_debugmodel"
    ac = ("None  # the step fits without checkpointing" if not w.plans or not any(p.modules for p in w.plans) else
          f'PlannedAC.Config(plan_path="{plan_dir}/rank0.json")  # see the note on plan files below')
    local = t.micro_batch * t.accumulation if t.pp > 1 else t.micro_batch
    pp = "" if t.pp == 1 else (f"    p.pipeline_parallel_schedule = \"{t.schedule}\"\n"
                                f"    p.pipeline_parallel_microbatch_size = {t.micro_batch}\n"
                                f"    p.pipeline_parallel_layers_per_stage = None\n")
    return f'''"""The launch advisor's fastest layout that fits, as a torchtitan 0.3.0 job config.

{result.model}, {result.cluster.describe()}, global batch {result.global_batch} x {result.seq_len} tokens:
{t.describe()} ({t.family}); per-rank peak {w.peak_bytes / GiB:.2f} GiB (verified), step {w.step_ms / 1e3:.2f} s
(modelled: no GPU measured it).

    torchrun --nnodes {max(1, result.cluster.n_gpus // result.cluster.gpus_per_node)} --nproc_per_node \\
        {min(result.cluster.n_gpus, result.cluster.gpus_per_node)} -m torchtitan.train --module torchtitan_job --config sac_advisor

Plan files (plans/): made for examples.llama.Llama (torchtitan's module names); torchtitan's own
Llama3Model has another fingerprint, so PlannedAC refuses them there: plan that model with this layout
(planner.distributed.fake_world) before launch where the step needs checkpointing.
"""

from torchtitan.models.llama3.config_registry import {recipe}


def sac_advisor():
    config = {recipe}()
    p = config.parallelism
    p.tensor_parallel_degree = {t.tp}
    p.context_parallel_degree = {t.cp}
    p.pipeline_parallel_degree = {t.pp}
    p.data_parallel_shard_degree = {t.dp_shard}
    p.data_parallel_replicate_degree = {t.dp_replicate}
{pp}    config.training.local_batch_size = {local}
    config.training.global_batch_size = {result.global_batch}
    config.training.seq_len = {result.seq_len}
    config.activation_checkpoint = {ac}
    return config
''' + ("" if "PlannedAC" not in ac else "\n\nfrom planner.integrations.torchtitan import PlannedAC  # noqa: E402\n")


def write_outputs(result, out: str | Path, *, top: int = 20) -> list[Path]:
    """search.txt, search.png (with matplotlib), and, where a layout fits, torchtitan_job.py and
    plans/ (one plan file per distinct rank of the winner); returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "search.txt"]
    written[0].write_text(result_text(result, top=top) + "\n")
    if plot_result(result, out / "search.png"):
        written.append(out / "search.png")
    w = result.winner
    if w is not None:
        (out / "torchtitan_job.py").write_text(torchtitan_job(result))
        written.append(out / "torchtitan_job.py")
        if w.plans:
            (out / "plans").mkdir(exist_ok=True)
            for i, plan in enumerate(w.plans):
                name = f"stage{plan.pipeline.stage_index}.json" if plan.pipeline is not None else f"rank{i}.json"
                plan.save(out / "plans" / name)
                written.append(out / "plans" / name)
    return written
