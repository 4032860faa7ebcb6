"""Apply a Plan to a model: non-reentrant torch.utils.checkpoint with a selective policy.

    handle = apply_plan(model, plan)     # or: with apply_plan(model, plan): ...
    ...train...
    handle.remove()                      # or remove_plan(model)

Each checkpointed module's ``forward`` is replaced on the instance by a
:class:`planner.applying.planned_forward.PlannedForward` (the module tree, parameter names and state_dict
keys do not change). Ratio-1 modules are plainly checkpointed; the others save exactly the plan's
ops. RNG state is preserved, so dropout draws the same mask in the recompute. How the recompute is
kept in step with the forward, and what still runs twice, is in ``planner/applying/planned_forward.py``.

Offload (``ModulePlan.offloaded_ops``, ``planner/applying/offload.py``): the outputs of the named ops that
are kept for backward go to host memory when the module's forward ends and come back one module
ahead in backward; a module plan with ``offloaded_ops`` and no ``saved_ops`` offloads without
checkpointing. ``handle.host_bytes_offloaded`` / ``handle.offload_counters()`` say what moved.
While such a plan is applied, the unplanned modules after an offloading one carry a forward hook
that starts the prefetch (removed with the plan).

Supported with a plan applied:

* ``copy.deepcopy(model)``: an independent planned model (``remove_plan`` works on it);
* ``pickle`` / ``torch.save(model)``: the loaded model is planned; ``state_dict`` is unchanged;
* ``torch.compile``: plan, apply, then compile (``torch.compile(model)`` after ``apply_plan``);
  ``solve_sac`` on a compiled model plans its ``_orig_mod`` and leaves the compiled one as it was;
* Hugging Face transformers: while a plan is applied the model's ``config.use_cache`` is False and
  planned modules get no KV cache (what HF does under its own gradient checkpointing); models with
  HF gradient checkpointing on are refused with the line that turns it off.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Iterable

import torch

from planner.errors import AlreadyCheckpointedError, PlanMismatchError
from planner.applying import offload
from planner.distributed.fsdp import original_class_name
from planner.distributed.layout import layout_mismatch
from planner.applying.offload import OffloadCounter, OffloadError
from planner.plan import ModulePlan, Plan, model_fingerprint, model_shape
from solver.graph import is_submodule
from planner.applying.planned_forward import CheckpointDivergenceWarning, PlannedForward, StalePlanWarning

__all__ = [
    "apply_plan",
    "apply_module_plans",
    "remove_plan",
    "AppliedPlan",
    "PlanMismatchError",
    "AlreadyCheckpointedError",
    "CheckpointDivergenceWarning",
    "OffloadError",
    "check_plannable",
    "hf_cache_note",
    "hf_cache_off",
    "unwrap_compiled",
]

logger = logging.getLogger(__name__)

_CACHE_OFF = "_sac_planner_use_cache_off"
"""Attribute of the module that owns an HF config (the outermost with it as ``.config``): the
configs whose cache a plan turned off. On the owner, not the module the plan was applied to, so
``remove_plan`` through a wrapper (peft's PeftModel) or on the inner model finds it."""


def _is_planned(mod: torch.nn.Module) -> bool:
    return isinstance(mod.__dict__.get("forward"), PlannedForward)


def _existing_checkpointing(model: torch.nn.Module) -> str | None:
    root = type(model).__name__
    for name, mod in model.named_modules():
        where = name or root
        # A plan with no module turns the cache off, nothing else.
        if _is_planned(mod) or _CACHE_OFF in mod.__dict__:
            return f"{where} already has a SAC Planner plan applied; call remove_plan(model) first"
        if getattr(mod, "gradient_checkpointing", False) is True:
            return (
                f"{root} has Hugging Face gradient checkpointing on (model.is_gradient_checkpointing, "
                f"set on {where}); a plan on top of it would checkpoint twice. Turn it off with "
                "model.gradient_checkpointing_disable() and plan again"
            )
        if hasattr(mod, "_checkpoint_wrapped_module"):
            return (
                f"{where} is wrapped by torch's checkpoint_wrapper; unwrap it "
                "(or plan the unwrapped model) before applying a plan"
            )
        try:
            from torch.distributed._composable.contract import _get_registry

            if "checkpoint" in (_get_registry(mod) or {}):
                return f"{where} uses torch.distributed._composable.checkpoint; plan the model without it"
        except ImportError:  # pragma: no cover - older torch
            pass
    return None


def check_plannable(model: torch.nn.Module) -> None:
    """Raise AlreadyCheckpointedError (before anything is touched) if ``model`` is checkpointed
    by a plan, HF gradient checkpointing or torch's wrappers."""
    problem = _existing_checkpointing(model)
    if problem:
        raise AlreadyCheckpointedError(problem)


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (``_orig_mod``), or ``model`` itself."""
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and orig is not None else model


# ------------------------------------------------------------------ Hugging Face KV cache
def _hf_configs(model: torch.nn.Module) -> list:
    seen, out = set(), []
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and id(cfg) not in seen and getattr(cfg, "use_cache", None) is True:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def hf_cache_note(model: torch.nn.Module) -> str | None:
    """The plan note for a model whose HF config has ``use_cache`` on, else None."""
    if not _hf_configs(model):
        return None
    return (
        "use_cache: the model's HF config has use_cache=True; while the plan is applied it is False "
        "and planned modules get no KV cache (a recompute would write it twice), as HF does under "
        "gradient checkpointing"
    )


class hf_cache_off:
    """``with hf_cache_off(model):`` HF ``config.use_cache`` is False inside, restored after
    (planning traces the model the way it runs once the plan is applied)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.configs = _hf_configs(model)

    def __enter__(self):
        for cfg in self.configs:
            cfg.use_cache = False
        return self

    def __exit__(self, *exc):
        for cfg in self.configs:
            cfg.use_cache = True


def root_relative(fqn: str, root: str) -> str | None:
    """A plan's module name relative to the model's root (``""`` for the root itself), or None
    where it is not under the root."""
    if fqn == root:
        return ""
    return fqn[len(root) + 1 :] if is_submodule(fqn, root) else None


def _root_relative(fqn: str, root: str) -> str:
    name = root_relative(fqn, root)
    if name is None:
        raise PlanMismatchError(f"plan module {fqn!r} is not under the model {root!r}")
    return name


_APPLIED = "_sac_planner_applied"
"""Key in the ``__dict__`` of the module a plan was applied to: the number of the handle that
applied it. A handle acts only while its number is there."""

_HANDLES = itertools.count(1)


@dataclass
class AppliedPlan:
    """Handle of an applied plan: ``remove()`` or use as a context manager.

    A handle removes only its own plan: after ``remove_plan(model)`` and another ``apply_plan``,
    an old handle's ``remove()`` (a leftover ``with`` block, a ``finally:``) does nothing rather
    than undo part of the new plan."""

    model: torch.nn.Module
    plan: Plan | None
    modules: list[torch.nn.Module] = field(default_factory=list)
    number: int = 0
    """This handle's number, kept on the model while its plan is applied."""
    undo: list = field(default_factory=list)
    """What ``remove()`` also undoes (a pipeline stage's grouped weight half)."""

    def _mine(self) -> list[torch.nn.Module]:
        """The planned modules still running this handle's plan (each PlannedForward carries the
        number of the handle that installed it: remove_plan on a submodule and a new apply there
        leave other forwards in those modules)."""
        return [m for m in self.modules if getattr(m.__dict__.get("forward"), "handle", None) == self.number]

    @property
    def applied(self) -> bool:
        """Whether this handle's plan is on the model (not removed, by it or by ``remove_plan``)."""
        if self.number == 0:
            return False
        if self.modules:
            return bool(self._mine())
        return self.model.__dict__.get(_APPLIED) == self.number  # a plan with no module

    def remove(self) -> None:
        while self.undo:
            self.undo.pop()()
        if self.applied:
            for mod in self._mine():
                _restore(mod)
            for mod in self.model.modules():
                offload.remove_sibling_hooks(mod)
            _restore_caches(self.model)
            offload.clear_pending()
            if self.model.__dict__.get(_APPLIED) == self.number:
                del self.model.__dict__[_APPLIED]
        self.modules = []

    def _planned_forwards(self) -> list[PlannedForward]:
        return [pf for mod in self.modules for pf in (mod.__dict__.get("forward"),)
                if isinstance(pf, PlannedForward)]

    def __repr__(self) -> str:
        # Not the dataclass repr: it printed the whole model and plan (hundreds of lines).
        names = [pf.mp.fqn for pf in self._planned_forwards()]
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        return f"AppliedPlan({type(self.model).__name__}, {len(names)} planned module(s): [{shown}])"

    def offload_counters(self) -> dict[str, OffloadCounter]:
        """Per planned module that offloads: what it copied to host memory so far (a live
        counter; ``reset()`` it between steps to read one step)."""
        return {pf.mp.fqn: pf.offload_counter for pf in self._planned_forwards() if pf.mp.offloaded_ops}

    @property
    def host_bytes_offloaded(self) -> int:
        """Bytes copied to host memory by every module of the plan, since applied (or reset)."""
        return sum(c.host_bytes for c in self.offload_counters().values())

    def __enter__(self) -> "AppliedPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _restore(mod: torch.nn.Module) -> bool:
    pf = mod.__dict__.get("forward")
    if not isinstance(pf, PlannedForward):
        return False
    del mod.__dict__["forward"]
    if pf.original is not None:
        mod.forward = pf.original
    return True


def _restore_caches(model: torch.nn.Module) -> None:
    for mod in model.modules():
        for cfg in mod.__dict__.pop(_CACHE_OFF, ()):
            cfg.use_cache = True


def _mark_caches_off(model: torch.nn.Module, configs: list) -> None:
    for cfg in configs:
        # Its own attribute: peft's PeftModel forwards .config to the model it wraps.
        owner = next((m for m in model.modules() if vars(m).get("config") is cfg),
                     next(m for m in model.modules() if getattr(m, "config", None) is cfg))
        owner.__dict__.setdefault(_CACHE_OFF, []).append(cfg)


def _check_not_compiled(model: torch.nn.Module) -> None:
    if unwrap_compiled(model) is not model:
        raise TypeError(
            "apply_plan got a torch.compile'd model: apply the plan to the original module, then "
            "compile it: `m = compiled._orig_mod; apply_plan(m, plan); compiled = torch.compile(m)`"
        )


def other_model(model: torch.nn.Module, plan: Plan) -> tuple[str, str] | None:
    """``(name, fingerprint)`` of ``model`` where they are not the ones ``plan`` was made for;
    None where the plan is this model's (``apply_plan`` and the CLI's ``--plan-in`` ask)."""
    name, fp = original_class_name(model), model_fingerprint(model)
    return None if (plan.model_name, plan.model_fingerprint) == (name, fp) else (name, fp)


def check_plan_modules(model: torch.nn.Module, plan: Plan) -> None:
    """Raise PlanMismatchError where a module ``plan`` names is not a module of ``model`` (a
    layer it lacks, a parameter's name): what ``apply_plan`` checks, for the paths that read a
    plan without applying it (the CLI's ``--plan-in --no-verify``). A fingerprint that matches
    does not cover it: the module list of a file can be edited."""
    _resolve(model, plan.modules)


def _resolve(model: torch.nn.Module, modules: Iterable[ModulePlan]) -> tuple[list, list[str]]:
    """``([(module, module plan)], [name relative to the root])`` of the plan's modules."""
    root = original_class_name(model)
    targets, names = [], []
    seen: set[str] = set()
    for mp in modules:
        if mp.fqn in seen:
            raise PlanMismatchError(f"plan module {mp.fqn!r} is listed twice")
        seen.add(mp.fqn)
        name = _root_relative(mp.fqn, root)
        try:
            targets.append((model.get_submodule(name) if name else model, mp))
        except AttributeError as e:
            what = ("a parameter or buffer, not a module" if _is_tensor_name(model, name)
                    else "not a module of the model")
            raise PlanMismatchError(
                f"plan module {mp.fqn!r} is {what}: the plan file was edited or made for another "
                f"version of this {root}; re-plan it") from e
        names.append(name)
    return targets, names


def _is_tensor_name(model: torch.nn.Module, name: str) -> bool:
    return any(n == name for n, _ in itertools.chain(model.named_parameters(), model.named_buffers()))


def apply_plan(model: torch.nn.Module, plan: Plan, *, check_fingerprint: bool = True) -> AppliedPlan:
    """Checkpoint ``model``'s modules as ``plan`` says. Atomic: on any error the model is unchanged.

    ``model`` may be a ``torch.distributed.pipelining.PipelineStage``: its module is planned, and a
    pipeline stage's plan is checked to be that stage's (``planner.applying.pipeline``).

    Example::

        plan = solve_sac(model, budget_gib=40, step=TrainStep(inputs=batch))
        with apply_plan(model, plan):
            loss_fn(model(*batch), batch).backward()
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_plan needs a Plan, got {type(plan).__name__}")
    plan.validate()  # e.g. a module listed twice would be wrapped twice and never removed
    from planner.applying.pipeline import group_weight_backward, stage_target

    model, stage = stage_target(model, plan)  # a pipeline stage's plan on its PipelineStage
    _check_not_compiled(model)
    root = original_class_name(model)  # fully_shard renames GPT to FSDPGPT
    other = other_model(model, plan) if check_fingerprint else None
    if other is not None:
        stage_of = f" pipeline {plan.pipeline.describe()}" if plan.pipeline is not None else ""
        raise PlanMismatchError(
            f"this plan was made for {plan.model_name}{stage_of} (fingerprint {plan.model_fingerprint}), "
            f"not for this {other[0]} (fingerprint {other[1]}): module names, parameter shapes or "
            "dtypes differ. Re-plan with solve_sac(model, ...)"
        )
    why = layout_mismatch(plan.layout, model) if check_fingerprint else None
    if why is not None:
        raise PlanMismatchError(f"{why}: the plan's per-rank figures do not hold for this layout. Re-plan the "
                                "model as it is laid out (solve_sac on the parallelized model)")
    trainable = model_shape(model).trainable_numel
    if plan.trainable_numel and trainable > plan.trainable_numel:
        warnings.warn(
            f"{trainable - plan.trainable_numel:,} more parameter elements of this {root} require "
            "grad than when the plan was made (layers unfrozen since): their gradients and "
            "optimizer state are not in the plan's figures, its predicted peak no longer holds. "
            "Re-plan with solve_sac(model, ...) as the model now trains", StalePlanWarning, stacklevel=2)
    handle = apply_module_plans(model, plan.modules, planned_trainable_numel=plan.trainable_numel)
    handle.plan = plan
    if handle.modules and check_fingerprint:  # the layout and stage it runs in, at its first call
        handle.modules[0].forward.expect(plan.layout, plan.pipeline, check_stage=stage is None)
    if stage is not None and plan.pipeline is not None and plan.pipeline.split_backward and plan.modules:
        handle.undo.append(group_weight_backward(stage))
    return handle


def apply_module_plans(model: torch.nn.Module, modules: Iterable[ModulePlan], *,
                       planned_trainable_numel: int = 0) -> AppliedPlan:
    """Checkpoint ``model``'s modules as the module plans say (no fingerprint check: the planner's
    own verification trace uses it on the fake copy it traces). Atomic."""
    _check_not_compiled(model)
    check_plannable(model)
    targets, names = _resolve(model, modules)  # everything before touching the model
    _check_offload(targets)
    done: list[torch.nn.Module] = []
    # A lazy module grows its parameters at its first call: not a change to watch for.
    lazy = any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters())
    shape = None if lazy else model_shape(model)
    if shape is not None and planned_trainable_numel > shape.trainable_numel:
        # Applied during a freeze the plan was not made with: unfreezing back is in its figures.
        shape = dataclasses.replace(shape, trainable_numel=planned_trainable_numel)
    try:
        for (mod, mp), name in zip(targets, names):
            mod.forward = _planned_forward(mod, mp)
            parts = name.split(".") if name else []
            mod.forward.set_ancestors([model.get_submodule(".".join(parts[:d])) for d in range(len(parts))])
            if not done and shape is not None:  # one module checks the whole model (PlannedForward.watch)
                mod.forward.watch(shape)
            done.append(mod)
        _hook_siblings(model, targets)
        # Even for a plan with no module: its peak was traced with the cache off, and a budget
        # can fall between the cache-off and cache-on peaks.
        cache = hf_cache_off(model)
        if cache.configs:
            cache.__enter__()
            _mark_caches_off(model, cache.configs)
    except BaseException:
        for mod in done:
            _restore(mod)
        for mod in model.modules():
            offload.remove_sibling_hooks(mod)
        raise
    handle = AppliedPlan(model=model, plan=None, modules=done, number=next(_HANDLES))
    model.__dict__[_APPLIED] = handle.number
    for mod in done:
        mod.forward.handle = handle.number
    return handle


def _check_offload(targets: list[tuple[torch.nn.Module, ModulePlan]]) -> None:
    """An offloading module must not run inside another planned module: that one's recompute
    would run it again in backward, and its saved tensors are that one's to manage."""
    for _, mp in targets:
        offload.check_module_plan(mp)
    names = [mp.fqn for _, mp in targets]
    for _, mp in targets:
        if not mp.offloaded_ops:
            continue
        outer = next((n for n in names if mp.fqn.startswith(n + ".")), None)
        if outer is not None:
            raise OffloadError(
                f"module {mp.fqn!r} offloads but is nested in {outer!r}, which the plan also "
                f"checkpoints; offload in {outer!r} instead, or leave {outer!r} out of the plan"
            )


