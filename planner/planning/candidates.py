"""Which modules a plan may checkpoint: the user's ``ac_units`` less the ones the MILP must leave
out, and the modules run more than once per step, whose floor is found by tracing."""

from __future__ import annotations

import dataclasses

from estimators.tracing.estimation import Estimate
from planner.planning import verification
from planner.planning.module_plans import module_plan
from planner.planning.verification import RecomputeDivergedError
from solver import SACMilp, predict_peak_bytes

__all__ = ["allowed_units", "shared_modules", "shared_full_plan"]


def allowed_units(info, ac_units) -> tuple[list[str] | None, dict[str, str]]:
    """The modules the MILP may checkpoint (``ac_units`` as given), and the candidates it
    leaves out itself (``ModStats.sac_blocker``, see ``solver.sac_milp``) with the reason why, for
    the notes: a module that mutates its inputs in place would crash in the recompute; one whose
    calls run different ops cannot be given one per-call plan."""
    excluded = {
        s.fqn: s.sac_blocker
        for s in info.mod_stats
        if s.sac_blocker and not s.is_leaf and s.sac_memory_bytes > 0
        and (ac_units is None or s.fqn in set(ac_units))
    }
    return (list(ac_units) if ac_units is not None else None), excluded


def shared_modules(info, allowed: list[str] | None, excluded: dict[str, str]) -> list[str]:
    """Outermost candidates that run more than once per step (weight sharing: AlbertModel's one
    layer applied N times, a block reused)."""
    ok = set(allowed) if allowed is not None else None
    multi = [s.fqn for s in info.mod_stats if s.n_calls > 1 and not s.is_leaf and s.sac_memory_bytes > 0
             and s.fqn not in excluded and (ok is None or s.fqn in ok)]
    return [f for f in multi if not any(f.startswith(o + ".") for o in multi)]


def shared_full_plan(model, est: Estimate, info, milp: SACMilp, shared: list[str], options):
    """The MILP's min-peak plan with the ``shared`` modules fully checkpointed instead (their
    descendants and ancestors dropped), traced: (result, module plans, estimate), or None when
    it cannot be traced. The memory model under-rates a module called more than once (one
    window, see :func:`planner.planning.plan_notes.shared_note`); the trace does not."""
    res = milp.solve(milp.min_reachable_peak_bytes())

    def related(f: str) -> bool:
        g = milp.graph
        return any(f == s or g.is_ancestor(s, f) or g.is_ancestor(f, s) for s in shared)

    discarded = {f: res.discarded_bytes[f] for f in res.checkpointed if not related(f)}
    discarded.update({f: info.stats(f).sac_memory_bytes for f in shared})
    order = tuple(s.fqn for s in info.mod_stats if s.fqn in discarded)  # forward pre-order
    modules = tuple(module_plan(info.stats(f), discarded[f], options) for f in order)
    try:
        planned = verification.traced_or_diverged(model, modules, est)
    except RecomputeDivergedError:
        return None
    res = dataclasses.replace(
        res, decisions={f: 1.0 if f in shared else res.decisions[f] for f in order},
        discarded_bytes={f: discarded[f] for f in order}, checkpointed=order,
        predicted_peak_bytes=predict_peak_bytes(info, discarded),
        recompute_ms=sum(m.recompute_ms for m in modules))
    return res, modules, planned
