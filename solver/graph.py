"""The module tree the solver reasons about: a networkx DiGraph of parent -> child.

A module's parent is the longest proper dotted prefix of its fqn that is itself a module, compared
by whole path components: ``"M.blocks.1"`` is not under ``"M.blocks.10"`` and ``"ba.c"`` is not
under ``"a"``. Containers that never run forward (``nn.ModuleList``) are absent from a trace, so
``"M.blocks.0"`` hangs under ``"M"`` when ``"M.blocks"`` is missing.

    g = Graph.from_module_info(info)
    [n.fqn for n in g.descendants("GPT.blocks.0")]      # forward pre-order
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

import networkx as nx

from solver.errors import GraphError, UnknownModuleError

if TYPE_CHECKING:  # only types
    from estimators.contract.module_info import ModOrder, ModStats, ModuleInfo

__all__ = ["Graph", "Node", "is_submodule", "close_names"]

logger = logging.getLogger(__name__)


def is_submodule(descendant: str, ancestor: str) -> bool:
    """True if ``descendant`` lies strictly under ``ancestor`` by dotted path components."""
    return descendant.startswith(ancestor + ".") and len(descendant) > len(ancestor) + 1


def close_names(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Known names that look like ``name`` (for 'did you mean' messages)."""
    import difflib

    return difflib.get_close_matches(name, list(known), n=n, cutoff=0.5)


