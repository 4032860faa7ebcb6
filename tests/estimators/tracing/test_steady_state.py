"""estimators/tracing/steady_state.py: the traced step starts as step 2 of the loop does, and the first
step beside it holds only what a fresh run has."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from estimators.tracing.estimation import estimate
from estimators.contract.module_info import Phase
from estimators.tracing.steady_state import first_step_module_info
from estimators.step.train_step import TrainStep
from estimators.tracing.trace import StorageKind
from examples import EXAMPLES
from planner.analysis.measure import measure_steps


def test_the_first_steps_view_has_no_optimizer_state_before_the_optimizer_phase():
    model, inputs = EXAMPLES["gpt_tiny"]()
    info = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")).module_info
    first = first_step_module_info(info)
    assert len(first.memory_points) == len(info.memory_points)
    for a, b in zip(info.memory_points, first.memory_points):
        if a.phase in (Phase.FW, Phase.BW):
            assert b.optimizer_bytes == 0 and a.optimizer_bytes > 0
            assert dataclasses.replace(b, optimizer_bytes=a.optimizer_bytes) == a
        else:
            assert b == a


class _WithUnused(torch.nn.Module):
    """A pooler the loss never reaches (BigBird's in its masked-LM head) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.frozen, self.body, self.pooler = (torch.nn.Linear(32, 32) for _ in range(3))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.body(self.frozen(x))
        return h, self.pooler(h[:, 0])


def test_optimizer_state_is_alive_from_the_start_of_the_traced_step():
    model, inputs = EXAMPLES["gpt_tiny"]()
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    first_op = est.timeline.by_kind(0)
    assert 2 * params <= first_op[StorageKind.OPTIMIZER] <= 2 * params + 64 * len(list(model.parameters()))
    assert first_op[StorageKind.GRAD] == 0  # set_to_none, one micro-batch
    assert est.module_info.memory_points[0].optimizer_bytes == first_op[StorageKind.OPTIMIZER]
    assert est.first_step_peak_bytes < est.module_info.peak_bytes


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("as_instance", [False, True])
def test_no_optimizer_state_for_parameters_that_get_no_gradient(micro_batches, as_instance):
    # torch's AdamW creates no state for a parameter whose .grad is None: the pooler (never in
    # the loss) and the frozen layer (given to the optimizer anyway). Before: the pooler got a
    # zero gradient and AdamW state in the traced steady state, 8,448 B + its 4 B step counters
    # over the measured peak (with accumulation its gradient too).
    model, x = _WithUnused(), torch.randn(16, 8, 32)
    opt = torch.optim.AdamW(model.parameters())  # every parameter, frozen ones included
    step = TrainStep(inputs=(x,), loss_fn=lambda out, inputs: out[0].sum(), micro_batches=micro_batches,
                     optimizer=opt if as_instance else "adamw")
    est = estimate(model, step)
    measured = [m.peak_bytes for m in measure_steps(model, step, opt, n_steps=3)]
    assert model.pooler.weight.grad is None and not opt.state.get(model.pooler.weight)
    assert est.module_info.peak_bytes == measured[1] == measured[2]
    assert est.first_step_peak_bytes == measured[0]
    state = sum(s.nbytes for s in est.trace.storages if s.kind is StorageKind.OPTIMIZER and s.alloc_op < 0)
    assert state == 2 * (32 * 32 + 32) * 4 + 2 * 4  # the body's exp_avg, exp_avg_sq and step counters


@pytest.mark.slow
def test_kept_gradients_have_the_placement_the_backward_gives_them(one_intra_op_thread):
    """torchtitan's vocabulary-sharded embedding (Shard(0) over tp=2) gets a replicated,
    full-vocabulary gradient from its backward, and the loop's gradient is that one: a step that
    keeps gradients (2 micro-batches) starts the trace with them as the backward made them, not
    in the parameter's placement (which counted half the embedding's gradient)."""
    from torch.distributed.device_mesh import init_device_mesh

    from examples.llama import llama_tiny
    from examples.tensor_parallel import parallelize_llama
    from planner.distributed.fake_world import fake_process_group

    with fake_process_group(world_size=2, rank=0):
        model, (tokens,) = llama_tiny()
        parallelize_llama(model, init_device_mesh("cpu", (2,)), sequence_parallel=True, loss_parallel=False)
        model.loss_fn(model(tokens), (tokens,)).backward()  # real tensors: the gradients a loop keeps
        kept = sum(p.grad.to_local().untyped_storage().nbytes() for p in model.parameters())
        w = model.tok_embeddings.weight
        assert w.grad.to_local().shape[0] == 2 * w.to_local().shape[0]  # the whole vocabulary
        model.zero_grad(set_to_none=True)
        est = estimate(model, TrainStep(inputs=(tokens,), loss_fn=model.loss_fn, micro_batches=2, optimizer="adamw"))
    traced = sum(s.nbytes for s in est.trace.storages if s.kind is StorageKind.GRAD and s.alloc_op < 0)
    assert traced == kept
