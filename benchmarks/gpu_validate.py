"""GPU truth for CUDA-target plans: predicted vs measured peak and step time, saved ops matched.

    python benchmarks/gpu_validate.py                        # on a CUDA machine: every model below
    python benchmarks/gpu_validate.py --models gpt_demo hf_t5 --budget-frac 0.2 --json out.json
    python benchmarks/gpu_validate.py --device cpu           # dry run of the same pipeline on CPU
    python benchmarks/gpu_validate.py --device cpu --target h100   # an h100 plan run on this CPU

For each model (built-in examples and HF GPT-2 / Llama / BERT / T5 from small configs with their
default settings): trace the step in fake mode for ``--target`` (default: the DeviceSpec of the
GPU at hand, e.g. h100), plan for a budget ``--budget-frac`` of the way from the smallest reachable
peak to the no-AC peak (verification on), then, on the real device:

* peak: the unplanned model and the planned model each train ``--steps`` steps (AdamW,
  ``zero_grad(set_to_none=True)``); each step's ``torch.cuda.max_memory_allocated`` (CPU:
  torch's MemTracker, through planner.analysis.measure). Step 1 creates the optimizer state; steps 2.. are
  the steady state. Both are printed beside the prediction (no-AC and planned peak).
* step time: predicted by the roofline (``EstimateOptions(runtime=RuntimeKind.ROOFLINE)``) and by
  benchmarked kernels (``RuntimeKind.BENCHMARK``: every op timed on this device) -- each is the
  unplanned step plus the plan's recompute, priced by that runtime -- against the median wall time
  of steps 2..N of the planned model in a separate run without a memory tracker.
* saved ops matched: the plan's selective policies are wrapped to count their MUST_SAVE answers in
  step 1's forward; ``matched / planned`` is how many of the plan's saved ops (op, occurrence)
  were met by an op of that name on the device. A plan made under the CUDA rules matches fully on
  CUDA; on CPU its CUDA-only ops (flash / efficient attention, native_dropout) are not found and
  simply get recomputed.

On a machine without CUDA (and without ``--device cpu``) it says what it needs and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from estimators.runtime.device import get_device_spec  # noqa: E402
from estimators.tracing.estimation import EstimateOptions, estimate  # noqa: E402
from estimators.runtime.models import RuntimeKind  # noqa: E402
from estimators.step.train_step import run_step  # noqa: E402
from examples import EXAMPLES  # noqa: E402
from planner.applying.checkpointing import apply_plan  # noqa: E402
from planner.analysis.measure import measure_step  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.planning.module_plans import recompute_ms_with_saved  # noqa: E402
from planner.planning.solve import plan_for_budget  # noqa: E402
from solver import SACMilp  # noqa: E402
from estimators.step.train_step import TrainStep

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


def _ids(size: str, vocab: int) -> torch.Tensor:
    batch, seq = (2, 64) if size == "tiny" else (8, 256)
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _hf(build: Callable[[Any, str], tuple[torch.nn.Module, dict]]) -> Callable[[str], Built]:
    def make(size: str) -> Built:
        import transformers

        torch.manual_seed(0)
        model, inputs = build(transformers, size)
        model.train()
        return model, inputs, _hf_loss

    return make


def _dims(size: str) -> dict:
    return dict(layers=2, hidden=64, ffn=128) if size == "tiny" else dict(layers=4, hidden=256, ffn=1024)


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
class Validation:
    """One model: what was predicted and what the device measured."""

    model: str
    target: str
    device: str
    budget_bytes: int
    predicted_no_ac_peak_bytes: int
    predicted_peak_bytes: int
    measured_no_ac_peak_bytes: tuple[int, ...]
    """Unplanned model, one peak per step (step 1 creates the optimizer state)."""
    measured_peak_bytes: tuple[int, ...]
    """Planned model, one peak per step."""
    predicted_step_ms_roofline: float
    predicted_step_ms_benchmark: float
    """NaN when the target's kernels cannot run here (a CUDA target in a CPU dry run)."""
    measured_step_ms: float
    """Median over steps 2..N of the planned model (a separate, untracked run)."""
    saved_ops_planned: int
    saved_ops_matched: int
    checkpointed_modules: int
    tracker: str

    @property
    def steady_peak_bytes(self) -> int:
        return max(self.measured_peak_bytes[1:] or self.measured_peak_bytes)


def _pct(measured: float, predicted: float) -> str:
    return f"{100 * (measured - predicted) / predicted:+.1f}%" if predicted else "n/a"


