"""A torchtitan activation-checkpointing policy that applies a plan made offline.

    from planner.integrations.torchtitan import PlannedAC

    config = llama3_debugmodel()                       # any torchtitan Trainer.Config
    config.activation_checkpoint = PlannedAC.Config(plan_path="plan.json")

Needs ``pip install 'sac-planner[torchtitan]'`` (torchtitan; its model package imports triton).
torchtitan applies the policy where it applies ``FullAC`` / ``SelectiveAC``, at its one call site
in ``parallelize``: ``ac_config.build(dump_folder=...).apply(model)``, after tensor parallelism and
before FSDP. The plan is made offline (``solve_sac(model, budget_gib, step).save("plan.json")``)
for the model as it stands at that point and for the step torchtitan trains (its micro-batches,
loss, optimizer, mixed precision); ``apply`` refuses a plan made for another model
(``PlanMismatchError``). Selected from a Python config: tyro's command line offers only the
policies torchtitan lists in ``ActivationCheckpointingConfig``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from planner.applying.checkpointing import apply_plan
from planner.plan import Plan

__all__ = ["PlannedAC"]

logger = logging.getLogger(__name__)


class PlannedAC(ActivationCheckpointing):
    """Checkpoint what a SAC Planner plan says, per module: the ops it saves and recomputes."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        plan_path: str | os.PathLike = ""
        """The plan file (``plan.save(path)``; a str or a ``Path``), made for this model as
        ``parallelize`` leaves it before activation checkpointing (after TP, before FSDP) and for
        the step it trains."""

        def __post_init__(self) -> None:
            if isinstance(self.plan_path, os.PathLike):
                self.plan_path = os.fspath(self.plan_path)
            if not isinstance(self.plan_path, str):
                raise TypeError(f"PlannedAC.Config plan_path must be a path (str or pathlib.Path), got "
                                f"{type(self.plan_path).__name__}")
            if not self.plan_path:
                raise ValueError("PlannedAC.Config needs plan_path: the file plan.save(path) wrote")
            if not self.preserve_rng_state:
                raise ValueError("PlannedAC replays every random draw in the recompute (a plan is bitwise "
                                 "by contract): preserve_rng_state=False cannot be honoured; leave it True")

    def apply(self, model: torch.nn.Module) -> None:
        """Apply the plan file to ``model`` (the plan's modules get its checkpoints)."""
        path = self.config.plan_path
        if not os.path.exists(path):  # a FIFO, a directory...: Plan.load says what it is
            raise FileNotFoundError(f"PlannedAC: no plan file at {path!r}; make one offline with "
                                    "solve_sac(model, budget_gib, step).save(path) for this model and step")
        plan = Plan.load(path)
        self.handle = apply_plan(model, plan)
        logger.info("Applied PlannedAC from %s: %d modules checkpointed, predicted peak %d B",
                    path, len(plan.modules), plan.predicted_peak_bytes)
