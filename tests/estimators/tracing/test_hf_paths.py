"""The fake trace answers transformers' packed-sequence check as the real run does, and only then."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimators.tracing.hf_paths import hf_real_paths

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


def _mask_skipped_on_fake(inputs, mask) -> bool:
    mask = mask.bool()
    with hf_real_paths(inputs), FakeTensorMode() as mode:
        fake = mode.from_tensor(mask)
        return mu._ignore_bidirectional_mask_sdpa(fake, mask.shape[-1])


def test_an_all_ones_attention_mask_is_skipped_as_in_the_real_run():
    ones, padded = torch.ones(2, 8, dtype=torch.long), torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    original = mu._ignore_bidirectional_mask_sdpa
    assert original(ones.bool(), 8) and not original(padded.bool(), 8)  # the real run's answers
    as_bool = ones.bool()
    with FakeTensorMode() as mode:
        assert not original(mode.from_tensor(as_bool), 8)  # transformers on a fake mask: never skip
    assert _mask_skipped_on_fake({"input_ids": ones, "attention_mask": ones}, ones)
    assert _mask_skipped_on_fake({"input_ids": ones}, ones)  # no mask passed: HF's mask is ones
    assert not _mask_skipped_on_fake({"input_ids": ones, "attention_mask": padded}, padded)
    assert not _mask_skipped_on_fake((ones, padded), padded)  # positional: unknowable, unpatched
    assert mu._ignore_bidirectional_mask_sdpa is original


def test_a_mask_the_model_builds_in_another_shape_is_asked_about_as_it_is():
    # Pix2Struct builds its decoder mask from labels (-100 padding gives zeros) while the step
    # passes an all-ones encoder mask: answering "ones" for every fake mask left out the
    # decoder mask the real run builds, 256 B under the measured peak.
    enc, dec = torch.ones(2, 8, dtype=torch.long), torch.tensor([[1] * 4, [1, 1, 0, 0]])
    both = {"input_ids": enc, "attention_mask": enc}
    assert _mask_skipped_on_fake(both, torch.ones(2, 8))  # a passed shape, all ones
    assert not _mask_skipped_on_fake(both, dec)  # another shape: built, as transformers does
    assert not _mask_skipped_on_fake(both, torch.ones(2, 4))  # (high, never low, where unknown)
    # Two passed masks of one shape: ones only if both are.
    mixed = {"attention_mask": enc, "decoder_attention_mask": torch.tensor([[1] * 8, [1] * 7 + [0]])}
    assert not _mask_skipped_on_fake(mixed, torch.ones(2, 8))


def test_a_batch_dict_inside_positional_arguments_passes_its_mask_by_name():
    # Lightning's step is training_step(batch, batch_idx): the batch dict sits inside a tuple.
    # Read at the top level only, its all-ones mask was "positional, unknowable" and the fake
    # trace built the 4-D mask the real run skips (1,024 B over on a tiny Llama).
    ones, padded = torch.ones(2, 8, dtype=torch.long), torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    assert _mask_skipped_on_fake(({"input_ids": ones, "attention_mask": ones}, 0), ones)
    assert not _mask_skipped_on_fake(({"input_ids": ones, "attention_mask": padded}, 0), padded)
    assert _mask_skipped_on_fake(({"input_ids": ones}, 0), ones)  # no mask in the batch: HF's ones
    # A tensor outside any dict beside the batch may be a mask: still unknowable.
    assert not _mask_skipped_on_fake(({"input_ids": ones}, padded), ones)


def test_position_ids_inside_a_nested_batch_decide():
    flat = torch.arange(8).unsqueeze(0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert not _packed_on_fake(({"input_ids": flat, "position_ids": flat}, 0))
    assert _packed_on_fake(({"input_ids": flat, "position_ids": packed}, 0))


def test_two_threads_tracing_at_once_leave_transformers_as_they_found_it():
    """The patches are the tracing thread's: another thread meanwhile runs transformers' own
    functions, and two traces leaving in either order leave the originals (each put back what
    it found: the second one's "original" was the first one's patch, left in place for good)."""
    import threading

    names = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    originals = {n: getattr(mu, n) for n in names}
    inputs = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    inside, leave, seen = threading.Barrier(3), [threading.Event(), threading.Event()], {}

    def trace(i):
        with hf_real_paths(inputs), FakeTensorMode():
            seen[i] = mu.find_packed_sequence_indices(torch.arange(8).unsqueeze(0)) is None
            inside.wait(30)
            leave[i].wait(30)

    threads = [threading.Thread(target=trace, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    inside.wait(30)
    with FakeTensorMode():  # this thread is not tracing: transformers' own answer ("maybe packed")
        assert mu.find_packed_sequence_indices(torch.arange(8).unsqueeze(0)) is not None
    leave[0].set()  # the first one in leaves first
    threads[0].join(30)
    leave[1].set()
    threads[1].join(30)
    assert seen == {0: True, 1: True}
    assert {n: getattr(mu, n) for n in names} == originals
