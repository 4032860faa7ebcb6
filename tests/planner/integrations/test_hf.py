"""plan_trainer on a real transformers.Trainer.train() run: 3 steps, AdamW, accumulation 2,
bf16 autocast, on tiny Llama and BERT. The measured steady-state peak (StepPeaks, over the whole
run) equals the plan's prediction to the byte, and the loss and parameters after 3 steps are
bitwise those of the same Trainer run unplanned."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="the HF integration reads transformers 5's Trainer")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install 'sac-planner[hf]')")

import transformers as T  # noqa: E402

from planner.analysis.measure import StepPeaks  # noqa: E402
from planner.errors import PlanningError  # noqa: E402
from planner.format import GiB  # noqa: E402
from planner.integrations.hf import plan_trainer  # noqa: E402
from tests.planner.integrations.tiny import (  # noqa: E402
    BATCH, dataset, examples_for, midway_budget_gib, no_ac_peak_bytes, tiny_model,
)

pytestmark = [pytest.mark.hf, pytest.mark.slow]


class _Meter(T.TrainerCallback):
    """The unplanned run's measurement: what plan_trainer(measure=True) runs, without a plan."""

    def __init__(self, trainer):
        self.trainer, self.peaks = trainer, []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.meter = StepPeaks(model, optimizer.optimizer, external=(self.trainer._tr_loss,))
        self.meter.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.peaks.append(self.meter.step_done())

    def on_train_end(self, args, state, control, **kwargs):
        self.meter.stop()


def _trainer(name, tmp_path, data=None, **args):
    model = tiny_model(name)
    args = T.TrainingArguments(**{
        "output_dir": str(tmp_path), "max_steps": 3, "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 2, "bf16": True, "use_cpu": True, "logging_steps": 1, "report_to": "none",
        "save_strategy": "no", "seed": 0, "learning_rate": 1e-3, "disable_tqdm": True, **args})
    return T.Trainer(model=model, args=args, train_dataset=dataset() if data is None else data)


def _train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return out, losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _unplanned(name, optim, tmp_path):
    trainer = _trainer(name, tmp_path, optim=optim)
    meter = _Meter(trainer)
    trainer.add_callback(meter)
    return (*_train(trainer), meter.peaks)


# AdamW both: the Trainer's default (adamw_torch_fused: AdamW(fused=True)) and the plain one.
@pytest.mark.parametrize("name, optim", [("llama", "adamw_torch_fused"), ("bert", "adamw_torch")])
def test_a_planned_trainer_run_peaks_as_predicted_and_trains_bitwise(name, optim, tmp_path_factory):
    ref_out, ref_losses, ref_params, ref_peaks = _unplanned(name, optim, tmp_path_factory.mktemp("ref"))
    budget = midway_budget_gib(name, 2, torch.bfloat16)  # before the Trainer seeds the generators
    trainer = _trainer(name, tmp_path_factory.mktemp("planned"), optim=optim)
    sac = plan_trainer(trainer, budget, measure=True)
    out, losses, params = _train(trainer)
    plan, peaks = sac.plan, sac.meter.peaks_bytes
    print(f"{name}: unplanned {ref_peaks}, planned {peaks}, predicted steady {plan.steady_peak_bytes} "
          f"first {plan.first_step_peak_bytes}, no AC {plan.baseline_peak_bytes}, {len(plan.modules)} modules")
    assert plan.modules, "the budget checkpoints something"
    assert peaks[1] == peaks[2] == plan.steady_peak_bytes == plan.predicted_peak_bytes  # to the byte
    assert ref_peaks[1] == ref_peaks[2] == plan.baseline_peak_bytes  # the unplanned run too
    # Step 1 holds no previous step's gradient norm: the prediction counts one 4 B scalar over.
    assert plan.first_step_peak_bytes - peaks[0] == 4
    assert losses == ref_losses and out.training_loss == ref_out.training_loss
    assert all(torch.equal(p, ref_params[n]) for n, p in params.items())
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["sac_measured_peak_bytes"] for e in logged] == peaks
    assert {e["sac_predicted_peak_bytes"] for e in logged} == {plan.predicted_peak_bytes}
    assert any("max_grad_norm" in n for n in plan.notes) and any("bf16" in n for n in plan.notes)
    assert all(not hasattr(m.__dict__.get("forward"), "mp") for m in trainer.model.modules())  # removed at the end


