"""benchmarks/time_fidelity.py: what its PASS line reads, on made-up timings, and one real round."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks import time_fidelity as tf
from planner.plan import ModulePlan, Plan


def _plan(*mods: ModulePlan) -> Plan:
    return Plan(modules=mods, model_name="M", model_fingerprint="x", device="cpu", world_size=1, budget_bytes=10,
                reserve_bytes=0, predicted_peak_bytes=1, solver_peak_bytes=1, baseline_peak_bytes=2,
                recompute_ms=0.0, baseline_step_ms=0.0)


FULL = _plan(ModulePlan(fqn="M.b0", discard_ratio=1.0, full=True), ModulePlan(fqn="M.b1", discard_ratio=1.0, full=True))
SELECTIVE = _plan(ModulePlan(fqn="M.b0", discard_ratio=0.5, full=False, saved_ops=(("aten.mm.default", 0),)))


def _variants(at: Plan, pred_at: float, pred_full: float) -> list[tf.Variant]:
    v = lambda name, plan, ms: tf.Variant(name=name, plan=plan, predicted_recompute_ms=ms,  # noqa: E731
                                          predicted_step_ms=100 + ms, predicted_peak_bytes=1)
    return [v("no AC", None, 0.0), v("plan @ full-AC peak", at, pred_at), v("full AC", FULL, pred_full)]


def _samples(*cpu_rounds: list[float]) -> dict[str, list[tf.Sample]]:
    names = ["no AC", "plan @ full-AC peak", "full AC"]
    return {n: [tf.Sample(wall_ms=2 * c, cpu_ms=c) for c in cpus] for n, cpus in zip(names, cpu_rounds)}


def test_overhead_is_the_median_of_paired_rounds():
    """Round r's overhead is that round's step less the same round's unplanned step: a slow
    round (the machine busy) moves both."""
    samples = _samples([100, 200, 100], [110, 212, 111], [120, 220, 121])
    rows = tf.rows_of(_variants(SELECTIVE, 10.0, 20.0), samples)
    assert [r.overhead_cpu_ms for r in rows] == [0, 11, 20]
    assert rows[1].step_cpu_ms == 111 and all(r.within for r in rows[1:])
    assert rows[1].overhead_cpu_ci == (-math.inf, math.inf)  # 3 rounds bound no median at 95 %


def test_median_ci_is_the_order_statistics_of_binomial_coverage():
    xs = [(x * 37) % 101 / 10 for x in range(21)]  # 21 distinct values, 0.0-10.0
    s = sorted(xs)
    assert tf.median_ci(xs) == (s[5], s[15])  # ranks 6 and 16: 97.3 % coverage, ranks 7 and 15 92.2 %
    assert tf.median_ci(list(range(41))) == (13, 27)
    assert tf.median_ci(list(range(6))) == (0, 5)  # 1 - 2 / 64 = 96.9 %
    assert tf.median_ci(list(range(5))) == (-math.inf, math.inf)  # 1 - 2 / 32 = 93.8 %: none
    lo, hi = tf.median_ci(xs * 4)
    assert s[5] < lo <= statistics.median(xs) <= hi < s[15]  # more rounds, a narrower interval


def test_pass_needs_every_overhead_within_tolerance_and_the_plan_faster_than_full_ac():
    status, line = tf.verdict(*_rows_and(_samples([100] * 7, [110] * 7, [120] * 7), 10.0, 20.0))
    assert status == "PASS" and line.startswith("PASS") and "-10.0 ms measured" in line
    status, line = tf.verdict(*_rows_and(_samples([100] * 7, [125] * 7, [120] * 7), 25.0, 20.0))
    assert status == "FAIL" and "vs full AC: +5.0 ms measured" in line  # within tolerance, but slower
    status, line = tf.verdict(*_rows_and(_samples([100] * 7, [110] * 7, [150] * 7), 10.0, 20.0))
    assert status == "FAIL" and "off by more than 15%" in line and "full AC" in line  # 50 ms measured, 20 predicted
    status, line = tf.verdict(*_rows_and(_samples([100] * 7, [122] * 7, [120] * 7), 20.0, 20.0, at=FULL))
    assert status == "PASS" and "the same plan as full AC" in line  # the same plan cannot be faster than itself
    status, _ = tf.verdict(*_rows_and(_samples([100] * 3, [110] * 3, [150] * 3), 10.0, 20.0))
    assert status == "NOISY"  # 3 rounds cannot show a prediction off


def test_a_median_outside_the_tolerance_whose_interval_reaches_it_is_noisy_not_a_pass():
    """Full AC predicted at 20 ms (17-23 allowed): its median overhead 26, but the median's
    interval over 9 rounds (ranks 2 and 8) reaches 21: NOISY. With the second-lowest round at 26
    it misses: FAIL. The plan at full AC's peak neither faster nor slower over its interval: NOISY."""
    noisy = _samples([100] * 9, [110] * 9, [120, 121, 126, 126, 126, 126, 127, 127, 127])
    status, line = tf.verdict(*_rows_and(noisy, 10.0, 20.0))
    rows = tf.rows_of(_variants(SELECTIVE, 10.0, 20.0), noisy)
    assert rows[2].overhead_cpu_ms == 26 and rows[2].overhead_cpu_ci == (21, 27)
    assert not rows[2].within and not rows[2].off
    assert status == "NOISY" and "not beyond the noise" in line and "full AC" in line
    status, _ = tf.verdict(*_rows_and(_samples([100] * 9, [110] * 9, [125] + [126] * 5 + [127] * 3), 10.0, 20.0))
    assert status == "FAIL"
    at = [115, 119, 119, 119, 122, 122, 122, 123, 130]  # vs full AC's 120: median +2, interval -1..+3
    status, line = tf.verdict(*_rows_and(_samples([100] * 9, at, [120] * 9), 20.0, 20.0))
    assert status == "NOISY" and "not faster than full AC, not slower beyond the noise" in line


