"""Every error the planner raises on purpose, in one place. Each message says what to change.

    from planner.errors import PlanningError, PlanMismatchError
"""

from __future__ import annotations

__all__ = [
    "PlanningError",
    "PlanFormatError",
    "StepMismatchError",
    "PlanMismatchError",
    "AlreadyCheckpointedError",
    "PlanHashMismatchError",
    "RemotePlanningError",
    "RankDisagreementError",
    "FileRefusedError",
]


class PlanningError(ValueError):
    """The request cannot be planned as asked; the message says what to change."""


class PlanFormatError(ValueError):
    """A plan file that is corrupt, from a newer version, or not a plan; or plan fields out of range."""


class StepMismatchError(ValueError):
    """A plan checked against a training step other than the one it was made for."""


class PlanMismatchError(ValueError):
    """The plan was made for another model."""


class AlreadyCheckpointedError(RuntimeError):
    """The model is already wrapped by a checkpointing scheme."""


class PlanHashMismatchError(RuntimeError):
    """Ranks of one job hold different plans; ``ranks`` are those that differ from rank 0."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class RemotePlanningError(PlanningError):
    """Raised on the other ranks when planning failed on rank 0; same message as rank 0's."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        """Class name of the exception rank 0 raised."""


class RankDisagreementError(PlanningError):
    """Ranks of one planning job were asked for different plans, or one rank could not plan;
    raised on every rank with the same message. ``ranks``: those that failed or differ from
    rank 0."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class FileRefusedError(ValueError):
    """A file that is not a regular file, too large, or JSON beyond the reader's limits."""
