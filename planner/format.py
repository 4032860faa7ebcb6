"""Byte counts as people read them: the one place tables, messages and plot axes choose a unit."""

from __future__ import annotations

__all__ = ["GiB", "byte_unit", "fmt_bytes"]

GiB = 2**30

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
