"""The training step as a timeline: a compute stream and the streams that run beside it.

A step is a chain of compute **segments** (forward of each block, backward of each block, the
optimizer, ...) on one stream, and **transfers** on their own streams: FSDP2's all-gathers and
reduce-scatters on the communication stream, activation offload copies device -> host (D2H) and
host -> device (H2D) on two copy streams (the PCIe / NVLink-C2C link is full duplex and a GPU
has a copy engine per direction). A transfer is released when a segment starts (FSDP2 issues a
prefetch, a module's forward ends), runs after the transfers issued before it on its stream
(FIFO), and the segment that needs it waits for it. So::

    start(seg i)    = max(end(seg i-1), end(t) for t needed by seg i)
    end(seg i)      = start(seg i) + recompute_ms_i + compute_ms_i
    start(t)        = max(end(seg release_t - 1), end(previous t on its stream), end(t.after))
    end(t)          = start(t) + duration_ms_t
    step_ms         = max(end(last seg), end(t) for t the step end waits for)

The step time is the critical path: a transfer costs time only where the compute stream waits
for it. Every wait is charged to the stream of the transfer it waited for, so

    step_ms == compute_ms + recompute_ms + exposed_comm_ms + exposed_copy_ms

exactly. ``step_layout`` lays out a traced step (``ModuleInfo``) on this model at the
granularity of repeated blocks; ``solver/offload/milp.py`` writes the same recurrences as linear
constraints (the longest path of a max-plus system is what an LP minimising the end time finds).

What is modelled, and what not (each rule is tested against hand-computed cases in
``tests/estimators/test_timeline.py``):

* FSDP2 prefetches one unit ahead: a unit's forward all-gather is issued when the segment before
  its forward starts, its backward all-gather when the segment before its backward starts (the
  root's all-gather at the step start, exposed); a reduce-scatter is issued when the unit's
  backward ends and the optimizer waits for all of them. All collectives share one stream (one
  link). Compute does not slow down while a collective or a copy runs (no contention).
* A block's offload is one transfer per direction whose duration is its bytes over the link's
  bandwidth plus a fixed latency per copy (per saved tensor: ``DeviceSpec.host_copy_latency_s``),
  so many small copies cost more than one large one of the same bytes.
* An offloaded block's D2H copy is issued when its forward ends; its H2D copy is issued when the
  backward of the block that runs just before it in backward order starts (prefetch one block
  ahead) and not before its D2H ended; the block's backward waits for it.
* Segments are blocks, not ops: compute between blocks (embedding, head, loss) is one segment
  before and one after them, in each direction.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats, ModuleInfo

__all__ = [
    "Stream",
    "Segment",
    "Transfer",
    "StepTimeline",
    "StepLayout",
    "UnitComm",
    "simulate",
    "step_layout",
    "copy_ms",
]


class Stream(str, enum.Enum):
    """Where a transfer runs."""

    COMM = "comm"
    """Collectives (FSDP2 all-gather / reduce-scatter)."""
    D2H = "d2h"
    """Offload copies, device -> host (forward)."""
    H2D = "h2d"
    """Offload copies back, host -> device (backward)."""


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of the compute stream."""

    name: str
    compute_ms: float
    recompute_ms: float = 0.0
    """Recomputation at the start of the segment (a checkpointed module's backward)."""

    def __post_init__(self) -> None:
        for what in ("compute_ms", "recompute_ms"):
            v = getattr(self, what)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"segment {self.name!r}: {what} must be finite and >= 0, got {v}")


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """A collective or a copy on its own stream."""

    name: str
    stream: Stream
    duration_ms: float
    release: int
    """It is issued when the compute stream reaches segment ``release`` (the end of segment
    ``release - 1``; 0: the step start; ``len(segments)``: the end of the last one)."""
    needed_by: int | None = None
    """Index of the segment that waits for it; None: only the end of the step waits."""
    after: str | None = None
    """Name of a transfer that must end before this one starts (an H2D after its D2H)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_ms) and self.duration_ms >= 0):
            raise ValueError(f"transfer {self.name!r}: duration_ms must be finite and >= 0, "
                             f"got {self.duration_ms}")
        if self.release < 0 or (self.needed_by is not None and self.needed_by < self.release):
            raise ValueError(f"transfer {self.name!r}: released at segment {self.release} but "
                             f"needed by segment {self.needed_by}; a segment cannot wait for a "
                             "transfer issued after it starts")


@dataclass(frozen=True, kw_only=True)
class StepTimeline:
    """One step on the timeline; the four parts add up to ``step_ms``."""

    compute_ms: float
    recompute_ms: float
    exposed_comm_ms: float
    """Time the compute stream waited for collectives (and the step end for the last ones)."""
    exposed_copy_ms: float
    """Time the compute stream waited for offload copies (and the step end for the last ones)."""
    step_ms: float
    segment_start_ms: tuple[float, ...] = ()
    transfer_end_ms: Mapping[str, float] = field(default_factory=dict)
    comm_ms: float = 0.0
    """All collective time, hidden or not."""
    copy_ms: float = 0.0
    """All copy time (both directions), hidden or not."""


def simulate(segments: Sequence[Segment], transfers: Iterable[Transfer] = ()) -> StepTimeline:
    """Run the recurrences of the module docstring; every wait is charged to a stream.

    >>> simulate([Segment(name="a", compute_ms=2.0), Segment(name="b", compute_ms=1.0)],
    ...          [Transfer(name="x", stream=Stream.D2H, duration_ms=3.0, release=1, needed_by=None)]
    ...          ).exposed_copy_ms
    2.0
    """
    transfers = list(transfers)
    n = len(segments)
    by_name = {t.name: t for t in transfers}
    if len(by_name) != len(transfers):
        raise ValueError("transfer names must be unique")
    for t in transfers:
        if t.release > n or (t.needed_by is not None and t.needed_by >= n):
            raise ValueError(f"transfer {t.name!r} names a segment beyond the {n} segments")
        if t.after is not None and t.after not in by_name:
            raise ValueError(f"transfer {t.name!r} waits for unknown transfer {t.after!r}")
    prev: dict[str, str | None] = {}
    for stream in Stream:  # FIFO: issue order on each stream (stable for equal releases)
        queue = sorted((t for t in transfers if t.stream is stream), key=lambda t: t.release)
        for a, b in zip([None, *queue], queue):
            prev[b.name] = a.name if a is not None else None

    starts: list[float] = []
    ready: list[float] = []  # ready[i]: end of segment i - 1, when segment i's prefetches issue
    ends: dict[str, float] = {}

    def end(name: str) -> float:
        if name not in ends:
            t = by_name[name]
            if t.release >= len(ready):
                raise ValueError(f"transfer {name!r} is released at segment {t.release} but waited "
                                 "for earlier; issue it earlier or wait for it later")
            begin = ready[t.release]
            for dep in (prev[name], t.after):
                if dep is not None:
                    begin = max(begin, end(dep))
            ends[name] = begin + t.duration_ms
        return ends[name]

    waits = {Stream.COMM: 0.0, Stream.D2H: 0.0, Stream.H2D: 0.0}
    needed: dict[int, list[Transfer]] = {}
    for t in transfers:
        if t.needed_by is not None:
            needed.setdefault(t.needed_by, []).append(t)
    clock = 0.0
    for i, seg in enumerate(segments):
        ready.append(clock)
        start, blocker = clock, None
        for t in needed.get(i, ()):
            e = end(t.name)
            if e > start:
                start, blocker = e, t
        if blocker is not None:
            waits[blocker.stream] += start - clock
        starts.append(start)
        clock = start + seg.recompute_ms + seg.compute_ms
    ready.append(clock)
    step, blocker = clock, None
    for t in transfers:
        e = end(t.name)
        if t.needed_by is None and e > step:
            step, blocker = e, t
    if blocker is not None:
        waits[blocker.stream] += step - clock
    return StepTimeline(
        compute_ms=sum(s.compute_ms for s in segments),
        recompute_ms=sum(s.recompute_ms for s in segments),
        exposed_comm_ms=waits[Stream.COMM],
        exposed_copy_ms=waits[Stream.D2H] + waits[Stream.H2D],
        step_ms=step,
        segment_start_ms=tuple(starts),
        transfer_end_ms=dict(ends),
        comm_ms=sum(t.duration_ms for t in transfers if t.stream is Stream.COMM),
        copy_ms=sum(t.duration_ms for t in transfers if t.stream is not Stream.COMM),
    )


def copy_ms(nbytes: float, copy_bytes_per_s: float, *, copies: int = 1,
            copy_latency_s: float = 0.0) -> float:
    """Time of ``copies`` offload copies moving ``nbytes`` in all at ``copy_bytes_per_s`` (see
    ``DeviceSpec.host_copy_bytes_per_s``), each with a fixed ``copy_latency_s``
    (``DeviceSpec.host_copy_latency_s``), in ms.

    >>> copy_ms(1e6, 1e9, copies=4, copy_latency_s=5e-6)   # 1 ms of bytes + 4 x 5 us
    1.02
    """
    if nbytes <= 0:
        return 0.0
    if not copy_bytes_per_s > 0:
        raise ValueError("offload needs a host link: the DeviceSpec's host_link_bytes_per_s is 0")
    if copies < 1 or copy_latency_s < 0:
        raise ValueError(f"copies must be >= 1 and copy_latency_s >= 0 for {nbytes} bytes, got "
                         f"{copies} and {copy_latency_s}")
    return 1e3 * (nbytes / copy_bytes_per_s + copies * copy_latency_s)


# ----------------------------------------------------------------------------- a traced step
@dataclass(frozen=True, kw_only=True)
class UnitComm:
    """One FSDP unit's collectives, one rank (``planner.distributed.fsdp.FsdpUnitComm`` carries these)."""

    fqn: str
    all_gather_ms: float
    """One all-gather of the unit's parameters."""
    all_gathers: int
    """1 (root: kept gathered after forward) or 2 (forward and backward)."""
    reduce_scatter_ms: float


