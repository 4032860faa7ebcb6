"""planner/planning/solve.py: predictions hold in real runs; the plan beats hand-made policies; bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
from estimators.step.train_step import TrainStep
from examples import EXAMPLES
from examples.gpt import GPTConfig, build_gpt
from planner import PlanningError, apply_plan, solve_sac
from planner.analysis.measure import measure_steps
from planner.format import GiB
from planner.format import fmt_bytes
from planner.planning.module_plans import module_plan
from planner.planning.solve import plan_for_budget
from solver import SACMilp, predict_peak_bytes
from tests.estimators.tracing.test_estimation import _assert_same, _snapshot
from tests.planner.conftest import EXAMPLE_NAMES, budgets, plan_at, planning
from planner.options import PlanOptions

REAL = EstimateOptions(mode=TraceMode.REAL)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_measured_peak_matches_prediction_at_four_budgets(name):
    activations = []
    for budget in budgets(name, 4):
        plan = plan_at(name, budget)
        model, inputs = EXAMPLES[name]()
        opt = torch.optim.Adam(model.parameters())
        step = TrainStep(inputs=inputs, loss_fn=model.loss_fn)
        with apply_plan(model, plan):
            first, *steady = measure_steps(model, step, opt, n_steps=2)
        # Step 1 (no Adam state yet) and the steady state, each against its own prediction: to
        # the byte on both examples at all four budgets (measured error 0 B; MemTracker on CPU
        # counts the same storages the fake-mode trace does).
        assert first.peak_bytes == plan.first_step_peak_bytes
        measured = max(m.peak_bytes for m in steady)
        assert measured == plan.predicted_peak_bytes, (budget, measured, plan.predicted_peak_bytes)
        assert max(first.peak_bytes, measured) <= budget
        activations.append(steady[-1].activation_bytes)
    assert activations == sorted(activations, reverse=True), activations
    assert activations[-1] < activations[0]


def _megatron_gpt():
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, dim=64, attn_impl="math")
    return build_gpt(cfg, batch_size=4)


@pytest.mark.slow
def test_plan_no_worse_than_megatron_attention_core_recompute():
    model, inputs = _megatron_gpt()
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), device="cpu")
    info = est.module_info
    cores = [s for s in info.mod_stats if s.fqn.endswith("attn.core")]
    assert len(cores) == 2 and all(s.sac_memory_bytes > 0 for s in cores)
    # The hand-made policy: recompute the whole attention core (scores, softmax, dropout).
    hand = {s.fqn: s.sac_memory_bytes for s in cores}
    hand_peak = predict_peak_bytes(info, hand)
    hand_ms = sum(module_plan(s, s.sac_memory_bytes).recompute_ms for s in cores)
    assert hand_peak < info.peak_bytes
    plan = plan_for_budget(model, est, hand_peak)
    assert plan.predicted_peak_bytes <= hand_peak
    assert plan.recompute_ms <= hand_ms, (plan.recompute_ms, hand_ms, plan.checkpointed)


def test_short_form_uses_example_inputs():
    model, _ = EXAMPLES["gpt_tiny"]()
    plan = solve_sac(model, options=PlanOptions(device="cpu"), budget_gib=1)
    assert plan.modules == () and plan.predicted_peak_bytes == plan.baseline_peak_bytes


def test_short_form_without_example_inputs_says_pass_inputs():
    with pytest.raises(ValueError, match="pass inputs="):
        solve_sac(torch.nn.Linear(4, 4), budget_gib=1)


def test_infeasible_budget_states_smallest_reachable():
    name = "convnet_demo"
    model, inputs = EXAMPLES[name]()
    low = planning(name)[3]  # the MILP's floor for this step (cpu, Adam), traced once per session
    with pytest.raises(PlanningError, match=r"smallest budget this model can reach is .*" + f"{low:,} bytes") as e:
        solve_sac(model, (low - 1) / GiB, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adam"), options=PlanOptions(device="cpu"))
    assert e.value.min_budget_bytes == low


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), "40"])
def test_bad_budget(bad):
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(PlanningError, match="budget_gib must be"):
        solve_sac(model, bad, TrainStep(inputs=inputs))


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), "1"])
def test_bad_host_budget_names_host_budget_and_fails_before_tracing(bad, monkeypatch):
    import planner.planning.solve

    def no_trace(*a, **k):
        raise AssertionError("traced before the host budget was checked")

    monkeypatch.setattr(planner.planning.solve, "estimate", no_trace)
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(PlanningError, match=r"^host_budget_gib must be .*offload=False"):
        solve_sac(model, 40, TrainStep(inputs=inputs), options=PlanOptions(offload=True, host_budget_gib=bad))


@pytest.mark.parametrize("kwargs, message", [
    ({"reserve_gib": float("nan")}, r"^reserve_gib must be a number of GiB from 0 up to below the budget"),
    ({"reserve_gib": float("inf")}, r"^reserve_gib must be"),
    ({"reserve_gib": 41}, r"^reserve_gib must be .*\(40 GiB\), got 41"),
    ({"ac_units": "GPT.blocks.0"}, r"^ac_units must be a list of module names, e\.g\. \['GPT\.blocks\.0'\]"),
    ({"host_budget_gib": 1}, r"^host_budget_gib only applies with offload=True"),
])
def test_bad_arguments_are_refused_before_tracing(kwargs, message, monkeypatch):
    # Each was found after a full trace (reserve_gib=nan: a bare ValueError), iterated per
    # character (ac_units="...": "module '.' does not exist"), or silently ignored (host_budget_gib).
    import planner.planning.solve

    def no_trace(*a, **k):
        raise AssertionError("traced before the arguments were checked")

    monkeypatch.setattr(planner.planning.solve, "estimate", no_trace)
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(PlanningError, match=message):
        solve_sac(model, 40, TrainStep(inputs=inputs), options=PlanOptions(**kwargs))
    with pytest.raises(TypeError, match="solve_sac plans a torch.nn.Module, got str"):
        solve_sac("model", 40, TrainStep(inputs=inputs))


def test_numpy_numbers_are_budgets():
    import numpy as np

    from planner.format import check_budget_gib

    assert check_budget_gib(np.float32(0.5)) == 0.5 and check_budget_gib(np.int64(40)) == 40.0
    with pytest.raises(PlanningError, match=r"for 1e\+300 bytes pass budget_gib=9\.313e\+290$"):
        check_budget_gib(1e300)


def test_cuda_reserve_is_stated():
    model, inputs = EXAMPLES["gpt_tiny"]()
    plan = solve_sac(model, 40, TrainStep(inputs=inputs, loss_fn=model.loss_fn), options=PlanOptions(device="h100"))
    assert plan.reserve_bytes == int(GiB + 0.05 * 40 * GiB)
    assert f"(reserve {fmt_bytes(plan.reserve_bytes)}, usable {fmt_bytes(plan.usable_budget_bytes)})" in plan.summary()


@pytest.mark.parametrize("name", ["convnet_demo", "gpt_demo"])
def test_module_plan_ratios_stay_in_0_1(name):
    # Batch norm's statistics are recomputed whenever its module is checkpointed, so they are
    # not on the trade-off curve (sac_memory_bytes) but are in what the op plan discards:
    # dividing one by the other gave ratios like 1.000244 on convnet_demo.
    model, inputs = EXAMPLES[name]()
    est = estimate(model, TrainStep(inputs=inputs, optimizer="adam"))
    seen = 0
    for s in est.module_info.mod_stats:
        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
            m = module_plan(s, int(frac * s.sac_memory_bytes))
            assert 0.0 <= m.discard_ratio <= 1.0, (s.fqn, frac, m.discard_ratio)
            assert m.discard_ratio == 1.0 or not m.full or m.discarded_bytes == 0
            seen += bool(s.sac_memory_bytes)
    assert seen

# ---------------------------------------------------------------- the step model
def test_one_default_target_everywhere():
    import inspect

    from estimators.tracing.estimation import DEFAULT_DEVICE
    from planner.cli import build_parser, target_device

    # every Python entry point takes its device from PlanOptions; estimate has its own keyword
    assert PlanOptions().device == DEFAULT_DEVICE
    assert inspect.signature(estimate).parameters["device"].default == DEFAULT_DEVICE
    assert target_device(build_parser().parse_args([]), None) == DEFAULT_DEVICE  # no --plan-in


@pytest.mark.slow
def test_a_plan_says_which_step_binds():
    model, inputs = EXAMPLES["gpt_tiny"]()
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw")
    plan = solve_sac(model, _midpoint_gib(estimate(model, step)), step)
    assert plan.modules and plan.binding_step == "steady state" and "binds            steady state" in plan.summary()


def _midpoint_gib(est) -> float:
    """Halfway between the smallest reachable and the no-AC peak: a budget that binds."""
    return (SACMilp(est.module_info).min_reachable_peak_bytes() + est.module_info.peak_bytes) / 2 / GiB


class _ReadsValues(torch.nn.Module):
    """Control flow on tensor values: fake tensors cannot trace it, real ones can."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))
            for _ in range(3)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.abs().sum().item() > 1e30:  # never true; reading it is the point
                x = x * 0
        return x


