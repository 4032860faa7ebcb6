"""benchmarks/new_user_trial.py: one family's row end to end (the script runs all fourteen)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.new_user_trial import _families, trial  # noqa: E402


@pytest.mark.hf
@pytest.mark.parametrize("name", ["resnet", "whisper"])  # BatchNorm statistics; an EMA copy under bf16
def test_a_family_is_planned_applied_and_checked_to_the_byte(name):
    row = trial(_families()[name])
    assert row.ok, row
    assert row.modules >= 1 and row.planned_meas < row.unplanned_meas
