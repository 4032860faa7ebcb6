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
from planner.integrations.hf import plan_trainer  # noqa: E402
from tests.planner.integrations.tiny import BATCH, dataset, midway_budget_gib, tiny_model  # noqa: E402

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


def _trainer(name, tmp_path, **args):
    model = tiny_model(name)
    args = T.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
        bf16=True, use_cpu=True, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        learning_rate=1e-3, disable_tqdm=True, **args)
    return T.Trainer(model=model, args=args, train_dataset=dataset())


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
    assert trainer.args.activation_checkpointing is False and trainer.args.gradient_checkpointing is False
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
