"""Apply a Plan to a model: non-reentrant torch.utils.checkpoint with a selective policy.

    handle = apply_plan(model, plan)     # or: with apply_plan(model, plan): ...
    ...train...
    handle.remove()                      # or remove_plan(model)

Each checkpointed module's ``forward`` is replaced on the instance (the module tree, parameter
names and state_dict keys do not change). Ratio-1 modules are plainly checkpointed; the others get
a policy from ``create_selective_checkpoint_contexts`` that saves exactly the plan's ops, counted
per (op, occurrence) in the forward and again in the recompute, so both index ops the same way.
RNG state is preserved, so dropout draws the same mask in the recompute.
"""

from __future__ import annotations

import collections
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.fsdp import original_class_name
from planner.plan import ModulePlan, Plan, model_fingerprint, op_key

__all__ = ["apply_plan", "remove_plan", "AppliedPlan", "PlanMismatchError", "AlreadyCheckpointedError"]

logger = logging.getLogger(__name__)

_MARK = "_sac_planner_original_forward"


class PlanMismatchError(ValueError):
    """The plan was made for another model."""


class AlreadyCheckpointedError(RuntimeError):
    """The model is already wrapped by a checkpointing scheme."""


def _policy_context_fn(saved: frozenset[tuple[str, int]]) -> Callable[[], Any]:
    def context_fn():
        counts = {False: collections.Counter(), True: collections.Counter()}

        def policy(ctx, op, *args, **kwargs):
            c = counts[ctx.is_recompute]
            key = op_key(str(op))
            occ = c[key]
            c[key] += 1
            return CheckpointPolicy.MUST_SAVE if (key, occ) in saved else CheckpointPolicy.PREFER_RECOMPUTE

        # An in-place op always shares its parent's decision (estimators/sac.py), so a cached
        # output is only ever mutated by ops that are cached with it: the cache holds the final
        # value and the recompute never re-runs the mutation.
        return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)

    return context_fn


def _checkpointed_forward(forward: Callable, mp: ModulePlan) -> Callable:
    kw: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
    if not mp.full:
        kw["context_fn"] = _policy_context_fn(frozenset(mp.saved_ops))

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing is saved without grad: no checkpoint
        return checkpoint(forward, *args, **kwargs, **kw)

    return wrapped


def _existing_checkpointing(model: torch.nn.Module) -> str | None:
    for name, mod in model.named_modules():
        where = name or type(model).__name__
        if _MARK in mod.__dict__:
            return f"{where} already has a SAC Planner plan applied; call remove_plan(model) first"
        if hasattr(mod, "_checkpoint_wrapped_module"):
            return (
                f"{where} is wrapped by torch's checkpoint_wrapper; unwrap it "
                "(or plan the unwrapped model) before applying a plan"
            )
        try:
            from torch.distributed._composable.contract import _get_registry

            if "checkpoint" in (_get_registry(mod) or {}):
                return (
                    f"{where} uses torch.distributed._composable.checkpoint; plan the model "
                    "without it"
                )
        except ImportError:  # pragma: no cover - older torch
            pass
    return None


def _root_relative(fqn: str, root: str) -> str:
    if fqn == root:
        return ""
    if not fqn.startswith(root + "."):
        raise PlanMismatchError(f"plan module {fqn!r} is not under the model {root!r}")
    return fqn[len(root) + 1 :]


@dataclass
class AppliedPlan:
    """Handle of an applied plan: ``remove()`` or use as a context manager."""

    model: torch.nn.Module
    plan: Plan
    modules: list[torch.nn.Module]

    def remove(self) -> None:
        for mod in self.modules:
            _restore(mod)
        self.modules = []

    def __enter__(self) -> "AppliedPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _restore(mod: torch.nn.Module) -> None:
    original = mod.__dict__.pop(_MARK, None)
    if original is None:
        return
    mod.__dict__.pop("forward", None)
    if original is not _CLASS_FORWARD:
        mod.forward = original


_CLASS_FORWARD = object()  # marker: the module used its class's forward


def apply_plan(model: torch.nn.Module, plan: Plan, *, check_fingerprint: bool = True) -> AppliedPlan:
    """Checkpoint ``model``'s modules as ``plan`` says. Atomic: on any error the model is unchanged.

    Example::

        plan = solve_sac(model, budget_gib=40, inputs=batch)
        with apply_plan(model, plan):
            loss_fn(model(*batch), batch).backward()
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_plan needs a Plan, got {type(plan).__name__}")
    plan.validate()  # e.g. a module listed twice would be wrapped twice and never removed
    root = original_class_name(model)  # fully_shard renames GPT to FSDPGPT
    if check_fingerprint:
        fp = model_fingerprint(model)
        if plan.model_name != root or plan.model_fingerprint != fp:
            raise PlanMismatchError(
                f"this plan was made for {plan.model_name} (fingerprint {plan.model_fingerprint}), "
                f"not for this {root} (fingerprint {fp}): module names, parameter shapes or dtypes "
                "differ. Re-plan with solve_sac(model, ...)"
            )
    problem = _existing_checkpointing(model)
    if problem:
        raise AlreadyCheckpointedError(problem)
    targets = []
    for mp in plan.modules:  # resolve everything before touching the model
        name = _root_relative(mp.fqn, root)
        try:
            targets.append((model.get_submodule(name) if name else model, mp))
        except AttributeError as e:
            raise PlanMismatchError(f"plan module {mp.fqn!r} does not exist in the model") from e
    done: list[torch.nn.Module] = []
    try:
        for mod, mp in targets:
            original = mod.__dict__.get("forward", _CLASS_FORWARD)
            mod.forward = _checkpointed_forward(mod.forward, mp)
            mod.__dict__[_MARK] = original
            done.append(mod)
    except BaseException:
        for mod in done:
            _restore(mod)
        raise
    return AppliedPlan(model=model, plan=plan, modules=done)


def remove_plan(model: torch.nn.Module) -> int:
    """Undo every applied plan on ``model``; returns how many modules were restored."""
    n = 0
    for mod in model.modules():
        if _MARK in mod.__dict__:
            _restore(mod)
            n += 1
    return n
