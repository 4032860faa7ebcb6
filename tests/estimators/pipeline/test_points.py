"""A pipeline rank's memory points (``rank_module_info``): the points another dominates (a steady
micro-batch's repeats) are left out, and the rank's memory under every plan, its MILP's floor and
its plans are the same as with every point."""

from __future__ import annotations

import random

import pytest

import estimators.pipeline.points as points_module
from planner.search import Cluster
from planner.search.family import model_family
from planner.search.layouts import Layout
from planner.search.pipeline_eval import PipelineCases
from planner.search.programs import World
from tests.planner.search.test_programs import _Evaluator, llama_8_layers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_dominated_points_change_no_figure(schedule, monkeypatch):
    family = model_family(llama_8_layers, seq_len=32)
    cluster = Cluster.parse("4xh100")
    t = Layout(pp=2, micro_batch=1, accumulation=12, schedule=schedule)
    with World(family, cluster, tp=1, cp=1) as world:
        cases = PipelineCases(_Evaluator(cluster), world)
        kept = [cases.planner(t, r) for r in range(2)]
        monkeypatch.setattr(points_module, "_dominant", tuple)
        every = [PipelineCases(_Evaluator(cluster), world).planner(t, r) for r in range(2)]
    rng = random.Random(0)
    for a, b in zip(kept, every):
        assert len(a.milp.memory.points) < len(b.milp.memory.points) // 2  # the repeats are gone
        assert a.unplanned_peak_bytes == b.unplanned_peak_bytes
        assert a.min_peak_bytes() == b.min_peak_bytes()
        ma, mb = a.milp.memory, b.milp.memory
        stats = list(ma.stats.values())[1:]
        for _ in range(20):  # any plan: the same peak
            plan = {s.fqn: rng.choice([0, s.sac_memory_bytes // 2, s.sac_memory_bytes])
                    for s in rng.sample(stats, k=min(6, len(stats)))}
            assert ma.peak(plan) == mb.peak(plan)
        for budget in (a.unplanned_peak_bytes, (a.unplanned_peak_bytes + a.min_peak_bytes()) // 2, a.min_peak_bytes()):
            ra, rb = a.milp.solve(budget), b.milp.solve(budget)
            assert ra.predicted_peak_bytes == rb.predicted_peak_bytes
            assert ra.recompute_ms == pytest.approx(rb.recompute_ms, rel=1e-9, abs=1e-12)