@pytest.mark.parametrize("flag", ["activation_checkpointing", "gradient_checkpointing"])
def test_the_trainers_gradient_checkpointing_is_turned_off_with_a_note(flag, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradient_checkpointing: transformers 5's deprecated alias
        trainer = _trainer("llama", tmp_path, **{flag: True})
    sac = plan_trainer(trainer, 1.0)
    seen = []

    class Args(T.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append((args.activation_checkpointing, args.gradient_checkpointing, model.is_activation_checkpointing))

    trainer.add_callback(Args())
    _train(trainer)
    assert seen == [(False, False, False)]  # off within train()
    assert trainer.args.activation_checkpointing is True and trainer.args.gradient_checkpointing is True  # after
    assert any("checkpointing turned off" in n for n in sac.notes)
    assert trainer.callback_handler.callbacks[0] is sac  # first: its on_log feeds the others


def test_a_trainer_whose_step_cannot_be_read_is_refused_with_what_to_do(tmp_path):
    class Custom(T.Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            return super().compute_loss(model, inputs, **kwargs) * 2

    model = tiny_model("llama")
    trainer = Custom(model=model, args=_trainer("llama", tmp_path).args, train_dataset=dataset())
    with pytest.raises(NotImplementedError, match="overrides compute_loss"):
        plan_trainer(trainer, 1.0)
    with pytest.raises(TypeError, match="transformers.Trainer"):
        plan_trainer(model, 1.0)


class _StepDone(T.TrainerCallback):
    def __init__(self, meter):
        self.meter = meter

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.step_done()


# Budgets below the step's no-AC peak: 0.7 of GPT-2's (as reported from the field); ConvNext's are
# 0.9 of a hand-written step's, which leaves out the two batches of images the Trainer holds beside
# the step (0.75-0.8 of the Trainer's own no-AC peak; its bf16 floor is at 0.70 of it).
@pytest.mark.parametrize("name, bf16, fraction", [("gpt2", True, 0.7), ("convnext", False, 0.9), ("convnext", True, 0.9)])
def test_a_run_measured_from_before_train_holds_the_prediction(name, bf16, fraction, tmp_path):
    """The meter starts before train(), so before planning: what the plan keeps alive for the run
    (it lives as long as the callback) is in every step's peak, as on a GPU."""
    budget = fraction * no_ac_peak_bytes(name, 2, torch.bfloat16 if bf16 else None) / GiB
    trainer = _trainer(name, tmp_path, examples_for(name), bf16=bf16)
    sac = plan_trainer(trainer, budget)
    meter = StepPeaks(trainer.model)
    trainer.add_callback(_StepDone(meter))
    meter.start()
    try:
        _train(trainer)
    finally:
        meter.stop()
    plan, peak = sac.plan, max(meter.peaks_bytes)
    print(f"{name} bf16={bf16}: measured {meter.peaks_bytes}, predicted {plan.predicted_peak_bytes}, "
          f"budget {plan.budget_bytes}, no AC {plan.baseline_peak_bytes}, {len(plan.modules)} modules")
    assert plan.modules, "the budget checkpoints something"
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.predicted_peak_bytes) <= 0.001 * plan.predicted_peak_bytes
    assert plan.train_step is None  # the planning batch and its stand-ins were freed


class _OnePass(torch.utils.data.IterableDataset):
    """A stream read once: a second iterator gets what the first left."""

    def __init__(self, rows):
        self.rows = iter(rows)

    def __iter__(self):
        return self.rows


def test_a_single_pass_stream_loses_no_batch_to_planning(tmp_path):
    rows = dataset(2 * 2 * BATCH)  # two steps of two micro-batches, nothing more
    ref = _trainer("llama", tmp_path / "ref", _OnePass(rows), max_steps=2)
    _, ref_losses, _ = _train(ref)
    trainer = _trainer("llama", tmp_path / "planned", _OnePass(rows), max_steps=2)
    plan_trainer(trainer, 1.0)
    _, losses, _ = _train(trainer)
    assert ref.state.global_step == trainer.state.global_step == 2
    assert losses == ref_losses  # the same batches, in the same order


class _Fail(T.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("a failure mid-run")


@pytest.mark.parametrize("where", ["planning", "training"])
def test_a_failed_train_leaves_the_trainer_and_model_as_they_were(where, tmp_path):
    trainer = _trainer("llama", tmp_path, activation_checkpointing=True)
    model = trainer.model
    model.activation_checkpointing_enable()
    flags = {n: m.gradient_checkpointing for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing")}
    sac = plan_trainer(trainer, 1e-5 if where == "planning" else midway_budget_gib("llama", 2, torch.bfloat16))
    if where == "training":
        trainer.add_callback(_Fail())
    with pytest.raises(PlanningError if where == "planning" else RuntimeError):
        _train(trainer)
    assert where == "planning" or sac.plan.modules  # applied when the run failed
    assert trainer.args.activation_checkpointing is True
    assert flags == {n: m.gradient_checkpointing for n, m in model.named_modules() if n in flags} and any(flags.values())
    assert all(not hasattr(m.__dict__.get("forward"), "mp") for m in model.modules())  # no module left planned
    assert sac._handle is None


def test_bad_budgets_and_replaced_losses_are_refused_before_train(tmp_path):
    trainer = _trainer("llama", tmp_path)
    for bad in (-1, 0, float("nan"), "20"):
        with pytest.raises(PlanningError, match="budget_gib must be"):
            plan_trainer(trainer, bad)
    with pytest.raises(TypeError, match="options must be a planner.PlanOptions"):
        plan_trainer(trainer, 1.0, options={"device": "cpu"})
    trainer.compute_loss = lambda model, inputs, **kwargs: model(**inputs).loss * 2
    with pytest.raises(NotImplementedError, match="overrides compute_loss \\(on the class or the instance\\)"):
        plan_trainer(trainer, 1.0)
    assert not trainer.callback_handler.callbacks[0].__class__.__name__ == "SACPlanCallback"
