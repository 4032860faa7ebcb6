"""``PlanOptions``: every planning setting in one frozen, keyword-only dataclass.

    plan = solve_sac(model, budget_gib=40, step=TrainStep(inputs=batch, optimizer="adamw"),
                     options=PlanOptions(device="h100", world_size=8, fsdp_units=units))

The step (what the loop runs) is a ``TrainStep``; how to plan it is a ``PlanOptions``. Both are
values: build one, ``dataclasses.replace`` it, pass it to every entry point.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from estimators.runtime.device import DeviceSpec, get_device_spec
from estimators.tracing.estimation import DEFAULT_DEVICE, EstimateOptions
from planner.errors import PlanningError
from planner.format import check_budget_gib
from solver import SolverOptions

__all__ = ["PlanOptions"]


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How a step is planned: the target device, the memory held back, the parallel layout, what
    may be checkpointed or offloaded, and how the trace and the solver run. Every field has a
    default that plans a single process on the default device."""

    device: str | DeviceSpec = DEFAULT_DEVICE
    """The target: a name (``"h100"``, ``"a100"``, ``"cpu"``, ...; ``estimators.runtime.device``)
    or a ``DeviceSpec``. It prices ops (roofline) and sets the memory semantics (CUDA's
    allocator rounding and kernels on a CUDA target). Planning never needs the device itself."""

    reserve_gib: float | None = None
    """GiB of the budget held back for what the trace does not see. None: the device's default
    (CUDA: 1 GiB for the context and library workspaces + 5 % of the budget for fragmentation;
    CPU: nothing). 0 plans the budget as given."""

    ac_units: tuple[str, ...] | None = None
    """The modules a plan may checkpoint (names as in the plan: ``"GPT.blocks.0"``). None: every
    module the planner can checkpoint safely."""

    world_size: int = 1
    """Ranks the parameters, gradients and optimizer state are sharded over. With
    ``fsdp_units`` the FSDP2 buffers are counted per rank too; without, the state is divided by
    ``world_size`` (ZeRO-style) and nothing else is added."""

    fsdp_units: tuple[str, ...] | None = None
    """The modules you will ``fully_shard`` (root included), e.g. ``("GPT", "GPT.blocks.0", ...)``:
    FSDP2's gathered parameters, prefetch and reduce-scatter buffers are added per rank
    (``planner.distributed.fsdp``). None: no FSDP2."""

    offload: bool = False
    """Also consider host memory for the saved activations of repeated blocks: the plan of least
    predicted step time, with copies on their own stream (``planner.planning.offload_solve``)."""

    host_budget_gib: float | None = None
    """With ``offload``: at most this many GiB of host memory per rank. None: no limit."""

    verify: bool = True
    """Trace the planned model and keep tightening until its traced peak fits (single process).
    False trusts the solver's figure."""

    solver: SolverOptions = field(default_factory=SolverOptions)
    """How the MILP is solved (``solver.SolverOptions``: time limit, optimality gap, backend)."""

    trace: EstimateOptions = field(default_factory=EstimateOptions)
    """How the step is traced (``EstimateOptions``: fake or real mode, roofline or benchmarked
    runtimes, progress logging)."""

    def __post_init__(self) -> None:
        for name in ("ac_units", "fsdp_units"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)):
                raise PlanningError(f"{name} must be a list of module names, e.g. [{value!r}], not the string {value!r}")
            names = tuple(value)
            if not all(isinstance(n, str) for n in names):
                raise PlanningError(f"{name} must hold module names (str), got {names!r}")
            object.__setattr__(self, name, names)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise PlanningError(f"world_size must be an int >= 1, got {self.world_size!r}")
        for name in ("offload", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.reserve_gib is not None:
            ok = isinstance(self.reserve_gib, numbers.Real) and not isinstance(self.reserve_gib, bool)
            if not ok or not math.isfinite(self.reserve_gib) or self.reserve_gib < 0:
                raise PlanningError(
                    f"reserve_gib must be a number of GiB from 0 up to below the budget, got "
                    f"{self.reserve_gib!r}; it is held back for the CUDA context and fragmentation "
                    "(None: the default for the device, 0: plan the budget as given)")
        if self.host_budget_gib is not None and not self.offload:
            raise PlanningError("host_budget_gib only applies with offload=True (host memory for offloaded "
                                "activations); pass offload=True or drop it")
        if self.host_budget_gib is not None:
            check_budget_gib(self.host_budget_gib, "host_budget_gib",
                             "; pass None for no host limit, or offload=False to keep everything on the device")
        if not isinstance(self.solver, SolverOptions):
            raise TypeError(f"solver must be a solver.SolverOptions, got {type(self.solver).__name__}")
        if not isinstance(self.trace, EstimateOptions):
            raise TypeError(f"trace must be an EstimateOptions, got {type(self.trace).__name__}")
        if not isinstance(self.device, (str, DeviceSpec)):
            raise TypeError(f"device must be a device name or a DeviceSpec, got {type(self.device).__name__}")
        get_device_spec(self.device)  # an unknown name fails here, listing the known ones

    @property
    def spec(self) -> DeviceSpec:
        """The target's ``DeviceSpec`` (an unknown name raises ``UnknownDeviceError`` listing the
        known ones)."""
        return get_device_spec(self.device)

    def replace(self, **changes: Any) -> "PlanOptions":
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

