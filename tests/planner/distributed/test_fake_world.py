"""planner/distributed/fake_world.py: a many-rank job's rank in this one process."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from planner.distributed.fake_world import FakeWorldError, fake_process_group


def test_a_64_rank_mesh_of_rank_17_is_built_here_and_torn_down():
    with fake_process_group(world_size=64, rank=17):
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
        assert dist.get_world_size() == 64 and dist.get_rank() == 17
        assert mesh["dp"].get_local_rank() == 2 and mesh["tp"].get_local_rank() == 1
    assert not dist.is_initialized()


def test_a_live_default_group_is_not_replaced():
    with fake_process_group(world_size=2):
        with pytest.raises(FakeWorldError, match="exists already"):
            with fake_process_group(world_size=4):
                pass


@pytest.mark.parametrize("world_size, rank", [(0, 0), (2, 2), (2, -1), (True, 0)])
def test_bad_sizes_and_ranks(world_size, rank):
    with pytest.raises(ValueError):
        with fake_process_group(world_size=world_size, rank=rank):
            pass


def _sequence_parallel_forward() -> None:
    """A row-wise layer whose output is reduce-scattered over the ``tp`` dim of a 2 x 2 mesh."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layer = parallelize_module(nn.Linear(8, 8), mesh["tp"], RowwiseParallel(output_layouts=Shard(0)))
    layer(torch.ones(4, 4)).wait()


def test_worlds_one_after_another_do_not_reuse_the_last_world_s_groups():
    # DeviceMesh equality leaves out its process groups, so DTensor's sharding-propagation cache
    # would hand the second world an output spec over the first world's (destroyed) tp group.
    # The first world makes more groups first, so its tp group's name is not one the second has.
    for extra_groups in (3, 0):
        with fake_process_group(world_size=4, rank=0):
            for _ in range(extra_groups):
                dist.new_group(ranks=[0, 1])
            _sequence_parallel_forward()
