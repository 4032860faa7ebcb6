"""estimators/pipeline/stage_trace.py: a traced pipeline micro-batch read as a ``StageProfile``,
checked against the same micro-batch run for real and measured by MemTracker."""

import copy

import pytest
import torch
import torch.distributed.pipelining  # noqa: F401 - imported before any trace, as a schedule's user has it
from torch import nn
from torch.utils.checkpoint import checkpoint

from estimators.pipeline.stage_trace import stage_profile
from estimators.step.stage_step import StageRole, run_stage_microbatch
from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import estimate
from examples.pipeline_stages import llama_pipeline_model, llama_stage, stage_loss
from planner.analysis.measure import StepPeaks


class _Checkpointed(nn.Module):
    """``inner`` under torch's non-reentrant checkpoint, as a plan's full discard runs it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _sum_loss(out, _target):
    return out.sum()


def _llama_stage(index: int, checkpoint_feed_forward: bool):
    full = llama_pipeline_model(n_layers=4)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = llama_stage(full, 0, 4)(tokens)
    stage = copy.deepcopy(llama_stage(full, index, 4))
    if checkpoint_feed_forward:
        for layer in stage.layers.values():
            layer.feed_forward = _Checkpointed(layer.feed_forward)
    return stage, (tokens if index == 0 else h)


def _mlp(hidden: int):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 64))


CASES = {
    # a middle stage whose feed-forward the weight half recomputes (InterleavedZeroBubble's planned
    # stages measured one FFN weight gradient, 32,768 B, under the prediction)
    "llama middle, feed-forward checkpointed": lambda: (*_llama_stage(1, True), False),
    "llama middle": lambda: (*_llama_stage(1, False), False),
    "mlp middle": lambda: (_mlp(1024), torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), False),
    "llama first, feed-forward checkpointed": lambda: (*_llama_stage(0, True), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_weight_half_measures_what_the_profile_says(case):
    """The stage's first weight half of a step, where the gradients do not exist yet (the
    schedule zeroes them with ``set_to_none``): its rise above what the micro-batch keeps after
    its input half is the profile's first-write curve (``w`` plus the gradients written so far,
    ``grad_pending``) less ``kept_after_i``, to the byte. The trace accumulates into existing
    gradients; the real first weight half makes each parameter group's ``dw`` the gradient."""
    model, h, is_first = CASES[case]()
    role = StageRole(is_first=is_first, is_last=False, split_backward=True)
    est = estimate(model, TrainStep(inputs=h, loss_fn=_sum_loss, optimizer="adamw", stage=role, micro_batches=2),
                   device="cpu")
    p = stage_profile(est, stage_index=0 if is_first else 1)
    predicted = max(c + p.grad_bytes - p.grad_pending[j] for j, c in enumerate(p.w)) - p.kept_after_i

    meter, at = StepPeaks(model, external=(h,)), {}

    def on_mark(name, _tensor=None):
        if name == "weight":
            meter.step_done()  # the forward's and the input half's peak
            at["weight"] = meter.step_done()  # nothing ran since: what is alive now

    meter.start()
    try:
        run_stage_microbatch(model, h, _sum_loss, None, None, role, on_mark=on_mark)
        measured = meter.step_done() - at["weight"]
    finally:
        meter.stop()
    assert all(q.grad is not None for q in model.parameters())
    assert measured == predicted


@pytest.mark.multiproc
def test_a_stage_trace_in_a_fresh_process_leaves_nothing_fake_behind():
    # torch.distributed.pipelining makes a module-level tensor when first imported; imported first
    # inside the fake trace it became a fake tensor the process kept (and a 4-byte storage the
    # stage's trace counted). A fresh interpreter is the only place it is not imported yet.
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, warnings, torch\n"
        "from estimators.tracing.estimation import estimate\n"
        "from estimators.step.train_step import TrainStep\n"
        "from estimators.step.stage_step import StageRole\n"
        "assert 'torch.distributed.pipelining' not in sys.modules\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))\n"
        "role = StageRole(is_first=True, is_last=False, split_backward=True)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('error')\n"
        "    est = estimate(m, TrainStep(inputs=(torch.randn(4, 8),), stage=role))\n"
        "print(est.steady_peak_bytes)\n"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    # ... and it predicts what this process, which imported pipelining first, predicts (the leaked
    # constant was 4 B more).
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    here = estimate(m, TrainStep(inputs=(torch.randn(4, 8),),
                                 stage=StageRole(is_first=True, is_last=False, split_backward=True)))
    assert int(out.stdout.split()[-1]) == here.steady_peak_bytes
