"""FSDP2's collective time per training step: one all-gather per unit in forward, one more in
backward for non-root units, one reduce-scatter; priced by a collective time model.

    est = fsdp_comm_ms(info, ["GPT", "GPT.blocks.0"], 8, AnalyticCollectiveModel.from_device("h100"))
    est.all_gather_ms, est.reduce_scatter_ms, est.note()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from estimators.runtime.collectives import Collective
from estimators.contract.module_info import ModuleInfo
from planner.distributed.fsdp.units import Unit, check_world_size, unit_table

__all__ = ["CollectiveTimeModel", "FsdpUnitComm", "FsdpCommEstimate", "fsdp_comm_ms",
           "RECOMPUTE_EXTRA_ALL_GATHER_REASON"]


class CollectiveTimeModel(Protocol):
    """What :func:`fsdp_comm_ms` needs: :class:`estimators.runtime.collectives.AnalyticCollectiveModel`,
    from a link (``from_device``) or fitted to a CollectiveBenchmark (``fit(bench.points())``)."""

    name: str

    def time_ms(self, collective: Collective, message_bytes: int, group_size: int) -> float: ...


RECOMPUTE_EXTRA_ALL_GATHER_REASON = (
    "the planner never checkpoints a module above an FSDP unit, and a checkpointed module inside "
    "a unit recomputes during that unit's backward, after FSDP2's pre-backward all-gather: its "
    "parameters are already gathered, so the recompute issues no extra all-gather"
)


@dataclass(frozen=True, kw_only=True)
class FsdpUnitComm:
    """Collective time of one FSDP unit per training step (one rank, ms)."""

    fqn: str
    all_gather_bytes: int
    """Whole gathered buffer: the unit's own parameter bytes (padding not counted)."""
    all_gathers: int
    """All-gathers per step: 1 (forward) + 1 when resharded after forward (non-root units)."""
    all_gather_ms: float
    """Time of all of them."""
    reduce_scatter_bytes: int
    """Whole reduced buffer: the unit's own gradient bytes."""
    reduce_scatter_ms: float

    @property
    def total_ms(self) -> float:
        return self.all_gather_ms + self.reduce_scatter_ms


@dataclass(frozen=True, kw_only=True)
class FsdpCommEstimate:
    """FSDP2's all-gather / reduce-scatter time per step, by unit (see :func:`fsdp_comm_ms`)."""

    units: tuple[FsdpUnitComm, ...]
    world_size: int
    model_name: str
    """The collective model's label, e.g. ``"analytic:nvlink4"``."""
    recompute_extra_all_gather_ms: float = 0.0
    """Extra all-gathers the plan's recomputation causes: none, see ``recompute_extra_reason``."""
    recompute_extra_reason: str = RECOMPUTE_EXTRA_ALL_GATHER_REASON

    @property
    def all_gather_ms(self) -> float:
        return sum(u.all_gather_ms for u in self.units)

    @property
    def reduce_scatter_ms(self) -> float:
        return sum(u.reduce_scatter_ms for u in self.units)

    @property
    def total_ms(self) -> float:
        return self.all_gather_ms + self.reduce_scatter_ms + self.recompute_extra_all_gather_ms

    def note(self) -> str:
        """One line for a plan's notes."""
        return (
            f"FSDP collectives: all-gather {self.all_gather_ms:.3f} ms, reduce-scatter "
            f"{self.reduce_scatter_ms:.3f} ms per step over {self.world_size} ranks "
            f"({self.model_name}; not overlapped with compute, recompute adds no all-gather)"
        )


def _collective_ms(model: CollectiveTimeModel, collective: Collective, nbytes: int, world_size: int) -> float:
    """One collective's time; an empty buffer issues no collective (FSDP2 skips empty groups)."""
    return model.time_ms(collective, nbytes, world_size) if nbytes > 0 else 0.0


def _unit_comm(unit: Unit, model: CollectiveTimeModel, world_size: int) -> FsdpUnitComm:
    # FSDP2 reshards non-root units after forward (R2: the root stays gathered), so their
    # pre-backward all-gathers the parameters again.
    count = 1 if unit.is_root else 2
    return FsdpUnitComm(
        fqn=unit.fqn,
        all_gather_bytes=unit.own_param_bytes,
        all_gathers=count,
        all_gather_ms=count * _collective_ms(model, Collective.ALL_GATHER, unit.own_param_bytes, world_size),
        reduce_scatter_bytes=unit.own_grad_bytes,
        reduce_scatter_ms=_collective_ms(model, Collective.REDUCE_SCATTER, unit.own_grad_bytes, world_size),
    )


def fsdp_comm_ms(
    info: ModuleInfo, fsdp_units: Iterable[str], world_size: int, model: CollectiveTimeModel
) -> FsdpCommEstimate:
    """All-gather and reduce-scatter time per step of each FSDP unit, with FSDP2's defaults.

    Per unit (its *own* parameters / gradients, see ``planner/distributed/fsdp/units.py``): one all-gather of its
    parameter bytes in forward, one more in backward for non-root units (resharded after
    forward; the root is not), one reduce-scatter of its gradient bytes. A unit with no own
    bytes issues none. Times come from ``model`` (``AnalyticCollectiveModel.from_device(spec)``
    or ``.fit(CollectiveBenchmark(...).points())``); overlap with compute is not modelled.
    The plan's recompute adds no all-gather (:data:`RECOMPUTE_EXTRA_ALL_GATHER_REASON`).

    >>> est = fsdp_comm_ms(info, ["GPT", "GPT.blocks.0"], 8, AnalyticCollectiveModel.from_device("h100"))  # doctest: +SKIP
    >>> est.all_gather_ms, est.reduce_scatter_ms                                                          # doctest: +SKIP
    """
    world_size = check_world_size(world_size)
    units = unit_table(info, fsdp_units)
    return FsdpCommEstimate(
        units=tuple(_unit_comm(u, model, world_size) for u in units.values()),
        world_size=world_size,
        model_name=model.name,
    )
