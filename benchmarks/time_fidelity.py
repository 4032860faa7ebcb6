"""Time fidelity on this CPU: each plan's recompute overhead, predicted beside measured.

    python benchmarks/time_fidelity.py                          # 3 families, 41 rounds each
    python benchmarks/time_fidelity.py --families hf_llama --rounds 11

Run on an idle machine for figures to publish; it prints the load average beside every figure.

For each family (a GPT decoder, a residual conv net, an HF Llama built from a config), on one
intra-op thread:

1. calibrate the ``cpu`` spec here (``planner.analysis.calibration.calibrate_device``: the
   roofline's figures and the checkpoint's host costs: per call, per submodule a call, per
   re-run op, per op a selective policy sees, per selective call), trace the step with every kernel priced by its
   median time in 5 unplanned steps of the model run here (``--kernels step``, the default:
   ``planner.analysis.kernel_profile``; thread CPU time), or timed alone, warm
   (``--kernels benchmark``: ``RuntimeKind.BENCHMARK``, no kernel priced below its bytes at the
   streaming bandwidth the runtime measures, which is printed);
2. plan it at 0.8x and 0.6x of the no-AC peak (where that is below the smallest reachable peak,
   0.8 and 0.6 of the way from it to the no-AC peak) and at full AC's peak, and build full AC
   (every block plainly checkpointed);
3. train the unplanned model, the three plans and full AC, AdamW, round-robin: each round runs one
   timed step of each, in a rotating order, after warm-up steps; each timed step comes right
   after an untimed step of the same variant, as in a training loop (a step straight after
   another variant's inherits that variant's heap and caches, and in a rotating order a variant
   follows the same other one in most rounds: a bias, not noise). The steps' garbage is
   collected before every step, outside the timed region, with the heap that was there before
   frozen (``planner.analysis.measure.gc_frozen``: a full collection walks the whole heap and
   leaves the caches cold, as a training loop's step does not find them). Every step is timed by
   the wall clock and by its thread's CPU time (``time.thread_time``). glibc's malloc is told to keep freed
   memory (as CUDA's caching allocator does): otherwise a step re-faults pages the step before
   handed back, by amounts that depend on which variant ran before it in the shared heap, and
   the runtime model does not price page faults. One more copy of the unplanned model takes its
   turn in every round, its step under an op timer (``planner.analysis.kernel_profile.OpTimer``),
   and every round ends with one round of the calibration's checkpoint chains
   (``planner.analysis.calibration.CheckpointCostRounds``);
4. price the same plans again (``repriced``) with those kernels (each signature's median over the
   rounds; a signature only a recompute runs keeps its price from step 1) and those host costs:
   the figures of the minutes the variants ran in. The machine's speed drifts between minutes
   by more than a small plan's tolerance, kernels and host costs alike (docs/accuracy.md,
   rounds 29 and 30), so the prices the plans were chosen with are not the ones they ran with;
   repriced, the figure tests the runtime model (which ops re-run, what a checkpoint costs the
   host), not the machine's steadiness. ``plan.recompute_ms`` is printed beside it ("planned").
   ``--kernels benchmark`` prices with kernels timed alone and does not reprice;
5. with ``--host step`` (the default), the host costs are the chains' scaled by the cold factor
   measured in the same rounds on other checkpoints of the model (``benchmarks/step_host.py``):
   each child of the blocks with ops of its own (an attention, an MLP, a conv stage's branch),
   in every block, checkpointed plainly and through the selective path caching nothing, four
   more variants timed like the others but not judged. The chains run behind fixed copies; a
   step's host runs colder as it streams more (docs/accuracy.md, round 31), by a factor one
   model's step sets, as it sets its kernels' times. The chains' own price is printed beside
   ("chains"); ``--host chains`` prices with it and times no extra variant.

The median over 41 rounds (the default): a step varies by several per cent from round to round
even idle, so a paired difference spreads widely and one median is known only to its interval;
the 3 ms floor below is what a plan of a few calls is held to.

Printed per variant: the measured step (median over rounds, and the spread min..max), the
predicted step (no-AC step + the plan's recompute, repriced), the measured overhead (the median
over rounds of the step less that round's unplanned step, and that median's 95 % interval,
``median_ci``) beside the predicted one (repriced; ``plan.recompute_ms`` as "planned"). Where a
family's unplanned step measured more than 15 % away from its prediction, a line says so
(``drift_note``): repriced, the step's model misses by that much beside its kernels; priced by
kernels profiled before, the machine ran at another speed while it timed.

PASS needs, per family: every plan's and full AC's overhead within 15 % of the prediction or 3 ms,
and the plan at full AC's peak faster than full AC (or the same plan). FAIL: a prediction off
beyond this run's timing noise (the whole interval outside prediction +- tolerance), or that
plan slower than full AC over the whole interval. NOISY otherwise: a median outside the
tolerance whose interval still reaches it, or that plan neither faster nor slower over its
interval, says nothing either way. Under 6 rounds no interval exists, so nothing can FAIL (a
PASS still reads the medians). The interval covers the rounds' noise only, not the drift of the
calibration and the kernel prices between minutes. The verdict reads the CPU time: on a shared
machine other processes stretch a step's wall time by whole time slices, which the thread's CPU
time does not count. Exit status 0 when every family passes, 1 on a FAIL, 2 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import gpu_validate as gv  # noqa: E402
from benchmarks.step_host import KINDS, HostScales, fit_host_scales, host_groups, probe_plans, terms  # noqa: E402
from estimators.runtime.kernel_bench import BenchmarkRuntime  # noqa: E402
from estimators.runtime.models import RuntimeKind, benchmark_runtime_override  # noqa: E402
from estimators.step.train_step import TrainStep, run_step  # noqa: E402
from estimators.tracing.estimation import EstimateOptions, estimate  # noqa: E402
from examples.convnet import ConvNetConfig, build_convnet  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402
from planner.analysis.calibration import (CheckpointCostRounds, CheckpointHostCosts, calibrate_device,  # noqa: E402
                                          with_host_costs)
from planner.analysis.kernel_profile import OpTimer, profile_step_kernels  # noqa: E402
from planner.analysis.measure import gc_frozen  # noqa: E402
from planner.applying.checkpointing import apply_plan, hf_cache_off  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.plan import ModulePlan, Plan  # noqa: E402
from planner.planning.baselines import find_blocks, full_ac  # noqa: E402
from planner.planning.module_plans import recompute_ms_with_saved  # noqa: E402
from planner.planning.solve import plan_estimate  # noqa: E402
from solver import SACMilp  # noqa: E402

GiB, MiB = 2**30, 2**20
TOLERANCE, FLOOR_MS = 0.15, 3.0


# ----------------------------------------------------------------------------- families


def _gpt() -> tuple[torch.nn.Module, TrainStep]:
    """The decoder of the issue: 4 layers, width 256, seq 256, batch 4, fp32, dropout 0.1."""
    model, inputs = build_gpt(GPTConfig(vocab_size=512, seq_len=256, n_layer=4, n_head=4, dim=256), batch_size=4)
    return model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")


def _convnet() -> tuple[torch.nn.Module, TrainStep]:
    """A residual conv net (BatchNorm, in-place ReLU), widths 32-64-128 on 32x32 images, batch 32."""
    model, inputs = build_convnet(ConvNetConfig(widths=(32, 64, 128)), batch_size=32)
    return model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")


def _hf_llama() -> tuple[torch.nn.Module, TrainStep]:
    """transformers' LlamaForCausalLM from a config: 4 layers, width 256, seq 256, batch 4."""
    model, inputs, loss_fn = gv.MODELS["hf_llama"]("small")
    return model, TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer="adamw")


