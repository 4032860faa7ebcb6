"""PlannedAC: a plan file applied through torchtitan's own Trainer config, on torchtitan's Llama3
classes (the debugmodel flavor cut to 2 layers and a 256-token vocabulary). Single process: the
measured steady-state peak of 3 AdamW steps equals the plan's prediction to the byte, and the
planned step's loss and gradients are bitwise those of torchtitan's FullAC (and of no
checkpointing)."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed, or its model package "
                                                       "cannot import triton (pip install 'sac-planner[torchtitan]')")

from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402

from estimators.step.train_step import TrainStep  # noqa: E402
from estimators.tracing.estimation import estimate  # noqa: E402
from planner.analysis.measure import measure_steps  # noqa: E402
from planner.errors import PlanMismatchError  # noqa: E402
from planner.format import GiB  # noqa: E402
from planner.integrations.torchtitan import PlannedAC  # noqa: E402
from planner.planning.solve import solve_sac  # noqa: E402
from solver import SACMilp  # noqa: E402

pytestmark = pytest.mark.slow

SEQ, LAYERS, VOCAB = 64, 2, 256


@functools.lru_cache(maxsize=None)
def _config():
    """torchtitan's debugmodel Trainer.Config (its Llama3 flavor, AdamW, FullAC / SelectiveAC field)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return llama3_debugmodel()


def _llama():
    """The debugmodel flavor, 2 layers, VOCAB tokens, RoPE at SEQ, with torchtitan's
    ScaledDotProductAttention inner attention: FlexAttention (what its Llama3 configs use) has no
    CPU backward in torch 2.13."""
    cfg = copy.deepcopy(_config().model_spec.model)
    cfg.layers = cfg.layers[:LAYERS]
    cfg.vocab_size = VOCAB
    cfg.tok_embeddings = dataclasses.replace(cfg.tok_embeddings, num_embeddings=VOCAB)
    cfg.lm_head = dataclasses.replace(cfg.lm_head, out_features=VOCAB)
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def _step(micro_batches, autocast_dtype, batch):
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(2))
    return TrainStep(inputs=(tokens,), loss_fn=lambda out, inputs: cross_entropy_loss(out, labels) / labels.numel(),
                     optimizer=lambda groups: torch.optim.AdamW(groups, lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1),
                     micro_batches=micro_batches, autocast_dtype=autocast_dtype)


def _loss_and_grads(model, step):
    with torch.autocast("cpu", dtype=step.autocast_dtype, enabled=step.autocast_dtype is not None):
        loss = step.loss_fn(model(*step.inputs), step.inputs)
    loss.backward()
    # FullAC wraps each block: its parameter names gain "_checkpoint_wrapped_module".
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}


# Batches as small as still make the budget bind: bfloat16 matmuls are slow on CPUs without bf16 units.
@pytest.mark.parametrize("micro_batches, autocast_dtype, batch", [(1, None, 8), (2, torch.bfloat16, 2)])
def test_a_plan_applied_through_torchtitans_config_peaks_as_predicted(micro_batches, autocast_dtype, batch, tmp_path):
    model, step = _llama(), _step(micro_batches, autocast_dtype, batch)
    info = estimate(model, step).module_info
    budget_gib = (SACMilp(info).min_reachable_peak_bytes() + info.peak_bytes) / 2 / GiB
    plan = solve_sac(model, budget_gib, step)
    path = str(tmp_path / "plan.json")
    plan.save(path)
    # As parallelize_llama does: ac_config.build(dump_folder=...).apply(model).
    config = copy.copy(_config())
    config.activation_checkpoint = PlannedAC.Config(plan_path=path)
    fresh = {name: _llama() for name in ("planned", "full", "none")}
    config.activation_checkpoint.build(dump_folder=config.dump_folder).apply(fresh["planned"])
    FullAC.Config().build(dump_folder=config.dump_folder).apply(fresh["full"])
    ref = {name: _loss_and_grads(copy.deepcopy(m), step) for name, m in fresh.items()}
    peaks = [m.peak_bytes for m in measure_steps(fresh["planned"], step, n_steps=3)]
    print(f"{micro_batches} mb, {autocast_dtype}: plan {[m.fqn for m in plan.modules]} predicted steady "
          f"{plan.steady_peak_bytes} first {plan.first_step_peak_bytes} no AC {plan.baseline_peak_bytes}, "
          f"measured {peaks}")
    assert plan.modules
    assert peaks[1] == peaks[2] == plan.steady_peak_bytes and peaks[0] == plan.first_step_peak_bytes
    for other in ("full", "none"):
        assert torch.equal(ref["planned"][0], ref[other][0])
        assert all(torch.equal(g, ref[other][1][n]) for n, g in ref["planned"][1].items()), other


def test_the_config_is_checked_and_a_plan_for_another_model_refused(tmp_path):
    with pytest.raises(ValueError, match="needs plan_path"):
        PlannedAC.Config()
    with pytest.raises(ValueError, match="preserve_rng_state"):
        PlannedAC.Config(plan_path="plan.json", preserve_rng_state=False)
    with pytest.raises(FileNotFoundError, match="no plan file"):
        PlannedAC.Config(plan_path=str(tmp_path / "missing.json")).build(dump_folder="").apply(_llama())
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(64, 8)
    info = estimate(other, TrainStep(inputs=(x,))).module_info
    plan = solve_sac(other, info.peak_bytes / GiB, TrainStep(inputs=(x,)))
    plan.save(str(tmp_path / "other.json"))
    with pytest.raises(PlanMismatchError):
        PlannedAC.Config(plan_path=str(tmp_path / "other.json")).build(dump_folder="").apply(_llama())


def test_a_path_object_is_taken_and_a_fifo_or_directory_named_for_what_it_is(tmp_path):
    # Before: Config(plan_path=Path) said "needs plan_path"; a FIFO or a directory "no plan file".
    import os
    from pathlib import Path

    from planner.errors import PlanFormatError

    assert PlannedAC.Config(plan_path=Path("plan.json")).plan_path == "plan.json"
    with pytest.raises(TypeError, match="plan_path must be a path \\(str or pathlib.Path\\), got int"):
        PlannedAC.Config(plan_path=3)
    os.mkfifo(tmp_path / "fifo")
    for path, what in ((tmp_path / "fifo", "is a FIFO"), (tmp_path, "is a directory")):
        with pytest.raises(PlanFormatError, match=what):
            PlannedAC.Config(plan_path=path).build(dump_folder="").apply(torch.nn.Linear(2, 2))