def _reads_values():
    torch.manual_seed(0)
    return _ReadsValues(), (torch.randn(1024, 32),)


@pytest.mark.slow
def test_real_mode_is_real_throughout_verification_included():
    model, inputs = _reads_values()
    with pytest.raises(TraceError, match="trace in real mode"):
        estimate(model, TrainStep(inputs=inputs))
    est = estimate(model, TrainStep(inputs=inputs, optimizer="adamw"), options=REAL)
    budget = (est.module_info.peak_bytes + SACMilp(est.module_info).min_reachable_peak_bytes()) // 2
    plan = plan_for_budget(model, est, budget)
    assert plan.modules and plan.predicted_peak_bytes <= budget
    opt = torch.optim.AdamW(model.parameters())
    with apply_plan(model, plan):
        steps = measure_steps(model, est.step, opt, n_steps=3)
    assert max(s.peak_bytes for s in steps) == plan.predicted_peak_bytes


def test_planning_in_real_mode_never_changes_the_model():
    model, inputs = EXAMPLES["gpt_tiny"]()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # optimizer state, then the gradients of a step in progress
        model.loss_fn(model(*inputs), inputs).backward()
        if not opt.state:
            opt.step()
    before = _snapshot(model, opt)
    rng = torch.get_rng_state()
    budget = _midpoint_gib(estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer=opt)))
    plan = solve_sac(model, budget, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer=opt), options=PlanOptions(trace=REAL))
    assert plan.modules, "the budget must bind so the verification trace applies a plan"
    _assert_same(before, _snapshot(model, opt))
    assert torch.equal(rng, torch.get_rng_state())
    assert not any(hasattr(m, "_sac_planner_original_forward") for m in model.modules())
    torch.manual_seed(0)
    out = model(*inputs)
    assert out.grad_fn is not None and "Checkpoint" not in type(out.grad_fn).__name__


