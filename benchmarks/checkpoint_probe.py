"""What one checkpointed call costs in the step, by module group, beside the runtime model's terms.

    python benchmarks/checkpoint_probe.py --family hf_llama --rounds 61

``time_fidelity.py`` says whether a plan's overhead is priced right; this says which term is
off. For a family of ``time_fidelity.py``, the groups are its blocks (``find_blocks``) and each
child of a block that runs ops of its own (``blocks.*.mlp``, ``blocks.*.self_attn``). Every
module of one group is checkpointed, in two ways:

* ``full``: a plain checkpoint (``ModulePlan(full=True)``);
* ``policy``: the selective path with nothing cached: the same ops re-run, plus the planner's
  dispatch modes in the forward and the recompute (what a selective plan pays for its policy,
  with no cached output to change the kernels).

The variants and the unplanned model are timed interleaved in plain steps (no op timer on
them), one intra-op thread, thread CPU time, each timed step after an untimed one of its own
(``time_fidelity.time_variants``). In every round an op-timed unplanned copy gives the kernels,
and one round of the calibration's chains the checkpoint's host costs, of the same minutes;
the terms are priced with those. Printed per group and variant, per call: the measured overhead
(median, 95 % interval), the priced kernels of the re-run ops, and the host beside its price
(measured overhead less the priced kernels; the price split into call, re-run ops and policy).
Exploratory: it has no pass line; docs/accuracy.md#runtimes quotes what it found.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import time_fidelity as tf  # noqa: E402
from benchmarks.recompute_breakdown import op_host_ms  # noqa: E402
from estimators.runtime.device import get_device_spec  # noqa: E402
from estimators.runtime.models import RuntimeKind, benchmark_runtime_override  # noqa: E402
from estimators.tracing.estimation import EstimateOptions, estimate  # noqa: E402
from estimators.tracing.sac import last_saved  # noqa: E402
from planner.analysis.calibration import CheckpointCostRounds, with_host_costs  # noqa: E402
from planner.analysis.kernel_profile import OpTimer  # noqa: E402
from planner.applying.checkpointing import hf_cache_off  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.plan import ModulePlan  # noqa: E402
from planner.planning.baselines import find_blocks  # noqa: E402
from planner.planning.solve import plan_estimate  # noqa: E402

KINDS = ("full", "policy")


def groups_of(info) -> dict[str, tuple[str, ...]]:
    """``{"blocks": the blocks, "blocks.*.<child>": that child of every block}`` for each child of
    the first block that is not a leaf (it runs ops of its own a checkpoint can re-run)."""
    blocks = find_blocks(info)
    out = {"blocks": blocks}
    for s in info.mod_stats:
        rest = s.fqn[len(blocks[0]) + 1:] if s.fqn.startswith(blocks[0] + ".") else ""
        if rest and "." not in rest and not s.is_leaf:
            fqns = tuple(f"{b}.{rest}" for b in blocks)
            if all(f in {m.fqn for m in info.mod_stats} for f in fqns):
                out[f"blocks.*.{rest}"] = fqns
    return out


def module_plans(fqns: tuple[str, ...], kind: str) -> tuple[ModulePlan, ...]:
    """``full``: plain checkpoints; ``policy``: the selective path caching nothing."""
    return tuple(ModulePlan(fqn=f, discard_ratio=1.0 if kind == "full" else 0.5, full=kind == "full") for f in fqns)


def terms(info, mods: tuple[ModulePlan, ...], spec, trace=None) -> dict[str, float]:
    """The runtime model's price of checkpointing ``mods`` (nothing cached), by term, summed over
    the modules' calls: re-run kernels, host per re-run op, the checkpoint's calls, and the
    selective policy (forward + replay) where the plan takes the selective path."""
    out = dict.fromkeys(("kernels", "host/op", "calls", "policy"), 0.0)
    for m in mods:
        s = info.stats(m.fqn)
        for o, host in zip(s.ops[: last_saved(s.ops) + 1], op_host_ms(info, m.fqn, spec, trace)):
            out["kernels"] += o.runtime_ms - host
            out["host/op"] += host
        out["calls"] += s.checkpoint_call_ms
        out["policy"] += 0.0 if m.full else s.selective_policy_ms
    return out


def probe_variants(model: torch.nn.Module, step, info, groups: dict[str, tuple[str, ...]],
                   options: PlanOptions) -> list[tf.Variant]:
    """The unplanned step and one variant per group and kind, its plan a copy of a no-op plan of
    ``model`` with the group's modules checkpointed that way (unpriced: ``terms`` prices them)."""
    with hf_cache_off(model):
        est = estimate(model, step, device=options.spec, options=options.trace)
    like = plan_estimate(model, est, 2 * est.module_info.peak_bytes / tf.GiB, options=options)
    out = [tf.Variant(name="no AC", plan=None, predicted_recompute_ms=0.0, predicted_step_ms=0.0,
                      predicted_peak_bytes=0)]
    for g, fqns in groups.items():
        for kind in KINDS:
            plan = dataclasses.replace(like, modules=module_plans(fqns, kind))
            out.append(tf.Variant(name=f"{g} {kind}", plan=plan, predicted_recompute_ms=0.0,
                                  predicted_step_ms=0.0, predicted_peak_bytes=0))
    return out


