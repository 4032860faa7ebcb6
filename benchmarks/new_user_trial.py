"""A new user's trial: 14 Hugging Face families, each planned, applied and checked in its own loop.

    python benchmarks/new_user_trial.py                 # every family
    python benchmarks/new_user_trial.py mixtral resnet  # some of them

Each family is built from a tiny config (no weights), trained as its users train it: AdamW
(``torch.optim.AdamW(model.parameters())``), 3 steps, bf16 autocast where the family trains so,
gradient accumulation for DeBERTa-v2 and Swin, an EMA copy of the model kept alive (and updated
after each step) for Whisper. It is planned with ``solve_sac`` at a budget 65 % of the way from
the smallest reachable peak to the no-AC peak (so real checkpointing is needed), the plan applied
to a copy, and both copies run the same loop from the same seed. Checked:

* planning left the model as it was (values, buffers, ``.grad``, ``requires_grad``, hooks, config);
* losses of every step, the last step's gradients, the parameters and every buffer (BatchNorm
  statistics) of the planned run bitwise equal to the unplanned run's;
* the measured steady-state peak (steps 2-3, ``planner.analysis.measure.measure_steps``, torch's
  MemTracker) equal to the prediction, planned (``plan.predicted_peak_bytes``) and unplanned
  (``plan.baseline_peak_bytes``).

One row per family; the exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from estimators.tracing.estimation import estimate  # noqa: E402
from estimators.step.train_step import TrainStep  # noqa: E402
from planner import apply_plan, solve_sac  # noqa: E402
from planner.applying.checkpointing import hf_cache_off  # noqa: E402
from planner.analysis.measure import measure_steps  # noqa: E402
from solver import SACMilp  # noqa: E402
from planner.options import PlanOptions

GiB = 1024**3
FRACTION = 0.65  # of the way from the smallest reachable peak to the no-AC peak
N_STEPS = 3
SEED = 1
VOCAB, HIDDEN, SEQ, BATCH = 128, 32, 16, 2


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], tuple[torch.nn.Module, dict]]
    autocast_dtype: torch.dtype | None = None
    micro_batches: int = 1
    ema: bool = False
    """The loop keeps an EMA copy of the model alive (and updates it after each step)."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None


def _ids(batch=BATCH, seq=SEQ, vocab=VOCAB):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _pixels(batch=BATCH, size=32, labels=4):
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (batch,), generator=g)}


