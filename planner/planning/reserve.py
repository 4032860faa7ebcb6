"""A budget's checks against the device, and the memory it holds back for what no trace sees."""

from __future__ import annotations

from estimators.runtime.device import DeviceSpec
from planner.errors import PlanningError
from planner.format import GiB

__all__ = ["default_reserve_bytes", "check_budget_on_device"]


def default_reserve_bytes(spec: DeviceSpec, budget_bytes: int) -> int:
    """CUDA: 1 GiB for the context and library workspaces + 5% of the budget for fragmentation.
    CPU: nothing (the host allocator has neither)."""
    return int(GiB + 0.05 * budget_bytes) if spec.is_cuda else 0


def check_budget_on_device(budget_bytes: int, spec: DeviceSpec, flag: str = "budget_gib") -> None:
    """A budget above a GPU target's memory plans for memory it does not have (``--budget-gib
    120`` for an 80 GiB H100 passed): refused. CPU targets have no fixed size: not checked."""
    if spec.is_cuda and budget_bytes > spec.memory_bytes:
        raise PlanningError(
            f"{flag} {budget_bytes / GiB:g} GiB is more than the {spec.name}'s {spec.memory_bytes / GiB:g} GiB: "
            f"the budget is one GPU's memory; pass at most {spec.memory_bytes / GiB:g}, or plan for a device "
            "with more (PlanOptions(device=...), --device)")
