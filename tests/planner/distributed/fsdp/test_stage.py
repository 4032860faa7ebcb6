"""planner/distributed/fsdp/stage.py: a pipeline stage sharded by FSDP2 (torchtitan's units under
PP), read on the fake process group: FSDP2's padded sizes per rank, checked against the shapes
worked out by hand, and what the rules do not model refused."""

from __future__ import annotations

import math

import pytest
import torch

from estimators.runtime.device import get_device_spec
from examples.pipeline_stages import LlamaStage, llama_pipeline_model, shard_llama_stage
from planner import PlanningError
from planner.distributed.fake_world import fake_process_group
from planner.distributed.fsdp.stage import stage_fsdp


def _stage(first: bool, last: bool) -> LlamaStage:
    return LlamaStage.on_meta(llama_pipeline_model(n_layers=2).config, range(2), first=first, last=last)


def _by_hand(shapes, w: int, rank: int) -> tuple[int, int, int]:
    """(gathered, padded shard, AdamW state) bytes of float32 parameters of ``shapes`` on ``rank``
    of ``w``: dim 0 chunked into ceil(d0 / w) rows, the last ranks' chunks short or empty."""
    gathered = shard = state = 0
    for shape in shapes:
        rows, rest = -(-shape[0] // w), math.prod(shape[1:])
        mine = max(0, min(rows, shape[0] - rank * rows))
        gathered, shard = gathered + 4 * w * rows * rest, shard + 4 * rows * rest
        state += 2 * 4 * mine * rest + 4  # exp_avg, exp_avg_sq on the rank's rows, step (a float32 scalar)
    return gathered, shard, state


@pytest.mark.parametrize("rank", [0, 2])
def test_sizes_are_fsdp2s_padded_shards_on_each_rank(rank):
    """W = 3 does not divide the 64 rows of the attention and FFN weights: each pads to 22 rows
    (66 gathered), rank 2 holds 20 of them (its optimizer state is the smaller)."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(world_size=3, rank=rank):
        stage = shard_llama_stage(_stage(first=True, last=True), init_device_mesh("cpu", (3,)))
        fs = stage_fsdp(stage, "adamw", get_device_spec("cpu"))
    names = [u.modules for u in fs.units]
    # FSDP2's order: the root (no parameters of its own: no unit), then by module order
    assert names == [("LlamaStage.tok_embeddings",), ("LlamaStage.layers.0",), ("LlamaStage.layers.1",),
                     ("LlamaStage.norm", "LlamaStage.output")]
    plain = _stage(first=True, last=True)
    units = [[plain.tok_embeddings.weight], list(plain.layers["0"].parameters()),
             list(plain.layers["1"].parameters()), [plain.norm.weight, plain.output.weight]]
    state = 0
    for unit, params in zip(fs.units, units):
        gathered, shard, adam = _by_hand([p.shape for p in params], 3, rank)
        unpadded = sum(4 * p.numel() for p in params)
        assert (unit.gathered_bytes, unit.reduce_scatter_input_bytes, unit.reduce_scatter_output_bytes,
                unit.grad_bytes) == (gathered, gathered, shard, unpadded)
        state += adam
    assert fs.world_size == 3 and fs.optimizer_state_bytes == state
    assert fs.sharded_param_bytes == sum(u.reduce_scatter_output_bytes for u in fs.units)
    assert fs.full_numel == sum(p.numel() for p in plain.parameters())


def test_what_the_rules_do_not_model_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    spec = get_device_spec("cpu")
    assert stage_fsdp(_stage(first=False, last=False), "adamw", spec) is None  # not sharded
    with fake_process_group(world_size=2, rank=0):
        mesh = init_device_mesh("cpu", (2,))
        default = _stage(first=False, last=False)
        for layer in default.layers.values():
            fully_shard(layer, mesh=mesh)  # FSDP2's default: a non-root unit reshards after forward
        fully_shard(default, mesh=mesh)
        with pytest.raises(PlanningError, match="LlamaStage.layers.0 reshards after forward.*reshard_after_forward=False"):
            stage_fsdp(default, "adamw", spec)
        mixed = shard_llama_stage(_stage(first=False, last=False), mesh,
                                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        with pytest.raises(PlanningError, match="MixedPrecisionPolicy, which is not modelled"):
            stage_fsdp(mixed, "adamw", spec)