def _families() -> dict[str, Family]:
    import transformers as T

    dec = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    bert_like = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=2 * HIDDEN, max_position_embeddings=64)
    bf16 = torch.bfloat16

    def whisper():
        cfg = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
                              encoder_attention_heads=2, decoder_attention_heads=2, d_model=HIDDEN,
                              encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN,
                              max_source_positions=16, max_target_positions=SEQ, pad_token_id=0,
                              decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(BATCH, 8, 32, generator=g)
        return T.WhisperForConditionalGeneration(cfg), {"input_features": feats, "labels": _ids(seq=8)["labels"]}

    def clip():
        cfg = T.CLIPConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=SEQ),
            vision_config=dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                               num_attention_heads=2, image_size=32, patch_size=8),
            projection_dim=16)
        model = T.CLIPModel(cfg)
        model.logit_scale.requires_grad_(False)  # a fixed temperature: a frozen parameter
        batch = {"input_ids": _ids(batch=8)["input_ids"], "pixel_values": _pixels(batch=8)["pixel_values"],
                 "return_loss": True}
        return model, batch

    fams = [
        Family("mixtral", lambda: (T.MixtralForCausalLM(T.MixtralConfig(
            **{**dec, "max_position_embeddings": 64}, num_local_experts=4, num_experts_per_tok=2)),
            _ids(batch=8, seq=64)), bf16),
        Family("qwen2_moe", lambda: (T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **dec, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN)), _ids(batch=4, seq=SEQ)), bf16),
        Family("falcon", lambda: (T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=SEQ, attention_dropout=0.1, hidden_dropout=0.1)), _ids()), bf16),
        Family("bloom", lambda: (T.BloomForCausalLM(T.BloomConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=2, attention_dropout=0.1,
            hidden_dropout=0.1)), _ids()), bf16),
        Family("albert", lambda: (T.AlbertForMaskedLM(T.AlbertConfig(
            **{**bert_like, "num_hidden_layers": 3}, embedding_size=16)), _ids())),
        Family("deberta_v2", lambda: (T.DebertaV2ForMaskedLM(T.DebertaV2Config(
            **bert_like, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])), _ids()),
            micro_batches=2),
        Family("whisper", whisper, bf16, ema=True),
        Family("convnext", lambda: (T.ConvNextForImageClassification(T.ConvNextConfig(
            num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4, image_size=32)), _pixels()), bf16),
        Family("resnet", lambda: (T.ResNetForImageClassification(T.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
            num_labels=4)), _pixels())),
        Family("mobilenet_v2", lambda: (T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
            num_channels=3, image_size=32, depth_multiplier=0.25, num_labels=4)), _pixels())),
        Family("swin", lambda: (T.SwinForImageClassification(T.SwinConfig(
            image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4,
            num_labels=4)), _pixels()), micro_batches=2),
        Family("clip", clip),
        Family("mamba", lambda: (T.MambaForCausalLM(T.MambaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=4)), _ids()), bf16),
        Family("bigbird", lambda: (T.BigBirdForMaskedLM(T.BigBirdConfig(
            **bert_like, attention_type="original_full")), _ids())),
    ]
    return {f.name: f for f in fams}


def _snapshot(model: torch.nn.Module) -> dict:
    """What planning must leave as it was."""
    cfg = getattr(model, "config", None)
    return {
        "tensors": {k: v.detach().clone() for k, v in {**dict(model.named_parameters()),
                                                        **dict(model.named_buffers())}.items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "hooks": {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                      type(m).forward is getattr(m.forward, "__func__", None), m.training)
                  for n, m in model.named_modules()},
        "config": cfg.to_dict() if cfg is not None else None,
    }


def _unchanged(a: dict, b: dict) -> bool:
    return (a["tensors"].keys() == b["tensors"].keys()
            and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
            and all((x is None and b["grads"][n] is None) or (x is not None and b["grads"][n] is not None
                                                              and torch.equal(x, b["grads"][n]))
                    for n, x in a["grads"].items())
            and a["requires_grad"] == b["requires_grad"] and a["hooks"] == b["hooks"] and a["config"] == b["config"])


def _ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float = 0.99) -> None:
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - decay)


def run_loop(model: torch.nn.Module, step: TrainStep, ema: torch.nn.Module | None) -> tuple[list, dict]:
    """The user's loop: AdamW over all parameters, N_STEPS measured steps (EMA updated after each)."""
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(SEED)
    measured = []
    for i in range(N_STEPS):
        if i:
            opt.zero_grad()
        measured += measure_steps(model, step, opt, n_steps=1)
        if ema is not None:
            _ema_update(ema, model)
    state = {
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "tensors": {**dict(model.named_parameters()), **dict(model.named_buffers())},
    }
    return measured, state


def _bitwise(a: dict, b: dict) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


@dataclass
class Row:
    name: str
    step: str
    unplanned_pred: int = 0
    unplanned_meas: int = 0
    planned_pred: int = 0
    planned_meas: int = 0
    modules: int = 0
    grads_equal: bool = False
    buffers_equal: bool = False
    unchanged: bool = False
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and self.grads_equal and self.buffers_equal and self.unchanged
                and self.planned_pred == self.planned_meas and self.unplanned_pred == self.unplanned_meas
                and self.planned_meas < self.unplanned_meas)


