"""estimators/runtime/op_facts.py: per-overload facts from the schema, per-call tensors read and written."""

import torch

from estimators.runtime.op_facts import cache_key, op_facts, read_tensors, written_tensors

aten = torch.ops.aten


def test_queries_are_not_ops_and_cost_nothing():
    for func in (aten.sym_size.int, torch.ops.prim.device.default, aten.is_contiguous.default):
        facts = op_facts(func)
        assert facts.is_query and facts.free


def test_no_kernel_ops_that_the_trace_still_records():
    for func in (aten.view.default, aten.empty.memory_format, aten._local_scalar_dense.default,
                 aten.transpose_.default):
        facts = op_facts(func)
        assert facts.free and not facts.is_query, func
    assert not op_facts(aten.mm.default).free


def test_written_arguments_come_from_the_schema():
    assert op_facts(aten.add_.Tensor).written == (0,)
    assert op_facts(aten.add.out).written_names == ("out",)
    assert op_facts(aten.add.out).unread_names == frozenset({"out"})
    assert op_facts(aten.copy_.default).unread == frozenset({0})  # copy_ overwrites self unread
    assert op_facts(aten.mm.default).written == ()
    assert op_facts(aten._foreach_add_.List).returns_nothing


def test_random_and_dynamic_output_tags():
    assert op_facts(aten.bernoulli.p).is_random and not op_facts(aten.add.Tensor).is_random
    assert op_facts(aten.nonzero.default).dynamic_output


def test_read_and_written_tensors_of_one_call():
    dst, src = torch.zeros(4), torch.ones(4)
    facts = op_facts(aten.copy_.default)
    assert read_tensors(facts, (dst, src), {}) == [src]
    xs, ys = [torch.ones(2)], [torch.ones(2)]
    facts = op_facts(aten._foreach_add_.List)
    written = written_tensors(facts, (xs, ys), {}, None)
    assert len(written) == 1 and written[0] is xs[0]


def test_cache_key_names_layouts_not_values():
    facts = op_facts(aten.mm.default)
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert cache_key(aten.mm.default, facts, (a,), {}, None, safe=False) == cache_key(
        aten.mm.default, facts, (b,), {}, None, safe=False
    )
    assert repr(cache_key(aten.mm.default, facts, (a,), {}, None, safe=True)) == repr(
        cache_key(aten.mm.default, facts, (b,), {}, None, safe=True)
    )
    assert cache_key(aten.mm.default, facts, (a.t(),), {}, None, safe=False) != cache_key(
        aten.mm.default, facts, (a,), {}, None, safe=False
    )
