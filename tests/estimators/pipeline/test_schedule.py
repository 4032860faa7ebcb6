"""estimators/pipeline/schedule.py: each rank's compute actions as torch runs them."""

import pytest
from torch.distributed.pipelining import (
    Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from estimators.pipeline.schedule import Runtime, ScheduleError, ScheduleLayout


def test_gpipe_runs_every_forward_then_every_backward():
    layout = ScheduleLayout.of(ScheduleGPipe, n_microbatches=3, n_stages=2)
    assert layout.actions(1) == [(1, "F", 0), (1, "F", 1), (1, "F", 2), (1, "B", 0), (1, "B", 1), (1, "B", 2)]
    assert layout.runtime is Runtime.GPIPE and not layout.split_backward


def test_1f1b_warms_up_stages_minus_stage_forwards():
    # What Schedule1F1B._step_microbatches runs; its pipeline_order names the last rank's
    # micro-batches 1..n, so it is not read.
    layout = ScheduleLayout.of(Schedule1F1B, n_microbatches=4, n_stages=2)
    assert layout.actions(0) == [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "F", 2), (0, "B", 1), (0, "F", 3),
                                 (0, "B", 2), (0, "B", 3)]
    assert layout.actions(1) == [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1), (1, "F", 2), (1, "B", 2),
                                 (1, "F", 3), (1, "B", 3)]


@pytest.mark.parametrize("cls", [ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble])
def test_runtime_schedules_follow_torchs_order_with_comms(cls):
    layout = ScheduleLayout.of(cls, n_microbatches=4, n_stages=4, virtual_stages=2)
    assert layout.stages_of(0) == (0, 2) and layout.stages_of(1) == (1, 3)
    for rank in range(2):
        acts = layout.actions(rank)
        assert sorted(acts) == sorted(set(acts))  # each action once
        per_stage = {s: sum(1 for a in acts if a[0] == s) for s in layout.stages_of(rank)}
        assert set(per_stage.values()) == {4 * (3 if cls is ScheduleInterleavedZeroBubble else 2)}
    assert layout.split_backward is (cls is ScheduleInterleavedZeroBubble)


def test_refuses_what_it_does_not_model():
    with pytest.raises(ScheduleError, match="V schedule"):
        ScheduleLayout.of(ScheduleZBVZeroBubble, n_microbatches=4, n_stages=4, virtual_stages=2)
    with pytest.raises(ScheduleError, match="n_microbatches >= n_stages"):
        ScheduleLayout.of(Schedule1F1B, n_microbatches=2, n_stages=4)
    with pytest.raises(ScheduleError, match="one stage per rank"):
        ScheduleLayout.of(Schedule1F1B, n_microbatches=4, n_stages=4, virtual_stages=2)
    with pytest.raises(ScheduleError, match="schedule class or object"):
        ScheduleLayout.of(int, n_microbatches=4, n_stages=4)


@pytest.mark.parametrize("cls", [ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble])
def test_a_runtime_schedule_lays_out_every_rank_the_same_whichever_rank_builds_it(cls):
    """The order is built once for all ranks (from rank 0's stand-ins): torch's constructor lays
    out every rank from the group's size, not from the rank that builds it."""
    from estimators.pipeline.schedule import _StandIn

    layout = ScheduleLayout.of(cls, n_microbatches=8, n_stages=8, virtual_stages=2)

    def order(rank):
        stages = [_StandIn(s, 8, 4, rank) for s in layout.stages_of(rank)]
        return {r: [str(a) for a in acts] for r, acts in cls(stages, 8).pipeline_order_with_comms.items()}

    assert order(0) == order(3)
    by_rank = layout.actions_by_rank()
    assert all(by_rank[r] == layout.actions(r) for r in range(4))
    assert [a for a in by_rank[3] if a[1] == "F"][0] == (3, "F", 0)


def test_a_runtime_schedule_is_built_once_for_every_rank():
    class Counting(ScheduleInterleaved1F1B):
        built = 0

        def __init__(self, *args, **kwargs):
            Counting.built += 1
            super().__init__(*args, **kwargs)

    layout = ScheduleLayout.of(Counting, n_microbatches=8, n_stages=8, virtual_stages=2)
    for rank in range(4):
        layout.actions(rank)
    layout.actions_by_rank()
    assert Counting.built == 1
