"""A stack traced once (``EstimateOptions.replicate_blocks``) against every block traced, on the
models of ``benchmarks/new_user_trial.py`` and the HF families of ``test_hf_models.py`` built six
layers deep (so that two of their blocks are laid in), each as its users train it: the trace, the
memory timeline, the ModuleInfo and the first step's peak are the full trace's; a plan at a
budget that needs checkpointing has the same hash and predicted peaks. Models whose traced blocks
differ (or whose structure does not stack) are traced whole, which the DEBUG log says."""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from estimators.step.train_step import TrainStep  # noqa: E402
from estimators.tracing.estimation import EstimateOptions, estimate  # noqa: E402
from planner import solve_sac  # noqa: E402
from planner.applying.checkpointing import hf_cache_off  # noqa: E402
from planner.distributed.ranks import plan_hash  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.planning.solve import plan_estimate  # noqa: E402
from solver import SACMilp  # noqa: E402
from tests.estimators.tracing.trace_equivalence import estimate_difference  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

DEPTH = 6
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers")
FULL = EstimateOptions(replicate_blocks=False)

# Traced four blocks of each stack and laid the others in (the rest are traced whole: their
# blocks differ, share parameters, or their code reads every block's output).
REPLICATED = {"mixtral", "qwen2_moe", "falcon", "bloom", "deberta_v2", "whisper", "convnext", "resnet", "gpt2", "llama",
              "qwen2", "gemma", "phi", "gpt_neox", "opt", "bert", "mamba", "mamba2", "bigbird", "clip", "mistral"}


def _deepen(model: torch.nn.Module) -> torch.nn.Module:
    """The same family and config, ``DEPTH`` layers (every stack of the model)."""
    def bump(d: dict) -> dict:
        for k in _DEPTH_KEYS:
            if isinstance(d.get(k), int):
                d[k] = DEPTH
        if isinstance(d.get("depths"), list):
            d["depths"] = [DEPTH] * len(d["depths"])
        d.pop("layer_types", None)  # derived from the depth
        for sub in ("text_config", "vision_config"):
            if isinstance(d.get(sub), dict):
                bump(d[sub])
        return d

    config = type(model.config)(**bump(model.config.to_dict()))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deep = type(model)(config)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for n, p in deep.named_parameters():
        p.requires_grad_(n not in frozen)
    return deep.train()


def _trial_cases() -> dict:
    from benchmarks.new_user_trial import _families

    out = {}
    for name, f in _families().items():
        def case(f=f):
            model, batch = f.build()
            return _deepen(model), TrainStep(inputs=batch, optimizer="adamw", autocast_dtype=f.autocast_dtype,
                                             micro_batches=f.micro_batches)
        out[name] = case
    return out


def _hf_cases() -> dict:
    from tests.integration.test_hf_models import _build, _configs

    out = {}
    for name in _configs():
        def case(name=name):
            model, batch = _build(name)
            return _deepen(model), TrainStep(inputs=batch, optimizer="adamw")
        out[name] = case
    return out


@functools.lru_cache(maxsize=None)
def _cases() -> dict:
    return {**_trial_cases(), **_hf_cases()}


NAMES = ["mixtral", "qwen2_moe", "falcon", "bloom", "albert", "deberta_v2", "whisper", "convnext", "resnet",
         "mobilenet_v2", "swin", "clip", "mamba", "bigbird", "gpt2", "llama", "bert", "t5", "qwen2", "gemma",
         "phi", "gpt_neox", "opt", "mamba2", "mistral"]


@pytest.mark.parametrize("name", NAMES)
def test_the_replicated_trace_is_the_full_trace(name, caplog):
    model, step = _cases()[name]()
    with caplog.at_level(logging.DEBUG, logger="estimators.tracing.estimation"):
        rep = estimate(model, step, device="h100")
    full = estimate(model, step, device="h100", options=FULL)
    assert estimate_difference(full, rep) == ""
    if name in REPLICATED:
        assert rep.trace.twin_of, caplog.text
    else:
        assert not rep.trace.twin_of
        assert "every block traced" in caplog.text or not _stacked(model)


def _stacked(model) -> bool:
    from estimators.tracing.stacks import find_stacks

    return bool(find_stacks(model))


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral", "whisper"])
def test_plans_and_predicted_peaks_are_the_full_traces(name):
    model, step = _cases()[name]()
    with hf_cache_off(model):  # traced as solve_sac traces it: its plan is solve_sac's (plan_estimate)
        full = estimate(model, step, device="cpu", options=FULL)
    low, high = SACMilp(full.module_info).min_reachable_peak_bytes(), full.module_info.peak_bytes
    budget_gib = (low + 0.5 * (high - low)) / 2**30
    plans = [plan_estimate(model, full, budget_gib, options=PlanOptions(device="cpu", trace=FULL)),
             solve_sac(model, budget_gib, step, options=PlanOptions(device="cpu", trace=EstimateOptions(
                 replicate_blocks=True)))]
    assert plans[0].modules  # checkpointing is needed at this budget
    assert plan_hash(plans[0]) == plan_hash(plans[1])
    assert [(p.predicted_peak_bytes, p.first_step_peak_bytes, p.steady_peak_bytes) for p in plans[:1]] == \
        [(p.predicted_peak_bytes, p.first_step_peak_bytes, p.steady_peak_bytes) for p in plans[1:]]
