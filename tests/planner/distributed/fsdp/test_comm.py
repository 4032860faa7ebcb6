"""planner/distributed/fsdp/comm.py ``fsdp_comm_ms``: FSDP2's all-gather / reduce-scatter time per unit on a
hand-built ModuleInfo, against numbers computed by hand."""

from __future__ import annotations

import pytest

from estimators.runtime.collectives import AnalyticCollectiveModel, Collective, CollectiveCost
from estimators.runtime.device import Interconnect
from estimators.contract.module_info import ModOrder, ModStats, ModuleInfo
from planner.distributed.fsdp.comm import RECOMPUTE_EXTRA_ALL_GATHER_REASON, fsdp_comm_ms
from planner.distributed.fsdp.units import FSDPUnitError

# Root "M" holds 1000 B of parameters in all: "M.a" 300 B (of which its child "M.a.x" 100 B, not a
# unit) and "M.b" 200 B, so the root's own parameters are 1000 - 300 - 200 = 500 B. "M.b" is
# frozen: no gradients. The link: 1e9 B/s, 10 us per collective; 4 ranks: ring factor 3/4.
_PARAMS = {"M": 1000, "M.a": 300, "M.a.x": 100, "M.b": 200}
_GRADS = {"M": 800, "M.a": 300, "M.a.x": 100, "M.b": 0}
UNITS = ["M", "M.a", "M.b"]
LINK = Interconnect(name="test", bandwidth_bytes_per_s=1e9, latency_s=1e-5)


def _info() -> ModuleInfo:
    stats = tuple(
        ModStats(fqn=f, is_leaf=f in ("M.a.x", "M.b"), param_bytes=_PARAMS[f], grad_bytes=_GRADS[f],
                 fw_pre_op=i, fw_post_op=i + 1, bw_pre_op=10 + i, bw_post_op=11 + i)
        for i, f in enumerate(_PARAMS)
    )
    names = tuple(_PARAMS)
    order = ModOrder(fw_pre_order=names, fw_post_order=names, bw_pre_order=names, bw_post_order=names)
    return ModuleInfo(mod_order=order, mod_stats=stats, memory_points=())


def _ms(nbytes: int) -> float:
    """One ring collective over 4 ranks on LINK, by hand: 10 us + 3/4 * bytes / 1e9 B/s."""
    return (1e-5 + 0.75 * nbytes / 1e9) * 1e3


def test_per_unit_times_match_the_hand_computed_ones():
    est = fsdp_comm_ms(_info(), UNITS, 4, AnalyticCollectiveModel.from_interconnect(LINK))
    by_fqn = {u.fqn: u for u in est.units}
    root, a, b = by_fqn["M"], by_fqn["M.a"], by_fqn["M.b"]
    # The root stays gathered after forward: one all-gather; the others re-gather in backward.
    assert (root.all_gather_bytes, root.all_gathers) == (500, 1)
    assert root.all_gather_ms == _ms(500)  # 0.010375 ms
    assert (a.all_gather_bytes, a.all_gathers) == (300, 2)
    assert a.all_gather_ms == 2 * _ms(300)  # 0.02045 ms
    assert b.all_gather_ms == 2 * _ms(200)  # 0.0203 ms
    # Gradients: root's own 800 - 300 = 500 B; M.b is frozen and issues no reduce-scatter.
    assert root.reduce_scatter_bytes == 500 and root.reduce_scatter_ms == _ms(500)
    assert a.reduce_scatter_ms == _ms(300)
    assert b.reduce_scatter_bytes == 0 and b.reduce_scatter_ms == 0.0
    assert a.total_ms == 3 * _ms(300)


def test_step_totals_and_the_recompute_adds_no_all_gather():
    est = fsdp_comm_ms(_info(), UNITS, 4, AnalyticCollectiveModel.from_interconnect(LINK))
    # Exact: the same float operations in the same order as the estimate (units root, M.a, M.b);
    # the decimals 0.010375 + 0.02045 + 0.0203 differ from them in the last bit.
    assert est.all_gather_ms == _ms(500) + 2 * _ms(300) + 2 * _ms(200)  # 0.051125 ms
    assert est.reduce_scatter_ms == _ms(500) + _ms(300) + 0.0  # 0.0206 ms
    assert est.recompute_extra_all_gather_ms == 0.0
    assert est.recompute_extra_reason == RECOMPUTE_EXTRA_ALL_GATHER_REASON
    assert "pre-backward all-gather" in est.recompute_extra_reason
    assert est.total_ms == est.all_gather_ms + est.reduce_scatter_ms
    note = est.note()
    assert "all-gather 0.051 ms, reduce-scatter 0.021 ms per step over 4 ranks" in note
    assert "analytic:test" in note


def test_one_rank_moves_nothing_and_a_fitted_model_is_accepted():
    assert fsdp_comm_ms(_info(), UNITS, 1, AnalyticCollectiveModel.from_interconnect(LINK)).total_ms == 0.0
    # As AnalyticCollectiveModel.fit(CollectiveBenchmark(...).points()) makes: a cost per collective.
    fitted = AnalyticCollectiveModel(
        costs={Collective.ALL_GATHER: CollectiveCost(latency_s=0.0, bandwidth_bytes_per_s=1e6),
               Collective.REDUCE_SCATTER: CollectiveCost(latency_s=1e-3, bandwidth_bytes_per_s=1e6)},
        name="analytic:fit",
    )
    est = fsdp_comm_ms(_info(), UNITS, 2, fitted)
    # all-gather: (500 + 2*300 + 2*200) * 1/2 / 1e6 s; reduce-scatter: 2 * 1 ms + (500 + 300) / 2 / 1e6 s
    # Exact (float operations in the model's order), as in every check of this file.
    assert est.all_gather_ms == 1500 * 0.5 / 1e6 * 1e3
    assert est.reduce_scatter_ms == 2 * 1.0 + 800 * 0.5 / 1e6 * 1e3
    assert est.model_name == "analytic:fit"


def test_bad_units_are_refused():
    model = AnalyticCollectiveModel.from_interconnect(LINK)
    with pytest.raises(FSDPUnitError, match="must include the root"):
        fsdp_comm_ms(_info(), ["M.a"], 2, model)
    with pytest.raises(ValueError, match="world_size"):
        fsdp_comm_ms(_info(), UNITS, 0, model)