def _hook_siblings(model: torch.nn.Module, targets: list[tuple[torch.nn.Module, ModulePlan]]) -> None:
    """Unplanned modules beside an offloading module or beside one of its ancestors (the next
    module in forward order, at whatever level it is) prefetch what it offloaded
    (planner.applying.offload). Planned modules do it themselves; ancestors would do it too late."""
    planned = {id(mod) for mod, _ in targets}
    root = original_class_name(model)
    names = [_root_relative(mp.fqn, root) for _, mp in targets if mp.offloaded_ops]
    chain = {id(model.get_submodule(".".join(n.split(".")[:i]))) for n in names if n
             for i in range(len(n.split(".")) + 1)}  # offloading modules and their ancestors
    hooked: set[int] = set()
    for n in names:
        parts = n.split(".") if n else []
        for depth in range(len(parts)):
            for child in model.get_submodule(".".join(parts[:depth])).children():
                if id(child) not in planned | chain | hooked:
                    hooked.add(id(child))
                    child.register_forward_hook(offload.sibling_post_hook)


def _planned_forward(mod: torch.nn.Module, mp: ModulePlan) -> PlannedForward:
    original = mod.__dict__.get("forward")
    if getattr(original, "__self__", None) is mod:
        original = None if original.__func__ is type(mod).forward else original
    return PlannedForward(mod, mp, original)


def remove_plan(model: torch.nn.Module) -> int:
    """Undo every applied plan on ``model``; returns how many modules were restored."""
    n = sum(_restore(mod) for mod in model.modules())
    for mod in model.modules():
        offload.remove_sibling_hooks(mod)
        mod.__dict__.pop(_APPLIED, None)
    _restore_caches(model)
    offload.clear_pending()
    return n
