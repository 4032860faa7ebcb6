"""estimators/tracing/replicate.py (with stacks.py, truncation.py, block_layout.py): a stack's
middle blocks laid in from a trace of four of them give the full trace, record for record; where
the traced blocks differ the full model is traced, and said at DEBUG."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from estimators.step.train_step import TrainStep, ZeroGrad
from estimators.tracing.estimation import EstimateOptions, estimate
from estimators.tracing.stacks import find_stacks
from examples.gpt import GPTConfig, build_gpt
from examples.llama import LlamaConfig, build_llama
from tests.estimators.tracing.trace_equivalence import estimate_difference

FULL = EstimateOptions(replicate_blocks=False)


def _llama(n_layers: int = 6):
    cfg = LlamaConfig(vocab_size=256, seq_len=32, n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return build_llama(cfg, 2, device="meta")


def _gpt(n_layer: int = 6, impl: str = "math"):
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=n_layer, n_head=4, dim=64, attn_impl=impl)
    return build_gpt(cfg, 2, device="meta")


def _both(model, step, device):
    return estimate(model, step=step, device=device, options=FULL), estimate(model, step=step, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["h100", "cpu"])  # foreach AdamW lists / a loop per parameter
def test_a_llama_laid_in_from_four_blocks_is_the_full_trace(device):
    model, inputs = _llama(7)
    full, rep = _both(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn, optimizer="adamw"), device)
    assert len(rep.trace.twin_of) == 3 * 13  # blocks 3, 4, 5: 13 module calls each
    assert estimate_difference(full, rep) == ""
    assert rep.module_info == full.module_info


@pytest.mark.slow
@pytest.mark.parametrize("step_kw", [
    dict(micro_batches=2),  # gradients alive from the start, accumulated in place
    dict(autocast_dtype=torch.bfloat16, zero_grad=ZeroGrad.ZERO),
    dict(keep_output=True, optimizer="sgd"),
    dict(optimizer=None),
])
def test_the_loop_variants_replicate_exactly(step_kw):
    model, inputs = _gpt(6)
    step = TrainStep(inputs=inputs, loss_fn=model.loss_fn, **{"optimizer": "adam", **step_kw})
    full, rep = _both(model, step, "h100")
    assert rep.trace.twin_of
    assert estimate_difference(full, rep) == ""


def test_a_run_after_a_first_block_that_differs_is_a_stack():
    layers = nn.Sequential(nn.Linear(8, 16), *(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(6)))
    (stack,) = find_stacks(nn.Sequential(layers, nn.Linear(16, 1)))
    assert stack.container == "0" and stack.keys == ("1", "2", "3", "4", "5", "6")
    assert stack.traced_keys == ("1", "2", "3", "6") and stack.skipped_keys == ("4", "5")
    model = nn.Sequential(layers, nn.Linear(16, 1))
    step = TrainStep(inputs=(torch.randn(4, 8),), optimizer="adamw")
    full, rep = _both(model, step, "h100")
    assert rep.trace.twin_of and estimate_difference(full, rep) == ""


class _Block(nn.Module):
    def __init__(self, i: int, window: int | None = None) -> None:
        super().__init__()
        self.layer_idx, self.window = i, window
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        if self.layer_idx % 2:  # behaviour the structure does not show: the trace does
            y = y * 2
        return x + y.relu()


class _Stack(nn.Module):
    def __init__(self, blocks) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_differing_in_a_plain_attribute_are_no_stack():
    windows = [None if i % 2 else 4 for i in range(8)]  # Gemma-2's alternating sliding window
    assert find_stacks(_Stack(_Block(i, w) for i, w in enumerate(windows))) == []
    numbered = find_stacks(_Stack(_Block(i) for i in range(8)))
    assert [s.keys for s in numbered] == [tuple(str(i) for i in range(8))]  # layer_idx numbers them


def test_blocks_that_trace_differently_fall_back_to_the_full_trace_and_say_so(caplog):
    model = _Stack(_Block(i) for i in range(8))  # odd blocks run one op more
    step = TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw")
    with caplog.at_level(logging.DEBUG, logger="estimators.tracing.estimation"):
        full, rep = _both(model, step, "h100")
    assert "_Stack: every block traced (NotReplicable: blocks 1 and 2 run different numbers" in caplog.text
    assert not rep.trace.twin_of
    assert estimate_difference(full, rep) == ""


def test_the_fallback_leaves_nothing_for_the_leak_scan(monkeypatch):
    """The truncated trace's NotReplicable is handled inside its fake mode: its traceback goes
    before the mode ends, so the mode dies with it and no heap scan for caches runs (with the
    traceback alive at the mode's end, every such trace scanned the heap: seconds per
    zero-bubble stage in a search that keeps many traces)."""
    from estimators.tracing import fake_leaks

    scans = []
    real = fake_leaks._clear
    monkeypatch.setattr(fake_leaks, "_clear", lambda mode, report: scans.append(report) or real(mode, report=report))
    model = _Stack(_Block(i) for i in range(8))  # odd blocks run one op more: NotReplicable
    est = estimate(model, step=TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw"), device="h100")
    assert not est.trace.twin_of  # the full trace was taken
    assert scans == []


class _Indexes(_Stack):
    def forward(self, x):
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)  # the truncated copy has no block 4
        return x


def test_code_that_indexes_the_blocks_is_traced_whole():
    model = _Indexes(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8))
    step = TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw")
    full, rep = _both(model, step, "cpu")
    assert not rep.trace.twin_of
    assert estimate_difference(full, rep) == ""


class _Collects(_Stack):
    def forward(self, x):
        outs = []
        for b in self.blocks:
            x = b(x)
            outs.append(x)
        return torch.stack(outs).sum(0)  # one op over every block's output: depends on the depth


def test_an_op_over_every_blocks_output_is_traced_whole():
    model = _Collects(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8))
    full, rep = _both(model, TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw"), "h100")
    assert not rep.trace.twin_of
    assert estimate_difference(full, rep) == ""


def test_a_shared_parameter_makes_no_stack():
    shared = nn.Linear(16, 16)  # the full trace counts it once: the copies of a block cannot
    blocks = [nn.Sequential(shared if i in (3, 5) else nn.Linear(16, 16), nn.Tanh()) for i in range(9)]
    assert find_stacks(_Stack(blocks)) == []


@pytest.mark.slow
def test_real_mode_and_prepare_trace_every_block():
    model, inputs = _llama(6)
    prepared = []
    est = estimate(model, TrainStep(inputs=inputs, loss_fn=model.loss_fn), device="h100", prepare=prepared.append)
    assert not est.trace.twin_of and len(prepared[0].layers) == 6


def test_a_frozen_stack_without_backward_replicates():
    stack = _Stack(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(7))
    stack.requires_grad_(False)  # a frozen feature extractor: no backward runs through its blocks
    model = nn.Sequential(stack, nn.Linear(16, 2))
    full, rep = _both(model, TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw"), "h100")
    assert rep.trace.twin_of
    assert estimate_difference(full, rep) == ""


class _Dict(nn.Module):
    """Blocks in a ModuleDict run in order, as torchtitan keeps a decoder's layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for i in range(6)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_blocks_of_a_module_dict_stack():
    model = _Dict()
    (stack,) = find_stacks(model)
    assert stack.container == "layers" and stack.keys == tuple(str(i) for i in range(6))
    full, rep = _both(model, TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw"), "h100")
    assert rep.trace.twin_of and estimate_difference(full, rep) == ""


@pytest.mark.slow
@pytest.mark.parametrize("stage,group", [(1, True), (2, True), (1, False)])  # middle, last; W grouped or not
def test_a_split_backward_stage_is_laid_in_exactly(stage, group):
    """A zero-bubble stage runs its input half over the blocks in reverse order, then its weight
    half in order, each after torch's list over every parameter: laid in, each half and each
    list takes the copies at their places (stage 0 of such a schedule runs one backward)."""
    from estimators.step.stage_step import StageRole
    from examples.pipeline_stages import llama_pipeline_model, llama_stage, stage_loss

    module = llama_stage(llama_pipeline_model(18), stage, 3)  # 6 layers a stage
    last = stage == 2
    tokens = torch.zeros(2, 32, dtype=torch.long)
    step = TrainStep(inputs=torch.randn(2, 32, 64), loss_fn=stage_loss, optimizer="adamw",
                     target=tokens if last else None, micro_batches=2,
                     stage=StageRole(is_first=False, is_last=last, split_backward=True, group_weight_backward=group))
    full, rep = _both(module, step, "h100")
    assert len(rep.trace.twin_of) == 2 * 13  # layers 3 and 4 of the stage's 6
    m = rep.trace.marks
    assert m["backward"] < m["weight"] < m["optimizer"]
    assert estimate_difference(full, rep) == ""
    assert rep.module_info == full.module_info and rep.trace.marks == full.trace.marks
