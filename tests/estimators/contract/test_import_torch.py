"""estimators/contract/import_torch.py: torch's aggregate_stats dict -> ModuleInfo with torch's memory model.

The oracle is torch's own formula, written out below from sac_ilp.sac_milp's constraints, and
torch's get_peak_memory_runtime_baseline for the no-AC peak.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from typing import Any

import pytest

from estimators.contract.import_torch import module_info_from_torch_dict
from estimators.contract.module_info import ModuleInfo, ModuleInfoFormatError
from solver import min_reachable_peak_bytes, predict_peak_bytes, solve_milp

MiB = 2**20


def stat(fqn: str, **kw: Any) -> dict[str, Any]:
    d = {
        "fqn": fqn, "param_per_module": 0, "grad_per_module": 0, "grad_total": 0,
        "act_fw_per_module": 0, "act_bw_per_module": 0, "act_grad_per_module": 0, "act_total": 0,
        "input_per_module": 0, "output_per_module": 0, "fw_runtime_per_module": 0.0,
        "bw_runtime_per_module": 0.0, "is_leaf": True, "sac_runtime": 0, "sac_memory": 0,
        "n_segments": 0, "slopes": [], "intercepts": [], "breakpoints": [],
        "tradeoff_curve": OrderedDict(),
    }
    d.update(kw)
    return d


def hand_dict() -> dict[str, Any]:
    """M -> (a -> fc, b). a keeps 600 MiB of its 1000 MiB op memory (ACM - IA = 400 MiB)."""
    curve = OrderedDict([(0.01, 0.2), (0.51, 0.5), (1.01, 1.0)])
    return {
        "mod_order": {
            "fw_pre_order": ["M", "M.a", "M.a.fc", "M.b"],
            "fw_post_order": ["M.a.fc", "M.a", "M.b", "M"],
            "bw_pre_order": ["M", "M.b", "M.a", "M.a.fc"],
            "bw_post_order": ["M.b", "M.a.fc", "M.a", "M"],
        },
        "mod_stats": [
            stat("M", param_per_module=100 * MiB, grad_total=0, act_total=1300 * MiB,
                 act_grad_per_module=50 * MiB, is_leaf=False, fw_runtime_per_module=9.0,
                 bw_runtime_per_module=18.0, sac_memory=1300 * MiB, act_fw_per_module=1200 * MiB,
                 sac_runtime=8.0, tradeoff_curve=OrderedDict([(0.01, 0.0), (1.01, 1.0)])),
            stat("M.b", grad_total=10 * MiB, act_total=1300 * MiB, act_grad_per_module=30 * MiB),
            stat("M.a", is_leaf=False, grad_total=20 * MiB, act_total=700 * MiB,
                 act_grad_per_module=100 * MiB, sac_memory=1000 * MiB, act_fw_per_module=600 * MiB,
                 sac_runtime=4.0, tradeoff_curve=curve),
            stat("M.a.fc", grad_total=30 * MiB, act_total=600 * MiB, act_grad_per_module=10 * MiB),
        ],
    }


def torch_peak(d: dict[str, Any], discarded: dict[str, int], world_size: int = 1) -> float:
    """sac_milp's memory model: max_i TA_i + AG_i + (P_root + TG_i)/ws - sum_{pos_j < pos_i} d_j."""
    post = d["mod_order"]["fw_post_order"]
    by = {s["fqn"]: s for s in d["mod_stats"]}
    root = d["mod_order"]["fw_pre_order"][0]
    peak = 0.0
    for fqn, s in by.items():
        gone = sum(v for f, v in discarded.items() if post.index(f) < post.index(fqn))
        sharded = (by[root]["param_per_module"] + s["grad_total"]) / world_size
        m = s["act_total"] + s["act_grad_per_module"] + sharded
        peak = max(peak, m - gone)
    return peak


def torch_baseline_peak(d: dict[str, Any]) -> int:
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info

    return get_peak_memory_runtime_baseline(parse_module_info(copy.deepcopy(d)))[0]