def render(rows: list[Validation]) -> str:
    head = (f"{'model':13} {'target':7} {'budget':>9} {'noAC pred':>10} {'noAC meas':>10} "
            f"{'plan pred':>10} {'step1':>9} {'steady':>9} {'err':>7}  {'ms roof':>8} {'ms bench':>8} "
            f"{'ms meas':>8}  saved")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.model:13} {r.target:7} {r.budget_bytes / MiB:8.2f}M "
            f"{r.predicted_no_ac_peak_bytes / MiB:9.2f}M {max(r.measured_no_ac_peak_bytes[1:] or r.measured_no_ac_peak_bytes) / MiB:9.2f}M "
            f"{r.predicted_peak_bytes / MiB:9.2f}M {r.measured_peak_bytes[0] / MiB:8.2f}M "
            f"{r.steady_peak_bytes / MiB:8.2f}M {_pct(r.steady_peak_bytes, r.predicted_peak_bytes):>7}  "
            f"{r.predicted_step_ms_roofline:8.3f} {r.predicted_step_ms_benchmark:8.3f} {r.measured_step_ms:8.3f}  "
            f"{r.saved_ops_matched}/{r.saved_ops_planned}"
        )
    if rows:
        lines.append(f"peaks measured by {rows[0].tracker} on {rows[0].device}; err = steady vs plan pred; "
                     "M = MiB; saved = MUST_SAVE hits in step 1 / the plan's saved ops")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pieces


def plan_step_ms(est, plan: Plan) -> float:
    """The unplanned step plus the plan's recompute, priced by ``est``'s runtime model (the
    planner's own rule: every op a checkpointed module re-runs)."""
    return est.module_info.step_runtime_ms + sum(
        recompute_ms_with_saved(est.module_info.stats(mp.fqn), frozenset(mp.saved_ops)) for mp in plan.modules)


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


def time_steps(model, inputs, loss_fn, steps: int, plan: Plan) -> float:
    """Median wall time of steps 2..N in ms, untracked (CPU's MemTracker slows a step down)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    times = []
    with apply_plan(model, plan):
        for step in range(max(steps, 2)):
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


def validate(name: str, *, target: str, device: torch.device, size: str, budget_frac: float,
             steps: int) -> Validation:
    model, inputs, loss_fn = MODELS[name](size)
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer="adamw"), device=target, options=EstimateOptions(runtime=RuntimeKind.ROOFLINE))
    milp = SACMilp(est.module_info)
    low, high = milp.min_reachable_peak_bytes(), est.module_info.peak_bytes
    budget = int(low + budget_frac * (high - low))
    plan = plan_for_budget(model, est, budget, milp=milp)
    bench_ms = math.nan  # kernels of a CUDA target cannot be timed on this CPU (dry run)
    if get_device_spec(target).kind == device.type:
        bench = estimate(model, TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer="adamw"), device=target, options=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
        bench_ms = plan_step_ms(bench, plan)
    dev_inputs = _to(device, inputs)
    base_peaks, _, _ = train_steps(copy.deepcopy(model).to(device), dev_inputs, loss_fn, steps)
    timed = copy.deepcopy(model).to(device)
    peaks, hits, tracker = train_steps(model.to(device), dev_inputs, loss_fn, steps, plan)
    return Validation(
        model=name, target=target, device=str(device), budget_bytes=budget,
        predicted_no_ac_peak_bytes=high, predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_no_ac_peak_bytes=tuple(base_peaks), measured_peak_bytes=tuple(peaks),
        predicted_step_ms_roofline=plan_step_ms(est, plan), predicted_step_ms_benchmark=bench_ms,
        measured_step_ms=time_steps(timed, dev_inputs, loss_fn, steps, plan),
        saved_ops_planned=sum(len(m.saved_ops) for m in plan.modules), saved_ops_matched=hits,
        checkpointed_modules=len(plan.modules), tracker=tracker,
    )


NEEDS = """gpu_validate needs a CUDA GPU: torch.cuda.is_available() is False here (torch {torch}, CUDA
build: {cuda}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch (and
`pip install transformers` for the HF models):

    python benchmarks/gpu_validate.py [--models ...] [--json out.json]

or try the same pipeline on this CPU: python benchmarks/gpu_validate.py --device cpu"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to validate (default all)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to measure (default cuda; cpu: dry run)")
    p.add_argument("--target", help="DeviceSpec to plan for (default: the GPU at hand; cpu with --device cpu)")
    p.add_argument("--size", choices=["tiny", "medium"], help="HF model size (default medium on cuda, tiny on cpu)")
    p.add_argument("--budget-frac", type=float, default=0.3, help="budget between the smallest reachable (0) and the no-AC peak (1) (default 0.3)")
    p.add_argument("--steps", type=int, default=3, help="training steps measured per model (default 3; >= 2 for a steady state)")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if not 0 <= args.budget_frac <= 1 or args.steps < 1:
        p.error("--budget-frac must be in [0, 1] and --steps >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NEEDS.format(torch=torch.__version__, cuda=torch.version.cuda))
        return 0
    device = torch.device(args.device)
    target = args.target or (_gpu_spec_name() if device.type == "cuda" else "cpu")
    size = args.size or ("medium" if device.type == "cuda" else "tiny")
    rows, failures = [], []
    for name in args.models:
        if name.startswith("hf_"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"skip {name}: transformers is not installed", file=sys.stderr)
                continue
        try:
            rows.append(validate(name, target=target, device=device, size=size,
                                 budget_frac=args.budget_frac, steps=args.steps))
        except Exception as e:  # noqa: BLE001 -- report every model, then fail
            failures.append(f"{name}: {type(e).__name__}: {e}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(render(rows))
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
