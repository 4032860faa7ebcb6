"""Plan files from anywhere (planner/plan.py, planner/safe_io.py): truncated, every field mutated,
random bytes changed, odd file types. Each is a valid plan or one short line of PlanFormatError,
quickly; a plan that loads is applied or refused, and the model is left as it was. A pipeline
stage's plan and a parallel layout's are mutated field by field too, and their records are drawn
by hypothesis: one that loads is a pipeline ``Pipeline`` takes (its rank's stages, its split
backward) or a layout a model can have."""

from __future__ import annotations

import json
import os
import pickle
import random
import threading
import time
from typing import Any, Iterator

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from estimators.pipeline.schedule import SCHEDULES
from planner import PlanFormatError, apply_plan, remove_plan
from planner.distributed.layout import LayoutRecord
from planner.plan import ModulePlan, Plan, StepRecord, model_fingerprint
from planner.plan_pipeline import PipelineRecord

_MAX_CASE_S = 5.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


_EXTRAS = {
    "plain": {},
    "pipeline": {"pipeline": PipelineRecord(schedule="ScheduleInterleaved1F1B", n_microbatches=8, stage_index=1,
                                            n_stages=4, virtual_stages=2, rank_stages=(1, 3), fw_ms=1.0, bw_ms=2.0,
                                            optim_ms=0.5, makespan_ms=30.0, bubble_fraction=0.25)},
    "layout": {"layout": LayoutRecord(fsdp_world_size=8, fsdp_units=("Sequential", "Sequential.0")), "world_size": 8},
}
"""A single-process plan, a pipeline stage's (applied to the bare stage module), an FSDP layout's
(applied before fully_shard, as torchtitan does)."""


def _plan(model: nn.Module, kind: str = "plain") -> Plan:
    return dataclasses.replace(_plain_plan(model), **_EXTRAS[kind])


def _plain_plan(model: nn.Module) -> Plan:
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


def _texts(plan: Plan, every: int = 7, n_random: int = 300) -> Iterator[tuple[str, bytes]]:
    text = plan.to_json()
    d = json.loads(text)
    raw = text.encode()
    for k in range(0, len(raw), every):
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
    for i in range(n_random):
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
@pytest.mark.parametrize("kind", list(_EXTRAS))
def test_fuzzed_plan_files_load_or_are_refused_in_one_line(tmp_path, kind):
    model = _model()
    before = _state(model)
    plan = _plan(model, kind)
    p = tmp_path / "plan.json"
    plan.save(p)
    # The unmutated plan works (the first apply imports and sets up: not timed).
    assert _check_one(p, model, before, limit_s=float("inf")) == "applied"
    outcomes: dict[str, int] = {}
    # Truncation and random bytes test the reader, the same for every kind: the others get fewer.
    for name, data in _texts(plan, *((7, 300) if kind == "plain" else (31, 60))):
        p.write_bytes(data)
        try:
            outcome = _check_one(p, model, before)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from None
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert sum(outcomes.values()) > 1000 and outcomes["refused"] > 900, outcomes
    assert outcomes["applied"] > 50, outcomes  # mutations the plan survives are applied and trained


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


_HOSTILE_FIELD = (st.integers(-2, 12) | st.sampled_from([0, 2**31, 10**30, True, 1.5, "", "x" * 5000]) | st.none()
                  | st.lists(st.integers(-1, 12), max_size=3))


@st.composite
def _pipeline_fields(draw) -> dict:
    """A record as the planner writes it, then at most two fields replaced by anything."""
    schedule = draw(st.sampled_from(SCHEDULES))
    virtual = 1 if schedule in ("ScheduleGPipe", "Schedule1F1B") else draw(st.sampled_from([1, 2]))
    n_stages = virtual * draw(st.sampled_from([1, 2, 3, 4]))
    d = {"schedule": schedule, "n_microbatches": draw(st.integers(1, 12)), "n_stages": n_stages,
         "virtual_stages": virtual, "stage_index": draw(st.integers(0, n_stages - 1)), "rank_stages": [],
         "split_backward": schedule == "ScheduleInterleavedZeroBubble", "return_outputs": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted(d)), max_size=2, unique=True)):
        d[name] = draw(_HOSTILE_FIELD | st.sampled_from(SCHEDULES + ("ScheduleZBVZeroBubble", "os.system", "torch")))
    return d


@pytest.mark.slow
@pytest.mark.property
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(d=_pipeline_fields())
def test_a_pipeline_record_that_loads_is_a_pipeline_the_planner_takes(d):
    from estimators.pipeline.schedule import schedule_class
    from planner.options import Pipeline

    try:
        rec = PipelineRecord.from_dict(d)
    except PlanFormatError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) < 600, str(e)[:300]
        return
    layout = Pipeline(schedule_class(rec.schedule), n_microbatches=rec.n_microbatches, stage_index=rec.stage_index,
                      n_stages=rec.n_stages, virtual_stages=rec.virtual_stages).layout
    assert rec.rank_stages == layout.stages_of(layout.rank_of(rec.stage_index))
    assert rec.split_backward == layout.split_backward
    assert PipelineRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec


@st.composite
def _layout_fields(draw) -> dict:
    tp = draw(st.booleans())
    d = {"meshes": ["tp=2"] if tp else [], "placements": "0123456789abcdef" if tp else "",
         "dtensor_parameters": draw(st.integers(1, 100)) if tp else 0, "fsdp_world_size": draw(st.integers(1, 64)),
         "fsdp_units": draw(st.lists(st.sampled_from(["Sequential", "Sequential.0", "Sequential.2"]), unique=True))}
    for name in draw(st.lists(st.sampled_from(sorted(d)), max_size=2, unique=True)):
        d[name] = draw(_HOSTILE_FIELD | st.lists(st.sampled_from(["tp=2", "", "x" * 5000, "a"]), max_size=3))
    return d


@pytest.mark.slow
@pytest.mark.property
@settings(max_examples=300, deadline=None, derandomize=True)
@given(d=_layout_fields())
def test_a_layout_record_that_loads_is_a_layout_a_model_can_have(d):
    try:
        rec = LayoutRecord(**d)
    except PlanFormatError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) < 600, str(e)[:300]
        return
    assert bool(rec.meshes) == bool(rec.placements) == (rec.dtensor_parameters > 0)
    assert 1 <= rec.fsdp_world_size <= 2**20 and all(rec.fsdp_units) and len(rec.describe()) < 20_000
    assert LayoutRecord(**dataclasses.asdict(rec)) == rec
