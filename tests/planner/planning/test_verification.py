"""The verification trace (planner/planning/verification.py): a plan traced as it will run, and the
modules whose recompute diverges from their forward named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from estimators.tracing.estimation import estimate
from planner.planning.module_plans import module_plan
from planner.planning.verification import RecomputeDivergedError, peak_in_backward_of, traced_or_diverged, traced_peak
from tests.planner.planning.test_solve import _ExtraOpInBackward, _Mlp, _residual_step
from estimators.step.train_step import TrainStep


def _whole(est, fqn: str, *, full: bool):
    """``fqn`` discarding all it can: as a full checkpoint, or replayed op by op (selective)."""
    stats = est.module_info.stats(fqn)
    return dataclasses.replace(module_plan(stats, stats.sac_memory_bytes), full=full)


def test_an_empty_plan_is_the_estimate_itself_and_a_plan_lowers_the_traced_peak():
    model, step = _residual_step()
    est = estimate(model, step)
    assert traced_peak(model, (), est) == (est.first_step_peak_bytes, est.steady_peak_bytes)
    plans = tuple(_whole(est, f"_Residual.blocks.{i}", full=False) for i in (1, 3))
    planned = traced_or_diverged(model, plans, est)
    assert planned.steady_peak_bytes < est.steady_peak_bytes
    # The planned step peaks in the backward of the last planned block (its recompute's gelu
    # backward); without a plan no module is named.
    assert peak_in_backward_of(planned, plans) == "_Residual.blocks.3"
    assert peak_in_backward_of(est, ()) is None


def test_a_selective_recompute_that_diverges_is_named():
    model, step = _residual_step()
    est = estimate(model, step)
    plans = tuple(_whole(est, f"_Residual.blocks.{i}", full=False) for i in range(4))
    with pytest.raises(RecomputeDivergedError) as info:
        traced_or_diverged(model, plans, est)
    assert sorted(info.value.fqns) == ["_Residual.blocks.0", "_Residual.blocks.2"]  # the _Alternating ones


@pytest.mark.slow
def test_a_full_checkpoint_torch_refuses_is_named_by_replaying_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Mlp(32), _ExtraOpInBackward(32))
    est = estimate(model, TrainStep(inputs=(torch.randn(64, 32),), optimizer="adamw"))
    plans = tuple(_whole(est, f"Sequential.{i}", full=True) for i in range(2))
    with pytest.raises(RecomputeDivergedError) as info:
        traced_or_diverged(model, plans, est)
    assert info.value.fqns == ["Sequential.1"]
    assert isinstance(info.value.__cause__, torch.utils.checkpoint.CheckpointError)


def _llama_step(n_layers: int = 8):
    from examples.llama import LlamaConfig, build_llama, llama_loss

    cfg = LlamaConfig(vocab_size=256, seq_len=32, n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    model, inputs = build_llama(cfg, 2, device="meta")
    return model, TrainStep(inputs=inputs, loss_fn=llama_loss, optimizer="adamw")


@pytest.mark.parametrize("kind", ["every block full", "every attention half", "one middle block differs",
                                  "the root"])
def test_a_plan_alike_on_the_middle_blocks_is_traced_on_four_and_gives_the_full_trace(kind):
    """The verification trace of a plan that treats blocks 1..N-2 alike runs four blocks and
    lays in the rest (``plan_on_stacks``); it equals the trace of every block, record by record.
    A plan that differs on a middle block, or checkpoints what holds the stack, is traced whole."""
    from estimators.tracing.estimation import EstimateOptions
    from tests.estimators.tracing.trace_equivalence import estimate_difference

    model, step = _llama_step()
    est = estimate(model, step, device="h100")

    def at(fqn, share):
        stats = est.module_info.stats(fqn)
        return module_plan(stats, int(stats.sac_memory_bytes * share))

    if kind == "every block full":
        plans = [at(f"Llama.layers.{i}", 1.0) for i in range(8)]
    elif kind == "every attention half":
        plans = [at(f"Llama.layers.{i}.attention", 0.5) for i in range(8)]
    elif kind == "one middle block differs":
        plans = [at(f"Llama.layers.{i}", 1.0 if i != 5 else 0.5) for i in range(8)]
    else:
        plans = [at("Llama", 1.0)]
    planned = traced_or_diverged(model, plans, est)
    full = traced_or_diverged(model, plans, dataclasses.replace(est, options=EstimateOptions(replicate_blocks=False)))
    assert not full.trace.twin_of
    laid_in = bool(planned.trace.twin_of)
    assert laid_in == (kind in ("every block full", "every attention half"))
    assert estimate_difference(full, planned) == ""
    assert (planned.steady_peak_bytes, planned.first_step_peak_bytes) == (full.steady_peak_bytes, full.first_step_peak_bytes)
