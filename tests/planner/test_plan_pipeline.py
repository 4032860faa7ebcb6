"""planner/plan_pipeline.py: a stage plan's pipeline record, checked as ``Pipeline`` checks the
pipeline it was made for (an edited file loaded and applied before)."""

from __future__ import annotations

import pytest

from planner.errors import PlanFormatError
from planner.plan_pipeline import PipelineRecord

_GOOD = {"schedule": "ScheduleInterleaved1F1B", "n_microbatches": 8, "stage_index": 5, "n_stages": 8,
         "virtual_stages": 2, "rank_stages": [1, 5]}


def _record(**changes) -> PipelineRecord:
    return PipelineRecord.from_dict({**_GOOD, **changes})


def test_a_record_of_a_pipeline_the_planner_lays_out_loads():
    rec = _record()
    assert rec.rank_stages == (1, 5) and not rec.split_backward
    assert _record(rank_stages=[]).rank_stages == (1, 5)  # filled in from the layout
    zb = _record(schedule="ScheduleInterleavedZeroBubble", split_backward=True)
    assert zb.split_backward


@pytest.mark.parametrize("changes, message", [
    ({"schedule": "os.system"}, "schedule 'os.system' is not one the planner lays out"),
    ({"schedule": "torch"}, "not one the planner lays out"),  # an attribute of torch's schedules module
    ({"schedule": "ScheduleZBVZeroBubble"}, "not one the planner lays out"),
    ({"schedule": "MySchedule"}, "not one the planner lays out"),
    ({"schedule": "Schedule1F1B"}, "runs one stage per rank: virtual_stages must be 1"),
    ({"schedule": "Schedule1F1B", "virtual_stages": 1, "n_microbatches": 4, "rank_stages": [5]},
     "Schedule1F1B needs n_microbatches >= n_stages"),
    ({"virtual_stages": 3}, "must be a multiple of virtual_stages"),
    ({"n_microbatches": 9}, "torch refuses it"),
    ({"n_microbatches": 2**20}, r"pipeline.n_microbatches must be in \[1, 4,096\]"),
    ({"n_stages": 2**20}, r"pipeline.n_stages must be in \[1, 1,024\]"),
    ({"rank_stages": [0, 5]}, r"rank_stages \[0, 5\] are not the stages of stage 5's rank 1 \(\[1, 5\]\)"),
    ({"rank_stages": [5]}, "are not the stages of stage 5's rank 1"),
    ({"split_backward": True}, "split_backward is true, but ScheduleInterleaved1F1B does not split the backward"),
    ({"schedule": "ScheduleInterleavedZeroBubble"}, "split_backward is false, but ScheduleInterleavedZeroBubble splits"),
])
def test_an_edited_record_is_refused_in_one_line(changes, message):
    with pytest.raises(PlanFormatError, match=message) as e:
        _record(**changes)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
