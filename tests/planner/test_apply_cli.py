"""planner/apply.py: the command line, end to end on a small model."""

from __future__ import annotations

import json

import pytest

from planner.apply import main
from planner.plan import Plan


def test_cli_plans_applies_and_measures(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SAC plan for ConvNet" in text and "measured peak" in text and "predicted peak" in text
    plan = Plan.load(out)
    assert plan.modules
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    measured, predicted = d["measured"]["peak_bytes"], d["plan"]["predicted_peak_bytes"]
    assert abs(measured - predicted) <= 0.05 * predicted
    assert measured <= d["plan"]["budget_bytes"]


def test_cli_unknown_factory_and_bad_spec():
    with pytest.raises(SystemExit, match="has no factory 'nope'.*gpt_demo"):
        main(["--model", "examples:nope", "--quiet"])
    with pytest.raises(SystemExit, match="MODULE:FACTORY"):
        main(["--model", "examples.gpt_demo", "--quiet"])
    with pytest.raises(SystemExit, match="cannot import module"):
        main(["--model", "no_such_pkg:f", "--quiet"])


def test_cli_plan_for_another_model(tmp_path):
    out = tmp_path / "plan.json"
    main(["--model", "examples:convnet_demo", "--quiet", "--plan-out", str(out), "--no-verify"])
    from planner import PlanMismatchError

    with pytest.raises(PlanMismatchError, match="made for ConvNet"):
        main(["--model", "examples:gpt_demo", "--quiet", "--plan-in", str(out)])