class _Alternating(torch.nn.Module):
    """A forward that branches on where it runs: relu in the forward, clamp_min(0) (the same
    values by another op) when run inside the backward, as a recompute is. (nn.MultiheadAttention
    branching on ``query is key`` served here until planned_forward kept the forward's argument
    aliasing for the recompute.)"""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.up(x)
        in_backward = torch._C._current_autograd_node() is not None
        return self.down(torch.nn.functional.gelu(h.clamp_min(0) if in_backward else h.relu()))


class _Mlp(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x).relu()))


class _Residual(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Alternating(d), _Mlp(d), _Alternating(d), _Mlp(d)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _residual_step():
    torch.manual_seed(0)
    model = _Residual()
    return model, TrainStep(inputs=(torch.randn(256, 64),), optimizer="adamw")


@pytest.mark.slow
def test_modules_whose_recompute_diverges_are_left_out_not_crashed_on():
    """A selective checkpoint of a module whose recompute runs other ops (torch's checkpoint
    refuses that, or worse, hands back another op's output): the planner leaves such modules
    out, says so, and the plan it returns trains bitwise equal without a divergence."""
    import warnings

    from planner.analysis.gradcheck import check_gradients
    from planner.applying.planned_forward import CheckpointDivergenceWarning
    from planner.planning.tradeoff import tradeoff_curve

    model, step = _residual_step()
    before = copy.deepcopy(model.state_dict())
    table = tradeoff_curve(model, step, n_points=2)  # its bounds only
    # 90 % of the way up: one module checkpointed in part (a selective policy), blocks.0 first
    budget = table.min_reachable_peak_bytes + 0.9 * (table.no_ac_peak_bytes - table.min_reachable_peak_bytes)
    plan = solve_sac(model, budget / GiB, step)
    left_out = [n for n in plan.notes if "its recompute ran other ops than its forward" in n]
    assert left_out == ["_Residual.blocks.0 not checkpointed: its recompute ran other ops than its forward"], plan.notes
    assert plan.modules and "_Residual.blocks.0" not in {m.fqn for m in plan.modules}
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointDivergenceWarning)
        assert check_gradients(model, plan, TrainStep(inputs=step.inputs)).equal
        with apply_plan(copy.deepcopy(model), plan) as handle:
            handle.model(*step.inputs).sum().backward()


