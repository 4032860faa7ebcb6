"""planner/analysis/measure.py: real steps of a three-module net measured by MemTracker, against peaks
worked out by hand (tests/estimators/test_aggregate.py derives the same step's 632 B)."""

from __future__ import annotations

import copy

import pytest
import torch

from estimators.step.train_step import TrainStep, ZeroGrad
from planner.analysis.measure import StepPeaks, measure_step, measure_steps
from tests.estimators.tracing.test_aggregate import Net

# The unplanned step (loss = output.sum(), no optimizer) peaks at threshold_backward: params 224 +
# x 48 + loss 4 + its gradient 4 + ReLU's output 96 + b's weight gradient 64 + the two [3, 8]
# gradients 96 + 96.
PEAK = 632
# With the gradients kept from the last step (ZeroGrad.ZERO), all 224 B of them are there, and
# b's new weight gradient is added in place, so its 64 B are gone by then: 632 - 64 + 224.
PEAK_GRADS_KEPT = 792


def _net():
    torch.manual_seed(0)
    return Net(), torch.randn(3, 4)


def test_one_step_peak_loss_and_activation_bytes():
    model, x = _net()
    with torch.no_grad():
        ref_loss = float(model(x).sum())
    m = measure_step(model, (x,))
    assert m.peak_bytes == PEAK
    assert m.loss == ref_loss
    assert m.tracker == "torch.distributed._tools.MemTracker"
    # Everything but parameters and the gradients alive at the peak (b's weight gradient, 64 B).
    assert m.activation_bytes == PEAK - 224 - 64
    assert m.step_time_ms > 0
    assert model.b.weight.grad is not None and model.a.weight.grad is not None  # the step ran


@pytest.mark.parametrize("how, peaks", [
    (ZeroGrad.SET_TO_NONE, [PEAK, PEAK, PEAK]),
    (ZeroGrad.ZERO, [PEAK, PEAK_GRADS_KEPT, PEAK_GRADS_KEPT]),
])
def test_steps_reset_gradients_as_the_loop_says(how, peaks):
    model, x = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = measure_steps(model, TrainStep(inputs=(x,), zero_grad=how), opt, n_steps=3)
    assert [s.peak_bytes for s in steps] == peaks


def test_steps_train_the_model():
    model, x = _net()
    ref = copy.deepcopy(model)
    steps = measure_steps(model, TrainStep(inputs=(x,)), torch.optim.SGD(model.parameters(), lr=0.1),
                          n_steps=2)
    # Step 2's loss is that of the parameters after one plain SGD step, done here by hand.
    ref(x).sum().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
        assert steps[1].loss == float(ref(x).sum())


def test_steps_without_an_optimizer_use_the_one_the_step_names():
    """optimizer=None: the step's "adamw" is built over the model and stepped (it was ignored,
    so the steady state had no AdamW state and the model did not train), and the step's own
    instance is stepped as it is."""
    model, x = _net()
    ref = copy.deepcopy(model)
    named = measure_steps(model, TrainStep(inputs=(x,), optimizer="adamw"), n_steps=2)
    given = measure_steps(ref, TrainStep(inputs=(x,)), torch.optim.AdamW(ref.parameters()), n_steps=2)
    assert [s.peak_bytes for s in named] == [s.peak_bytes for s in given]
    assert [s.loss for s in named] == [s.loss for s in given]
    assert named[1].loss != named[0].loss
    assert named[1].peak_bytes >= PEAK + 2 * 224  # AdamW's exp_avg and exp_avg_sq are alive (632 B without)
    model, x = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    measure_steps(model, TrainStep(inputs=(x,), optimizer=opt), n_steps=1)
    assert len(opt.state) == 3  # momentum buffers of the instance itself
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_micro_batches_report_the_last_scaled_loss():
    model, x = _net()
    with torch.no_grad():
        ref_loss = float(model(x).sum())
    (m,) = measure_steps(model, TrainStep(inputs=(x,), micro_batches=2), n_steps=1)
    assert m.loss == ref_loss / 2  # each micro-batch's loss is divided by their number (exact: / 2)


