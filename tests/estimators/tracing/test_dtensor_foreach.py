"""DTensor's elementwise foreach ops on the local shards (``local_foreach``): the trace of a
tensor-parallel step with AdamW's foreach step is DTensor's dispatch's, record by record and byte by
byte, whole model and pipeline stage; a call DTensor would redistribute goes through its dispatch."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from estimators.tracing.dtensor_foreach import local_foreach
from estimators.tracing.estimation import EstimateOptions, estimate
from examples.llama import llama_tiny
from planner.search import Cluster
from planner.search.family import model_family
from planner.search.programs import World
from solver import SolverOptions
from tests.estimators.tracing.trace_equivalence import trace_difference

pytestmark = pytest.mark.slow


def _same(a, b) -> None:
    assert trace_difference(a.trace, b.trace) == ""
    assert a.module_info.peak_bytes == b.module_info.peak_bytes
    assert a.first_step_peak_bytes == b.first_step_peak_bytes
    assert [(p.fqn, p.phase, p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.other_bytes)
            for p in a.module_info.memory_points] == [
        (p.fqn, p.phase, p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.other_bytes)
        for p in b.module_info.memory_points]


@pytest.mark.parametrize("tp", [2])
def test_a_tp_step_traces_alike_with_and_without(tp):
    family = model_family(llama_tiny, seq_len=32)
    with World(family, Cluster.parse(f"{tp}xh100"), tp=tp, cp=1) as world:
        step = world.model_step(micro_batch=1, accumulation=2)
        assert step.optimizer == "adamw"
        fast = estimate(world.model, step, device="h100")
        full = estimate(world.model, step, device="h100", options=EstimateOptions(local_foreach=False))
    assert any("_foreach_addcdiv" in str(op.func) for op in fast.trace.ops)  # the optimizer's foreach step ran
    _same(fast, full)


def test_a_tp_stage_traces_alike_with_and_without():
    from estimators.step.stage_step import StageRole
    from planner.planning.pipeline_solve import trace_stage
    from planner.search.pipeline_eval import PipelineCases
    from planner.search.layouts import Layout

    family = model_family(llama_tiny, seq_len=32)
    t = Layout(tp=2, pp=2, micro_batch=1, accumulation=4, schedule="1F1B")
    with World(family, Cluster.parse("4xh100"), tp=2, cp=1) as world:
        cases = PipelineCases(type("Ev", (), {"cluster": Cluster.parse("4xh100"), "solver": SolverOptions()})(), world)
        opts = cases.options(t, 1)
        module = world.stage_module(family.stage_layers(2)[1], first=False, last=True)
        role = StageRole(is_first=False, is_last=True, split_backward=False)
        fast = trace_stage(module, world.stage_step(1, 2, 1), role, opts)
        slow = trace_stage(module, world.stage_step(1, 2, 1), role,
                           dataclasses.replace(opts, trace=EstimateOptions(local_foreach=False)))
    _same(fast, slow)


def test_every_kind_of_call_gives_what_dtensor_gives():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from planner.distributed.fake_world import fake_process_group

    def run(fast: bool):
        mesh = init_device_mesh("cpu", (2,))

        def dt(value, placement):
            local = (1, 2) if isinstance(placement, Shard) else (2, 2)  # every global shape (2, 2)
            return DTensor.from_local(torch.full(local, float(value)), mesh, [placement], run_check=False)

        a, b, c, p = dt(4, Shard(0)), dt(1, Replicate()), dt(2, Replicate()), dt(3, Partial())
        with local_foreach() if fast else contextlib.nullcontext():
            out = [*torch._foreach_sqrt([a, b])]          # out of place, one list
            torch._foreach_mul_([a, b], 2.0)              # in place, a scalar
            torch._foreach_add_([c], [b], alpha=3.0)      # a keyword scalar
            torch._foreach_lerp_([b], [p], 0.5)           # in place, a Partial operand: resharded to self's
            torch._foreach_addcmul_([c], [p], [p], 0.5)   # twice
            out += torch._foreach_mul([p], [p])           # a Partial self: DTensor's own path
            out += torch._foreach_add([b], [a])           # out of place, placements differ: DTensor's own path
        return [(t.placements, t.shape, t.to_local().tolist()) for t in (a, b, c, p, *out)]

    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = dict(handlers)
    with fake_process_group(world_size=2):
        full = run(False)
    with fake_process_group(world_size=2):
        assert run(True) == full
    assert dict(handlers) == before  # as it was
