"""Exceptions the solver raises; each message says how to fix the problem."""

from __future__ import annotations

__all__ = [
    "SolverError",
    "GraphError",
    "UnknownModuleError",
    "BackendUnavailableError",
    "InfeasibleBudgetError",
    "SolverTimeoutError",
]

_GiB = 2**30


class SolverError(Exception):
    """Base class of every error the solver raises on purpose."""


class GraphError(SolverError, ValueError):
    """A module tree that is not a tree: duplicate names, unknown parents, cycles, bad orders."""


class UnknownModuleError(GraphError, KeyError):
    """A module name (e.g. in ``ac_units``) that the ModuleInfo does not contain."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(SolverError, ImportError):
    """The MILP backend asked for is not installed."""


class SolverTimeoutError(SolverError):
    """The backend hit its time limit before it found any plan."""


class InfeasibleBudgetError(SolverError, ValueError):
    """No plan fits the budget; ``min_reachable_peak_bytes`` is the smallest budget that does."""

    def __init__(self, budget_bytes: int, min_reachable_peak_bytes: int, world_size: int) -> None:
        self.budget_bytes = budget_bytes
        self.min_reachable_peak_bytes = min_reachable_peak_bytes
        self.world_size = world_size
        super().__init__(
            f"infeasible: a budget of {_fmt(budget_bytes)} ({budget_bytes:,} bytes) is below the "
            f"smallest peak this model can reach, {_fmt(min_reachable_peak_bytes)} "
            f"({min_reachable_peak_bytes:,} bytes, world_size={world_size}); ask for at least "
            "that, or shard parameters, gradients and optimizer state over more ranks "
            "(larger world_size / FSDP)"
        )


def _fmt(nbytes: int) -> str:
    """GiB as users think of budgets; MiB for models too small to show in GiB."""
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB // 10 else f"{nbytes / 2**20:.2f} MiB"
