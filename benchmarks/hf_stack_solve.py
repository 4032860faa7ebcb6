"""The solver on traced Hugging Face stacks at full size: every budget proven, and how fast.

    python benchmarks/hf_stack_solve.py                       # gpt2 bert whisper t5 llama
    python benchmarks/hf_stack_solve.py gpt2 t5 --time-limit 60
    python benchmarks/hf_stack_solve.py --save-module-info-dir /tmp/hf     # trace once ...
    python benchmarks/hf_stack_solve.py --module-info-dir /tmp/hf          # ... solve again

Each family is built from a config at a real size on the meta device (no weights, no memory:
GPT-2-medium, BERT-large, Whisper-medium-like, T5-large, a 1B Llama), traced for one AdamW step
under bf16 weights on the h100 roofline (``estimators.estimate``), and its MILP solved at 5
budgets from the smallest reachable peak to the no-AC peak with the default options (HiGHS,
rel_gap 1e-4, count branching, the program). Printed per budget: seconds, what made the plan
("program" or "highs"), the status and gap; the verdict counts budgets proven within 1e-4 and
the slowest solve.

Why these stacks: their blocks are numbered but not identical enough for count branching to
prove them within its box cap, and HiGHS' plain branch and bound runs into its time limit on
them; the program has to take them, T5's blocks ending with their last layer (same op)
included.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from estimators.contract.module_info import ModuleInfo  # noqa: E402
from estimators.tracing.estimation import estimate  # noqa: E402
from estimators.step.train_step import TrainStep  # noqa: E402
from solver import SACMilp, SolverOptions  # noqa: E402

FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _families() -> dict:
    import transformers as T

    return {
        "gpt2": lambda: (T.GPT2LMHeadModel(T.GPT2Config(n_embd=1024, n_layer=24, n_head=16)), 50257, 1024),
        "bert": lambda: (T.BertForMaskedLM(T.BertConfig(hidden_size=1024, num_hidden_layers=24,
                                                        num_attention_heads=16, intermediate_size=4096)), 30522, 512),
        "whisper": lambda: (T.WhisperForConditionalGeneration(T.WhisperConfig(
            d_model=1024, encoder_layers=24, decoder_layers=24, encoder_attention_heads=16,
            decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=51865)), 51865, 448),
        "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(
            decoder_start_token_id=0, d_model=1024, d_ff=4096, num_layers=24, num_decoder_layers=24,
            num_heads=16, d_kv=64, vocab_size=32128)), 32128, 512),
        "llama": lambda: (T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000)), 32000, 2048),
    }


def trace(name: str, batch: int = 8):
    with torch.device("meta"):
        model, vocab, seq = _families()[name]()
        model = model.to(torch.bfloat16)
    if name == "whisper":
        inputs = {"input_features": torch.randn(batch, 80, 3000, device="meta", dtype=torch.bfloat16),
                  "labels": torch.randint(0, vocab, (batch, seq), device="meta")}
    else:
        ids = torch.randint(0, vocab, (batch, seq), device="meta")
        inputs = {"input_ids": ids, "labels": ids}
    step = TrainStep(inputs=inputs, loss_fn=lambda out, _: out.loss, optimizer="adamw")
    return estimate(model, step, device="h100").module_info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="*", default=["gpt2", "bert", "whisper", "t5", "llama"])
    p.add_argument("--time-limit", type=float, default=60.0, help="SolverOptions.time_limit_s")
    p.add_argument("--module-info-dir", type=Path, default=None,
                   help="load <family>.json ModuleInfos from here instead of tracing")
    p.add_argument("--save-module-info-dir", type=Path, default=None,
                   help="write each traced ModuleInfo to <dir>/<family>.json (for reruns)")
    args = p.parse_args(argv)
    unknown = set(args.families) - set(_families())
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {sorted(_families())}")
    rows = []
    for name in args.families:
        t0 = time.perf_counter()
        if args.module_info_dir is not None:
            info = ModuleInfo.from_json(args.module_info_dir / f"{name}.json")
        else:
            info = trace(name)
        if args.save_module_info_dir is not None:
            args.save_module_info_dir.mkdir(parents=True, exist_ok=True)
            info.to_json(args.save_module_info_dir / f"{name}.json")
        milp = SACMilp(info, options=SolverOptions(time_limit_s=args.time_limit))
        lo = milp.min_reachable_peak_bytes()
        print(f"{name}: {len(info.mod_stats)} modules, {len(milp.candidates)} candidates, loaded or traced and "
              f"floored in {time.perf_counter() - t0:.1f} s; budgets {lo / 2**30:.2f} .. "
              f"{info.peak_bytes / 2**30:.2f} GiB", flush=True)
        for frac in FRACTIONS:
            budget = int(lo + frac * (info.peak_bytes - lo))
            t = time.perf_counter()
            res = milp.solve(budget)
            secs = time.perf_counter() - t
            proven = res.status.value == "optimal" and (res.gap or 0.0) <= 1e-4
            rows.append((name, secs, proven))
            print(f"  {frac:4.0%}  {secs:6.2f} s  {res.solved_by:8} {res.status.value:8} "
                  f"gap {res.gap if res.gap is not None else float('nan'):.1e}  "
                  f"recompute {res.recompute_ms:9.3f} ms", flush=True)
    n_proven = sum(r[2] for r in rows)
    slowest = max(rows, key=lambda r: r[1])
    print(f"\n{'PASS' if n_proven == len(rows) else 'FAIL'}  proven within 1e-4: {n_proven}/{len(rows)}")
    print(f"      slowest solve: {slowest[1]:.2f} s ({slowest[0]})")
    return 0 if n_proven == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
