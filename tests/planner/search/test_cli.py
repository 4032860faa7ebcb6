"""``sac-plan search``: the table on stdout, the files under --out, one error line for bad input."""

from __future__ import annotations

import pytest

from planner.cli import main

pytestmark = pytest.mark.slow

ARGS = ["search", "--model", "examples:llama_tiny", "--gpus", "2xcpu", "--global-batch", "4", "--seq-len", "32",
        "--budget-gib", str(1.6 / 1024), "--cp", "1", "--micro-batches", "1", "--schedules", "1F1B", "--quiet"]


def test_search_prints_the_table_and_writes_the_winner(tmp_path, capsys):
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layout (degrees > 1" in out and "MODELLED" in out
    assert (tmp_path / "search.txt").read_text().startswith("llama_tiny (float32 parameters")
    job = (tmp_path / "torchtitan_job.py").read_text()
    compile(job, "torchtitan_job.py", "exec")
    assert "def sac_advisor():" in job and "p.tensor_parallel_degree =" in job


@pytest.mark.parametrize("bad, says", [
    (["--gpus", "2"], "COUNTxDEVICE"),
    (["--model", "examples"], "MODULE:FACTORY"),
    (["--model", "examples:gpt_tiny"], "seq_len"),
])
def test_bad_input_is_one_error_line(bad, says, capsys):
    args = list(ARGS)
    for flag, value in zip(bad[::2], bad[1::2]):
        args[args.index(flag) + 1] = value
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0]


def test_no_bound_plans_every_layout(monkeypatch):
    import importlib

    search_module = importlib.import_module("planner.search.search")  # the package's `search` is the function

    seen = []

    class Stop(Exception):
        pass

    def fake_search(model_fn, cluster, *, global_batch, seq_len, options):
        seen.append(options.bound)
        raise Stop

    monkeypatch.setattr(search_module, "search", fake_search)  # the CLI imports it when it runs
    for extra, bound in (([], True), (["--no-bound"], False)):
        with pytest.raises(Stop):
            main([*ARGS, *extra])
    assert seen == [True, False]