@dataclass(frozen=True, kw_only=True)
class StepLayout:
    """A traced step laid out on the timeline: segments, the fixed transfers (collectives), and
    where each block's offload copies and recomputation go."""

    segments: tuple[Segment, ...]
    comm: tuple[Transfer, ...]
    blocks: tuple[str, ...]
    """Blocks in forward order (the granularity of segments and offload)."""
    fw_segment: Mapping[str, int]
    bw_segment: Mapping[str, int]
    prefetch_segment: Mapping[str, int]
    """Segment whose start issues a block's H2D copy: the backward of the block before it in
    backward order (its own for the first one)."""
    optim_segment: int

    def segment_of_backward(self, s: ModStats) -> int:
        """Segment in which module ``s``'s backward starts (its recompute runs there)."""
        for b in self.blocks:
            if self._under(s.fqn, b):
                return self.bw_segment[b]
        first = self.bw_segment[self.blocks[-1]] if self.blocks else 0
        # Backward before the blocks (head, loss) or after them (embedding).
        return first - 1 if s.bw_pre_op < self._first_block_bw_op else self.optim_segment - 1

    @staticmethod
    def _under(fqn: str, ancestor: str) -> bool:
        return fqn == ancestor or fqn.startswith(ancestor + ".")

    _first_block_bw_op: int = 0

    def copy_transfers(self, nbytes: Mapping[str, float], copy_bytes_per_s: float, *,
                       copies: Mapping[str, int] | None = None,
                       copy_latency_s: float = 0.0) -> list[Transfer]:
        """D2H and H2D transfers of each block offloading ``nbytes[block]`` bytes in
        ``copies[block]`` copies (1 where not given), each way."""
        out = []
        for b, nb in nbytes.items():
            if nb <= 0:
                continue
            ms = copy_ms(nb, copy_bytes_per_s, copies=(copies or {}).get(b, 1),
                         copy_latency_s=copy_latency_s)
            out.append(Transfer(name=f"d2h:{b}", stream=Stream.D2H, duration_ms=ms,
                                release=self.fw_segment[b] + 1))
            out.append(Transfer(name=f"h2d:{b}", stream=Stream.H2D, duration_ms=ms,
                                release=self.prefetch_segment[b], needed_by=self.bw_segment[b],
                                after=f"d2h:{b}"))
        return out

    def timeline(
        self,
        *,
        recompute_ms_by_segment: Mapping[int, float] | None = None,
        offload_bytes: Mapping[str, float] | None = None,
        copy_bytes_per_s: float = 0.0,
        offload_copies: Mapping[str, int] | None = None,
        copy_latency_s: float = 0.0,
    ) -> StepTimeline:
        """The step with this recomputation and these blocks' offloaded bytes (moved in
        ``offload_copies[block]`` copies of ``copy_latency_s`` fixed time each)."""
        rec = recompute_ms_by_segment or {}
        segs = [Segment(name=s.name, compute_ms=s.compute_ms, recompute_ms=rec.get(i, 0.0))
                for i, s in enumerate(self.segments)]
        copies = self.copy_transfers(offload_bytes or {}, copy_bytes_per_s, copies=offload_copies,
                                     copy_latency_s=copy_latency_s)
        return simulate(segs, [*self.comm, *copies])


