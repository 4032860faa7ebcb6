"""planner/applying/offload.py: hand-made offload plans, alone and with SAC, applied in eager on CPU.

Each case checks the apply contract (loss and gradients bitwise equal, dropout on; buffers as
after one unplanned step), the memory (three real AdamW steps measured by torch's MemTracker,
equal to the fake-mode trace of the applied plan -- one attention mask apart for HF Llama with
SAC -- and below the unplanned peak) and the host bytes (the plan's counter against :func:`planner.applying.offload.predicted_host_bytes` of the unplanned
trace). The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import pytest
import torch

from estimators.tracing.estimation import estimate
from estimators.step.train_step import TrainStep, run_step
from examples import EXAMPLES
from planner import PlanFormatError, remove_plan
from planner.applying import offload
from planner.applying.checkpointing import apply_module_plans, hf_cache_off
from planner.analysis.measure import measure_steps
from planner.applying.offload import MIN_OFFLOAD_BYTES, OffloadError, predicted_host_bytes
from planner.plan import ModulePlan, op_key
from planner.applying.planned_forward import PlannedForward
from planner.planning.module_plans import module_plan
from planner.planning.verification import traced_estimate

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# Modules to offload (every block but the last: its backward comes first, nothing to hide it).
# llama_tiny's and the HF model's activations are a few KiB: the size floor is lowered for them
# (the floor itself is checked on gpt_demo, whose layer-norm statistics stay on the device).
_CASES = {
    "gpt_demo": (("GPT.blocks.0", "GPT.blocks.1", "GPT.blocks.2"), MIN_OFFLOAD_BYTES),
    "llama_tiny": (("Llama.layers.0",), 1024),
    "hf_llama": (("LlamaForCausalLM.model.layers.0",), 1024),
    "convnet_demo": (("ConvNet.stem", "ConvNet.stages.0", "ConvNet.stages.1"), MIN_OFFLOAD_BYTES),
}


def _hf_causal_lm(family: str, batch: int, seq: int, **config):
    """A seeded HF causal LM from a small config, in train mode, with token ids as inputs and labels."""
    import transformers as T

    torch.manual_seed(0)
    cfg = getattr(T, f"{family}Config")(vocab_size=128, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(T, f"{family}ForCausalLM")(cfg)
    model.train()
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _hf_llama():
    return _hf_causal_lm("Llama", 4, 16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         attention_dropout=0.1)


def _build(name):
    if name == "hf_llama":
        pytest.importorskip("transformers")
        return _hf_llama()
    model, inputs = EXAMPLES[name]()
    model.train()
    return model, inputs


def _step(model, inputs) -> TrainStep:
    return TrainStep(inputs=inputs, loss_fn=getattr(model, "loss_fn", None), optimizer="adamw")


@functools.lru_cache(maxsize=None)
def _planning(name):
    """(estimate of the unplanned steady step, measured unplanned steady peak)."""
    model, inputs = _build(name)
    step = _step(model, inputs)
    with hf_cache_off(model):
        est = estimate(model, step, device="cpu")
    fresh, _ = _build(name)
    with hf_cache_off(fresh):
        measured = measure_steps(fresh, step, torch.optim.AdamW(fresh.parameters()), n_steps=2)
    return est, measured[1].peak_bytes


def _candidates(stats, min_bytes) -> list:
    """Ops whose outputs autograd saves inside the module, big enough to offload."""
    return [(op_key(o.func), o.occurrence) for o in stats.ops
            if o.is_saved and not o.is_view and o.inplace_parent < 0 and o.memory_bytes >= min_bytes]


def _offload_plans(est, fqns, mode, min_bytes) -> tuple[ModulePlan, ...]:
    out = []
    for fqn in fqns:
        stats = est.module_info.stats(fqn)
        cands = _candidates(stats, min_bytes)
        if mode == "alone":  # not checkpointed: every other saved op goes to the host
            out.append(ModulePlan(fqn=fqn, discard_ratio=0.0, full=False, offloaded_ops=tuple(cands[::2])))
        else:  # the op MILP's selective plan for a part of the module, offloading some saved ops
            for part in (3, 10, 100):
                mp = module_plan(stats, stats.sac_memory_bytes // part)
                off = [k for k in mp.saved_ops if k in set(cands)][::2]
                if off and mp.recomputed_ops:
                    break
            if not off:
                continue  # e.g. a conv + batch norm stem whose selective plan saves no big output
            out.append(dataclasses.replace(mp, offloaded_ops=tuple(off)))
        assert out[-1].offloaded_ops, f"{fqn}: nothing to offload in this case"
    assert out, "nothing to offload in this case"
    return tuple(out)


def _loss_grads_buffers(model, inputs, seed=1234, runner=None):
    """Loss, gradients and buffers of one step of ``runner`` (default ``model``), read on ``model``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = run_step(model if runner is None else runner, inputs, getattr(model, "loss_fn", None), None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    return loss, grads, bufs


def _assert_same(got, ref):
    loss, grads, bufs = got
    ref_loss, ref_grads, ref_bufs = ref
    assert loss == ref_loss  # float32 -> float: exact
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items()), [
        n for n, g in ref_grads.items() if not torch.equal(grads[n], g)]
    assert bufs.keys() == ref_bufs.keys() and all(torch.equal(bufs[n], b) for n, b in ref_bufs.items())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["alone", "with_sac"])
