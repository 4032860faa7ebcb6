"""estimators/pipeline/memory.py: the rank's memory over its schedule, on hand-built profiles
with the figures worked out by hand (every rule also matches MemTracker on real gloo runs:
benchmarks/pipeline_e2e.py)."""

from estimators.pipeline.memory import rank_memory
from estimators.pipeline.profile import StageProfile
from estimators.pipeline.schedule import Runtime


def _first() -> StageProfile:
    return StageProfile(stage_index=0, is_first=True, is_last=False, split=False, resident_bytes=1000,
                        grad_bytes=100, input_bytes=0, output_bytes=10, fw=(5, 20), bw=(30, 40, 10),
                        grad_pending=(100, 60, 0), kept_after_fw=20, optim=(5,))


def _last() -> StageProfile:
    return StageProfile(stage_index=1, is_first=False, is_last=True, split=False, resident_bytes=1000,
                        grad_bytes=100, input_bytes=8, output_bytes=64, loss_bytes=4, fw=(10, 90),
                        bw=(100,), grad_pending=(0,), kept_after_fw=80, optim=(5,))


def test_first_stage_of_1f1b():
    acts = [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)]
    rm = rank_memory(acts, {0: _first()}, 2, Runtime.ONE_F_ONE_B)
    # resident 1000 + 2 gradient receive buffers of 10 (M2) = 1020
    assert [a.peak_bytes for a in rm.actions] == [
        1040,  # F0: 1020 + its curve's 20
        1060,  # F1: micro-batch 0 keeps 20 (M4)
        1150,  # B0: first backward, gradients appear as written: max(30+0, 40+40, 10+100) (M3)
        1160,  # B1: every gradient (100) + its curve's 40
    ]
    assert [a.in_flight for a in rm.actions] == [{}, {0: 1}, {0: 1}, {}]
    assert (rm.merge_peak_bytes, rm.end_base_bytes, rm.optim_peak_bytes, rm.peak_bytes) == (1120, 1120, 1125, 1160)
    assert rm.actions[2].first_write and not rm.actions[3].first_write


def test_last_stage_of_gpipe_holds_losses_chunks_sends_and_the_merged_output():
    acts = [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]
    rm = rank_memory(acts, {1: _last()}, 2, Runtime.GPIPE)
    # resident 1000 + 2 activation receive buffers of 8 = 1016
    assert [a.peak_bytes for a in rm.actions] == [
        1106,  # F0
        1190,  # F1: loss 0 (4) + micro-batch 0's 80
        1304,  # B0: losses 8 + micro-batch 1's 80 + first write 100 + 100
        1296,  # B1: gradients 100, losses 8, chunk 0 (64), input gradient 0 sent (8) + 100
    ]
    # after the loop (losses and sends gone): chunks 128 + the merged output 128
    assert rm.merge_peak_bytes == 1016 + 100 + 128 + 128
    assert rm.end_base_bytes == 1016 + 100 + 128  # chunks stay until the next step()
    assert rm.peak_bytes == rm.merge_peak_bytes and rm.peak_where == "merge"
    no_chunks = rank_memory(acts, {1: _last()}, 2, Runtime.GPIPE, return_outputs=False)
    assert no_chunks.merge_peak_bytes == 1016 + 100


def test_gradients_kept_between_steps():
    acts = [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)]
    kept = rank_memory(acts, {0: _first()}, 2, Runtime.ONE_F_ONE_B, grads_at_start=True)
    assert [a.peak_bytes for a in kept.actions] == [1140, 1160, 1180, 1160]


def test_split_backward_keeps_what_the_weight_half_needs():
    p = StageProfile(stage_index=1, is_first=False, is_last=False, split=True, resident_bytes=0, grad_bytes=0,
                     input_bytes=8, output_bytes=8, fw=(50,), bw=(70,), w=(60,), grad_pending=(0,),
                     kept_after_fw=50, kept_after_i=60)
    acts = [(1, "F", 0), (1, "F", 1), (1, "I", 0), (1, "W", 0), (1, "I", 1), (1, "W", 1)]
    rm = rank_memory(acts, {1: p}, 2, Runtime.RUNTIME)
    # receive buffers 2 x (8 + 8) = 32; after I the input gradient stays on the buffer (8, M5)
    assert [a.base_bytes for a in rm.actions] == [32, 82, 82, 32 + 50 + 8, 32 + 8 + 8, 32 + 8 + 8 + 8]
    assert rm.end_base_bytes == 32 + 16  # both input gradients through the optimizer step
