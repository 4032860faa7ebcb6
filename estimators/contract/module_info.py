"""What the estimators hand to the solver: plain numbers, one record per module.

``ModuleInfo`` is the only thing that crosses from ``estimators`` to ``solver``. It holds

* ``mod_order``      the module order of one traced step (forward/backward, pre/post);
* ``mod_stats``      one ``ModStats`` per module, in forward pre-order;
* ``memory_points``  the step's memory, by category, at the instants where a peak can occur.

The exact memory model the solver uses (see ``solver/sac_milp.py``)::

    memory(point) = (param + grad + optimizer) / world_size + activation + other
                    - sum of d_j over modules j with fw_post_op_j <= point.op_index < bw_pre_op_j
                    - d_j + g_j(r_j) y_j                  if point.recompute_of == j

where ``d_j = r_j * sac_memory_bytes_j + (forced_discard_bytes_j - checkpoint_retain_bytes_j) y_j``
is the activation memory module ``j`` discards under checkpointing, net of the inputs the
checkpoint holds, ``y_j`` says whether ``j`` is checkpointed and ``g_j`` is its recompute growth
(``recompute_growth_bytes``, linear between the curve's breakpoints).  Between two module boundaries
the discarded amount is constant, so the estimator emits one point per such interval (the
interval's highest live-bytes op) and the model is exact up to the recompute transients.

Names and meanings follow torch.distributed._tools (``ModuleInfo``, ``ModStats``, ``act_fw``...)
so that its users recognise them; units are in the field names.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "SCHEMA_VERSION",
    "Phase",
    "ModOrder",
    "SACOp",
    "TradeoffCurve",
    "ModStats",
    "MemoryPoint",
    "ModuleInfo",
    "ModuleInfoFormatError",
]

SCHEMA_VERSION = 1
_KIND = "sac_planner.ModuleInfo"


class ModuleInfoFormatError(ValueError):
    """A ModuleInfo file or dict that is corrupt, foreign, or from a newer version."""


class Phase(enum.StrEnum):
    """Part of the training step an op, a storage or a memory point belongs to.

    A ``str`` enum so that JSON files keep ``"fw"`` / ``"bw"`` / ``"optim"`` and code that
    compares with those strings keeps working; defined here (torch-free) so that the solver can
    name it too."""

    FW = "fw"
    """Model forward and the loss."""
    BW = "bw"
    OPTIM = "optim"


@dataclass(frozen=True, kw_only=True)
class ModOrder:
    """Fully qualified module names in the order their hooks would fire in one step."""

    fw_pre_order: tuple[str, ...]
    """Forward pre-order: a module before its children."""
    fw_post_order: tuple[str, ...]
    """Forward post-order: a module after its children."""
    bw_pre_order: tuple[str, ...]
    """Order in which modules' backward starts (first backward op of the module or a descendant)."""
    bw_post_order: tuple[str, ...]
    """Order in which modules' backward ends."""


