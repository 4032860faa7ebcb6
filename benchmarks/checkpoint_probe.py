"""What one checkpointed call costs in the step, by module group, beside the runtime model's terms.

    python benchmarks/checkpoint_probe.py --family hf_llama --rounds 61
    python benchmarks/checkpoint_probe.py --family hf_llama --seq 32    # the same model, less streamed

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
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

from benchmarks import time_fidelity as tf  # noqa: E402
from benchmarks.step_host import KINDS, groups_of, host_groups, probe_plans, terms  # noqa: E402
from estimators.runtime.device import get_device_spec  # noqa: E402
from estimators.runtime.models import RuntimeKind, benchmark_runtime_override  # noqa: E402
from estimators.step.train_step import TrainStep  # noqa: E402
from estimators.tracing.estimation import EstimateOptions, estimate  # noqa: E402
from planner.analysis.calibration import CheckpointCostRounds, with_host_costs  # noqa: E402
from planner.analysis.kernel_profile import OpTimer  # noqa: E402
from planner.applying.checkpointing import hf_cache_off  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.planning.solve import plan_estimate  # noqa: E402



def shortened(step: TrainStep, seq: int) -> TrainStep:
    """``step`` with every integer matrix of its inputs (token ids and labels, batch x sequence)
    cut to its first ``seq`` positions: the same model at a shorter sequence streams less around
    each checkpointed call (docs/accuracy.md, round 31). Raises ValueError where the inputs hold
    no such matrix (a conv net's images) or a shorter one."""
    flat, spec = tree_flatten(step.inputs)
    tokens = [isinstance(t, torch.Tensor) and t.ndim == 2 and not t.is_floating_point() for t in flat]
    if not any(tokens):
        raise ValueError("--seq needs token inputs (batch x sequence integer tensors); this family has none")
    if any(ok and t.shape[1] < seq for ok, t in zip(tokens, flat)):
        raise ValueError(f"--seq {seq} is longer than the family's sequence")
    cut = [t[:, :seq].contiguous() if ok else t for ok, t in zip(tokens, flat)]
    return dataclasses.replace(step, inputs=tree_unflatten(cut, spec))


def probe_variants(model: torch.nn.Module, est, groups: dict[str, tuple[str, ...]],
                   options: PlanOptions) -> list[tf.Variant]:
    """The unplanned step and one variant per group and kind, each a copy of a plan of ``model``
    (from its estimate ``est``) that checkpoints nothing, with the group's modules checkpointed that
    way (unpriced: ``terms`` prices them). The unplanned step applies the empty plan: it runs as
    the variants do (an HF model's ``use_cache`` off, as any applied plan sets it)."""
    like = plan_estimate(model, est, 2 * est.module_info.peak_bytes / tf.GiB, options=options)
    empty = dataclasses.replace(like, modules=())
    out = [tf.Variant(name="no AC", plan=empty, predicted_recompute_ms=0.0, predicted_step_ms=0.0,
                      predicted_peak_bytes=0)]
    for g, fqns in groups.items():
        for kind in KINDS:
            out.append(tf.Variant(name=f"{g} {kind}", plan=dataclasses.replace(like, modules=probe_plans(fqns, kind)),
                                  predicted_recompute_ms=0.0, predicted_step_ms=0.0, predicted_peak_bytes=0))
    return out


def report(variants: list[tf.Variant], samples: dict[str, list[tf.Sample]], info, spec, trace) -> list[str]:
    """One line per variant, per call (see the module docstring): the measured overhead and its
    interval, the priced kernels, the measured host (overhead less those kernels) beside the
    priced host and its terms, and the ops the policy sees."""
    base = [s.cpu_ms for s in samples[variants[0].name]]
    lines = [f"{'variant':28} {'n':>3} {'measured':>8} {'(95 % interval)':>16} {'kernels':>8} {'host':>7} "
             f"{'host priced':>11} = {'call':>5} + {'op host':>7} + {'policy':>6}  {'policy ops':>10}   (ms a call)"]
    for v in variants[1:]:
        mods = v.plan.modules
        n = sum(info.stats(m.fqn).n_calls for m in mods)
        overheads = [s.cpu_ms - b for s, b in zip(samples[v.name], base)]
        lo, hi = tf.median_ci(overheads)
        per_call = {k: x / n for k, x in terms(info, mods, spec, trace).items()}
        measured = statistics.median(overheads) / n
        host_priced = per_call["calls"] + per_call["host/op"] + per_call["policy"]
        lines.append(f"{v.name:28} {n:3d} {measured:+8.2f} {f'({lo / n:+.2f}..{hi / n:+.2f})':>16} "
                     f"{per_call['kernels']:8.2f} {measured - per_call['kernels']:+7.2f} {host_priced:11.2f} = "
                     f"{per_call['calls']:5.2f} + {per_call['host/op']:7.2f} + {per_call['policy']:6.2f}  "
                     f"{per_call['policy ops']:10.0f}")
    return lines


def cross_check(variants: list[tf.Variant], samples: dict[str, list[tf.Sample]], info, spec, trace) -> list[str]:
    """The cold factor as ``time_fidelity.py --host step`` fits it, from the blocks' children
    (``step_host.host_groups``), and the blocks' rows priced with it: a check on modules the
    factor was not fitted on. No children: one line saying so."""
    children = {f"{g} {k}" for g in host_groups(info) for k in KINDS}
    if not children:
        return ["cold factor: the blocks have no child with ops of its own"]
    scales, _ = tf.measured_scales(variants, samples, info, spec, trace, fitted=lambda v: v.name in children)
    base = [s.cpu_ms for s in samples[variants[0].name]]
    lines = [f"cold factor from the children: plain x{scales.plain:.2f}, policy x{scales.policy:.2f}; "
             "the blocks priced so (host ms a call):"]
    for v in variants[1:]:
        if v.name in children:
            continue
        t = terms(info, v.plan.modules, spec, trace)
        n = sum(info.stats(m.fqn).n_calls for m in v.plan.modules)
        measured = statistics.median(s.cpu_ms - b for s, b in zip(samples[v.name], base)) - t["kernels"]
        scaled = scales.plain * (t["calls"] + t["host/op"]) + scales.policy * t["policy"]
        lines.append(f"  {v.name:26} measured {measured / n:5.2f}, scaled {scaled / n:5.2f}, "
                     f"chains {(t['calls'] + t['host/op'] + t['policy']) / n:5.2f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="hf_llama", choices=list(tf.FAMILIES))
    p.add_argument("--rounds", type=int, default=61, help="timed rounds of every variant (default 61)")
    p.add_argument("--seq", type=int, metavar="N",
                   help="cut the family's token inputs to their first N positions (the decoders; default: all)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.seq is not None and args.seq < 2:
        p.error("--seq must be >= 2 (a next-token loss needs two positions)")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.family.startswith("hf_"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            p.error(f"{args.family} needs transformers (pip install transformers)")
    t0 = time.perf_counter()
    heap = tf.keep_freed_memory()
    model, step = tf.FAMILIES[args.family]()
    if args.seq is not None:
        try:
            step = shortened(step, args.seq)
        except ValueError as e:
            p.error(str(e))
    options = PlanOptions(device=get_device_spec("cpu"), reserve_gib=0,
                          trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    bench, how = tf.kernel_runtime(model, step, "step")
    with benchmark_runtime_override(bench), hf_cache_off(model):
        est = estimate(model, step, device=options.spec, options=options.trace)
    info = est.module_info
    groups, missing = groups_of(info)
    with benchmark_runtime_override(bench):
        variants = probe_variants(model, est, groups, options)
    seq = "" if args.seq is None else f" at seq {args.seq}"
    print(f"load {tf.load_average()}; one intra-op thread; {heap}\n{args.family}{seq}: {how}; groups: "
          + ", ".join(f"{g} ({len(f)})" for g, f in groups.items())
          + (f"; left out (not in every block): {', '.join(missing)}" if missing else ""))
    timer, host = OpTimer(), CheckpointCostRounds()
    samples = tf.time_variants(model, step, variants, args.rounds, timer=timer, each_round=host.run)
    now, costs = tf.priced_in_rounds(timer, args.rounds, bench, host)
    spec = with_host_costs(options.spec, costs)
    with benchmark_runtime_override(now), hf_cache_off(model):
        est = estimate(model, step, device=spec, options=options.trace)
    print(f"priced with the kernels and the {costs.summary()}, timed in the same rounds")
    print("\n".join(report(variants, samples, est.module_info, spec, est.trace)))
    print("\n".join(cross_check(variants, samples, est.module_info, spec, est.trace)))
    print(f"measured = step - the same round's unplanned step, over the calls; host = measured - kernels "
          f"(priced); {args.rounds} rounds, load {tf.load_average()}, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