FAMILIES: dict[str, Callable[[], tuple[torch.nn.Module, TrainStep]]] = {
    "gpt": _gpt, "convnet": _convnet, "hf_llama": _hf_llama,
}


# ----------------------------------------------------------------------------- variants


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One way to run the step: unplanned, a plan, or full AC."""

    name: str
    plan: Plan | None
    predicted_recompute_ms: float
    predicted_step_ms: float
    predicted_peak_bytes: int
    planned_recompute_ms: float | None = None
    """What the plan was made with (``plan.recompute_ms``), where ``predicted_recompute_ms`` is a
    re-pricing of it (``repriced``); None where they are one."""
    chains_recompute_ms: float | None = None
    """The same re-pricing with the calibration chains' host costs as they are, where
    ``predicted_recompute_ms`` scales them by the cold factor measured in the step
    (``--host step``); None otherwise."""


def full_ac_plan(like: Plan, info) -> Plan:
    """Every block plainly checkpointed (``find_blocks``), priced by the planner's rule."""
    mods = tuple(ModulePlan(fqn=b, discard_ratio=1.0, full=True,
                            recompute_ms=recompute_ms_with_saved(info.stats(b), frozenset()))
                 for b in find_blocks(info))
    return dataclasses.replace(like, modules=mods, recompute_ms=sum(m.recompute_ms for m in mods),
                               predicted_peak_bytes=full_ac(info).predicted_peak_bytes)


