"""Plans hold in real training, not only in step 1: three real steps with the plan applied
(``zero_grad(set_to_none=True)`` between them, gradient accumulation, autocast), measured by
torch's MemTracker, stay within 2 % of the prediction and never above the budget.

Every case plans 3 budgets and trains 3 real steps per plan under MemTracker, which is slow on
2 shared cores, so the default run is 5 cases: every model, every optimizer and every
micro-batch count at least once. ``SAC_STEADY_MATRIX=latin`` runs a Latin square (every model
with every optimizer, each pair at one of 1, 2, 4 micro-batches so that every model and every
optimizer meets every count: 12 cases); ``SAC_STEADY_MATRIX=full`` all 36 combinations.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from estimators.tracing.estimation import estimate
from estimators.step.train_step import TrainStep, ZeroGrad
from examples import EXAMPLES
from planner import apply_plan
from planner.analysis.measure import measure_steps
from planner.planning.solve import plan_for_budget
from solver import SACMilp

pytestmark = pytest.mark.hf

TOLERANCE = 0.02
BUDGET_FRACTIONS = (0.85, 0.45, 0.08)  # of the way from the smallest reachable to the no-AC peak

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "none": None,
}


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 256, (4, 64))
    return model, {"input_ids": ids, "labels": ids}, lambda out, inputs: out.loss


def _example(name: str, batch_size: int):
    def make():
        model, _ = EXAMPLES[name]()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            inputs = model.example_inputs(batch_size)  # smaller batches keep the suite fast
        return model, inputs, model.loss_fn

    return make


MODELS = {
    "gpt_demo": _example("gpt_demo", 2),
    "convnet_demo": _example("convnet_demo", 8),
    "llama_tiny": _example("llama_tiny", 2),
    "hf_gpt2": _hf_gpt2,
}


MICRO_BATCHES = (1, 2, 4)


DEFAULT_CASES = [
    ("gpt_demo", "adamw", 1),
    ("convnet_demo", "sgd_momentum", 2),
    ("llama_tiny", "adamw", 4),
    ("hf_gpt2", "adamw", 2),
    ("llama_tiny", "none", 1),
]


def _cases():
    names, opts = list(MODELS), list(OPTIMIZERS)
    matrix = os.environ.get("SAC_STEADY_MATRIX", "")
    if matrix == "full":
        return list(itertools.product(names, opts, MICRO_BATCHES))
    if matrix == "latin":
        return [(m, o, MICRO_BATCHES[(i + j) % 3]) for (i, m), (j, o) in
                itertools.product(enumerate(names), enumerate(opts))]
    return DEFAULT_CASES


def check_steady_state(name: str, opt_name: str, micro_batches: int, *,
                       zero_grad: ZeroGrad = ZeroGrad.SET_TO_NONE, autocast_dtype=None) -> list[float]:
    """Plan at 3 budgets, train 3 real steps with each plan; returns |measured - predicted| / predicted."""
    model, inputs, loss_fn = MODELS[name]()
    make_opt = OPTIMIZERS[opt_name]
    step = TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer=make_opt, micro_batches=micro_batches,
                     zero_grad=zero_grad, autocast_dtype=autocast_dtype)
    est = estimate(model, step)
    milp = SACMilp(est.module_info)
    low, high = milp.min_reachable_peak_bytes(), est.module_info.peak_bytes
    errors = []
    for frac in BUDGET_FRACTIONS:
        budget = int(low + frac * (high - low))
        plan = plan_for_budget(model, est, budget, milp=milp)
        fresh, _, _ = MODELS[name]()
        opt = make_opt(fresh.parameters()) if make_opt else None
        with apply_plan(fresh, plan):
            steps = measure_steps(fresh, step, opt, n_steps=3)
        peaks = [s.peak_bytes for s in steps]
        measured, predicted = max(peaks), plan.predicted_peak_bytes
        where = (name, opt_name, micro_batches, frac, peaks, predicted, budget)
        assert measured <= budget, where
        assert abs(measured - predicted) <= TOLERANCE * predicted, where
        if make_opt is not None and opt_name != "none":
            # The state the first step lacks is there from step 2 on: the steady state binds.
            assert peaks[1] > peaks[0] and plan.binding_step == "steady state", where
        errors.append(abs(measured - predicted) / predicted)
    assert plan.modules, "the smallest budget must make the planner checkpoint something"
    return errors


@pytest.mark.parametrize("name,opt_name,micro_batches", _cases())
def test_three_real_steps_stay_at_the_prediction(name, opt_name, micro_batches):
    errors = check_steady_state(name, opt_name, micro_batches)
    print(f"{name} {opt_name} x{micro_batches}: max |err| {max(errors):.4%}")


def test_gradients_kept_between_steps():
    errors = check_steady_state("llama_tiny", "adamw", 1, zero_grad=ZeroGrad.ZERO)
    print(f"llama_tiny adamw zero_grad=zero: max |err| {max(errors):.4%}")


@pytest.mark.parametrize("name,micro_batches,dtype", [("convnet_demo", 1, torch.bfloat16),
                                                      ("llama_tiny", 2, torch.bfloat16),
                                                      ("llama_tiny", 1, torch.float16)])
def test_autocast_on_cpu(name, micro_batches, dtype):
    # float16 too: torch's CPU autocast runs it (the CPU target refused it, so a CPU fp16 loop
    # with GradScaler("cpu") could not be planned here).
    errors = check_steady_state(name, "adamw", micro_batches, autocast_dtype=dtype)
    print(f"{name} adamw x{micro_batches} autocast {dtype}: max |err| {max(errors):.4%}")


class _SparseEmbeddingNet(torch.nn.Module):
    """A recommendation-style net: a sparse embedding (sparse gradients) and dense blocks."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 32, sparse=True)
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)) for _ in range(3)])
        self.head = torch.nn.Linear(32, 4)

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