class _ExtraOpInBackward(torch.nn.Module):
    """Run inside the backward (a recompute), it first scales its input by a one-element
    buffer: one more saved tensor than its forward, which torch's full checkpoint refuses."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.register_buffer("one", torch.ones(1))

    def forward(self, x):
        if torch._C._current_autograd_node() is not None:
            x = x * self.one
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.slow
def test_a_full_checkpoint_torch_refuses_is_left_out_by_name():
    # torch's CheckpointError ("Recomputed values ... have different metadata") names no module:
    # solve_sac raised it from the verification trace. The planner now finds the module (its
    # recompute replayed op by op), leaves it out and plans the rest.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), _ExtraOpInBackward(64), _Mlp(64), _Mlp(64))
    step = TrainStep(inputs=(torch.randn(256, 64),), optimizer="adamw")
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        from planner.applying.checkpointing import apply_module_plans
        from planner.plan import ModulePlan

        planned = copy.deepcopy(model)
        apply_module_plans(planned, [ModulePlan(fqn="Sequential.1", discard_ratio=1.0, full=True)])
        planned(*step.inputs).sum().backward()
    from planner.planning.tradeoff import tradeoff_curve

    table = tradeoff_curve(model, step, n_points=2)  # its bounds only
    with pytest.raises(PlanningError, match=r"left out as unsafe to checkpoint: Sequential\.1 \(its recompute"):
        solve_sac(model, table.min_reachable_peak_bytes / GiB, step)
    lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
    plan = solve_sac(model, (lo + 0.6 * (hi - lo)) / GiB, step)
    assert "Sequential.1 not checkpointed: its recompute ran other ops than its forward" in plan.notes
    assert plan.modules and "Sequential.1" not in {m.fqn for m in plan.modules}


@pytest.mark.slow
def test_a_divergence_first_met_in_the_min_peak_plan_is_a_planning_error():
    # Two such modules: once the least-recompute attempts had left one out and ran out of
    # tightenings, the last resort (the min-peak plan) checkpointed the other, and solve_sac
    # raised the internal RecomputeDivergedError instead of a PlanningError.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), _ExtraOpInBackward(64), _Mlp(64),
                                _ExtraOpInBackward(64), _Mlp(64))
    step = TrainStep(inputs=(torch.randn(256, 64),), optimizer="adamw")
    from planner.planning.tradeoff import tradeoff_curve

    table = tradeoff_curve(model, step, n_points=2)  # its bounds only
    with pytest.raises(PlanningError, match=r"left out as unsafe to checkpoint: Sequential\.\d \(its recompute ran "
                                            r"other ops than its forward\); Sequential\.\d") as e:
        solve_sac(model, table.min_reachable_peak_bytes / GiB, step)
    plan = solve_sac(model, e.value.min_budget_gib, step)
    assert plan.predicted_peak_bytes <= plan.usable_budget_bytes
    assert not {"Sequential.1", "Sequential.3"} & {m.fqn for m in plan.modules}


@pytest.mark.slow
def test_every_candidate_left_out_for_divergence_is_a_planning_error():
    # ac_units naming only modules whose recompute diverges, selectively checkpointed: once they
    # were left out no attempt had traced a plan, and solve_sac raised UnboundLocalError
    # ('traced') instead of saying what it could do.
    from planner.planning.tradeoff import tradeoff_curve

    model, step = _residual_step()
    table = tradeoff_curve(model, step, n_points=2)  # its bounds only
    alternating = ["_Residual.blocks.0", "_Residual.blocks.2"]
    with pytest.raises(PlanningError, match=r"smallest budget that verifies.*left out as unsafe to checkpoint: "
                                            r"_Residual\.blocks\.\d \(its recompute ran other ops") as e:
        solve_sac(model, (table.no_ac_peak_bytes - 1024) / GiB, step, options=PlanOptions(ac_units=alternating))
    # The figure it states is one the planner accepts (as the infeasible-budget refusal's).
    assert e.value.floor is None and e.value.min_budget_bytes <= e.value.min_budget_gib * GiB
    plan = solve_sac(model, e.value.min_budget_gib, step, options=PlanOptions(ac_units=alternating))
    assert plan.predicted_peak_bytes <= plan.usable_budget_bytes


def _hf_loop_peaks(model, batch, n_steps=3):
    """The plain HF loop ``loss = model(**batch).loss; loss.backward()`` under bf16 autocast,
    AdamW, MemTracker per step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters())
    peaks = []
    for _ in range(n_steps):
        mt = MemTracker()
        mt.track_external(model, opt, *batch.values())
        with mt:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        peaks.append(int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
    return peaks


@pytest.mark.hf
def test_peak_no_ac_is_the_model_as_it_runs_unplanned_with_hf_use_cache_on():
    # A Llama left at use_cache=True keeps its K/V cache until the output is dropped; with a
    # padding mask HF repeats the grouped K/V heads, so the cache is not the tensors attention
    # saves. Its step peaks in the loss (forward), cache alive. Planning traces the model as the
    # plan runs it (use_cache off): "peak, no AC" was that, 3,539,900 B, 131,072 B (the cache,
    # -3.6 %) under the unplanned model's measured 3,670,972 B. It is now the model as it runs.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    model.train()
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, -8:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    plan = solve_sac(model, budget_gib=3.45e6 / 2**30, step=TrainStep(inputs=batch, optimizer="adamw", autocast_dtype=torch.bfloat16))
    assert model.config.use_cache is True  # planning left it as it was
    unplanned = _hf_loop_peaks(copy.deepcopy(model), batch)
    assert unplanned[1:] == [plan.baseline_peak_bytes] * 2
    # The no-AC figure of the note is the model's step with use_cache off, measured (how much
    # the cache adds depends on how the transformers version keeps it: 131,072 B when this test
    # was written, 98,304 B with transformers 5.24).
    off = copy.deepcopy(model)
    off.config.use_cache = False
    no_cache = _hf_loop_peaks(off, batch)
    assert no_cache[1:] == [no_cache[1]] * 2 and no_cache[1] < plan.baseline_peak_bytes
    assert f"use_cache on ({plan.baseline_peak_bytes:,} B)" in plan.notes[-1]
    assert f"no-AC peak is {no_cache[1]:,} B" in plan.notes[-1]
    planned = copy.deepcopy(model)
    with apply_plan(planned, plan):
        assert _hf_loop_peaks(planned, batch)[1:] == [plan.predicted_peak_bytes] * 2


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d), torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.b(torch.nn.functional.gelu(self.a(x))))


