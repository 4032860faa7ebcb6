"""Each distinct per-rank program traced once: a pipeline stage's trace is shared across splits
that cut the same stages (PP 4 x 1 and PP 2 x 2), across a (TP, CP) World closed and opened again,
and across stages of the same program under other layer names; each shared trace equals the
stage's own full trace record by record and byte by byte."""

from __future__ import annotations

import pytest

from estimators.step.stage_step import StageRole
from examples.llama import LlamaConfig, build_llama
from planner.planning.pipeline_solve import trace_stage
from planner.search import Cluster
from planner.search.family import model_family
from planner.search.layouts import Layout
from planner.search.pipeline_eval import PipelineCases
from planner.search.programs import World
from solver import SolverOptions
from tests.estimators.tracing.trace_equivalence import trace_difference

pytestmark = pytest.mark.slow


def llama_8_layers(*, seq_len: int = 32):
    return build_llama(LlamaConfig(vocab_size=256, seq_len=seq_len, n_layers=8, dim=64, n_heads=4, n_kv_heads=2,
                                   ffn_dim=128), batch_size=1)


class _Evaluator:
    def __init__(self, cluster):
        self.cluster, self.solver, self.stage_cache = cluster, SolverOptions(), {}


def _points(est):
    return [(p.fqn, p.phase, p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.other_bytes, p.recompute_of)
            for p in est.module_info.memory_points]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stage_program_is_traced_once_and_equals_its_own_trace(tp):
    family = model_family(llama_8_layers, seq_len=32)
    cluster = Cluster.parse("8xh100")
    ev = _Evaluator(cluster)
    four = Layout(tp=tp, pp=4, micro_batch=1, accumulation=8, schedule="1F1B")
    two_by_two = Layout(tp=tp, pp=2, micro_batch=1, accumulation=8, schedule="Interleaved1F1B")
    with World(family, cluster, tp=tp, cp=1, stage_cache=ev.stage_cache) as world:
        first = PipelineCases(ev, world).traces(four)
    assert first.traced == 3  # first, one middle (stage 2 is stage 1 renamed), last
    with World(family, cluster, tp=tp, cp=1, stage_cache=ev.stage_cache) as world:  # opened again
        cases = PipelineCases(ev, world)
        assert cases.traces(four) is first
        shared = cases.traces(two_by_two)
        assert shared.traced == 0  # the same four stages, cut over two ranks
        for s, est in shared.estimates.items():
            role = StageRole(is_first=s == 0, is_last=s == 3, split_backward=False)
            own = trace_stage(shared.modules[s], shared.steps[s], role, cases.options(two_by_two, s))
            assert trace_difference(est.trace, own.trace) == ""
            assert _points(est) == _points(own)
            assert [(m.fqn, m.sac_memory_bytes) for m in est.module_info.mod_stats] == [
                (m.fqn, m.sac_memory_bytes) for m in own.module_info.mod_stats]
            assert est.module_info.peak_bytes == own.module_info.peak_bytes
        assert cases.planner(two_by_two, 0) is not None


def llama_32_layers(*, seq_len: int = 32):
    return build_llama(LlamaConfig(vocab_size=256, seq_len=seq_len, n_layers=32, dim=64, n_heads=4, n_kv_heads=2,
                                   ffn_dim=128), batch_size=1)


def _stage_figures(est):
    """What the pipeline planner reads off a stage's trace: its marks, the marked storages' bytes."""
    t = est.trace
    return (t.marks, {k: sum(t.storages[s].nbytes for s in set(v)) for k, v in t.marked_sids.items()})


@pytest.mark.parametrize("tp,schedule,stage", [(1, "1F1B", 1), (1, "1F1B", 0), (1, "1F1B", 3),
                                               (2, "1F1B", 1), (2, "1F1B", 3), (1, "InterleavedZeroBubble", 1),
                                               (1, "InterleavedZeroBubble", 3), (1, "InterleavedZeroBubble", 0),
                                               (2, "InterleavedZeroBubble", 2), (2, "InterleavedZeroBubble", 3)])
def test_a_stage_laid_in_from_four_blocks_is_its_full_trace(tp, schedule, stage):
    """A stage of 8 (or 4 x 2: 4) decoder layers traced with its repeated blocks laid in equals
    its trace block by block: every record, the memory timeline, the module stats, the marks.
    A zero-bubble stage's split backward too: its input half over the blocks in reverse order,
    then its weight half in order, each after a list over every parameter (stage 0: one backward)."""
    import dataclasses

    from estimators.tracing.estimation import EstimateOptions
    from tests.estimators.tracing.trace_equivalence import estimate_difference

    family = model_family(llama_32_layers, seq_len=32)
    cluster = Cluster.parse("8xh100")
    t = Layout(tp=tp, pp=2 if schedule == "InterleavedZeroBubble" else 4, micro_batch=1, accumulation=8,
               schedule=schedule)
    n = t.n_stages
    with World(family, cluster, tp=tp, cp=1) as world:
        cases = PipelineCases(_Evaluator(cluster), world)
        ranges = family.stage_layers(n)
        module = world.stage_module(ranges[stage], first=stage == 0, last=stage == n - 1)
        role = StageRole(is_first=stage == 0, is_last=stage == n - 1, split_backward=t.split_backward)
        opts = cases.options(t, stage)
        laid = trace_stage(module, world.stage_step(stage, n, 1), role, opts)
        full = trace_stage(module, world.stage_step(stage, n, 1), role,
                           dataclasses.replace(opts, trace=EstimateOptions(replicate_blocks=False)))
    assert len(laid.trace.twin_of) == 4 * 13  # layers 4 .. 7 of 8: 13 module calls each
    if t.split_backward and stage > 0:
        assert laid.trace.marks["backward"] < laid.trace.marks["weight"] < laid.trace.marks["optimizer"]
    assert estimate_difference(full, laid) == ""
    assert _stage_figures(laid) == _stage_figures(full)
    assert laid.module_info == full.module_info
    assert (laid.module_info.peak_bytes, laid.first_step_peak_bytes) == (full.module_info.peak_bytes,
                                                                          full.first_step_peak_bytes)