def test_steps_that_keep_the_output_hold_it_through_backward():
    # The output [3, 2] float32 (24 B) is alive at the peak in threshold_backward when the loop keeps it.
    model, x = _net()
    steps = measure_steps(model, TrainStep(inputs=(x,), keep_output=True), n_steps=2)
    assert [s.peak_bytes for s in steps] == [PEAK + 24, PEAK + 24]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_n_steps_must_be_a_positive_int(bad):
    model, x = _net()
    with pytest.raises(ValueError, match="n_steps must be an int >= 1"):
        measure_steps(model, TrainStep(inputs=(x,)), n_steps=bad)


def test_a_model_with_frozen_parameters_is_measured():
    # MemTracker registers a gradient hook on every parameter it meets and raised "cannot register
    # a hook on a tensor that doesn't require gradient" for a frozen one. The peak is the trace's.
    from estimators.tracing.estimation import estimate

    model, x = _net()
    model.a.requires_grad_(False)
    step = TrainStep(inputs=(x,), optimizer="adamw")
    predicted = estimate(copy.deepcopy(model), step).steady_peak_bytes
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    a, b = model.a.weight.clone(), model.b.weight.clone()
    steps = measure_steps(model, step, opt, n_steps=3)
    assert [s.peak_bytes for s in steps[1:]] == [predicted, predicted]
    assert torch.equal(model.a.weight, a) and not torch.equal(model.b.weight, b)  # b trained, a frozen


def test_measuring_installs_no_module_hooks():
    # MemTracker's ModTracker registered global module hooks and, on every module's inputs and
    # outputs, multi-grad hooks that hold gradients until all of a module's inputs have theirs.
    from torch.nn.modules import module as nn_module

    model, x = _net()
    seen = []

    def loss_fn(out, inputs):
        seen.append((len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
                     sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())))
        return out.sum()

    measure_steps(model, TrainStep(inputs=(x,), loss_fn=loss_fn), n_steps=2)
    assert seen == [(0, 0, 0), (0, 0, 0)]
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # removed after the step


@pytest.mark.hf
def test_a_whisper_step_is_measured_as_it_runs_untracked():
    # Tiny Whisper under bf16 autocast: with MemTracker's module hooks the steady-state peak
    # measured 547,404 B; the step itself (and the trace) peaks at 545,356 B.
    transformers = pytest.importorskip("transformers")
    import warnings

    from estimators.tracing.estimation import estimate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
            vocab_size=128, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=16, max_target_positions=16, pad_token_id=0, decoder_start_token_id=1,
            bos_token_id=1, eos_token_id=2))
    g = torch.Generator().manual_seed(0)
    batch = {"input_features": torch.randn(2, 8, 32, generator=g),
             "labels": torch.randint(0, 128, (2, 8), generator=g)}
    step = TrainStep(inputs=batch, optimizer="adamw", autocast_dtype=torch.bfloat16)
    predicted = estimate(model, step).module_info.peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ModTracker warned "Module is None. Skipping PRE_BW hook."
        steps = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=3)
    assert [s.peak_bytes for s in steps[1:]] == [predicted, predicted] == [545_356, 545_356]


def test_a_meta_or_parameterless_model_is_refused_with_what_to_do():
    from estimators.step.train_step import TrainStep
    from planner.analysis.measure import StepPeaks, measure_step, measure_steps

    with torch.device("meta"):
        lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        measure_steps(lin, TrainStep(inputs=(torch.randn(2, 4),)))
    with pytest.raises(ValueError, match=r"meta device"):
        measure_step(lin, (torch.randn(2, 4),))
    with pytest.raises(ValueError, match="no parameters"):
        measure_steps(torch.nn.ReLU(), TrainStep(inputs=(torch.randn(2, 4),)))


