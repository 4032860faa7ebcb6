"""Tensor / sequence parallel ranks traced at their local shapes, in one process (torch's fake
process group): the trace's per-rank peak is MemTracker's measured peak, to the byte.

With the fake group every collective is answered locally, so a real step here allocates what a
rank of a live job allocates (tests/integration/test_tensor_parallel_ranks.py checks the same
figures on real gloo ranks).
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from estimators.tracing.estimation import EstimateOptions, TraceMode, estimate
from examples.llama import LlamaConfig, build_llama
from examples.tensor_parallel import parallelize_llama
from planner import TrainStep
from planner.analysis import measure_steps
from planner.distributed.fake_world import fake_process_group

TINY = LlamaConfig(vocab_size=256, seq_len=32, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


def _tp_llama(mesh, sp: bool, lp: bool, device: str = "cpu"):
    model, inputs = build_llama(TINY, batch_size=2, device=device)
    parallelize_llama(model, mesh, sequence_parallel=sp, loss_parallel=lp)
    step = TrainStep(inputs=build_llama(TINY, batch_size=2, device="cpu")[1], loss_fn=model.loss_fn,
                     optimizer="adamw", context=loss_parallel if lp else None)
    return model, step


@pytest.mark.parametrize("sp, lp", [pytest.param(True, True, id="sp+loss_parallel"),
                                    pytest.param(False, False, id="tp", marks=pytest.mark.slow)])
def test_a_tp_rank_traces_to_the_measured_peak(one_intra_op_thread, sp, lp):
    with fake_process_group(world_size=2, rank=1):
        model, step = _tp_llama(init_device_mesh("cpu", (2,)), sp, lp)
        fake = estimate(model, step)
        real = estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL))
        measured = [s.peak_bytes for s in measure_steps(model, step, n_steps=3)]
    assert fake.module_info.peak_bytes == real.module_info.peak_bytes == max(measured[1:])
    assert fake.first_step_peak_bytes == measured[0]
    colls = {str(op.func) for op in fake.trace.ops if op.func.namespace == "_c10d_functional"}
    assert "_c10d_functional.all_gather_into_tensor.default" in colls if sp else True
    # The unsharded model's step is larger: the trace is not at global shapes.
    whole, inputs = build_llama(TINY, batch_size=2)
    assert estimate(whole, TrainStep(inputs=inputs, loss_fn=whole.loss_fn, optimizer="adamw")
                    ).module_info.peak_bytes > fake.module_info.peak_bytes


def test_a_model_parallelized_on_meta_traces_like_the_real_one(one_intra_op_thread):
    with fake_process_group(world_size=2, rank=0):
        mesh = init_device_mesh("cpu", (2,))
        real_model, step = _tp_llama(mesh, True, True)
        meta_model, _ = _tp_llama(mesh, True, True, device="meta")
        a, b = estimate(real_model, step), estimate(meta_model, step)
    assert a.module_info.peak_bytes == b.module_info.peak_bytes
    assert a.first_step_peak_bytes == b.first_step_peak_bytes


def test_the_collectives_are_priced_on_the_link_and_their_exposed_part_is_in_the_step(one_intra_op_thread):
    from estimators.runtime.collective_ops import collective_call  # noqa: F401 - the pricing rule

    with fake_process_group(world_size=2, rank=0):
        model, step = _tp_llama(init_device_mesh("cpu", (2,)), True, True)
        est = estimate(model, step, device="h100")
    colls = est.trace.collective_ms
    kinds = {str(est.trace.ops[i].func).split(".")[1] for i in colls}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"} <= kinds
    assert all(ms > 0 for ms in colls.values())
    exposed = sum(est.trace.ops[i].runtime_ms for i in colls)
    assert 0 < exposed <= sum(colls.values())
    # The step's compute stream: every op's runtime, the collectives' exposed part included.
    total = sum(op.runtime_ms for op in est.trace.ops)
    assert est.module_info.step_runtime_ms == pytest.approx(total, rel=1e-9)


@pytest.mark.parametrize("sp", [pytest.param(True, id="sp+loss_parallel"),
                                pytest.param(False, id="tp", marks=pytest.mark.slow)])
def test_a_tp_rank_traced_once_per_block_is_the_full_trace(one_intra_op_thread, sp):
    """The repeated-block trace (four layers traced, the others laid in) of a TP rank is the
    trace of every layer, record for record, collectives and their buffers included. (Without
    sequence parallel the norms stay plain tensors beside DTensors, which a foreach optimizer, as
    on CUDA, refuses to mix: that case is traced for the CPU.)"""
    from tests.estimators.tracing.trace_equivalence import trace_difference

    config = LlamaConfig(vocab_size=256, seq_len=32, n_layers=6, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    with fake_process_group(world_size=2, rank=0):
        model, inputs = build_llama(config, batch_size=2)
        parallelize_llama(model, init_device_mesh("cpu", (2,)), sequence_parallel=sp, loss_parallel=sp)
        step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw", context=loss_parallel if sp else None)
        device = "h100" if sp else "cpu"
        once = estimate(model, step, device=device)
        full = estimate(model, step, device=device, options=EstimateOptions(replicate_blocks=False))
    assert once.trace.twin_of, "the layers were not laid in: this test checks nothing"
    assert trace_difference(once.trace, full.trace) == ""
    assert once.trace.collective_ms == full.trace.collective_ms
    assert once.module_info == full.module_info
