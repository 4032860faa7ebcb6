"""estimators/contract/module_info.py: JSON round trip, format errors, the exact curve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimators.tracing.estimation import estimate
from estimators.contract.module_info import MemoryPoint, ModuleInfo, ModuleInfoFormatError, Phase, TradeoffCurve
from examples import EXAMPLES
from estimators.step.train_step import TrainStep

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def info() -> ModuleInfo:
    model, inputs = EXAMPLES["gpt_tiny"]()
    return estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="h100").module_info


@pytest.mark.slow
def test_json_round_trip_is_exact(info, tmp_path):
    path = tmp_path / "info.json"
    info.to_json(path)
    assert ModuleInfo.from_json(path) == info
    assert ModuleInfo.from_json(info.to_json()) == info


def test_newer_version_is_refused(info):
    d = json.loads(info.to_json())
    d["version"] = 99
    with pytest.raises(ModuleInfoFormatError, match="newer than this SAC Planner"):
        ModuleInfo.from_dict(d)


def test_foreign_and_corrupt_files(info, tmp_path):
    with pytest.raises(ModuleInfoFormatError, match="not a SAC Planner ModuleInfo"):
        ModuleInfo.from_dict({"mod_order": {}, "mod_stats": []})
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "sac_planner.ModuleInfo", "version": 1, "mod_stats": [')
    with pytest.raises(ModuleInfoFormatError, match="does not parse"):
        ModuleInfo.from_json(bad)
    d = json.loads(info.to_json())
    del d["mod_stats"][0]["fqn"]
    with pytest.raises(ModuleInfoFormatError, match="corrupt"):
        ModuleInfo.from_dict(d)


def test_curve_validation_and_envelope():
    with pytest.raises(ValueError, match="start at"):
        TradeoffCurve(discarded_bytes=(10, 20), recompute_ms=(0.0, 1.0))
    c = TradeoffCurve(discarded_bytes=(0, 50, 100), recompute_ms=(0.0, 1.0, 4.0))
    # normalized points (0, 0), (0.5, 0.25), (1, 1)
    assert c.lower_convex_envelope() == [(0.5, 0.0), (1.5, -0.5)]
    assert c.recompute_ms_at(75) == 2.5
    assert c.recompute_ms_at(1000) == 4.0


def test_every_non_leaf_has_a_curve_and_memory_points_cover_the_peak(info):
    cands = [s for s in info.mod_stats if not s.is_leaf]
    assert cands and all(s.tradeoff.total_bytes == s.sac_memory_bytes for s in cands)
    assert max(p.total_bytes for p in info.memory_points) == info.peak_bytes


@pytest.mark.multiproc
def test_module_info_and_solver_import_without_torch():
    # A fresh interpreter: this one has torch loaded already. The solver promises never to import
    # torch, and ModuleInfo is its only input.
    code = (
        "import sys; import solver; from estimators.contract.module_info import ModuleInfo, Phase; "
        "import estimators; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_memory_point_phase_is_one_enum_and_json_keeps_the_string(info):
    assert all(isinstance(p.phase, Phase) for p in info.memory_points)
    d = json.loads(info.to_json())
    assert {p["phase"] for p in d["memory_points"]} <= {"fw", "bw", "optim"}
    with pytest.raises(ValueError, match="MemoryPoint.phase must be one of"):
        MemoryPoint(op_index=0, phase="forward")


@pytest.mark.multiproc
def test_package_names_stay_the_functions_after_their_modules_are_imported():
    # The import system binds a submodule as an attribute of its package once it is imported, so a
    # lazily exported name equal to a submodule's name would become that module (it did: the
    # function ``estimate`` lived in ``estimators/estimate.py``). A fresh interpreter, planner first.
    code = (
        "import planner, estimators.tracing.estimation, estimators.step.train_step, estimators.runtime.device; "
        "from estimators import estimate, TrainStep, get_device_spec; import inspect; "
        "assert all(inspect.isfunction(f) or inspect.isclass(f) for f in (estimate, TrainStep, get_device_spec))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    import estimators

    assert not {n for n in estimators.__all__ if n in _submodule_names()}


def _submodule_names() -> set[str]:
    return {p.stem for p in (ROOT / "estimators").glob("*.py")}
