"""estimators/step/stage_step.py: one pipeline micro-batch run with torch's stage functions."""

import copy

import pytest
import torch

from estimators.step.stage_step import StageRole, run_stage_microbatch
from examples.pipeline_stages import llama_pipeline_model, llama_stage, stage_loss


@pytest.mark.parametrize("split", [False, True])
def test_last_stage_gives_the_unsplit_models_gradients(split):
    """Full or split into input and weight halves, the last stage's parameter gradients and the
    input gradient it sends back are the unsplit model's, bitwise."""
    full = llama_pipeline_model(n_layers=2)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    s0, s1 = llama_stage(full, 0, 2), llama_stage(full, 1, 2)
    ref1 = copy.deepcopy(s1)
    h = s0(tokens).detach().requires_grad_(True)
    stage_loss(ref1(h), tokens).backward()
    marks = {}
    written = run_stage_microbatch(s1, h.detach(), stage_loss, tokens, None,
                                   StageRole(is_first=False, is_last=True, split_backward=split),
                                   on_mark=lambda name, t: marks.setdefault(name, t))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(s1.parameters(), ref1.parameters()))
    assert torch.equal(marks["input_grad"], h.grad)
    assert written == {id(p) for p in s1.parameters()}
    assert ("weight" in marks) is split and {"loss", "backward"} <= set(marks)


def test_first_stage_split_runs_its_whole_backward_in_the_weight_half():
    """torch's stage 0 computes nothing in the input half (its input needs no gradient)."""
    s0 = llama_stage(llama_pipeline_model(n_layers=2), 0, 2)
    names = []
    run_stage_microbatch(s0, torch.randint(0, 256, (2, 32)), stage_loss, None, None,
                         StageRole(is_first=True, is_last=False, split_backward=True),
                         on_mark=lambda name, t: names.append(name))
    assert names == ["backward", "output_grad", "weight"]
    assert all(p.grad is not None for p in s0.parameters())


@pytest.mark.parametrize("split", [False, True])
def test_the_steps_context_wraps_forward_loss_and_backward_not_the_optimizer(split):
    """``TrainStep.context`` (loss_parallel under tensor parallelism) is entered as a loop enters
    it around ``schedule.step()``: the forward, the loss and both backward halves run inside it,
    the optimizer step outside."""
    import contextlib

    s1 = llama_stage(llama_pipeline_model(n_layers=2), 1, 2)
    inside, seen = [False], []

    @contextlib.contextmanager
    def context():
        inside[0] = True
        yield
        inside[0] = False

    def loss_fn(out, target):
        seen.append(("loss", inside[0]))
        return stage_loss(out, target)

    class Optimizer(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(("optimizer", inside[0]))
            return super().step(closure)

    s1.layers["1"].register_full_backward_hook(lambda *_: seen.append(("backward", inside[0])))
    run_stage_microbatch(s1, torch.randn(2, 32, 64), loss_fn, torch.randint(0, 256, (2, 32)),
                         Optimizer(s1.parameters(), lr=0.1),
                         StageRole(is_first=False, is_last=True, split_backward=split), context=context)
    assert seen == [("loss", True), ("backward", True), ("optimizer", False)]
