"""planner/distributed/layout.py: the layout a plan records, and the layouts it refuses."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner import PlanOptions, TrainStep, apply_plan, solve_sac
from planner.distributed.fake_world import fake_process_group
from planner.distributed.layout import (
    LayoutRecord,
    check_parallel_support,
    fsdp_options,
    layout_mismatch,
    layout_of,
)
from planner.errors import PlanFormatError, PlanMismatchError, PlanningError
from planner.options import Pipeline
from planner.plan import Plan


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MLP() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _tp(net: _Net, mesh, down=RowwiseParallel) -> _Net:
    plan = {}
    for i in range(len(net.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = down()
    return parallelize_module(net, mesh, plan)


def test_a_single_process_model_has_no_parallel_layout():
    record = layout_of(_Net())
    assert not record.parallel and record.describe() == "one process, no parallel layout"
    assert layout_mismatch(None, _Net()) is None


def test_the_layout_is_read_from_the_dtensors_and_survives_the_plan_file(one_intra_op_thread):
    torch.manual_seed(0)
    with fake_process_group(world_size=2, rank=0):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = _tp(_Net(), mesh)
        record = layout_of(model, ["_Net", "_Net.blocks.0", "_Net.blocks.1"], 4)
        assert record.meshes == ("tp=2",) and record.dtensor_parameters == 8 and len(record.placements) == 16
        assert record.fsdp_world_size == 4 and record.describe().startswith("tensor parallel over tp=2")
        step = TrainStep(inputs=(torch.randn(8, 16),), optimizer="adamw")
        budget = 1.0
        plan = solve_sac(model, budget, step, options=PlanOptions(reserve_gib=0))
        assert plan.layout == layout_of(model)
        again = Plan.from_dict(json.loads(plan.to_json()))
        assert again.layout == plan.layout and again == plan
        apply_plan(model, again).remove()  # its own layout: accepted
        with pytest.raises(PlanMismatchError, match="the plan was made for tensor parallel"):
            apply_plan(_Net(), plan)  # the same model unparallelized
        other = _tp(_Net(), mesh, down=ColwiseParallel)  # other placements, same meshes
        assert "other placements" in layout_mismatch(plan.layout, other)
    plain_plan = Plan.from_dict({**json.loads(plan.to_json()), "layout": None})
    with pytest.raises(PlanMismatchError, match="one process"):
        apply_plan(model, plain_plan)


def test_a_corrupt_layout_is_refused():
    with pytest.raises(PlanFormatError, match="layout: meshes"):
        LayoutRecord(meshes="tp=2")
    with pytest.raises(PlanFormatError, match="fsdp_world_size"):
        LayoutRecord(fsdp_world_size=0)
    for fields, message in (({"fsdp_world_size": 10**30}, r"layout.fsdp_world_size must be in \[1, 1,048,576\]"),
                            ({"placements": "x" * 5000}, "placements must be 16 hex digits or empty"),
                            ({"meshes": ["tp=2"]}, "must be all set"),
                            ({"meshes": ["tp=2"], "placements": "0" * 16}, "must be all set"),
                            ({"fsdp_units": ["a"] * 200_000}, "more than the 100,000"),
                            ({"fsdp_units": ["a", "a"]}, "lists an entry twice"),
                            ({"fsdp_units": [""]}, "non-empty string"),
                            ({"dtensor_parameters": -1}, "dtensor_parameters must be >= 0")):
        with pytest.raises(PlanFormatError, match=message) as e:
            LayoutRecord(**fields)
        assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_what_a_tp_model_cannot_plan_yet_is_refused_by_name(one_intra_op_thread):
    from estimators.tracing.estimation import EstimateOptions, TraceMode

    with fake_process_group(world_size=2, rank=0):
        model = _tp(_Net(), init_device_mesh("cpu", (2,)))
        with pytest.raises(PlanningError, match="offload=True is not planned for a tensor-parallel"):
            check_parallel_support(model, PlanOptions(offload=True))
        with pytest.raises(PlanningError, match="on rank 0 alone"):
            check_parallel_support(model, PlanOptions(trace=EstimateOptions(mode=TraceMode.REAL)),
                                   traced_on_one_rank=True)
        check_parallel_support(model, PlanOptions(trace=EstimateOptions(mode=TraceMode.REAL)))  # every rank traces
        # a tensor-parallel pipeline stage is planned per rank (planner.distributed.pipeline)
        check_parallel_support(model, PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=2, n_stages=2)))
    check_parallel_support(_Net(), PlanOptions(offload=True))  # a plain model: nothing to refuse


def test_fsdp_units_of_a_model_not_yet_sharded_are_the_options():
    assert fsdp_options(_Net(), None, 1) == (None, 1)
    assert fsdp_options(_Net(), ["_Net"], 8) == (("_Net",), 8)


def _fsdp_plan(model: nn.Module, world_size: int) -> Plan:
    from planner.plan import ModulePlan, model_fingerprint

    units = ("_Net", "_Net.blocks.0", "_Net.blocks.1")
    return Plan(modules=(ModulePlan(fqn="_Net.blocks.0", discard_ratio=1.0, full=True),), model_name="_Net",
                model_fingerprint=model_fingerprint(model), device="cpu", world_size=world_size,
                budget_bytes=1 << 20, reserve_bytes=0, predicted_peak_bytes=1, solver_peak_bytes=1,
                baseline_peak_bytes=1, recompute_ms=0.0, baseline_step_ms=0.0,
                layout=LayoutRecord(fsdp_world_size=world_size, fsdp_units=units))


@pytest.mark.parametrize("planned_ranks", [8, 2])
def test_a_plan_applied_before_fully_shard_is_checked_at_the_first_step(one_intra_op_thread, planned_ranks):
    """torchtitan's order applies the plan, then shards: an FSDP plan made for 8 ranks, sharded
    over 2, trained with no warning."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    from planner.applying.planned_forward import StalePlanWarning

    torch.manual_seed(0)
    model = _Net()
    handle = apply_plan(model, _fsdp_plan(model, planned_ranks))
    with fake_process_group(world_size=2, rank=0):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.randn(4, 16)).sum().backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, StalePlanWarning)]
    if planned_ranks == 2:
        assert messages == []
    else:
        assert len(messages) == 1 and ("sharded with FSDP2 over 2 ranks (3 units), the plan was made for FSDP2 "
                                       "over 8 ranks") in messages[0], messages
    handle.remove()


def test_a_layout_for_another_world_size_than_the_plans_is_refused():
    plan = _fsdp_plan(_Net(), 8)
    with pytest.raises(PlanFormatError, match=r"layout.fsdp_world_size \(8\) is not the plan's world_size \(2\)"):
        Plan.from_dict({**json.loads(plan.to_json()), "world_size": 2})