class _SharedBlockNet(torch.nn.Module):
    """One block applied twice (weight sharing) between two ordinary ones."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.first, self.shared, self.last, self.head = _Block(d), _Block(d), _Block(d), torch.nn.Linear(d, 8)

    def forward(self, x):
        return self.head(self.last(self.shared(self.shared(self.first(x)))))


@pytest.mark.slow
def test_a_module_called_twice_is_planned_exactly_and_fully_checkpointed_below_the_milp_floor():
    # The memory model gives Shared.shared one window (its last call's forward end to its first
    # call's backward start), so the MILP's smallest reachable peak was 3,101,632 B (the plan at
    # it traced 3,100,352 B) and budgets below were refused, while checkpointing the shared
    # block fully traces and measures 2,578,368 B. Below the MILP's floor the min-peak plan with
    # the shared block fully checkpointed is traced and used: predicted = measured, bitwise.
    from planner.analysis.gradcheck import check_gradients

    torch.manual_seed(0)
    model, x = _SharedBlockNet(), torch.randn(256, 64)
    step = TrainStep(inputs=(x,), optimizer="adamw")
    plan = solve_sac(model, budget_gib=2.7e6 / GiB, step=step)
    assert {m.fqn: m.full for m in plan.modules} == {"_SharedBlockNet.first": True, "_SharedBlockNet.shared": True}
    assert plan.predicted_peak_bytes == 2_578_368
    assert any(n.startswith("_SharedBlockNet.shared (2 calls) runs more than once per step") for n in plan.notes)
    mine = copy.deepcopy(model)
    with apply_plan(mine, plan):
        steps = measure_steps(mine, step, torch.optim.AdamW(mine.parameters()), n_steps=3)
    assert [s.peak_bytes for s in steps[1:]] == [plan.predicted_peak_bytes] * 2
    assert check_gradients(model, plan, TrainStep(inputs=(x,))).equal
    with pytest.raises(PlanningError, match=r"the smallest budget this model can reach is 0.002402 GiB "
                                            r"\(2,578,368 bytes\).*Note: _SharedBlockNet.shared \(2 calls\)"):
        solve_sac(model, budget_gib=2.5e6 / GiB, step=step)


class _SharedBNBlock(torch.nn.Module):
    def __init__(self, c: int, momentum) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(c, c, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(c, momentum=momentum)
        self.c2, self.b2 = torch.nn.Conv2d(c, c, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(c, momentum=momentum)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class _SharedBNNet(torch.nn.Module):
    """A conv + BatchNorm block applied twice (weight sharing, as in a recurrent conv net)."""

    def __init__(self, momentum) -> None:
        super().__init__()
        self.stem, self.blk, self.head = torch.nn.Conv2d(3, 16, 3, 1, 1), _SharedBNBlock(16, momentum), torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.blk(self.blk(self.stem(x))).mean((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_batchnorm_block_called_twice_is_checkpointed_with_its_statistics_as_unplanned(momentum):
    # Each call's BatchNorm adds 1 to num_batches_tracked in place, so the first call read a
    # buffer the second overwrote, and the block was refused ("reads a tensor the caller later
    # overwrites in place (aten.add_.Tensor)"): floor = no-AC peak, 1,714,656 B. The recompute
    # gets the buffers the forward started with, so the block is safe to checkpoint: loss,
    # gradients and running statistics after 3 AdamW steps equal the unplanned run's.
    from planner.analysis.gradcheck import check_gradients

    torch.manual_seed(0)
    model, x = _SharedBNNet(momentum), torch.randn(4, 3, 24, 24)
    step = TrainStep(inputs=(x,), optimizer="adamw")
    plan = solve_sac(model, options=PlanOptions(reserve_gib=0), budget_gib=1.3e6 / GiB, step=step)
    assert [m.fqn for m in plan.modules] == ["_SharedBNNet.blk"] and plan.module("_SharedBNNet.blk").full
    assert not any("not checkpointed" in n for n in plan.notes)
    assert check_gradients(model, plan, TrainStep(inputs=(x,))).equal
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    ref_steps = measure_steps(ref, step, torch.optim.AdamW(ref.parameters()), n_steps=3)
    with apply_plan(mine, plan):
        steps = measure_steps(mine, step, torch.optim.AdamW(mine.parameters()), n_steps=3)
    assert [s.peak_bytes for s in steps[1:]] == [plan.predicted_peak_bytes] * 2
    assert plan.predicted_peak_bytes < min(s.peak_bytes for s in ref_steps[1:])
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), mine.state_dict().values()))
    assert int(mine.blk.b1.num_batches_tracked) == 6  # 2 calls x 3 steps, not once more per recompute


@pytest.mark.hf
def test_albert_shared_layer_is_checkpointed_below_the_milp_floor():
    # AlbertForMaskedLM applies one layer 4 times: the MILP's smallest reachable peak was
    # 4,897,912 B; its min-peak plan with the shared layer group fully checkpointed traces and
    # measures 2,303,864 B, bitwise.
    transformers = pytest.importorskip("transformers")
    from planner.analysis.gradcheck import check_gradients

    torch.manual_seed(0)
    model = transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64)).train()
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    step = TrainStep(inputs=batch, optimizer="adamw")
    plan = solve_sac(model, budget_gib=4.0e6 / GiB, step=step)
    group = "AlbertForMaskedLM.albert.encoder.albert_layer_groups.0"
    assert plan.module(group).full and plan.predicted_peak_bytes == 2_303_864
    mine = copy.deepcopy(model)
    with apply_plan(mine, plan):
        steps = measure_steps(mine, step, torch.optim.AdamW(mine.parameters()), n_steps=3)
    assert [s.peak_bytes for s in steps[1:]] == [plan.predicted_peak_bytes] * 2
    assert check_gradients(model, plan, TrainStep(inputs=batch)).equal


def _eval_mode_net():
    torch.manual_seed(0)
    block = lambda c: torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(), torch.nn.Dropout(0.2))
    model = torch.nn.Sequential(block(8), block(8), block(8), torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 4))
    return model.eval(), (torch.randn(4, 8, 16, 16),)


@pytest.mark.slow
def test_a_model_left_in_eval_mode_is_planned_as_it_trains():
    """from_pretrained returns a model in eval mode; its loop trains it in train mode (planned as
    it was, a BERT measured 5.1 % over the plan). The step runs as model.train() leaves it; the
    user's flags are put back after planning and after measuring."""
    model, inputs = _eval_mode_net()
    flags = [m.training for m in model.modules()]
    step = TrainStep(inputs=inputs, optimizer="sgd")
    est = estimate(model, step)
    as_is = estimate(model, TrainStep(inputs=inputs, optimizer="sgd", train_mode=False))
    trained = copy.deepcopy(model).train()
    assert est.module_info.peak_bytes == estimate(trained, step).module_info.peak_bytes
    assert as_is.module_info.peak_bytes < est.module_info.peak_bytes  # no dropout masks, no batch stats
    budget = (est.module_info.peak_bytes + SACMilp(est.module_info).min_reachable_peak_bytes()) // 2
    plan = plan_for_budget(model, est, budget)
    assert [m.training for m in model.modules()] == flags
    assert any("eval mode: planned in train mode" in n for n in plan.notes)
    with apply_plan(model, plan):
        steps = measure_steps(model, step, n_steps=3)
    assert [m.training for m in model.modules()] == flags
    assert max(s.peak_bytes for s in steps) == plan.predicted_peak_bytes


