"""The selective-checkpointing grouping rules, as data: which ops of a module share one decision.

Both consumers read the same groups: ``estimators.tracing.sac`` (the greedy order and the exact
trade-off curve) and ``solver.op_milp`` (the op-level knapsack), as xformers' checkpoint.py
hands its solver index lists of view-like, in-place and random ops. Rules, over one module's
``SACOp`` table:

* an in-place op shares the decision of the op that created the storage it mutates
  (``inplace_parent``; chains of in-place ops form one group);
* an in-place op whose ``inplace_parent`` is its own index mutates a storage made outside the
  module: its group must be saved (recomputing it would apply the mutation a second time);
* an op that reads a storage before a later in-place op mutates it (``reads_before_mutation``)
  must not be recomputed while the storage's creator is cached (saved, the storage holds the
  mutated values when the recompute reads it): where the creator's group is always recomputed
  nothing is needed; elsewhere the reader shares its decision, and where a saved group would
  not cache the reader's output (autograd keeps none of it) the group must be recomputed; a
  storage made outside the module: the reader's group must be saved. A reader that must be
  recomputed in a group that must be saved is named by ``unsafe_reads``: such a module is not
  checkpointed at all (``estimators.tracing.aggregate``);
* all random ops of the module form one group (a checkpoint replays the RNG from the start of the
  region, so the recompute draws the forward's numbers only if they are recomputed together);
* a group holding a view or an op with a cache cost (outputs autograd does not keep) must be
  recomputed: a view costs nothing to recompute, and caching the other would hold memory the
  unplanned step never held. A must-save rule wins over a must-recompute one.

Torch-free (the solver imports it): it reads only the plain numbers of ``SACOp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence


if TYPE_CHECKING:
    from estimators.contract.module_info import SACOp

__all__ = ["SACGroup", "cached_if_saved", "sac_groups", "unsafe_reads"]


@dataclass(frozen=True, kw_only=True)
class SACGroup:
    """Ops that are saved or recomputed together, and whether the rules fix that decision."""

    ops: tuple[int, ...]
    """Indices in the module's op table, ascending."""
    memory_bytes: int
    """Bytes freed when the group is recomputed (sum of its ops' ``memory_bytes``)."""
    runtime_ms: float
    """Time to recompute the group (sum of its ops' ``runtime_ms``, in op order)."""
    must_save: bool = False
    """Holds an in-place op on a storage made outside the module."""
    must_recompute: bool = False
    """Holds a view or an op with a cache cost, and no must-save op."""

    @property
    def is_choice(self) -> bool:
        """Neither decision is forced: the greedy curve and the knapsack decide."""
        return not (self.must_save or self.must_recompute)


def cached_if_saved(op: SACOp) -> bool:
    """A saved group caches this op's output: autograd saves it, it is no view, and caching it
    costs nothing the unplanned step did not hold. The one test of what a plan caches
    (``planner.planning.solve.module_plan``), what a recompute re-makes (``estimators.tracing.aggregate``) and
    what may go to host (``solver.offload.cost.offload_ops``)."""
    return op.is_saved and not op.is_view and not op.cache_cost_bytes


def sac_groups(ops: Sequence[SACOp]) -> tuple[SACGroup, ...]:
    """The groups of ``ops`` under the rules of this module, in order of their first op.

    Raises ValueError for an ``inplace_parent`` that is not -1, the op's own index or an earlier
    op of the table, and for a ``reads_before_mutation`` entry that is not the op itself or an
    earlier op."""
    uf, save, recompute, _ = _settle(ops)
    groups = []
    for members in sorted(sorted(s) for s in uf.to_sets()):
        root = uf[members[0]]
        groups.append(
            SACGroup(
                ops=tuple(members),
                memory_bytes=sum(ops[i].memory_bytes for i in members),
                runtime_ms=sum(ops[i].runtime_ms for i in members),
                must_save=save[root],
                must_recompute=recompute[root] and not save[root],
            )
        )
    return tuple(groups)


