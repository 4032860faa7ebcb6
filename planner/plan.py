"""The Plan: what to checkpoint, which ops to save, and what the planner predicts for it.

A Plan is plain data with a versioned JSON form, so it can be saved, diffed, reviewed and applied
to the same model later (``apply_plan`` checks the model fingerprint first).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["OpKey", "ModulePlan", "Plan", "PlanFormatError", "model_fingerprint", "op_key"]

PLAN_VERSION = 1
_KIND = "sac_planner.Plan"
GiB = 2**30

# Fused attention runs as a different aten op on each backend; a plan made on one applies on all.
_SDPA_OPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
}


def op_key(func_name: str) -> str:
    """The name ops are matched by at run time."""
    return "sdpa" if func_name in _SDPA_OPS else func_name


OpKey = tuple[str, int]
"""(op key, occurrence of that key within one call of the module)."""


class PlanFormatError(ValueError):
    """A plan file that is corrupt, from a newer version, or not a plan."""


@dataclass(frozen=True, kw_only=True)
class ModulePlan:
    """How one module is checkpointed."""

    fqn: str
    """Module name as in ModuleInfo (root class name first, e.g. ``GPT.blocks.3``)."""
    discard_ratio: float
    """Fraction of the module's recomputable activation memory the solver discards."""
    full: bool
    """Plain full checkpointing (ratio 1): every op is recomputed, no policy."""
    saved_ops: tuple[OpKey, ...] = ()
    """Ops whose outputs are kept (MUST_SAVE); every other op is recomputed."""
    recomputed_ops: tuple[OpKey, ...] = ()
    """Ops autograd would have saved that are recomputed instead (for reading; not used to apply)."""
    discarded_bytes: int = 0
    recompute_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A selective-activation-checkpointing plan for one model, step and device."""

    modules: tuple[ModulePlan, ...]
    model_name: str
    model_fingerprint: str
    device: str
    world_size: int
    budget_bytes: int
    """What the user asked for."""
    reserve_bytes: int
    """Held back from the budget for the CUDA context and fragmentation."""
    predicted_peak_bytes: int
    """Peak of a training step with the plan applied (fake-mode trace of the planned model)."""
    solver_peak_bytes: int
    """Peak the MILP's memory model predicts for the plan."""
    baseline_peak_bytes: int
    """Peak without any checkpointing."""
    recompute_ms: float
    """Predicted extra time per step spent recomputing."""
    baseline_step_ms: float
    """Predicted step time without checkpointing (forward + backward + optimizer)."""
    solver_status: str = ""
    solve_time_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    first_step_peak_bytes: int | None = None
    """Peak of the first step of a fresh run (no optimizer state before its optimizer phase)."""
    steady_peak_bytes: int | None = None
    """Peak of the steady-state step (step 2 on); ``predicted_peak_bytes`` is the larger one."""

    @property
    def binding_step(self) -> str:
        """``"steady state"``, ``"first step"``, or ``""`` for a plan that does not say."""
        if self.first_step_peak_bytes is None or self.steady_peak_bytes is None:
            return ""
        return "first step" if self.first_step_peak_bytes > self.steady_peak_bytes else "steady state"

    @property
    def usable_budget_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return tuple(m.fqn for m in self.modules)

    def module(self, fqn: str) -> ModulePlan:
        for m in self.modules:
            if m.fqn == fqn:
                return m
        raise KeyError(f"module {fqn!r} is not checkpointed by this plan")

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {"kind": _KIND, "version": PLAN_VERSION, **dataclasses.asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        if not isinstance(d, dict) or d.get("kind") != _KIND:
            raise PlanFormatError("not a SAC Planner plan (kind != 'sac_planner.Plan')")
        v = d.get("version")
        if not isinstance(v, int) or v > PLAN_VERSION:
            raise PlanFormatError(
                f"plan version {v!r} is newer than this SAC Planner reads ({PLAN_VERSION}); "
                "upgrade sac-planner or re-plan with this version"
            )
        try:
            body = {k: val for k, val in d.items() if k not in ("kind", "version")}
            body["modules"] = tuple(
                ModulePlan(
                    **{
                        **m,
                        "saved_ops": tuple((str(k), int(o)) for k, o in m.get("saved_ops", ())),
                        "recomputed_ops": tuple(
                            (str(k), int(o)) for k, o in m.get("recomputed_ops", ())
                        ),
                    }
                )
                for m in body["modules"]
            )
            body["notes"] = tuple(body.get("notes", ()))
            return cls(**body)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"corrupt plan: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"plan file {path} is not valid JSON: {e}") from e
        return cls.from_dict(d)

    def summary(self) -> str:
        from planner.report import plan_summary

        return plan_summary(self)


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of module names and parameter names, shapes and dtypes (not values, not device).

    The same before and after ``fully_shard``: FSDP2 renames a sharded module's class to
    ``FSDP<Name>`` (the original name is hashed) and its parameters become DTensors whose
    ``.shape`` is the global, unsharded shape.

    >>> model_fingerprint(torch.nn.Linear(2, 3)) == model_fingerprint(torch.nn.Linear(2, 3))
    True
    """
    from planner.fsdp import original_class_name

    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"m:{name}:{original_class_name(mod)}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"p:{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()[:16]
