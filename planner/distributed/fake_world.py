"""Plan a many-rank job in one process: torch's fake process group as the default group.

    with fake_process_group(world_size=64, rank=0):
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = build_model()
        parallelize(model, mesh)                  # the same function the job trains with
        plan = solve_sac(model, 70, step, options=options)

Inside, DeviceMesh, DTensor, the tensor-parallel styles, ``loss_parallel`` and FSDP2 run as rank
``rank`` of ``world_size`` would: every collective is answered locally and moves no data
(``FakeProcessGroup``), so a trace sees the rank's local shard shapes and the collectives it
issues, with no other process. The mesh is built for the device type ``"cpu"`` (the fake group
registers for it); that is the host the trace runs on, not the target device of the plan.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

__all__ = ["fake_process_group", "FakeWorldError"]


class FakeWorldError(RuntimeError):
    """A fake process group cannot be set up here; the message says why."""


def _check(world_size: int, rank: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group is a fake one of ``world_size`` ranks, this process being
    ``rank``, until the block ends (then it is destroyed). Raises :class:`FakeWorldError` when a
    default group exists already (a live job: plan with it instead, every rank the same)."""
    _check(world_size, rank)
    if not dist.is_available():
        raise FakeWorldError("this torch build has no torch.distributed; a parallel layout cannot be planned")
    if dist.is_initialized():
        raise FakeWorldError(
            "a default process group exists already (backend "
            f"{dist.get_backend()!r}, {dist.get_world_size()} ranks): plan in that job (every rank "
            "traces its own program), or call this before init_process_group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches. A DeviceMesh compares equal to another of the
    same ranks and dim names whatever its process groups, so a cached output spec of one world
    would give the next world's DTensors a mesh over groups destroyed with the first (a collective
    then fails: "Could not resolve the process group registered under the name ...")."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # the cache is torch's own detail: without this hook, nothing to clear
        return
    _clear_sharding_prop_cache()
