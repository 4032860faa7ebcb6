"""The parallel layout a plan is made for, recorded in the plan file and checked when it is applied.

A rank's peak depends on what it holds: the tensor-parallel placements of the parameters (their
mesh and ``Shard`` / ``Replicate`` placements: the local shard shapes every trace figure is made
of) and FSDP2's sharding (the units and the group size). :class:`LayoutRecord` is that layout as
plain data; ``apply_plan`` refuses a plan whose layout is not the model's
(:func:`layout_mismatch`), since its per-rank peaks would not hold.

The model's own DTensors say what the layout is: parallelize the model as the job trains it (with
the job's mesh shape, in this process or on torch's fake process group, see
``planner.distributed.fake_world``) and plan it. A model already sharded with ``fully_shard``
gives its FSDP2 units and group size too (:func:`fsdp_options`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from estimators.tracing.sharded_model import fsdp_layout, unsharded_parts
from planner.errors import PlanFormatError, PlanningError
from planner.plan_fields import MAX_COUNT, MAX_MODULES, MAX_OPS, check_int, check_str, short

MAX_MESHES = 64
"""Device meshes of one model's DTensor parameters (a model has one or two)."""

__all__ = ["LayoutRecord", "layout_of", "plan_layout", "layout_mismatch", "fsdp_options", "has_dtensors",
           "check_parallel_support"]


@dataclass(frozen=True, kw_only=True)
class LayoutRecord:
    """What each rank holds, as a plan records it."""

    meshes: tuple[str, ...] = ()
    """The device meshes of the DTensor parameters before FSDP2 (``"tp=8"``, ``"(2, 4)"``); empty:
    no tensor parallelism."""
    placements: str = ""
    """sha256 (16 hex digits) of every DTensor parameter's name, mesh and placements; empty: none."""
    dtensor_parameters: int = 0
    """How many parameters are DTensors (before FSDP2)."""
    fsdp_world_size: int = 1
    """Ranks FSDP2 shards each parameter over (1: no FSDP2)."""
    fsdp_units: tuple[str, ...] = ()
    """The modules ``fully_shard`` is (or will be) called on."""

    def __post_init__(self) -> None:
        # Bounded as every field of a plan file (planner.plan_fields): the file may come from anywhere.
        for name, most in (("meshes", MAX_MESHES), ("fsdp_units", MAX_MODULES)):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
                    not all(isinstance(v, str) for v in value):
                raise PlanFormatError(f"layout: {name} must be a list of strings, got {short(value)}")
            if len(value) > most:
                raise PlanFormatError(f"layout: {name} lists {len(value):,} entries, more than the {most:,} a plan takes")
            for v in value:
                check_str(f"layout.{name}[]", v, nonempty=True)
            if len(set(value)) != len(value):
                raise PlanFormatError(f"layout: {name} lists an entry twice")
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.placements, str) or not re.fullmatch(r"([0-9a-f]{16})?", self.placements):
            raise PlanFormatError(f"layout: placements must be 16 hex digits or empty, got {short(self.placements)}")
        check_int("layout.dtensor_parameters", self.dtensor_parameters, high=MAX_OPS)
        check_int("layout.fsdp_world_size", self.fsdp_world_size, low=1, high=MAX_COUNT)
        if bool(self.meshes) != bool(self.placements) or bool(self.placements) != (self.dtensor_parameters > 0):
            raise PlanFormatError("layout: meshes, placements and dtensor_parameters must be all set (tensor "
                                  "parallel) or all empty")

    @property
    def parallel(self) -> bool:
        """Anything but a single process's layout."""
        return bool(self.meshes) or self.fsdp_world_size > 1

    def describe(self) -> str:
        """One line: ``tensor parallel over tp=8 (560 DTensor parameters), FSDP2 over 8 ranks (81 units)``."""
        parts = []
        if self.meshes:
            parts.append(f"tensor parallel over {', '.join(self.meshes)} ({self.dtensor_parameters} DTensor parameters)")
        if self.fsdp_world_size > 1:
            parts.append(f"FSDP2 over {self.fsdp_world_size} ranks ({len(self.fsdp_units)} units)")
        return ", ".join(parts) or "one process, no parallel layout"


def _mesh_name(mesh: Any) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    shape = tuple(int(n) for n in mesh.shape)
    if names:
        return ", ".join(f"{n}={s}" for n, s in zip(names, shape))
    return str(shape)


