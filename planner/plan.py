"""The Plan: what to checkpoint, which ops to save, and what the planner predicts for it.

A Plan is plain data with a versioned JSON form, so it can be saved, diffed, reviewed and applied
to the same model later (``apply_plan`` checks the model fingerprint first).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["OpKey", "ModulePlan", "Plan", "PlanFormatError", "StepMismatchError", "StepRecord",
           "model_fingerprint", "op_key"]

PLAN_VERSION = 1
_KIND = "sac_planner.Plan"
from planner.distributed.layout import LayoutRecord
from planner.errors import PlanFormatError, StepMismatchError
from planner.plan_pipeline import PipelineRecord
from planner.plan_summary import plan_summary
from planner.plan_fields import (MAX_BYTES, MAX_COUNT, MAX_JSON_DEPTH, MAX_MODULES, MAX_NOTE_CHARS, MAX_NOTES,
                                 MAX_PLAN_FILE_BYTES,
                                 check_bool, check_float, check_int, check_str, fields_of, op_keys, short)
from planner.safe_io import FileRefusedError, parse_json, read_regular_file, write_atomic
# Written by plan files of the first release: a timing, not part of the plan (read and dropped).
_LEGACY_FIELDS = frozenset({"solve_time_s"})

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


@dataclass(frozen=True, kw_only=True)
class ModulePlan:
    """How one module is checkpointed."""

    fqn: str
    """Module name as in ModuleInfo (root class name first, e.g. ``GPT.blocks.3``)."""
    discard_ratio: float
    """Fraction of the module's recomputable activation memory (the bytes of every op that is not
    forced to be saved) that the op plan discards, in [0, 1]."""
    full: bool
    """Plain full checkpointing (ratio 1): every op is recomputed, no policy."""
    saved_ops: tuple[OpKey, ...] = ()
    """Ops whose outputs are kept (MUST_SAVE); every other op is recomputed."""
    recomputed_ops: tuple[OpKey, ...] = ()
    """Ops autograd would have saved that are recomputed instead (for reading; not used to apply)."""
    discarded_bytes: int = 0
    recompute_ms: float = 0.0
    offloaded_ops: tuple[OpKey, ...] = ()
    """Ops of the module whose outputs, where autograd saves them for backward, are copied to host
    memory in forward and brought back in backward (prefetched one module ahead)."""
    offloaded_bytes: int = 0
    """Bytes the planner predicts ``offloaded_ops`` send to host per micro-batch (one forward),
    over all calls of the module, in its memory model (``ModStats`` op bytes); 0: none, or a
    hand-written plan that does not say."""
    input_numel: int = 0
    """Elements of the tensors the module was traced with (its largest call); a planned forward
    given more (a bigger batch, a longer sequence) warns that the plan no longer holds. 0: not
    recorded (a hand-written plan, or one saved before this field)."""

    def __post_init__(self) -> None:
        w = f"module {short(self.fqn)}" if isinstance(self.fqn, str) else "module"
        check_str(f"{w}: fqn", self.fqn, nonempty=True)
        set_ = functools.partial(object.__setattr__, self)
        set_("discard_ratio", check_float(f"{w}: discard_ratio", self.discard_ratio, high=1.0))
        set_("full", check_bool(f"{w}: full", self.full))
        set_("saved_ops", op_keys(f"{w}: saved_ops", self.saved_ops))
        set_("recomputed_ops", op_keys(f"{w}: recomputed_ops", self.recomputed_ops))
        set_("discarded_bytes", check_int(f"{w}: discarded_bytes", self.discarded_bytes))
        set_("recompute_ms", check_float(f"{w}: recompute_ms", self.recompute_ms))
        if self.full and self.saved_ops:
            raise PlanFormatError(
                f"{w}: full checkpointing saves no op, but saved_ops lists {len(self.saved_ops)}"
            )
        both = set(self.saved_ops) & set(self.recomputed_ops)
        if both:
            raise PlanFormatError(f"{w}: op {list(min(both))} is both saved and recomputed")
        set_("offloaded_ops", op_keys(f"{w}: offloaded_ops", self.offloaded_ops))
        set_("offloaded_bytes", check_int(f"{w}: offloaded_bytes", self.offloaded_bytes))
        set_("input_numel", check_int(f"{w}: input_numel", self.input_numel))
        if self.full and self.offloaded_ops:
            raise PlanFormatError(
                f"{w}: full checkpointing keeps no op output to offload, but offloaded_ops lists "
                f"{len(self.offloaded_ops)}; drop them or plan the module selectively (full=False)"
            )
        clash = set(self.offloaded_ops) & set(self.recomputed_ops)
        if clash:
            raise PlanFormatError(
                f"{w}: op {list(min(clash))} is both offloaded and recomputed; an op's output is "
                "either recomputed or offloaded, not both"
            )


_ZERO_GRADS = ("set_to_none", "zero")
_AUTOCASTS = ("none", "bfloat16", "float16")
TRAIN_MODES = {"auto": None, "train": True, "as_is": False}
"""How a plan file (and the CLI's ``--train-mode``) spells ``TrainStep.train_mode``."""


def optimizer_name(optimizer: Any) -> str:
    """The name a step's optimizer is recorded under: ``"adamw"`` for the string, the class or
    an instance alike; a factory function's ``__name__``; ``"none"`` for no optimizer."""
    if optimizer is None:
        return "none"
    if isinstance(optimizer, str):
        return optimizer.lower()
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if issubclass(cls, torch.optim.Optimizer):
        return cls.__name__.lower()
    return getattr(optimizer, "__name__", type(optimizer).__name__)


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """The training step a plan was made for (``estimators.step.train_step.TrainStep`` as plain data): the
    plan's peaks hold only for this loop, so a loaded plan is checked against the step it is run
    with (``Plan.check_step``)."""

    optimizer: str
    """``optimizer_name`` of the step's optimizer (``"adamw"``; ``"none"``: no optimizer step)."""
    micro_batches: int
    """Forward/backward passes per optimizer step."""
    zero_grad: str
    """``"set_to_none"`` or ``"zero"`` (``ZeroGrad`` values)."""
    autocast: str
    """``"none"``, ``"bfloat16"`` or ``"float16"``: the forward's autocast dtype."""
    keep_output: bool
    """The loop holds the model output through backward (``TrainStep.keep_output``)."""
    train_mode: str = "auto"
    """``TrainStep.train_mode``: ``"auto"`` (None: a model in eval mode runs as ``model.train()``
    leaves it), ``"train"`` (True) or ``"as_is"`` (False). Plans saved before it: ``"auto"``."""

    def __post_init__(self) -> None:
        check_str("step: optimizer", self.optimizer, nonempty=True)
        object.__setattr__(self, "micro_batches", check_int("step: micro_batches", self.micro_batches, low=1, high=MAX_COUNT))
        for name, known in (("zero_grad", _ZERO_GRADS), ("autocast", _AUTOCASTS), ("train_mode", tuple(TRAIN_MODES))):
            if getattr(self, name) not in known:
                raise PlanFormatError(f"step: {name} must be one of {', '.join(known)}, got {short(getattr(self, name))}")
        check_bool("step: keep_output", self.keep_output)

    @classmethod
    def of(cls, step: Any) -> "StepRecord":
        """The record of a ``TrainStep``."""
        dt = step.autocast_dtype
        return cls(optimizer=optimizer_name(step.optimizer), micro_batches=step.micro_batches,
                   zero_grad=step.zero_grad.value, keep_output=step.keep_output,
                   autocast="none" if dt is None else str(dt).replace("torch.", ""),
                   train_mode=next(k for k, v in TRAIN_MODES.items() if v is getattr(step, "train_mode", None)))

    @property
    def train_mode_flag(self) -> bool | None:
        """``train_mode`` as ``TrainStep`` takes it."""
        return TRAIN_MODES[self.train_mode]

    def differences(self, other: "StepRecord") -> tuple[tuple[str, Any, Any], ...]:
        """``(field, this value, other value)`` for every field where the two steps differ."""
        return tuple((f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                     if getattr(self, f.name) != getattr(other, f.name))


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
    """Predicted extra time spent recomputing in one micro-batch's backward (the whole step's
    with one micro-batch; a step of k micro-batches recomputes k times this)."""
    baseline_step_ms: float
    """Predicted time without checkpointing of one micro-batch's forward + backward plus the
    optimizer step (the whole step with one micro-batch)."""
    solver_status: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    first_step_peak_bytes: int | None = None
    """Peak of the first step of a fresh run (no optimizer state before its optimizer phase)."""
    steady_peak_bytes: int | None = None
    """Peak of the steady-state step (step 2 on); ``predicted_peak_bytes`` is the larger one."""
    host_peak_bytes: int = 0
    """Bytes of offloaded activations resident in host memory at once: one micro-batch's (they
    leave the device in its forward and are back before the next micro-batch's forward), the
    host memory a run needs. Compare with ``host_bytes_per_step`` for what a step moves."""
    host_bytes_per_step: int = 0
    """Bytes copied device -> host per optimizer step: ``host_peak_bytes`` times the step's
    micro-batches. What ``AppliedPlan.host_bytes_offloaded`` counts over one step (0: no
    offload, or a plan file written before this field existed)."""
    compute_ms: float = 0.0
    """Step timeline (``estimators/contract/timeline.py``): forward + backward + optimizer compute."""
    exposed_comm_ms: float = 0.0
    """Collective time the compute stream waits for (FSDP2 all-gather / reduce-scatter)."""
    exposed_copy_ms: float = 0.0
    """Offload copy time the compute stream waits for."""
    step_ms: float = 0.0
    """Predicted time of one micro-batch plus the optimizer step, as ``baseline_step_ms``:
    compute + recompute + exposed comm + exposed copies (0: not costed, e.g. a plan file written
    before the timeline existed)."""
    trainable_numel: int = 0
    """Elements of the parameters that required grad when planned: their gradients and optimizer
    state are in the figures (0: a plan file written before this field existed). The fingerprint
    leaves ``requires_grad`` out; ``apply_plan`` warns where more train now."""
    step: StepRecord | None = None
    """The training step the plan was made for (optimizer, micro-batches, zero_grad, autocast,
    keep_output); None: a plan file written before plans recorded it."""
    layout: LayoutRecord | None = None
    """The parallel layout the per-rank figures are for (tensor-parallel placements, FSDP2
    units and group size; ``planner.distributed.layout``); None: one process, or a plan file
    written before plans recorded it. ``apply_plan`` refuses a model laid out otherwise."""
    pipeline: PipelineRecord | None = None
    """A pipeline stage's plan: the stage, schedule and layout it holds for (the peak is the
    rank's over its schedule) and the stage's times; None: not a pipeline stage."""
    solve_time_s: float = field(default=0.0, compare=False, repr=False)
    """Wall time of the solve. A timing, not part of the plan: left out of equality, of the JSON
    (so of ``plan_hash``), so identical solves give identical plans; 0 for a loaded plan."""
    train_step: Any = field(default=None, compare=False, repr=False, metadata={"saved": False})
    """The ``TrainStep`` the plan was made for, in memory only (never saved, not compared): what
    ``check_gradients(model, plan)`` runs. None for a loaded plan."""

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        mods = self.modules
        if isinstance(mods, (str, bytes, dict)) or not isinstance(mods, (list, tuple)):
            raise PlanFormatError(f"modules must be a list of module plans, got {type(mods).__name__}")
        if len(mods) > MAX_MODULES:
            raise PlanFormatError(f"modules lists {len(mods):,} modules, more than the {MAX_MODULES:,} a plan takes")
        for i, m in enumerate(mods):
            if not isinstance(m, ModulePlan):
                raise PlanFormatError(f"modules[{i}] must be a ModulePlan, got {type(m).__name__}")
        fqns = [m.fqn for m in mods]
        dup = sorted({f for f in fqns if fqns.count(f) > 1})
        if dup:
            # Applying a module twice would wrap it twice and leave it unremovable.
            raise PlanFormatError(f"the plan lists module(s) {', '.join(map(repr, dup))} more than once")
        set_("modules", tuple(mods))
        for name in ("model_name", "model_fingerprint", "device", "solver_status"):
            check_str(name, getattr(self, name), nonempty=name in ("model_name", "device"))
        set_("world_size", check_int("world_size", self.world_size, low=1, high=MAX_COUNT))
        set_("budget_bytes", check_int("budget_bytes", self.budget_bytes, low=1))
        set_("reserve_bytes", check_int("reserve_bytes", self.reserve_bytes))
        if self.reserve_bytes >= self.budget_bytes:
            raise PlanFormatError(
                f"reserve_bytes ({self.reserve_bytes}) must be below budget_bytes ({self.budget_bytes})"
            )
        for name in ("predicted_peak_bytes", "solver_peak_bytes", "baseline_peak_bytes"):
            set_(name, check_int(name, getattr(self, name)))
        for name in ("recompute_ms", "baseline_step_ms", "compute_ms", "exposed_comm_ms",
                     "exposed_copy_ms", "step_ms"):
            set_(name, check_float(name, getattr(self, name)))
        set_("host_peak_bytes", check_int("host_peak_bytes", self.host_peak_bytes))
        set_("host_bytes_per_step", check_int("host_bytes_per_step", self.host_bytes_per_step, high=MAX_BYTES * MAX_COUNT))
        set_("trainable_numel", check_int("trainable_numel", self.trainable_numel))
        notes = self.notes
        if isinstance(notes, (str, bytes)) or not isinstance(notes, (list, tuple)):
            raise PlanFormatError(f"notes must be a list of strings, got {short(notes)}")
        if len(notes) > MAX_NOTES:
            raise PlanFormatError(f"notes lists {len(notes):,} notes, more than the {MAX_NOTES:,} a plan takes")
        set_("notes", tuple(check_str(f"notes[{i}]", n, max_chars=MAX_NOTE_CHARS) for i, n in enumerate(notes)))
        set_("solve_time_s", check_float("solve_time_s", self.solve_time_s))
        for name in ("first_step_peak_bytes", "steady_peak_bytes"):
            if getattr(self, name) is not None:
                set_(name, check_int(name, getattr(self, name)))
        if self.step is not None and not isinstance(self.step, StepRecord):
            raise PlanFormatError(f"step must be a StepRecord or None, got {type(self.step).__name__}")
        if self.layout is not None and not isinstance(self.layout, LayoutRecord):
            raise PlanFormatError(f"layout must be a LayoutRecord or None, got {type(self.layout).__name__}")
        if self.layout is not None and self.layout.fsdp_world_size not in (1, self.world_size):
            raise PlanFormatError(f"layout.fsdp_world_size ({self.layout.fsdp_world_size:,}) is not the plan's "
                                  f"world_size ({self.world_size:,}): the per-rank figures are for one of them")
        if self.pipeline is not None and not isinstance(self.pipeline, PipelineRecord):
            raise PlanFormatError(f"pipeline must be a PipelineRecord or None, got {type(self.pipeline).__name__}")

    def validate(self) -> None:
        """Re-run every check (PlanFormatError): ``apply_plan`` calls it, since a frozen
        dataclass can still be changed behind its back (``object.__setattr__``)."""
        for m in self.modules if isinstance(self.modules, (list, tuple)) else ():
            if isinstance(m, ModulePlan):
                m.__post_init__()
        self.__post_init__()

    @property
    def binding_step(self) -> str:
        """``"steady state"``, ``"first step"``, or ``""`` for a plan that does not say."""
        if self.first_step_peak_bytes is None or self.steady_peak_bytes is None:
            return ""
        return "first step" if self.first_step_peak_bytes > self.steady_peak_bytes else "steady state"

    def check_step(self, step: Any) -> None:
        """Raise ``StepMismatchError`` if ``step`` (a ``TrainStep`` or ``StepRecord``) is not the
        step this plan was made for: its peaks would not hold (a loop that keeps the output, more
        micro-batches, another optimizer or autocast each change the memory). A plan that does
        not record its step (``step`` None, an older file) cannot be checked and passes."""
        if self.step is None:
            return
        given = step if isinstance(step, StepRecord) else StepRecord.of(step)
        diff = self.step.differences(given)
        if diff:
            raise StepMismatchError(
                "the plan was made for another training step: "
                + "; ".join(f"{name} {planned!r} in the plan, {got!r} in this step" for name, planned, got in diff)
                + "; run the step the plan was made for, or re-plan for this one"
            )

    @property
    def usable_budget_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return tuple(m.fqn for m in self.modules)

    @property
    def offloading(self) -> tuple[str, ...]:
        """Modules that send saved activations to host memory."""
        return tuple(m.fqn for m in self.modules if m.offloaded_ops)

    def module(self, fqn: str) -> ModulePlan:
        for m in self.modules:
            if m.fqn == fqn:
                return m
        raise KeyError(f"module {fqn!r} is not checkpointed by this plan")

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``kind``, ``version``, then every field but the timing)."""
        body = dataclasses.asdict(dataclasses.replace(self, train_step=None))
        del body["solve_time_s"], body["train_step"]
        return {"kind": _KIND, "version": PLAN_VERSION, **body}

    def to_json(self) -> str:
        """Deterministic text: identical plans give byte-identical files."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` atomically: the file is the old plan or the new one, never a
        part (a full disk leaves the old plan). ``FileRefusedError`` (planner.safe_io) where
        ``path`` exists and is not a regular file; ``OSError`` where the system refuses."""
        write_atomic(path, self.to_json().encode("utf-8"), what=f"plan file {path}")

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        """Check every field (types, ranges, duplicates, version) -> Plan, or one PlanFormatError."""
        if not isinstance(d, dict) or d.get("kind") != _KIND:
            raise PlanFormatError("not a SAC Planner plan (kind != 'sac_planner.Plan')")
        _check_version(d.get("version", _MISSING))
        try:
            body = fields_of("the plan", {k: v for k, v in d.items() if k not in ("kind", "version")},
                           cls, _LEGACY_FIELDS)
            mods = body["modules"]
            if not isinstance(mods, list):
                raise PlanFormatError(f"modules must be a list, got {type(mods).__name__}")
            if len(mods) > MAX_MODULES:  # before building any
                raise PlanFormatError(f"modules lists {len(mods):,} modules, more than the {MAX_MODULES:,} a plan takes")
            body["modules"] = tuple(
                ModulePlan(**fields_of(f"modules[{i}]", m, ModulePlan)) for i, m in enumerate(mods)
            )
            if "notes" in body and isinstance(body["notes"], list):
                body["notes"] = tuple(body["notes"])
            if body.get("step") is not None:
                body["step"] = StepRecord(**fields_of("step", body["step"], StepRecord))
            if body.get("layout") is not None:
                body["layout"] = LayoutRecord(**fields_of("layout", body["layout"], LayoutRecord))
            if body.get("pipeline") is not None:
                body["pipeline"] = PipelineRecord.from_dict(body["pipeline"])
            return cls(**body)
        except PlanFormatError as e:
            raise PlanFormatError(f"corrupt plan: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan file; PlanFormatError (one line) for anything that is not a valid plan:
        not a regular file (a FIFO, a device), over ``MAX_PLAN_FILE_BYTES``, not UTF-8 JSON,
        JSON beyond the reader's limits, or fields out of range. ``OSError`` where the system
        refuses (no such file, no permission)."""
        what = f"plan file {path}"
        try:
            raw = read_regular_file(path, max_bytes=MAX_PLAN_FILE_BYTES, what=what)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                kind = "a Python pickle" if raw[:1] == b"\x80" else "binary data"
                raise PlanFormatError(f"{what} is {kind}, not a JSON plan; save plans with plan.save(path)") from None
            d = parse_json(text, what=what, max_depth=MAX_JSON_DEPTH)
        except FileRefusedError as e:
            raise PlanFormatError(str(e)) from None
        return cls.from_dict(d)

    def summary(self) -> str:

        return plan_summary(self)


_MISSING = object()


def _check_version(v: Any) -> None:
    if v is _MISSING:
        raise PlanFormatError("corrupt plan: no 'version' field; re-save it with Plan.save")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanFormatError(f"corrupt plan: version must be an integer >= 1, got {short(v)}")
    if v > PLAN_VERSION:
        raise PlanFormatError(
            f"plan version {v} is newer than this SAC Planner reads ({PLAN_VERSION}); "
            "upgrade sac-planner or re-plan with this version"
        )


def dtype_names(dtypes) -> str:
    """``float32/bfloat16``-style text of a set of dtypes."""
    return "/".join(sorted(str(d).replace("torch.", "") for d in dtypes))


@dataclass(frozen=True)
class ModelShape:
    """What of a model's parameters moves a plan's figures without renaming a module: how many
    elements, how many train (gradients and optimizer state grow with them), which dtypes."""

    numel: int
    trainable_numel: int
    dtypes: frozenset[str]

    def change(self, now: "ModelShape", *, dtypes: bool = True) -> str | None:
        """What differs in ``now`` that makes a plan made at this shape over-run, or None.
        Fewer trainable elements (a backbone frozen mid-run) only lowers the peak: not named."""
        if now.numel != self.numel:
            return (f"the model has {now.numel:,} parameter elements, {self.numel:,} when the plan "
                    "was applied (resized embeddings, added or removed layers)")
        if now.trainable_numel > self.trainable_numel:
            return (f"{now.trainable_numel - self.trainable_numel:,} more parameter elements require "
                    "grad than when the plan was applied (unfrozen layers: their gradients and "
                    "optimizer state are not in the plan)")
        if dtypes and now.dtypes != self.dtypes:
            return (f"the model's parameters are {dtype_names(now.dtypes)} now, "
                    f"{dtype_names(self.dtypes)} when the plan was applied")
        return None


def model_shape(model: torch.nn.Module) -> ModelShape:
    """Lazy modules' parameters not materialised yet (``nn.LazyLinear`` before its first call)
    have no size: left out."""
    from torch.nn.parameter import UninitializedParameter

    params = [p for p in model.parameters() if not isinstance(p, UninitializedParameter)]
    return ModelShape(numel=sum(p.numel() for p in params),
                      trainable_numel=sum(p.numel() for p in params if p.requires_grad),
                      dtypes=frozenset(str(p.dtype).replace("torch.", "") for p in params))


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of module names and parameter names, shapes and dtypes (not values, not device).

    The same before and after ``fully_shard``: FSDP2 renames a sharded module's class to
    ``FSDP<Name>`` (the original name is hashed) and its parameters become DTensors whose
    ``.shape`` is the global, unsharded shape.

    >>> model_fingerprint(torch.nn.Linear(2, 3)) == model_fingerprint(torch.nn.Linear(2, 3))
    True
    """
    from planner.distributed.fsdp import original_class_name

    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"m:{name}:{original_class_name(mod)}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"p:{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()[:16]
