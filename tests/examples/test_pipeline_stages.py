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


def test_a_stage_built_on_meta_is_the_split_models_stage_and_tensor_parallel_builds_shard_it():
    """``LlamaStage.on_meta`` has the split model's modules, parameter names, shapes and dtypes
    (one plan serves both); ``llama_stage_builder`` parallelizes a stage over the mesh's ``tp``
    dim (vocabulary-sharded embedding, sequence-sharded input on a later stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    from examples.pipeline_stages import LlamaStage, llama_stage_builder
    from planner.distributed.fake_world import fake_process_group
    from planner.plan import model_fingerprint

    model = llama_pipeline_model(n_layers=4)
    for s in range(2):
        meta = LlamaStage.on_meta(model.config, layer_ranges(4, 2)[s], first=s == 0, last=s == 1)
        assert model_fingerprint(meta) == model_fingerprint(llama_stage(model, s, 2))
    build = llama_stage_builder(model.config, n_stages=2, micro_batch=2)
    with fake_process_group(world_size=4, rank=0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        first, step0 = build(0, mesh)
        second, step1 = build(1, mesh)
    assert first.tok_embeddings.weight.to_local().shape == (128, 64) and step0.context is not None
    assert step0.inputs.shape == (2, 32) and step1.inputs.shape == (2, 16, 64) and step1.target.shape == (2, 32)
