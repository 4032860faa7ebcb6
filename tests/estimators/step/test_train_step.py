"""estimators/step/train_step.py: the TrainStep options (validation, clear errors) and the loop it runs."""

from __future__ import annotations

import pytest
import torch

from estimators.runtime.device import get_device_spec
from estimators.tracing.estimation import estimate
from estimators.step.train_step import Phase, StepError, TrainStep, ZeroGrad, run_step, split_inputs, zero_grads
from examples import EXAMPLES


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_micro_batches_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"micro_batches must be an int >= 1"):
        TrainStep(micro_batches=bad)


@pytest.mark.parametrize("bad", [torch.float32, torch.float64, torch.int8, "bf16"])
def test_unknown_autocast_dtype(bad):
    with pytest.raises(ValueError, match=r"autocast_dtype must be None, torch.bfloat16 or torch.float16"):
        TrainStep(autocast_dtype=bad)


def test_zero_grad_accepts_its_names_and_refuses_others():
    assert TrainStep(zero_grad="zero").zero_grad is ZeroGrad.ZERO
    with pytest.raises(ValueError, match=r"zero_grad must be ZeroGrad.SET_TO_NONE"):
        TrainStep(zero_grad="sometimes")


def test_fields_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        TrainStep((torch.ones(1),))  # noqa: the point is that it raises
    step = TrainStep()
    with pytest.raises(AttributeError):
        step.micro_batches = 2  # type: ignore[misc]


def test_a_dtype_the_target_cannot_run():
    step = TrainStep(autocast_dtype=torch.float16)
    no_fp16 = get_device_spec("cpu").replace(name="bf16-cpu", peak_flops_per_s={torch.float32: 2e11, torch.bfloat16: 1e11})
    with pytest.raises(ValueError, match=r"float16 cannot run on the target 'bf16-cpu'.*autocast_dtype=torch.bfloat16"):
        step.check_target(no_fp16)
    step.check_target(get_device_spec("h100"))  # CUDA targets run both
    step.check_target(get_device_spec("cpu"))  # and torch's CPU autocast
    no_bf16 = get_device_spec("cpu").replace(name="old-cpu", peak_flops_per_s={torch.float32: 1e11})
    with pytest.raises(ValueError, match=r"bfloat16 cannot run on the target 'old-cpu'.*drop autocast_dtype"):
        TrainStep(autocast_dtype=torch.bfloat16).check_target(no_bf16)


def test_estimate_refuses_a_dtype_the_target_cannot_run():
    model, inputs = EXAMPLES["gpt_tiny"]()
    no_fp16 = get_device_spec("cpu").replace(name="bf16-cpu", peak_flops_per_s={torch.float32: 2e11, torch.bfloat16: 1e11})
    with pytest.raises(ValueError, match=r"float16 cannot run on the target 'bf16-cpu'"):
        estimate(model, TrainStep(inputs=inputs, autocast_dtype=torch.float16), device=no_fp16)


def test_a_step_that_is_not_a_train_step_is_refused_with_the_way_to_write_it():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(TypeError, match=r"step must be a TrainStep, got tuple: describe the step as TrainStep\(inputs=batch"):
        estimate(model, inputs)


def test_grads_alive_at_start():
    assert not TrainStep().grads_alive_at_start
    assert TrainStep(micro_batches=2).grads_alive_at_start
    assert TrainStep(zero_grad=ZeroGrad.ZERO).grads_alive_at_start


def test_accumulation_gives_the_mean_gradient_of_the_micro_batches():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    run_step(lin, (x,), None, None, micro_batches=4)
    accumulated = lin.weight.grad.clone()
    zero_grads(lin, None, ZeroGrad.SET_TO_NONE)
    assert lin.weight.grad is None
    run_step(lin, (x,), None, None)
    # Exact (measured: bitwise equal for seeds 0-19): each micro-batch's gradient is g / 4 exactly
    # (a power of two), and the accumulation g/4 + g/4 + g/4 + g/4 rounds back to g.
    assert torch.equal(accumulated, lin.weight.grad)


def test_autocast_covers_forward_and_loss_not_backward():
    seen = {}

    def loss_fn(out, inputs):
        seen["out"] = out.dtype
        seen["in_autocast"] = torch.is_autocast_enabled("cpu")
        return out.float().sum()

    lin = torch.nn.Linear(4, 4)
    run_step(lin, (torch.randn(2, 4),), loss_fn, None, autocast_dtype=torch.bfloat16)
    assert seen == {"out": torch.bfloat16, "in_autocast": True}
    assert lin.weight.grad.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