@pytest.mark.parametrize("name", ["gpt_demo", "llama_tiny", pytest.param("hf_llama", marks=pytest.mark.hf), "convnet_demo"])
def test_offload_plans_are_exact_and_predicted(name, mode, monkeypatch):
    fqns, min_bytes = _CASES[name]
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", min_bytes)
    est, unplanned_peak = _planning(name)
    plans = _offload_plans(est, fqns, mode, min_bytes)

    ref_model, inputs = _build(name)
    with hf_cache_off(ref_model):
        ref = _loss_grads_buffers(ref_model, inputs)
    model, _ = _build(name)
    predicted = traced_estimate(model, plans, est)
    handle = apply_module_plans(model, plans)
    _assert_same(_loss_grads_buffers(model, inputs), ref)

    for c in handle.offload_counters().values():
        c.reset()
    step = _step(model, inputs)
    first, *steady = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=4)
    measured = max(s.peak_bytes for s in steady)  # three steady-state steps
    want = predicted.steady_peak_bytes
    host_predicted = sum(predicted_host_bytes(est.trace, plans, micro_batches=est.step.micro_batches).values())
    counters = handle.offload_counters()
    print(f"\n{name} {mode}: steady peak predicted {want:,} measured {measured:,} "
          f"({(measured - want) / want:+.3%}) unplanned {unplanned_peak:,}; first step predicted "
          f"{predicted.first_step_peak_bytes:,} measured {first.peak_bytes:,}; host bytes/step "
          f"{handle.host_bytes_offloaded // 4:,} predicted {host_predicted:,}; prefetched "
          f"{sum(c.prefetched for c in counters.values())} on demand "
          f"{sum(c.loaded_on_demand for c in counters.values())} ambiguous "
          f"{sum(c.ambiguous for c in counters.values())}")
    # Measured = predicted to the byte, HF Llama with SAC included (it was over-predicted by one bool
    # [4, 1, 16, 16] attention mask, 1,024 B, until the fake trace took the real run's mask path).
    assert want == measured
    assert predicted.first_step_peak_bytes == first.peak_bytes
    assert measured < unplanned_peak
    assert host_predicted > 0 and handle.host_bytes_offloaded == 4 * host_predicted
    # Every offloading module here has a module after it (planned, or unplanned beside it).
    assert all(c.prefetched == c.storages and not c.loaded_on_demand for c in counters.values()), counters
    handle.remove()


@pytest.mark.slow
def test_views_and_small_storages_stay_on_the_device(monkeypatch):
    est, _ = _planning("gpt_demo")
    stats = est.module_info.stats("GPT.blocks.0")
    views = tuple((op_key(o.func), o.occurrence) for o in stats.ops if o.is_view)
    big = tuple(_candidates(stats, MIN_OFFLOAD_BYTES))
    model, inputs = _build("gpt_demo")
    ref = _loss_grads_buffers(copy.deepcopy(model), inputs)
    mp = ModulePlan(fqn="GPT.blocks.0", discard_ratio=0.0, full=False, offloaded_ops=views)
    with apply_module_plans(model, [mp]) as handle:
        _assert_same(_loss_grads_buffers(model, inputs), ref)
        assert handle.host_bytes_offloaded == 0
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 2**40)
    mp = ModulePlan(fqn="GPT.blocks.0", discard_ratio=0.0, full=False, offloaded_ops=big)
    with apply_module_plans(model, [mp]) as handle:
        _assert_same(_loss_grads_buffers(model, inputs), ref)
        assert handle.host_bytes_offloaded == 0


def _alone_plans():
    est, _ = _planning("gpt_demo")
    return _offload_plans(est, _CASES["gpt_demo"][0], "alone", MIN_OFFLOAD_BYTES)