def _maximal_others(info: ModuleInfo, blocks: Sequence[str]) -> list[ModStats]:
    """Modules outside every block and above none, with no such module above them."""
    def under(f: str, a: str) -> bool:
        return f.startswith(a + ".")

    rel = [s for s in info.mod_stats[1:]
           if not any(s.fqn == b or under(s.fqn, b) or under(b, s.fqn) for b in blocks)]
    names = {s.fqn for s in rel}
    return [s for s in rel if not any(under(s.fqn, o) for o in names)]


def step_layout(
    info: ModuleInfo,
    blocks: Sequence[str],
    *,
    comm: Sequence[UnitComm] = (),
) -> StepLayout:
    """Segments of the traced step at block granularity, and FSDP2's collectives on them.

    Segments: forward before the blocks, each block's forward, forward after them; backward
    before the blocks (head, loss), each block's backward (reverse order), backward after them;
    the optimizer. Compute outside the blocks is split before / after by the top-level modules'
    own runtimes (the rest of it -- the root's own ops, the loss -- counts after the blocks).
    ``comm``: per FSDP unit; a unit that is one of ``blocks`` is prefetched one segment ahead,
    any other (the root) gathers at the step start and reduce-scatters after the backward.
    """
    stats = {s.fqn: s for s in info.mod_stats}
    missing = [b for b in blocks if b not in stats]
    if missing:
        raise ValueError(f"blocks not in the ModuleInfo: {missing}")
    bl = sorted(blocks, key=lambda b: stats[b].fw_pre_op)
    others = _maximal_others(info, bl)
    first_fw = stats[bl[0]].fw_pre_op if bl else 0
    last_bw = stats[bl[-1]].bw_pre_op if bl else 0
    fw_pre = sum(s.fw_runtime_ms for s in others if 0 <= s.fw_pre_op < first_fw)
    bw_pre = sum(s.bw_runtime_ms for s in others if 0 <= s.bw_pre_op < last_bw)
    fw_blocks = sum(stats[b].fw_runtime_ms for b in bl)
    bw_blocks = sum(stats[b].bw_runtime_ms for b in bl)
    segs = [Segment(name="fw:before blocks", compute_ms=fw_pre)]
    fw_seg, bw_seg = {}, {}
    for b in bl:
        fw_seg[b] = len(segs)
        segs.append(Segment(name=f"fw:{b}", compute_ms=stats[b].fw_runtime_ms))
    segs.append(Segment(name="fw:after blocks",
                        compute_ms=max(0.0, info.fw_runtime_ms - fw_pre - fw_blocks)))
    segs.append(Segment(name="bw:before blocks", compute_ms=bw_pre))
    for b in reversed(bl):
        bw_seg[b] = len(segs)
        segs.append(Segment(name=f"bw:{b}", compute_ms=stats[b].bw_runtime_ms))
    segs.append(Segment(name="bw:after blocks",
                        compute_ms=max(0.0, info.bw_runtime_ms - bw_pre - bw_blocks)))
    optim = len(segs)
    segs.append(Segment(name="optimizer", compute_ms=info.optimizer_runtime_ms))
    prefetch = {b: bw_seg[bl[i + 1]] if i + 1 < len(bl) else bw_seg[b] for i, b in enumerate(bl)}
    return StepLayout(
        segments=tuple(segs), comm=tuple(_comm_transfers(comm, fw_seg, bw_seg, optim)),
        blocks=tuple(bl), fw_segment=fw_seg, bw_segment=bw_seg, prefetch_segment=prefetch,
        optim_segment=optim, _first_block_bw_op=last_bw,
    )


