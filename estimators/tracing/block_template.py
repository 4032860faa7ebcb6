"""Blocks 1 and 2 of a truncated trace, checked to trace alike and merged into the template every
laid-in block is built from (``estimators.tracing.replicate``).

Every block ``k`` of ``3 .. N-2`` of a stack sits between two middle blocks. What it does alone (its
ops, the storages it makes and frees, its module calls) and what it does with the block before it
are read off block 2, whose previous block (1) is a middle one; what it does with the block after
it (reading the next block's gradients, freeing its output in the next block's backward) is read
off block 1, whose next block (2) is a middle one. Blocks 1 and 2 must agree on everything else,
written relative to themselves (``estimators.tracing.block_layout``): functions, runtimes, flags,
bytes, kinds, phases, the storages and calls they reference. The first and last blocks may differ
(a gradient summed over the layers starts in the last one's backward). Every reference between
blocks must reach the next or the previous block only (a record of the first or last block that
the block not next to it names globally, and the one next to it names too, is that same record
for every block: where a split backward's weight half frees every block's saved tensors), and
nothing outside the blocks but the
optimizer's ``_foreach`` lists and the outputs of module calls may touch blocks 1 and 2
(:func:`check_outside`). A failed check raises ``NotReplicable`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from estimators.tracing.block_layout import BlockLayout, NotReplicable

__all__ = ["BlockTemplate", "TemplateOp", "check_outside", "runs_of"]


def _delta(ref: Any) -> int | None:
    return ref[1] if isinstance(ref, tuple) and ref[0] in ("s", "o", "c") else None


def _is_global(ref: Any) -> bool:
    return isinstance(ref, tuple) and ref[0] == "g"


def _pick(L: BlockLayout, r1: Any, r2: Any, what: str) -> Any:
    """Block 2's view of a reference, with facts about the next block taken from block 1's."""
    d1, d2 = _delta(r1), _delta(r2)
    for d in (d1, d2):
        if d is not None and abs(d) > 1:
            raise NotReplicable(f"{what} reaches a block that is not next to it")
    if (d1 == -1 and _is_global(r2)) or (_is_global(r1) and d2 == 1):
        # A reference to an end block's record that the other block, not next to that one,
        # makes globally, to the same record (the last op of a split backward's weight half,
        # where every block's saved tensors go): the same record for every block.
        if L.absolute(1, r1) == L.absolute(2, r2):
            return r1 if _is_global(r1) else r2
    if d1 == 1 or d2 == 1:
        if d1 != 1 or d2 not in (1, None):
            raise NotReplicable(f"{what}: {r1} in block 1, {r2} in block 2")
        return r1
    if d2 == -1:
        if d1 not in (-1, None):
            raise NotReplicable(f"{what}: {r1} in block 1, {r2} in block 2")
        return r2
    if r1 != r2:
        raise NotReplicable(f"{what}: {r1} in block 1, {r2} in block 2")
    return r2


def _picks(L: BlockLayout, a: tuple, b: tuple, what: str) -> tuple:
    if len(a) != len(b):
        raise NotReplicable(f"{what}: {len(a)} in block 1, {len(b)} in block 2")
    return tuple(_pick(L, x, y, what) for x, y in zip(a, b))


def _pick_set(a, b, what: str) -> frozenset:
    """Calls saving a storage: its own block's and global ones agree, the previous block's come
    from block 2, the next block's from block 1."""
    same1 = {r for r in a if _delta(r) in (0, None)}
    same2 = {r for r in b if _delta(r) in (0, None)}
    if same1 != same2 or any(abs(_delta(r) or 0) > 1 for r in (*a, *b)):
        raise NotReplicable(f"{what}: saved by {sorted(a)} in block 1, {sorted(b)} in block 2")
    return frozenset(same2 | {r for r in b if _delta(r) == -1} | {r for r in a if _delta(r) == 1})


@dataclass(frozen=True)
class TemplateOp:
    template: int  # op index in block 2's segment
    kind: Any  # segment kind
    call: Any
    new: tuple  # storages: a global sid (int) or (delta, key)
    args: tuple
    mutated: tuple