# ----------------------------------------------------------------------------- run_step itself
def test_split_inputs_of_each_accepted_form():
    t = torch.ones(1)
    assert split_inputs(t) == ((t,), {})
    assert split_inputs((t, 2)) == ((t, 2), {})
    assert split_inputs([t, 2]) == ((t, 2), {})
    d = {"x": t}
    args, kwargs = split_inputs(d)
    assert args == () and kwargs == d and kwargs is not d  # a copy: the forward may not mutate ours


def test_phases_in_order_and_the_last_scaled_loss():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    with torch.no_grad():
        full = float(lin(x).sum())
    phases = []
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    loss = run_step(lin, (x,), None, opt, phases.append, micro_batches=2)
    assert phases == [Phase.FW, Phase.BW, Phase.FW, Phase.BW, Phase.OPTIM]
    assert loss == full / 2  # the last micro-batch's loss, divided by their number (exact: / 2)
    phases.clear()
    run_step(lin, (x,), None, None, phases.append, micro_batches=4, passes=1)  # a trace runs one pass
    assert phases == [Phase.FW, Phase.BW]


class _Out:
    def __init__(self, loss):
        self.loss = loss


@pytest.mark.parametrize("wrap, expect", [
    (lambda y: y, lambda y: y.sum()),                  # a tensor: its sum
    (lambda y: _Out(y.mean()), lambda y: y.mean()),    # an HF-style output: its .loss
    (lambda y: (y, "text"), lambda y: y.sum()),        # one tensor among other things: its sum
])
def test_default_loss(wrap, expect):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    model = _Wrapped(lin, wrap)
    with torch.no_grad():
        want = float(expect(lin(x)))
    assert run_step(model, (x,), None, None) == want


class _Wrapped(torch.nn.Module):
    def __init__(self, inner, wrap):
        super().__init__()
        self.inner, self.wrap = inner, wrap

    def forward(self, x):
        return self.wrap(self.inner(x))


def test_step_errors_say_what_to_change():
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.raises(StepError, match=r"returned tuple with 2 tensors; pass loss_fn="):
        run_step(_Wrapped(lin, lambda y: (y, y + 1)), (x,), None, None)
    with pytest.raises(StepError, match=r"the loss must be a scalar tensor, got \(4, 2\); reduce it"):
        run_step(lin, (x,), lambda out, inputs: out, None)
    with pytest.raises(StepError, match=r"the loss must be a scalar tensor, got float"):
        run_step(lin, (x,), lambda out, inputs: 1.0, None)
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(StepError, match=r"the loss does not require grad"):
        run_step(frozen, (x,), None, None)
    with pytest.raises(StepError, match=r"Linear.forward raised RuntimeError: .* check that the inputs match") as e:
        run_step(lin, (torch.randn(4, 5),), None, None)
    assert isinstance(e.value.__cause__, RuntimeError)  # the original error stays attached


def test_zero_grads_with_and_without_an_optimizer():
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    run_step(lin, (x,), None, None)
    zero_grads(lin, None, ZeroGrad.ZERO)
    assert all(p.grad is not None and not p.grad.any() for p in lin.parameters())
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    zero_grads(lin, opt, ZeroGrad.SET_TO_NONE)
    assert all(p.grad is None for p in lin.parameters())


def test_describe_names_the_loop():
    assert TrainStep(optimizer="adam").describe() == (
        "step: optimizer adam, 1 micro-batch(es), zero_grad set_to_none, autocast off")
    assert TrainStep(optimizer=torch.optim.AdamW, micro_batches=2, zero_grad="zero",
                     autocast_dtype=torch.bfloat16).describe() == (
        "step: optimizer AdamW, 2 micro-batch(es), zero_grad zero, autocast bfloat16")


