"""The modelled step time of a layout: its parts add up, hand-computed pipeline cases."""

from __future__ import annotations

import types

import pytest
from torch.distributed.pipelining import Schedule1F1B

from estimators.pipeline.schedule import ScheduleLayout
from estimators.runtime.device import Interconnect
from planner.search.cost import RankTraffic, model_step_time, pipeline_step_time, unit_comms

SLOW = Interconnect(name="slow", bandwidth_bytes_per_s=1e9, latency_s=0.0)  # 1 MB: 1 ms
FAST = Interconnect(name="fast", bandwidth_bytes_per_s=1e15, latency_s=0.0)


def _record(fw, bw, optim=0.5):
    return types.SimpleNamespace(fw_ms=fw, bw_ms=bw, w_ms=0.0, optim_ms=optim)


def test_a_two_stage_1f1b_step_by_hand():
    """F = 1, B = 2 ms, hand-over 1 ms, 2 micro-batches: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1;
    rank 0's B1 ends at 9 + 2 x 1 ms; both optimizers take 0.5 ms."""
    layout = ScheduleLayout.of(Schedule1F1B, n_microbatches=2, n_stages=2)
    records = {0: _record(1.0, 2.0), 1: _record(1.0, 2.0)}
    traffic = {0: RankTraffic(param_bytes=0, grad_bytes=0), 1: RankTraffic(param_bytes=0, grad_bytes=0)}
    st = pipeline_step_time(layout, records, {0: 0.25, 1: 0.25}, traffic, hop_bytes=10**6, pp_link=SLOW,
                            fsdp_size=1, fsdp_link=FAST, replicas=1, replica_link=FAST)
    assert st.step_ms == pytest.approx(9.5 + 2.0)
    assert st.recompute_ms == pytest.approx(2 * 0.25)  # per micro-batch, both micro-batches
    assert st.compute_ms == pytest.approx(6.0 - 0.5 + 0.5)
    assert st.exposed_comm_ms == pytest.approx(2.0)  # two hand-overs on the critical path
    assert st.bubble_ms == pytest.approx(3.0)
    assert st.compute_ms + st.recompute_ms + st.exposed_comm_ms + st.bubble_ms == pytest.approx(st.step_ms)


def test_fsdp_under_a_pipeline_gathers_once_and_reduces_after_the_last_backward():
    layout = ScheduleLayout.of(Schedule1F1B, n_microbatches=2, n_stages=2)
    records = {0: _record(1.0, 2.0), 1: _record(1.0, 2.0)}
    traffic = {r: RankTraffic(param_bytes=4 * 10**6, grad_bytes=4 * 10**6) for r in (0, 1)}
    st = pipeline_step_time(layout, records, {}, traffic, hop_bytes=0, pp_link=FAST,
                            fsdp_size=2, fsdp_link=SLOW, replicas=1, replica_link=FAST)
    # all-gather 4 MB over 2 ranks: 1/2 x 4 ms = 2 ms, 1 ms hidden behind the first forward;
    # reduce-scatter 2 ms after the last backward.
    assert st.step_ms == pytest.approx(9.5 + 1.0 + 2.0)
    hsdp = pipeline_step_time(layout, records, {}, traffic, hop_bytes=0, pp_link=FAST,
                              fsdp_size=2, fsdp_link=SLOW, replicas=2, replica_link=SLOW)
    assert hsdp.step_ms == pytest.approx(st.step_ms + 2.0)  # all-reduce of the 2 MB shard: 2 x 1/2 x 2 ms


@pytest.fixture(scope="module")
def tiny_estimate():
    from estimators.step.train_step import TrainStep
    from estimators.tracing.estimation import estimate
    from examples.llama import llama_tiny

    model, inputs = llama_tiny()
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw", micro_batches=2)
    return estimate(model, step, device="h100")


