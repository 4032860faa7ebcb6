"""PlannedAC on torchtitan's Llama3 tensor-parallel over 2 gloo ranks (this CPU): the debugmodel
flavor cut to 2 layers, sharded by torchtitan's own ``Module.parallelize`` from its Trainer
config (TP 2, sequence parallel, vocab-parallel embedding and loss; both its SPMD backends, the
default ``spmd_types`` and ``partial_dtensor``), planned per rank before
activation checkpointing (torchtitan applies AC after TP), the plan applied through
``PlannedAC.Config`` as ``parallelize_llama`` applies its AC config. On every rank the measured
peak of 3 AdamW steps equals the plan's prediction to the byte (first and steady state), the loss
and gradient shards are bitwise those of torchtitan's FullAC (and of no checkpointing), and both
ranks hold the same plan. The workers are in torchtitan_tp_ranks.py; both backends run on one
spawn of the ranks (``ranks`` fixture), each test asserts its own."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed, or its model package "
                                                       "cannot import triton (pip install 'sac-planner[torchtitan]')")

from tests.planner.integrations import torchtitan_tp_ranks  # noqa: E402
from tests.planner.spawned import run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Per rank, {backend: result}: both backends on one spawn."""
    tmp = tmp_path_factory.mktemp("ranks")
    run_ranks(torchtitan_tp_ranks.worker, WORLD, (WORLD, str(tmp), list(torchtitan_tp_ranks.BACKENDS)),
              timeout_s=480)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("backend", torchtitan_tp_ranks.BACKENDS)
def test_planned_ac_through_torchtitans_config_on_tp_ranks(ranks, backend):
    results = [r[backend] for r in ranks]
    for rank, r in enumerate(results):
        print(f"rank {rank}: floor {r['floor']:,} no AC {r['no_ac']:,} budget {r['budget']:,} "
              f"predicted first {r['predicted_first']:,} steady {r['predicted_steady']:,} measured {r['measured']} "
              f"{r['checkpointed']} bitwise vs FullAC {r['equal_full']} vs none {r['equal_none']}")
        assert r["checkpointed"], "the budget must bind"
        assert r["floor"] < r["budget"] < r["no_ac"]
        first, *steady = r["measured"]
        assert steady == [r["predicted_steady"]] * 2 and first == r["predicted_first"]
        assert r["predicted_steady"] <= r["budget"]
        assert r["n_grads"] > 0 and r["equal_full"] and r["equal_none"]
    assert results[0]["hash"] == results[1]["hash"]
