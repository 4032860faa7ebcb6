"""The checkpoint's host cost measured in the model's own step: which modules to time, how the
runtime model prices them term by term, and the cold factor that brings the calibration's
chains to what the step measured.

``planner.analysis.calibration`` measures the host costs of a checkpoint (per call, per re-run
op, per op a selective policy sees) on chains of tiny ops behind fixed copies. In a step those
costs grow with what the step streams around the checkpoint's work: on this CPU an HF Llama's
plain checkpoint was priced right at 32 positions and 0.9-1.3 ms a call under at 256
(docs/accuracy.md, round 31). The chains' terms keep their proportions (call against op,
cold op against warm); ``fit_host_scales`` measures one factor for the plain checkpoint's terms
and one for the selective policy's from checkpoints of a block's children (``host_groups``),
each plain and through the selective path caching nothing. ``time_fidelity.py`` then prices
its plans (other modules, other mixes) with the chains' costs scaled by them, as it prices
kernels by their time in the step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

from estimators.tracing.sac import last_saved, module_ops, policy_ops
from planner.plan import ModulePlan, op_key
from planner.planning.baselines import find_blocks

__all__ = ["KINDS", "HostScales", "fit_host_scales", "groups_of", "host_groups", "op_host_ms", "predicted_terms",
           "probe_plans", "terms"]

KINDS = ("full", "policy")


def op_host_ms(info, fqn: str, spec, trace=None) -> list[float]:
    """The host's re-run cost the model adds to each op of ``fqn``'s table, over its calls:
    ``DeviceSpec.recompute_op_host_ms`` by what the op before it moved, worked out again from
    ``trace`` where given (and its calls give the same table), else ``recompute_op_ms`` each."""
    s = info.stats(fqn)
    if trace is not None:
        calls = [c for c in trace.calls if c.fqn == fqn]
        bare = module_ops(trace, calls, 0.0)
        if len(bare) == len(s.ops):
            return [a.runtime_ms - b.runtime_ms for a, b in zip(module_ops(trace, calls, spec.recompute_op_host_ms), bare)]
    return [spec.recompute_op_ms * s.n_calls] * len(s.ops)


def predicted_terms(info, plan, spec, trace=None) -> dict[str, float]:
    """The model's terms of ``plan.recompute_ms``: re-run kernels, host per re-run op, calls,
    policy (forward + replay), each summed over the plan's modules."""
    out = defaultdict(float)
    for m in plan.modules:
        s = info.stats(m.fqn)
        saved = frozenset(m.saved_ops)
        stop = last_saved(s.ops)
        hosts = op_host_ms(info, m.fqn, spec, trace)
        for o, host in zip(s.ops[: stop + 1], hosts):
            if (op_key(o.func), o.occurrence) in saved:
                continue
            out["kernels"] += o.runtime_ms - host
            out["host/op"] += host
            out["n_rerun"] += 1
        out["calls"] += s.checkpoint_call_ms
        out["policy"] += s.selective_policy_ms if saved else 0.0
    return dict(out)


def groups_of(info) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """``{"blocks": the blocks, "blocks.*.<child>": that child of every block}`` for each child of
    the first block the trace gives an op table (a leaf, such as a norm, has none: a plan cannot
    checkpoint it) and every block has; and the children left out because some block lacks them."""
    blocks = find_blocks(info)
    known = {m.fqn: m for m in info.mod_stats}
    out, missing = {"blocks": blocks}, []
    for s in info.mod_stats:
        rest = s.fqn[len(blocks[0]) + 1:] if s.fqn.startswith(blocks[0] + ".") else ""
        if rest and "." not in rest and not s.is_leaf:
            fqns = tuple(f"{b}.{rest}" for b in blocks)
            if all(f in known for f in fqns):
                out[f"blocks.*.{rest}"] = fqns
            else:
                missing.append(rest)
    return out, missing


def host_groups(info) -> dict[str, tuple[str, ...]]:
    """The groups ``fit_host_scales`` is measured on: the blocks' children (``groups_of``), not
    the blocks themselves, which full AC checkpoints; empty where the blocks have none."""
    return {g: f for g, f in groups_of(info)[0].items() if g != "blocks"}


def probe_plans(fqns: tuple[str, ...], kind: str) -> tuple[ModulePlan, ...]:
    """``full``: plain checkpoints; ``policy``: the selective path caching nothing (so discarding
    everything, as a plain one)."""
    return tuple(ModulePlan(fqn=f, discard_ratio=1.0, full=kind == "full") for f in fqns)


def terms(info, mods: tuple[ModulePlan, ...], spec, trace=None) -> dict[str, float]:
    """The price of checkpointing ``mods`` (nothing cached) by ``predicted_terms`` (re-run
    kernels, host of the re-run ops, the checkpoint's calls), summed over the modules' calls,
    with the selective policy (forward and replay) added for a ``policy`` module. The planner
    itself prices a plan caching nothing as a plain checkpoint, with no policy
    (``recompute_ms_with_saved``): the ``policy`` rows are a construct of this measurement, what
    the selective path costs before anything is cached."""
    out = dict.fromkeys(("kernels", "host/op", "calls"), 0.0)
    out.update(predicted_terms(info, SimpleNamespace(modules=mods), spec, trace))
    out["policy"] = sum(info.stats(m.fqn).selective_policy_ms for m in mods if not m.full)
    out["policy ops"] = sum(policy_ops(info.stats(m.fqn).ops) * info.stats(m.fqn).n_calls for m in mods if not m.full)
    return out


@dataclass(frozen=True)
class HostScales:
    """What the step measured over what the chains' costs price, for the host terms of a plain
    checkpoint (call, submodules, re-run ops) and of the selective policy (its calls and ops)."""

    plain: float
    policy: float


def fit_host_scales(measured: list[tuple[str, float, dict[str, float]]]) -> HostScales:
    """The scales from checkpoints timed in the step: ``(kind, measured overhead ms, terms)`` per
    variant, ``kind`` one of ``KINDS`` and ``terms`` its price (``terms``, by the chains' costs).
    ``plain``: the measured host (overhead less the priced kernels) of the ``full`` variants over
    their priced host, summed; ``policy``: what the ``policy`` variants measured beyond their
    kernels and their plain host so scaled, over their priced policy. Each at least 0; 1.0 where
    nothing of its kind was priced."""
    def host(t: dict[str, float]) -> float:
        return t["calls"] + t["host/op"]

    full = [(m - t["kernels"], host(t)) for k, m, t in measured if k == "full"]
    priced = sum(h for _, h in full)
    plain = max(0.0, sum(m for m, _ in full) / priced) if priced > 0 else 1.0
    pol = [(m - t["kernels"] - plain * host(t), t["policy"]) for k, m, t in measured if k == "policy"]
    priced = sum(p for _, p in pol)
    policy = max(0.0, sum(m for m, _ in pol) / priced) if priced > 0 else 1.0
    return HostScales(plain=plain, policy=policy)
