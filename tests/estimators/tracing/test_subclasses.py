"""estimators/tracing/subclasses.py: what a rank's trace sees of DTensor (fake process group, one process)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from estimators.tracing.subclasses import (
    defers,
    fake_copy_of,
    in_sharding_propagation,
    local_tensor,
    mark_sharding_propagation,
    storage_of,
)
from planner.distributed.fake_world import fake_process_group


def test_only_wrapper_subclasses_defer():
    from torch._subclasses.fake_tensor import FakeTensor

    assert defers((DTensor,))
    assert defers((torch.Tensor, DTensor))
    assert not defers((torch.Tensor,))
    assert not defers((FakeTensor,))  # the trace's own mode's tensors
    assert not defers(())


def test_a_dtensor_s_storage_is_its_local_shard():
    with fake_process_group(world_size=2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        t = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
        assert tuple(t.shape) == (8, 6) and tuple(local_tensor(t).shape) == (4, 6)
        assert storage_of(t).nbytes() == 4 * 6 * 4
        assert storage_of(t).data_ptr() == t._local_tensor.untyped_storage().data_ptr()
        plain = torch.zeros(3)
        assert local_tensor(plain) is plain


def test_a_fake_copy_of_a_meta_dtensor_keeps_its_layout_and_gets_a_fake_cpu_shard():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with fake_process_group(world_size=4, rank=0):
        mesh = init_device_mesh("cpu", (4,))
        with torch.device("meta"):
            t = distribute_tensor(torch.empty(16, 8), mesh, [Shard(1)])
        mode = FakeTensorMode()

        def fake(inner):
            with mode:
                return torch.empty_strided(inner.shape, inner.stride(), dtype=inner.dtype, device="cpu")

        f = fake_copy_of(t, fake)
        assert isinstance(f, DTensor) and f.placements == (Shard(1),) and tuple(f.shape) == (16, 8)
        assert isinstance(f._local_tensor, FakeTensor) and f._local_tensor.device.type == "cpu"
        assert tuple(f._local_tensor.shape) == (16, 2)


def test_dtensor_metadata_ops_are_marked_and_the_local_ops_are_not():
    """A deferring mode sees the local op once and DTensor's fake global-shape op (on a sharding
    cache miss) only while in_sharding_propagation() is true."""
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if defers(types):
                return NotImplemented
            if func is torch.ops.aten.tanh.default:
                seen.append((tuple(args[0].shape), in_sharding_propagation()))
            return func(*args, **(kwargs or {}))

    mark_sharding_propagation()
    mark_sharding_propagation()  # idempotent
    with fake_process_group(world_size=2, rank=0):
        mesh = init_device_mesh("cpu", (2,))
        t = distribute_tensor(torch.randn(10, 3), mesh, [Shard(0)])
        with Spy():
            out = torch.tanh(t)
        assert out.placements == (Shard(0),)
        assert ((5, 3), False) in seen  # the rank's op, at its local shape
        assert all(shape == (10, 3) for shape, marked in seen if marked)  # DTensor's, global
        assert not in_sharding_propagation()
        r = distribute_tensor(torch.randn(4), mesh, [Replicate()])
        assert storage_of(r).nbytes() == 16