@dataclass(frozen=True, kw_only=True)
class SACOp:
    """One forward op of a module call, as selective activation checkpointing sees it."""

    func: str
    """Aten overload name, e.g. ``aten.mm.default``."""
    occurrence: int
    """How many ops with the same ``func`` came before this one in the same module call.

    ``(func, occurrence)`` identifies the op at run time: the selective-checkpoint policy counts
    ops the same way in the forward and in the recompute."""
    runtime_ms: float
    """Estimated time to recompute this op, in milliseconds, over the module's calls: its kernel
    and the host's cost of re-running it (``DeviceSpec.recompute_op_ms``; a view launches no
    kernel and costs that alone)."""
    memory_bytes: int
    """Bytes freed if this op is recomputed instead of saved: its new output storages that autograd
    saves for backward inside this module only. 0 for views, in-place ops and unsaved outputs."""
    is_view: bool = False
    """View-like: aliases its input; always recomputed (never costs memory)."""
    inplace_parent: int = -1
    """For an in-place op, the index (in this table) of the op that created the storage it
    mutates; the two are saved or recomputed together. Its own index when that storage was made
    outside the module (the op must then be saved). -1 for ops that are not in-place."""
    reads_before_mutation: tuple[int, ...] = ()
    """Indices (in this table) of the ops that created storages this op reads before a later
    in-place op of the module mutates them; its own index for a storage made outside the module.
    A saved storage holds its mutated values, so a recompute of this op would read those; what
    that constrains is ``estimators.contract.sac_groups``' rule. Seen: the clone autograd makes
    of a conv output for ``SiLU(inplace=True)``'s backward, recomputed from the saved conv output
    after ``silu_`` had overwritten it, gave wrong gradients."""
    is_random: bool = False
    """Draws random numbers; all random ops of a module are recomputed together or not at all."""
    is_saved: bool = False
    """Autograd saved (part of) an output of this op for backward."""
    saved_inside: bool | None = None
    """An op of this module saves (part of) this op's output, or the storage it writes in place:
    torch's recompute stops early after the last such op (:func:`estimators.tracing.sac.last_saved`),
    and an output only later modules save (a block's output, which the next block saves) does
    not keep it going. None: not recorded (a hand-built table, a file from before this field),
    taken as ``is_saved``."""
    cache_cost_bytes: int = 0
    """Bytes a selective checkpoint would hold *only because it caches this op*: outputs autograd
    does not save (e.g. batch norm's output when only its statistics are saved). Such ops are
    always recomputed: caching them would cost memory the unplanned step never held."""


@dataclass(frozen=True, kw_only=True)
class TradeoffCurve:
    """Exact piecewise-linear recompute-time vs discarded-memory curve of one module.

    Breakpoints follow the greedy recompute order (most memory freed per ms first), so the curve is
    convex; ``discarded_bytes[0] == 0`` and ``recompute_ms[0] == 0``."""

    discarded_bytes: tuple[int, ...] = (0,)
    recompute_ms: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        if len(self.discarded_bytes) != len(self.recompute_ms) or not self.discarded_bytes:
            raise ValueError("TradeoffCurve needs as many recompute_ms as discarded_bytes (>= 1)")
        if self.discarded_bytes[0] != 0 or self.recompute_ms[0] != 0:
            raise ValueError("TradeoffCurve must start at (0 bytes, 0 ms)")
        if any(b < a for a, b in zip(self.discarded_bytes, self.discarded_bytes[1:])):
            raise ValueError("TradeoffCurve.discarded_bytes must be non-decreasing")

    @property
    def total_bytes(self) -> int:
        return self.discarded_bytes[-1]

    @property
    def total_ms(self) -> float:
        return self.recompute_ms[-1]

    def normalized(self) -> tuple[list[float], list[float]]:
        """Breakpoints as (discard ratio, recompute fraction), both in [0, 1]."""
        tb, tm = self.total_bytes, self.total_ms
        xs = [b / tb if tb else 0.0 for b in self.discarded_bytes]
        ys = [m / tm if tm else 0.0 for m in self.recompute_ms]
        return xs, ys

    def lower_convex_envelope(self) -> list[tuple[float, float]]:
        """(slope, intercept) of each segment of the lower convex envelope in normalized units.

        ``recompute_fraction(r) = max_s(slope_s * r + intercept_s)`` for ``r`` in [0, 1]; a MILP
        uses one ``>=`` constraint per segment. Vertical steps (memory-free ops) are dropped."""
        xs, ys = self.normalized()
        # The greedy order makes the hull the curve itself.
        return lower_hull_segments(list(zip(xs, ys)))

    def recompute_ms_at(self, discarded_bytes: float) -> float:
        """Recompute time of discarding ``discarded_bytes`` along the curve (linear in between)."""
        if discarded_bytes <= 0:
            return 0.0
        xs, ys = self.discarded_bytes, self.recompute_ms
        if discarded_bytes >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_left(xs, discarded_bytes, 1)  # first breakpoint at or past it
        span = xs[i] - xs[i - 1]
        t = (discarded_bytes - xs[i - 1]) / span if span else 1.0
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


