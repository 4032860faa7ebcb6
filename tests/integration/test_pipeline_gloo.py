"""A pipeline planned per stage and run for real: 2 gloo ranks, Schedule1F1B, 4 micro-batches,
3 AdamW steps, MemTracker on each rank (the acceptance table is benchmarks/pipeline_e2e.py)."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_each_ranks_measured_peak_is_its_prediction_and_gradients_stay_bitwise():
    from benchmarks._pipeline_ranks import RunConfig, rank_worker, run_ranks
    from benchmarks.pipeline_e2e import RankPlanners, plan_ranks

    planned = plan_ranks(RankPlanners("llama", 2), "1F1B", 4, fractions=(0.5,))
    plans = {s: p for r in planned for s, p in planned[r][2][0][1].items()}
    results = run_ranks(rank_worker, 2, "llama", [RunConfig("1F1B", 4), RunConfig("1F1B", 4, plans)], timeout_s=900)
    for rank in range(2):
        unplanned, floor, [(budget, rank_plans)] = planned[rank]
        plain, with_plan = results[rank]
        predicted = rank_plans[rank].predicted_peak_bytes
        measured = max(with_plan["peaks"][1:])
        assert abs(measured - predicted) <= 0.02 * predicted, (rank, measured, predicted)
        assert measured <= budget < unplanned
        assert max(plain["peaks"][1:]) == unplanned  # the unplanned schedule, to the byte
        assert with_plan["grads"] == plain["grads"]
        assert rank_plans[rank].modules  # the budget needed a plan
