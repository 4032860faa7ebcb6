"""The layouts the launch advisor weighs: a cluster, the search space, every layout in it, and the
ones that cannot run (a degree that does not divide) or cannot fit (their sharded state alone
fills the budget), each with its reason.

    cluster = Cluster.parse("64xh100")
    found = enumerate_layouts(llama_family(llama3_70b, 8192), cluster, global_batch=512,
                              space=SearchSpace())
    found.layouts, found.rejected          # what goes on to be planned; what does not, and why

A layout is torchtitan's mesh ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first: tensor
parallel ranks are neighbours on a node), with FSDP2 sharding over ``dp_shard x cp`` as torchtitan
shards, ``micro_batch`` sequences per forward on each data-parallel rank and ``accumulation``
forwards per optimizer step (under pipeline parallelism: the schedule's micro-batches), so that
``dp x micro_batch x accumulation`` is the global batch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

from estimators.runtime.device import DeviceSpec, Interconnect, get_device_spec, get_interconnect
from planner.errors import PlanningError
from planner.format import GiB, fmt_bytes
from planner.planning.reserve import default_reserve_bytes

__all__ = ["Cluster", "Layout", "SearchSpace", "Rejected", "Enumerated", "enumerate_layouts", "SCHEDULES"]

SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
    "LoopedBFS": ("ScheduleLoopedBFS", 2),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2),
}
"""torchtitan's schedule names -> (torch's class name, stages per rank as torchtitan lays them)."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The GPUs a job gets: how many, which kind, how they are linked."""

    n_gpus: int
    device: str | DeviceSpec = "h100"
    """The accelerator (``estimators.runtime.device``): its memory, peak FLOP/s and node link."""
    gpus_per_node: int = 8
    """GPUs sharing the node's link (NVLink); a group of ranks spread over nodes runs at
    ``inter_node_link``'s speed."""
    inter_node_link: str | Interconnect = "infiniband-ndr"
    """The link between nodes, per GPU (one 400 Gb/s NIC per GPU: ``infiniband-ndr``)."""
    budget_gib: float | None = None
    """Memory per GPU a plan may use, GiB; None: the device's memory."""

    def __post_init__(self) -> None:
        for name in ("n_gpus", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanningError(f"Cluster.{name} must be an int >= 1, got {v!r}")
        get_device_spec(self.device)
        get_interconnect(self.inter_node_link)
        if self.budget_gib is not None and not (isinstance(self.budget_gib, (int, float)) and self.budget_gib > 0):
            raise PlanningError(f"Cluster.budget_gib must be a positive number of GiB or None, got {self.budget_gib!r}")

    @classmethod
    def parse(cls, text: str, **changes) -> "Cluster":
        """``"64xh100"`` (count x device name) -> Cluster; ``changes`` set the other fields."""
        m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*([\w.-]+)\s*", str(text))
        if m is None:
            raise PlanningError(f"a cluster is COUNTxDEVICE, e.g. 64xh100; got {text!r}")
        return cls(n_gpus=int(m[1]), device=m[2], **changes)

    @property
    def spec(self) -> DeviceSpec:
        return get_device_spec(self.device)

    @property
    def budget_bytes(self) -> int:
        return int((self.budget_gib if self.budget_gib is not None else self.spec.memory_bytes / GiB) * GiB)

    @property
    def usable_bytes(self) -> int:
        """The budget less the device's default reserve (``planner.planning.reserve``)."""
        return self.budget_bytes - default_reserve_bytes(self.spec, self.budget_bytes)

    def link(self, group_size: int, stride: int) -> Interconnect:
        """The link a group of ``group_size`` ranks, ``stride`` ranks apart, runs its collectives on:
        the node's where the group lies within a node (ranks are numbered node by node)."""
        if group_size <= 1 or stride * group_size <= self.gpus_per_node:
            return self.spec.collective_link or get_interconnect(self.inter_node_link)
        return get_interconnect(self.inter_node_link)

    def describe(self) -> str:
        spec = self.spec
        return (f"{self.n_gpus} x {spec.name} ({self.gpus_per_node} per node, "
                f"{get_interconnect(self.inter_node_link).name} between nodes), "
                f"{fmt_bytes(self.budget_bytes)} per GPU")


@dataclass(frozen=True, kw_only=True, order=True)
class Layout:
    """One way to run the job (torchtitan's parallelism degrees and batch split)."""

    tp: int = 1
    """Tensor parallel degree (with sequence parallelism and loss_parallel, as torchtitan)."""
    cp: int = 1
    """Context parallel degree (the sequence split over ranks; ring attention)."""
    pp: int = 1
    """Pipeline parallel degree (ranks); ``virtual_stages`` stages each."""
    dp_shard: int = 1
    """FSDP2 shard degree (torchtitan's ``data_parallel_shard_degree``)."""
    dp_replicate: int = 1
    """Replicas of the sharded group (HSDP; DDP where ``dp_shard`` is 1)."""
    micro_batch: int = 1
    """Sequences per forward on a data-parallel rank."""
    accumulation: int = 1
    """Forwards per optimizer step on a data-parallel rank (PP: the schedule's micro-batches)."""
    schedule: str = ""
    """torchtitan's pipeline schedule name (``SCHEDULES``); "" without PP."""

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 shards a parameter over: ``dp_shard x cp`` (torchtitan's dp_shard_cp mesh)."""
        return self.dp_shard * self.cp

    @property
    def virtual_stages(self) -> int:
        return SCHEDULES[self.schedule][1] if self.schedule else 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def schedule_class(self) -> str:
        return SCHEDULES[self.schedule][0] if self.schedule else ""

    @property
    def split_backward(self) -> bool:
        return "ZeroBubble" in self.schedule

    @property
    def family(self) -> str:
        """The kind of layout: which parallelisms it uses (``"PP x TP x FSDP"``)."""
        parts = [p for p, on in (("PP", self.pp > 1), ("TP", self.tp > 1), ("CP", self.cp > 1)) if on]
        if self.dp_shard > 1:
            parts.append("HSDP" if self.dp_replicate > 1 else "FSDP")
        elif self.dp_replicate > 1:
            parts.append("DDP")
        return " x ".join(parts) or "one GPU"

    def describe(self) -> str:
        """``PP 4 1F1B x TP 8 x FSDP 2, mb 1 x 32``: degrees > 1, then micro-batch x accumulation."""
        parts = []
        if self.pp > 1:
            parts.append(f"PP {self.pp} {self.schedule}")
        parts += [f"{n} {d}" for n, d in (("TP", self.tp), ("CP", self.cp)) if d > 1]
        if self.dp_shard > 1 and self.dp_replicate > 1:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"DDP {self.dp_replicate}")
        return f"{' x '.join(parts) or '1 GPU'}, mb {self.micro_batch} x {self.accumulation}"


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which degrees the search tries (None: every one that divides)."""

    tp: tuple[int, ...] | None = None
    """None: every degree up to a node that divides the KV heads, the FFN and the vocabulary."""
    cp: tuple[int, ...] = (1, 2)
    """Context parallel degrees (each must divide the sequence in 2 x CP chunks)."""
    pp: tuple[int, ...] | None = None
    """None: 1 and every power of two up to the layers (a stage holds at least one layer)."""
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
    """GPipe and LoopedBFS hold every micro-batch's activations for the same bubble as 1F1B and
    Interleaved1F1B: opt-in."""
    micro_batches: tuple[int, ...] = (1, 2)
    """Sequences per forward on a data-parallel rank."""
    hsdp: bool = True
    """Also shard over part of the data-parallel ranks and replicate the rest (HSDP)."""
    pp_micro_batch_one: bool = True
    """Under PP, only the smallest micro-batch: a larger one runs the same compute in fewer
    micro-batches, so a larger bubble and more activation memory per micro-batch in flight (the
    time model gains nothing from larger kernels beyond the weight reads of memory-bound ops)."""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "micro_batches"):
            v = getattr(self, name)
            if v is None:
                continue
            v = tuple(v)
            if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                raise PlanningError(f"SearchSpace.{name} must list ints >= 1, got {v!r}")
            object.__setattr__(self, name, tuple(sorted(set(v))))
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad:
            raise PlanningError(f"unknown schedule(s) {bad}; known: {', '.join(SCHEDULES)}")
        object.__setattr__(self, "schedules", tuple(self.schedules))


@dataclass(frozen=True)
class Rejected:
    """A layout left out before planning, and why."""

    layout: Layout
    reason: str
    """The rule (``"divides"``, ``"state bound"``, ...): rejected families are grouped by it."""
    detail: str


@dataclass(frozen=True)
class Enumerated:
    """Every layout of the space: those to plan, those left out, and how many there were."""

    layouts: tuple[Layout, ...]
    rejected: tuple[Rejected, ...]
    raw_count: int
    state_bytes: dict = field(default_factory=dict)
    """Layout -> the largest rank's sharded state bytes (the lower bound it passed)."""


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def _degrees(given: tuple[int, ...] | None, default: list[int]) -> list[int]:
    return list(given) if given is not None else default


def _raw(family, cluster: Cluster, global_batch: int, space: SearchSpace) -> Iterator[Layout]:
    n = cluster.n_gpus
    tps = _degrees(space.tp, _powers_of_two(cluster.gpus_per_node))
    pps = _degrees(space.pp, _powers_of_two(family.n_layers))
    for tp in tps:
        for cp in space.cp:
            for pp in pps:
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                shards = [d for d in range(1, dp + 1) if dp % d == 0] if space.hsdp else [dp]
                scheds = [""] if pp == 1 else list(space.schedules)
                for dp_shard in shards:
                    for mb in space.micro_batches:
                        local = global_batch / dp / mb
                        acc = int(local) if local == int(local) and local >= 1 else 0
                        for s in scheds:
                            yield Layout(tp=tp, cp=cp, pp=pp, dp_shard=dp_shard, dp_replicate=dp // dp_shard,
                                         micro_batch=mb, accumulation=acc, schedule=s)


def _divides(layout: Layout, family, cluster: Cluster, global_batch: int, seq_len: int) -> str | None:
    """Why ``layout`` cannot run, or None."""
    t = layout
    if t.accumulation == 0:
        return (f"global batch {global_batch} is not {t.dp} data-parallel ranks x micro-batch "
                f"{t.micro_batch} x a whole number of micro-batches")
    why = family.tp_refusal(t.tp)
    if why:
        return why
    if t.dp_shard == 1 and t.dp_replicate > 1:
        return ("DDP (replicas that shard nothing) is not modelled: its gradient buckets are not counted; "
                "HSDP shards over part of the data-parallel ranks instead")
    if seq_len % (2 * t.cp):
        return f"CP {t.cp}: the sequence ({seq_len}) must split in 2 x CP = {2 * t.cp} equal chunks (load balance)"
    if t.cp > 1 and not cluster.spec.is_cuda:
        return "context parallel is traced for a CUDA target only (ring attention has no CPU kernel)"
    if t.tp * t.cp > cluster.gpus_per_node:
        return (f"TP {t.tp} x CP {t.cp} spans nodes: their collectives run inside every layer and are "
                "priced on the node's link")
    if t.pp > 1:
        if t.n_stages > family.n_layers:
            return f"{t.n_stages} stages for {family.n_layers} layers: a stage needs at least one layer"
        try:
            from planner.options import Pipeline
            from torch.distributed.pipelining import schedules

            Pipeline(getattr(schedules, t.schedule_class), n_microbatches=t.accumulation, stage_index=0,
                     n_stages=t.n_stages, virtual_stages=t.virtual_stages)
        except PlanningError as e:
            return f"{t.schedule}: {e}"
        except Exception as e:  # noqa: BLE001 - torch's own schedule checks (micro-batch counts)
            return f"{t.schedule}: {type(e).__name__}: {e}"
    return None


def state_bound_bytes(layout: Layout, family, *, rank: int | None = None) -> int:
    """The largest rank's (or pipeline rank ``rank``'s) parameters, gradients and optimizer state:
    sharded over the FSDP group, plus (under PP with FSDP) the stage's parameters and gradients
    FSDP2 keeps unsharded through the step (torch's ``PipelineStage`` turns off resharding after
    backward and gradient sync until the last micro-batch; torchtitan keeps parameters gathered
    after forward under PP)."""
    w = layout.fsdp_size
    worst = 0
    sets = family.rank_layer_sets(layout.pp, layout.virtual_stages)
    for ids, first, last in (sets if rank is None else [sets[rank]]):
        p = family.param_bytes(tp=layout.tp, layer_ids=ids, first=first, last=last)
        state = math.ceil((p + p + family.optimizer_bytes_per_param_byte * p) / w)
        if layout.pp > 1 and w > 1:
            state += p + p - p // w  # gathered parameters, unsharded gradients
        worst = max(worst, state)
    return worst


def enumerate_layouts(family, cluster: Cluster, *, global_batch: int, seq_len: int,
                      space: SearchSpace = SearchSpace()) -> Enumerated:
    """Every layout of ``space`` on ``cluster`` for ``global_batch`` sequences of ``seq_len``,
    split into those to plan and those rejected with their reason (see the module docstring)."""
    usable = cluster.usable_bytes
    keep, rejected, raw, bounds = [], [], 0, {}
    for layout in dict.fromkeys(_raw(family, cluster, global_batch, space)):
        raw += 1
        why = _divides(layout, family, cluster, global_batch, seq_len)
        if why:
            rejected.append(Rejected(layout, "does not divide", why))
            continue
        if space.pp_micro_batch_one and layout.pp > 1 and layout.micro_batch > min(space.micro_batches):
            rejected.append(Rejected(layout, "dominated", (
                f"PP with micro-batch {layout.micro_batch}: the same compute in fewer micro-batches than with "
                f"{min(space.micro_batches)}, so a larger bubble and more activation memory in flight")))
            continue
        state = state_bound_bytes(layout, family)
        bounds[layout] = state
        if state > usable:
            rejected.append(Rejected(layout, "state bound", (
                f"sharded state {state / GiB:.1f} GiB per rank alone is over the {usable / GiB:.1f} GiB usable")))
            continue
        keep.append(layout)
    return Enumerated(tuple(keep), tuple(rejected), raw, bounds)


def with_changes(layout: Layout, **changes) -> Layout:
    return dataclasses.replace(layout, **changes)