def _compiled(refs: tuple) -> tuple:
    """Storage references as the builder reads them fastest: a global sid, or (delta, key)."""
    return tuple(r[1] if r[0] == "g" else (r[1], r[2]) for r in refs)


class BlockTemplate:
    """Block 2's records, written relative to block 2, with block 1's facts about the next block
    (see the module docstring); building it is the check that blocks 1 and 2 trace alike."""

    def __init__(self, L: BlockLayout) -> None:
        trace = L.trace
        segs = [[s for s in L.segs if s.block == j] for j in (1, 2)]
        if [s.kind for s in segs[0]] != [s.kind for s in segs[1]] or \
                [s.stop - s.start for s in segs[0]] != [s.stop - s.start for s in segs[1]]:
            raise NotReplicable("blocks 1 and 2 have different segments (ops or optimizer runs)")
        self.ops: list[TemplateOp] = []
        for s1, s2 in zip(*segs):
            for i1, i2 in zip(range(s1.start, s1.stop), range(s2.start, s2.stop)):
                a, b = trace.ops[i1], trace.ops[i2]
                what = f"op {i2 - s2.anchor} of {s2.kind} ({b.func})"
                if (a.func, a.phase, a.runtime_ms, a.is_view, a.is_random) != (
                        b.func, b.phase, b.runtime_ms, b.is_view, b.is_random):
                    raise NotReplicable(f"{what}: block 1 runs {a.func} ({a.runtime_ms} ms)")
                self.ops.append(TemplateOp(
                    i2, s2.kind, _pick(L, L.rel_op_call(1, i1), L.rel_op_call(2, i2), what),
                    _compiled(_picks(L, _rels(L, 1, a.new_sids), _rels(L, 2, b.new_sids), what)),
                    _compiled(_picks(L, _rels(L, 1, a.arg_sids), _rels(L, 2, b.arg_sids), what)),
                    _compiled(_picks(L, _rels(L, 1, a.mutated_sids), _rels(L, 2, b.mutated_sids), what))))
        if L.by_key[1].keys() != L.by_key[2].keys():
            diff = set(L.by_key[1]) ^ set(L.by_key[2])
            raise NotReplicable(f"blocks 1 and 2 own different storages ({sorted(map(str, diff))[:3]})")
        self.storages: dict[Any, tuple] = {}
        for key, sid2 in L.by_key[2].items():
            a, b = trace.storages[L.by_key[1][key]], trace.storages[sid2]
            what = f"storage {key}"
            if (a.nbytes, a.kind, a.phase, a.saved) != (b.nbytes, b.kind, b.phase, b.saved):
                raise NotReplicable(f"{what}: {a.nbytes} B {a.kind.name} in block 1, {b.nbytes} B {b.kind.name} in 2")
            self.storages[key] = (
                _pick(L, L.rel_op(1, a.alloc_op), L.rel_op(2, b.alloc_op), what),
                _pick(L, L.rel_op(1, a.free_op), L.rel_op(2, b.free_op), what),
                _pick(L, L.rel_call(1, a.owner_call), L.rel_call(2, b.owner_call), what),
                _pick_set({L.rel_call(1, c) for c in a.saved_by_calls}, {L.rel_call(2, c) for c in b.saved_by_calls}, what))
        self.calls: list[tuple] = []
        for c1, c2 in zip(trace.calls[L.cids[1]:L.cids[1] + L.n_sub], trace.calls[L.cids[2]:L.cids[2] + L.n_sub]):
            what = f"call {c2.fqn}"
            if (c1.fqn[len(L.prefix + L.keys[1]):], c1.depth, c1.input_numel) != (
                    c2.fqn[len(L.prefix + L.keys[2]):], c2.depth, c2.input_numel):
                raise NotReplicable(f"{what} differs from {c1.fqn}")
            self.calls.append((
                _pick(L, L.rel_call(1, c1.parent), L.rel_call(2, c2.parent), what),
                *(_pick(L, L.rel_op(1, getattr(c1, f)), L.rel_op(2, getattr(c2, f)), what)
                  for f in ("fw_first_op", "fw_last_op", "bw_first_op", "bw_last_op")),
                _picks(L, _rels(L, 1, c1.input_sids), _rels(L, 2, c2.input_sids), what),
                _picks(L, _rels(L, 1, c1.output_sids), _rels(L, 2, c2.output_sids), what)))
        self._check_ranks(L)
        self._check_globals(L)

    @staticmethod
    def _check_ranks(L: BlockLayout) -> None:
        calls = L.trace.calls
        ranks = [[calls[c].post_rank - min(calls[x].post_rank for x in range(L.cids[j], L.cids[j] + L.n_sub))
                  for c in range(L.cids[j], L.cids[j] + L.n_sub)] for j in (1, 2)]
        if ranks[0] != ranks[1] or sorted(ranks[1]) != list(range(L.n_sub)):
            raise NotReplicable("the modules of blocks 1 and 2 end their forwards in different orders")

    @staticmethod
    def _check_globals(L: BlockLayout) -> None:
        """Storages of no block that blocks 1 and 2 save (an attention mask) are saved by both
        alike; none is freed inside either (its last use would then depend on the depth)."""
        seen: list[dict] = [{}, {}]
        for s in L.trace.storages:
            if s.sid in L.owner:
                continue
            for j in (1, 2):
                mine = frozenset(L.rel_call(j, c) for c in s.saved_by_calls if L.subtree_of(c) == j)
                if mine:
                    seen[j - 1][s.sid] = mine
                if s.free_op is not None and s.free_op >= 0 and L.context_of_op(s.free_op) == j:
                    raise NotReplicable(f"a storage made outside the blocks dies inside block {L.keys[j]}")
        if seen[0] != seen[1]:
            raise NotReplicable("blocks 1 and 2 save different tensors made outside the blocks")