@pytest.mark.slow
def test_deepcopy_of_an_offloading_model_offloads_on_its_own():
    model, inputs = _build("gpt_demo")
    ref = _loss_grads_buffers(copy.deepcopy(model), inputs)
    handle = apply_module_plans(model, _alone_plans())
    twin = copy.deepcopy(model)
    twin_pfs = [m.__dict__["forward"] for m in twin.modules() if isinstance(m.__dict__.get("forward"), PlannedForward)]
    assert len(twin_pfs) == 3 and all(pf.module is not None for pf in twin_pfs)
    _assert_same(_loss_grads_buffers(twin, inputs), ref)
    assert sum(pf.offload_counter.host_bytes for pf in twin_pfs) > 0
    assert handle.host_bytes_offloaded == 0  # the original was not run
    assert remove_plan(twin) == 3
    handle.remove()


@pytest.mark.slow
def test_remove_plan_restores_and_no_grad_offloads_nothing():
    model, inputs = _build("gpt_demo")
    forwards = {n: m.forward for n, m in model.named_modules()}
    handle = apply_module_plans(model, _alone_plans())
    with torch.no_grad():
        model(*inputs)
    assert handle.host_bytes_offloaded == 0
    _loss_grads_buffers(model, inputs)
    assert handle.host_bytes_offloaded > 0
    assert remove_plan(model) == 3
    for n, m in model.named_modules():
        assert m.forward == forwards[n] and "forward" not in m.__dict__
        assert not m._forward_hooks  # the prefetch hook on GPT.blocks.3 is gone
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert offload.take_pending() == []


@pytest.mark.slow
def test_a_forward_dropped_without_backward_frees_what_it_offloaded():
    # The offload hooks kept saved outputs with their grad_fn: a cycle through autograd's C++
    # graph that gc cannot free, so a metric forward outside no_grad leaked its host copies
    # (2.6 MB per forward on a ResNet, without bound).
    import gc

    model, inputs = _build("gpt_demo")
    handle = apply_module_plans(model, _alone_plans())
    for _ in range(3):
        out = model(*inputs)
        del out
    gc.collect()
    assert handle.host_bytes_offloaded > 0
    assert not [o for o in gc.get_objects() if type(o) in (offload._Stored, offload._Handle)]
    handle.remove()


