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
