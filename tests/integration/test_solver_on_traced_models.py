"""The MILP's memory model against traces of planned models: for full checkpointing of every block
and for random plans, the predicted peak of a plan equals the traced peak of that plan (within
1 %), and the smallest reachable budget is at or below full checkpointing's traced peak.

Covers the CPU-sized built-in examples and two HF transformers families built from small configs.
``SAC_EXACT_DEMO=1`` adds gpt_demo (about a minute to trace), whose last block's attention core
was priced 3 MiB low before the held inputs were counted through the checkpoint's own backward.
"""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch

from estimators.tracing.estimation import estimate
from examples import EXAMPLES
from planner.planning.baselines import find_blocks
from planner.planning.module_plans import module_plan
from planner.planning.verification import traced_peak
from solver import SACMilp, predict_peak_bytes
from solver.graph import Graph
from estimators.step.train_step import TrainStep

pytestmark = pytest.mark.hf

N_RANDOM = 20
TOL = 0.01
"""Issue 11's bound for random plans. Measured worst |predicted - traced| / traced over the 20
plans: gpt_tiny +0.82 %, hf_llama +0.68 %, gpt_small_math +0.60 %, hf_gpt2 +0.43 %, gpt_small
+0.14 %, convnet_demo -0.010 %, convnet_tiny -0.025 %, llama_tiny 0. The larger errors are
over-predictions of plans that checkpoint part of a block (a sub-module whose recompute growth is
interpolated between the breakpoints of its curve, rounded up); not attributed further."""
FULL_AC_TOL = 3e-4
"""Full checkpointing of every block, measured: convnet_tiny -0.023 %, gpt_tiny +0.011 %,
convnet_demo -0.005 %, gpt_small(_math) +0.003 %, llama_tiny / hf_llama / hf_gpt2 0; the
residue is not attributed."""


def _hf(family: str):
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if family == "llama":
            cfg = transformers.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                use_cache=False, attn_implementation="eager",
            )
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.GPT2Config(
                vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, use_cache=False,
                attn_implementation="eager",
            )
            model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 128, (2, 32))
    model.train()
    return model, (ids,), lambda out, inp: out.logits.float().mean()


def _example(name: str):
    model, inputs = EXAMPLES[name]()
    return model, inputs, model.loss_fn


MODELS = {
    "gpt_tiny": lambda: _example("gpt_tiny"),
    "gpt_small_math": lambda: (lambda m, i: (m, i, m.loss_fn))(*EXAMPLES["gpt_small"](attn_impl="math")),
    "convnet_tiny": lambda: _example("convnet_tiny"),
    "llama_tiny": lambda: _example("llama_tiny"),
    "convnet_demo": lambda: _example("convnet_demo"),
    "hf_llama": lambda: _hf("llama"),
    "hf_gpt2": lambda: _hf("gpt2"),
}


@functools.lru_cache(maxsize=None)
def _setup(name: str):
    model, inputs, loss_fn = MODELS[name]()
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer="adamw"), device="cpu")
    return model, inputs, loss_fn, est


def _check(name: str, plan: dict[str, int]) -> tuple[int, int]:
    model, inputs, loss_fn, est = _setup(name)
    info = est.module_info
    mods = tuple(module_plan(info.stats(f), d) for f, d in plan.items())
    traced = traced_peak(model, mods, est)[1]  # the steady state: what the MILP is built on
    # The op plan's discard includes the forced ones; the solver's is the curve's part alone.
    curve = {m.fqn: min(info.stats(m.fqn).sac_memory_bytes,
                        max(0, m.discarded_bytes - info.stats(m.fqn).forced_discard_bytes))
             for m in mods}
    predicted = predict_peak_bytes(info, curve)
    return predicted, traced


def _random_plan(info, rng: random.Random) -> dict[str, int]:
    graph = Graph.from_module_info(info)
    # The root is left out: checkpointing the whole model is priced up to 1.5 % high (on the safe
    # side) on gpt_small with math attention; a known gap, not covered here.
    cands = [n for n in graph if not n.is_leaf and n.stats.sac_memory_bytes > 0 and n.parent]
    rng.shuffle(cands)
    plan: dict[str, int] = {}
    for n in cands[: rng.randint(1, max(1, len(cands) // 2))]:
        if any(graph.is_ancestor(f, n.fqn) or graph.is_ancestor(n.fqn, f) for f in plan):
            continue  # no nested checkpoints
        xs = n.stats.tradeoff.discarded_bytes
        plan[n.fqn] = xs[rng.randrange(1, len(xs))]
    return plan


@pytest.mark.parametrize("name", list(MODELS))
def test_full_ac_every_block_is_exact_and_reachable(name):
    _, _, _, est = _setup(name)
    info = est.module_info
    blocks = find_blocks(info)
    assert blocks, f"{name}: no repeated blocks found"
    predicted, traced = _check(name, {b: info.stats(b).sac_memory_bytes for b in blocks})
    assert abs(predicted - traced) <= FULL_AC_TOL * traced, (predicted, traced)
    assert SACMilp(info).min_reachable_peak_bytes() <= traced


@pytest.mark.parametrize("name", list(MODELS))
def test_random_plans_are_exact(name):
    _, _, _, est = _setup(name)
    rng = random.Random(name)
    errors, seen = [], set()
    for _ in range(N_RANDOM):
        plan = _random_plan(est.module_info, rng)
        if frozenset(plan.items()) in seen:
            continue  # drawn before: the same trace, checked already
        seen.add(frozenset(plan.items()))
        predicted, traced = _check(name, plan)
        if abs(predicted - traced) > TOL * traced:
            errors.append((sorted(plan), predicted, traced))
    assert not errors, errors


@pytest.mark.skipif(not os.environ.get("SAC_EXACT_DEMO"), reason="set SAC_EXACT_DEMO=1 (about a minute)")
def test_gpt_demo_full_ac_and_last_attention_core_are_exact():
    MODELS.setdefault("gpt_demo", lambda: _example("gpt_demo"))
    _, _, _, est = _setup("gpt_demo")
    info = est.module_info
    last = max(f.fqn for f in info.mod_stats if f.fqn.endswith(".attn.core"))
    for plan in ({b: info.stats(b).sac_memory_bytes for b in find_blocks(info)},
                 {last: info.stats(last).sac_memory_bytes}):
        predicted, traced = _check("gpt_demo", plan)
        assert abs(predicted - traced) <= TOL * traced, (plan, predicted, traced)
