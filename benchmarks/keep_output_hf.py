"""A Hugging Face loop that keeps the model output, written out by hand and measured, against the plan.

    python benchmarks/keep_output_hf.py               # keep_output=True: predicted to the byte
    python benchmarks/keep_output_hf.py --drop        # the default: the under-prediction it fixes

A 2-layer Qwen2 built from a small config (vocabulary 512, hidden 32, batch 4 x 32, dropout on),
trained 3 steps with AdamW in the loop ``out = model(**batch); out.loss.backward();
opt.step(); opt.zero_grad()`` -- not the planner's step -- each step measured by torch's
MemTracker (the previous step's output, alive until the next forward returns, is tracked).
Prediction: ``estimate(..., step=TrainStep(keep_output=...))``; the unplanned model runs with
HF's ``use_cache`` on, so its prediction is traced so too; the plan (35 % of the way from the
smallest reachable peak to the no-AC peak) is made as ``solve_sac`` makes it (cache off in
planned modules). Gradients of step 1, planned and unplanned, are compared bitwise.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from estimators.tracing.estimation import estimate  # noqa: E402
from estimators.step.train_step import TrainStep  # noqa: E402
from estimators.tracing.trace import held_tensors  # noqa: E402
from planner.applying.checkpointing import apply_plan, hf_cache_off  # noqa: E402
from planner.planning.solve import plan_for_budget  # noqa: E402
from solver import SACMilp  # noqa: E402

VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 512, 32, 2, 32, 4


def build():
    import transformers as T

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.Qwen2ForCausalLM(T.Qwen2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ, attention_dropout=0.1))
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def own_loop(model, batch, n_steps=3, seed=1):
    """Peaks per step and step 1's gradients of the loop that keeps ``out``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(seed)
    peaks, grads, out = [], None, None
    for _ in range(n_steps):
        held = held_tensors(out)  # logits, loss and the K/V cache (pytree does not open HF's DynamicCache)
        mt = MemTracker()
        mt.track_external(model, opt, *batch.values(), *held)
        del held
        with mt:
            out = model(**batch)
            out.loss.backward()
            grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        peaks.append(int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
    return peaks, grads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drop", action="store_true", help="predict with keep_output=False (the default)")
    args = p.parse_args(argv)
    model, batch = build()
    step = TrainStep(inputs=batch, optimizer="adamw", keep_output=not args.drop)
    plain, planned = copy.deepcopy(model), copy.deepcopy(model)
    predicted = estimate(model, step, device="cpu").module_info.peak_bytes  # use_cache on
    peaks, ref = own_loop(plain, batch)
    with hf_cache_off(model):
        est = estimate(model, step, device="cpu")
    milp = SACMilp(est.module_info)
    low, high = milp.min_reachable_peak_bytes(), est.module_info.peak_bytes
    plan = plan_for_budget(model, est, int(low + 0.35 * (high - low)), milp=milp)
    with apply_plan(planned, plan):
        planned_peaks, grads = own_loop(planned, batch)
    equal = all(torch.equal(grads[n], g) for n, g in ref.items())
    print(f"keep_output={step.keep_output}; logits {BATCH * SEQ * VOCAB * 4:,} B")
    for what, pred, got in (("unplanned", predicted, peaks), (f"planned ({len(plan.modules)} modules)",
                                                             plan.predicted_peak_bytes, planned_peaks)):
        err = got[-1] - pred
        print(f"  {what:22s} predicted {pred:>10,} B  measured {', '.join(f'{g:,}' for g in got)} B"
              f"  steady-state error {err:+,} B ({err / pred:+.2%})")
    print(f"  gradients (step 1)     bitwise {'EQUAL' if equal else 'DIFFERENT'}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