def variants_of(model: torch.nn.Module, step: TrainStep, options: PlanOptions) -> tuple[list[Variant], Any]:
    """The unplanned step, plans at 0.8x / 0.6x of the no-AC peak and at full AC's, and full AC."""
    with hf_cache_off(model):
        est = estimate(model, step, device=options.spec, options=options.trace)
    info = est.module_info
    no_ac, floor = info.peak_bytes, SACMilp(info).min_reachable_peak_bytes()
    full_peak = full_ac(info).predicted_peak_bytes
    # 0.8x and 0.6x of the no-AC peak; where that is below the smallest reachable peak, as far
    # from it towards the no-AC peak instead.
    budgets = [int(f * no_ac) if f * no_ac >= floor else int(floor + f * (no_ac - floor)) for f in (0.8, 0.6)]
    budgets = [(f"plan {b / no_ac:.2f}x", b) for b in budgets] + [("plan @ full-AC peak", full_peak)]
    base = est.module_info.step_runtime_ms
    out = [Variant(name="no AC", plan=None, predicted_recompute_ms=0.0, predicted_step_ms=base,
                   predicted_peak_bytes=no_ac)]
    plan = None
    for name, budget in budgets:
        plan = plan_estimate(model, est, budget / GiB, options=options)
        out.append(Variant(name=name, plan=plan, predicted_recompute_ms=plan.recompute_ms,
                           predicted_step_ms=base + plan.recompute_ms, predicted_peak_bytes=plan.predicted_peak_bytes))
    full = full_ac_plan(plan, info)
    out.append(Variant(name="full AC", plan=full, predicted_recompute_ms=full.recompute_ms,
                       predicted_step_ms=base + full.recompute_ms, predicted_peak_bytes=full.predicted_peak_bytes))
    return out, est


def repriced(model: torch.nn.Module, step: TrainStep, variants: list[Variant], options: PlanOptions,
             runtime: BenchmarkRuntime) -> list[Variant]:
    """The same variants, the same plans, priced again with ``runtime``'s kernel times by the
    planner's rule (``recompute_ms_with_saved`` of each module's cached ops, the no-AC step of a
    new trace): the runtime model's prediction from kernels timed at another moment. Plans that
    offload are refused: their price is the offload timeline's, not a sum over modules."""
    if any(m.offloaded_ops for v in variants if v.plan is not None for m in v.plan.modules):
        raise ValueError("repriced() prices recompute only; a plan here offloads")
    with benchmark_runtime_override(runtime), hf_cache_off(model):
        info = estimate(model, step, device=options.spec, options=options.trace).module_info
    base, out = info.step_runtime_ms, []
    for v in variants:
        ms = 0.0 if v.plan is None else sum(recompute_ms_with_saved(info.stats(m.fqn), frozenset(m.saved_ops))
                                            for m in v.plan.modules)
        out.append(dataclasses.replace(v, predicted_recompute_ms=ms, predicted_step_ms=base + ms,
                                       planned_recompute_ms=v.predicted_recompute_ms))
    return out


