"""estimators/pipeline/fsdp.py: FSDP2 inside a pipeline stage (rules F1-F6), each on hand-built
numbers worked out by hand (the rules against MemTracker on gloo ranks:
tests/integration/test_pipeline_gloo.py, benchmarks/pipeline_e2e.py --dp)."""

import pytest

from estimators.pipeline.fsdp import FsdpProfile, FsdpStage, FsdpUnit, reduce_grad
from estimators.pipeline.memory import rank_memory
from estimators.pipeline.profile import StageProfile
from estimators.pipeline.schedule import Runtime

# Two units over W = 2: 60 B of parameters (even; its last parameter 20 B), and one of 40 B
# padded to 44 B.
_U1 = FsdpUnit(modules=("S.a",), gathered_bytes=60, grad_bytes=60, reduce_scatter_input_bytes=60,
               reduce_scatter_output_bytes=30, last_grad_bytes=20)
_U2 = FsdpUnit(modules=("S.b",), gathered_bytes=44, grad_bytes=40, reduce_scatter_input_bytes=44,
               reduce_scatter_output_bytes=22, last_grad_bytes=40)


def _first() -> StageProfile:
    """Stage 0 as the rank holds it sharded: resident 1000 (F1), gradients 100 unsharded."""
    return StageProfile(stage_index=0, is_first=True, is_last=False, split=False, resident_bytes=1000,
                        grad_bytes=100, input_bytes=0, output_bytes=10, fw=(5, 20), bw=(30, 40, 10),
                        grad_pending=(100, 60, 0), kept_after_fw=20, optim=(5,))


def test_units_gather_in_the_first_forward_and_stay_gathered_to_the_reduce():
    acts = [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)]
    over = FsdpProfile((_U1, _U2), first_forward=(120, 148), copies_reduce_scatter_input=True)  # F2 + F3 per op
    rm = rank_memory(acts, {0: _first()}, 2, Runtime.ONE_F_ONE_B, fsdp={0: over})
    # resident 1000 + 2 gradient receive buffers of 10 = 1020; gathered 60 + 44 = 104
    assert [a.peak_bytes for a in rm.actions] == [
        1188,  # F0: max(5 + 120, 20 + 148): the units gather as the first forward reaches them
        1164,  # F1: 1020 + 104 gathered + micro-batch 0's 20 + 20
        1254,  # B0: 1144 + the first write max(30, 40 + 40, 10 + 100) (M3 on the unsharded gradients)
        1264,  # B1: 1020 + 104 + 100 + 40
    ]
    assert [a.first_forward for a in rm.actions] == [True, False, False, False]
    # F5 inside the 1F1B loop: 1224 + the last forward's output 10. Unit 1 resharded (-60), its
    # input (+60) while its gradients live (1234), they go but the last parameter's (-40), its
    # output comes (+30) beside gloo's copy of its input (+60): 1284; the last gradient (-20).
    # Unit 2: -44, -60 unit 1's input, +44, -0, +22 (1166, with the copy 1210), -40. After the
    # loop: 1020 + the sharded gradients 52.
    assert rm.reduce_peak_bytes == 1284
    assert (rm.merge_peak_bytes, rm.end_base_bytes, rm.optim_peak_bytes) == (1072, 1072, 1077)
    assert rm.peak_bytes == 1284 and rm.peak_where == "reduce-scatter"


def test_the_reduce_walks_units_in_order_and_frees_each_input_at_the_next():
    # A unit whose input outgrows what it frees (its gradients reduced in a wider dtype) sets the peak.
    wide = FsdpUnit(modules=("S.c",), gathered_bytes=10, grad_bytes=10, reduce_scatter_input_bytes=200,
                    reduce_scatter_output_bytes=100)
    # unit 1: -60 resharded, +60 its input, -60 its gradients, +30 its output (470); the wide
    # unit: -10 resharded, -60 unit 1's input, +200 its own while its gradients live (600), -10
    # its gradients, +100 its output beside its input: 690; gloo's copy of it on top: 890
    assert reduce_grad((_U1, wide), 500) == 690
    assert reduce_grad((_U1, wide), 500, copies_input=True) == 890
    assert reduce_grad((_U1,), 500) == 500  # an input no larger than the parameters freed: no new high
    # a unit without gradients frees the previous input and reduces nothing (402), then 392 + 200 - 10 + 100
    frozen = FsdpUnit(modules=("S.d",), gathered_bytes=8, grad_bytes=0, reduce_scatter_input_bytes=0,
                      reduce_scatter_output_bytes=0)
    assert reduce_grad((_U1, frozen, wide), 500) == 682