def report(variants: list[tf.Variant], samples: dict[str, list[tf.Sample]], info, spec, trace) -> list[str]:
    """One line per variant, per call (see the module docstring)."""
    base = [s.cpu_ms for s in samples[variants[0].name]]
    lines = [f"{'variant':32} {'calls':>5} {'measured':>8} {'(95 % interval)':>16} {'kernels':>8} "
             f"{'host':>7} {'priced':>7} = {'call':>6} + {'ops':>6} + {'policy':>6}   (ms a call)"]
    for v in variants[1:]:
        mods = v.plan.modules
        n = sum(info.stats(m.fqn).n_calls for m in mods)
        d = [s.cpu_ms - b for s, b in zip(samples[v.name], base)]
        lo, hi = tf.median_ci(d)
        t = {k: x / n for k, x in terms(info, mods, spec, trace).items()}
        host = statistics.median(d) / n - t["kernels"]
        priced = t["calls"] + t["host/op"] + t["policy"]
        lines.append(f"{v.name:32} {n:5d} {statistics.median(d) / n:+8.2f} {f'({lo / n:+.2f}..{hi / n:+.2f})':>16} "
                     f"{t['kernels']:8.2f} {host:+7.2f} {priced:7.2f} = {t['calls']:6.2f} + {t['host/op']:6.2f} + "
                     f"{t['policy']:6.2f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="hf_llama", choices=list(tf.FAMILIES))
    p.add_argument("--rounds", type=int, default=61, help="timed rounds of every variant (default 61)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    heap = tf.keep_freed_memory()
    model, step = tf.FAMILIES[args.family]()
    options = PlanOptions(device=get_device_spec("cpu"), reserve_gib=0,
                          trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    bench, how = tf.kernel_runtime(model, step, "step")
    with benchmark_runtime_override(bench), hf_cache_off(model):
        info = estimate(model, step, device=options.spec, options=options.trace).module_info
    groups = groups_of(info)
    with benchmark_runtime_override(bench):
        variants = probe_variants(model, step, info, groups, options)
    print(f"load {tf.load_average()}; one intra-op thread; {heap}\n{args.family}: {how}; groups: "
          + ", ".join(f"{g} ({len(f)})" for g, f in groups.items()))
    timer, host = OpTimer(), CheckpointCostRounds()
    samples = tf.time_variants(model, step, variants, args.rounds, timer=timer, each_round=host.run)
    now = timer.profile(args.rounds).runtime()
    now.import_cache({k: v for k, v in bench.export_cache().items() if k not in timer.samples})
    costs = host.costs()
    spec = with_host_costs(options.spec, costs)
    with benchmark_runtime_override(now), hf_cache_off(model):
        est = estimate(model, step, device=spec, options=options.trace)
    print(f"priced with the kernels and the {costs.summary()}, timed in the same rounds")
    print("\n".join(report(variants, samples, est.module_info, spec, est.trace)))
    print(f"measured = step - the same round's unplanned step, over the calls; host = measured - kernels "
          f"(priced); {args.rounds} rounds, load {tf.load_average()}, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