def test_exit_status_fail_first_then_pass_only_when_every_family_passed():
    assert tf.exit_status(["PASS", "PASS"]) == 0
    assert tf.exit_status(["PASS", "NOISY", "FAIL"]) == 1
    assert tf.exit_status(["PASS", "NOISY"]) == 2
    assert tf.exit_status([]) == 2  # nothing ran (the HF family skipped alone): not a pass


def test_a_drifted_unplanned_step_is_named():
    rows = tf.rows_of(_variants(SELECTIVE, 10.0, 20.0), _samples([117] * 3, [127] * 3, [137] * 3))
    assert tf.drift_note(rows) is not None and "+17%" in tf.drift_note(rows)  # 117 vs 100 predicted
    rows = tf.rows_of(_variants(SELECTIVE, 10.0, 20.0), _samples([110] * 3, [120] * 3, [130] * 3))
    assert tf.drift_note(rows) is None


def test_each_timed_step_follows_an_untimed_step_of_its_own_variant(monkeypatch):
    """A timed step never follows another variant's step: it would inherit that variant's heap and
    caches, and in a rotating order mostly the same variant's (a bias per variant)."""
    import types

    import torch

    ran: list[int] = []  # the model copy of every step, in the order run
    monkeypatch.setattr(tf, "run_step", lambda m, *a, **k: ran.append(id(m)))
    # A clock that reads len(ran) ** 2 s: a sample of (2n + 1) * 1000 ms timed the n-th step run.
    monkeypatch.setattr(tf.time, "thread_time", lambda: len(ran) ** 2)
    variants = [tf.Variant(name=n, plan=None, predicted_recompute_ms=0.0, predicted_step_ms=1.0,
                           predicted_peak_bytes=1) for n in ("a", "b", "c")]
    step = types.SimpleNamespace(inputs=None, loss_fn=None)
    ends: list[int] = []  # steps run when each round ended (the host costs' rounds run there)
    samples = tf.time_variants(torch.nn.Linear(2, 2), step, variants, rounds=4, warmup=1, timer=tf.OpTimer(),
                               each_round=lambda: ends.append(len(ran)))
    timed = sorted(round((s.cpu_ms / 1000 - 1) / 2) for ss in samples.values() for s in ss)
    assert set(samples) == {"a", "b", "c", tf.PROFILED}  # the op-timed copy takes its turn too
    assert ends == [4 + 8 * r for r in range(1, 5)]
    assert all(len(s) == 4 for s in samples.values()) and len(ran) == 4 + 2 * 16 and len(timed) == 16
    assert all(ran[n - 1] == ran[n] and n - 1 not in timed for n in timed)


def _rows_and(samples, pred_at: float, pred_full: float, at: Plan = SELECTIVE):
    return tf.rows_of(_variants(at, pred_at, pred_full), samples), samples


@pytest.mark.slow
def test_one_round_of_the_convnet_family_runs(one_intra_op_thread):
    """The variants of a real family are planned, applied and timed (one round, no verdict:
    one round on a shared machine says nothing)."""
    from estimators.runtime.device import get_device_spec
    from planner.options import PlanOptions

    model, step = tf.FAMILIES["convnet"]()
    variants, _ = tf.variants_of(model, step, PlanOptions(device=get_device_spec("cpu"), reserve_gib=0))
    assert [v.name for v in variants][-2:] == ["plan @ full-AC peak", "full AC"] and len(variants) == 5
    full = variants[-1]
    assert all(m.full for m in full.plan.modules) and full.predicted_recompute_ms > 0
    assert variants[3].predicted_recompute_ms <= full.predicted_recompute_ms  # the solver beats full AC's price
    timer = tf.OpTimer()
    samples = tf.time_variants(model, step, variants, rounds=1, warmup=0, timer=timer)
    assert all(len(s) == 1 and s[0].cpu_ms > 0 for s in samples.values()) and timer.samples