def test_train_mode_keeps_submodules_the_user_froze_in_eval_mode():
    from estimators.step.train_step import step_mode

    model, _ = _eval_mode_net()
    model.train()
    model[0][1].eval()  # a frozen BatchNorm: the loop trains with it in eval mode
    with step_mode(model, None):
        assert not model[0][1].training and model[1][1].training
    with step_mode(model, True):
        assert model[0][1].training
    assert not model[0][1].training and model.training
    with pytest.raises(TypeError, match="train_mode"):
        TrainStep(train_mode="yes")


def test_real_mode_planning_of_an_eval_model_puts_every_flag_back():
    """Real mode traces the user's model itself: the one path where planning flips its flags."""
    model, inputs = _eval_mode_net()
    model[1][1].train()  # mixed flags under an eval root
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    est = estimate(model, TrainStep(inputs=inputs, optimizer="sgd"), options=REAL)
    assert [m.training for m in model.modules()] == flags
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BN stats too
    fake = estimate(model, TrainStep(inputs=inputs, optimizer="sgd"))
    assert est.module_info.peak_bytes == fake.module_info.peak_bytes


@pytest.mark.slow
def test_a_plan_records_its_train_mode_and_the_check_runs_it():
    from planner.analysis.gradcheck import check_gradients
    from planner.plan import Plan

    model, inputs = _eval_mode_net()
    est = estimate(model, TrainStep(inputs=inputs, optimizer="sgd"))
    budget = (est.module_info.peak_bytes + SACMilp(est.module_info).min_reachable_peak_bytes()) // 2
    plan = plan_for_budget(model, est, budget)
    import json

    assert plan.step.train_mode == "auto" and Plan.from_dict(json.loads(plan.to_json())) == plan
    old_file = json.loads(plan.to_json())
    del old_file["step"]["train_mode"]  # a plan saved before train_mode was recorded
    assert Plan.from_dict(old_file).step.train_mode == "auto"
    check = check_gradients(model, plan)  # the plan's own step, train mode "auto"
    assert check.equal and not model.training
    torch.manual_seed(0)
    trained = copy.deepcopy(model).train()
    assert check.loss_reference == float(trained(*inputs).sum().detach())  # dropout on, batch statistics
    as_is = plan_for_budget(model, estimate(model, TrainStep(inputs=inputs, optimizer="sgd", train_mode=False)),
                            budget)
    assert as_is.step.train_mode == "as_is"
    torch.manual_seed(0)
    assert check_gradients(model, as_is).loss_reference == float(model(*inputs).sum().detach())