def test_bad_offload_plans_are_refused_and_the_model_untouched():
    est, _ = _planning("gpt_demo")
    stats = est.module_info.stats("GPT.blocks.0")
    mp = module_plan(stats, stats.sac_memory_bytes // 3)
    model, _ = _build("gpt_demo")
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    with pytest.raises(PlanFormatError, match="both offloaded and recomputed"):
        dataclasses.replace(mp, offloaded_ops=mp.recomputed_ops[:1])
    with pytest.raises(PlanFormatError, match="full checkpointing keeps no op output to offload"):
        ModulePlan(fqn=mp.fqn, discard_ratio=1.0, full=True, offloaded_ops=mp.saved_ops[:1])
    with pytest.raises(OffloadError, match=r"offloaded op \['aten.mm.default', 99\] is not in saved_ops"):
        apply_module_plans(model, [dataclasses.replace(mp, offloaded_ops=(("aten.mm.default", 99),))])
    inner = ModulePlan(fqn="GPT.blocks.0.mlp", discard_ratio=0.0, full=False,
                       offloaded_ops=(("aten.gelu.default", 0),))
    with pytest.raises(OffloadError, match="nested in 'GPT.blocks.0'"):
        apply_module_plans(model, [mp, inner])
    assert {n: dict(m.__dict__) for n, m in model.named_modules()} == before


class _MutatesSaved(torch.nn.Module):
    """exp saves its output, which is then written in place: autograd refuses the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 256))

    def forward(self, x):
        y = (x @ self.w).exp()
        z = y * 2
        y.add_(1)
        return z.sum()


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _MutatesSaved()

    def forward(self, x):
        return self.inner(x)


def test_a_saved_tensor_written_in_place_stays_and_fails_as_unplanned():
    model, x = _Outer(), torch.randn(256, 256)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).backward()
    mp = ModulePlan(fqn="_Outer.inner", discard_ratio=0.0, full=False, offloaded_ops=(("aten.exp.default", 0),))
    with apply_module_plans(model, [mp]) as handle:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(x).backward()
        counter = handle.offload_counters()["_Outer.inner"]
        assert counter.ambiguous == 1 and counter.host_bytes == 0


@pytest.mark.slow
def test_compiled_offloading_model_is_exact(monkeypatch):
    """Plan, apply, compile: exact. Offload happens only where the planned forward runs eagerly
    (dynamo falls back to eager around the checkpoint here); a compiled graph keeps the tensors."""
    fqns, min_bytes = _CASES["llama_tiny"]
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", min_bytes)
    est, _ = _planning("llama_tiny")
    model, inputs = _build("llama_tiny")
    ref = _loss_grads_buffers(copy.deepcopy(model), inputs)
    with apply_module_plans(model, _offload_plans(est, fqns, "with_sac", min_bytes)) as handle:
        compiled = torch.compile(model, backend="aot_eager")
        try:
            _assert_same(_loss_grads_buffers(model, inputs, runner=compiled), ref)
        finally:
            torch._dynamo.reset()
        assert handle.host_bytes_offloaded in (0, sum(predicted_host_bytes(est.trace, _plans_of(handle)).values()))


def _plans_of(handle):
    return [m.__dict__["forward"].mp for m in handle.modules]


@pytest.mark.slow
def test_micro_batches_offload_each_micro_batch():
    model, inputs = _build("gpt_demo")
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw", micro_batches=2)
    est = estimate(model, step, device="cpu")
    plans = _offload_plans(est, _CASES["gpt_demo"][0], "alone", MIN_OFFLOAD_BYTES)
    predicted = traced_estimate(model, plans, est)
    with apply_module_plans(model, plans) as handle:
        _, steady = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=2)
        assert steady.peak_bytes == predicted.steady_peak_bytes  # measured error 0 B
        assert handle.host_bytes_offloaded == 2 * sum(predicted_host_bytes(est.trace, plans, micro_batches=est.step.micro_batches).values())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["alone", "with_sac"])
def test_offload_around_a_checkpointed_submodule(mode):
    """GPT.blocks.0 offloads and its mlp is fully checkpointed: the mlp's saved tensors are its
    checkpoint's (not offloaded when blocks.0 is not checkpointed; cached by blocks.0's policy,
    so offloaded, when it is), and the host-bytes prediction says so."""
    est, _ = _planning("gpt_demo")
    plans = _offload_plans(est, _CASES["gpt_demo"][0], mode, MIN_OFFLOAD_BYTES)
    plans += (ModulePlan(fqn="GPT.blocks.0.mlp", discard_ratio=1.0, full=True),)
    model, inputs = _build("gpt_demo")
    ref = _loss_grads_buffers(copy.deepcopy(model), inputs)
    predicted = traced_estimate(model, plans, est)
    with apply_module_plans(model, plans) as handle:
        _assert_same(_loss_grads_buffers(model, inputs), ref)
        step = _step(model, inputs)
        _, steady = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=2)
        assert steady.peak_bytes == predicted.steady_peak_bytes  # measured error 0 B
        per_module = predicted_host_bytes(est.trace, plans, micro_batches=est.step.micro_batches)
        got = {fqn: c.host_bytes for fqn, c in handle.offload_counters().items()}
        assert got == {fqn: 3 * b for fqn, b in per_module.items()}  # 1 + 2 measured steps
        inner_kept = per_module["GPT.blocks.0"] < per_module["GPT.blocks.1"]
        assert inner_kept == (mode == "alone")


@pytest.mark.hf
def test_hf_mistral_bf16_autocast_micro_batches_host_bytes_are_predicted(monkeypatch):
    """Grouped-query attention under bf16 autocast, 2 micro-batches: the fake-mode trace must take
    the real run's attention path (no materialized mask, SDPA's enable_gqa), or the ops the plan
    names are other tensors in the real run (1,048,576 B moved vs 1,245,184 B predicted, before)."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 1024)

    def build():
        return _hf_causal_lm("Mistral", 2, 32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)

    model, inputs = build()
    step = TrainStep(inputs=inputs, optimizer="adamw", micro_batches=2, autocast_dtype=torch.bfloat16)
    with hf_cache_off(model):
        est = estimate(model, step, device="cpu")
    plans = _offload_plans(est, ("MistralForCausalLM.model.layers.0",), "alone", 1024)
    host_predicted = sum(predicted_host_bytes(est.trace, plans, micro_batches=2).values())
    predicted = traced_estimate(model, plans, est)

    ref_model, _ = build()
    ref = measure_steps(ref_model, step, torch.optim.AdamW(ref_model.parameters()), n_steps=2)
    with apply_module_plans(model, plans) as handle:
        first, steady = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=2)
        moved = handle.host_bytes_offloaded
    print(f"\nhf mistral bf16 x2: host bytes moved {moved:,} predicted {2 * host_predicted:,} (2 steps); steady peak "
          f"predicted {predicted.steady_peak_bytes:,} measured {steady.peak_bytes:,}; unplanned {ref[1].peak_bytes:,}")
    assert host_predicted > 0 and moved == 2 * host_predicted  # 2 steps (the prediction counts both micro-batches)
    assert steady.peak_bytes == predicted.steady_peak_bytes
