"""How a spawned test rank ends once its results are written."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave_rank() -> None:
    """Destroy the process group, then ``os._exit(0)``.

    Why not a normal exit: once a process has run an op under ``FakeTensorMode`` while a gloo
    group is alive (planning does), the group's threads (``gloo_tcp_loop``, two
    ``pt_gloo_runloop``) outlive ``destroy_process_group()``; a ten-line script with
    ``with FakeTensorMode(): torch.randn(3)`` shows it, and without that op they are joined.
    They are then destroyed during interpreter finalization, where 1 run in 12-15 of
    test_distributed_bench.py aborted with "terminate called without an active exception"
    (SIGABRT; pytorch/pytorch#179291 describes that teardown). ``os._exit`` skips those
    destructors. Everything the test checks was written before this call, and an exception
    raised earlier still fails the rank."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, world_size: int, args: tuple = (), *, timeout_s: float = 120.0) -> None:
    """Spawn ``worker(rank, *args)`` on ``world_size`` processes and wait at most ``timeout_s``:
    a rank still running then is killed (SIGKILL, by the pid this call started) and the test
    fails, so no test waits for a hung collective."""
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout_s:.0f} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
