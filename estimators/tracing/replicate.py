"""The full step's trace from a truncated one: the middle blocks of a stack laid in as copies.

A truncated trace ran blocks 0, 1, 2 and the last block ``N - 1`` of a stack
(``estimators.tracing.stacks``). :func:`replicate` checks that it may stand for the full step,
then builds the trace the full step would have given, op for op.

Blocks 1 and 2 are first checked to trace alike and merged into the template every laid-in block
is built from (``estimators.tracing.block_template``: what a block does alone and with the block
before it is read off block 2, what it does with the block after it off block 1).

The copies go in at their places: their forward after block 2's, their backward (in reverse
order) before block 2's, under a split backward (``estimators.tracing.block_layout``) their input
halves so and their weight halves (in order) after block 2's, their runs (optimizer loops, a split
backward's lists over every parameter) after block 2's runs, their tensors after block 2's in every
``_foreach`` list (whose runtime the trace priced over the full lists:
``estimators.tracing.truncation.FullListsRuntime``). Block 2 itself is rebuilt from the template
too (its next block is now block 3), and the last block's references to its previous block go to
block ``N - 2``.

Any check that fails raises :class:`NotReplicable` with the reason; the caller traces the full
model instead. Nothing here estimates: the result is a ``StepTrace`` like any other, so the
memory timeline, the ModuleInfo and every prediction are derived from it unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from estimators.tracing.block_layout import BlockLayout, NotReplicable
from estimators.tracing.block_template import BlockTemplate, TemplateOp, check_outside, runs_of
from estimators.tracing.records import ModuleCall, OpRecord, StepTrace, StorageRecord
from estimators.tracing.stacks import Stack

__all__ = ["replicate", "expand_stacks", "NotReplicable"]

logger = logging.getLogger(__name__)


def expand_stacks(trace: StepTrace, stacks: list[Stack], owners: list[dict[int, int]], root_name: str) -> StepTrace:
    """``trace`` of a truncated model with every stack replicated in turn; ``owners``: each
    stack's pre-step storage owners (``estimators.tracing.truncation.pre_step_owners``)."""
    for st, own in zip(stacks, owners):
        prefix = f"{root_name}.{st.container}." if st.container else f"{root_name}."
        trace = replicate(BlockLayout(trace, prefix, st.traced_keys, own), st.keys)
        logger.debug("%s: traced blocks %s of %d, the others laid in as copies of block %s",
                     prefix[:-1], ", ".join(st.traced_keys), st.n_blocks, st.traced_keys[2])
    return trace


def replicate(layout: BlockLayout, keys: tuple[str, ...]) -> StepTrace:
    """The trace of the step with every block of the stack, whose children's ``keys`` are given in
    order (see the module docstring)."""
    template = BlockTemplate(layout)
    check_outside(layout)
    return _Builder(layout, keys, template).build()


# ---------------------------------------------------------------------------------- build