def _comm_transfers(comm: Sequence[UnitComm], fw_seg: Mapping[str, int],
                    bw_seg: Mapping[str, int], optim: int) -> list[Transfer]:
    out = []
    for u in comm:
        if u.fqn in fw_seg:
            f, b = fw_seg[u.fqn], bw_seg[u.fqn]
            out.append(Transfer(name=f"ag:fw:{u.fqn}", stream=Stream.COMM,
                                duration_ms=u.all_gather_ms, release=max(0, f - 1), needed_by=f))
            if u.all_gathers > 1:
                out.append(Transfer(name=f"ag:bw:{u.fqn}", stream=Stream.COMM,
                                    duration_ms=u.all_gather_ms, release=b - 1, needed_by=b))
            out.append(Transfer(name=f"rs:{u.fqn}", stream=Stream.COMM,
                                duration_ms=u.reduce_scatter_ms, release=b + 1, needed_by=optim))
        else:  # the root (or a unit outside the blocks): gathered first, reduced last
            out.append(Transfer(name=f"ag:fw:{u.fqn}", stream=Stream.COMM,
                                duration_ms=u.all_gather_ms * u.all_gathers, release=0, needed_by=0))
            out.append(Transfer(name=f"rs:{u.fqn}", stream=Stream.COMM,
                                duration_ms=u.reduce_scatter_ms, release=optim, needed_by=optim))
    return out