HOST = "host: "
"""The name prefix of the variants timed for the host's cold factor (``--host step``)."""


def host_variants(like: Plan, info) -> list[Variant]:
    """The checkpoints the cold factor is measured on (``step_host.host_groups``: each child of
    the blocks, in every block, checkpointed ``full`` and through the selective path caching
    nothing), as copies of ``like`` (a plan of this model); not judged, not priced here."""
    return [Variant(name=f"{HOST}{g} {kind}", plan=dataclasses.replace(like, modules=probe_plans(fqns, kind)),
                    predicted_recompute_ms=0.0, predicted_step_ms=0.0, predicted_peak_bytes=0)
            for g, fqns in host_groups(info).items() for kind in KINDS]


def measured_scales(variants: list[Variant], samples: dict[str, list[Sample]], info, spec, trace,
                    fitted: Callable[[Variant], bool] = lambda v: v.name.startswith(HOST)
                    ) -> tuple[HostScales, list[str]]:
    """The cold factor of the ``fitted`` variants (the host variants; each checkpoints its
    modules all plainly or all through the selective path caching nothing) by
    ``fit_host_scales``: their median overhead over the unplanned step, ``variants[0]``, beside
    their terms priced by ``spec``; and a line per variant: host measured / priced a call."""
    base, measured, lines = samples[variants[0].name], [], []
    for v in variants:
        if not fitted(v):
            continue
        mods = v.plan.modules
        t = terms(info, mods, spec, trace)
        m = statistics.median(_paired(samples[v.name], base, "cpu_ms"))
        kind = "full" if all(x.full for x in mods) else "policy"
        measured.append((kind, m, t))
        n = sum(info.stats(x.fqn).n_calls for x in mods)
        priced = t["calls"] + t["host/op"] + (t["policy"] if kind == "policy" else 0.0)
        lines.append(f"  {v.name.removeprefix(HOST):26} {n:2d} calls: host {(m - t['kernels']) / n:5.2f} ms a call "
                     f"measured, {priced / n:5.2f} priced by the chains")
    return fit_host_scales(measured), lines


def priced_in_rounds(timer: OpTimer, rounds: int, planned_with: BenchmarkRuntime,
                     host: CheckpointCostRounds) -> tuple[BenchmarkRuntime, CheckpointHostCosts]:
    """The kernels and the checkpoint's host costs measured in the timing rounds: each signature's
    median under ``timer`` over ``rounds`` steps, a signature only a recompute runs (the unplanned
    steps never do) keeping its price from ``planned_with``; and the chains' fit of ``host``."""
    now = timer.profile(rounds).runtime()
    now.import_cache({k: v for k, v in planned_with.export_cache().items() if k not in timer.samples})
    return now, host.costs()


# ----------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Sample:
    wall_ms: float
    cpu_ms: float


PROFILED = "no AC, op-timed"


