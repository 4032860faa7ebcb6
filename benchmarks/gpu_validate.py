"""GPU truth for CUDA-target plans: predicted vs measured peak and step time, at 3 budgets, for
plans made with the roofline and with kernels benchmarked on the GPU; one CSV for docs/accuracy.md.

    python benchmarks/gpu_validate.py                   # on a CUDA machine: every model, < 8 min on an H200
    python benchmarks/gpu_validate.py --models gpt_demo hf_t5 --csv out.csv
    python benchmarks/gpu_validate.py --dry-run         # the same pipeline on this CPU (tiny models)
    python benchmarks/gpu_validate.py --dry-run --target h100   # h100 plans, run on this CPU

For each model (built-in examples and HF GPT-2 / Llama / BERT / T5 from configs with their default
settings), the step (AdamW) is traced in fake mode for ``--target`` (default: the DeviceSpec of
the GPU at hand), priced two ways: by the roofline (``RuntimeKind.ROOFLINE``) and by every kernel
timed on the device (``RuntimeKind.BENCHMARK``). Budgets sit ``--budget-fracs`` of the way from
the smallest reachable peak to the no-AC peak; each mode plans each budget (verification on).
Then on the device:

* peak: the unplanned model and every plan train ``--steps`` steps (AdamW,
  ``zero_grad(set_to_none=True)``); each step's ``torch.cuda.max_memory_allocated`` (CPU: torch's
  MemTracker). Step 1 creates the optimizer state; steps 2.. are the steady state, compared with
  the prediction;
* step time: the median of steps 2..N of a separate untracked run (CUDA: synchronised), beside
  the unplanned step plus the plan's recompute priced by each runtime model; the measured
  overhead is the planned step less the unplanned one;
* saved ops matched: the plan's selective policies count their MUST_SAVE answers in step 1;
  ``matched / planned`` (a CUDA-rules plan run on a CPU misses its CUDA-only ops).

Rows go to ``--csv`` (default ``gpu_validate.csv``). Models still to run when ``--max-minutes``
is spent are skipped and named. Without CUDA (and without ``--dry-run``) it says what it needs and
exits 0; a dry run says what it skips for want of a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from estimators.runtime.device import get_device_spec  # noqa: E402
from estimators.runtime.models import RuntimeKind  # noqa: E402
from estimators.step.train_step import TrainStep, run_step  # noqa: E402
from estimators.tracing.estimation import EstimateOptions, estimate  # noqa: E402
from examples import EXAMPLES  # noqa: E402
from planner.analysis.measure import measure_step  # noqa: E402
from planner.applying.checkpointing import apply_plan, hf_cache_off  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.planning.module_plans import recompute_ms_with_saved  # noqa: E402
from planner.planning.solve import plan_for_budget  # noqa: E402
from solver import SACMilp  # noqa: E402

MiB = 2**20
Built = tuple[torch.nn.Module, Any, Callable]  # (model, inputs, loss_fn(output, inputs))


# ----------------------------------------------------------------------------- models


def _example(name: str) -> Callable[[str], Built]:
    def make(size: str) -> Built:
        model, inputs = EXAMPLES[name]()
        return model, inputs, model.loss_fn

    return make


def _hf_loss(output, inputs):
    return output.loss


SIZES = {
    "tiny": dict(batch=2, seq=64, layers=2, hidden=64, ffn=128),
    "small": dict(batch=4, seq=256, layers=4, hidden=256, ffn=688),
    "medium": dict(batch=8, seq=256, layers=4, hidden=256, ffn=1024),
}
"""The HF models' shapes: tiny for a CPU dry run, small for CPU timings, medium on a GPU."""


def _ids(size: str, vocab: int) -> torch.Tensor:
    d = SIZES[size]
    return torch.randint(0, vocab, (d["batch"], d["seq"]), generator=torch.Generator().manual_seed(1))


def _hf(build: Callable[[Any, str], tuple[torch.nn.Module, dict]]) -> Callable[[str], Built]:
    def make(size: str) -> Built:
        import transformers

        torch.manual_seed(0)
        model, inputs = build(transformers, size)
        model.train()
        return model, inputs, _hf_loss

    return make


def _dims(size: str) -> dict:
    return SIZES[size]


_VOCAB = 512


