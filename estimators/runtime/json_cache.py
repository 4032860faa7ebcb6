"""A JSON file of measured timings, shared by the kernel and collective benchmarks.

One file format for both caches::

    {"format": "sac-planner/benchmark-cache", "version": 1, "torch_version": "2.13.0",
     ...identity fields (e.g. "device"), "entries": {"<key>": <ms>, ...}}

* load refuses, with :class:`BenchmarkCacheError` and what to do, a file that is unreadable, of
  another format or version, measured on another identity (device), or has an entry that is not
  a finite time >= 0;
* save merges with what the file holds (several runtimes, ranks or processes may share one
  file; a file load refuses is replaced) and writes to a temporary file renamed over the old
  one, so an interrupted save or a concurrent reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["BenchmarkCacheError", "JsonTimingCache", "is_time"]


class BenchmarkCacheError(ValueError):
    """A timing cache file that is corrupt, of another format, or from another device."""


def is_time(value: Any) -> bool:
    """A finite number of milliseconds >= 0 (not a bool)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


@dataclass(frozen=True, kw_only=True)
class JsonTimingCache:
    """One cache file: where it is, what it must be, and how to name it in errors."""

    path: Path
    format: str
    """The ``format`` field every file of this cache carries, e.g. ``"sac-planner/benchmark-cache"``."""
    version: int
    description: str
    """What the file is, for messages: ``"benchmark cache"``."""
    identity: Mapping[str, str] = field(default_factory=dict)
    """Header fields a file must match to be read, e.g. ``{"device": "cpu:x86_64:2threads"}``:
    timings from other hardware never answer for this one."""
    error: type[BenchmarkCacheError] = BenchmarkCacheError
    """The exception raised for a file that cannot be used."""

    def load(self) -> dict[str, float]:
        """The entries of the file (``{}`` when it does not exist)."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise self.error(
                f"{self.description} {self.path} is unreadable ({exc}); delete it or pass another "
                "cache_path"
            ) from exc
        self._check_header(data)
        entries = data.get("entries")
        if not isinstance(entries, dict) or not all(map(is_time, entries.values())):
            raise self.error(f"{self.description} {self.path} has malformed entries; delete it")
        return {str(k): float(v) for k, v in entries.items()}

    def save(self, entries: Mapping[str, float]) -> None:
        """Merge ``entries`` into the file (they win over the file's) and replace it atomically."""
        try:
            merged = {**self.load(), **entries}
        except BenchmarkCacheError:
            merged = dict(entries)  # a foreign or corrupt file was refused at load; replace it
        payload = {
            "format": self.format,
            "version": self.version,
            **self.identity,
            "torch_version": _torch_version(),
            "entries": merged,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _check_header(self, data: Any) -> None:
        if not isinstance(data, dict) or data.get("format") != self.format:
            raise self.error(
                f"{self.path} is not a {self.description} (format {self.format!r}); pass another "
                "cache_path"
            )
        if data.get("version") != self.version:
            raise self.error(
                f"{self.description} {self.path} has version {data.get('version')!r}, this code "
                f"reads {self.version}; delete it to re-measure"
            )
        for name, expected in self.identity.items():
            if data.get(name) != expected:
                raise self.error(
                    f"{self.description} {self.path} was measured on {name} "
                    f"{data.get(name)!r}, this run measures on {expected!r}; pass one cache_path "
                    f"per {name}"
                )


def _torch_version() -> str:
    # Recorded for people reading the file; torch is loaded already wherever timings are taken.
    import torch

    return torch.__version__
