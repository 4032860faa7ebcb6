"""examples/pipeline_stages.py: stages run in sequence are the unsplit model."""

import pytest
import torch

from examples.pipeline_stages import (hf_decoder_stage, layer_ranges, llama_pipeline_model, llama_stage,
                                      qwen2_pipeline_model)


def test_layer_ranges_are_contiguous_and_even():
    assert layer_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    with pytest.raises(ValueError, match="need 1 to 8"):
        layer_ranges(8, 9)


def test_llama_stages_in_sequence_give_the_models_logits_bitwise():
    model = llama_pipeline_model()
    x = torch.randint(0, 256, (2, 32))
    h = x
    for s in range(4):
        h = llama_stage(model, s, 4)(h)
    assert torch.equal(h, model(x))
    assert "layers.2.attention.wq.weight" in dict(llama_stage(model, 1, 4).named_parameters())


@pytest.mark.hf
def test_hf_decoder_stages_in_sequence_give_the_models_logits_bitwise():
    model = qwen2_pipeline_model()
    x = torch.randint(0, 256, (2, 32))
    h = x
    for s in range(4):
        h = hf_decoder_stage(model, s, 4)(h)
    assert torch.equal(h, model(input_ids=x).logits)