def test_a_small_budget_for_a_gpu_names_the_default_reserve():
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(PlanningError, match=r"the default on a CUDA target.*reserve_gib=0 plans the budget as given"):
        solve_sac(model, options=PlanOptions(device="h100", verify=False), budget_gib=0.003, step=TrainStep(inputs=inputs, loss_fn=model.loss_fn))


class _FeatureBank(torch.nn.Module):
    """A block that pushes its features into a 512 KiB bank by rebinding it (a MoCo-style
    queue): a checkpoint of it holds the old bank until its backward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
        self.register_buffer("bank", torch.zeros(4096, 32))

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        with torch.no_grad():
            self.bank = torch.cat([h.detach().reshape(-1, 32), self.bank[: -h.shape[0] * h.shape[1]]])
        return x + h


@pytest.mark.slow
def test_a_refusal_never_states_a_smallest_budget_above_the_unplanned_peak():
    # The min-peak plan traced above the unplanned step (each checkpoint holds its old bank):
    # the refusal stated 3,579,112 B as the smallest budget that verifies; 2,661,608 B (no plan)
    # does.
    from planner.planning.tradeoff import tradeoff_curve

    torch.manual_seed(0)
    model = torch.nn.Sequential(_FeatureBank(), _FeatureBank(), _FeatureBank(), torch.nn.Linear(32, 4))
    step = TrainStep(inputs=(torch.randn(8, 16, 32),), loss_fn=lambda out, _: out.pow(2).mean(),
                     optimizer="adamw")
    table = tradeoff_curve(model, step, n_points=2)  # its bounds only
    lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
    with pytest.raises(PlanningError, match=f"smallest budget that verifies is .* \\({hi:,} bytes\\)") as e:
        solve_sac(model, (lo + 0.3 * (hi - lo)) / GiB, step)
    assert e.value.min_budget_bytes == hi
    assert solve_sac(model, e.value.min_budget_gib, step).predicted_peak_bytes <= hi


def test_a_budget_above_the_gpus_memory_is_refused():
    """``--budget-gib 120`` for an 80 GiB H100 planned for memory the device does not have."""
    model, inputs = EXAMPLES["gpt_tiny"]()
    with pytest.raises(PlanningError, match=r"budget_gib 120 GiB is more than the h100's 80 GiB: the budget is one "
                                            r"GPU's memory; pass at most 80"):
        solve_sac(model, 120, TrainStep(inputs=inputs), options=PlanOptions(device="h100"))
