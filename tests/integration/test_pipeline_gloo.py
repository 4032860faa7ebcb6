"""A pipeline planned per stage and run for real: 2 gloo ranks, Schedule1F1B, 4 micro-batches,
3 AdamW steps, MemTracker on each rank; PP 2 x TP 2 on 4 ranks (the acceptance tables are
benchmarks/pipeline_e2e.py's, with and without --tp)."""

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


def test_pp_x_tp_each_ranks_measured_peak_is_its_prediction_and_gradient_shards_stay_bitwise():
    """PP 2 x TP 2 on 4 gloo ranks (each stage parallelized as torchtitan does, loss_parallel):
    every rank planned on the fake process group at its local shapes; 1F1B with sequence
    parallelism, GPipe without; unplanned and at a middle budget, predicted = measured to
    the byte on every rank, gradient shards bitwise, the plan within its budget, the same on
    both ranks of a stage's TP group and the same when each rank plans on the live gloo group."""
    from benchmarks._pipeline_ranks import RunConfig, rank_worker, run_ranks
    from benchmarks.pipeline_e2e import plan_tp_ranks
    from planner.distributed.ranks import plan_hash

    layouts = {True: [("1F1B", 4)], False: [("GPipe", 4)]}
    configs, expected = [], []
    for sp, cases in layouts.items():
        planned = plan_tp_ranks(2, 2, sp, cases, fractions=(0.5,))
        for case in cases:
            by_rank = planned[case]
            plans = {r: by_rank[r][2][0][1] for r in by_rank}
            live = {r: by_rank[r][2][0][0] / 2**30 for r in by_rank} if (sp, case) == (True, ("1F1B", 4)) else None
            configs += [RunConfig(*case, None, tp=2, sequence_parallel=sp),
                        RunConfig(*case, plans, tp=2, sequence_parallel=sp, plan_here_gib=live)]
            expected.append((sp, case, by_rank))
    results = run_ranks(rank_worker, 4, "llama", configs, timeout_s=1500)
    for i, (sp, case, by_rank) in enumerate(expected):
        for rank in range(4):
            unplanned, _, [(budget, plans)] = by_rank[rank]
            plain, with_plan = results[rank][2 * i], results[rank][2 * i + 1]
            (plan,) = plans.values()
            where = (sp, case, rank)
            assert max(plain["peaks"][1:]) == unplanned, where
            assert max(with_plan["peaks"][1:]) == plan.predicted_peak_bytes <= budget < unplanned, where
            assert with_plan["grads"] == plain["grads"] and plan.modules, where
            assert plan_hash(plan) == plan_hash(next(iter(by_rank[rank ^ 1][2][0][1].values()))), where
            if with_plan["live_plan_hashes"] is not None:  # traced on the live gloo group: the same plan
                assert with_plan["live_plan_hashes"] == {s: plan_hash(p) for s, p in plans.items()}, where