def _rels(L: BlockLayout, j: int, sids: tuple[int, ...]) -> tuple:
    return tuple(L.rel_sid(j, s) for s in sids)


def check_outside(L: BlockLayout) -> None:
    """Nothing outside the blocks touches blocks 1 and 2 but ``_foreach`` lists and the arguments
    of module calls, where block 2's tensors follow block 1's alike (the copies' go after them)."""
    trace, middle, foreach = L.trace, {1, 2}, set(L.foreach_ops)
    for op in trace.ops:
        if op.index not in foreach and L.context_of_op(op.index) is None:
            if any(L.owner.get(s) in middle for s in (*op.arg_sids, *op.mutated_sids, *op.new_sids)):
                raise NotReplicable(f"{op.func} outside the blocks reads tensors of the middle blocks")
    lists = [(str(trace.ops[i].func), sids) for i in L.foreach_ops
             for sids in (trace.ops[i].arg_sids, trace.ops[i].mutated_sids, trace.ops[i].new_sids)]
    # A module returning every block's output (an encoder's hidden states); one given them would
    # count their elements in its input_numel, which the trace cannot widen.
    lists += [(c.fqn, c.output_sids) for c in trace.calls if L.subtree_of(c.cid) is None]
    for c in trace.calls:
        if L.subtree_of(c.cid) is None and any(L.owner.get(s) in middle for s in c.input_sids):
            raise NotReplicable(f"{c.fqn} is given tensors of the middle blocks")
    for what, sids in lists:
        for a, b in runs_of(L, sids, 2):
            before = sids[max(0, a - (b - a)):a]
            if len(before) != b - a or any(L.owner.get(s) != 1 for s in before) or \
                    [L.key_of[s] for s in before] != [L.key_of[s] for s in sids[a:b]]:
                raise NotReplicable(f"{what}: block {L.keys[2]}'s tensors do not follow block {L.keys[1]}'s "
                                    "alike in its arguments")
        if any(L.owner.get(s) == 1 for s in sids) and not runs_of(L, sids, 2):
            raise NotReplicable(f"{what} takes tensors of block {L.keys[1]} but not of block {L.keys[2]}")


def runs_of(L: BlockLayout, sids: tuple[int, ...], j: int) -> list[tuple[int, int]]:
    """Maximal [a, b) ranges of ``sids`` owned by block ``j``."""
    out, a = [], None
    for t, s in enumerate((*sids, None)):
        mine = s is not None and L.owner.get(s) == j
        if mine and a is None:
            a = t
        elif not mine and a is not None:
            out.append((a, t))
            a = None
    return out
