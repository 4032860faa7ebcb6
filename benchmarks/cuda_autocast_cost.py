"""What CUDA autocast's policy costs over CPU autocast's on standard blocks (docs/cuda_autocast.md).

    python -m benchmarks.cuda_autocast_cost --block gpt2 --dtype bf16
    python -m benchmarks.cuda_autocast_cost --block llama3-8b --dtype fp16
    python -m benchmarks.cuda_autocast_cost --block hf-gpt2     # needs transformers

Traces a 1-layer model for an h100 target twice, with CPU autocast's policy
(``EstimateOptions(cuda_autocast=False)``, what a trace for a GPU did before) and with CUDA's,
allocator rounding off so the bytes are exact (models built on the meta device), and prints for each configuration (parameters in
float32 or in the autocast dtype; attention / norm variant) the bytes autograd saves in the
block's forward and the step's peak under each policy.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch import nn

from estimators.runtime.device import get_device_spec
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import EstimateOptions, estimate
from estimators.tracing.records import StorageKind

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def saved_bytes_by_module(est) -> dict[str, int]:
    """Bytes of the storages autograd saved, by the module whose op allocated them."""
    trace = est.trace
    out: dict[str, int] = collections.Counter()
    for s in trace.storages:
        if s.kind is StorageKind.ACTIVATION and s.alloc_op >= 0:
            op = trace.ops[s.alloc_op]
            out[trace.calls[op.call].fqn if op.call >= 0 else "(loss)"] += s.nbytes
    return out


def block_cost(model: nn.Module, step: TrainStep, block: str) -> dict[str, tuple[int, int]]:
    """{"block saved": (cpu policy, cuda policy), "step peak": (...)} for an h100 target."""
    h100 = get_device_spec("h100").replace(allocator_block_bytes=1)
    saved, peak = [], []
    for cuda_autocast in (False, True):
        est = estimate(model, step, device=h100, options=EstimateOptions(cuda_autocast=cuda_autocast))
        saved.append(sum(n for fqn, n in saved_bytes_by_module(est).items() if fqn.startswith(block)))
        peak.append(est.module_info.peak_bytes)
    return {"block saved": tuple(saved), "step peak": tuple(peak)}


def _use_nn_rmsnorm(model: nn.Module) -> None:
    """The examples' float32 RMSNorm replaced by torch's nn.RMSNorm (F.rms_norm), same weights."""
    from examples.llama import RMSNorm

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, RMSNorm):
                new = nn.RMSNorm(child.weight.shape[0], eps=child.eps, device=child.weight.device, dtype=child.weight.dtype)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                setattr(module, name, new)


def gpt2_configs(dtype: torch.dtype):
    """GPT-2-small-shaped block: D 768, 12 heads, T 1024, B 8, nn.LayerNorm, nn.GELU, dropout 0.1."""
    from examples.gpt import GPTConfig, build_gpt

    for attn in ("sdpa", "math"):
        for params in (torch.float32, dtype):
            cfg = GPTConfig(vocab_size=1024, seq_len=1024, n_layer=1, n_head=12, dim=768, attn_impl=attn)
            model, inputs = build_gpt(cfg, batch_size=8, dtype=params, device="meta")
            yield f"params {str(params)[6:]:8s} attention {attn}", model, inputs, model.loss_fn, "GPT.blocks.0"


def llama_configs(dtype: torch.dtype):
    """Llama-3-8B-shaped block: D 4096, 32 / 8 heads, FFN 14336, T 4096, B 1, SDPA."""
    from examples.llama import LlamaConfig, build_llama

    for norm in ("reference", "nn.RMSNorm"):
        for params in (torch.float32, dtype):
            cfg = LlamaConfig(vocab_size=1024, seq_len=4096, n_layers=1, dim=4096, n_heads=32, n_kv_heads=8,
                              ffn_dim=14336)
            model, inputs = build_llama(cfg, batch_size=1, dtype=params, device="meta")
            if norm == "nn.RMSNorm":
                _use_nn_rmsnorm(model)
            yield f"params {str(params)[6:]:8s} RMSNorm {norm}", model, inputs, model.loss_fn, "Llama.layers.0"


def hf_gpt2_configs(dtype: torch.dtype):
    """Hugging Face GPT-2 small's block (``gelu_new``, Conv1D, eager or SDPA attention), T 1024, B 8."""
    import transformers

    ids = torch.randint(0, 1024, (8, 1024), generator=torch.Generator().manual_seed(0))
    for attn in ("sdpa", "eager"):
        for params in (torch.float32, dtype):
            cfg = transformers.GPT2Config(n_layer=1, n_embd=768, n_head=12, n_positions=1024, vocab_size=1024,
                                          attn_implementation=attn)
            with torch.device("meta"):
                model = transformers.GPT2LMHeadModel(cfg).to(params).train()
            yield (f"params {str(params)[6:]:8s} attention {attn}", model, {"input_ids": ids, "labels": ids},
                   _hf_loss, "GPT2LMHeadModel.transformer.h.0")


def _hf_loss(output, inputs):
    return output.loss


_BLOCKS = {"gpt2": gpt2_configs, "llama3-8b": llama_configs, "hf-gpt2": hf_gpt2_configs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", choices=sorted(_BLOCKS), default="gpt2", help="which standard block")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="autocast dtype")
    args = p.parse_args(argv)
    dtype = _DTYPES[args.dtype]
    for name, model, inputs, loss_fn, block in _BLOCKS[args.block](dtype):
        step = TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer="adamw", autocast_dtype=dtype)
        cost = block_cost(model, step, block)
        line = "; ".join(f"{k} {a:,} -> {b:,} ({b - a:+,})" for k, (a, b) in cost.items())
        print(f"{args.block} {args.dtype} {name}: {line}", flush=True)


if __name__ == "__main__":
    main()
