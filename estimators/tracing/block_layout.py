"""Where the four traced blocks of a stack sit in a truncated trace, and every reference in it
written relative to them.

A truncated trace (``estimators.tracing.stacks``) runs blocks 0, 1, 2 and the last one of a stack:
truncated positions ``j = 0, 1, 2, 3``. Each block owns *segments* of the op list:

* ``"f"``: its forward, from its call's first op to the next block's first (the parent's ops
  between two blocks go with the block before them), anchored at its first op;
* ``"b"``: its backward, after the next block's backward up to its call's last backward op (the
  backward of those parent ops comes first), anchored at that last op;
* ``"w"``: under a split backward (a zero-bubble pipeline stage, ``estimators.step.stage_step``),
  ``"b"`` is the input-gradient half, run over the blocks in reverse order before the trace's
  ``"weight"`` mark, and ``"w"`` the weight-gradient half after it, run over the blocks in forward
  order: from the previous block's ``"w"`` to its call's last backward op, anchored at its first op;
* ``("r", n)``: the n-th run of ops outside its segments that touch its tensors alone: of optimizer
  ops (a per-parameter loop), or of a split backward's list over every parameter (torch's
  ``stage_backward_input`` and ``stage_backward_weight`` each start with a ``view_as`` of every
  parameter, in the parameters' order, under whichever module call is current).

A block owns the storages allocated in its segments, the state it holds before the step (its
parameters, their gradients and optimizer state, its buffers), and the outputs of ``_foreach``
optimizer ops at the list positions of its tensors. Each owned storage has a *key* that names it
within its block the same way in every block. A reference (an op index, a storage, a call) made
from block ``j`` is written as ``(delta, ...)`` to a block ``j + delta`` or as global, so that
blocks 1 and 2 can be compared and block 2 copied to any position (``estimators.tracing.replicate``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Hashable

from estimators.contract.module_info import Phase
from estimators.tracing.records import StepTrace, StorageKind

__all__ = ["NotReplicable", "BlockLayout", "Ref"]

Ref = tuple
"""A relative reference: ``("g", x)`` global (x absolute), or ``("s" | "o" | "c", delta, ...)``."""


class NotReplicable(Exception):
    """The truncated trace cannot stand for the full one; the message says why."""


@dataclass
class _Seg:
    start: int
    stop: int  # exclusive
    block: int
    kind: Hashable  # "f", "b", "w" or ("r", n)
    anchor: int


@dataclass
class BlockLayout:
    """The blocks, segments, owners and keys of one stack in a truncated trace."""

    trace: StepTrace
    prefix: str
    """The blocks' fqn prefix in the trace (``"Llama.layers."``)."""
    keys: tuple[str, str, str, str]
    """The traced children's keys, truncated positions 0..3."""
    pre_owner: dict[int, int]
    """Storage id -> truncated position of the block owning it before the step."""
    cids: list[int] = field(default_factory=list)  # block call ids, positions 0..3
    n_sub: int = 0  # calls in one block's subtree
    segs: list[_Seg] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)  # sid -> position
    key_of: dict[int, Hashable] = field(default_factory=dict)  # sid -> key within its block
    by_key: list[dict[Hashable, int]] = field(default_factory=lambda: [{}, {}, {}, {}])
    optim_start: int = 0
    runs: list[list[_Seg]] = field(default_factory=lambda: [[], [], [], []])  # optimizer runs per position
    foreach_ops: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._find_calls()
        self._find_segments()
        self._own_before_and_in_segments()
        self._scan_optimizer()
        self._starts = [s.start for s in self.segs]

    # ------------------------------------------------------------------ calls and segments
    def _find_calls(self) -> None:
        calls = self.trace.calls
        names = [self.prefix + k for k in self.keys]
        found: dict[str, list[int]] = {n: [] for n in names}
        for c in calls:
            if c.fqn in found:
                found[c.fqn].append(c.cid)
        for n in names:
            if len(found[n]) != 1:
                raise NotReplicable(f"{n} is called {len(found[n])} times in the step")
        self.cids = [found[n][0] for n in names]
        ends = [self._subtree_end(c) for c in self.cids]
        sizes = {e - c for c, e in zip(self.cids, ends)}
        if len(sizes) != 1:
            raise NotReplicable("the traced blocks call different numbers of modules")
        self.n_sub = sizes.pop()
        for j in range(3):
            if ends[j] != self.cids[j + 1]:
                raise NotReplicable("modules are called between two blocks")
        for j in range(4):
            if not (calls[self.cids[j]].fw_last_op >= calls[self.cids[j]].fw_first_op >= 0):
                raise NotReplicable(f"{names[j]} runs no forward op")
        parents = {calls[c].parent for c in self.cids}
        if len(parents) != 1:
            raise NotReplicable("the traced blocks are called from different modules")

    def _subtree_end(self, cid: int) -> int:
        calls = self.trace.calls
        depth = calls[cid].depth
        end = cid + 1
        while end < len(calls) and calls[end].depth > depth:
            end += 1
        return end

    def _find_segments(self) -> None:
        calls, ops = self.trace.calls, self.trace.ops
        f = [calls[c].fw_first_op for c in self.cids]
        if not f[0] < f[1] < f[2] < f[3]:
            raise NotReplicable("the blocks' forwards do not run in order")
        ends = [f[1], f[2], f[3], calls[self.cids[3]].fw_last_op + 1]
        if ends[1] - f[1] != ends[2] - f[2]:
            raise NotReplicable("blocks 1 and 2 run different numbers of forward ops")
        for j in range(4):
            self.segs.append(_Seg(f[j], ends[j], j, "f", f[j]))
        e = [calls[c].bw_last_op for c in self.cids]
        lists: list[tuple[int, int]] = []
        if all(x < 0 for x in e):
            pass  # no backward through the blocks (frozen, inputs without grad)
        elif any(x < 0 for x in e):
            raise NotReplicable("some of the blocks run no backward")
        elif (w := self._weight_half()) is not None:
            lists = self._split_backward_segments(w)
        elif not e[3] < e[2] < e[1] < e[0]:
            raise NotReplicable("the blocks' backwards do not run in reverse order")
        else:
            self._input_half_segments(e)
        for s in self.segs:
            want = Phase.FW if s.kind == "f" else Phase.BW
            if any(op.phase is not want for op in ops[s.start:s.stop]):
                raise NotReplicable(f"block {s.block}'s {s.kind} segment mixes phases")
        for a, b in lists:
            self._list_runs(a, b)
        self.segs.sort(key=lambda s: s.start)
        for a, b in zip(self.segs, self.segs[1:]):
            if a.stop > b.start:
                raise NotReplicable("the blocks' segments overlap")
        self.optim_start = next((op.index for op in ops if op.phase is Phase.OPTIM), len(ops))
        if any(op.phase is not Phase.OPTIM for op in ops[self.optim_start:]):
            raise NotReplicable("ops of other phases run after the optimizer step starts")

    def _input_half_segments(self, e: list[int]) -> None:
        """The ``"b"`` segments, ``e[j]`` the last op of block ``j``'s backward (or input half)."""
        if not e[3] < e[2] < e[1] < e[0]:
            raise NotReplicable("the blocks' backwards do not run in reverse order")
        if e[1] - e[2] != e[2] - e[3]:
            raise NotReplicable("blocks 1 and 2 run different numbers of backward ops")
        starts = [e[1] + 1, e[2] + 1, e[3] + 1, self.trace.calls[self.cids[3]].bw_first_op]
        for j in range(4):
            self.segs.append(_Seg(starts[j], e[j] + 1, j, "b", e[j]))

    def _weight_half(self) -> int | None:
        """Where a split backward's weight half begins (the ``"weight"`` mark) if the blocks run
        backward ops on both sides of it, else None (one backward: the mark, if any, is before it,
        as on torch's first stage, whose input half computes nothing)."""
        w = self.trace.marks.get("weight")
        if w is None:
            return None
        calls = [self.trace.calls[c] for c in self.cids]
        both = [c.bw_first_op < w <= c.bw_last_op for c in calls]
        if not any(both):
            return None
        if not all(both):
            raise NotReplicable("some of the blocks run no backward op in one half of the split backward")
        return w

    def _split_backward_segments(self, w: int) -> list[tuple[int, int]]:
        """The ``"b"`` (input half, reverse order) and ``"w"`` (weight half, forward order)
        segments of a split backward whose weight half starts at op ``w``; returns the ranges
        of the two parameter lists, laid out as runs once every segment is known."""
        calls, ops = self.trace.calls, self.trace.ops
        first_bw = min(calls[c].bw_first_op for c in self.cids)
        ei = [-1, -1, -1, -1]
        for i in range(first_bw, w):
            j = self.subtree_of(ops[i].call) if ops[i].call >= 0 else None
            if j is not None:
                ei[j] = i
        if not ei[3] < ei[2] < ei[1] < ei[0]:
            raise NotReplicable("the blocks' input-gradient halves do not run in reverse order")
        self._input_half_segments(ei)
        ew = [calls[c].bw_last_op for c in self.cids]
        if not ew[0] < ew[1] < ew[2] < ew[3]:
            raise NotReplicable("the blocks' weight-gradient halves do not run in order")
        input_list = self._param_list(self.trace.marks.get("backward", first_bw), calls[self.cids[3]].bw_first_op)
        weight_list = self._param_list(w, ew[0] + 1)
        if weight_list is not None:
            start = weight_list[1]
        else:
            start = next(i for i in range(w, ew[0] + 1) if ops[i].call >= 0 and self.subtree_of(ops[i].call) == 0)
        starts = [start, ew[0] + 1, ew[1] + 1, ew[2] + 1]
        for j in range(4):
            self.segs.append(_Seg(starts[j], ew[j] + 1, j, "w", starts[j]))
        return [r for r in (input_list, weight_list) if r is not None]

    def _param_list(self, a: int, b: int) -> tuple[int, int] | None:
        """The first run in ops ``[a, b)`` of ops that each only read one parameter, every one
        another, over the parameters of two blocks at least (torch's ``view_as`` of each
        parameter): its range, or None."""
        ops, storages = self.trace.ops, self.trace.storages

        def single_param(i: int) -> int | None:
            op = ops[i]
            if op.new_sids or op.mutated_sids or len(op.arg_sids) != 1:
                return None
            sid = op.arg_sids[0]
            return sid if storages[sid].kind is StorageKind.PARAM else None

        i = a
        while i < b:
            if single_param(i) is None:
                i += 1
                continue
            seen: set[int] = set()
            k = i
            while k < b and (sid := single_param(k)) is not None and sid not in seen:
                seen.add(sid)
                k += 1
            if len({self.pre_owner.get(sid) for sid in seen} - {None}) >= 2:
                return i, k
            i = k
        return None

    def _list_runs(self, a: int, b: int) -> None:
        """The runs of each block in the parameter list at ops ``[a, b)``; the blocks' parameters
        must come in the blocks' order, each block's together, outside every segment."""
        if any(s.start < b and a < s.stop for s in self.segs):
            raise NotReplicable("a list over every parameter runs inside a block's segment")
        ops = self.trace.ops
        order: list[int] = []
        current: _Seg | None = None
        for i in range(a, b):
            j = self.pre_owner.get(ops[i].arg_sids[0])
            if j is None:
                current = None
                continue
            if current is None or current.block != j or current.stop != i:
                if order and j <= order[-1]:
                    raise NotReplicable("a list over every parameter does not take the blocks in order")
                order.append(j)
                current = _Seg(i, i, j, ("r", len(self.runs[j])), i)
                self.runs[j].append(current)
                self.segs.append(current)
            current.stop = i + 1

    # ------------------------------------------------------------------ owners and keys
    def _own(self, sid: int, j: int, key: Hashable) -> None:
        if sid in self.owner:
            return
        self.owner[sid] = j
        self.key_of[sid] = key
        self.by_key[j][key] = sid

    def _own_before_and_in_segments(self) -> None:
        rank = [0, 0, 0, 0]
        for sid in sorted(self.pre_owner):
            j = self.pre_owner[sid]
            self._own(sid, j, ("p", rank[j]))
            rank[j] += 1
        self._made_at: dict[int, list[int]] = {}
        for st in self.trace.storages:
            if st.alloc_op >= 0:
                self._made_at.setdefault(st.alloc_op, []).append(st.sid)
        for s in self.segs:
            for i in range(s.start, s.stop):
                self._own_made_at(i, s)

    def _own_made_at(self, i: int, s: _Seg) -> None:
        """The storages op ``i`` of segment ``s`` made: its outputs, and a tensor made outside
        the trace that it is the first to read (a constant), in the order the trace met them."""
        for rank, sid in enumerate(self._made_at.get(i, ())):
            self._own(sid, s.block, (s.kind, i - s.anchor, rank))

    def _scan_optimizer(self) -> None:
        """Classify optimizer ops: ``_foreach`` ops (lists over every block), runs of ops on one
        block's tensors, and the rest (global). Runs and list positions make owners."""
        ops = self.trace.ops
        current: _Seg | None = None
        for i in range(self.optim_start, len(ops)):
            op = ops[i]
            if str(op.func).startswith("aten._foreach_"):
                current = None
                self.foreach_ops.append(i)
                self._own_foreach_outputs(i)
                continue
            blocks = {self.owner[s] for s in (*op.arg_sids, *op.mutated_sids) if s in self.owner}
            if len(blocks) > 1:
                raise NotReplicable(f"optimizer op {op.func} reads tensors of several blocks")
            if not blocks:
                current = None
                continue
            j = blocks.pop()
            if current is None or current.block != j or current.stop != i:
                current = _Seg(i, i, j, ("r", len(self.runs[j])), i)
                self.runs[j].append(current)
                self.segs.append(current)
            current.stop = i + 1
            self._own_made_at(i, current)
        self.segs.sort(key=lambda s: s.start)

    def _own_foreach_outputs(self, i: int) -> None:
        """Output t of a ``_foreach`` op belongs to the block of its first list's item t."""
        op = self.trace.ops[i]
        n = len(op.new_sids)
        if n == 0:
            return
        if n > len(op.arg_sids):
            raise NotReplicable(f"{op.func} makes more tensors than it reads")
        first = op.arg_sids[:n]
        start = 0
        for t in range(n):
            j = self.owner.get(first[t])
            if t == 0 or self.owner.get(first[t - 1]) != j:
                start = t
            if j is not None:
                self._own(op.new_sids[t], j, ("o", i, t - start))

    # ------------------------------------------------------------------ relative forms
    def where(self, i: int) -> _Seg | None:
        """The segment op ``i`` lies in, if any."""
        k = bisect.bisect_right(self._starts, i) - 1
        if k >= 0 and self.segs[k].start <= i < self.segs[k].stop:
            return self.segs[k]
        return None

    def subtree_of(self, cid: int) -> int | None:
        """The position of the block whose subtree holds call ``cid``."""
        for j, c in enumerate(self.cids):
            if c <= cid < c + self.n_sub:
                return j
        return None

    # A reference from block j to a block that is not next to it (the last traced block's output
    # freed in the first one's backward: a pipeline stage's output, kept to its backward's end) is
    # to that traced block itself, not to the block at that distance once the others are laid in.

    def rel_op(self, j: int | None, i: int | None) -> Any:
        if i is None or i < 0:
            return i
        s = self.where(i)
        if s is None or j is None or abs(s.block - j) > 1:
            return ("g", i)
        return ("o", s.block - j, s.kind, i - s.anchor)

    def rel_sid(self, j: int | None, sid: int) -> Ref:
        o = self.owner.get(sid)
        if o is None or j is None or abs(o - j) > 1:
            return ("g", sid)
        return ("s", o - j, self.key_of[sid])

    def rel_call(self, j: int | None, cid: int) -> Ref:
        o = self.subtree_of(cid) if cid >= 0 else None
        if o is None or j is None or abs(o - j) > 1:
            return ("g", cid)
        return ("c", o - j, cid - self.cids[o])

    def rel_op_call(self, j: int | None, i: int) -> Ref:
        """The call op ``i`` runs under, relative to block ``j``; global for an op of a run (a
        list over every parameter runs under whichever call is current, the same for each
        block's part)."""
        s = self.where(i)
        cid = self.trace.ops[i].call
        return self.rel_call(None if s is not None and isinstance(s.kind, tuple) else j, cid)

    def absolute(self, j: int, ref: Ref) -> Any:
        """What a reference made from block ``j`` names in this trace: an op index, a storage id
        or a call id."""
        if not isinstance(ref, tuple):
            return ref
        if ref[0] == "g":
            return ref[1]
        d = ref[1]
        if ref[0] == "o":
            return next(s.anchor for s in self.segs if s.block == j + d and s.kind == ref[2]) + ref[3]
        if ref[0] == "s":
            return self.by_key[j + d][ref[2]]
        return self.cids[j + d] + ref[2]

    def context_of_op(self, i: int) -> int | None:
        s = self.where(i)
        return None if s is None else s.block
