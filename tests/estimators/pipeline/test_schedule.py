"""estimators/pipeline/schedule.py: each rank's compute actions as torch runs them."""

import time

import pytest
from torch.distributed.pipelining import (
    Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
    ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule

from estimators.pipeline.schedule import (
    MAX_MICROBATCHES, MAX_STAGE_MICROBATCHES, Runtime, ScheduleError, ScheduleLayout, _StandIn, schedule_class)

_RUNTIME = (ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble)


def _torchs_lowered_order(layout: ScheduleLayout, rank: int) -> list:
    """The rank's compute actions in torch's ``pipeline_order_with_comms`` (its full constructor,
    quadratic in the micro-batches): what the layout must equal."""
    stages = [_StandIn(s, layout.n_stages, layout.n_ranks, rank) for s in layout.stages_of(rank)]
    sched = layout.schedule_cls(stages, layout.n_microbatches)
    out = []
    for a in sched.pipeline_order_with_comms[rank]:
        for sub in a.sub_actions or (a,):
            if sub.computation_type.value in ("F", "B", "I", "W"):
                out.append((sub.stage_index, sub.computation_type.value, sub.microbatch_index))
    return out


def _torch_refuses(cls, n_ranks: int, virtual: int, n: int) -> bool:
    try:
        cls([_StandIn(s, n_ranks * virtual, n_ranks, 0) for s in range(0, n_ranks * virtual, n_ranks)], n)
    except (ValueError, AssertionError):
        return True
    return False


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


@pytest.mark.slow  # torch's own constructor, 250 times
@pytest.mark.parametrize("cls", _RUNTIME)
def test_runtime_orders_are_torchs_lowered_order_and_refused_where_torch_refuses(cls):
    laid = refused = 0
    for n_ranks in (1, 2, 3, 4):
        for virtual in (1, 2):
            for n in range(1, 11):
                try:
                    layout = ScheduleLayout.of(cls, n_microbatches=n, n_stages=n_ranks * virtual, virtual_stages=virtual)
                except ScheduleError as e:
                    assert "\n" not in str(e) and _torch_refuses(cls, n_ranks, virtual, n), (n_ranks, virtual, n, e)
                    refused += 1
                    continue
                for rank in range(n_ranks):
                    assert layout.actions(rank) == _torchs_lowered_order(layout, rank), (n_ranks, virtual, n, rank)
                laid += 1
    assert laid > 50 and (refused > 0) is (cls is not ScheduleLoopedBFS)


def test_a_micro_batch_count_torch_refuses_is_refused_in_one_line():
    # 4 ranks, 9 micro-batches: 2 rounds, and 9 is not a multiple of 2
    with pytest.raises(ScheduleError, match=r"ScheduleInterleaved1F1B with 9 micro-batches on 4 ranks: torch refuses it"):
        ScheduleLayout.of(ScheduleInterleaved1F1B, n_microbatches=9, n_stages=8, virtual_stages=2)


def test_only_the_schedules_it_lays_out_are_taken():
    for cls in (PipelineScheduleMulti, _PipelineSchedule, type("MySchedule", (Schedule1F1B,), {})):
        with pytest.raises(ScheduleError, match="schedule class or object, one of ScheduleGPipe"):
            ScheduleLayout.of(cls, n_microbatches=4, n_stages=2)
    for name in ("os.system", "ScheduleZBVZeroBubble", "torch", "", None):
        with pytest.raises(ScheduleError, match="not one the planner lays out"):
            schedule_class(name)
    assert schedule_class("Schedule1F1B") is Schedule1F1B


def test_counts_are_bounded():
    with pytest.raises(ScheduleError, match=r"n_microbatches must be an int in \[1, 4,096\]"):
        ScheduleLayout.of(ScheduleGPipe, n_microbatches=10**30, n_stages=2)
    with pytest.raises(ScheduleError, match="stage micro-batches"):
        ScheduleLayout.of(ScheduleGPipe, n_microbatches=MAX_MICROBATCHES, n_stages=MAX_STAGE_MICROBATCHES // 2048)
    with pytest.raises(ScheduleError, match="n_stages"):
        ScheduleLayout.of(ScheduleGPipe, n_microbatches=1, n_stages=True)


@pytest.mark.parametrize("cls", _RUNTIME + (Schedule1F1B,))
def test_the_layout_is_linear_in_the_micro_batches(cls):
    """torch's lowering of a runtime schedule is quadratic (Interleaved1F1B, 8 stages on 4 ranks:
    20 s at 1,000 micro-batches); the layout reads the order before it, once for every rank."""
    virtual = 1 if cls is Schedule1F1B else 2
    cpu = {}
    for n in (128, 1024):
        t = time.thread_time()
        layout = ScheduleLayout.of(cls, n_microbatches=n, n_stages=8, virtual_stages=virtual)
        assert sum(len(layout.actions(r)) for r in range(layout.n_ranks)) >= 16 * n
        cpu[n] = time.thread_time() - t
    assert cpu[1024] < 2.0, cpu  # 8x the micro-batches: about 8x the time (64x if quadratic)
