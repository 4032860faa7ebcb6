"""FSDP units of a traced model: which modules are units, and the parameter and gradient bytes
each *owns* (its ``ModStats`` bytes minus those of the units nested in it, since a nested unit
gathers and reduces its own). Shared by the memory rules (``memory.py``) and the communication time
(``comm.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from estimators.contract.module_info import ModStats, ModuleInfo
from solver.graph import close_names, is_submodule
from solver.plan_cost import check_world_size as _check_world_size

__all__ = ["FSDPUnitError", "Unit", "check_world_size", "unit_table"]

logger = logging.getLogger(__name__)


class FSDPUnitError(ValueError):
    """``fsdp_units`` that do not describe a valid FSDP wrapping of the traced model."""


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One FSDP unit as the memory rules and the communication time need it."""

    stats: ModStats
    own_param_bytes: int
    own_grad_bytes: int
    is_root: bool

    @property
    def fqn(self) -> str:
        return self.stats.fqn


def check_world_size(world_size: object) -> int:
    """``world_size`` as an int, or the solver's ValueError (one rule, one message)."""
    _check_world_size(world_size)  # type: ignore[arg-type]
    return int(world_size)  # type: ignore[arg-type]


def _check_units(info: ModuleInfo, fsdp_units: Iterable[str]) -> list[str]:
    if isinstance(fsdp_units, str):
        raise FSDPUnitError(f"fsdp_units must be a list of module names, not the string {fsdp_units!r}")
    units = list(dict.fromkeys(fsdp_units))
    known = [s.fqn for s in info.mod_stats]
    known_set = set(known)
    for u in units:
        if not isinstance(u, str):
            raise FSDPUnitError(f"fsdp_units must hold module names (str), got {u!r}")
        if u not in known_set:
            close = close_names(u, known)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise FSDPUnitError(
                f"fsdp_units names {u!r}, which is not a module of the traced model "
                f"(names start with the root class, e.g. {known[0]!r}){hint}"
            )
    root = known[0]
    if root not in units:
        raise FSDPUnitError(
            f"fsdp_units must include the root {root!r}: call fully_shard(model) last, as FSDP2 "
            "expects; parameters outside every unit would stay replicated, which this model does "
            "not count"
        )
    return units



def _build_units(info: ModuleInfo, names: list[str]) -> dict[str, Unit]:
    root = info.mod_stats[0].fqn
    out: dict[str, Unit] = {}
    for name in names:
        s = info.stats(name)
        # Units nested in this one, not inside another nested unit: their params are theirs.
        nested = [n for n in names if is_submodule(n, name)]
        direct = [n for n in nested if not any(is_submodule(n, m) for m in nested)]
        own_p = s.param_bytes - sum(info.stats(n).param_bytes for n in direct)
        own_g = s.grad_bytes - sum(info.stats(n).grad_bytes for n in direct)
        if s.n_calls > 1:
            logger.warning("FSDP unit %s runs %d times per step; modelled as one call", name, s.n_calls)
        out[name] = Unit(
            stats=s, own_param_bytes=max(0, own_p), own_grad_bytes=max(0, own_g), is_root=name == root
        )
    return out


def unit_table(info: ModuleInfo, fsdp_units: Iterable[str]) -> dict[str, Unit]:
    """The checked ``fsdp_units`` of ``info`` by name, root first, each with its own bytes."""
    return _build_units(info, _check_units(info, fsdp_units))
