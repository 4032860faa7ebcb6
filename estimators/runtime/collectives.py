"""Collective runtimes: an analytic ring model on a link, or timings measured in a process group.

Two ways to price an all-gather / reduce-scatter / all-reduce / broadcast of ``message_bytes``
over ``group_size`` ranks:

* :class:`AnalyticCollectiveModel`: ``latency_s + factor(n) * message_bytes / bandwidth`` per
  collective, with parameters from an :class:`~estimators.runtime.device.Interconnect` (datasheet) or
  fitted to measured points (:meth:`AnalyticCollectiveModel.fit`). No process group needed.
* ``estimators.runtime.collective_bench.CollectiveBenchmark``: runs the collective in an initialised
  ``torch.distributed`` group (gloo on CPU, nccl on GPU) and caches the median time; its points
  fit this model.

``message_bytes`` is always the size of the whole buffer, never a shard:

* all_gather: the gathered (output) buffer, ``group_size`` times one rank's shard;
* reduce_scatter: the (input) buffer that is reduced, ``group_size`` times one rank's output;
* all_reduce and broadcast: the buffer itself;
* all_to_all: one rank's input buffer (it keeps ``1 / n`` of it and sends the rest).

Ring factors (bytes each rank sends, as a fraction of ``message_bytes``), n = ``group_size``:
all_gather, reduce_scatter and all_to_all ``(n - 1) / n``, all_reduce ``2 (n - 1) / n`` (a reduce-scatter then
an all-gather), broadcast 1 (a pipelined ring: every rank receives the buffer once). A group of one
costs 0. The latency is one fixed cost per collective: it does not grow with n (a fit at one group
size absorbs the ring's per-step latency into it). Not modelled: tree algorithms, protocol switches
with message size, contention with compute, multi-node topologies (one link for all ranks).

Example::

    model = AnalyticCollectiveModel.from_device("h100")
    model.time_ms(Collective.ALL_GATHER, message_bytes=2**30, group_size=8)   # ~2.1 ms on NVLink4
"""

from __future__ import annotations

import enum
import logging
import math
import types
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from estimators.runtime.device import DeviceSpec, Interconnect, get_device_spec, get_interconnect

__all__ = [
    "Collective",
    "CollectiveCost",
    "CollectivePoint",
    "AnalyticCollectiveModel",
    "CollectiveFitError",
    "ring_factor",
    "bucket_bytes",
]

logger = logging.getLogger(__name__)


class Collective(enum.Enum):
    """The collectives FSDP-style and tensor / context parallel training issue."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"


def ring_factor(collective: Collective, group_size: int) -> float:
    """Bytes each rank moves, as a multiple of ``message_bytes`` (ring algorithms).

    >>> ring_factor(Collective.ALL_REDUCE, 8)
    1.75
    """
    check_collective(collective)
    check_group_size(group_size)
    n = group_size
    if n == 1:
        return 0.0
    if collective is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n
    if collective is Collective.BROADCAST:
        return 1.0
    return (n - 1) / n


def bucket_bytes(message_bytes: int) -> int:
    """``message_bytes`` rounded up to a power of two (at least 1): the benchmark cache's key.

    >>> bucket_bytes(1000), bucket_bytes(1024), bucket_bytes(1025)
    (1024, 1024, 2048)
    """
    check_message_bytes(message_bytes)
    return 1 if message_bytes <= 1 else 1 << (message_bytes - 1).bit_length()


# ----------------------------------------------------------------------------- analytic model


class CollectiveFitError(ValueError):
    """Benchmark points that cannot determine a latency and a bandwidth."""


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """Latency and bandwidth of one collective: ``latency_s + factor * bytes / bandwidth``.

    Example::

        CollectiveCost(latency_s=5e-6, bandwidth_bytes_per_s=100e9)
    """

    latency_s: float
    """Fixed cost per collective, seconds."""
    bandwidth_bytes_per_s: float
    """Bytes per second one rank moves; ``math.inf`` when a fit found no size dependence."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(
                f"CollectiveCost.latency_s must be finite and >= 0, got {self.latency_s}"
            )
        if not self.bandwidth_bytes_per_s > 0:  # also rejects NaN
            raise ValueError(
                "CollectiveCost.bandwidth_bytes_per_s must be > 0, "
                f"got {self.bandwidth_bytes_per_s}"
            )

    @classmethod
    def of_link(cls, link: Interconnect) -> "CollectiveCost":
        return cls(latency_s=link.latency_s, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s)