def _tp_lines(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """(parameter name, mesh, placements) of every DTensor parameter as it was before FSDP2."""
    from torch.distributed.tensor import DTensor

    pre_shard, _, _ = unsharded_parts(model)
    out = []
    for name, p in model.named_parameters():
        pre = pre_shard.get(id(p))
        if pre is not None:  # sharded by fully_shard: its layout before
            if pre.spec is not None:
                out.append((name, _mesh_name(pre.spec.mesh), repr(tuple(pre.spec.placements))))
        elif isinstance(p, DTensor):
            out.append((name, _mesh_name(p.device_mesh), repr(tuple(p.placements))))
    return out


def layout_of(model: torch.nn.Module, fsdp_units: Iterable[str] | None = None, world_size: int = 1) -> LayoutRecord:
    """The layout of ``model`` with FSDP2 over ``fsdp_units`` and ``world_size`` ranks (or as
    ``fully_shard`` sharded it already)."""
    lines = _tp_lines(model) if "torch.distributed.tensor" in __import__("sys").modules else []
    sharded = fsdp_layout(model)
    if sharded is not None:
        units, size = sharded.units, sharded.shard_world_size
    else:
        units, size = tuple(fsdp_units or ()), world_size if fsdp_units is not None else 1
    digest = hashlib.sha256("\n".join(f"{n} {m} {p}" for n, m, p in sorted(lines)).encode()).hexdigest()[:16]
    return LayoutRecord(meshes=tuple(sorted({m for _, m, _ in lines})), placements=digest if lines else "",
                        dtensor_parameters=len(lines), fsdp_world_size=size, fsdp_units=tuple(units))


def plan_layout(model: torch.nn.Module, fsdp_units: Iterable[str] | None, world_size: int) -> LayoutRecord | None:
    """The layout a plan records: :func:`layout_of`, None for a single process's (plan files of
    single-process plans stay as they were)."""
    record = layout_of(model, fsdp_units, world_size)
    return record if record.parallel else None


def layout_mismatch(planned: LayoutRecord | None, model: torch.nn.Module) -> str | None:
    """Why a plan made for ``planned`` cannot run on ``model``, or None. The FSDP2 part is checked
    only on a model already sharded (torchtitan's order applies the plan before ``fully_shard``)."""
    now = layout_of(model)
    planned = planned or LayoutRecord()
    if (planned.meshes, planned.placements) != (now.meshes, now.placements):
        return (f"the plan was made for {planned.describe()}, the model has {now.describe()}"
                + (" (same meshes, other placements)" if planned.meshes == now.meshes else ""))
    if now.fsdp_world_size > 1 and (now.fsdp_world_size, now.fsdp_units) != (planned.fsdp_world_size, planned.fsdp_units):
        return (f"the model is sharded with FSDP2 over {now.fsdp_world_size} ranks ({len(now.fsdp_units)} units), "
                f"the plan was made for {planned.describe()}")
    return None


def fsdp_options(model: torch.nn.Module, fsdp_units: Iterable[str] | None, world_size: int
                 ) -> tuple[tuple[str, ...] | None, int]:
    """The FSDP2 units and group size to plan ``model`` with: the options' for a model not yet
    sharded; the model's own for one ``fully_shard`` sharded (options that say otherwise are
    refused). Raises :class:`PlanningError` for precisions or layouts the FSDP rules do not model."""
    sharded = fsdp_layout(model)
    if sharded is None:
        return (None if fsdp_units is None else tuple(fsdp_units)), world_size
    if fsdp_units is not None and tuple(fsdp_units) != sharded.units:
        raise PlanningError(f"fsdp_units {list(fsdp_units)} are not the units fully_shard sharded "
                            f"{list(sharded.units)}; drop fsdp_units (they are read from the model)")
    if world_size not in (1, sharded.shard_world_size):
        raise PlanningError(f"world_size={world_size} but the model is sharded over {sharded.shard_world_size} "
                            "ranks; drop world_size (it is read from the model)")
    if sharded.param_dtype is not None or sharded.reduce_dtype is not None:
        raise PlanningError("the model is sharded with an FSDP2 MixedPrecisionPolicy, which solve_sac does not "
                            "plan yet (planner.distributed.fsdp.fsdp_module_info(mp_policy=...) counts it); "
                            "plan the model before fully_shard with autocast in the TrainStep instead")
    # HSDP: a rank holds what FSDP2 over its shard group holds (the replicas all-reduce the
    # reduce-scattered gradients in place).
    return sharded.units, sharded.shard_world_size


def has_dtensors(model: torch.nn.Module) -> bool:
    """``model`` holds DTensor parameters (or FSDP2 shards of them)."""
    if "torch.distributed.tensor" not in __import__("sys").modules:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_parallel_support(model: torch.nn.Module, options: Any, *, traced_on_one_rank: bool = False) -> None:
    """Raise :class:`PlanningError` naming what cannot be planned for ``model``'s layout yet,
    before any trace (never a figure for the global shapes). ``traced_on_one_rank``: only rank 0
    traces the planned steps it verifies (``solve_sac_distributed``)."""
    if not has_dtensors(model):
        return
    if getattr(options, "offload", False):
        raise PlanningError(
            "offload=True is not planned for a tensor-parallel (DTensor) model yet: host copies of its "
            "activations are not implemented; plan it with offload=False (recompute only)")
    mode = getattr(getattr(options, "trace", None), "mode", None)
    if traced_on_one_rank and getattr(mode, "value", mode) == "real":
        raise PlanningError(
            "a real-mode trace of a tensor-parallel model runs its collectives, and solve_sac_distributed "
            "traces the plans it verifies on rank 0 alone (the other ranks would never join them): trace in "
            "fake mode (the default), or call solve_sac on every rank")
