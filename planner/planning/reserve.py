"""The memory a budget holds back for what no trace sees."""

from __future__ import annotations

from estimators.runtime.device import DeviceSpec
from planner.format import GiB

__all__ = ["default_reserve_bytes"]


def default_reserve_bytes(spec: DeviceSpec, budget_bytes: int) -> int:
    """CUDA: 1 GiB for the context and library workspaces + 5% of the budget for fragmentation.
    CPU: nothing (the host allocator has neither)."""
    return int(GiB + 0.05 * budget_bytes) if spec.is_cuda else 0
