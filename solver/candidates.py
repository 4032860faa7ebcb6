"""What the module-level models share: which modules a plan may checkpoint, the checks of the
caller's input, the solver unit and the tie-break of the objective.

    graph = Graph.from_module_info(info)
    allowed = check_units(ac_units, graph, "ac_units")        # None: every module
    fsdp = check_units(fsdp_units, graph, "fsdp_units")
    cands = find_candidates(graph, allowed, fsdp)             # [Candidate(node, segments), ...]
    unit, unit_name = solver_unit(no_ac_peak_bytes)           # bytes per solver unit

``SACMilp`` (recompute only: ``solver/sac_milp.py``) and ``OffloadMilp`` (keep / recompute /
offload: ``solver/offload/milp.py``) plan the same candidates, so a plan of one is a plan of the
other.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from solver.graph import Graph, Node
from solver.plan_cost import cost_envelope, has_window, unknown_module_error

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats

__all__ = [
    "Candidate", "find_candidates", "fsdp_blocked", "nesting", "check_budget", "check_units",
    "solver_unit", "safe_name", "tie_break_ms", "TIE_Y", "TIE_R",
]

logger = logging.getLogger(__name__)

_UNITS = ((2**30, "gib"), (2**20, "mib"), (2**10, "kib"), (1, "bytes"))

TIE_Y = 1e-6
TIE_R = 1e-7
"""Tie-break weights: all the y (r) terms together weigh at most this much (twice, with the
position weight) of the largest single-module recompute time. Summed over the modules, so the
tie-break stays far below the default rel_gap of 1e-4 whatever the model's size (a weight per
module grows with the model until the backend spends its time ordering equal plans)."""


@dataclass(frozen=True)
class Candidate:
    """A module a plan may checkpoint, with its cost curve's convex envelope: recompute ms
    ``max_s(a_s r + b_s)`` at discard ratio r in (0, 1] (``solver.plan_cost.cost_envelope``)."""

    node: Node
    segments: tuple[tuple[float, float], ...]

    @property
    def fqn(self) -> str:
        return self.node.fqn

    @property
    def stats(self) -> ModStats:
        return self.node.stats


def fsdp_blocked(graph: Graph, fsdp: set[str] | None) -> set[str]:
    """Modules that wrap an FSDP unit (strict ancestors): never checkpointed."""
    return {a.fqn for u in (fsdp or ()) for a in graph.ancestors(u)}


def find_candidates(graph: Graph, allowed: set[str] | None, fsdp: set[str] | None) -> list[Candidate]:
    """The modules a plan may checkpoint, in forward pre-order: not leaves, something to discard,
    in ``allowed`` (None: all), not wrapping an FSDP unit, safe to recompute (no
    ``sac_blocker``) and with a window in which a discard lowers memory. Every consumer of the
    models (solve_sac, tradeoff_curve, step-time curves) must leave the same modules out."""
    blocked = fsdp_blocked(graph, fsdp)
    out = []
    for node in graph:
        s = node.stats
        if s.is_leaf or s.sac_memory_bytes <= 0:
            continue
        if (allowed is not None and node.fqn not in allowed) or node.fqn in blocked:
            continue
        if getattr(s, "sac_blocker", ""):
            logger.info("%s: never checkpointed: %s", node.fqn, s.sac_blocker)
            continue
        if not has_window(s):
            logger.info("%s: empty fw_post_op..bw_pre_op window, never checkpointed", node.fqn)
            continue
        segs, convex = cost_envelope(s)
        if not convex:
            logger.warning("%s: trade-off curve is not convex; the MILP uses its convex envelope "
                           "and reports recompute_ms on the exact curve", node.fqn)
        out.append(Candidate(node, tuple(segs)))
    return out


def nesting(graph: Graph, cands: Sequence[Candidate]) -> tuple[list[list[int]], list[set[int]]]:
    """Per candidate, the candidates above it (nearest first) and the set below it, as indices
    into ``cands``: no plan checkpoints two of one root-to-leaf path."""
    index = {c.fqn: k for k, c in enumerate(cands)}
    above = [[index[a.fqn] for a in graph.ancestors(c.fqn) if a.fqn in index] for c in cands]
    below: list[set[int]] = [set() for _ in cands]
    for k, anc in enumerate(above):
        for a in anc:
            below[a].add(k)
    return above, below


def tie_break_ms(cands: Sequence[Candidate], n_modules: int) -> tuple[list[float], list[float]]:
    """Per candidate, the objective's tie-break cost of checkpointing it (y = 1) and of
    discarding all it can (r = 1), in ms: among plans of equal recompute time the models prefer
    fewer checkpointed modules, then modules earlier in forward pre-order, then discarding less."""
    scale = max((max(a + b for a, b in c.segments) for c in cands if c.segments), default=1.0)
    scale = scale if scale > 0 else 1.0
    n = len(cands)
    w = [1.0 + c.node.index / max(1, n_modules) for c in cands]
    return [TIE_Y * scale * wk / n for wk in w], [TIE_R * scale * wk / n for wk in w]


# ----------------------------------------------------------------------------- input checks
def check_budget(budget_bytes: float) -> int:
    """A budget in whole bytes (rounded down), or a ValueError that says what to pass."""
    ok = isinstance(budget_bytes, numbers.Real) and not isinstance(budget_bytes, bool)
    if not ok or not math.isfinite(budget_bytes) or budget_bytes <= 0:
        raise ValueError(
            "budget_bytes must be a positive, finite number of bytes per rank, e.g. "
            f"int(40 * 2**30) for 40 GiB; got {budget_bytes!r}"
        )
    return int(math.floor(budget_bytes))


def check_units(units: Iterable[str] | None, graph: Graph, what: str) -> set[str] | None:
    """``units`` (module fqns) as a set, each checked against ``graph``; None stays None."""
    if units is None:
        return None
    if isinstance(units, str):
        raise TypeError(f"{what} must be a list of module fqns, not the string {units!r}")
    names = set(units)
    for fqn in sorted(names):
        if fqn not in graph:
            raise unknown_module_error(fqn, (n.fqn for n in graph), what)
    return names


# ----------------------------------------------------------------------------- model helpers
def solver_unit(peak_bytes: int) -> tuple[int, str]:
    """The one place bytes become solver units: GiB, or a smaller binary unit for models whose
    peak is under 1 GiB, so coefficients stay near 1 and well above the backend's tolerances."""
    return next(((u, name) for u, name in _UNITS if peak_bytes >= u), _UNITS[-1])


def safe_name(name: str) -> str:
    """``name`` usable in a column or row name of an LP file."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)
