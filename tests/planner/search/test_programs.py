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