@dataclass(frozen=True, kw_only=True)
class CollectivePoint:
    """One measured (or synthetic) collective time: what :meth:`AnalyticCollectiveModel.fit` takes.

    Example::

        CollectivePoint(collective=Collective.ALL_REDUCE, message_bytes=2**20, group_size=2,
                        runtime_ms=0.41)
    """

    collective: Collective
    message_bytes: int
    """Whole-buffer size, as defined in the module docstring."""
    group_size: int
    """Ranks in the group (>= 2 for a fit: a group of one moves nothing)."""
    runtime_ms: float
    """Measured time of one collective."""

    def __post_init__(self) -> None:
        check_collective(self.collective)
        check_message_bytes(self.message_bytes)
        check_group_size(self.group_size)
        if not (math.isfinite(self.runtime_ms) and self.runtime_ms >= 0):
            raise ValueError(
                f"CollectivePoint.runtime_ms must be finite and >= 0, got {self.runtime_ms}"
            )


@dataclass(frozen=True, kw_only=True)
class AnalyticCollectiveModel:
    """Per collective, ``time = latency_s + ring_factor(collective, n) * message_bytes / bw``.

    Build it from a link (:meth:`from_interconnect`, :meth:`from_device`: every collective shares
    the link's numbers) or fit it to benchmark points (:meth:`fit`: one cost per collective).

    Example::

        link = Interconnect(name="test", bandwidth_bytes_per_s=100e9, latency_s=5e-6)
        model = AnalyticCollectiveModel.from_interconnect(link)
        model.time_ms(Collective.ALL_GATHER, 2**30, 8)   # 0.005 + 7/8 * 2**30 / 1e8 = 9.40024096
    """

    costs: Mapping[Collective, CollectiveCost]
    """Latency and bandwidth of each collective the model prices."""
    name: str = "analytic"
    """Label recorded with estimates, e.g. ``"analytic:nvlink4"``."""

    def __post_init__(self) -> None:
        for collective, cost in self.costs.items():
            check_collective(collective)
            if not isinstance(cost, CollectiveCost):
                raise ValueError(f"costs[{collective}] must be a CollectiveCost, got {cost!r}")
        if not self.costs:
            raise ValueError("AnalyticCollectiveModel needs the cost of at least one collective")
        # Read-only copy: the frozen model must not change under a caller's dict.
        object.__setattr__(self, "costs", types.MappingProxyType(dict(self.costs)))

    @classmethod
    def from_interconnect(cls, link: Interconnect | str) -> "AnalyticCollectiveModel":
        """Every collective on one link's latency and bandwidth."""
        link = get_interconnect(link)
        cost = CollectiveCost.of_link(link)
        return cls(costs={c: cost for c in Collective}, name=f"analytic:{link.name}")

    @classmethod
    def from_device(cls, device: DeviceSpec | str) -> "AnalyticCollectiveModel":
        """The model of ``device``'s default link (:attr:`DeviceSpec.collective_link`)."""
        spec = get_device_spec(device)
        link = spec.collective_link
        if link is None:
            raise ValueError(
                f"device {spec.name!r} names no interconnect; pass "
                "spec.replace(interconnect=get_interconnect('nvlink4')) or use "
                "AnalyticCollectiveModel.from_interconnect(...)"
            )
        return cls.from_interconnect(link)

    @classmethod
    def fit(
        cls, points: Iterable[CollectivePoint], *, relative_error: bool = True
    ) -> "AnalyticCollectiveModel":
        """Least-squares latency and bandwidth of each collective that has points (both >= 0).

        Args:
            points: at least two distinct ``ring_factor * message_bytes`` per collective, from
                groups of two or more ranks.
            relative_error: minimise squared relative errors (each point weighted by 1 / its
                time), so small messages' latency counts as much as large messages' bandwidth;
                ``False``: plain squared errors in seconds, dominated by the largest messages.

        Example::

            model = AnalyticCollectiveModel.fit(bench.points())
        """
        by_collective: dict[Collective, list[CollectivePoint]] = {}
        for p in points:
            if not isinstance(p, CollectivePoint):
                raise TypeError(f"fit takes CollectivePoint items, got {type(p).__name__}")
            by_collective.setdefault(p.collective, []).append(p)
        if not by_collective:
            raise CollectiveFitError("fit needs benchmark points; got none")
        costs = {c: _fit_one(c, pts, relative_error) for c, pts in by_collective.items()}
        return cls(costs=costs, name="analytic:fit")

    def time_ms(self, collective: Collective, message_bytes: int, group_size: int) -> float:
        """Time of one collective of ``message_bytes`` (whole buffer) over ``group_size`` ranks."""
        factor = ring_factor(collective, group_size)
        check_message_bytes(message_bytes)
        if factor == 0.0:
            return 0.0
        cost = self.costs.get(collective)
        if cost is None:
            known = ", ".join(c.value for c in self.costs)
            raise KeyError(
                f"{self.name} has no cost for {collective.value} (it prices {known}); "
                "fit it with points of that collective too"
            )
        return (cost.latency_s + factor * message_bytes / cost.bandwidth_bytes_per_s) * 1e3