def _dotted_parents(names: Sequence[str]) -> dict[str, str | None]:
    """Parent = longest proper dotted prefix that is a module; the first name is the root."""
    known = set(names)
    out: dict[str, str | None] = {names[0]: None}
    for fqn in names[1:]:
        parts = fqn.split(".")
        prefixes = (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
        out[fqn] = next((p for p in prefixes if p in known), None)
        if out[fqn] is None:
            want = fqn.rsplit(".", 1)[0] if "." in fqn else "<none>"
            raise GraphError(
                f"module {fqn!r} has unknown parent {want!r}: no dotted prefix of it is a module; "
                f"every fqn must start with the root's name {names[0]!r}"
            )
    return out


@dataclass(frozen=True, eq=False)
class Node:
    """One module of the tree, with its stats and its place in the two forward orders."""

    fqn: str
    index: int
    """Position in forward pre-order."""
    pos_fw_post_order: int
    """Position in forward post-order; -1 if the order does not list the module."""
    parent: str | None
    depth: int
    stats: ModStats

    @property
    def is_leaf(self) -> bool:
        return self.stats.is_leaf


class Graph:
    """Module tree in forward pre-order, with prefix-correct ancestor/descendant queries."""

    def __init__(
        self,
        stats: Sequence[ModStats],
        parents: Mapping[str, str | None] | None = None,
        mod_order: ModOrder | None = None,
    ) -> None:
        """Build and validate the tree.

        ``stats`` are in forward pre-order, root first. ``parents`` maps fqn -> parent fqn (None
        for the root); by default it is derived from the dotted names."""
        names = [s.fqn for s in stats]
        _check_unique(names)
        if parents is None:
            parents = _dotted_parents(names)
        self._dag = _build_dag(names, parents)
        order = _pre_order(names, mod_order)
        by_name = {s.fqn: s for s in stats}
        post = _post_positions(self._dag, order, mod_order)
        depth = nx.single_source_shortest_path_length(self._dag, names[0])
        rank = {n: i for i, n in enumerate(order)}
        self._nodes: list[Node] = []
        self._by_name: dict[str, Node] = {}
        for i, fqn in enumerate(order):
            parent = parents.get(fqn)
            if parent is not None and rank[parent] > i:
                raise GraphError(f"forward pre-order lists {fqn!r} before its parent {parent!r}")
            node = Node(fqn, i, post.get(fqn, -1), parent, depth[fqn], by_name[fqn])
            self._nodes.append(node)
            self._by_name[fqn] = node

    @classmethod
    def from_module_info(cls, info: ModuleInfo) -> "Graph":
        return cls(info.mod_stats, mod_order=info.mod_order)

    # ------------------------------------------------------------------ queries
    @property
    def nodes(self) -> tuple[Node, ...]:
        """All nodes in forward pre-order."""
        return tuple(self._nodes)

    @property
    def root(self) -> Node:
        return self._nodes[0]

    @property
    def nx_graph(self) -> nx.DiGraph:
        """The parent -> child DiGraph (do not mutate)."""
        return self._dag

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._by_name

    def node(self, fqn: str) -> Node:
        try:
            return self._by_name[fqn]
        except KeyError:
            hint = close_names(fqn, self._by_name)
            more = f"; did you mean {', '.join(map(repr, hint))}?" if hint else ""
            raise UnknownModuleError(f"no module named {fqn!r} in this graph{more}") from None

    def children(self, fqn: str) -> list[Node]:
        self.node(fqn)
        return sorted((self._by_name[c] for c in self._dag.successors(fqn)), key=lambda n: n.index)

    def ancestors(self, fqn: str) -> list[Node]:
        """Strict ancestors, nearest first."""
        out, cur = [], self.node(fqn).parent
        while cur is not None:
            out.append(self._by_name[cur])
            cur = self._by_name[cur].parent
        return out

    def descendants(self, fqn: str) -> list[Node]:
        """Strict descendants in forward pre-order."""
        self.node(fqn)
        return sorted((self._by_name[d] for d in nx.descendants(self._dag, fqn)), key=lambda n: n.index)

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        """True if ``ancestor`` is a strict ancestor of ``descendant`` in this tree."""
        return any(a.fqn == ancestor for a in self.ancestors(descendant))


def _check_unique(names: Sequence[str]) -> None:
    seen: set[str] = set()
    dups = sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if dups:
        raise GraphError(f"duplicate module fqns: {', '.join(map(repr, dups))}")
    if not names:
        raise GraphError("a module graph needs at least one module (the root)")


def _build_dag(names: Sequence[str], parents: Mapping[str, str | None]) -> nx.DiGraph:
    known = set(names)
    dag = nx.DiGraph()
    dag.add_nodes_from(names)
    roots = []
    for n in names:
        p = parents.get(n)
        if p is None:
            roots.append(n)
        elif p not in known:
            hint = close_names(p, known)
            more = f" (did you mean {', '.join(map(repr, hint))}?)" if hint else ""
            raise GraphError(f"module {n!r} has unknown parent {p!r}{more}")
        else:
            dag.add_edge(p, n)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = " -> ".join(u for u, _ in nx.find_cycle(dag))
        raise GraphError(f"module parents form a cycle: {cycle}")
    if len(roots) != 1:
        raise GraphError(
            f"a module graph needs exactly one root, found {len(roots)}: "
            f"{', '.join(map(repr, roots[:5]))}; every other fqn must start with the root's name"
        )
    if roots[0] != names[0]:
        raise GraphError(f"the root {roots[0]!r} must come first (forward pre-order), not {names[0]!r}")
    return dag


def _check_order_names(what: str, order: Sequence[str], known: set[str]) -> None:
    unknown = [n for n in order if n not in known]
    if unknown:
        hint = close_names(unknown[0], known)
        more = f" (did you mean {', '.join(map(repr, hint))}?)" if hint else ""
        raise GraphError(f"mod_order.{what} names unknown modules: {unknown[:5]}{more}")


def _pre_order(names: Sequence[str], mod_order: ModOrder | None) -> list[str]:
    """Forward pre-order: ``mod_order.fw_pre_order`` when given (it must be a permutation)."""
    if mod_order is None:
        return list(names)
    known = set(names)
    for what in ("fw_pre_order", "fw_post_order", "bw_pre_order", "bw_post_order"):
        _check_order_names(what, getattr(mod_order, what), known)
    pre = list(dict.fromkeys(mod_order.fw_pre_order))
    if not pre:
        return list(names)
    if set(pre) != known:
        missing = sorted(known - set(pre))[:5]
        raise GraphError(f"mod_order.fw_pre_order misses modules: {missing}")
    return _parents_first(pre, names[0])


def _parents_first(first_calls: list[str], root: str) -> list[str]:
    """The tree in pre-order, each module's children in the order their subtrees were first
    called. The same list where the calls already are a pre-order; where a module ran before
    its parent did (LLaVA calls ``language_model.embed_tokens`` before ``language_model``), the
    parent moves up to just before it."""
    parents = _dotted_parents([root] + [n for n in first_calls if n != root])
    first = {n: i for i, n in enumerate(first_calls)}
    children: dict[str, list[str]] = {}
    for n in first_calls:
        if parents.get(n) is not None:
            children.setdefault(parents[n], []).append(n)
    subtree_first: dict[str, int] = {}

    def earliest(n: str) -> int:
        if n not in subtree_first:
            subtree_first[n] = min([first[n], *(earliest(c) for c in children.get(n, ()))])
        return subtree_first[n]

    out: list[str] = []
    stack = [root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(sorted(children.get(n, ()), key=earliest, reverse=True))
    return out


def _post_positions(dag: nx.DiGraph, pre: list[str], mod_order: ModOrder | None) -> dict[str, int]:
    if mod_order is not None and mod_order.fw_post_order:
        pos: dict[str, int] = {}
        for i, n in enumerate(mod_order.fw_post_order):
            pos.setdefault(n, i)  # a module called twice: its first post event
        return pos
    # No recorded order: the tree's own post-order with children in pre-order.
    rank = {n: i for i, n in enumerate(pre)}
    out: list[str] = []
    stack: list[tuple[str, bool]] = [(pre[0], False)]
    while stack:
        n, done = stack.pop()
        if done:
            out.append(n)
            continue
        stack.append((n, True))
        for c in sorted(dag.successors(n), key=rank.__getitem__, reverse=True):
            stack.append((c, False))
    return {n: i for i, n in enumerate(out)}