class _Builder:
    """Lays blocks 3 .. N-2 into the truncated trace (module docstring)."""

    def __init__(self, L: BlockLayout, keys: tuple[str, ...], template: BlockTemplate) -> None:
        self.L, self.trace, self.t = L, L.trace, template
        self.stack_keys = keys
        self.N = len(keys)
        self.M = self.N - 4
        self.pos = [0, 1, 2, self.N - 1]  # full position of truncated position j
        calls = self.trace.calls
        self.c3 = L.cids[3]
        self.r2 = min(c.post_rank for c in calls[L.cids[2]:L.cids[2] + L.n_sub])
        self.r3 = self.r2 + L.n_sub
        if min(c.post_rank for c in calls[self.c3:self.c3 + L.n_sub]) != self.r3:
            raise NotReplicable("a module's forward ends between two blocks'")
        self.seq_period = calls[L.cids[2]].seq_start - calls[L.cids[1]].seq_start
        self.seq3 = calls[self.c3].seq_start
        self.keys2 = list(L.by_key[2])
        self.sid_base = len(self.trace.storages)
        self.real = {p: j for j, p in enumerate(self.pos)}
        # Storage ids by key at every position, and each position's first call id.
        self.sids_at: list[dict[Any, int]] = []
        self.call_base: list[int] = []
        n_keys = len(self.keys2)
        for p in range(self.N):
            j = self.real.get(p)
            if j is not None:
                self.sids_at.append(L.by_key[j])
                self.call_base.append(self.new_cid(L.cids[j]))
            else:
                first = self.sid_base + (p - 3) * n_keys
                self.sids_at.append({k: first + t for t, k in enumerate(self.keys2)})
                self.call_base.append(self.c3 + (p - 3) * L.n_sub)
        self._lay_out_ops()

    # ------------------------------------------------------------------ positions
    def _template_of(self, p: int) -> int | None:
        """The truncated position of full position ``p`` if it was traced, else None (a copy)."""
        return self.real.get(p)

    def _lay_out_ops(self) -> None:
        """The new op sequence: ("orig", i) or ("copy", k, i), and the anchors of every segment."""
        L, ops = self.L, self.trace.ops
        forward, backward = range(3, self.N - 1), range(self.N - 2, 2, -1)
        after: dict[int, list[tuple]] = {}  # the copies laid in right after an original op
        for s in L.segs:
            if s.block != 2:
                continue
            # Forwards, weight halves and runs in the blocks' order, after block 2's; backwards
            # (input halves) in reverse order, before block 2's (after the last block's).
            at, ks = (s.start - 1, backward) if s.kind == "b" else (s.stop - 1, forward)
            after.setdefault(at, []).extend(("copy", k, i) for k in ks for i in range(s.start, s.stop))
        order: list[tuple] = []
        for i in range(len(ops)):
            order.append(("orig", i))
            order += after.get(i, ())
        self.order = order
        self.new_of = [0] * len(ops)
        self.anchor: dict[tuple[int, Any], int] = {}
        anchors2 = {s.anchor: s.kind for s in L.segs if s.block == 2}
        for n, entry in enumerate(order):
            if entry[0] == "orig":
                self.new_of[entry[1]] = n
                s = L.where(entry[1])
                if s is not None and s.anchor == entry[1]:
                    self.anchor[(self.pos[s.block], s.kind)] = n
            else:
                kind = anchors2.get(entry[2])
                if kind is not None:
                    self.anchor[(entry[1], kind)] = n

    def new_cid(self, cid: int) -> int:
        return cid if cid < self.c3 else cid + self.M * self.L.n_sub

    def _call_base(self, p: int) -> int:
        return self.call_base[p]

    # ------------------------------------------------------------------ resolution at a position
    def op_at(self, p: int, rel: Any) -> Any:
        if rel is None or isinstance(rel, int):
            return rel
        if rel[0] == "g":
            return self.new_of[rel[1]]
        _, d, kind, off = rel
        return self.anchor[(p + d, kind)] + off

    def sid_at(self, p: int, rel: tuple) -> int:
        if rel[0] == "g":
            return rel[1]
        try:
            return self.sids_at[p + rel[1]][rel[2]]
        except KeyError:
            raise NotReplicable(f"block at position {p + rel[1]} has no storage {rel[2]}") from None

    def call_at(self, p: int, rel: tuple) -> int:
        if rel[0] == "g":
            return self.new_cid(rel[1]) if rel[1] >= 0 else rel[1]
        return self.call_base[p + rel[1]] + rel[2]

    # ------------------------------------------------------------------ records
    def build(self) -> StepTrace:
        L, trace, t = self.L, self.trace, self.t
        rebuilt = {op.template: op for op in t.ops}  # block 2's ops come from the template
        ops = []
        for n, entry in enumerate(self.order):
            if entry[0] == "copy":
                ops.append(self._from_template(n, entry[1], rebuilt[entry[2]]))
            elif entry[1] in rebuilt:
                ops.append(self._from_template(n, 2, rebuilt[entry[1]]))
            else:
                ops.append(self._op(n, trace.ops[entry[1]]))
        storages = [None if L.owner.get(s.sid) == 2 else self._storage(s) for s in trace.storages]
        for p in range(2, self.N - 1):
            for key in self.keys2:
                sid = self.sids_at[p][key]
                rec = self._template_storage(p, sid, trace.storages[L.by_key[2][key]], t.storages[key])
                if p == 2:
                    storages[sid] = rec
                else:
                    storages.append(rec)
        calls = [self._call(c) for c in trace.calls]
        twin_of = {self.new_cid(c): self.new_cid(r) for c, r in trace.twin_of.items()}
        rep = self.new_cid(L.cids[2])
        for p in range(2, self.N - 1):
            for off in range(L.n_sub):
                c = self._template_call(p, off)
                if p == 2:
                    calls[c.cid] = c
                else:
                    calls.append(c)
                    twin_of[c.cid] = rep + off
        calls.sort(key=lambda c: c.cid)
        leaves, params, grads = self._module_tables()
        return StepTrace(
            ops=ops, storages=storages, calls=calls, leaf_fqns=leaves, param_bytes_by_module=params,
            grad_bytes_by_module=grads, device=trace.device, previous_output_sids=trace.previous_output_sids,
            twin_of=twin_of, marked_sids=dict(trace.marked_sids),  # storages keep their ids
            marks={name: self.new_of[i] if i < len(self.new_of) else len(ops) for name, i in trace.marks.items()},
        )

    def _from_template(self, n: int, p: int, t: TemplateOp) -> OpRecord:
        op = self.trace.ops[t.template]
        at = self.sids_at
        # Positional: OpRecord's field order (index, func, phase, call, runtime_ms, new_sids,
        # arg_sids, is_view, mutated_sids, is_random); a copy per laid-in op.
        return OpRecord(n, op.func, op.phase, self.call_at(p, t.call), op.runtime_ms,
                        tuple([r if r.__class__ is int else at[p + r[0]][r[1]] for r in t.new]),
                        tuple([r if r.__class__ is int else at[p + r[0]][r[1]] for r in t.args]),
                        op.is_view,
                        tuple([r if r.__class__ is int else at[p + r[0]][r[1]] for r in t.mutated]),
                        op.is_random)

    def _op(self, n: int, op: OpRecord) -> OpRecord:
        L = self.L
        j = L.context_of_op(op.index)
        if j is None:
            call = self.new_cid(op.call) if op.call >= 0 else op.call
            if op.index in L.foreach_ops:
                return _op_record(op, n, call, self._widen(op.new_sids), self._widen(op.arg_sids),
                                  self._widen(op.mutated_sids))
            return _op_record(op, n, call, op.new_sids, op.arg_sids, op.mutated_sids)
        p = self.pos[j]
        rel = L.rel_sid
        return _op_record(op, n, self.call_at(p, L.rel_op_call(j, op.index)),
                          tuple(self.sid_at(p, rel(j, s)) for s in op.new_sids),
                          tuple(self.sid_at(p, rel(j, s)) for s in op.arg_sids),
                          tuple(self.sid_at(p, rel(j, s)) for s in op.mutated_sids))

    def _widen(self, sids: tuple[int, ...]) -> tuple[int, ...]:
        """A ``_foreach`` list with the copies' tensors inserted after block 2's."""
        runs = runs_of(self.L, sids, 2)
        if not runs:
            return sids
        out: list[int] = []
        last = 0
        for a, b in runs:
            out += sids[last:b]
            keys = [self.L.key_of[s] for s in sids[a:b]]
            for k in range(3, self.N - 1):
                out += [self.sids_at[k][key] for key in keys]
            last = b
        out += sids[last:]
        return tuple(out)

    def _storage(self, s: StorageRecord) -> StorageRecord:
        L = self.L
        j = L.owner.get(s.sid)
        if j is None:
            saved = set()
            for c in s.saved_by_calls:
                saved.add(self.new_cid(c) if c >= 0 else c)
                if L.subtree_of(c) == 2:
                    saved.update(self._call_base(k) + c - L.cids[2] for k in range(3, self.N - 1))
            return StorageRecord(
                s.sid, s.nbytes, self.new_of[s.alloc_op] if s.alloc_op >= 0 else s.alloc_op,
                self.new_of[s.free_op] if s.free_op is not None and s.free_op >= 0 else s.free_op,
                s.kind, s.phase, self.new_cid(s.owner_call) if s.owner_call >= 0 else s.owner_call,
                s.saved, saved)
        p = self.pos[j]
        return StorageRecord(
            s.sid, s.nbytes, self.op_at(p, L.rel_op(j, s.alloc_op)), self.op_at(p, L.rel_op(j, s.free_op)),
            s.kind, s.phase, self.call_at(p, L.rel_call(j, s.owner_call)), s.saved,
            {self.call_at(p, L.rel_call(j, c)) for c in s.saved_by_calls})

    def _template_storage(self, p: int, sid: int, s: StorageRecord, t: tuple) -> StorageRecord:
        alloc, free, owner, saved = t
        return StorageRecord(sid, s.nbytes, self.op_at(p, alloc), self.op_at(p, free), s.kind, s.phase,
                             self.call_at(p, owner), s.saved, {self.call_at(p, c) for c in saved})

    def _call(self, c: ModuleCall) -> ModuleCall:
        L = self.L
        j = L.subtree_of(c.cid)
        if j is not None:
            p = self.pos[j]
            return ModuleCall(
                cid=self._call_base(p) + c.cid - L.cids[j], fqn=c.fqn, parent=self.call_at(p, L.rel_call(j, c.parent)),
                depth=c.depth, seq_start=self._seq(c.seq_start), seq_end=self._seq(c.seq_end),
                fw_first_op=self.op_at(p, L.rel_op(j, c.fw_first_op)), fw_last_op=self.op_at(p, L.rel_op(j, c.fw_last_op)),
                bw_first_op=self.op_at(p, L.rel_op(j, c.bw_first_op)), bw_last_op=self.op_at(p, L.rel_op(j, c.bw_last_op)),
                input_sids=tuple(self.sid_at(p, L.rel_sid(j, s)) for s in c.input_sids),
                output_sids=tuple(self.sid_at(p, L.rel_sid(j, s)) for s in c.output_sids),
                post_rank=self._rank(c.post_rank), input_numel=c.input_numel)
        new = self.new_of
        return ModuleCall(
            cid=self.new_cid(c.cid), fqn=c.fqn, parent=self.new_cid(c.parent) if c.parent >= 0 else c.parent,
            depth=c.depth, seq_start=self._seq(c.seq_start), seq_end=self._seq(c.seq_end),
            fw_first_op=new[c.fw_first_op] if c.fw_first_op >= 0 else c.fw_first_op,
            fw_last_op=new[c.fw_last_op] if c.fw_last_op >= 0 else c.fw_last_op,
            bw_first_op=new[c.bw_first_op] if c.bw_first_op >= 0 else c.bw_first_op,
            bw_last_op=new[c.bw_last_op] if c.bw_last_op >= 0 else c.bw_last_op,
            input_sids=c.input_sids, output_sids=self._widen(c.output_sids),
            post_rank=self._rank(c.post_rank), input_numel=c.input_numel)

    def _template_call(self, p: int, off: int) -> ModuleCall:
        L = self.L
        c = self.trace.calls[L.cids[2] + off]
        parent, fw_first, fw_last, bw_first, bw_last, inputs, outputs = self.t.calls[off]
        name = L.prefix + L.keys[2]
        shift = (p - 2) * self.seq_period
        return ModuleCall(
            cid=self._call_base(p) + off, fqn=L.prefix + self._key(p) + c.fqn[len(name):],
            parent=self.call_at(p, parent), depth=c.depth,
            seq_start=self._seq(c.seq_start) + shift, seq_end=self._seq(c.seq_end) + shift,
            fw_first_op=self.op_at(p, fw_first), fw_last_op=self.op_at(p, fw_last),
            bw_first_op=self.op_at(p, bw_first), bw_last_op=self.op_at(p, bw_last),
            input_sids=tuple(self.sid_at(p, r) for r in inputs), output_sids=tuple(self.sid_at(p, r) for r in outputs),
            post_rank=self.r2 + (p - 2) * L.n_sub + c.post_rank - self.r2, input_numel=c.input_numel)

    def _key(self, p: int) -> str:
        j = self._template_of(p)
        return self.L.keys[j] if j is not None else self.stack_keys[p]

    def _rank(self, r: int) -> int:
        return r if r < self.r3 else r + self.M * self.L.n_sub

    def _seq(self, s: int) -> int:
        if s < 0:
            return s
        return s if s < self.seq3 else s + self.M * self.seq_period

    def _module_tables(self) -> tuple[set[str], dict[str, int], dict[str, int]]:
        """Leaves and parameter / gradient bytes with the copies' modules; the stack's ancestors
        hold the copies' parameters too (each block's own: ``estimators.tracing.stacks``)."""
        L, trace = self.L, self.trace
        rep = L.prefix + L.keys[2]
        leaves = set(trace.leaf_fqns)
        params, grads = dict(trace.param_bytes_by_module), dict(trace.grad_bytes_by_module)
        copies = [L.prefix + self.stack_keys[k] for k in range(3, self.N - 1)]
        for fqn in list(params):
            if fqn == rep or fqn.startswith(rep + "."):
                for name in copies:
                    params[name + fqn[len(rep):]] = params[fqn]
                    grads[name + fqn[len(rep):]] = grads[fqn]
        for fqn in trace.leaf_fqns:
            if fqn == rep or fqn.startswith(rep + "."):
                leaves.update(name + fqn[len(rep):] for name in copies)
        container = L.prefix[:-1]
        for fqn in params:
            if container == fqn or container.startswith(fqn + "."):
                params[fqn] += self.M * trace.param_bytes_by_module.get(rep, 0)
                grads[fqn] += self.M * trace.grad_bytes_by_module.get(rep, 0)
        return leaves, params, grads


def _op_record(op: OpRecord, index: int, call: int, new_sids, arg_sids, mutated_sids) -> OpRecord:
    return OpRecord(index=index, func=op.func, phase=op.phase, call=call, runtime_ms=op.runtime_ms,
                    new_sids=tuple(new_sids), arg_sids=tuple(arg_sids), is_view=op.is_view,
                    mutated_sids=tuple(mutated_sids), is_random=op.is_random)