def time_variants(model: torch.nn.Module, step: TrainStep, variants: list[Variant], rounds: int,
                  warmup: int = 2, settle: int = 1, timer: OpTimer | None = None,
                  each_round: Callable[[], None] | None = None) -> dict[str, list[Sample]]:
    """Each variant's steps, ``rounds`` of them, round-robin in a rotating order (a model copy and
    an AdamW each; ``warmup`` untimed steps first). Each timed step comes right after ``settle``
    untimed steps of the same variant, as a training loop runs one step after another of the same
    model: a step run straight after another variant's inherits that variant's heap and caches,
    and in a rotating order each variant follows the same other one in most rounds, so what it
    inherits biases its figure instead of averaging out. With a ``timer``, one more copy of the
    unplanned model takes its turn in every round, its step run under the timer (``PROFILED``,
    sampled but not a variant): the kernels priced in the minutes the variants are timed in.
    ``each_round`` runs after every timed round (``CheckpointCostRounds.run``: the checkpoint's
    host costs measured in the same minutes)."""
    runs = []
    for v in variants:
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        if v.plan is not None:
            apply_plan(m, v.plan)
        else:
            hf_cache_off(m).__enter__()  # run as every plan runs it (and as traced): no KV cache
        runs.append((v.name, m, opt))
    if timer is not None:
        m = copy.deepcopy(model)
        hf_cache_off(m).__enter__()
        runs.append((PROFILED, m, torch.optim.AdamW(m.parameters(), lr=1e-4)))

    def one(m, opt, mode=contextlib.nullcontext()) -> Sample:
        m.zero_grad(set_to_none=True)
        gc.collect()
        with mode:
            w, c = time.perf_counter(), time.thread_time()
            run_step(m, step.inputs, step.loss_fn, opt)
            return Sample((time.perf_counter() - w) * 1e3, (time.thread_time() - c) * 1e3)

    samples: dict[str, list[Sample]] = {name: [] for name, _, _ in runs}
    with gc_frozen():
        for _ in range(warmup):
            for _, m, opt in runs:
                one(m, opt)
        for r in range(rounds):
            for k in range(len(runs)):
                name, m, opt = runs[(r + k) % len(runs)]
                for _ in range(settle):
                    one(m, opt)
                samples[name].append(one(m, opt, timer if name == PROFILED else contextlib.nullcontext()))
            if each_round is not None:
                each_round()
    return samples


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True, kw_only=True)
class Row:
    variant: Variant
    step_cpu_ms: float
    step_cpu_spread: tuple[float, float]
    step_wall_ms: float
    step_wall_spread: tuple[float, float]
    overhead_cpu_ms: float
    overhead_cpu_ci: tuple[float, float]
    """The median overhead's 95 % interval (``median_ci``): where the machine's noise leaves it."""
    overhead_wall_ms: float

    @property
    def tolerance_ms(self) -> float:
        return max(TOLERANCE * self.variant.predicted_recompute_ms, FLOOR_MS)

    @property
    def within(self) -> bool:
        return abs(self.overhead_cpu_ms - self.variant.predicted_recompute_ms) <= self.tolerance_ms

    @property
    def off(self) -> bool:
        """The prediction is off beyond the noise: the whole interval misses prediction +- tolerance."""
        pred, tol = self.variant.predicted_recompute_ms, self.tolerance_ms
        lo, hi = self.overhead_cpu_ci
        return hi < pred - tol or lo > pred + tol

    @property
    def state(self) -> str:
        """"ok" within the tolerance, "OFF" beyond the noise (``off``), "noisy" neither."""
        return "ok" if self.within else "OFF" if self.off else "noisy"


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """The distribution-free ``level`` interval of the median of ``xs``: the order statistics
    ``k`` and ``n + 1 - k`` for the largest ``k`` whose binomial coverage (each sample below the
    median with probability 1/2) is at least ``level``. Too few samples for any (5 or fewer at
    95 %): ``(-inf, inf)``, which can tell nothing."""
    n, xs = len(xs), sorted(xs)
    below, k = 0.0, 0  # P(fewer than k+1 of n samples below the median), k the rank so far
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if 1 - 2 * below < level:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else (-math.inf, math.inf)


def _paired(a: list[Sample], b: list[Sample], field: str) -> list[float]:
    return [getattr(x, field) - getattr(y, field) for x, y in zip(a, b)]


