"""estimators/contract/sac_groups.py: the grouping rules on hand-built op tables, exact groups."""

from __future__ import annotations

import pytest

from estimators.contract.module_info import SACOp
from estimators.contract.sac_groups import sac_groups, unsafe_reads


def op(i: int, mb: int = 0, ms: float = 1.0, **kw) -> SACOp:
    return SACOp(func=f"aten.f{i}.default", occurrence=0, runtime_ms=ms, memory_bytes=mb, **kw)


def test_inplace_chain_and_random_ops_form_groups_in_first_op_order():
    ops = (
        op(0, 10, is_random=True),
        op(1, 20),
        op(2, 0, inplace_parent=1),
        op(3, 0, inplace_parent=2),  # a chain: 1 <- 2 <- 3
        op(4, 5, is_random=True),
        op(5, 0, is_view=True),
    )
    groups = sac_groups(ops)
    assert [g.ops for g in groups] == [(0, 4), (1, 2, 3), (5,)]
    assert [g.memory_bytes for g in groups] == [15, 20, 0]
    assert [g.runtime_ms for g in groups] == [2.0, 3.0, 1.0]
    assert [g.is_choice for g in groups] == [True, True, False]
    assert groups[2].must_recompute and not groups[2].must_save


def test_outside_mutation_must_be_saved_and_wins_over_a_cache_cost():
    ops = (
        op(0, 8, cache_cost_bytes=4),
        op(1, 0, inplace_parent=0),
        op(2, 0, inplace_parent=2),  # mutates a storage from outside the module
        op(3, 8, cache_cost_bytes=4),
    )
    a, b, c = sac_groups(ops)
    assert (a.ops, a.must_save, a.must_recompute) == ((0, 1), False, True)
    assert (b.ops, b.must_save, b.must_recompute) == ((2,), True, False)
    assert (c.ops, c.must_save, c.must_recompute) == ((3,), False, True)
    both = sac_groups((op(0, 8, cache_cost_bytes=4, inplace_parent=0),))
    assert both[0].must_save and not both[0].must_recompute


@pytest.mark.parametrize("parent", [2, 3, -2])
def test_inplace_parent_must_be_an_earlier_op(parent):
    with pytest.raises(ValueError, match="inplace_parent must index an earlier op"):
        sac_groups((op(0), op(1, inplace_parent=parent), op(2)))


def test_a_read_before_an_inplace_mutation_shares_the_creator_s_decision():
    # 0 makes a storage, 1 reads it (autograd's clone for silu_'s backward), 2 mutates it (silu_):
    # saved, the storage holds 2's values, so 1 recomputed from it would read them.
    ops = (op(0, 8), op(1, 8, reads_before_mutation=(0,), is_saved=True), op(2, 0, inplace_parent=0), op(3, 8))
    groups = sac_groups(ops)
    assert [g.ops for g in groups] == [(0, 1, 2), (3,)]
    assert groups[0].is_choice and groups[0].memory_bytes == 16
    # A storage made outside the module, read and then mutated in it: the reader must be saved.
    outside = sac_groups((op(0, 8, reads_before_mutation=(0,)), op(1, 0, inplace_parent=1)))
    assert [(g.ops, g.must_save) for g in outside] == [((0,), True), ((1,), True)]


@pytest.mark.parametrize("link", [(2,), (-1,)])
def test_reads_before_mutation_must_index_earlier_ops(link):
    with pytest.raises(ValueError, match="reads_before_mutation must index earlier ops"):
        sac_groups((op(0), op(1, reads_before_mutation=link), op(2)))


def test_a_reader_a_saved_group_would_not_cache_makes_its_group_recomputed():
    # h = fc(x); g = h.mean(); h.relu_(): autograd keeps nothing of the mean, so a saved group
    # caches only fc and relu_ and recomputes the mean from the overwritten h (232 off).
    ops = (op(0, 8, is_saved=True), op(1, 0, reads_before_mutation=(0,)), op(2, 0, inplace_parent=0, is_saved=True))
    (g,) = sac_groups(ops)
    assert g.ops == (0, 1, 2) and g.must_recompute and not g.must_save
    cached = (op(0, 8, is_saved=True), op(1, 8, reads_before_mutation=(0,), is_saved=True),
              op(2, 0, inplace_parent=0, is_saved=True))
    assert sac_groups(cached)[0].is_choice  # the reader's output is cached with the group


def test_a_reader_of_a_storage_whose_creator_is_always_recomputed_stays_free():
    # conv -> BatchNorm (output not saved: a cache cost, always recomputed) -> clone for
    # hardswish_'s backward -> hardswish_: the recompute makes the storage afresh, so the clone
    # may be cached or not (MobileNetV3 recomputed up to 25 % more when it had to follow).
    ops = (op(0, 8, is_saved=True), op(1, 0, cache_cost_bytes=8),
           op(2, 8, is_saved=True, reads_before_mutation=(1,)), op(3, 0, inplace_parent=1, is_saved=True))
    groups = sac_groups(ops)
    assert [(g.ops, g.must_recompute) for g in groups] == [((0,), False), ((1, 3), True), ((2,), False)]
    assert groups[2].is_choice


def test_reads_settle_whatever_the_order_the_groups_become_saved_in():
    # The reader (1) was left free while its creator's group (0, 2) looked recompute-only (0 has
    # a cache cost); op 2 then made that group saved (it reads a storage made outside the
    # module that a later op overwrites): a plan could recompute 1 from the cached, overwritten
    # storage (24 of 32 assignments of such a module gave wrong gradients).
    ops = (op(0, 0, is_saved=True, cache_cost_bytes=8), op(1, 8, is_saved=True, reads_before_mutation=(0,)),
           op(2, 0, inplace_parent=0, reads_before_mutation=(2,)), op(3, 0, inplace_parent=3))
    assert [(g.ops, g.must_save) for g in sac_groups(ops)] == [((0, 1, 2), True), ((3,), True)]
    assert unsafe_reads(ops) == ()
    # The same reader if a saved group would not cache it: the module cannot be checkpointed.
    uncached = (ops[0], op(1, 0, reads_before_mutation=(0,)), ops[2], ops[3])
    assert unsafe_reads(uncached) == (1,)
