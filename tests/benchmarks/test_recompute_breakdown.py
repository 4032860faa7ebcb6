"""benchmarks/recompute_breakdown.py: the per-op table of a plan's recompute, on made-up ops."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import recompute_breakdown as rb
from estimators.contract.module_info import SACOp
from planner.plan import ModulePlan


def test_a_plans_rerun_ops_beside_their_price_cached_ones_left_out():
    """conv re-run (priced 1.0 less the host's 0.1), batch norm cached (its look-up is not a
    re-run), relu re-run twice over two calls; the recompute stops after the last saved op."""
    ops = (SACOp(func="aten.convolution.default", occurrence=0, runtime_ms=1.1, memory_bytes=8, is_saved=True),
           SACOp(func="aten.native_batch_norm.default", occurrence=0, runtime_ms=0.6, memory_bytes=8, is_saved=True),
           SACOp(func="aten.relu_.default", occurrence=0, runtime_ms=0.3, memory_bytes=8, is_saved=True),
           SACOp(func="aten.sum.default", occurrence=0, runtime_ms=5.0, memory_bytes=0, is_saved=False))
    info = SimpleNamespace(stats=lambda fqn: SimpleNamespace(ops=ops, n_calls=1))
    plan = SimpleNamespace(modules=[ModulePlan(fqn="M.b", discard_ratio=0.5, full=False,
                                               saved_ops=(("aten.native_batch_norm.default", 0),))])
    dispatched = [("aten.convolution.default", 1.5), ("aten.native_batch_norm.default", 0.05),
                  ("aten.relu_.default", 0.2), ("aten.relu_.default", 0.25)]
    rows = rb.rerun_ops_table(plan, dispatched, info, SimpleNamespace(recompute_op_ms=0.1))
    assert [(k, n) for k, n, _, _ in rows] == [("aten.convolution.default", 1), ("aten.relu_.default", 2)]
    (_, _, conv_ms, conv_priced), (_, _, relu_ms, relu_priced) = rows
    assert (conv_ms, relu_ms) == (1.5, 0.45)
    assert abs(conv_priced - 1.0) < 1e-9 and abs(relu_priced - 0.2) < 1e-9