def random_plans(info: ModuleInfo, n: int, seed: int = 0) -> list[dict[str, int]]:
    rng = random.Random(seed)
    cands = [s for s in info.mod_stats if s.sac_memory_bytes > 0]
    return [{s.fqn: rng.randint(1, s.sac_memory_bytes) for s in cands if rng.random() < 0.6}
            for _ in range(n)]


# ----------------------------------------------------------------------------- hand-made dict
def test_points_and_windows_follow_torch() -> None:
    info = module_info_from_torch_dict(hand_dict())
    assert [s.fqn for s in info.mod_stats] == ["M", "M.a", "M.a.fc", "M.b"]  # sorted to pre-order
    pts = {p.fqn: p for p in info.memory_points}
    assert {f: p.op_index for f, p in pts.items()} == {"M.a.fc": 1, "M.a": 4, "M.b": 7, "M": 10}
    assert pts["M.a"].total_bytes == (100 + 20 + 700 + 100) * MiB
    a = info.stats("M.a")
    assert (a.fw_pre_op, a.fw_post_op) == (0, 5)
    assert all(s.bw_pre_op > 10 for s in info.mod_stats)
    assert info.peak_bytes == torch_baseline_peak(hand_dict()) == (100 + 0 + 1300 + 50) * MiB
    assert (info.fw_runtime_ms, info.bw_runtime_ms) == (9.0, 18.0)


def test_curve_drops_the_key_shift_and_the_unsaved_bytes() -> None:
    """x_min = 400/1000; f(0.4) = 0.2 + 0.4/0.5 * 0.3 = 0.44; bytes = 1000 MiB x - 400 MiB."""
    a = module_info_from_torch_dict(hand_dict()).stats("M.a")
    assert a.sac_memory_bytes == 600 * MiB
    assert a.tradeoff.discarded_bytes == (0, 0, 100 * MiB, 600 * MiB)
    assert a.tradeoff.recompute_ms == pytest.approx((0.0, 0.44 * 4.0, 0.5 * 4.0, 4.0))
    assert a.sac_runtime_ms == pytest.approx(4.0)
    leaf = module_info_from_torch_dict(hand_dict()).stats("M.b")
    assert leaf.is_leaf and leaf.sac_memory_bytes == 0


@pytest.mark.parametrize("world_size", [1, 2])
def test_memory_model_equals_torch_formula(world_size: int) -> None:
    d = hand_dict()
    info = module_info_from_torch_dict(d)
    for plan in random_plans(info, 50):
        ours = predict_peak_bytes(info, plan, world_size=world_size)
        assert ours == pytest.approx(torch_peak(d, plan, world_size), abs=1)  # ours: ceil bytes


def test_solver_on_imported_dict() -> None:
    """Budget 1300 MiB: M.a covers M.b and M (pos 2, 3) but not its own point (920 MiB)."""
    d = hand_dict()
    res = solve_milp(module_info_from_torch_dict(d), 1300 * MiB)
    assert res.checkpointed == ("M.a",)
    assert res.discarded_bytes == {"M.a": 150 * MiB}  # 1450 - 1300 at the root's point
    assert torch_peak(d, dict(res.discarded_bytes)) == res.predicted_peak_bytes == 1300 * MiB


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("mod_stats"), "aggregate_stats"),
    (lambda d: d["mod_order"].pop("bw_pre_order"), "bw_pre_order"),
    (lambda d: d["mod_stats"][2].pop("act_total"), r"'M.a' misses keys \['act_total'\]"),
    (lambda d: d["mod_stats"][1].update(grad_total=float("nan")), "non-finite"),
    (lambda d: d["mod_stats"][2]["tradeoff_curve"].update({0.7: float("inf")}), "non-finite"),
    (lambda d: d["mod_order"]["fw_post_order"].remove("M.b"), "missing from mod_order"),
])
def test_bad_dicts(mutate, match) -> None:
    d = hand_dict()
    mutate(d)
    with pytest.raises(ModuleInfoFormatError, match=match):
        module_info_from_torch_dict(d)