def rows_of(variants: list[Variant], samples: dict[str, list[Sample]]) -> list[Row]:
    base = samples[variants[0].name]
    rows = []
    for v in variants:
        s = samples[v.name]
        cpu, wall = [x.cpu_ms for x in s], [x.wall_ms for x in s]
        d_cpu, d_wall = _paired(s, base, "cpu_ms"), _paired(s, base, "wall_ms")
        rows.append(Row(variant=v, step_cpu_ms=statistics.median(cpu), step_cpu_spread=(min(cpu), max(cpu)),
                        step_wall_ms=statistics.median(wall), step_wall_spread=(min(wall), max(wall)),
                        overhead_cpu_ms=statistics.median(d_cpu), overhead_cpu_ci=median_ci(d_cpu),
                        overhead_wall_ms=statistics.median(d_wall)))
    return rows


def render(family: str, rows: list[Row], load: tuple[str, str]) -> str:
    head = (f"{'variant':20} {'peak pred':>9} {'step cpu [min-max]':>23} {'step wall [min-max]':>24} "
            f"{'step pred':>9} {'overhead cpu [95% ci]':>26} {'wall':>7} {'pred':>7} {'err':>6} {'chains':>7} {'planned':>8}")
    lines = [f"== {family}   load before {load[0]}, after {load[1]}", head, "-" * len(head)]
    for r in rows:
        v = r.variant
        err = "" if v.plan is None else (
            f"{(r.overhead_cpu_ms - v.predicted_recompute_ms) / v.predicted_recompute_ms:+.0%}"
            if v.predicted_recompute_ms else "n/a")
        mark = "" if v.plan is None else f"  {r.state}"
        planned = "" if v.planned_recompute_ms is None or v.plan is None else f"{v.planned_recompute_ms:.1f}"
        chains = "" if v.chains_recompute_ms is None or v.plan is None else f"{v.chains_recompute_ms:.1f}"
        lines.append(
            f"{v.name:20} {v.predicted_peak_bytes / MiB:8.1f}M "
            f"{r.step_cpu_ms:8.1f} [{r.step_cpu_spread[0]:6.1f}-{r.step_cpu_spread[1]:6.1f}] "
            f"{r.step_wall_ms:8.1f} [{r.step_wall_spread[0]:6.1f}-{r.step_wall_spread[1]:7.1f}] "
            f"{v.predicted_step_ms:9.1f} "
            f"{r.overhead_cpu_ms:+8.1f} [{r.overhead_cpu_ci[0]:+7.1f} {r.overhead_cpu_ci[1]:+7.1f}] "
            f"{r.overhead_wall_ms:+7.1f} {v.predicted_recompute_ms:7.1f} {err:>6} {chains:>7} {planned:>8}{mark}")
    return "\n".join(lines)


def verdict(rows: list[Row], samples: dict[str, list[Sample]]) -> tuple[str, str]:
    """(``"PASS"``, ``"FAIL"`` or ``"NOISY"``, one line). PASS: every plan's overhead within the
    tolerance, and the plan at full AC's peak faster than full AC (median of paired CPU-time
    rounds) or the same plan. FAIL: a prediction off beyond the noise (``Row.off``), or that plan
    slower than full AC in the whole interval. NOISY: neither; the measurement cannot tell."""
    by = {r.variant.name: r for r in rows}
    plans = [r for r in rows if r.variant.plan is not None]
    off = [r.variant.name for r in plans if r.state == "OFF"]
    noisy = [r.variant.name for r in plans if r.state == "noisy"]
    at, full = by["plan @ full-AC peak"], by["full AC"]
    same = {m.fqn: (m.full, m.saved_ops) for m in at.variant.plan.modules} == \
        {m.fqn: (m.full, m.saved_ops) for m in full.variant.plan.modules}
    d = _paired(samples[at.variant.name], samples[full.variant.name], "cpu_ms")
    diff, (lo, hi) = statistics.median(d), median_ci(d)
    faster, slower = same or diff < 0, not same and lo > 0
    vs = "the same plan as full AC" if same else (
        f"plan @ full-AC peak vs full AC: {diff:+.1f} ms measured [{lo:+.1f} {hi:+.1f}], "
        f"{at.variant.predicted_recompute_ms - full.variant.predicted_recompute_ms:+.1f} ms predicted")
    status = "FAIL" if off or slower else "PASS" if not noisy and faster else "NOISY"
    why = f"overhead off by more than {TOLERANCE:.0%} / {FLOOR_MS:g} ms beyond this run's noise: {', '.join(off)}; " if off else ""
    if noisy:
        why += (f"outside the tolerance but not beyond the noise (the 95% interval reaches it): {', '.join(noisy)}; ")
    if not faster and not slower:
        why += "not faster than full AC, not slower beyond the noise; "
    return status, f"{status}: {why}{vs} (CPU time)"


