"""Plan files from anywhere (planner/plan.py, planner/safe_io.py): truncated, every field mutated,
random bytes changed, odd file types. Each is a valid plan or one short line of PlanFormatError,
quickly; a plan that loads is applied or refused, and the model is left as it was."""

from __future__ import annotations

import json
import os
import pickle
import random
import threading
import time
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from planner import PlanFormatError, apply_plan, remove_plan
from planner.plan import ModulePlan, Plan, StepRecord, model_fingerprint

_MAX_CASE_S = 5.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _plan(model: nn.Module) -> Plan:
    return Plan(
        modules=(ModulePlan(fqn="Sequential.0", discard_ratio=1.0, full=True, discarded_bytes=512,
                            recompute_ms=0.01, input_numel=64),
                 ModulePlan(fqn="Sequential.2", discard_ratio=0.5, full=False,
                            saved_ops=(("aten.addmm.default", 0),), recomputed_ops=(("aten.t.default", 0),),
                            discarded_bytes=128, recompute_ms=0.002, input_numel=128)),
        model_name="Sequential", model_fingerprint=model_fingerprint(model), device="cpu", world_size=1,
        budget_bytes=100_000, reserve_bytes=0, predicted_peak_bytes=9_000, solver_peak_bytes=9_100,
        baseline_peak_bytes=10_000, recompute_ms=0.012, baseline_step_ms=0.5, solver_status="optimal",
        notes=("a note",), first_step_peak_bytes=9_000, steady_peak_bytes=8_000, trainable_numel=212,
        step=StepRecord(optimizer="adamw", micro_batches=1, zero_grad="set_to_none", autocast="none",
                        keep_output=False))


_HOSTILE: list[Any] = [
    None, True, False, -1, 0, 1, 7, 2**31, 2**53, 10**30, -0.5, 0.5, 1.5, 1e300, float("nan"),
    float("inf"), "", "x" * 5000, "aten.mm.default", "Sequential.9", [], [[]], [["aten.mm.default", 0]],
    [["nope", -1]], {}, {"a": 1}, [1] * 50, [[[[[[1]]]]]],
]


def _paths(x: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every place in the JSON tree: dict keys and list indices, depth first."""
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, path + (i,))


def _set(d: Any, path: tuple, value: Any) -> Any:
    d = json.loads(json.dumps(d))
    if not path:
        return value
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return d


def _delete(d: Any, path: tuple) -> Any:
    d = json.loads(json.dumps(d))
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    return d


def _texts(plan: Plan) -> Iterator[tuple[str, bytes]]:
    text = plan.to_json()
    d = json.loads(text)
    raw = text.encode()
    for k in range(0, len(raw), 7):
        yield f"truncated at {k}", raw[:k]
    for path in _paths(d):
        for i, v in enumerate(_HOSTILE):
            yield f"{path} = hostile[{i}]", json.dumps(_set(d, path, v)).encode()
        if path:
            yield f"{path} deleted", json.dumps(_delete(d, path)).encode()
        parent = d
        for k in path:
            parent = parent[k]
        if isinstance(parent, dict):
            yield f"{path} + unknown key", json.dumps(_set(d, path + ("zz",), 1)).encode()
    rng = random.Random(33)
    for i in range(300):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            op, at = rng.randrange(3), rng.randrange(len(b))
            if op == 0:
                b[at] = rng.randrange(256)
            elif op == 1:
                b.insert(at, rng.choice(b'[]{}",:0123456789-.eE \\ntrufalsn'))
            else:
                del b[at]
        yield f"random bytes {i}", bytes(b)
    yield "empty", b""
    yield "utf-8 BOM", b"\xef\xbb\xbf" + raw
    yield "utf-16", text.encode("utf-16")
    yield "pickle", pickle.dumps(d)
    yield "gzip magic", b"\x1f\x8b\x08\x00" + raw[:50]
    yield "a JSON list", b"[1, 2, 3]"
    yield "a JSON string", b'"plan"'


def _state(model: nn.Module) -> tuple:
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    return model_fingerprint(model), sd, tuple(type(m).forward for m in model.modules())


def _same_model(model: nn.Module, before: tuple) -> None:
    fp, sd, forwards = _state(model)
    assert fp == before[0] and forwards == before[2]
    assert sd.keys() == before[1].keys() and all(torch.equal(sd[k], before[1][k]) for k in sd)
    assert remove_plan(model) == 0  # nothing left applied


def _check_one(path, model: nn.Module, before: tuple, limit_s: float = _MAX_CASE_S) -> str:
    """'loaded', 'refused' or 'applied'; fails the test on anything else."""
    t0 = time.monotonic()
    try:
        plan = Plan.load(path)
    except PlanFormatError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) < 1000, msg[:300]
        outcome = "refused"
    else:
        assert len(plan.summary()) < 100_000
        try:
            with apply_plan(model, plan):
                model(torch.randn(4, 8)).sum().backward()
            outcome = "applied"
        except (PlanFormatError, ValueError, RuntimeError) as e:  # PlanMismatchError is a ValueError
            assert "\n" not in str(e), str(e)[:300]
            outcome = "loaded"
        model.zero_grad(set_to_none=True)
        _same_model(model, before)
    assert time.monotonic() - t0 < limit_s
    return outcome


@pytest.mark.slow
def test_fuzzed_plan_files_load_or_are_refused_in_one_line(tmp_path):
    model = _model()
    before = _state(model)
    plan = _plan(model)
    p = tmp_path / "plan.json"
    plan.save(p)
    # The unmutated plan works (the first apply imports and sets up: not timed).
    assert _check_one(p, model, before, limit_s=float("inf")) == "applied"
    outcomes: dict[str, int] = {}
    for name, data in _texts(plan):
        p.write_bytes(data)
        try:
            outcome = _check_one(p, model, before)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from None
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert sum(outcomes.values()) > 1000 and outcomes["refused"] > 900, outcomes


def test_odd_file_types_are_refused_at_once(tmp_path):
    model = _model()
    before = _state(model)
    plan_path = tmp_path / "plan.json"
    _plan(model).save(plan_path)
    assert _check_one(plan_path, model, before, limit_s=float("inf")) == "applied"
    cases = {"a directory": tmp_path / "d"}
    cases["a directory"].mkdir()
    os.mkfifo(tmp_path / "fifo")
    cases["a FIFO"] = tmp_path / "fifo"
    for name, target in (("a character device", "/dev/zero"), ("a character device", "/dev/null")):
        link = tmp_path / f"link-{os.path.basename(target)}"
        link.symlink_to(target)
        cases[f"{name} ({target})"] = link
    for name, path in cases.items():
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(outcome=_check_one(path, model, before)), daemon=True)
        t.start()
        t.join(_MAX_CASE_S)
        assert done.get("outcome") == "refused", f"{name}: {done or 'still running'}"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        Plan.load(dangling)
