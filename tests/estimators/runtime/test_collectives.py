"""estimators/runtime/collectives.py: hand-computed ring formulas and an exact fit."""

import pytest

from estimators.runtime.collectives import (
    AnalyticCollectiveModel,
    Collective,
    CollectiveCost,
    CollectiveFitError,
    CollectivePoint,
    bucket_bytes,
    ring_factor,
)
from estimators.runtime.device import Interconnect, get_device_spec

GiB = 2**30
AG, RS, AR, BC = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE,
                  Collective.BROADCAST)
TEST_LINK = Interconnect(name="test", bandwidth_bytes_per_s=100e9, latency_s=5e-6)



def test_ring_factors():
    assert ring_factor(AG, 8) == ring_factor(RS, 8) == 7 / 8
    assert ring_factor(AR, 8) == 14 / 8
    assert ring_factor(BC, 8) == 1.0
    assert all(ring_factor(c, 1) == 0.0 for c in Collective)


def test_bucket_bytes_rounds_up_to_a_power_of_two():
    sizes = (0, 1, 2, 3, 1000, 1024, 1025)
    assert [bucket_bytes(n) for n in sizes] == [1, 1, 2, 4, 1024, 1024, 2048]


def test_all_gather_1gib_8_ranks_100gbps_5us_hand_computed():
    model = AnalyticCollectiveModel.from_interconnect(TEST_LINK)
    # 5 us + 7/8 * 2**30 B / 100e9 B/s = 5e-6 + 939524096 / 1e11 s = 9.40024096 ms
    assert model.time_ms(AG, GiB, 8) == pytest.approx(9.40024096, rel=1e-12)
    assert model.time_ms(RS, GiB, 8) == pytest.approx(9.40024096, rel=1e-12)
    # all_reduce moves twice as much: 5e-6 + 1879048192 / 1e11 s
    assert model.time_ms(AR, GiB, 8) == pytest.approx(18.79548192, rel=1e-12)
    # broadcast: the whole buffer once, 5e-6 + 1073741824 / 1e11 s
    assert model.time_ms(BC, GiB, 8) == pytest.approx(10.74241824, rel=1e-12)


def test_group_of_one_costs_nothing_and_empty_message_costs_the_latency():
    model = AnalyticCollectiveModel.from_interconnect(TEST_LINK)
    assert model.time_ms(AR, GiB, 1) == 0.0
    assert model.time_ms(AR, 0, 4) == pytest.approx(0.005)


def test_model_from_device_uses_its_link():
    model = AnalyticCollectiveModel.from_device("h100")
    assert model.name == "analytic:nvlink4"
    # NVLink4: 450e9 B/s, 10 us; all_reduce of 1 GiB over 8 ranks: 1e-5 + 1.75 * 2**30 / 450e9 s
    assert model.time_ms(AR, GiB, 8) == pytest.approx(1e-2 + 1.75 * 2**30 / 450e6, rel=1e-12)
    slower = get_device_spec("h100").replace(interconnect_bytes_per_s=100e9)
    assert AnalyticCollectiveModel.from_device(slower).time_ms(AG, GiB, 8) == pytest.approx(
        1e-2 + 7 / 8 * 2**30 / 1e8, rel=1e-12
    )
    with pytest.raises(ValueError, match="names no interconnect"):
        AnalyticCollectiveModel.from_device("cpu")


def _synthetic_points(truth):
    return [
        CollectivePoint(collective=c, message_bytes=nbytes, group_size=n,
                        runtime_ms=AnalyticCollectiveModel(costs=truth).time_ms(c, nbytes, n))
        for c in truth
        for n in (2, 4, 8)
        for nbytes in (1024, 65536, 2**20, 2**26)
    ]


@pytest.mark.parametrize("relative_error", [True, False])
def test_fit_recovers_latency_and_bandwidth_exactly(relative_error):
    truth = {
        AG: CollectiveCost(latency_s=7e-6, bandwidth_bytes_per_s=123e9),
        RS: CollectiveCost(latency_s=11e-6, bandwidth_bytes_per_s=80e9),
        AR: CollectiveCost(latency_s=23e-6, bandwidth_bytes_per_s=95e9),
        BC: CollectiveCost(latency_s=3e-6, bandwidth_bytes_per_s=40e9),
    }
    fitted = AnalyticCollectiveModel.fit(_synthetic_points(truth), relative_error=relative_error)
    for c, cost in truth.items():
        got = fitted.costs[c]
        assert got.latency_s == pytest.approx(cost.latency_s, rel=1e-6)
        assert got.bandwidth_bytes_per_s == pytest.approx(cost.bandwidth_bytes_per_s, rel=1e-6)


def test_fit_keeps_latency_non_negative():
    # Through these points the unconstrained line has a negative intercept (-0.5 ms).
    points = [
        CollectivePoint(collective=AR, message_bytes=b, group_size=2, runtime_ms=t)
        for b, t in ((1000, 0.5), (2000, 1.5), (3000, 2.5))
    ]
    cost = AnalyticCollectiveModel.fit(points, relative_error=False).costs[AR]
    assert cost.latency_s == 0.0
    # Best line through the origin: slope = sum(x y) / sum(x x), x = bytes moved (factor 1).
    x, y = [1000, 2000, 3000], [0.5e-3, 1.5e-3, 2.5e-3]
    slope = sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x)
    assert cost.bandwidth_bytes_per_s == pytest.approx(1 / slope, rel=1e-9)


def test_fit_needs_two_message_sizes_and_real_groups():
    one_size = [CollectivePoint(collective=AG, message_bytes=4096, group_size=2, runtime_ms=t)
                for t in (0.1, 0.2)]
    with pytest.raises(CollectiveFitError, match="two or more message sizes"):
        AnalyticCollectiveModel.fit(one_size)
    singletons = [CollectivePoint(collective=AG, message_bytes=b, group_size=1, runtime_ms=0.1)
                  for b in (4096, 8192)]
    with pytest.raises(CollectiveFitError):
        AnalyticCollectiveModel.fit(singletons)
    with pytest.raises(CollectiveFitError, match="got none"):
        AnalyticCollectiveModel.fit([])


def test_fitted_model_names_collectives_it_cannot_price():
    points = [CollectivePoint(collective=AG, message_bytes=b, group_size=2, runtime_ms=b / 1e6)
              for b in (4096, 8192)]
    model = AnalyticCollectiveModel.fit(points)
    with pytest.raises(KeyError, match="no cost for all_reduce"):
        model.time_ms(AR, 4096, 2)


def test_bad_arguments_are_refused():
    model = AnalyticCollectiveModel.from_interconnect(TEST_LINK)
    with pytest.raises(TypeError, match="Collective.ALL_GATHER"):
        model.time_ms("all_gather", 10, 2)
    with pytest.raises(ValueError, match="message_bytes"):
        model.time_ms(AG, -1, 2)
    with pytest.raises(ValueError, match="group_size"):
        model.time_ms(AG, 10, 0)
    with pytest.raises(ValueError):
        CollectiveCost(latency_s=-1.0, bandwidth_bytes_per_s=1.0)
