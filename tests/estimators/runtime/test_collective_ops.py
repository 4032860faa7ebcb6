"""estimators/runtime/collective_ops.py: a rank's functional collectives read and priced on a link."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from estimators.runtime.collective_ops import CollectivePricing, collective_call
from estimators.runtime.collectives import AnalyticCollectiveModel, Collective
from estimators.runtime.device import get_device_spec
from estimators.runtime.roofline import RooflineRuntime
from planner.distributed.fake_world import fake_process_group

F = torch.ops._c10d_functional


def _calls():
    name = dist.group.WORLD.group_name
    x = torch.zeros(8, 3)  # 96 bytes
    return [
        (F.all_gather_into_tensor.default, (x, 4, name), Collective.ALL_GATHER, 4 * 96),
        (F.reduce_scatter_tensor.default, (x, "sum", 4, name), Collective.REDUCE_SCATTER, 96),
        (F.all_reduce.default, (x, "sum", name), Collective.ALL_REDUCE, 96),
        (F.all_to_all_single.default, (x, [2, 2, 2, 2], [2, 2, 2, 2], name), Collective.ALL_TO_ALL, 96),
    ]


def test_each_collective_is_read_with_its_whole_buffer_and_group():
    with fake_process_group(world_size=4, rank=2):
        for func, args, kind, nbytes in _calls():
            out = F.wait_tensor.default(func(*args))
            call = collective_call(func, args, {}, out)
            assert (call.collective, call.message_bytes, call.group_size) == (kind, nbytes, 4)
        assert collective_call(torch.ops.aten.mm.default, (), {}, None) is None
        x = torch.zeros(2)
        assert collective_call(F.wait_tensor.default, (x,), {}, x) is None  # moves no data


def test_collectives_are_priced_on_the_link_and_other_ops_as_before():
    spec = get_device_spec("h100")
    inner = RooflineRuntime(spec)
    priced = CollectivePricing.for_device(inner, spec)
    link = AnalyticCollectiveModel.from_device(spec)
    with fake_process_group(world_size=4, rank=0):
        for func, args, kind, nbytes in _calls():
            out = F.wait_tensor.default(func(*args))
            assert priced.op_runtime_ms(func, args, {}, out) == pytest.approx(link.time_ms(kind, nbytes, 4))
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    mm = torch.ops.aten.mm.default
    assert priced.op_runtime_ms(mm, (a, b), {}, a @ b) == inner.op_runtime_ms(mm, (a, b), {}, a @ b)
    assert priced.name == f"{inner.name}+{link.name}"


def test_a_device_without_a_link_prices_collectives_as_copies_never_as_its_runtime_model():
    class Refuses:
        name = "refuses"

        def op_runtime_ms(self, func, args, kwargs, out):
            if func.namespace == "_c10d_functional":
                raise AssertionError("a benchmarking runtime would run the collective on one rank")
            return 1.0

    spec = get_device_spec("cpu")
    priced = CollectivePricing.for_device(Refuses(), spec)
    with fake_process_group(world_size=2, rank=0):
        x = torch.zeros(8, 3)
        func, args = F.all_reduce.default, (x, "sum", dist.group.WORLD.group_name)
        out = F.wait_tensor.default(func(*args))
        assert priced.op_runtime_ms(func, args, {}, out) == RooflineRuntime(spec).op_runtime_ms(func, args, {}, out)
    assert priced.op_runtime_ms(torch.ops.aten.relu.default, (x,), {}, x) == 1.0


def test_all_to_all_moves_all_but_a_rank_s_own_share():
    from estimators.runtime.collectives import ring_factor

    assert ring_factor(Collective.ALL_TO_ALL, 4) == 0.75
    assert ring_factor(Collective.ALL_TO_ALL, 1) == 0.0
