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

__all__ = ["PlanOptions", "Pipeline"]


@dataclass(frozen=True)
class Pipeline:
    """The pipeline a stage runs in (``torch.distributed.pipelining``), in one line::

        Pipeline(Schedule1F1B, n_microbatches=8, stage_index=1, n_stages=4)
        Pipeline(ScheduleInterleaved1F1B, n_microbatches=8, stage_index=1, n_stages=8, virtual_stages=2)

    The stage's plan is made for its schedule: how many micro-batches it holds at once, the
    schedule's receive buffers and held tensors, the split backward of zero-bubble schedules.
    Stage ``s`` runs on rank ``s % (n_stages // virtual_stages)`` (torch's loop layout)."""

    schedule: Any
    """The schedule: a class (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``,
    ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``) or a built schedule object."""
    n_microbatches: int = field(default=1, kw_only=True)
    """Micro-batches per step (``n_microbatches`` of the schedule), at most 4,096; at most 65,536
    over all stages (``n_stages * n_microbatches``). Real runs use tens to low hundreds; the
    bounds and why: ``estimators.pipeline.schedule.MAX_MICROBATCHES``."""
    stage_index: int = field(default=0, kw_only=True)
    """The stage to plan (for a rank of several stages: any of them; all are planned together)."""
    n_stages: int = field(default=1, kw_only=True)
    """Stages in the pipeline, over all ranks."""
    virtual_stages: int = field(default=1, kw_only=True)
    """Stages per rank (2 for the interleaved and zero-bubble schedules' usual layout)."""
    return_outputs: bool = field(default=True, kw_only=True)
    """``schedule.step(..., return_outputs=...)``, torch's default True: the last stage keeps
    every micro-batch's output until the next step."""

    def __post_init__(self) -> None:
        for name in ("n_microbatches", "n_stages", "virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanningError(f"Pipeline.{name} must be an int >= 1, got {v!r}")
        s = self.stage_index
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.n_stages:
            raise PlanningError(f"Pipeline.stage_index must be an int in [0, n_stages={self.n_stages}), got {s!r}")
        if not isinstance(self.return_outputs, bool):
            raise TypeError(f"Pipeline.return_outputs must be True or False, got {self.return_outputs!r}")
        from estimators.pipeline.schedule import ScheduleError

        try:
            self.layout
        except ScheduleError as e:
            raise PlanningError(str(e)) from None

    @property
    def layout(self):
        """The schedule's ``estimators.pipeline.schedule.ScheduleLayout``."""
        from estimators.pipeline.schedule import ScheduleLayout

        return ScheduleLayout.of(self.schedule, n_microbatches=self.n_microbatches, n_stages=self.n_stages,
                                 virtual_stages=self.virtual_stages)


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

    pipeline: Pipeline | None = None
    """The model is a pipeline stage (``Pipeline``): planned for its schedule, on its rank.
    None: not pipelined."""

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
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise TypeError(f"pipeline must be a planner.options.Pipeline, got {type(self.pipeline).__name__}")
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