def exit_status(verdicts: list[str]) -> int:
    """0 when every family passed, 1 when one failed, 2 otherwise (NOISY, or no family ran)."""
    return 1 if "FAIL" in verdicts else 0 if verdicts and all(v == "PASS" for v in verdicts) else 2


def drift_note(rows: list[Row]) -> str | None:
    """A line when the unplanned step measured more than ``TOLERANCE`` away from its prediction:
    with kernels profiled minutes before (not repriced), the machine's speed moved; repriced
    with kernels timed in the same rounds, the step's own model (its host costs) is that far off."""
    base = rows[0]
    pred = base.variant.predicted_step_ms
    if pred <= 0:
        return None
    off = (base.step_cpu_ms - pred) / pred
    if abs(off) <= TOLERANCE:
        return None
    when = ("timed in the same rounds: what the runtime model adds to the kernels misses by that much"
            if base.variant.planned_recompute_ms is not None else
            "profiled here minutes before: the machine ran at another speed, and every figure of this "
            "family moved with it")
    return (f"the unplanned step measured {base.step_cpu_ms:.1f} ms, {off:+.0%} from the {pred:.1f} predicted "
            f"from kernels {when}")


def kernel_runtime(model: torch.nn.Module, step: TrainStep, kernels: str) -> tuple[BenchmarkRuntime, str]:
    """The runtime the plans are priced by, and a line saying how: ``"step"``, each kernel's
    median time in 5 unplanned steps of the model (``profile_step_kernels``); ``"benchmark"``,
    each timed alone, warm, floored at the streaming bandwidth."""
    if kernels == "step":
        profile = profile_step_kernels(model, step)
        return profile.runtime(), f"kernels priced in the step: {profile.summary()}"
    bench = BenchmarkRuntime(stream_floor=True)
    return bench, f"kernels timed alone, floored at {bench.stream_bytes_per_ms / 1e6:.3g} GB/s (streaming copy)"


