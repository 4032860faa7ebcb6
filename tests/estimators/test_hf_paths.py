"""The fake trace answers transformers' packed-sequence check as the real run does, and only then."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimators.hf_paths import hf_real_paths

mu = pytest.importorskip("transformers.masking_utils")


def _packed_on_fake(inputs) -> bool:
    with hf_real_paths(inputs), FakeTensorMode():
        pos = torch.arange(8).unsqueeze(0)
        return mu.find_packed_sequence_indices(pos) is not None


def test_without_position_ids_the_fake_trace_is_not_packed_and_the_patch_is_undone():
    original = mu.find_packed_sequence_indices
    with FakeTensorMode():
        assert original(torch.arange(8).unsqueeze(0)) is not None  # transformers alone: "maybe packed"
    assert not _packed_on_fake({"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    assert mu.find_packed_sequence_indices is original


def test_real_position_ids_decide():
    flat = torch.arange(8).unsqueeze(0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert not _packed_on_fake({"input_ids": flat, "position_ids": flat})
    assert _packed_on_fake({"input_ids": flat, "position_ids": packed})  # two sequences: the mask stays