@pytest.mark.parametrize("optimizer", ["sparse_adam", "adagrad"])
def test_sparse_embedding_gradients_are_planned_and_measured(optimizer):
    # SparseAdam refused the steady-state set-up's dense zero gradients (planning stopped where
    # training runs), and MemTracker raised on the sparse gradients of every measured step.
    # Planned and measured now, bitwise; the sparse bytes themselves are not predicted.
    import copy

    from planner import solve_sac
    from planner.planning.tradeoff import tradeoff_curve

    torch.manual_seed(0)
    model = _SparseEmbeddingNet()
    if optimizer == "sparse_adam":  # the embedding alone, as SparseAdam takes only sparse gradients
        for name, p in model.named_parameters():
            p.requires_grad_(name == "emb.weight")
        make = lambda params: torch.optim.SparseAdam(params)  # noqa: E731
    else:
        make = lambda params: torch.optim.Adagrad(params)  # noqa: E731
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    step = TrainStep(inputs=(ids,), loss_fn=lambda out, _: out.pow(2).mean(), optimizer=make)
    table = tradeoff_curve(model, step, n_points=2)  # its bounds only
    lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
    plan = solve_sac(model, (lo + 0.5 * (hi - lo)) / 2**30, step)
    assert plan.checkpointed
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    assert any(n.startswith("sparse gradients (emb.weight) are not counted") for n in plan.notes)
    ref, got = (measure_steps(m, step, n_steps=3) for m in (model, planned))
    assert [s.loss for s in got] == [s.loss for s in ref]
    assert torch.equal(planned.emb.weight, model.emb.weight)
    # Not predicted (see the note), but never more under than the sparse gradient's bytes: 128
    # lookups, an int64 index and 32 float32 values each.
    sparse_bytes = 128 * (8 + 32 * 4)
    for measured, predicted in ((ref, plan.baseline_peak_bytes), (got, plan.predicted_peak_bytes)):
        assert all(predicted <= s.peak_bytes <= predicted + sparse_bytes for s in measured[1:])