def test_an_optimizer_over_another_copy_is_refused():
    """It would step the other copy: the measured steps trained nothing (loss unchanged)."""
    import copy

    from estimators.step.train_step import TrainStep
    from planner.analysis.measure import measure_steps

    a = torch.nn.Linear(4, 4)
    b = copy.deepcopy(a)
    step = TrainStep(inputs=(torch.randn(2, 4),), optimizer=torch.optim.SGD(a.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="2 of its 2 parameters that are not this Linear's"):
        measure_steps(b, step)
    with pytest.raises(ValueError, match="not this Linear's"):
        measure_steps(b, TrainStep(inputs=(torch.randn(2, 4),)), torch.optim.SGD(a.parameters(), lr=0.1))
    assert len(measure_steps(a, step, n_steps=2)) == 2


def _loop(model, x, meter, kept=None, n_steps=3, dataset=None):
    """A loop someone else owns: StepPeaks is read at each optimizer-step boundary. ``dataset``:
    a host tensor whose rows the loop indexes for its batch (x then only gives the shape)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter.optimizer = opt
    meter.start()
    try:
        for i in range(n_steps):
            batch = x if dataset is None else dataset[3 * i:3 * i + 3].clone()
            loss = model(batch).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if kept is not None:
                kept.append(loss.detach())  # a logged value the loop keeps across steps
            meter.step_done()
    finally:
        meter.stop()
    return meter.peaks_bytes


def test_step_peaks_of_a_loop_equal_measure_steps():
    model, x = _net()
    assert _loop(model, x, StepPeaks(model, external=(x,))) == [PEAK, PEAK, PEAK]


def test_step_peaks_count_what_a_step_inherits_from_the_one_before():
    # The first step's kept loss is alive through the second step's peak, both through the third.
    model, x = _net()
    assert _loop(model, x, StepPeaks(model, external=(x,)), kept=[]) == [PEAK, PEAK + 4, PEAK + 8]


def test_step_peaks_leave_out_a_dataset_made_before_they_started():
    # The loop indexes a 1 MiB host tensor: the view shares its storage, which MemTracker alone
    # would count from then on; the batch copied from it is the step's.
    model, x = _net()
    dataset = torch.randn(65536, 4)
    assert _loop(model, x, StepPeaks(model), dataset=dataset) == [PEAK, PEAK, PEAK]


def test_step_peaks_count_the_batch_only_when_named():
    model, x = _net()
    assert _loop(model, x, StepPeaks(model)) == [PEAK - x.nbytes] * 3


def test_step_peaks_must_start_first_and_once():
    model, x = _net()
    meter = StepPeaks(model)
    with pytest.raises(RuntimeError, match="before start"):
        meter.step_done()
    meter.start()
    try:
        with pytest.raises(RuntimeError, match="twice"):
            meter.start()
    finally:
        meter.stop()
    meter.stop()  # idempotent


def test_labels_a_loss_closes_over_are_resident_in_the_trace_and_the_measurement():
    """A classifier's labels in the loss's closure (the README's pattern) are in device memory
    from before the step: the prediction and MemTracker's steady-state peak are equal."""
    import torch.nn.functional as F

    from estimators.tracing.estimation import estimate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    x, labels = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    step = TrainStep(inputs=(x,), loss_fn=lambda out, _: F.cross_entropy(out, labels), optimizer="adamw")
    assert step.loss_closure_tensors(model) == [labels]
    est = estimate(model, step, device="cpu")
    measured = [s.peak_bytes for s in measure_steps(model, step)]
    assert measured == [est.first_step_peak_bytes, est.module_info.peak_bytes, est.module_info.peak_bytes]


@pytest.mark.parametrize("how", [ZeroGrad.SET_TO_NONE, ZeroGrad.ZERO])
def test_steps_leave_no_gradients_behind(how):
    """The last step's gradients stayed on the model: a second measure_steps' first step read them
    as the model's (+224 B here, +6.5 MB on a GPT-2)."""
    model, x = _net()
    step = TrainStep(inputs=(x,), optimizer="adamw", zero_grad=how)
    first = measure_steps(model, step, n_steps=2)
    assert all(p.grad is None for p in model.parameters())
    again = measure_steps(model, step, n_steps=2)
    assert [s.peak_bytes for s in again] == [s.peak_bytes for s in first]
    model.a.weight.grad = torch.ones_like(model.a.weight)  # gradients the caller had are the caller's
    measure_steps(model, step, n_steps=1)
    assert model.a.weight.grad is not None and model.b.weight.grad is None


def test_gc_frozen_freezes_the_heap_within_and_gives_it_back():
    """Within, a collection walks only what was made since entry; after, everything is collectable
    again (a user's process is left as it was)."""
    import gc

    from planner.analysis.measure import gc_frozen

    gc.unfreeze()  # the suite freezes its heap after collection (tests/conftest.py)
    try:
        with gc_frozen():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
        gc.freeze()  # a caller that froze its own: left frozen, not released with ours
        n = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert gc.get_freeze_count() == n
        gc.unfreeze()
        with pytest.raises(KeyError), gc_frozen():  # an exception in the block: given back too
            raise KeyError("x")
        assert gc.get_freeze_count() == 0
    finally:
        gc.collect()
        gc.freeze()  # frozen again: the suite froze its heap (and now what earlier tests left alive)
