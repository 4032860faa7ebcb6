"""Stated routing (estimators/tracing/routing.py): a fake trace of an expert-parallel MoE layer
reads its routing's token counts from the stated load. A small EP layer written with torch's public
APIs the way torchtitan's all-to-all dispatcher works (top-k routing, counts exchanged with
``all_to_all_single``, ``.tolist()`` split sizes, tokens sent and returned by all-to-all) is traced
on rank 0 or 1 of torch's fake process group of 2."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single

from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
from estimators.tracing.fake_leaks import FakeTensorLeakWarning
from estimators.tracing.routing import ExpertLoad, ExpertLoadError, recorded_exchanges
from planner.distributed.fake_world import fake_process_group

TOKENS, DIM, EXPERTS, TOP_K, EP = 32, 8, 8, 2, 2
ROWS = TOKENS * TOP_K
SEEN: list = []
"""What the traced layer read (the trace runs a copy of the module: read here, not on it)."""


class EPLayer(nn.Module):
    """Top-k routing over EXPERTS experts, an equal share of them on each rank, tokens sent to the
    experts' ranks and back by all-to-all with split sizes read from the exchanged counts. The
    counts are exchanged by ``exchange``: the functional all-to-all (torchtitan's partial_dtensor
    backend), ``dist.all_to_all_single`` into an empty tensor, or ``dist.all_to_all`` of a list
    (its spmd_types backend)."""

    def __init__(self, exchange: str = "functional") -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.w = nn.Parameter(torch.randn(EXPERTS // dist.get_world_size(), DIM, DIM) / DIM)
        self.exchange = exchange

    def _exchange(self, counts: torch.Tensor, ep: int) -> torch.Tensor:
        if self.exchange == "functional":
            return torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, dist.group.WORLD))
        got = torch.empty_like(counts)
        if self.exchange == "single":
            dist.all_to_all_single(got, counts)
        else:
            dist.all_to_all(list(got.unbind(0)), list(counts.unbind(0)))
        return got

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, ep = dist.group.WORLD, dist.get_world_size()
        scores = self.gate(x).softmax(-1)
        top, ids = scores.topk(TOP_K, dim=-1)
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(0)  # (E,)
        got = self._exchange(counts.view(ep, -1), ep)
        send, recv = counts.view(ep, -1).sum(1).tolist(), got.sum(1).tolist()
        order = ids.view(-1).argsort(stable=True)
        routed = all_to_all_single(x[order // TOP_K], recv, send, group)  # (R, D): R set by the load
        offsets = got.sum(0).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(routed, self.w, offs=offsets)
        back = all_to_all_single(h, send, recv, group)
        SEEN.append({"received": routed.shape[0], "send": send, "recv": recv, "first": ids[0].tolist()})
        return torch.zeros_like(x).index_add(0, order // TOP_K, back * top.reshape(-1)[order, None])


def _trace(load: ExpertLoad | None, rank: int = 0, world: int = EP, exchange: str = "functional"):
    SEEN.clear()
    with fake_process_group(world_size=world, rank=rank):
        torch.manual_seed(0)
        model = EPLayer(exchange)
        step = TrainStep(inputs=(torch.randn(TOKENS, DIM),), optimizer="adamw")
        with recorded_exchanges() as exchanges:
            est = estimate(model, step, options=EstimateOptions(expert_load=load))
    return est, list(exchanges), SEEN[-1]


@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0, 1.5, 2.0])
def test_the_rows_a_rank_receives_follow_the_stated_factor(factor):
    est, (exchange,), seen = _trace(ExpertLoad(capacity_factor=factor))
    rows = round(factor * ROWS)
    assert seen["received"] == exchange.received_rows == rows
    assert seen["recv"] == [rows // EP] * EP  # from every rank of the group, factor / EP of its rows
    assert seen["send"] == [ROWS // EP] * EP  # it always sends its TOKENS x TOP_K rows, balanced
    assert (exchange.ep_size, exchange.ep_rank, exchange.experts, exchange.local_experts) == (EP, 0, EXPERTS, 4)
    assert exchange.routed_rows == ROWS and exchange.capacity_factor == factor
    assert seen["first"] == [0, 1]  # token 0's choices: (0 * k + j) % E


# torch's fake kernels of the c10d collectives draw a work id from Python's `random`: the trace warns.
@pytest.mark.filterwarnings("ignore::estimators.tracing.estimation.HostRandomnessWarning")
@pytest.mark.parametrize("exchange", ["single", "list"])
def test_the_counts_exchanged_in_place_are_the_stated_ones(exchange):
    _, (exchange_,), seen = _trace(ExpertLoad(capacity_factor=1.5), exchange=exchange)
    assert seen["received"] == exchange_.received_rows == round(1.5 * ROWS)


@pytest.mark.slow
def test_the_peak_grows_with_the_rows_received():
    peaks = [_trace(ExpertLoad(capacity_factor=f))[0].module_info.peak_bytes for f in (0.0, 1.0, 2.0)]
    assert peaks[0] < peaks[1] < peaks[2]


@pytest.mark.slow
def test_worst_case_every_token_that_can_reach_the_rank_does():
    _, (exchange,), seen = _trace(ExpertLoad.worst_case())
    most = EP * TOKENS * min(TOP_K, EXPERTS // EP)  # each token to min(k, e) of this rank's experts
    assert seen["received"] == exchange.received_rows == most
    assert exchange.capacity_factor == most / ROWS == 2.0
    _, (capped,), _ = _trace(ExpertLoad.worst_case(max_capacity_factor=1.25))
    assert capped.received_rows == round(1.25 * ROWS) and capped.capacity_factor == 1.25


def test_a_load_the_routing_cannot_produce_is_refused():
    with pytest.raises(TraceError, match="can send at most 64 .*capacity_factor 2, the worst case"):
        _trace(ExpertLoad(capacity_factor=2.5))


@pytest.mark.slow
def test_one_factor_per_rank_of_the_group():
    load = ExpertLoad(capacity_factor=(1.5, 0.5))
    assert [_trace(load, rank=r)[2]["received"] for r in (0, 1)] == [round(1.5 * ROWS), round(0.5 * ROWS)]
    assert load.planned() == ExpertLoad(capacity_factor=1.5)
    with pytest.raises(TraceError, match="gives 2 factors, but the expert-parallel group has 4 ranks"):
        _trace(load, world=4)


def test_without_a_load_the_trace_is_refused_as_before():
    with pytest.raises(TraceError, match="reads tensor values"):
        _trace(None)


def test_a_real_trace_follows_its_batch_and_takes_no_load():
    with fake_process_group(world_size=EP, rank=0):
        with pytest.raises(ValueError, match="needs mode=TraceMode.FAKE"):
            estimate(EPLayer(), TrainStep(inputs=(torch.randn(TOKENS, DIM),)),
                     options=EstimateOptions(mode=TraceMode.REAL, expert_load=ExpertLoad()))


def test_no_fake_tensor_is_left_behind():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FakeTensorLeakWarning)
        _trace(ExpertLoad())


class _Reads(nn.Module):
    """Value reads on index arithmetic: ``.item()``, ``bincount`` (its size is a value),
    ``nonzero``; a float op (the mask times the input) stays fake."""

    def forward(self, x):
        _, ids = x.topk(TOP_K, dim=-1)
        mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, ids, True)
        SEEN.append({"bins": torch.bincount(ids.view(-1)).tolist(), "nonzero": torch.nonzero(mask).shape[0],
                     "any": bool(mask.any()), "last": ids[-1, -1].item()})
        return x * mask


class _ReadsEmpty(nn.Module):
    def forward(self, x):
        return x * torch.empty(2, dtype=torch.long).sum().item()


def test_an_empty_tensor_holds_no_values_to_read():
    with pytest.raises(TraceError, match="reads tensor values"):
        estimate(_ReadsEmpty(), TrainStep(inputs=(torch.randn(2, requires_grad=True),)),
                 options=EstimateOptions(expert_load=ExpertLoad()))


def test_value_reads_and_shapes_of_values():
    SEEN.clear()
    estimate(_Reads(), TrainStep(inputs=(torch.randn(TOKENS, EXPERTS, requires_grad=True),)),
             options=EstimateOptions(expert_load=ExpertLoad()))
    assert SEEN[-1] == {"bins": [ROWS // EXPERTS] * EXPERTS, "nonzero": ROWS, "any": True,
                        "last": (ROWS - 1) % EXPERTS}


@pytest.mark.parametrize("bad, match", [
    (dict(capacity_factor=-1.0), "numbers >= 0"), (dict(capacity_factor=float("nan")), "numbers >= 0"),
    (dict(capacity_factor=True), "numbers >= 0"), (dict(capacity_factor=()), "tuple of one number"),
    (dict(max_capacity_factor=0), "number > 0"), (dict(max_capacity_factor=math.inf), "number > 0"),
    (dict(capacity_factor=2.0, max_capacity_factor=1.5), "above the model's capacity"),
])
def test_expert_load_refuses_what_no_routing_is(bad, match):
    with pytest.raises(ExpertLoadError, match=match):
        ExpertLoad(**bad)


def test_expert_load_names():
    assert ExpertLoad.balanced() == ExpertLoad() and not ExpertLoad().is_worst_case
    assert ExpertLoad.worst_case().is_worst_case and ExpertLoad.worst_case(1.5).max_capacity_factor == 1.5
    assert ExpertLoad(capacity_factor=(1.0, 2.0)).factor_of(1, 2) == 2.0
