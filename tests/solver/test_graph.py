"""solver/graph.py: tree construction, prefix-correct queries, validation errors."""

from __future__ import annotations

import pytest

from estimators.contract.module_info import ModOrder, ModStats, ModuleInfo
from solver.errors import GraphError, UnknownModuleError
from solver.graph import Graph, is_submodule


def stats(*names: str) -> list[ModStats]:
    return [ModStats(fqn=n, is_leaf=False) for n in names]


def info(names: list[str], post: tuple[str, ...] = ()) -> ModuleInfo:
    order = ModOrder(fw_pre_order=tuple(names), fw_post_order=post, bw_pre_order=(), bw_post_order=())
    return ModuleInfo(mod_order=order, mod_stats=tuple(stats(*names)))


# Blocks 1 and 10 are siblings; "M.blocks" (a ModuleList) never runs, so it is absent.
NAMES = ["M", "M.blocks.1", "M.blocks.1.attn", "M.blocks.10", "M.blocks.10.attn", "M.ba", "M.ba.c", "M.a"]


def test_is_submodule_compares_whole_components() -> None:
    assert is_submodule("M.blocks.1.attn", "M.blocks.1")
    assert not is_submodule("M.blocks.10", "M.blocks.1")
    assert not is_submodule("M.blocks.10.attn", "M.blocks.1")
    assert not is_submodule("ba.c", "a")
    assert not is_submodule("M.a", "M.a")


def test_tree_follows_dotted_components() -> None:
    g = Graph.from_module_info(info(NAMES))
    assert [n.fqn for n in g.nodes] == NAMES and [n.index for n in g.nodes] == list(range(8))
    assert g.node("M.blocks.1").parent == "M"  # missing container skipped
    assert g.node("M.blocks.10.attn").parent == "M.blocks.10"
    assert [n.fqn for n in g.descendants("M.blocks.1")] == ["M.blocks.1.attn"]
    assert [n.fqn for n in g.ancestors("M.blocks.10.attn")] == ["M.blocks.10", "M"]
    assert [n.fqn for n in g.descendants("M.a")] == []
    assert not g.is_ancestor("M.a", "M.ba.c") and g.is_ancestor("M.ba", "M.ba.c")
    assert [n.fqn for n in g.children("M")] == ["M.blocks.1", "M.blocks.10", "M.ba", "M.a"]
    assert g.node("M.blocks.10.attn").depth == 2 and g.root.fqn == "M"
    assert set(g.nx_graph.successors("M.ba")) == {"M.ba.c"}


def test_post_order_positions_recorded_or_derived() -> None:
    derived = Graph.from_module_info(info(NAMES))
    expect = ["M.blocks.1.attn", "M.blocks.1", "M.blocks.10.attn", "M.blocks.10", "M.ba.c",
              "M.ba", "M.a", "M"]
    assert sorted(derived.nodes, key=lambda n: n.pos_fw_post_order) == [derived.node(f) for f in expect]
    recorded = Graph.from_module_info(info(["M", "M.x", "M.y"], post=("M.y", "M.x", "M")))
    assert [n.pos_fw_post_order for n in recorded.nodes] == [2, 1, 0]


def test_duplicate_fqns() -> None:
    with pytest.raises(GraphError, match="duplicate module fqns: 'M.a'"):
        Graph(stats("M", "M.a", "M.a"))


def test_unknown_parent_from_names() -> None:
    with pytest.raises(GraphError, match="'X.a' has unknown parent 'X'"):
        Graph(stats("M", "M.b", "X.a"))


def test_unknown_parent_explicit() -> None:
    with pytest.raises(GraphError, match=r"'M.b' has unknown parent 'M.c' \(did you mean 'M.b', 'M.a'"):
        Graph(stats("M", "M.a", "M.b"), parents={"M": None, "M.a": "M", "M.b": "M.c"})


def test_cycle() -> None:
    with pytest.raises(GraphError, match="cycle"):
        Graph(stats("M", "a", "b"), parents={"M": None, "a": "b", "b": "a"})


def test_mod_order_naming_unknown_modules() -> None:
    bad = ModOrder(fw_pre_order=("M", "M.a"), fw_post_order=("M.a", "M.bb"), bw_pre_order=(),
                   bw_post_order=())
    with pytest.raises(GraphError, match=r"fw_post_order names unknown modules: \['M.bb'\]"):
        Graph(stats("M", "M.a"), mod_order=bad)


def test_stats_without_a_recorded_order_must_put_parents_first() -> None:
    with pytest.raises(GraphError, match="before its parent"):
        Graph(stats("M", "M.a.b", "M.a"))


def test_a_module_first_called_before_its_parent_is_ordered_after_it() -> None:
    # LLaVA calls language_model.embed_tokens before language_model: the recorded first calls
    # listed the grandchild before its parent, and planning raised GraphError.
    g = Graph.from_module_info(info(["M", "M.lm.embed", "M.vision", "M.lm", "M.lm.layer", "M.head"]))
    assert [n.fqn for n in g] == ["M", "M.lm", "M.lm.embed", "M.lm.layer", "M.vision", "M.head"]
    assert g.node("M.lm.embed").parent == "M.lm" and [n.fqn for n in g.ancestors("M.lm.embed")] == ["M.lm", "M"]
    # A recorded order that is a pre-order already stays as it is.
    assert [n.fqn for n in Graph.from_module_info(info(NAMES))] == NAMES


def test_one_root_first() -> None:
    with pytest.raises(GraphError, match="exactly one root"):
        Graph(stats("M", "N"), parents={"M": None, "N": None})


def test_unknown_node_suggests_names() -> None:
    g = Graph.from_module_info(info(NAMES))
    with pytest.raises(UnknownModuleError, match="did you mean 'M.blocks.10'"):
        g.node("M.blocks.100")