def test_repricing_with_the_planning_kernels_gives_the_plans_own_prices(one_intra_op_thread):
    """``repriced`` prices a plan by the planner's rule: with the kernels it was planned with, it
    gives back ``plan.recompute_ms`` and the no-AC step; with others, the plan is kept and its
    price moves (what the verdict reads when the kernels are timed in the rounds)."""
    from estimators.runtime.device import get_device_spec
    from estimators.runtime.models import RuntimeKind, benchmark_runtime_override
    from estimators.tracing.estimation import EstimateOptions
    from planner.options import PlanOptions

    model, step = tf.FAMILIES["convnet"]()
    options = PlanOptions(device=get_device_spec("cpu"), reserve_gib=0,
                          trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    planned_with = tf.profile_step_kernels(model, step, steps=1, warmup=0).runtime()
    with benchmark_runtime_override(planned_with):
        variants, _ = tf.variants_of(model, step, options)
    again = tf.repriced(model, step, variants, options, planned_with)
    for v, w in zip(variants, again):
        assert w.plan is v.plan and w.planned_recompute_ms == v.predicted_recompute_ms
        assert w.predicted_recompute_ms == pytest.approx(v.predicted_recompute_ms, rel=1e-9)
        assert w.predicted_step_ms == pytest.approx(v.predicted_step_ms, rel=1e-9)
    slower = tf.BenchmarkRuntime()
    slower.import_cache({k: 2 * t for k, t in planned_with.export_cache().items()})
    doubled = tf.repriced(model, step, variants, options, slower)
    assert all(w.plan is v.plan for v, w in zip(variants, doubled))
    assert doubled[0].predicted_step_ms == pytest.approx(2 * variants[0].predicted_step_ms, rel=0.05)
    assert all(w.predicted_recompute_ms > v.predicted_recompute_ms for v, w in zip(variants[1:], doubled[1:]))


def test_the_rounds_price_their_kernels_and_keep_the_planning_price_of_recompute_only_ones():
    """A signature the op-timed unplanned steps ran is priced by its median there; one only a
    recompute runs (never timed in the rounds) keeps the price the plans were made with."""
    timer = tf.OpTimer()
    timer.samples["mm"] = [2_000_000, 3_000_000, 4_000_000]  # ns
    planned_with = tf.BenchmarkRuntime()
    planned_with.import_cache({"mm": 9.0, "recompute only": 5.0})
    host = type("Rounds", (), {"costs": lambda self: "the chains' fit"})()
    now, costs = tf.priced_in_rounds(timer, 3, planned_with, host)
    assert now.export_cache() == {"mm": 3.0, "recompute only": 5.0} and costs == "the chains' fit"


def test_the_unplanned_copies_run_with_the_hf_cache_off_as_the_plans_and_the_trace(monkeypatch):
    """HF ``use_cache`` costs the unplanned step a cache the plans (and the trace) never build:
    every unplanned copy, the op-timed one included, runs with it off; the user's model keeps it."""
    import types

    import torch

    seen: list[bool] = []
    monkeypatch.setattr(tf, "run_step", lambda m, *a, **k: seen.append(m.config.use_cache))
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(use_cache=True)
    variants = [tf.Variant(name="no AC", plan=None, predicted_recompute_ms=0.0, predicted_step_ms=1.0,
                           predicted_peak_bytes=1)]
    tf.time_variants(model, types.SimpleNamespace(inputs=None, loss_fn=None), variants, rounds=2, warmup=0,
                     timer=tf.OpTimer())
    assert seen and not any(seen) and model.config.use_cache is True


def test_the_host_variants_checkpoint_each_child_group_both_ways_and_fit_from_their_rounds(small):
    """``host_variants``: the blocks' children, plain and through the selective path caching
    nothing, copies of a plan of the model; ``measured_scales`` reads their rounds against the
    unplanned step's and gives back the factors they were built at."""
    from benchmarks.step_host import terms

    _, _, spec, est = small
    info = est.module_info
    like = _plan()
    host = tf.host_variants(like, info)
    assert [v.name for v in host] == ["host: blocks.*.attn full", "host: blocks.*.attn policy",
                                      "host: blocks.*.mlp full", "host: blocks.*.mlp policy"]
    assert all(v.plan.model_fingerprint == like.model_fingerprint for v in host)
    assert [m.full for m in host[0].plan.modules] == [True, True]
    assert [m.full for m in host[1].plan.modules] == [False, False]
    base = tf.Variant(name="no AC", plan=None, predicted_recompute_ms=0.0, predicted_step_ms=1.0,
                      predicted_peak_bytes=1)
    samples = {"no AC": [tf.Sample(wall_ms=0, cpu_ms=c) for c in (100.0, 101.0, 99.0)]}
    for v in host:  # each round the unplanned step plus the kernels, 1.5x the plain host, 2x the policy
        t = terms(info, v.plan.modules, spec, est.trace)
        over = t["kernels"] + 1.5 * (t["calls"] + t["host/op"]) + 2.0 * t["policy"]
        samples[v.name] = [tf.Sample(wall_ms=0, cpu_ms=s.cpu_ms + over) for s in samples["no AC"]]
    scales, lines = tf.measured_scales([base, *host], samples, info, spec, est.trace)
    assert scales.plain == pytest.approx(1.5) and scales.policy == pytest.approx(2.0)
    assert len(lines) == 4 and "2 calls" in lines[0]