def _logs_grad_norms():
    """A backward hook that logs a gradient norm, as training scripts do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    norms = []
    model[0].register_full_backward_hook(lambda mod, gin, gout: norms.append(gout[0].norm().item()))
    return model, torch.randn(3, 4), norms


def test_values_read_in_a_backward_hook_say_to_trace_in_real_mode():
    # Was torch's bare DataDependentOutputException from inside the fake-mode backward.
    from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode

    model, x, norms = _logs_grad_norms()
    with pytest.raises(TraceError, match=r"the backward .* reads tensor values.*TraceMode.REAL"):
        estimate(model, TrainStep(inputs=(x,)))
    est = estimate(model, TrainStep(inputs=(x,)), options=EstimateOptions(mode=TraceMode.REAL))
    assert est.steady_peak_bytes > 0 and len(norms) >= 1


def test_values_read_in_the_loss_say_to_trace_in_real_mode():
    from estimators.tracing.estimation import TraceError

    model, x, _ = _logs_grad_norms()
    with pytest.raises(TraceError, match=r"the loss function .* reads tensor values.*--mode real"):
        estimate(model, TrainStep(inputs=(x,), loss_fn=lambda out, inp: out.sum() * (1.0 if out.max().item() > 0 else 2.0)))


def test_keep_output_must_be_a_bool():
    with pytest.raises(TypeError, match=r"keep_output must be True or False"):
        TrainStep(keep_output="yes")
    assert TrainStep(keep_output=True).describe().endswith("autocast off, output kept through backward")


def _output_lifetimes(keep_output: bool, micro_batches: int) -> list[tuple[str, list[bool]]]:
    """Which outputs of the earlier forwards are still alive as each phase starts."""
    import weakref

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    outs, seen = [], []
    lin.register_forward_hook(lambda mod, args, out: outs.append(weakref.ref(out)))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    run_step(lin, (x,), None, opt, lambda ph: seen.append((ph.name, [o() is not None for o in outs])),
             micro_batches=micro_batches, keep_output=keep_output)
    return seen + [("END", [o() is not None for o in outs])]


def test_keep_output_holds_the_output_through_backward_and_the_optimizer_step():
    # The loop `out = model(x); out.sum().backward(); opt.step()`: the output lives through
    # backward and the optimizer step; without keep_output it is gone before backward starts.
    assert _output_lifetimes(True, 1) == [("FW", []), ("BW", [True]), ("OPTIM", [True]), ("END", [False])]
    assert _output_lifetimes(False, 1) == [("FW", []), ("BW", [False]), ("OPTIM", [False]), ("END", [False])]
    # Accumulation: micro-batch 1's output is let go when micro-batch 2's forward returns (the
    # loop rebinds `out`), so it is alive in that forward but not in its backward.
    assert _output_lifetimes(True, 2) == [
        ("FW", []), ("BW", [True]), ("FW", [True]), ("BW", [False, True]), ("OPTIM", [False, True]),
        ("END", [False, False])]


def _t5(**config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, **config))


@pytest.mark.hf
def test_an_encoder_decoder_without_decoder_start_token_says_what_to_set():
    # T5Config() (transformers 5) has no decoder_start_token_id: with labels and no
    # decoder_input_ids, T5 raised AttributeError ('T5Config' object has no attribute ...) and the
    # hint said to check the forward's signature. The hint now names the token and the fix.
    ids = torch.randint(0, 64, (2, 8))
    model = _t5()
    with pytest.raises(StepError, match=r"T5ForConditionalGeneration builds its decoder inputs by shifting labels "
                       r"right behind config.decoder_start_token_id, which its config does not set .*: set "
                       r"model.config.decoder_start_token_id = 0 \(its pad_token_id, as T5 starts\), or pass "
                       r"decoder_input_ids") as e:
        run_step(model, {"input_ids": ids, "labels": ids}, None, None)
    assert "forward signature" not in str(e.value)
    model.config.decoder_start_token_id = 0  # what the hint says
    assert run_step(model, {"input_ids": ids, "labels": ids}, None, None) > 0
    run_step(_t5(), {"input_ids": ids, "decoder_input_ids": ids}, lambda out, inp: out.logits.sum(), None)
    with pytest.raises(StepError, match="an encoder-decoder model needs inputs for its decoder: pass labels"):
        run_step(_t5(), {"input_ids": ids}, None, None)


class _ReadsValues(torch.nn.Module):
    """An encoder-decoder by its config (is_encoder_decoder, as HF's time-series models) whose
    forward reads a value; it takes no labels."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"is_encoder_decoder": True, "encoder_layerdrop": 0.1})()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, past_values):
        return self.fc(past_values) if past_values.sum() > 0 else self.fc(-past_values)


def test_a_value_read_is_named_before_missing_decoder_inputs():
    # TimeSeriesTransformer was told to pass labels, which it does not take; the cause was a
    # value read (its LayerDrop's draw, then torch.distributions' argument checks).
    from estimators.tracing.estimation import TraceError

    with pytest.raises(TraceError, match=r"reads tensor values.*TraceMode.REAL.*LayerDrop is on "
                       r"\(config.encoder_layerdrop = 0.1\).*set it to 0.0") as e:
        estimate(_ReadsValues(), TrainStep(inputs={"past_values": torch.randn(2, 4)}))
    assert "labels" not in str(e.value)


@pytest.mark.hf
def test_bart_without_decoder_start_token_is_told_its_own_token():
    transformers = pytest.importorskip("transformers")
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
        decoder_start_token_id=None))
    ids = torch.randint(3, 64, (2, 8))
    with pytest.raises(StepError, match=r"raised TypeError: can't assign a NoneType .*BART's is its eos_token_id, 2"):
        run_step(model, {"input_ids": ids, "labels": ids}, None, None)