def _hf_family(config: str, model: str, config_kwargs: Callable[[dict], dict],
               mask: bool = False) -> Callable[[Any, str], tuple[torch.nn.Module, dict]]:
    """A builder of ``transformers.<model>(transformers.<config>(...))`` at ``size``, with token
    ids as inputs and labels (and, with ``mask``, an attention mask that pads the last 1/8)."""

    def build(tf, size):
        ids = _ids(size, _VOCAB)
        inputs = {"input_ids": ids}
        if mask:
            inputs["attention_mask"] = torch.ones_like(ids)
            inputs["attention_mask"][:, -ids.shape[1] // 8:] = 0  # padding: the attention gets a bias
        cfg = getattr(tf, config)(vocab_size=_VOCAB, **config_kwargs(_dims(size)))
        return getattr(tf, model)(cfg), {**inputs, "labels": ids}

    return build


_gpt2 = _hf_family("GPT2Config", "GPT2LMHeadModel", lambda d: dict(
    n_layer=d["layers"], n_embd=d["hidden"], n_head=4, n_positions=256))
_llama = _hf_family("LlamaConfig", "LlamaForCausalLM", lambda d: dict(
    num_hidden_layers=d["layers"], hidden_size=d["hidden"], intermediate_size=d["ffn"],
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
_bert = _hf_family("BertConfig", "BertForMaskedLM", lambda d: dict(
    num_hidden_layers=d["layers"], hidden_size=d["hidden"], intermediate_size=d["ffn"],
    num_attention_heads=4, max_position_embeddings=256), mask=True)
_t5 = _hf_family("T5Config", "T5ForConditionalGeneration", lambda d: dict(
    num_layers=d["layers"], num_decoder_layers=d["layers"], d_model=d["hidden"], d_ff=d["ffn"],
    d_kv=d["hidden"] // 4, num_heads=4, decoder_start_token_id=0))


MODELS: dict[str, Callable[[str], Built]] = {
    "gpt_tiny": _example("gpt_tiny"),
    "gpt_demo": _example("gpt_demo"),
    "convnet_demo": _example("convnet_demo"),
    "llama_tiny": _example("llama_tiny"),
    "hf_gpt2": _hf(_gpt2),
    "hf_llama": _hf(_llama),
    "hf_bert": _hf(_bert),
    "hf_t5": _hf(_t5),
}


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class Row:
    """One model run one way (unplanned, or a plan of one mode at one budget): predicted and
    measured. A CSV row."""

    model: str
    target: str
    device: str
    plan_mode: str
    """"none" (unplanned), "roofline" or "benchmark": the runtime model the plan was made with."""
    budget_frac: float
    """Where the budget sits from the smallest reachable peak (0) to the no-AC peak (1); NaN: none."""
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_step1_bytes: int
    measured_peak_steady_bytes: int
    """Largest peak of steps 2..N (step 1's alone with one step)."""
    predicted_step_ms_roofline: float
    predicted_step_ms_benchmark: float
    """NaN where the target's kernels cannot run here (a CUDA target in a CPU dry run)."""
    measured_step_ms: float
    predicted_recompute_ms_roofline: float
    predicted_recompute_ms_benchmark: float
    measured_overhead_ms: float
    """This run's step less the unplanned step (0 for the unplanned row)."""
    checkpointed_modules: int
    saved_ops_planned: int
    saved_ops_matched: int
    tracker: str

    @property
    def peak_error(self) -> float:
        return (self.measured_peak_steady_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes


def _ms(x: float) -> str:
    return "     n/a" if math.isnan(x) else f"{x:8.2f}"


def render(rows: list[Row]) -> str:
    head = (f"{'model':13} {'mode':9} {'frac':>4} {'peak pred':>10} {'step1':>10} {'steady':>10} {'err':>7}  "
            f"{'ms roof':>8} {'ms bench':>8} {'ms meas':>8}  {'rc roof':>8} {'rc bench':>8} {'ovh meas':>8}  saved")
    lines = [head, "-" * len(head)]
    for r in rows:
        frac = "" if math.isnan(r.budget_frac) else f"{r.budget_frac:.1f}"
        lines.append(
            f"{r.model:13} {r.plan_mode:9} {frac:>4} {r.predicted_peak_bytes / MiB:9.2f}M "
            f"{r.measured_peak_step1_bytes / MiB:9.2f}M {r.measured_peak_steady_bytes / MiB:9.2f}M "
            f"{100 * r.peak_error:+6.2f}%  {_ms(r.predicted_step_ms_roofline)} {_ms(r.predicted_step_ms_benchmark)} "
            f"{_ms(r.measured_step_ms)}  {_ms(r.predicted_recompute_ms_roofline)} "
            f"{_ms(r.predicted_recompute_ms_benchmark)} {_ms(r.measured_overhead_ms)}  "
            f"{r.saved_ops_matched}/{r.saved_ops_planned}")
    if rows:
        lines.append(f"peaks by {rows[0].tracker} on {rows[0].device}, target {rows[0].target}; err = steady vs "
                     "pred; ms = step (unplanned + recompute), rc = recompute, ovh = measured step - unplanned; "
                     "M = MiB; saved = MUST_SAVE hits in step 1 / the plan's saved ops")
    return "\n".join(lines)


def write_csv(rows: list[Row], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Row)])
        w.writeheader()
        w.writerows(asdict(r) for r in rows)


# ----------------------------------------------------------------------------- pieces


def plan_step_ms(est, plan: Plan) -> float:
    """The unplanned step plus the plan's recompute, priced by ``est``'s runtime model (the
    planner's own rule: every op a checkpointed module re-runs)."""
    return est.module_info.step_runtime_ms + recompute_of(est, plan)


def recompute_of(est, plan: Plan) -> float:
    """The plan's recompute priced by ``est``'s runtime model."""
    return sum(recompute_ms_with_saved(est.module_info.stats(mp.fqn), frozenset(mp.saved_ops)) for mp in plan.modules)


def saved_hits(model) -> int:
    """MUST_SAVE answers so far of every planned module's policy: the plan's saved ops matched."""
    return sum(getattr(m.__dict__.get("forward"), "saved_hits", 0) for m in model.modules())


def train_steps(model, inputs, loss_fn, steps: int, plan: Plan | None = None):
    """(peak bytes per step, MUST_SAVE hits in step 1's forward, tracker name)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks, hits = [], 0
    with apply_plan(model, plan) if plan else contextlib.nullcontext():
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            m = measure_step(model, inputs, loss_fn, opt)
            peaks.append(m.peak_bytes)
            if step == 0:
                hits = saved_hits(model)
    return peaks, hits, m.tracker


def time_steps(model, inputs, loss_fn, steps: int, plan: Plan | None) -> float:
    """Median time of steps 2..N in ms, untracked (CPU's MemTracker slows a step down)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    times = []
    with apply_plan(model, plan) if plan else contextlib.nullcontext():
        for _ in range(max(steps, 2)):
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            run_step(model, inputs, loss_fn, opt)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def _to(device: torch.device, inputs):
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def _gpu_spec_name() -> str:
    name = torch.cuda.get_device_name().lower()
    mem_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    for key, spec in (("h200", "h200"), ("h100", "h100"), ("b200", "b200"), ("l4", "l4")):
        if key in name:
            return spec
    if "a100" in name:
        return "a100-80gb" if mem_gib > 50 else "a100-40gb"
    print(f"note: no DeviceSpec for {torch.cuda.get_device_name()!r}; planning for h100", file=sys.stderr)
    return "h100"


def _measured(model, dev_inputs, loss_fn, device, steps: int, plan: Plan | None):
    """(peaks per step, MUST_SAVE hits, tracker, median step ms) of ``plan`` on a fresh copy."""
    peaks, hits, tracker = train_steps(copy.deepcopy(model).to(device), dev_inputs, loss_fn, steps, plan)
    ms = time_steps(copy.deepcopy(model).to(device), dev_inputs, loss_fn, steps, plan)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peaks, hits, tracker, ms


def validate(name: str, *, target: str, device: torch.device, size: str, budget_fracs: tuple[float, ...],
             steps: int) -> list[Row]:
    """The unplanned row and one row per mode and budget for model ``name``."""
    model, inputs, loss_fn = MODELS[name](size)
    step = TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer="adamw")
    modes = [RuntimeKind.ROOFLINE]
    if get_device_spec(target).kind == device.type:  # else: kernels of the target cannot run here
        modes.append(RuntimeKind.BENCHMARK)
    with hf_cache_off(model):
        ests = {m: estimate(model, step, device=target, options=EstimateOptions(runtime=m)) for m in modes}
    roof = ests[RuntimeKind.ROOFLINE]
    bench = ests.get(RuntimeKind.BENCHMARK)
    milp = SACMilp(roof.module_info)
    low, high = milp.min_reachable_peak_bytes(), roof.module_info.peak_bytes
    dev_inputs = _to(device, inputs)
    peaks, _, tracker, base_ms = _measured(model, dev_inputs, loss_fn, device, steps, None)
    nan = math.nan

    def row(mode: str, frac: float, budget: int, plan: Plan | None, peaks, hits, ms) -> Row:
        mods = plan.modules if plan else ()
        return Row(
            model=name, target=target, device=str(device), plan_mode=mode, budget_frac=frac, budget_bytes=budget,
            predicted_peak_bytes=plan.predicted_peak_bytes if plan else high,
            measured_peak_step1_bytes=peaks[0], measured_peak_steady_bytes=max(peaks[1:] or peaks),
            predicted_step_ms_roofline=roof.module_info.step_runtime_ms + (recompute_of(roof, plan) if plan else 0.0),
            predicted_step_ms_benchmark=(bench.module_info.step_runtime_ms + (recompute_of(bench, plan) if plan else 0.0))
            if bench else nan,
            measured_step_ms=ms,
            predicted_recompute_ms_roofline=recompute_of(roof, plan) if plan else 0.0,
            predicted_recompute_ms_benchmark=(recompute_of(bench, plan) if plan else 0.0) if bench else nan,
            measured_overhead_ms=ms - base_ms, checkpointed_modules=len(mods),
            saved_ops_planned=sum(len(m.saved_ops) for m in mods), saved_ops_matched=hits, tracker=tracker)

    rows = [row("none", nan, high, None, peaks, 0, base_ms)]
    for mode in modes:
        est = ests[mode]
        milp = SACMilp(est.module_info)
        for frac in budget_fracs:
            budget = int(low + frac * (high - low))
            plan = plan_for_budget(model, est, budget, milp=milp)
            peaks, hits, _, ms = _measured(model, dev_inputs, loss_fn, device, steps, plan)
            rows.append(row(mode.value, frac, budget, plan, peaks, hits, ms))
    return rows


NEEDS = """gpu_validate needs a CUDA GPU: torch.cuda.is_available() is False here (torch {torch}, CUDA
build: {cuda}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch (and
`pip install transformers` for the HF models):

    python benchmarks/gpu_validate.py [--models ...] [--csv out.csv]

or try the same pipeline on this CPU: python benchmarks/gpu_validate.py --dry-run (or --device cpu)"""

SKIPPED_ON_CPU = ("dry run on CPU: skipped for want of a GPU: torch.cuda.max_memory_allocated (peaks are "
                  "MemTracker's), CUDA kernels timed for the benchmark mode (a CUDA --target is priced by "
                  "its roofline only), CUDA-only ops of a CUDA-rules plan (flash attention, native_dropout: "
                  "recomputed here), GPU step times")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to validate (default all)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to measure (default cuda; cpu: a dry run)")
    p.add_argument("--dry-run", action="store_true", help="the same as --device cpu")
    p.add_argument("--target", help="DeviceSpec to plan for (default: the GPU at hand; cpu in a dry run)")
    p.add_argument("--size", choices=list(SIZES), help="HF model size (default medium on cuda, tiny on cpu)")
    p.add_argument("--budget-fracs", type=float, nargs="+", default=[0.2, 0.5, 0.8],
                   help="budgets between the smallest reachable (0) and the no-AC peak (1) (default 0.2 0.5 0.8)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 5 on cuda, 2 on cpu)")
    p.add_argument("--csv", default="gpu_validate.csv", help="write the rows here (default gpu_validate.csv)")
    p.add_argument("--max-minutes", type=float, default=7.5, help="start no model after this many minutes (default 7.5)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    steps = args.steps if args.steps is not None else (5 if device.type == "cuda" else 2)
    if not all(0 <= f <= 1 for f in args.budget_fracs) or steps < 1:
        p.error("--budget-fracs must be in [0, 1] and --steps >= 1")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(NEEDS.format(torch=torch.__version__, cuda=torch.version.cuda))
        return 0
    target = args.target or (_gpu_spec_name() if device.type == "cuda" else "cpu")
    size = args.size or ("medium" if device.type == "cuda" else "tiny")
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny kernels: an intra-op pool only contends for the cores
        print(SKIPPED_ON_CPU)
    t0 = time.perf_counter()
    rows, failures, skipped = [], [], []
    for name in args.models:
        if time.perf_counter() - t0 > 60 * args.max_minutes:
            skipped.append(name)
            continue
        if name.startswith("hf_"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"skip {name}: transformers is not installed", file=sys.stderr)
                continue
        try:
            rows += validate(name, target=target, device=device, size=size,
                             budget_fracs=tuple(args.budget_fracs), steps=steps)
        except Exception as e:  # noqa: BLE001 -- report every model, then fail
            failures.append(f"{name}: {type(e).__name__}: {e}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(render(rows))
    if skipped:
        print(f"not run (--max-minutes {args.max_minutes:g} spent): {', '.join(skipped)}")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    if args.csv:
        write_csv(rows, args.csv)
        print(f"{len(rows)} rows in {args.csv}; {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
