"""The fields of a plan file, each bounded: the checks ``planner.plan``'s dataclasses run.

A plan file may come from anywhere: every field is bounded, so that a hostile or broken file is
refused by its loader, not by arithmetic or a renderer further on. Each check returns the value
or raises :class:`PlanFormatError` naming the field, in one line of bounded length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import torch

from planner.errors import PlanFormatError

__all__ = ["MAX_BYTES", "MAX_COUNT", "MAX_MODULES", "MAX_MS", "MAX_NAME_CHARS", "MAX_NOTES", "MAX_NOTE_CHARS",
           "MAX_OPS", "MAX_PLAN_FILE_BYTES", "MAX_JSON_DEPTH", "check_bool", "check_float", "check_int",
           "check_op_name", "check_str", "fields_of", "op_keys", "short"]

# ------------------------------------------------------------------ limits
# A plan file may come from anywhere: every field is bounded, so that a hostile or broken file
# is refused by its loader, not by arithmetic or a renderer further on.
MAX_PLAN_FILE_BYTES = 64 * 2**20
"""Largest plan file read (a plan of 1,000 modules with 100 ops each takes about 8 MiB)."""
MAX_BYTES = 2**50
"""Byte fields: 1 PiB, more than any one device or host holds (budgets at or above it are
refused by ``solve_sac`` as bytes typed for GiB)."""
MAX_MS = 1e10
"""Time fields: about 115 days."""
MAX_COUNT = 2**20
"""world_size and micro_batches."""
MAX_NAME_CHARS = 4096
"""Module, model, device, op names and the solver status."""
MAX_NOTE_CHARS = 100_000
MAX_NOTES = 10_000
MAX_MODULES = 100_000
MAX_OPS = 100_000
"""Entries of one op list of one module (a plan lists the ops of one call of one module)."""
MAX_JSON_DEPTH = 16  # a plan nests 5 deep (plan, modules, module, saved_ops, [op, occurrence])


# ------------------------------------------------------------------ field checks
# Each returns the value or raises PlanFormatError naming the field: a plan is applied to a
# model and drives the checkpointing of real training, so nothing out of range may get that far.
def check_int(where: str, v: Any, *, low: int = 0, high: int = MAX_BYTES) -> int:
    if type(v) is not int and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
        raise PlanFormatError(f"{where} must be an integer, got {short(v)}")
    if not low <= v <= high:
        bound = f"in [{low}, {high:,}]" if v > high else f">= {low}"
        raise PlanFormatError(f"{where} must be {bound}, got {short(v)}")
    return int(v)


def check_float(where: str, v: Any, *, high: float = MAX_MS) -> float:
    if type(v) is not float and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
        raise PlanFormatError(f"{where} must be a number, got {short(v)}")
    if not (math.isfinite(v) and 0 <= v <= high):
        bound = f"in [0, {high:g}]" if high <= 1 else f"finite, >= 0 and <= {high:g}"
        raise PlanFormatError(f"{where} must be {bound}, got {short(v)}")
    return float(v)


def check_str(where: str, v: Any, *, nonempty: bool = False, max_chars: int = MAX_NAME_CHARS) -> str:
    if not isinstance(v, str) or (nonempty and not v):
        raise PlanFormatError(f"{where} must be a {'non-empty ' if nonempty else ''}string, got {short(v)}")
    if len(v) > max_chars:
        raise PlanFormatError(f"{where} has {len(v):,} characters, more than the {max_chars:,} a plan "
                              f"takes ({short(v)})")
    return v


def short(v: Any, n: int = 60) -> str:
    """``repr(v)`` cut to about ``n`` characters: messages stay one short line whatever the file
    holds (an int of 4,300 digits has no repr at all)."""
    try:
        r = repr(v) if not isinstance(v, int) or abs(v) < 10**n else f"an integer of over {n} digits"
    except ValueError:
        r = f"an integer of over {n} digits"
    return r if len(r) <= n else f"{r[:n - 20]}...{r[-12:]} ({len(r):,} characters)"


def check_bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise PlanFormatError(f"{where} must be true or false, got {short(v)}")
    return v


@functools.lru_cache(maxsize=1)
def _registered_ops(generation: int) -> frozenset[str]:
    del generation  # the cache key: a new generation re-reads the registry
    return frozenset(torch._C._dispatch_get_all_op_names())


_registry_generation = 0


def check_op_name(where: str, name: str) -> None:
    """``name`` is an op key (``aten.mm.default``, ``aten.add.Tensor``, ``sdpa``) of an operator
    registered with torch. A miss re-reads the registry once: a custom op's library may have
    been imported since the last look."""
    global _registry_generation
    if name == "sdpa":
        return
    parts = name.split(".")
    if len(parts) != 3 or not all(parts):
        raise PlanFormatError(f"{where} must name an op as namespace.op.overload (aten.mm.default), "
                              f"got {short(name)}")
    ns, op, overload = parts
    qualified = f"{ns}::{op}" if overload == "default" else f"{ns}::{op}.{overload}"
    if qualified in _registered_ops(_registry_generation):
        return
    _registry_generation += 1
    if qualified not in _registered_ops(_registry_generation):
        raise PlanFormatError(
            f"{where} names {short(name)}, an op torch does not know: a typo, or a custom op whose "
            "library is not imported yet (import it before loading or applying the plan)")


def op_keys(where: str, v: Any) -> tuple[tuple[str, int], ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise PlanFormatError(f"{where} must be a list of [op, occurrence] pairs, got {short(v)}")
    if len(v) > MAX_OPS:
        raise PlanFormatError(f"{where} lists {len(v):,} ops, more than the {MAX_OPS:,} a plan takes "
                              "for one call of one module; re-plan the model to get a valid file")
    keys = []
    names: set[str] = set()
    for i, k in enumerate(v):
        if isinstance(k, (str, bytes)) or not isinstance(k, (list, tuple)) or len(k) != 2:
            raise PlanFormatError(f"{where}[{i}] must be an [op, occurrence] pair, got {short(k)}")
        name, occurrence = k
        if not isinstance(name, str) or name not in names:
            check_op_name(f"{where}[{i}][0] (op)", check_str(f"{where}[{i}][0] (op)", name, nonempty=True))
            names.add(name)
        if type(occurrence) is not int or not 0 <= occurrence <= MAX_OPS:
            occurrence = check_int(f"{where}[{i}][1] (occurrence)", occurrence, high=MAX_OPS)
        keys.append((name, occurrence))
    if len(set(keys)) != len(keys):
        seen: set = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise PlanFormatError(f"{where} lists {list(dup)} twice")
    return tuple(keys)


def fields_of(where: str, d: Any, cls: type, legacy: frozenset = frozenset()) -> dict[str, Any]:
    """``d`` as keyword arguments of ``cls``: a dict, no unknown keys, every required key."""
    if not isinstance(d, dict):
        raise PlanFormatError(f"{where} must be a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls) if f.init and f.metadata.get("saved", True)} - legacy
    unknown = sorted(set(d) - names - legacy)
    if unknown:
        more = f" and {len(unknown) - 3:,} more" if len(unknown) > 3 else ""
        raise PlanFormatError(
            f"{where} has unknown field(s) {', '.join(short(k, 40) for k in unknown[:3])}{more}; "
            f"known: {', '.join(sorted(names))}"
        )
    required = {f.name for f in dataclasses.fields(cls)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(d))
    if missing:
        raise PlanFormatError(f"{where} is missing field(s) {', '.join(map(repr, missing))}")
    return {k: v for k, v in d.items() if k in names}