def keep_freed_memory() -> str:
    """Make glibc's malloc keep freed memory in the process (no trimming, no mmap for large
    blocks), as CUDA's caching allocator does: otherwise a step re-faults the pages the previous
    one handed back, by amounts that depend on which variant ran before in this heap, a cost the
    runtime model does not price. Returns what was done."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_trim_threshold, 2**30) and libc.mallopt(m_mmap_threshold, 2**25)
    except (OSError, AttributeError, TypeError):
        ok = False
    return ("glibc malloc keeps freed memory (mallopt: no trim; mmap only over 32 MiB)" if ok
            else "allocator left as it is (no glibc mallopt here): page faults may add to some steps")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES),
                   help="families to run (default all)")
    p.add_argument("--rounds", type=int, default=41, help="timed rounds of every variant (default 41)")
    p.add_argument("--kernels", choices=("step", "benchmark"), default="step",
                   help="price kernels by their time in unplanned steps run here (default) or timed alone")
    p.add_argument("--host", choices=("step", "chains"), default="step",
                   help="price the checkpoint's host by the calibration chains scaled by the cold factor "
                        "measured in the step on the blocks' children (default), or by the chains as they are")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write every family's samples (ms, in the order timed) and predictions to PATH")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    heap = keep_freed_memory()
    cal = calibrate_device("cpu")
    print(f"load {load_average()}; one intra-op thread; {heap}; calibrated here:\n{cal.report()}\n")
    options = PlanOptions(device=cal.spec, reserve_gib=0, trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    verdicts, record = [], {}
    for family in args.families:
        if family.startswith("hf_"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"skip {family}: transformers is not installed\n")
                continue
        model, step = FAMILIES[family]()
        bench, how = kernel_runtime(model, step, args.kernels)
        with benchmark_runtime_override(bench):  # one timing per kernel, verification traces too
            variants, est = variants_of(model, step, options)
        print(f"{family}: {how}; {bench.measurements} benchmarked alone (load {load_average()})")
        before = load_average()
        timer, host = (OpTimer(), CheckpointCostRounds()) if args.kernels == "step" else (None, None)
        timed = variants
        if timer is not None and args.host == "step":
            timed = variants + host_variants(variants[-1].plan, est.module_info)
            if len(timed) == len(variants):
                print(f"{family}: its blocks have no child with ops of its own: the chains' host costs as they are")
        samples = time_variants(model, step, timed, args.rounds, timer=timer,
                                each_round=None if host is None else host.run)
        scales = None
        if timer is not None:
            now, costs = priced_in_rounds(timer, args.rounds, bench, host)
            print(f"{family}: repriced with the kernels and the {costs.summary()}, timed in the same rounds")
            chains_options = dataclasses.replace(options, device=with_host_costs(cal.spec, costs))
            planned, variants = variants, repriced(model, step, variants, chains_options, now)
            if len(timed) > len(variants):
                with benchmark_runtime_override(now), hf_cache_off(model):
                    e = estimate(model, step, device=chains_options.spec, options=options.trace)
                scales, lines = measured_scales(timed, samples, e.module_info, chains_options.spec, e.trace)
                print(f"{family}: the host's cold factor measured in the step (blocks' children): plain "
                      f"checkpoint x{scales.plain:.2f}, selective policy x{scales.policy:.2f}\n" + "\n".join(lines))
                scaled = with_host_costs(cal.spec, costs.scaled(scales.plain, scales.policy))
                variants = [dataclasses.replace(v, chains_recompute_ms=c.predicted_recompute_ms) for v, c in
                            zip(repriced(model, step, planned, dataclasses.replace(options, device=scaled), now), variants)]
        rows = rows_of(variants, samples)
        print(render(f"{family}: {FAMILIES[family].__doc__}", rows, (before, load_average())))
        status, line = verdict(rows, samples)
        verdicts.append(status)
        record[family] = {"verdict": status, "load": [before, load_average()],
                          "host_costs_in_rounds": None if host is None else dataclasses.asdict(costs),
                         "host_scales": None if scales is None else dataclasses.asdict(scales), "variants": [
            {"name": v.name, "predicted_recompute_ms": v.predicted_recompute_ms, "planned_recompute_ms":
             v.planned_recompute_ms, "predicted_step_ms": v.predicted_step_ms,
             "chains_recompute_ms": v.chains_recompute_ms, "cpu_ms": [x.cpu_ms for x in samples[v.name]], "wall_ms": [x.wall_ms for x in samples[v.name]]}
            for v in variants]}
        if args.json is not None:  # after every family: a long run stopped midway keeps what it timed
            args.json.write_text(json.dumps({"rounds": args.rounds, "kernels": args.kernels, "families": record}, indent=1))
        if (note := drift_note(rows)) is not None:
            print(f"{family}: note: {note}")
        print(f"{family}: {line}\n")
    pred = ("the plan priced again with the rounds' kernels and host costs; planned = plan.recompute_ms"
            if args.kernels == "step" else "plan.recompute_ms")
    print(f"overhead = step - the same round's unplanned step; pred = {pred}; spread = min..max "
          f"over {args.rounds} rounds; ci = the median's 95 % interval; M = MiB. {time.perf_counter() - t0:.0f} s")
    return exit_status(verdicts)


if __name__ == "__main__":
    sys.exit(main())
