"""Byte counts and durations as people read and type them: the one place tables, messages and plot axes choose a
unit, and where a number of GiB a user typed is checked."""

from __future__ import annotations

import math
import numbers
from typing import Any

from planner.errors import PlanningError

__all__ = ["GiB", "byte_unit", "fmt_bytes", "fmt_ms", "check_budget_gib"]

GiB = 2**30
_PIB_IN_GIB = 2**20

_BYTE_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def byte_unit(nbytes: float) -> tuple[int, str]:
    """(bytes per unit, name) of the largest binary unit that ``|nbytes|`` reaches; (1, "B") below
    1 KiB. The one place tables, messages and plot axes choose a unit.

    >>> byte_unit(3 * 2**30), byte_unit(-5 * 2**20), byte_unit(1023)
    ((1073741824, 'GiB'), (1048576, 'MiB'), (1, 'B'))
    """
    return next(((div, name) for div, name in _BYTE_UNITS if abs(nbytes) >= div), (1, "B"))


def fmt_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes in its :func:`byte_unit` with ``digits`` decimals; whole bytes below 1 KiB.

    >>> fmt_bytes(131_173_532), fmt_bytes(0), fmt_bytes(64 * 2**20, digits=0)
    ('125.10 MiB', '0 B', '64 MiB')
    """
    div, unit = byte_unit(n)
    return f"{int(n)} B" if div == 1 else f"{n / div:.{digits}f} {unit}"


def fmt_ms(ms: float) -> str:
    """A duration in seconds from 1 s up, else in ms.

    >>> fmt_ms(103_100.0), fmt_ms(44.7), fmt_ms(1500)
    ('103.10 s', '44.7 ms', '1.50 s')
    """
    return f"{ms / 1000:,.2f} s" if abs(ms) >= 1000 else f"{ms:,.1f} ms"


def check_budget_gib(budget_gib: Any, name: str = "budget_gib", hint: str = "") -> float:
    """A positive, finite number of GiB, or a PlanningError that names the argument (``name``)
    and says what to pass (``hint`` appended)."""
    # numbers.Real: numpy's scalars too (np.float32(40) was refused as "not a number").
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, numbers.Real):
        raise PlanningError(f"{name} must be a number of GiB, got {budget_gib!r}{hint}")
    budget_gib = float(budget_gib)
    if not math.isfinite(budget_gib) or budget_gib <= 0:
        raise PlanningError(f"{name} must be a positive finite number of GiB, got {budget_gib}{hint}")
    if budget_gib * GiB < 1:  # the reserve (0 B) was blamed for a budget of 0 bytes
        raise PlanningError(
            f"{name}={budget_gib:g} GiB is {budget_gib * GiB:.3g} bytes, less than one byte: budgets "
            f"are in GiB (0.5 is 512 MiB; 1 MiB is {1 / 1024:g}){hint}")
    if budget_gib >= _PIB_IN_GIB:  # bytes typed where GiB are asked for (9_000_000 planned nothing)
        nbytes = f"{budget_gib:.0f}" if budget_gib < 1e18 else f"{budget_gib:g}"
        raise PlanningError(
            f"{name} is in GiB: {budget_gib:g} GiB is {budget_gib / _PIB_IN_GIB:.3g} PiB per rank, more "
            f"than any device holds; for {nbytes} bytes pass {name}={budget_gib / GiB:.4g}{hint}")
    return budget_gib
