"""planner/plan.py: versioned JSON, fingerprints, the summary."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest

from examples import EXAMPLES
from planner import PlanFormatError, apply_plan, remove_plan
from planner.distributed.ranks import plan_hash
from estimators.step.train_step import TrainStep, ZeroGrad
from planner.errors import StepMismatchError
from planner.plan import ModulePlan, Plan, StepRecord, model_fingerprint
from planner.format import fmt_bytes
from planner.planning.solve import plan_for_budget
from tests.planner.conftest import budgets, plan_at, planning


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
    # The figures, not the labels (the labels are printed for any plan).
    assert f"  peak, planned    {fmt_bytes(plan.predicted_peak_bytes)}  (MILP model: " in text
    assert f"  recompute        {plan.recompute_ms:.3f} ms/step" in text
    for m in plan.modules:
        assert f"{m.discard_ratio:>7.1%}  {fmt_bytes(m.discarded_bytes):>10}" in text, m.fqn


def _mutated(plan: Plan, change) -> dict:
    d = json.loads(json.dumps(plan.to_dict()))
    change(d)
    return d


def _set_module(**kw):
    return lambda d: d["modules"][0].update(kw)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("version"), "no 'version' field"),
        (lambda d: d.update(version=0), "version must be an integer >= 1, got 0"),
        (lambda d: d.update(version=True), "version must be an integer >= 1, got True"),
        (lambda d: d.update(version="1"), "version must be an integer >= 1"),
        (lambda d: d.update(version=2), "newer than this SAC Planner"),
        (_set_module(discard_ratio=-0.1), r"discard_ratio must be in \[0, 1\], got -0.1"),
        (_set_module(discard_ratio=float("nan")), r"discard_ratio must be in \[0, 1\], got nan"),
        (_set_module(discard_ratio=1.5), r"discard_ratio must be in \[0, 1\]"),
        (_set_module(discard_ratio="0.5"), "discard_ratio must be a number"),
        (_set_module(discarded_bytes=-1), "discarded_bytes must be >= 0"),
        (_set_module(discarded_bytes=1.5), "discarded_bytes must be an integer"),
        (_set_module(recompute_ms=float("inf")), "recompute_ms must be finite"),
        (_set_module(fqn=7), "fqn must be a non-empty string, got 7"),
        (_set_module(fqn=""), "fqn must be a non-empty string"),
        (_set_module(full="yes"), "full must be true or false"),
        (_set_module(full=1), "full must be true or false"),
        (_set_module(saved_ops="aten.mm.default"), "saved_ops must be a list"),
        (_set_module(saved_ops=[["aten.mm.default", -1]]), r"occurrence\) must be >= 0"),
        (_set_module(saved_ops=[["aten.mm.default"]]), r"must be an \[op, occurrence\] pair"),
        (_set_module(saved_ops=[[3, 0]]), r"\(op\) must be a non-empty string"),
        (_set_module(recomputed_ops=[["aten.mm.default", True]]), "occurrence.*must be an integer"),
        (_set_module(colour="red"), "modules\\[0\\] has unknown field"),
        (lambda d: d.pop("model_fingerprint"), "missing field.*model_fingerprint"),
        (lambda d: d.update(colour="red"), "unknown field.*'colour'"),
        (lambda d: d.update(world_size=0), "world_size must be >= 1"),
        (lambda d: d.update(budget_bytes=float("nan")), "budget_bytes must be an integer"),
        (lambda d: d.update(reserve_bytes=-5), "reserve_bytes must be >= 0"),
        (lambda d: d.update(reserve_bytes=d["budget_bytes"]), "must be below budget_bytes"),
        (lambda d: d.update(predicted_peak_bytes=-1), "predicted_peak_bytes must be >= 0"),
        (lambda d: d.update(notes="a note"), "notes must be a list of strings"),
        (lambda d: d.update(notes=[3]), r"notes\[0\] must be a string"),
        (lambda d: d.update(modules={"a": 1}), "modules must be a list"),
        (lambda d: d["modules"].append(d["modules"][0]), "lists module.*more than once"),
        (lambda d: d["step"].update(micro_batches=0), "step: micro_batches must be >= 1"),
        (lambda d: d["step"].update(keep_output="yes"), "step: keep_output must be true or false"),
        (lambda d: d["step"].update(autocast="fp8"), "step: autocast must be one of none, bfloat16, float16"),
        (lambda d: d["step"].update(colour="red"), "step has unknown field.*'colour'"),
        (lambda d: d["step"].pop("optimizer"), "step is missing field.*'optimizer'"),
    ],
)
def test_bad_fields_are_refused_with_one_line_naming_them(plan, tmp_path, change, message):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_mutated(plan, change)))
    with pytest.raises(PlanFormatError, match=message) as e:
        Plan.load(p)
    assert "\n" not in str(e.value)


def test_full_module_with_saved_ops_is_refused(plan):
    m = plan.modules[0]
    with pytest.raises(PlanFormatError, match="full checkpointing saves no op"):
        ModulePlan(fqn=m.fqn, discard_ratio=1.0, full=True, saved_ops=(("aten.mm.default", 0),))


def test_pickle_and_binary_files_are_refused(plan, tmp_path):
    p = tmp_path / "plan.pkl"
    p.write_bytes(pickle.dumps(plan.to_dict()))
    with pytest.raises(PlanFormatError, match="is a Python pickle, not a JSON plan"):
        Plan.load(p)
    p.write_bytes(bytes(range(256)))
    with pytest.raises(PlanFormatError, match="binary data"):
        Plan.load(p)


def test_a_module_listed_twice_is_refused_when_built_and_when_applied(plan):
    with pytest.raises(PlanFormatError, match="more than once"):
        dataclasses.replace(plan, modules=(plan.modules[0], plan.modules[0]))
    # A Plan forced past its checks (frozen dataclasses can be) is still refused by apply_plan,
    # and the model is left untouched.
    twice = copy.copy(plan)
    object.__setattr__(twice, "modules", (plan.modules[0], plan.modules[0]))
    model, _ = EXAMPLES["gpt_demo"]()
    with pytest.raises(PlanFormatError, match="more than once"):
        apply_plan(model, twice)
    assert remove_plan(model) == 0


def test_legacy_files_with_solve_time_still_load(plan, tmp_path):
    d = plan.to_dict()
    d["solve_time_s"] = 1.25  # written by the first release
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    assert Plan.load(p) == plan


def test_identical_solves_give_byte_identical_plans_and_equal_hashes(tmp_path):
    est, milp, _, _ = planning("convnet_demo")
    model, _ = EXAMPLES["convnet_demo"]()
    budget = budgets("convnet_demo", 3)[1]
    a = plan_for_budget(model, est, budget, milp=milp)
    b = plan_for_budget(model, est, budget)  # a fresh MILP too
    assert a.solve_time_s > 0 and b.solve_time_s > 0  # the timing is still there to read...
    assert "solve_time_s" not in a.to_dict()  # ... but not part of the plan
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a == b and plan_hash(a) == plan_hash(b)
    assert plan_hash(Plan.load(tmp_path / "a.json")) == plan_hash(a)


# ------------------------------------------------------------------ offloaded_ops
_MM, _ADD = ("aten.mm.default", 0), ("aten.add.Tensor", 1)


def test_offloaded_ops_round_trip_and_old_files_load(plan, tmp_path):
    m = plan.modules[0]
    mp = dataclasses.replace(m, full=False, saved_ops=m.saved_ops or (_MM,),
                             offloaded_ops=(m.saved_ops or (_MM,))[:1])
    offloading = dataclasses.replace(plan, modules=(mp, *plan.modules[1:]))
    p = tmp_path / "p.json"
    offloading.save(p)
    loaded = Plan.load(p)
    assert loaded == offloading and loaded.modules[0].offloaded_ops == mp.offloaded_ops
    assert json.loads(p.read_text())["modules"][0]["offloaded_ops"] == [list(k) for k in mp.offloaded_ops]
    d = plan.to_dict()
    for md in d["modules"]:
        del md["offloaded_ops"]  # a file written before the field existed
    p.write_text(json.dumps(d))
    assert Plan.load(p) == plan and all(m.offloaded_ops == () for m in Plan.load(p).modules)


def test_input_numel_round_trips_and_old_files_load(plan, tmp_path):
    assert all(m.input_numel > 0 for m in plan.modules)  # recorded from the trace
    p = tmp_path / "p.json"
    plan.save(p)
    assert Plan.load(p) == plan
    d = plan.to_dict()
    for md in d["modules"]:
        del md["input_numel"]  # a file written before the field existed: nothing to compare with
    p.write_text(json.dumps(d))
    assert all(m.input_numel == 0 for m in Plan.load(p).modules)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(offloaded_ops=[_MM, _MM]), r"offloaded_ops lists \['aten.mm.default', 0\] twice"),
        (dict(offloaded_ops=[["aten.mm.default"]]), r"offloaded_ops\[0\] must be an \[op, occurrence\] pair"),
        (dict(offloaded_ops="aten.mm.default"), "offloaded_ops must be a list"),
        (dict(offloaded_ops=[_MM], recomputed_ops=[_MM]), "both offloaded and recomputed"),
        (dict(offloaded_ops=[_ADD], full=True, discard_ratio=1.0), "full checkpointing keeps no op output to offload"),
    ],
)
def test_bad_offloaded_ops_are_refused(kw, message):
    base = dict(fqn="GPT.blocks.0", discard_ratio=0.0, full=False)
    with pytest.raises(PlanFormatError, match=message):
        ModulePlan(**{**base, **kw})


# ------------------------------------------------------------------ the step a plan was made for
def test_a_plan_records_its_step_and_refuses_another(plan, tmp_path):
    # The peaks hold only for the loop the plan was traced with: it is saved with the plan and a
    # step that differs in any recorded field is refused, naming each field.
    made_for = TrainStep(optimizer="adam")  # what tests.planner.conftest plans with
    assert plan.step == StepRecord.of(made_for) == StepRecord(
        optimizer="adam", micro_batches=1, zero_grad="set_to_none", autocast="none", keep_output=False)
    p = tmp_path / "p.json"
    plan.save(p)
    loaded = Plan.load(p)
    assert loaded.step == plan.step
    loaded.check_step(made_for)
    import torch

    loaded.check_step(TrainStep(optimizer=torch.optim.Adam))  # the class is the same optimizer as "adam"
    for other, field in [(TrainStep(optimizer="adam", keep_output=True), "keep_output False in the plan, True"),
                         (TrainStep(optimizer="adam", micro_batches=4), "micro_batches 1 in the plan, 4"),
                         (TrainStep(optimizer="adamw"), "optimizer 'adam' in the plan, 'adamw'"),
                         (TrainStep(optimizer="adam", zero_grad=ZeroGrad.ZERO), "zero_grad 'set_to_none'"),
                         (TrainStep(optimizer="adam", autocast_dtype=torch.bfloat16), "autocast 'none' in the plan, 'bfloat16'")]:
        with pytest.raises(StepMismatchError, match=field):
            loaded.check_step(other)
    d = plan.to_dict()
    del d["step"]  # a file written before plans recorded their step: loads, cannot be checked
    p.write_text(json.dumps(d))
    old = Plan.load(p)
    assert old.step is None
    old.check_step(TrainStep(keep_output=True))


def test_a_pipeline_stage_plan_round_trips_its_stage_and_schedule(plan, tmp_path):
    from planner.plan_pipeline import PipelineRecord

    rec = PipelineRecord(schedule="Schedule1F1B", n_microbatches=8, stage_index=1, n_stages=4, fw_ms=1.5,
                         bw_ms=3.0, makespan_ms=40.0, bubble_fraction=0.25)
    staged = dataclasses.replace(plan, pipeline=rec)
    staged.save(tmp_path / "stage.json")
    loaded = Plan.load(tmp_path / "stage.json")
    assert loaded == staged and loaded.pipeline.rank_stages == (1,)
    bad = json.loads(staged.to_json())
    bad["pipeline"]["stage_index"] = 4
    with pytest.raises(PlanFormatError, match="stage_index must be in \\[0, 4\\)"):
        Plan.from_dict(bad)
    bad["pipeline"] = {"schedule": "Schedule1F1B", "n_microbatches": 8, "stage_index": 1, "n_stages": 4, "colour": 1}
    with pytest.raises(PlanFormatError, match="unknown field"):
        Plan.from_dict(bad)


# ------------------------------------------------------------------ plan files from anywhere
def _write(tmp_path, d) -> "Path":
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    return p


def _refused(path, message: str) -> str:
    with pytest.raises(PlanFormatError, match=message) as e:
        Plan.load(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 600
    return str(e.value)


def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path):
    p = tmp_path / "p.json"
    p.write_text("[" * 100_000)
    _refused(p, "nests arrays or objects deeper")


def test_an_integer_of_5000_digits_is_one_line(plan, tmp_path):
    text = plan.to_json().replace(f'"budget_bytes": {plan.budget_bytes}', '"budget_bytes": ' + "9" * 5000)
    p = tmp_path / "p.json"
    p.write_text(text)
    _refused(p, "holds a number beyond any field's range")


@pytest.mark.parametrize("field, value", [("budget_bytes", 10**400), ("predicted_peak_bytes", 2**50 + 1),
                                          ("host_bytes_per_step", 2**80), ("world_size", 2**21),
                                          ("recompute_ms", 1e300), ("step_ms", 1e11)])
def test_fields_past_what_a_machine_has_are_refused(plan, tmp_path, field, value):
    _refused(_write(tmp_path, _mutated(plan, lambda d: d.update({field: value}))), f"{field} must be")


def test_the_largest_plan_in_range_has_a_summary(plan):
    from planner.plan_fields import MAX_BYTES, MAX_MS

    big = dataclasses.replace(plan, budget_bytes=MAX_BYTES, predicted_peak_bytes=MAX_BYTES,
                              baseline_peak_bytes=MAX_BYTES, solver_peak_bytes=MAX_BYTES,
                              recompute_ms=MAX_MS, baseline_step_ms=MAX_MS, step_ms=MAX_MS)
    assert "1048576.00 GiB" in big.summary()


def test_ops_torch_does_not_know_are_refused(plan, tmp_path):
    change = _set_module(full=False, saved_ops=[["aten.no_such_op.default", 0]], recomputed_ops=[])
    _refused(_write(tmp_path, _mutated(plan, change)), "names 'aten.no_such_op.default', an op torch does not know")
    change = _set_module(full=False, saved_ops=[["mm", 0]], recomputed_ops=[])
    _refused(_write(tmp_path, _mutated(plan, change)), "must name an op as namespace.op.overload")


def test_a_custom_op_registered_after_the_first_look_is_known(plan, tmp_path):
    import torch

    change = _set_module(full=False, saved_ops=[["hardtest.late.default", 0]], recomputed_ops=[])
    path = _write(tmp_path, _mutated(plan, change))
    _refused(path, "an op torch does not know: a typo, or a custom op whose library is not imported yet")

    lib = torch.library.Library("hardtest", "FRAGMENT")  # a user's library, imported late
    lib.define("late(Tensor x) -> Tensor")
    assert Plan.load(path).modules[0].saved_ops == (("hardtest.late.default", 0),)


def test_more_ops_than_a_module_runs_are_refused_before_they_are_checked(plan, tmp_path):
    from planner.plan_fields import MAX_OPS

    many = [["aten.mm.default", i] for i in range(MAX_OPS + 1)]
    _refused(_write(tmp_path, _mutated(plan, _set_module(full=False, saved_ops=many, recomputed_ops=[]))),
             f"saved_ops lists {MAX_OPS + 1:,} ops, more than the {MAX_OPS:,}")


def test_a_fifo_or_a_device_is_refused_unread(tmp_path):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _refused(fifo, "is a FIFO")  # the read would block forever: the check comes first
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    _refused(zero, "is a character device")


def test_a_file_past_the_cap_is_refused(plan, tmp_path, monkeypatch):
    import planner.plan as plan_module

    monkeypatch.setattr(plan_module, "MAX_PLAN_FILE_BYTES", 1000)
    _refused(_write(tmp_path, _mutated(plan, lambda d: d.update(notes=["x" * 2000]))), "larger than 1,000 bytes")


def test_long_notes_and_names_are_refused_and_summaries_stay_short(plan, tmp_path):
    from planner.plan_fields import MAX_NOTE_CHARS

    _refused(_write(tmp_path, _mutated(plan, lambda d: d.update(notes=["x" * (MAX_NOTE_CHARS + 1)]))),
             r"notes\[0\] has 100,001 characters")
    _refused(_write(tmp_path, _mutated(plan, _set_module(fqn="M" * 5000))), "fqn has 5,000 characters")
    wordy = dataclasses.replace(plan, notes=("x" * MAX_NOTE_CHARS,) * 100, model_name="N" * 4000)
    text = wordy.summary()
    assert len(text) < 60_000 and "... and 80 more notes" in text and "(3,880 more characters)" in text


def test_save_is_atomic_and_leaves_the_old_plan_on_a_full_disk(plan, tmp_path):
    import os
    import resource
    import signal

    p = tmp_path / "plan.json"
    plan.save(p)
    before = p.read_bytes()
    bigger = dataclasses.replace(plan, notes=("x" * 50_000,))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 10, hard))  # the disk fills up mid-write
    try:
        with pytest.raises(OSError):
            bigger.save(p)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert p.read_bytes() == before and Plan.load(p) == plan
    assert os.listdir(tmp_path) == ["plan.json"]
