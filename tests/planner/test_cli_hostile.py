"""planner/cli.py against hostile or careless input (issue 33): every plan file, model and loss
that cannot be planned or checked exits 2 with one line; summaries are of bounded size."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import textwrap

import pytest

from planner.cli import main

_MODULE = '''
import torch
from torch import nn


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


def no_params():
    return NoParams(), (torch.randn(4, 8, requires_grad=True),)


def nan_loss(output, inputs):
    return output.sum() * float("nan")
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "i33_user_models.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "i33_user_models"
    sys.modules.pop("i33_user_models", None)


_MODEL = "examples:convnet_demo"


@pytest.fixture
def plan_file(tmp_path, capsys):
    """A valid plan for ``_MODEL`` (the CLI's default budget checkpoints two modules)."""
    path = tmp_path / "plan.json"
    assert main(["--model", _MODEL, "--quiet", "--no-verify", "--plan-out", str(path)]) == 0
    capsys.readouterr()
    assert json.loads(path.read_text())["modules"]
    return path


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert len(err[0]) < 1000
    return err[0]


def _plan_in(path, *extra) -> int:
    return main(["--model", _MODEL, "--quiet", "--plan-in", str(path), *extra])


def _edited(path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("case, message", [
    ("deep", "nests arrays or objects deeper than the JSON reader goes"),                 # row 1
    ("digits", "holds a number beyond any field's range"),                                # row 2
    ("10**400", "budget_bytes must be in [1, 1,125,899,906,842,624]"),                   # row 3
    ("/dev/zero", "is a character device, not a regular file"),                          # row 4
    ("fifo", "is a FIFO (named pipe), not a regular file"),                               # row 5
    ("unknown op", "names 'aten.no_such_op.default', an op torch does not know"),         # row 7
    ("1,000,000 ops", "saved_ops lists 1,000,000 ops, more than the 100,000"),            # row 7
    ("70 MB note", "is larger than 67,108,864 bytes"),                                    # row 17 (200 MB there)
])
def test_hostile_plan_files_exit_2_with_one_line(plan_file, capsys, case, message):
    # Before: RecursionError / ValueError / OverflowError tracebacks (exit 1), reads of /dev/zero
    # and a FIFO that never ended, unknown ops and a million of them accepted (exit 0, 40 s),
    # a 200 MB note printed whole.
    path = plan_file.with_name("hostile.json")
    text = plan_file.read_text()
    budget = json.loads(text)["budget_bytes"]
    if case == "deep":
        path.write_text("[" * 100_000)
    elif case in ("digits", "10**400"):
        path.write_text(text.replace(f'"budget_bytes": {budget}', '"budget_bytes": '
                                     + ("9" * 5000 if case == "digits" else "1" + "0" * 400)))
    elif case == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "70 MB note":
        path.write_text(text[:-2] + ', "notes": ["' + "x" * 70_000_000 + '"]}')
    else:
        path.write_text(text)
        ops = ([["aten.no_such_op.default", 0]] if case == "unknown op"
               else [["aten.mm.default", i] for i in range(1_000_000)])
        _edited(path, lambda d: d["modules"][-1].update(full=False, saved_ops=ops, recomputed_ops=[],
                                                         offloaded_ops=[]))
    assert _plan_in(path, "--no-verify") == 2
    assert message in _error_line(capsys)


@pytest.mark.parametrize("fqn, what", [("ConvNet.stages.9", "is not a module of the model"),
                                       ("ConvNet.stem.conv.weight", "is a parameter or buffer, not a module")])
def test_no_verify_still_checks_the_module_names(plan_file, capsys, fqn, what):
    # Row 6. Before: printed as a plan, exit 0 (the fingerprint does not cover the module list).
    _edited(plan_file, lambda d: d["modules"][0].update(fqn=fqn))
    assert _plan_in(plan_file, "--no-verify") == 2
    assert f"plan module '{fqn}' {what}: the plan file was edited" in _error_line(capsys)


@pytest.mark.parametrize("verify", [[], ["--no-verify"]])
def test_a_model_without_parameters_is_one_line(user, capsys, verify):
    # Row 9. Before: exit 1 with measure_steps' traceback (exit 0 with --no-verify).
    assert main(["--model", f"{user}:no_params", "--quiet", "--budget-gib", "0.001", *verify]) == 2
    assert "NoParams has no parameters, so its step trains nothing" in _error_line(capsys)


def test_a_nan_loss_is_not_called_bitwise_equal(user, capsys):
    # Row 10. Before: "bitwise EQUAL ... max |diff| nan", exit 0.
    assert main(["--model", _MODEL, "--loss-fn", f"{user}:nan_loss", "--quiet"]) == 2
    assert "the loss is nan: a step on it trains nothing" in _error_line(capsys)


def test_the_summary_of_a_wordy_plan_is_bounded(plan_file, capsys):
    # Row 17: a note the file limits allow (100,000 characters) is printed up to 2,000.
    _edited(plan_file, lambda d: d.update(notes=["y" * 100_000] * 30))
    assert _plan_in(plan_file, "--no-verify") == 0
    out = capsys.readouterr().out
    assert len(out) < 60_000 and "(98,000 more characters)" in out and "... and 10 more notes" in out


def test_plan_out_on_a_full_disk_keeps_the_old_plan(plan_file, capsys):
    # Row 8. Before: the previous plan truncated, the JSON left half written.
    before = plan_file.read_bytes()
    _edited(plan_file, lambda d: d.update(notes=[]))  # a smaller file than the one to write
    small = plan_file.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(small) + 10, hard))
    try:
        code = main(["--model", _MODEL, "--quiet", "--no-verify", "--plan-out", str(plan_file)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert code == 2 and "cannot write it" in _error_line(capsys)
    assert plan_file.read_bytes() == small != before
    assert sorted(p.name for p in plan_file.parent.iterdir() if p.name.endswith(".tmp")) == []


def test_plan_out_to_a_directory_is_one_line(tmp_path, capsys):
    assert main(["--model", _MODEL, "--quiet", "--no-verify", "--plan-out", str(tmp_path)]) == 2
    assert "is a directory, not a regular file" in _error_line(capsys)


@pytest.mark.parametrize("field, value, verify, message", [
    ("layout", {"meshes": ["tp=2"], "placements": "0123456789abcdef", "dtensor_parameters": 4}, ["--no-verify"],
     "the plan was made for tensor parallel over tp=2 (4 DTensor parameters), the model has one process"),
    ("pipeline", {"schedule": "Schedule1F1B", "n_microbatches": 4, "stage_index": 0, "n_stages": 2}, [],
     "the plan is for pipeline stage 0 of 2 (Schedule1F1B, 4 micro-batches)"),
])
def test_a_plan_for_another_layout_is_not_checked_as_one_process(plan_file, capsys, field, value, verify, message):
    # Before (exit 0 both): a TP plan's per-rank figures printed as this process's (--no-verify;
    # with --verify apply_plan refused it), a stage plan checked against an ordinary step and
    # reported "within".
    _edited(plan_file, lambda d: d.update({field: value}))
    assert _plan_in(plan_file, *verify) == 2
    assert message in _error_line(capsys)


def test_a_seed_torch_cannot_take_is_one_line(capsys):
    # Before: a 39-line traceback from torch.manual_seed.
    assert main(["--model", _MODEL, "--quiet", "--seed", "99999999999999999999999"]) == 2
    assert "argument --seed: must be an integer in [-2**63, 2**64)" in _error_line(capsys)


def test_ctrl_c_during_a_solve_is_one_line_and_exit_130(capsys, monkeypatch):
    # Before: the KeyboardInterrupt's 50-110 line traceback (exit 130 was right).
    import planner.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(planner.cli, "_solve", interrupted)
    assert main(["--model", _MODEL, "--quiet"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted"]


@pytest.mark.parametrize("flag", ["--micro-batches", "--world-size"])
def test_a_count_no_plan_file_can_hold_is_refused_before_the_trace(capsys, flag):
    # Before: --micro-batches 10**20 an OverflowError traceback from the loss's division,
    # --world-size 10**20 refused only once the step was traced and solved.
    assert main(["--model", _MODEL, "--quiet", "--no-verify", flag, "99999999999999999999"]) == 2
    assert f"argument {flag}: must be an integer in [1, 1,048,576]" in _error_line(capsys)