def test_held_takes_tensors_and_modules():
    t, m = torch.zeros(3), torch.nn.Linear(2, 2)
    assert TrainStep(held=t).held == (t,)
    assert TrainStep(held=[t, m]).held == (t, m)
    assert TrainStep(held=None).held == TrainStep().held == ()
    assert TrainStep(held=m).held_tensors() == [m.weight, m.bias]
    with pytest.raises(TypeError, match=r"held\[1\] must be a tensor or an nn.Module .* EMA"):
        TrainStep(held=[t, "ema"])
    assert "1 held object(s) (24 B) resident" in TrainStep(held=m).describe()


def test_loss_functions_are_checked_for_output_and_inputs():
    import functools

    def two(out, inputs):
        return out.sum()

    @functools.wraps(lambda out: out.sum())
    def adapter(out, inputs):  # functools.wraps copies a one-argument __wrapped__
        return out.sum()

    for ok in (two, adapter, functools.partial(lambda out, inputs, scale: out.sum() * scale, scale=2.0),
               torch.nn.MSELoss(), lambda *args: args[0].sum(), torch.nn.functional.mse_loss):
        TrainStep(inputs=(torch.randn(2, 4),), loss_fn=ok)
    with pytest.raises(TypeError, match=r"loss_fn is called as loss_fn\(output, inputs\).*takes \(out\)"):
        TrainStep(inputs=(torch.randn(2, 4),), loss_fn=lambda out: out.sum())
    with pytest.raises(TypeError, match="train_mode"):
        TrainStep(train_mode=0)


# ------------------------------------------------------------------ losses that mean nothing
def _tiny():
    return torch.nn.Sequential(torch.nn.Linear(8, 4))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_loss_that_is_not_finite_is_refused_where_it_has_a_value(value):
    # Before: planned and measured (920 B); the CLI's gradient check printed "bitwise EQUAL ...
    # max diff nan" and exited 0. A fake trace has no values: the real runs refuse it.
    from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
    from planner.analysis.gradcheck import check_gradients
    from planner.analysis.measure import measure_steps

    step = TrainStep(inputs=(torch.randn(16, 8),), loss_fn=lambda out, batch: out.sum() * 0 + value)
    with pytest.raises(TraceError, match=f"the loss is {value}: a step on it trains nothing"):
        estimate(_tiny(), step=step, options=EstimateOptions(mode=TraceMode.REAL))
    with pytest.raises(StepError, match="check the batch"):
        measure_steps(_tiny(), step, n_steps=1)
    model = _tiny()
    with pytest.raises(StepError, match=f"the loss is {value}"):
        check_gradients(model, _empty_plan(model), step)


def _empty_plan(model):
    from planner.plan import Plan, model_fingerprint

    return Plan(modules=(), model_name=type(model).__name__, model_fingerprint=model_fingerprint(model),
                device="cpu", world_size=1, budget_bytes=10**6, reserve_bytes=0, predicted_peak_bytes=0,
                solver_peak_bytes=0, baseline_peak_bytes=0, recompute_ms=0.0, baseline_step_ms=0.0)