def _fit_one(
    collective: Collective, points: list[CollectivePoint], relative_error: bool
) -> CollectiveCost:
    x = np.array([ring_factor(collective, p.group_size) * p.message_bytes for p in points], float)
    y_s = np.array([p.runtime_ms for p in points], float) / 1e3
    if np.unique(x[x > 0]).size < 2:
        raise CollectiveFitError(
            f"{collective.value}: a latency and a bandwidth need points at two or more message "
            f"sizes from groups of two or more ranks; got {len(points)} point(s) with bytes moved "
            f"{sorted(set(x.tolist()))}"
        )
    if relative_error and np.any(y_s <= 0):
        raise CollectiveFitError(
            f"{collective.value}: a relative-error fit needs positive runtimes; pass "
            "relative_error=False or drop the zero-time points"
        )
    weight = 1 / y_s if relative_error else np.ones_like(y_s)
    design = np.column_stack([weight, weight * x])
    scale = np.abs(design).max(axis=0)  # equilibrate columns: seconds vs seconds-per-byte
    latency_s, s_per_byte = _nonnegative_lstsq(design / scale, weight * y_s) / scale
    if s_per_byte <= 0:
        logger.warning("%s: the fit found no dependence on message size", collective.value)
    bandwidth = 1 / s_per_byte if s_per_byte > 0 else math.inf
    return CollectiveCost(latency_s=float(latency_s), bandwidth_bytes_per_s=float(bandwidth))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a @ c - b|| over c >= 0, for two columns (exact: an active-set of size 2)."""
    c, *_ = np.linalg.lstsq(a, b, rcond=None)
    if np.all(c >= 0):
        return c
    # The convex optimum lies on a face c[j] = 0: the best one-column fit, clamped at 0.
    faces = []
    for j in range(a.shape[1]):
        col = a[:, j]
        face = np.zeros(a.shape[1])
        face[j] = max(0.0, float(col @ b) / float(col @ col))
        faces.append(face)
    return min(faces, key=lambda f: float(np.linalg.norm(a @ f - b)))


# ----------------------------------------------------------------------------- argument checks


def check_collective(collective: Any) -> None:
    if not isinstance(collective, Collective):
        known = ", ".join(f"Collective.{c.name}" for c in Collective)
        raise TypeError(f"collective must be one of {known}, got {collective!r}")


def check_message_bytes(message_bytes: Any) -> None:
    if isinstance(message_bytes, bool) or not isinstance(message_bytes, int) or message_bytes < 0:
        raise ValueError(f"message_bytes must be an int >= 0, got {message_bytes!r}")


def check_group_size(group_size: Any) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