def lower_hull(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Vertices of the lower convex hull of ``points``, left to right (Andrew's monotone chain).
    Torch-free, for the solver too."""
    pts = sorted(set(points))
    return [pts[k] for k in lower_hull_indices([x for x, _ in pts], [y for _, y in pts])]


def lower_hull_indices(xs: Sequence[float], ys: Sequence[float], i: int = 0,
                       j: int | None = None) -> list[int]:
    """Indices of the lower convex hull's vertices among points ``i..j`` (default: all) of
    ``(xs, ys)``, x nondecreasing, left to right; of points with equal x only the lowest counts.
    Python lists are several times faster here than numpy arrays (scalar access)."""
    hull: list[int] = []
    for k in range(i, len(xs) if j is None else j + 1):
        xk, yk = xs[k], ys[k]
        if hull and xs[hull[-1]] == xk:
            if yk >= ys[hull[-1]]:
                continue
            hull.pop()
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            if (xs[a] - xs[o]) * (yk - ys[o]) - (ys[a] - ys[o]) * (xk - xs[o]) <= 0:
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def lower_hull_segments(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(slope, intercept) of each segment of the lower convex hull of ``points``, left to right;
    vertical steps are dropped."""
    hull = lower_hull(points)
    segs = []
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        if x1 - x0 > 1e-15:
            slope = (y1 - y0) / (x1 - x0)
            segs.append((slope, y0 - slope * x0))
    return segs


@dataclass(frozen=True, kw_only=True)
class ModStats:
    """Memory, runtime and SAC trade-off of one module (summed over its calls in the step)."""

    fqn: str
    """Fully qualified name, torch's ModTracker style: the root is its class name (``"GPT"``) and
    children are prefixed with it (``"GPT.blocks.0.attn"``)."""
    is_leaf: bool
    """No submodules; leaf modules are never checkpointed."""
    n_calls: int = 1
    """Times the module ran in the traced forward."""
    param_bytes: int = 0
    """Unique parameter bytes of the module and its descendants."""
    grad_bytes: int = 0
    """Gradient bytes of those parameters."""
    input_bytes: int = 0
    """Bytes of the module's tensor inputs (unique storages, first call)."""
    output_bytes: int = 0
    """Bytes of the module's tensor outputs (unique new storages, first call)."""
    act_fw_bytes: int = 0
    """Activation bytes autograd saved for backward while this module's forward ran (unique
    storages, parameters excluded); torch's ``act_fw_per_module``."""
    act_total_bytes: int = 0
    """Activation + temporary bytes alive when this module's forward ended (all modules so far)."""
    grad_total_bytes: int = 0
    """Parameter-gradient bytes alive when this module's backward started."""
    act_bw_peak_bytes: int = 0
    """Highest activation + temporary bytes during this module's backward."""
    act_grad_bytes: int = 0
    """Growth of temporary bytes (activation gradients) from the start to the peak of backward."""
    fw_runtime_ms: float = 0.0
    bw_runtime_ms: float = 0.0
    sac_memory_bytes: int = 0
    """Activation bytes checkpointing this module can discard (= tradeoff.total_bytes)."""
    sac_runtime_ms: float = 0.0
    """Time to recompute all of it (= tradeoff.total_ms)."""
    recompute_fixed_ms: float = 0.0
    """Time any selective checkpoint of this module costs, whatever the ratio: the recompute
    re-runs the ops whose outputs autograd does not save, up to the last op whose output it
    does; plus ``checkpoint_call_ms`` and ``selective_policy_ms``."""
    checkpoint_call_ms: float = 0.0
    """Host time of the checkpoint itself over the module's calls, beside the ops it re-runs
    (``DeviceSpec.checkpoint_call_ms`` per call, and ``checkpoint_submodule_ms`` per module
    nested in it): paid by every checkpoint of the module."""
    selective_policy_ms: float = 0.0
    """Host time of a selective policy over the module's calls: ``DeviceSpec.selective_op_ms``
    for every forward op and every op the recompute replays up to the last saved one, and
    ``selective_call_ms`` a call. Paid by a selective checkpoint, not by a full one."""
    full_recompute_ms: float = 0.0
    """Recompute time of a plain (full) checkpoint of this module: every op up to the last one
    autograd saves, and ``checkpoint_call_ms``; no policy. 0: discarding everything is not a
    full checkpoint here (some op must be saved)."""
    tradeoff: TradeoffCurve = field(default_factory=TradeoffCurve)
    ops: tuple[SACOp, ...] = ()
    """Forward ops of one call (leaf modules: empty), in execution order."""
    checkpoint_retain_bytes: int = 0
    """Input bytes a checkpoint of this module keeps alive until its backward that the unplanned
    step frees earlier (e.g. a fused qkv output the module only reads through views). A
    checkpointed module discards ``r * sac_memory_bytes - checkpoint_retain_bytes`` net."""
    recompute_transient_bytes: int = 0
    """Legacy transient (used only when ``recompute_growth_bytes`` is empty, e.g. for imported
    torch stats): bytes added on top of the unplanned memory at the start of the module's
    backward when it is checkpointed."""
    recompute_growth_bytes: tuple[int, ...] = ()
    """Highest growth of live bytes while the checkpoint recomputes this module at the start of its
    backward, one entry per breakpoint of ``tradeoff`` (entry k: the first k greedy units plus the
    ops every checkpoint recomputes are re-run; cached ops allocate nothing). It counts the
    recomputed activations as they come back and the recompute's temporaries, up to the last op
    whose output the module saves (early stop). At that instant the memory is the unplanned one
    minus what was discarded plus this growth. Empty: use ``recompute_transient_bytes``."""
    forced_discard_bytes: int = 0
    """Activation bytes any checkpoint of this module discards whatever the ratio: saved outputs
    of the ops it always recomputes (e.g. ops grouped with an output autograd does not keep).
    They are not on ``tradeoff`` because they are not a choice."""
    fw_pre_op: int = -1
    """Op index (in the step trace) of the module's first forward op; -1 if never ran."""
    fw_post_op: int = -1
    """First op index after the module's forward ended (last call): from here on its discarded
    activations are gone."""
    bw_pre_op: int = -1
    """Op index of the module's first backward op; -1 if it has no backward."""
    bw_post_op: int = -1
    """Op index of the module's last backward op."""
    input_numel: int = 0
    """Elements of the tensors the module's calls take (the largest call's), as traced: what a
    planned module compares its inputs with (a bigger batch or sequence outgrows the plan)."""
    sac_blocker: str = ""
    """Why checkpointing this module would be unsafe ("" when it is not): its forward mutates in
    place a tensor made before the call (the recompute would mutate it again), or its calls in
    one step run different ops (one per-call plan cannot name them). The planner excludes it."""


@dataclass(frozen=True, kw_only=True)
class MemoryPoint:
    """Live memory at one instant of the traced step, by category, in bytes."""

    op_index: int
    """Op index of the instant (same numbering as ModStats.fw_pre_op etc.)."""
    phase: Phase
    """Step phase of the instant (a ``"fw"`` / ``"bw"`` / ``"optim"`` string is converted)."""
    fqn: str = ""
    """Innermost module running at that instant ("" outside every module)."""
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    """Tensors autograd saved for backward, still alive."""
    other_bytes: int = 0
    """Everything else: temporaries, activation gradients, inputs, buffers."""
    recompute_of: str | None = None
    """Set on the point at the start of module ``recompute_of``'s backward, where its recompute's
    temporaries are added when it is checkpointed."""
    recompute_in_window: str | None = None
    """Set on a point where module ``recompute_in_window`` recomputes while its discard still
    holds (a pipeline's split backward: the input half recomputes and frees again; the window
    ends at the weight half): the memory change there is the recompute's growth alone."""
    grad_written_bytes: int | None = None
    """Parameter-gradient bytes the traced backward has written before this instant, for a loop
    whose gradients are None as each backward starts (FSDP2's unsharded parameters): a gradient
    counts from the op after the one that frees its ``dw``, which the trace counts until then
    (``estimators.tracing.memory.gradient_writes``). None: not recorded."""
    in_flight: tuple[tuple[str, int], ...] = ()
    """Pipeline schedules: ``(module, n)`` pairs: n more micro-batches of the stage whose root is
    ``module`` are in flight at this instant (forward done, backward not), each holding its
    activations less everything the plan discards under that root. Empty: one micro-batch."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_flight", tuple((str(g), int(n)) for g, n in self.in_flight))
        if not isinstance(self.phase, Phase):
            try:
                object.__setattr__(self, "phase", Phase(self.phase))
            except ValueError:
                known = ", ".join(repr(p.value) for p in Phase)
                raise ValueError(f"MemoryPoint.phase must be one of {known}, got {self.phase!r}") from None

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.other_bytes
        )


@dataclass(frozen=True, kw_only=True)
class ModuleInfo:
    """Module order, per-module stats and the memory timeline of one traced training step."""

    mod_order: ModOrder
    mod_stats: tuple[ModStats, ...]
    """In forward pre-order; the first entry is the root."""
    memory_points: tuple[MemoryPoint, ...] = ()
    peak_bytes: int = 0
    """Step peak without any checkpointing."""
    peak_op_index: int = -1
    peak_op: str = ""
    """Aten op at which the peak happens, with its module."""
    fw_runtime_ms: float = 0.0
    bw_runtime_ms: float = 0.0
    optimizer_runtime_ms: float = 0.0
    device: str = ""
    """DeviceSpec name the numbers were estimated for."""

    def __post_init__(self) -> None:
        names = [s.fqn for s in self.mod_stats]
        if len(set(names)) != len(names):
            raise ValueError("ModuleInfo.mod_stats has duplicate fqns")

    @property
    def step_runtime_ms(self) -> float:
        return self.fw_runtime_ms + self.bw_runtime_ms + self.optimizer_runtime_ms

    def stats(self, fqn: str) -> ModStats:
        for s in self.mod_stats:
            if s.fqn == fqn:
                return s
        raise KeyError(f"no module named {fqn!r} in this ModuleInfo")

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {"kind": _KIND, "version": SCHEMA_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModuleInfo":
        if not isinstance(d, dict) or d.get("kind") != _KIND:
            raise ModuleInfoFormatError(
                "not a SAC Planner ModuleInfo (missing kind='sac_planner.ModuleInfo'); "
                "for torch.distributed._tools output use estimators.contract.import_torch.module_info_from_torch_dict"
            )
        version = d.get("version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ModuleInfoFormatError(
                f"ModuleInfo version {version!r} is newer than this SAC Planner understands "
                f"({SCHEMA_VERSION}); upgrade sac-planner or re-run the estimator"
            )
        try:
            order = ModOrder(**{k: tuple(v) for k, v in d["mod_order"].items()})
            stats = tuple(_mod_stats_from_dict(s) for s in d["mod_stats"])
            points = tuple(MemoryPoint(**p) for p in d.get("memory_points", ()))
            rest = {
                k: d[k]
                for k in (
                    "peak_bytes",
                    "peak_op_index",
                    "peak_op",
                    "fw_runtime_ms",
                    "bw_runtime_ms",
                    "optimizer_runtime_ms",
                    "device",
                )
                if k in d
            }
            return cls(mod_order=order, mod_stats=stats, memory_points=points, **rest)
        except (KeyError, TypeError, ValueError) as e:
            raise ModuleInfoFormatError(f"corrupt ModuleInfo: {e}") from e

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ModuleInfo":
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        text = p.read_text() if p is not None else str(text_or_path)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ModuleInfoFormatError(f"ModuleInfo JSON does not parse: {e}") from e
        return cls.from_dict(d)


def _mod_stats_from_dict(s: dict[str, Any]) -> ModStats:
    s = dict(s)
    tc = s.pop("tradeoff", None) or {}
    ops = tuple(SACOp(**{**o, "reads_before_mutation": tuple(o.get("reads_before_mutation", ()))})
                for o in s.pop("ops", ()))
    curve = TradeoffCurve(
        discarded_bytes=tuple(tc.get("discarded_bytes", (0,))),
        recompute_ms=tuple(tc.get("recompute_ms", (0.0,))),
    )
    if "recompute_growth_bytes" in s:
        s["recompute_growth_bytes"] = tuple(s["recompute_growth_bytes"])
    return ModStats(tradeoff=curve, ops=ops, **s)


def finite_or_raise(values: Iterable[float], what: str) -> None:
    """Raise if any value is NaN or infinite (used by importers)."""
    for v in values:
        if not math.isfinite(v):
            raise ModuleInfoFormatError(f"{what} contains a non-finite number: {v}")