def test_a_complex_loss_is_refused_in_the_steps_own_words():
    # Before: torch's "grad can be implicitly created only for real scalar outputs".
    from estimators.tracing.estimation import TraceError, estimate

    step = TrainStep(inputs=(torch.randn(16, 8),), loss_fn=lambda out, batch: out.sum() * (1 + 1j))
    with pytest.raises(TraceError, match=r"the loss is complex \(complex64\).*loss.abs\(\) or loss.real"):
        estimate(_tiny(), step=step)


def test_a_batch_with_no_rows_is_refused_before_it_is_planned():
    # Before: planned silently (fake tensors see shapes only; the loss over it is NaN).
    from estimators.tracing.estimation import TraceError, estimate

    step = TrainStep(inputs=(torch.randn(0, 8),), loss_fn=lambda out, batch: out.mean())
    with pytest.raises(TraceError, match=r"the batch has no rows \(tensors of shape \(0, 8\)\)"):
        estimate(_tiny(), step=step)
    estimate(_tiny(), step=TrainStep(inputs=(torch.randn(1, 8),)))  # one row is a batch


def test_an_unknown_optimizer_name_is_refused_when_the_step_is_built():
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamm'; use one of \['adam', 'adamw', 'sgd'\]"):
        TrainStep(optimizer="adamm")
    assert TrainStep(optimizer="AdamW").optimizer == "AdamW"  # names are case-insensitive


def test_a_target_outside_a_pipeline_is_refused_with_where_labels_go():
    step = TrainStep(inputs=torch.randn(2, 3), target=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="close over the labels in loss_fn"):
        estimate(torch.nn.Linear(3, 4), step, device="cpu")


LABELS = torch.arange(6) % 3
"""A module-level label tensor a loss names (a script's ``labels``)."""


def test_the_tensors_a_loss_closes_over_are_found_and_the_counted_ones_left_out():
    import functools

    import torch.nn.functional as F

    model = torch.nn.Linear(4, 3)
    x = torch.randn(6, 4)
    labels, weights = torch.arange(6) % 3, [torch.ones(3), torch.ones(3)]

    def closure(out, inputs):
        return F.cross_entropy(out, labels, weight=weights[0]) + (out * x).sum() + model.weight.sum()

    def with_default(out, inputs, target=torch.zeros(6, dtype=torch.long)):
        return F.cross_entropy(out, target)

    by_global = TrainStep(inputs=(x,), loss_fn=lambda out, _: F.cross_entropy(out, LABELS))
    assert [t is LABELS for t in by_global.loss_closure_tensors(model)] == [True]
    found = TrainStep(inputs=(x,), loss_fn=closure).loss_closure_tensors(model)
    # x is an input and the weight the model's: counted already; a list holds the class weights
    assert {id(t) for t in found} == {id(labels), id(weights[0]), id(weights[1])}
    assert len(TrainStep(inputs=(x,), loss_fn=with_default).loss_closure_tensors(model)) == 1
    part = functools.partial(lambda out, inputs, y: F.cross_entropy(out, y), y=labels)
    assert [t is labels for t in TrainStep(inputs=(x,), loss_fn=part).loss_closure_tensors(model)] == [True]
    view = labels[:3]
    same = TrainStep(inputs=(x,), loss_fn=lambda out, _, a=labels, b=view: out.sum()).loss_closure_tensors()
    assert len(same) == 1  # a view of a storage already found is that storage
    assert TrainStep(inputs=(x,)).loss_closure_tensors(model) == []


@pytest.mark.parametrize("loss_fn, error", [
    (lambda out, inputs: out.square().mean() + inputs[1].sum(), "IndexError: tuple index out of range"),
    (lambda out, inputs: {"out": out}["logits"].sum(), "KeyError: 'logits'"),
    (lambda out, inputs: out.loss, "AttributeError: 'Tensor' object has no attribute 'loss'"),
])
def test_a_loss_that_looks_up_what_is_not_there_says_it_is_the_loss(loss_fn, error):
    """It raised a bare IndexError / AttributeError that did not say it came from the loss."""
    model = torch.nn.Linear(16, 4)
    with pytest.raises(StepError) as info:
        run_step(model, (torch.randn(8, 16),), loss_fn, None)
    msg = str(info.value)
    assert msg.startswith(f"the loss function raised {error}")
    assert "output being what the model returned (float32[8, 4]) and inputs the batch as given (tuple of 1: " \
           "(float32[8, 16]))" in msg
