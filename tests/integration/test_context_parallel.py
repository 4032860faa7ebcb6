"""Context parallel (torch's ``context_parallel``): what this CPU cannot run, and the rule a CP
rank's trace follows, checked on its own.

The limit: CP's ring attention has handlers only for CUDA's attention kernels (flash, efficient,
cuDNN); on CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no
sharding rule, so a CP step runs neither eagerly nor in a trace for the CPU, and a CP plan is not
measured here. For a CUDA target the fake trace runs torch's own ring attention on fake local
chunks. The rule it follows, per attention call of a rank holding ``S / cp`` of the sequence
(``x`` = one local K-sized tensor, heads as SDPA gets them): everything else is the plain step at
``S / cp``; forward all-gathers K and V of the whole sequence (one buffer of ``2 cp x`` bytes),
backward all-gathers them again and returns the K / V gradient chunks in ``cp`` all-to-alls of
``2 x``. Rank 0 saves one more query-sized tensor per attention call for backward, the last rank
none (torch 2.13's ring attention with its default head-tail load balancing): CP ranks differ,
and rank 0's plan -- the one ``solve_sac_distributed`` makes -- covers the larger.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from estimators.tracing.estimation import TraceError, estimate
from examples.llama import LlamaConfig, build_llama
from planner import TrainStep
from planner.distributed.fake_world import fake_process_group

S, B = 256, 2
CONFIG = LlamaConfig(vocab_size=256, seq_len=S, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


def _steps(mesh, cp: int):
    model, _ = build_llama(CONFIG, batch_size=B)
    tokens = torch.randint(0, CONFIG.vocab_size, (B, S // cp))
    cp_step = TrainStep(inputs=(tokens,), loss_fn=model.loss_fn, optimizer="adamw",
                        context=lambda: context_parallel(mesh, buffers=[torch.zeros(1, S)], buffer_seq_dims=[1]))
    return model, cp_step, TrainStep(inputs=(tokens,), loss_fn=model.loss_fn, optimizer="adamw")


def test_context_parallel_does_not_trace_for_the_cpu_and_says_why(one_intra_op_thread):
    with fake_process_group(world_size=2, rank=0):
        model, cp_step, _ = _steps(init_device_mesh("cpu", (2,)), 2)
        with pytest.raises(TraceError, match="context parallel.*CUDA target"):
            estimate(model, cp_step, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("cp, rank", [(2, 0), (2, 1), (4, 0), (4, 3)])
def test_a_cp_rank_for_a_cuda_target_follows_the_ring_rule(one_intra_op_thread, cp, rank):
    with fake_process_group(world_size=cp, rank=rank):
        model, cp_step, plain_step = _steps(init_device_mesh("cpu", (cp,)), cp)
        ring = estimate(model, cp_step, device="h100")
        plain = estimate(model, plain_step, device="h100")
    x = B * CONFIG.n_heads * (S // cp) * CONFIG.head_dim * 4  # one local K (float32), heads repeated
    buffers = Counter((str(ring.trace.ops[s.alloc_op].func).split(".")[1], s.nbytes) for s in ring.trace.storages
                      if s.alloc_op >= 0 and ring.trace.ops[s.alloc_op].func.namespace == "_c10d_functional")
    layers = CONFIG.n_layers
    assert buffers == {("all_gather_into_tensor", 2 * cp * x): 2 * layers, ("all_to_all_single", 2 * x): cp * layers}
    for i in range(layers):
        fqn = f"Llama.layers.{i}"
        assert ring.module_info.stats(fqn).act_fw_bytes == plain.module_info.stats(fqn).act_fw_bytes + (x if rank == 0 else 0)
    assert ring.module_info.peak_bytes > plain.module_info.peak_bytes
