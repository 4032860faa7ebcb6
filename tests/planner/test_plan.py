"""planner/plan.py: versioned JSON, fingerprints, the summary."""

from __future__ import annotations

import json

import pytest

from examples import EXAMPLES
from planner import PlanFormatError, apply_plan
from planner.plan import Plan, model_fingerprint
from tests.planner.conftest import budgets, plan_at


@pytest.fixture(scope="module")
def plan() -> Plan:
    return plan_at("gpt_demo", budgets("gpt_demo", 3)[1])


def test_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan


def test_corrupt_newer_and_foreign_files(plan, tmp_path):
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.load(p)
    d = plan.to_dict()
    d["version"] = 7
    p.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match="newer than this SAC Planner"):
        Plan.load(p)
    p.write_text(json.dumps({"kind": "something.else"}))
    with pytest.raises(PlanFormatError, match="not a SAC Planner plan"):
        Plan.load(p)
    d = plan.to_dict()
    del d["modules"][0]["fqn"]
    p.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match="corrupt plan"):
        Plan.load(p)


def test_fingerprint_ignores_values_and_device_but_not_shapes():
    a, _ = EXAMPLES["gpt_demo"]()
    b, _ = EXAMPLES["gpt_demo"](device="meta")
    c, _ = EXAMPLES["gpt_small"]()
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(c)


def test_loaded_plan_applies(plan, tmp_path):
    plan.save(tmp_path / "p.json")
    model, _ = EXAMPLES["gpt_demo"]()
    with apply_plan(model, Plan.load(tmp_path / "p.json")) as h:
        assert len(h.modules) == len(plan.modules) > 0


def test_summary_lists_every_checkpointed_module(plan):
    text = plan.summary()
    assert all(m.fqn in text for m in plan.modules)
    assert "peak, planned" in text and "recompute" in text
