"""Plot a trade-off table against the hand-made baselines (needs ``pip install sac-planner[plot]``).

    from planner.analysis.plotting import plot_tradeoff
    fig = plot_tradeoff(table, baselines, save_path="tradeoff.png")

matplotlib is imported when a plot is made, never at ``import planner``; the figure is built
without pyplot (no global figure state, no GUI backend) and written to disk only when
``save_path`` is given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from planner.format import byte_unit

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from planner.planning.baselines import BaselinePoint
    from planner.planning.tradeoff import TradeoffTable

__all__ = ["plot_tradeoff", "memory_unit"]

logger = logging.getLogger(__name__)

_BASELINE_MARKERS = ("s", "^", "v", "D", "P", "X", "<", ">", "h", "*")


def memory_unit(nbytes: float) -> tuple[int, str]:
    """(bytes per unit, name) to show ``nbytes`` in: GiB from 1 GiB up, else MiB (KiB below 1 MiB).

    >>> memory_unit(3 * 2**30), memory_unit(5 * 2**20)
    ((1073741824, 'GiB'), (1048576, 'MiB'))
    """
    div, name = byte_unit(nbytes)
    return (2**10, "KiB") if div == 1 else (div, name)  # an axis in bytes would need 4-digit ticks


def _import_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plot_tradeoff needs matplotlib: pip install sac-planner[plot] (or pip install matplotlib)"
        ) from e
    return Figure


def _draw_curve(ax: Any, table: TradeoffTable, div: int) -> None:
    rows = sorted(table.feasible_rows, key=lambda r: r.predicted_peak_bytes)
    if not rows:
        return
    xs = [r.predicted_peak_bytes / div for r in rows]
    ys = [r.recompute_ms for r in rows]
    ax.plot(xs, ys, "-", color="C0", lw=1.5, label="SAC planner (MILP)", zorder=2)
    front = [(x, y) for x, y, r in zip(xs, ys, rows) if r.on_pareto]
    rest = [(x, y) for x, y, r in zip(xs, ys, rows) if not r.on_pareto]
    if front:
        ax.plot(*zip(*front), "o", color="C0", ms=5, label="planner, Pareto points", zorder=3)
    if rest:
        ax.plot(*zip(*rest), "o", mfc="white", mec="C0", ms=5, label="planner, dominated", zorder=3)


def _draw_limits(ax: Any, table: TradeoffTable, div: int, unit: str) -> None:
    ax.axvline(table.min_reachable_peak_bytes / div, color="grey", ls=":", lw=1,
               label=f"smallest reachable peak ({table.min_reachable_peak_bytes / div:.2f} {unit})")
    ax.axvline(table.no_ac_peak_bytes / div, color="grey", ls="--", lw=1,
               label=f"no-AC peak ({table.no_ac_peak_bytes / div:.2f} {unit})")


def _draw_baselines(ax: Any, baselines: Sequence[BaselinePoint], div: int) -> None:
    at: dict[tuple[int, float], list[int]] = {}  # policies at one point share a label
    for i, b in enumerate(baselines):
        x, y = b.predicted_peak_bytes / div, b.recompute_ms
        ax.plot([x], [y], _BASELINE_MARKERS[i % len(_BASELINE_MARKERS)], color=f"C{i + 1}", ms=8,
                label=b.name, zorder=4)
        at.setdefault((b.predicted_peak_bytes, round(b.recompute_ms, 9)), []).append(i)
    for same in at.values():
        first = baselines[same[0]]
        ax.annotate(" = ".join(baselines[i].name for i in same), (first.predicted_peak_bytes / div, first.recompute_ms),
                    textcoords="offset points", xytext=(6, 4), fontsize=7, color=f"C{same[0] + 1}")


def _add_percent_axis(ax: Any, step_ms: float) -> None:
    if step_ms <= 0:
        return
    sec = ax.secondary_yaxis("right", functions=(lambda ms: 100.0 * ms / step_ms,
                                                 lambda pct: pct * step_ms / 100.0))
    sec.set_ylabel("recompute, % of the no-AC step")


def plot_tradeoff(
    table: TradeoffTable,
    baselines: Sequence[BaselinePoint] | None = None,
    ax: Any = None,
    *,
    budget_bytes: int | None = None,
    save_path: str | Path | None = None,
) -> Figure:
    """Peak memory (x) against recompute time (y) for the planner's sweep and the baselines.

    ``ax``: draw into an existing matplotlib Axes (its figure is returned); default a new Figure.
    ``budget_bytes``: the user's budget (per rank), drawn as a vertical line. Baselines at the
    same point (two policies that checkpoint the same modules) share one label. The right axis
    shows recompute as a percentage of the no-AC step. Nothing is written unless ``save_path``
    is given.

    >>> fig = plot_tradeoff(table, hand_made_baselines(info), save_path="out.png")  # doctest: +SKIP
    """
    figure_cls = _import_matplotlib()
    if ax is None:
        fig = figure_cls(figsize=(8, 5), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    div, unit = memory_unit(table.no_ac_peak_bytes)
    _draw_curve(ax, table, div)
    _draw_baselines(ax, baselines or (), div)
    _draw_limits(ax, table, div, unit)
    if budget_bytes is not None:
        ax.axvline(budget_bytes / div, color="C3", ls="-", lw=1.2, label=f"your budget ({budget_bytes / div:.2f} {unit})")
    _add_percent_axis(ax, table.step_ms)
    n_bad = sum(not r.feasible for r in table.rows)
    title = f"Peak memory vs recompute (world_size {table.world_size})"
    ax.set_title(title + (f"; {n_bad} budget(s) infeasible, not drawn" if n_bad else ""), fontsize=10)
    ax.set_xlabel(f"predicted peak memory per rank ({unit})")
    ax.set_ylabel("recompute time per step (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    if save_path is not None:
        path = Path(save_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        logger.info("trade-off figure written to %s", path)
    return fig
