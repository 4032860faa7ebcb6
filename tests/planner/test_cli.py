"""planner/cli.py (run as ``python -m planner.apply``): the command line, end to end on a small model, and its errors."""

from __future__ import annotations

import importlib
import json
import pickle
import re
import sys
import textwrap

import pytest

from planner.cli import load_callable, main
from planner.plan import ModulePlan, Plan, model_fingerprint
from planner.format import fmt_bytes
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep

_USER_MODULE = '''
import torch
from torch import nn

CALLS = []


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.body(x))


def make():
    torch.manual_seed(0)
    return Net(), (torch.randn(64, 32),)


def my_loss(output, inputs):
    CALLS.append(1)
    return output.square().mean()


class Sneaky(nn.Module):
    """Reads Python state its parent changes after calling it: a recompute sees another value."""

    def __init__(self, setting):
        super().__init__()
        self.setting, self.lin = setting, nn.Linear(32, 64)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.setting["scale"])


class SneakyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.setting = {"scale": 1.0}
        self.a, self.b = Sneaky(self.setting), nn.Linear(64, 1)

    def forward(self, x):
        self.setting["scale"] = 1.0
        h = self.a(x)
        self.setting["scale"] = 2.0
        return self.b(h)


def sneaky():
    torch.manual_seed(0)
    return SneakyNet(), (torch.randn(256, 32),)


def raises():
    raise RuntimeError("no GPU here")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "i10_user_models.py").write_text(textwrap.dedent(_USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "i10_user_models"
    sys.modules.pop("i10_user_models", None)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.slow
def test_cli_plans_applies_checks_gradients_and_measures(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gradients        bitwise EQUAL: loss and 23 parameter gradients compared" in text
    plan = Plan.load(out)
    assert plan.modules
    # The printed plan is the saved one, and the steady-state steps measured its peak to the byte.
    assert f"SAC plan for ConvNet on cpu (world_size 1)\n  budget           {fmt_bytes(plan.budget_bytes)}" in text
    peak = f"{fmt_bytes(plan.predicted_peak_bytes):>10} ({plan.predicted_peak_bytes:>11,} B)"
    assert f"  predicted peak   {fmt_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes:,} B)" in text
    assert f"     2  {peak}        +0.00%            within" in text
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    measured, predicted = d["measured"]["peak_bytes"], d["plan"]["predicted_peak_bytes"]
    assert measured == predicted  # to the byte on convnet_demo (measured error 0 B)
    assert measured <= d["plan"]["budget_bytes"]
    g = d["gradient_check"]
    assert g["equal"] is True and g["n_params_compared"] == 23 and g["max_abs_diff"] == 0.0


def test_cli_names_a_loss_function(user_module, capsys):
    assert main(["--model", f"{user_module}:make", "--loss-fn", f"{user_module}:my_loss", "--quiet",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert sys.modules[user_module].CALLS  # traced, checked and measured with it
    assert d["gradient_check"]["equal"] is True and d["gradient_check"]["n_params_compared"] == 6


def test_cli_reports_gradients_that_differ_and_exits_1(user_module, tmp_path, capsys):
    model, _ = importlib.import_module(user_module).sneaky()
    plan = Plan(
        modules=(ModulePlan(fqn="SneakyNet.a", discard_ratio=1.0, full=True),), model_name="SneakyNet",
        model_fingerprint=model_fingerprint(model), device="cpu", world_size=1, budget_bytes=2**30,
        reserve_bytes=0, predicted_peak_bytes=1, solver_peak_bytes=1, baseline_peak_bytes=1,
        recompute_ms=0.0, baseline_step_ms=0.0,
    )
    plan.save(tmp_path / "sneaky.json")
    code = main(["--model", f"{user_module}:sneaky", "--quiet", "--plan-in", str(tmp_path / "sneaky.json")])
    captured = capsys.readouterr()
    assert code == 1
    assert "gradients        DIFFERENT" in captured.out and "a.lin.weight" in captured.out
    assert "check failed: the planned step's loss or gradients differ" in captured.err


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "inf", "-inf", "lots", "1e400"])
def test_cli_bad_budget_names_budget_gib(bad, capsys):
    assert main(["--model", "examples:convnet_demo", "--quiet", f"--budget-gib={bad}"]) == 2
    line = _error_line(capsys)
    assert "--budget-gib" in line and "positive, finite number of GiB" in line and "reserve" not in line


@pytest.mark.parametrize("argv, message", [
    (["--reserve-gib", "-1"], "--reserve-gib: must be a finite number of GiB >= 0"),
    (["--reserve-gib", "nan"], "--reserve-gib: must be a finite number of GiB >= 0"),
    (["--budget-gib", "0.01", "--reserve-gib", "0.02"], r"--reserve-gib \(0.02\) must be below --budget-gib"),
    (["--budget-gib", "0.5", "--device", "h100"], "--budget-gib 0.5 leaves nothing once the default reserve for h100"),
    (["--world-size", "0"], r"--world-size: must be an integer in \[1, 1,048,576\]"),
    (["--budget-gib", "120", "--device", "h100"], "--budget-gib 120 GiB is more than the h100's 80 GiB"),
    (["--time-limit-s", "0"], "--time-limit-s: must be a positive"),
    (["--optimizer", "lion"], "--optimizer must be adam, adamw, sgd or none"),
    (["--micro-batches", "0"], r"--micro-batches: must be an integer in \[1, 1,048,576\]"),
    (["--autocast", "fp8"], "--autocast: invalid choice"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--plan-in", "/nonexistent/plan.json"], "--plan-in /nonexistent/plan.json: cannot read it"),
    (["--plan-in", "p.json", "--budget-gib", "1"], "--budget-gib has no effect with --plan-in"),
    (["--model", "examples:nope"], "has no callable 'nope' for --model.*gpt_demo"),
    # A typo gets the close name first, and only functions (not Callable, Factory, LossFn...).
    (["--model", "examples:llama_tin"], r"\(did you mean 'llama_tiny'\?\); functions there: llama_tiny, "),
    (["--model", "examples.gpt_demo"], "--model must look like MODULE:NAME"),
    (["--model", "no_such_pkg:f"], "cannot import module 'no_such_pkg' for --model"),
    (["--loss-fn", "examples"], "--loss-fn must look like MODULE:NAME"),
    (["--loss-fn", "examples:nope"], "no callable 'nope' for --loss-fn"),
])
def test_cli_bad_arguments_one_line_exit_2(argv, message, capsys):
    assert main(["--model", "examples:convnet_demo", "--quiet", "--no-verify", *argv]) == 2
    assert re.search(message, _error_line(capsys))


def test_cli_factory_errors_one_line(user_module, capsys):
    assert main(["--model", f"{user_module}:raises", "--quiet"]) == 2
    assert "the factory raised RuntimeError: no GPU here" in _error_line(capsys)
    assert main(["--model", f"{user_module}:CALLS", "--quiet"]) == 2
    assert "no callable 'CALLS'" in _error_line(capsys)
    assert main(["--model", f"{user_module}:my_loss", "--quiet"]) == 2  # needs arguments
    assert "the factory raised TypeError" in _error_line(capsys)


@pytest.mark.slow
def test_cli_infeasible_budget_is_one_line_and_debug_shows_the_traceback(capsys):
    from planner import PlanningError

    argv = ["--model", "examples:convnet_demo", "--quiet", "--budget-gib", "0.001"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "infeasible" in line and "smallest budget this model can reach is" in line and "To go lower" in line
    with pytest.raises(PlanningError):
        main([*argv, "--debug"])


def test_cli_plan_for_another_model_and_bad_plan_files(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-out", str(out), "--no-verify"]) == 0
    capsys.readouterr()
    assert main(["--model", "examples:gpt_demo", "--quiet", "--plan-in", str(out)]) == 2
    assert "made for ConvNet" in _error_line(capsys)
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps({"kind": "sac_planner.Plan"}))
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(tmp_path / "plan.pkl")]) == 2
    assert "is a Python pickle, not a JSON plan" in _error_line(capsys)
    d = json.loads(out.read_text())
    d["modules"][0]["discard_ratio"] = float("nan")
    out.write_text(json.dumps(d))
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out)]) == 2
    assert "discard_ratio must be in [0, 1], got nan" in _error_line(capsys)


@pytest.mark.slow
def test_cli_plans_the_loop_it_is_told(capsys):
    # Gradient accumulation and autocast reach the trace, the plan's notes and the 3 real steps.
    assert main(["--model", "examples:convnet_demo", "--quiet", "--json", "--micro-batches", "2",
                 "--autocast", "bf16", "--optimizer", "adamw"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "2 micro-batch(es)" in out["plan"]["notes"][0] and "autocast bfloat16" in out["plan"]["notes"][0]
    steps = out["measured_steps"]
    assert len(steps) == 3
    assert max(s["peak_bytes"] for s in steps) <= out["plan"]["budget_bytes"] - out["plan"]["reserve_bytes"]


@pytest.mark.slow
def test_cli_keep_output_reaches_the_trace_the_check_and_the_measured_steps(capsys):
    # --keep-output: the loop holds the output through backward; the plan says so and the
    # measured steps (which hold it too) meet the prediction to the byte.
    assert main(["--model", "examples:convnet_demo", "--quiet", "--json", "--keep-output"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["notes"][0].endswith("output kept through backward")
    assert out["gradient_check"]["equal"] is True
    assert out["measured"]["peak_bytes"] == out["plan"]["predicted_peak_bytes"]


@pytest.mark.multiproc
def test_python_m_planner_apply_runs_the_cli():
    """planner/apply.py is only the entry point: ``python -m planner.apply`` must reach cli.main
    (a bad flag is answered by cli's parser: its prog name and exit status 2)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "planner.apply", "--optimizer", "lion"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --optimizer must be adam, adamw, sgd or none, got 'lion'"]


@pytest.mark.multiproc
def test_python_m_planner_runs_the_cli():
    """``python -m planner`` is what a newcomer types first: it must be the same command as
    ``python -m planner.apply``, not Python's "No module named planner.__main__" (a bad flag is
    answered by cli's parser with exit status 2, as there)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "planner", "--optimizer", "lion"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --optimizer must be adam, adamw, sgd or none, got 'lion'"]


@pytest.mark.multiproc
def test_offload_plans_applies_and_checks_host_bytes():
    """``--offload``: a keep / recompute / offload plan for llama_tiny (2 micro-batches), applied
    and verified in a subprocess: bitwise gradients, measured peak, host bytes per step (two
    micro-batches: twice what is on host at once), the step timeline printed."""
    import subprocess
    from pathlib import Path

    from estimators import estimate
    from estimators.step.train_step import TrainStep
    from examples import EXAMPLES
    from solver import SACMilp

    model, inputs = EXAMPLES["llama_tiny"]()
    info = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw",
                                          micro_batches=2), device="cpu").module_info
    low = SACMilp(info).min_reachable_peak_bytes()
    budget_gib = (low + 0.9 * (info.peak_bytes - low)) / 2**30
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "planner.apply", "--model", "examples:llama_tiny", "--offload",
           "--host-budget-gib", "0.5", "--optimizer", "adamw", "--micro-batches", "2",
           "--budget-gib", f"{budget_gib:.9f}", "-q"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr  # 1 if gradients, peak or host bytes were off
    out = proc.stdout
    assert "bitwise EQUAL" in out
    assert re.search(r"offload \d+ ops \([\d.]+ KiB\) to host", out), out
    assert "step timeline" in out and "exposed copies" in out
    at_once, per_step = re.search(r"host memory +([\d.]+) KiB of offloaded activations at once "
                                  r".*one micro-batch, ([\d.]+) KiB copied per step", out).groups()
    assert float(per_step) == 2 * float(at_once) > 0
    measured, predicted = re.search(r"host copies .*\(([\d,]+) B\) per step to host memory, "
                                    r"predicted ([\d,]+) B: as predicted", out).groups()
    assert measured == predicted
    errs = [float(e) for e in re.findall(r"^ +[23] .*?([+-]\d+\.\d+)%", out, flags=re.M)]
    assert len(errs) == 2 and all(abs(e) <= 3 for e in errs), out  # steady steps vs predicted


def test_offload_flags_refused_where_they_do_nothing(capsys):
    assert main(["--host-budget-gib", "1", "--no-verify"]) == 2
    assert "--host-budget-gib only applies with --offload" in capsys.readouterr().err
    assert main(["--offload", "--host-budget-gib", "-1"]) == 2
    assert "--host-budget-gib: must be a positive" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_in_runs_the_step_the_plan_was_made_for_and_refuses_another(tmp_path, capsys, caplog):
    # A plan made for a loop that keeps the output: --plan-in without --keep-output runs that loop
    # (the measured peak meets the prediction to the byte; run with the output dropped it measured
    # 1,280 B under it), and a flag that asks for another step is refused, naming both.
    out = tmp_path / "kept.json"
    assert main(["--model", "examples:convnet_demo", "--quiet", "--keep-output", "--no-verify",
                 "--plan-out", str(out)]) == 0
    capsys.readouterr()
    assert Plan.load(out).step.keep_output is True
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gradient_check"]["equal"] is True
    assert d["measured"]["peak_bytes"] == d["plan"]["predicted_peak_bytes"]
    for flags, message in [(["--no-keep-output"], "--no-keep-output: the plan in .* was made for a step with "
                                                   "--keep-output, so its peaks do not hold for this one; drop --no-keep-output"),
                           (["--micro-batches", "2"], "--micro-batches 2: .* step with --micro-batches 1"),
                           (["--optimizer", "SGD"], "--optimizer sgd: .* step with --optimizer adam"),
                           (["--autocast", "bf16"], "--autocast bf16: .* step with --autocast none")]:
        assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), *flags]) == 2
        assert re.search(message, _error_line(capsys)), flags
    # The same flags as the plan's are fine; a file that does not record its step is run with the
    # flags, with a warning that says so.
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--keep-output",
                 "--optimizer", "adam", "--no-verify"]) == 0
    d = json.loads(out.read_text())
    del d["step"]
    out.write_text(json.dumps(d))
    capsys.readouterr()
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--no-verify"]) == 0
    assert "does not record the training step it was made for" in caplog.text


def test_cli_budget_in_bytes_gets_the_gib_figure(capsys):
    assert main(["--model", "examples:convnet_demo", "--quiet", "--budget-gib", "80000000000"]) == 2
    line = _error_line(capsys)
    assert "--budget-gib is in GiB" in line and "--budget-gib=74.51" in line


def test_plan_in_checks_the_model_first_and_refuses_flags_it_ignores(tmp_path, capsys):
    # With --no-verify a plan for another model was printed with exit 0 (no fingerprint check
    # ran), and --world-size / --reserve-gib / --mode / --time-limit-s were silently ignored.
    out = tmp_path / "gpt.json"
    assert main(["--model", "examples:gpt_tiny", "--quiet", "--no-verify", "--plan-out", str(out)]) == 0
    capsys.readouterr()
    for verify in ("--no-verify", "--verify"):
        assert main(["--model", "examples:convnet_tiny", "--quiet", "--plan-in", str(out), verify]) == 2
        err = capsys.readouterr().err
        assert re.search(r"the plan was made for GPT \(fingerprint \w+\), not this ConvNet", err)
    for flag in (["--world-size", "4"], ["--reserve-gib", "0.5"], ["--mode", "real"], ["--time-limit-s", "5"]):
        assert main(["--model", "examples:gpt_tiny", "--quiet", "--plan-in", str(out), "--no-verify", *flag]) == 2
        assert f"{flag[0]} has no effect with --plan-in" in capsys.readouterr().err
    assert main(["--model", "examples:gpt_tiny", "--quiet", "--plan-in", str(out), "--no-verify"]) == 0


@pytest.mark.slow
def test_plan_in_checks_the_plan_for_the_device_it_was_made_for(tmp_path, capsys):
    # --plan-in verified against --device: a cpu plan re-checked "for h100" skipped its budget
    # check (and passed a step 3.17 % over), an h100 plan re-checked without --device failed.
    out = tmp_path / "h100.json"
    assert main(["--model", "examples:convnet_demo", "--quiet", "--device", "h100", "--no-verify",
                 "--plan-out", str(out)]) == 0
    capsys.readouterr()
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--device", "cpu"]) == 2
    line = _error_line(capsys)
    assert "--device cpu: the plan in" in line and "was made for h100" in line
    assert main(["--model", "examples:convnet_demo", "--quiet", "--plan-in", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "plan made for h100 but verified on this CPU" in report["note"]


@pytest.mark.slow
def test_a_per_rank_plan_verified_in_one_process_is_not_compared(capsys):
    # --world-size 2: the per-rank figure was compared with an unsharded step: "+28.00% ABOVE",
    # exit 1, "check failed".
    assert main(["--model", "examples:convnet_demo", "--quiet", "--json", "--world-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "per rank for 2 ranks" in report["note"] and report["gradient_check"]["equal"]


@pytest.mark.slow
def test_plan_in_of_a_plan_for_a_devicespec_of_the_users_own(tmp_path, capsys):
    # The plan's device is no name the command line knows: it was refused as "--autocast none:
    # unknown device 'my-cpu'", and --device could not be given either. It is checked as --device.
    import dataclasses as dc

    from estimators.runtime.device import get_device_spec
    from examples.convnet import convnet_loss, convnet_tiny
    from planner import solve_sac

    model, inputs = convnet_tiny()
    spec = dc.replace(get_device_spec("cpu"), name="my-cpu")
    plan = solve_sac(model, options=PlanOptions(device=spec), budget_gib=0.0028, step=TrainStep(inputs=inputs, loss_fn=convnet_loss, optimizer="adam"))
    out = tmp_path / "custom.json"
    plan.save(out)
    assert main(["--model", "examples:convnet_tiny", "--quiet", "--plan-in", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gradient_check"]["equal"] and "note" not in report


def test_a_model_module_in_the_current_directory_imports_as_with_python_m(tmp_path, monkeypatch):
    # The `sac-plan` console script starts without the current directory on sys.path.
    (tmp_path / "mymodels_here.py").write_text("def make():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodels_here", raising=False)
    assert load_callable("mymodels_here:make", "--model", "examples:gpt_demo")() == 42


@pytest.mark.slow
def test_several_ranks_plan_per_rank_with_fsdp_units_and_precision(capsys):
    # With --world-size 8 the default budget was halfway to the one-process peak (1.28 MiB for a
    # per-rank no-AC peak of 974.72 KiB): nothing to plan. FSDP2's units and mixed precision had no flag.
    assert main(["--model", "examples:llama_tiny", "--quiet", "--json", "--no-verify", "--world-size", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["budget_bytes"] < plan["baseline_peak_bytes"] and plan["modules"]
    assert main(["--model", "examples:llama_tiny", "--quiet", "--json", "--no-verify", "--world-size", "8",
                 "--fsdp-units", "Llama, Llama.layers.*", "--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["layout"]["fsdp_units"] == ["Llama", "Llama.layers.0", "Llama.layers.1"]
    assert plan["budget_bytes"] < plan["baseline_peak_bytes"] and plan["modules"]
    assert "FSDP2 mixed precision: parameters gathered in bfloat16, gradients reduced in float32" in plan["notes"]
    for argv, says in ((["--fsdp-units", "Llama,Llama.layer.*"], "'Llama.layer.*' names no module of the traced model"),
                       (["--fsdp-param-dtype", "bf16"], "add --fsdp-units")):
        assert main(["--model", "examples:llama_tiny", "--quiet", "--no-verify", "--world-size", "8", *argv]) == 2
        assert says in _error_line(capsys)
