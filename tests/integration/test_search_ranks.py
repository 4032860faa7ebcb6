"""The launch advisor's fits on real ranks: every layout a 4-rank search of a small Llama calls a
fit runs 3 AdamW steps on 4 gloo ranks; each rank's steady peak is the search's prediction within
1 %, and the gradients are bitwise those of the same layout unplanned (benchmarks/search_ranks.py).

``SAC_SEARCH_RANKS=1`` runs it: 11 layouts x 4 ranks, longer than the rest of the suite
(docs/search.md has its table)."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc,
              pytest.mark.skipif(not os.environ.get("SAC_SEARCH_RANKS"),
                                 reason="set SAC_SEARCH_RANKS=1 (44 rank rows, about 5 minutes idle)")]


def test_every_fitting_layout_runs_as_the_search_predicts():
    from benchmarks._pipeline_ranks import run_ranks
    from benchmarks.search_ranks import TOLERANCE, rank_worker, search_cases
    from planner.search.layouts import Layout

    result, cases = search_cases(3.0)
    assert "+ FSDP2 under PP by a rule" in result.table_text(top=60)  # the approximation is named
    families = {Layout(**c["layout"]).family for c in cases}
    assert {"FSDP", "TP", "TP x FSDP", "PP", "PP x TP"} <= families, families
    assert any(c["plans"] and any('"modules": []' not in p for p in c["plans"]) for c in cases)  # some checkpoint
    rows = [r for per_rank in run_ranks(rank_worker, 4, cases, timeout_s=2400) for r in per_rank]
    assert len(rows) == 4 * len(cases)
    for r in rows:
        assert abs(r["measured"] - r["predicted"]) <= TOLERANCE * r["predicted"], r
        assert r["bitwise"], r