# ----------------------------------------------------------------------------- a real dict
def _real_aggregate_stats() -> dict[str, Any]:
    """aggregate_stats on a tiny MLP under FakeTensorMode on CPU.

    RuntimeEstimator's benchmark mode times ops with CUDA events and its roofline mode needs CUDA,
    so the op timer is replaced by a deterministic size-based cost; everything else (MemTracker,
    SACEstimator and its pwlf fit, aggregate_stats) is torch's own code."""
    import torch
    import torch.nn as nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    def cpu_cost(cls, func, args, kwargs):  # noqa: ANN001 - torch's classmethod signature
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves(out)
        return out, 1e-3 + 1e-6 * sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.relu(self.fc1(self.ln(x))))

    class Net(nn.Module):
        def __init__(self, d: int = 32, layers: int = 2) -> None:
            super().__init__()
            self.emb = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.head = nn.Linear(d, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.emb(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x).sum()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RuntimeEstimator, "_benchmark_estimate", classmethod(cpu_cost))
        with FakeTensorMode():
            model, x = Net(), torch.randn(4, 64, 32)
            opt = torch.optim.Adam(model.parameters())
            mem = MemTracker()
            mem.track_external(model, opt)
            with mem:
                model(x).backward()
                opt.step()
            runtime = RuntimeEstimator()
            with runtime("operator-level-benchmark"):
                model(x).backward()
            sac = SACEstimator()
            with sac("operator-level-benchmark"):
                model(x).backward()
            return aggregate_stats(model, mem, runtime, sac, torch.device("cpu"))


@pytest.fixture(scope="module")
def real_dict() -> dict[str, Any]:
    try:
        return _real_aggregate_stats()
    except (ImportError, AssertionError, RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch's estimator pipeline does not run on this CPU build: {e!r}")


def test_real_dict_imports_with_torchs_peak(real_dict) -> None:
    info = module_info_from_torch_dict(real_dict)
    assert {s.fqn for s in info.mod_stats} == {s["fqn"] for s in real_dict["mod_stats"]}
    assert info.peak_bytes == torch_baseline_peak(real_dict)
    blocks = [s for s in info.mod_stats if s.fqn.startswith("Net.blocks.") and s.fqn.count(".") == 2]
    assert len(blocks) == 2 and all(b.sac_memory_bytes > 0 for b in blocks)
    for plan in random_plans(info, 50, seed=1):
        assert predict_peak_bytes(info, plan) == pytest.approx(torch_peak(real_dict, plan), abs=1e-6)


def test_real_dict_plans_match_or_beat_torch(real_dict) -> None:
    """Both solvers see the same memory model; recompute is compared on our exact curves, where
    torch's plan (ratios rounded to 4 digits) still fits the budget. The curves come from real
    CPU timings: under load torch's plans missed the budget at both of two budgets once (0
    compared), so up to five budgets in the reachable range are tried and at least one comparison is required."""
    from torch.distributed._tools.ilp_utils import parse_module_info
    from torch.distributed._tools.sac_ilp import sac_milp

    from solver.plan_cost import module_recompute_ms

    info = module_info_from_torch_dict(real_dict)
    acm = {s["fqn"]: max(s["sac_memory"], s["act_fw_per_module"]) for s in real_dict["mod_stats"]}
    compared = 0
    lo = min_reachable_peak_bytes(info)
    budgets = [int(f * info.peak_bytes) for f in (0.95, 0.85)]
    budgets += [int(lo + f * (info.peak_bytes - lo)) for f in (0.75, 0.5, 0.25)]
    for budget in sorted({b for b in budgets if b >= lo}, reverse=True):
        ours = solve_milp(info, budget)
        assert torch_peak(real_dict, dict(ours.discarded_bytes)) <= budget
        theirs, _, _ = sac_milp(parse_module_info(copy.deepcopy(real_dict)), budget / 2**30)
        theirs_d = {f: max(0, round(acm[f] * r - (acm[f] - info.stats(f).sac_memory_bytes)))
                    for f, r in theirs.items()}
        if theirs and predict_peak_bytes(info, theirs_d) <= budget:
            their_ms = sum(module_recompute_ms(info.stats(f), d) for f, d in theirs_d.items())
            assert ours.recompute_ms <= their_ms + 1e-9
            compared += 1
    assert compared >= 1, compared