def test_a_whole_model_step_adds_up_and_scales_with_accumulation(tiny_estimate):
    est = tiny_estimate
    info = est.module_info
    one = model_step_time(est, info, {}, [], accumulation=1)
    four = model_step_time(est, info, {}, [], accumulation=4)
    assert one.compute_ms + one.recompute_ms + one.exposed_comm_ms == pytest.approx(one.step_ms)
    assert four.step_ms - info.optimizer_runtime_ms == pytest.approx(4 * (one.step_ms - info.optimizer_runtime_ms))
    block = "Llama.layers.0"
    planned = model_step_time(est, info, {block: info.stats(block).sac_memory_bytes}, [], accumulation=1)
    assert planned.recompute_ms > 0 and planned.compute_ms == pytest.approx(one.compute_ms)


def test_fsdp_collectives_on_a_slow_link_are_exposed_time(tiny_estimate):
    from planner.distributed.fsdp import fsdp_module_info

    est = tiny_estimate
    units = ["Llama", "Llama.layers.0", "Llama.layers.1"]
    info = fsdp_module_info(est.module_info, units, 4)
    fast = model_step_time(est, info, {}, unit_comms(info, units, 4, FAST), accumulation=1)
    slow = model_step_time(est, info, {}, unit_comms(info, units, 4, SLOW), accumulation=1)
    assert slow.compute_ms == pytest.approx(fast.compute_ms)
    assert slow.exposed_comm_ms > fast.exposed_comm_ms
    hsdp = model_step_time(est, info, {}, unit_comms(info, units, 4, SLOW, replicas=2, replica_link=SLOW),
                           accumulation=1)
    assert hsdp.exposed_comm_ms > slow.exposed_comm_ms



def _layers_info(n_layers: int, act: int, discard: int):
    """A ModuleInfo stand-in: ``n_layers`` layers of 1 ms forward / 2 ms backward, each saving
    ``act`` bytes of which ``discard`` can be dropped (recomputed at 1 ms per byte-unit curve)."""
    curve = types.SimpleNamespace(total_bytes=discard, discarded_bytes=[0, discard], recompute_ms=[0.0, 1.0])
    layer = types.SimpleNamespace(fw_runtime_ms=1.0, bw_runtime_ms=2.0, act_fw_bytes=act, tradeoff=curve,
                                  forced_discard_bytes=0)
    embed = types.SimpleNamespace(fw_runtime_ms=0.0, bw_runtime_ms=0.0)
    stats = {f"M.layers.{i}": layer for i in range(n_layers)} | {"M.tok_embeddings": embed}
    return types.SimpleNamespace(mod_stats=[types.SimpleNamespace(fqn="M")], stats=stats.__getitem__,
                                 fw_runtime_ms=1.0 * n_layers, bw_runtime_ms=2.0 * n_layers, optimizer_runtime_ms=0.0)


def test_the_pipeline_floor_counts_gradients_only_once_a_backward_made_them():
    """GPipe on 2 ranks, 4 micro-batches, 4 layers a stage each saving 100 bytes of which 90 can
    go: at a rank's first backward all 4 micro-batches are in flight and no gradient exists yet
    (zero_grad(set_to_none=True)); from its second on, 3 at most beside the gradients. Floor:
    4 x 4 x 10 kept + 90 recomputed = 250 without gradients, 3 x 40 + 90 = 210 with them."""
    from torch.distributed.pipelining import ScheduleGPipe

    from planner.search.cost import pipeline_bound

    layout = ScheduleLayout.of(ScheduleGPipe, n_microbatches=4, n_stages=2)
    actions = {r: layout.actions(r) for r in range(2)}
    state, grads = 10_000, 1_000

    def floor(g):
        return pipeline_bound(_layers_info(8, 100, 90), layout, [range(0, 4), range(4, 8)], {0: state, 1: state},
                              {0: g, 1: g}, usable_bytes=10**9, actions=actions).floor_bytes

    assert floor(0) == state + 250
    assert floor(grads) == max(state - grads + 250, state + 210)  # not state + 250: that is over the real floor