def test_a_gradient_in_other_placements_is_redistributed_before_the_unit_reduces():
    # a vocabulary-sharded embedding over TP 2: its kept gradient replicated (120 B), 60 B in the
    # parameter's placements. From 500: the copy beside it (560), the replicated one freed (440),
    # then as _U1 from 440: -60 resharded, +60 its input, -60, +30, -20
    emb = FsdpUnit(modules=("S.e",), gathered_bytes=60, grad_bytes=60, reduce_scatter_input_bytes=60,
                   reduce_scatter_output_bytes=30, last_grad_bytes=60, redistributed=((120, 60),))
    assert emb.kept_grad_bytes == 120
    assert reduce_grad((emb,), 500) == 560
    assert reduce_grad((emb,), 500, copies_input=True) == 560  # 440 - 60 + 60 + 30 + 60 = 530 below it


def test_sharded_state_scales_by_the_ranks_elements():
    stage = FsdpStage(world_size=3, units=(_U1,), sharded_param_bytes=88, optimizer_state_bytes=None,
                      shard_numel=22, full_numel=64)
    assert stage.scaled(640) == 220 and stage.scaled(1) == 1  # rounded up
    with pytest.raises(ValueError, match="world_size >= 2"):
        FsdpStage(world_size=1, units=(_U1,), sharded_param_bytes=0, optimizer_state_bytes=0, shard_numel=1,
                  full_numel=1)


def test_a_runtime_schedule_reduces_each_stage_after_its_last_backward():
    """Interleaved schedules (``_PipelineScheduleRuntime``) run REDUCE_GRAD right after a stage's
    last backward, mid-step: the other stage's micro-batches are still in flight, and the
    stage's gathered units and unsharded gradients are gone for the rest of the step."""
    middle = StageProfile(stage_index=1, is_first=False, is_last=False, split=False, resident_bytes=500,
                          grad_bytes=100, input_bytes=10, output_bytes=10, fw=(5, 20), bw=(30, 40, 10),
                          grad_pending=(100, 60, 0), kept_after_fw=20, optim=(5,))
    acts = [(0, "F", 0), (0, "F", 1), (1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1), (0, "B", 0), (0, "B", 1)]
    over = FsdpProfile((_U1, _U2), first_forward=(120, 148), copies_reduce_scatter_input=True)
    rm = rank_memory(acts, {0: _first(), 1: middle}, 2, Runtime.RUNTIME, fsdp={0: over, 1: over})
    # resident 1000 + 500, receive buffers 2 x 10 (stage 0's gradients) + 2 x (10 + 10) (stage 1's): 1560.
    # Stage 1's reduce: both stages gathered (208), stage 1's gradients 100, its sent outputs and
    # input gradients held to the loop's end (40), stage 0's 2 micro-batches in flight (40): 1948,
    # and the reduce adds 50 as in the 1F1B case (unit 1's input beside its output and gloo's copy).
    # Stage 0's: 1560 + its units 104 + stage 1's sharded gradients 52 + its own 100 + stage 1's
    # holds 40 + its own sent outputs 20 = 1876, + 50.
    assert rm.reduces == ((1998, {0: 2}), (1926, {}))
    assert rm.reduce_peak_bytes == 1998
    assert rm.end_base_bytes == 1560 + 52 + 52  # both stages' sharded gradients, every hold gone


def test_no_split_backward_and_gradients_set_to_none():
    over = FsdpProfile((_U1, _U2), first_forward=(0, 0))
    for acts, kw in (([(0, "F", 0), (0, "B", 0)], {"runtime": Runtime.GPIPE, "grads_at_start": True}),
                     ([(0, "F", 0), (0, "I", 0), (0, "W", 0)], {"runtime": Runtime.RUNTIME})):
        with pytest.raises(ValueError, match="without a split backward, with gradients set to None"):
            rank_memory(acts, {0: _first()}, 1, fsdp={0: over}, **kw)
