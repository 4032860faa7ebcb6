"""planner/distributed/fsdp/model.py: unit names and the class name of a really sharded model (one gloo rank);
the plan fingerprint does not change under fully_shard."""

from __future__ import annotations

import pytest

from planner.distributed.fsdp.model import fsdp_units_of, original_class_name
from planner.plan import model_fingerprint


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_units_and_fingerprint_of_a_sharded_model(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    from examples import EXAMPLES

    model, _ = EXAMPLES["gpt_tiny"]()
    before = model_fingerprint(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert fsdp_units_of(model) == []
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert type(model).__name__ == "FSDPGPT" and original_class_name(model) == "GPT"
    assert fsdp_units_of(model) == ["GPT", "GPT.blocks.0", "GPT.blocks.1"]
    # DTensor parameters report the global shape, so the fingerprint does not change.
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    assert type(next(model.parameters())).__name__ == "DTensor"
    assert model_fingerprint(model) == before
