"""planner/analysis/kernel_profile.py: kernels timed in real steps of a copy, priced by a trace,
and the model, its optimizer and the random state left as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimators.runtime.models import RuntimeKind, benchmark_runtime_override
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import EstimateOptions, estimate
from planner.analysis.kernel_profile import profile_step_kernels


def _mlp_step(optimizer="adamw"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 8))
    x = torch.rand(32, 64)
    return model, TrainStep(inputs=(x,), loss_fn=lambda out, inputs: out.square().mean(), optimizer=optimizer)


def test_profiling_leaves_the_model_its_optimizer_and_the_random_state_as_they_were(one_intra_op_thread):
    model, step = _mlp_step()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.3)
    step = TrainStep(inputs=step.inputs, loss_fn=step.loss_fn, optimizer=opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    prof = profile_step_kernels(model, step, steps=2, warmup=1)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert torch.equal(rng, torch.get_rng_state())
    # Dropout draws, the forward's and backward's matmuls, AdamW's update: all timed, per call.
    names = " ".join(prof.timings_ms)  # keys as the benchmark cache names them: repr(OpOverload), layouts
    assert all(f"op='aten.{op}'" in names for op in ("addmm", "bernoulli_", "mm", "gelu_backward"))
    assert "op='aten.lerp_'" in names or "op='aten.addcdiv_'" in names  # AdamW's step ran, on the copy
    assert prof.steps == 2 and prof.clock == "thread" and prof.calls > len(prof.timings_ms)
    assert all(ms >= 0 for ms in prof.timings_ms.values())


def test_a_trace_prices_the_profiled_signatures_and_benchmarks_only_the_others(one_intra_op_thread):
    """Every kernel of the traced step was run by the profiled steps: the trace prices it by its
    in-step time and benchmarks nothing; a profile of an addmm at 1 s a call shows in the
    step's time."""
    model, step = _mlp_step()
    prof = profile_step_kernels(model, step, steps=1, warmup=1)
    bench = prof.runtime()
    with benchmark_runtime_override(bench):
        est = estimate(model, step, device="cpu", options=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    assert bench.measurements == 0 and bench.hits > 0
    slow = {k: 1000.0 if "op='aten.addmm'" in k else v for k, v in prof.timings_ms.items()}
    bench = type(prof)(timings_ms=slow, calls=prof.calls, steps=1, clock=prof.clock).runtime()
    with benchmark_runtime_override(bench):
        slow_est = estimate(model, step, device="cpu", options=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    # Two addmm calls a forward (the two linears), each now 1 s.
    assert slow_est.module_info.step_runtime_ms - est.module_info.step_runtime_ms > 1900


@pytest.mark.parametrize("kwargs, match", [({"steps": 0}, "got 0, 2"), ({"warmup": -1}, "got 5, -1")])
def test_bad_counts_say_what_is_expected(kwargs, match):
    model, step = _mlp_step()
    with pytest.raises(ValueError, match=match):
        profile_step_kernels(model, step, **kwargs)


def test_a_meta_model_is_refused_with_what_to_do():
    model, step = _mlp_step()
    with pytest.raises(ValueError, match="meta device.*materialize"):
        profile_step_kernels(model.to("meta"), step)


def test_gradients_the_copy_can_reach_and_the_train_flags_are_put_back(one_intra_op_thread):
    """The batch and the loss's closure are not copied: an input that requires grad, and a loss
    that reads the user's own weight (a tied head), get gradients from the copy's backward
    unless put back; an eval-mode model trained in train mode (train_mode=True) is left in eval."""
    model, step = _mlp_step()
    model.eval()
    x = torch.rand(32, 64, requires_grad=True)
    head = model[3].weight
    head.grad = torch.full_like(head, 7.0)
    before = head.grad
    step = TrainStep(inputs=(x,), loss_fn=lambda out, inputs: (out @ head).square().mean(), optimizer="sgd",
                     train_mode=True)
    prof = profile_step_kernels(model, step, steps=1, warmup=1)
    assert x.grad is None and head.grad is before and bool((head.grad == 7.0).all())
    assert all(not m.training for m in model.modules())
    assert any("op='aten.bernoulli_'" in k for k in prof.timings_ms)  # dropout ran: trained in train mode


def test_an_optimizer_over_another_copy_is_refused():
    model, step = _mlp_step()
    other = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not this Sequential's parameters"):
        profile_step_kernels(model, TrainStep(inputs=step.inputs, loss_fn=step.loss_fn, optimizer=other))


def test_its_runtime_keeps_the_profiles_clock_and_writes_no_cache_file(tmp_path, one_intra_op_thread):
    model, step = _mlp_step()
    prof = profile_step_kernels(model, step, steps=1, warmup=0)
    assert prof.runtime().clock == prof.clock == "thread" == prof.runtime(device=torch.device("cpu")).clock
    for bad in ({"cache_path": tmp_path / "c.json"}, {"clock": "wall"}, {"device": "meta"}):
        with pytest.raises(ValueError, match="cache_path|clock"):
            prof.runtime(**bad)