def trial(fam: Family) -> Row:
    t0 = time.perf_counter()
    desc = (f"{'bf16' if fam.autocast_dtype else 'fp32'}" + (f" x{fam.micro_batches}" if fam.micro_batches > 1 else "")
            + (" +EMA" if fam.ema else ""))
    row = Row(fam.name, desc)
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, inputs = fam.build()
        model.train()
        ema = copy.deepcopy(model).requires_grad_(False) if fam.ema else None
        step = TrainStep(inputs=inputs, loss_fn=fam.loss_fn, optimizer="adamw", micro_batches=fam.micro_batches,
                         autocast_dtype=fam.autocast_dtype, held=(ema,) if fam.ema else ())
        before = _snapshot(model)
        with hf_cache_off(model):
            est = estimate(model, step, device="cpu")
        low, high = SACMilp(est.module_info).min_reachable_peak_bytes(), est.module_info.peak_bytes
        budget = int(low + FRACTION * (high - low))
        plan = solve_sac(model, budget / GiB, step, options=PlanOptions(device="cpu"))
        row.unchanged = _unchanged(before, _snapshot(model))
        row.modules = len(plan.modules)
        row.planned_pred, row.unplanned_pred = plan.predicted_peak_bytes, plan.baseline_peak_bytes
        plain, planned = copy.deepcopy(model), copy.deepcopy(model)
        ema_plain, ema_planned = copy.deepcopy(ema), copy.deepcopy(ema)
        del ema  # each run's loop holds its own EMA copy
        held = lambda e: dataclasses.replace(step, held=(e,) if e is not None else ())  # noqa: E731
        ref, ref_state = run_loop(plain, held(ema_plain), ema_plain)
        with apply_plan(planned, plan):
            got, got_state = run_loop(planned, held(ema_planned), ema_planned)
        row.unplanned_meas = max(m.peak_bytes for m in ref[1:])
        row.planned_meas = max(m.peak_bytes for m in got[1:])
        params = {n for n, _ in plain.named_parameters()}
        row.grads_equal = ([m.loss for m in ref] == [m.loss for m in got]
                           and _bitwise(ref_state["grads"], got_state["grads"])
                           and _bitwise({k: v for k, v in ref_state["tensors"].items() if k in params},
                                        {k: v for k, v in got_state["tensors"].items() if k in params}))
        row.buffers_equal = _bitwise({k: v for k, v in ref_state["tensors"].items() if k not in params},
                                     {k: v for k, v in got_state["tensors"].items() if k not in params})
    except Exception as e:  # noqa: BLE001 - a trial reports every failure and goes on
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        traceback.print_exc()
    row.seconds = time.perf_counter() - t0
    return row


def _fmt(n: int) -> str:
    return f"{n:,}" if n else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="*", help="family names (default: all)")
    args = p.parse_args(argv)
    fams = _families()
    names = args.families or list(fams)
    unknown = [n for n in names if n not in fams]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(fams)}")
    head = (f"{'family':13s} {'step':12s} {'mods':>4s} {'unplanned pred':>15s} {'measured':>11s} "
            f"{'planned pred':>13s} {'measured':>11s} {'saved':>6s} {'grads':>5s} {'bufs':>5s} {'model':>5s} {'s':>5s}")
    rows = []
    print(head)
    for n in names:
        r = trial(fams[n])
        rows.append(r)
        yes = lambda b: "YES" if b else "NO"  # noqa: E731
        saved = f"{1 - r.planned_meas / r.unplanned_meas:.0%}" if r.unplanned_meas else "-"
        print(f"{r.name:13s} {r.step:12s} {r.modules:4d} {_fmt(r.unplanned_pred):>15s} {_fmt(r.unplanned_meas):>11s} "
              f"{_fmt(r.planned_pred):>13s} {_fmt(r.planned_meas):>11s} {saved:>6s} {yes(r.grads_equal):>5s} "
              f"{yes(r.buffers_equal):>5s} {'same' if r.unchanged else 'CHNG':>5s} {r.seconds:5.1f}"
              + ("" if r.ok else "  FAIL" + (f": {r.error}" if r.error else "")), flush=True)
    failed = [r.name for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} families pass" + (f"; failing: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