def unsafe_reads(ops: Sequence[SACOp]) -> tuple[int, ...]:
    """Ops that read a storage a later in-place op overwrites, a saved group would not cache, and
    whose group must be saved: a checkpoint would recompute them from the overwritten storage,
    so the module must not be checkpointed at all."""
    return _settle(ops)[3]


class _UnionFind:
    """Disjoint sets over ``range(n)`` (union by size, path halving): ``uf[i]`` is i's root."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.size = [1] * n

    def __getitem__(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, *items: int) -> None:
        roots = list(dict.fromkeys(self[i] for i in items))
        if not roots:
            return
        best = max(roots, key=lambda r: self.size[r])
        for r in roots:
            if r != best:
                self.parent[r] = best
                self.size[best] += self.size[r]

    def to_sets(self) -> list[set[int]]:
        sets: dict[int, set[int]] = {}
        for i in range(len(self.parent)):
            sets.setdefault(self[i], set()).add(i)
        return list(sets.values())


def _settle(ops: Sequence[SACOp]) -> tuple[_UnionFind, dict[int, bool], dict[int, bool], tuple[int, ...]]:
    """(union-find of the groups, must-save and must-recompute by root, unsafe readers)."""
    uf = _UnionFind(len(ops))
    for i, op in enumerate(ops):
        p = op.inplace_parent
        if p == -1 or p == i:
            continue
        if not (isinstance(p, int) and 0 <= p < i):
            raise ValueError(
                f"op {i} ({op.func}): inplace_parent must index an earlier op in this table, "
                f"its own index, or be -1, got {p!r}"
            )
        uf.union(i, p)
    uf.union(*(i for i, op in enumerate(ops) if op.is_random))
    # Per group (by root): holds a view or a cache-cost op (recomputed), an outside mutation or
    # an outside storage read before it is overwritten (saved).
    recompute = {i: False for i in range(len(ops))}
    save = {i: False for i in range(len(ops))}
    links: list[tuple[int, int]] = []
    for i, op in enumerate(ops):
        recompute[uf[i]] |= op.is_view or op.cache_cost_bytes > 0
        save[uf[i]] |= op.inplace_parent == i
        for p in op.reads_before_mutation:
            if not (isinstance(p, int) and 0 <= p <= i):
                raise ValueError(
                    f"op {i} ({op.func}): reads_before_mutation must index earlier ops of this "
                    f"table or the op itself, got {p!r}"
                )
            if p == i:
                save[uf[i]] = True
            else:
                links.append((i, p))

    def merge(a: int, b: int, *, recomputed: bool) -> None:
        ra, rb = uf[a], uf[b]
        uf.union(a, b)
        r = uf[a]
        recompute[r] = recompute[ra] or recompute[rb] or recomputed
        save[r] = save[ra] or save[rb]

    # Reads before an in-place overwrite: a recompute of the reader must not meet the creator's
    # cached (overwritten) storage. Where the creator's group is always recomputed that cannot
    # happen; elsewhere the reader shares its decision, and where a saved group would not cache
    # the reader's output (autograd keeps none of it: h.mean() before h.relu_()), the group is
    # always recomputed. Flags only grow as groups merge, so links are settled to a fixpoint: a
    # reader left free because its creator's group was recompute-only must join it once a later
    # merge makes that group saved.
    pending = links
    while pending:
        waiting = []
        for i, p in pending:
            if recompute[uf[p]] and not save[uf[p]] and uf[i] != uf[p]:
                waiting.append((i, p))  # the creator is always recomputed, so far
            elif uf[i] != uf[p] or not cached_if_saved(ops[i]):
                merge(i, p, recomputed=not cached_if_saved(ops[i]))
        if len(waiting) == len(pending):
            break
        pending = waiting
    unsafe = tuple(sorted({i for i, p in links if uf[i] == uf[p] and save[uf[i]] and not cached_if_saved(ops[i])}))
    return uf, save, recompute, unsafe
