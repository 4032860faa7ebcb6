"""Check that a plan changes nothing but memory: the same step with and without it, bitwise.

    check = check_gradients(model, plan)            # the step the plan was made for
    assert check.equal, check.differing

Both runs start from the same state (parameters, buffers such as BatchNorm statistics, and the
gradients already there are saved and put back) and the same RNG seed (torch's, Python's
``random`` and numpy's), so dropout draws the same masks. The model is left as it was found: same
values, same ``.grad``, no plan applied; the RNG streams go on where they were.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from estimators.step.train_step import TrainStep, run_step, step_mode
from estimators.tracing.estimation import as_train_step
from estimators.step import host_rng
from planner.applying.checkpointing import apply_plan, hf_cache_note, hf_cache_off, unwrap_compiled
from planner.plan import Plan
from estimators.tracing.subclasses import local_tensor

__all__ = ["GradientCheck", "check_gradients"]


@dataclass(frozen=True, kw_only=True)
class GradientCheck:
    """Planned vs unplanned: one forward + backward each, from the same state and seed."""

    equal: bool
    """Loss and every parameter gradient bitwise equal (a gradient present in one run only counts
    as different)."""
    n_params_compared: int
    """Parameters that require grad."""
    max_abs_diff: float
    """Largest |planned - unplanned| over the loss and all gradients (0.0 when equal)."""
    loss_planned: float
    loss_reference: float
    differing: tuple[str, ...] = ()
    """Names of the parameters whose gradients differ."""
    seed: int = 0
    equal_with_cache_off: bool | None = None
    """Where ``equal`` is False on an HF model with ``use_cache`` on, which a plan turns off:
    whether the planned step is bitwise the unplanned one run with the cache off too (None: not
    checked). True says the difference is HF's: GPT-Neo and T5 compute the cached step with
    other rounding (up to 8e-8 in gradients, with or without a plan)."""

    @property
    def note(self) -> str:
        """What the check found, in a sentence."""
        if self.equal:
            return f"bitwise equal: loss and {self.n_params_compared} parameter gradients"
        if self.equal_with_cache_off:
            return (f"not bitwise equal to the unplanned step with use_cache on (max |diff| "
                    f"{self.max_abs_diff:.3g}), but bitwise equal to it with use_cache off, as the "
                    "plan runs: the model's own cached step rounds otherwise")
        return (f"NOT equal: {len(self.differing)} of {self.n_params_compared} gradients differ, "
                f"max |diff| {self.max_abs_diff:.3g}")


def check_gradients(model: torch.nn.Module, plan: Plan, step: TrainStep | None = None, *,
                    seed: int = 0) -> GradientCheck:
    """Run one forward + backward of ``step`` without and then with ``plan`` and compare them bitwise.

    ``model`` is the unplanned model (the plan is applied for the second run and removed after;
    a model with a plan applied already is refused). ``step``: the step to check (its inputs,
    loss, autocast, ``keep_output`` and ``train_mode``; one micro-batch, no optimizer step);
    None: the step the plan was made for (``plan.train_step``), which a plan loaded from a file
    does not carry, nor one whose batch was freed (a plan keeps no tensors of its step alive). Check the step training runs: an fp32 check of a bf16 plan compares other
    kernels than training runs."""
    if unwrap_compiled(model) is not model:
        raise TypeError("check_gradients got a torch.compile'd model: check the original module, "
                        "`check_gradients(compiled._orig_mod, plan)` (a plan is applied to it, "
                        "then compiled)")
    if step is None:
        step = plan.train_step
        if step is None:
            raise ValueError("this plan does not carry its training step (a plan loaded from a file, or one "
                             "whose batch was freed: a plan keeps no tensors of its step alive): pass it, "
                             "check_gradients(model, plan, TrainStep(inputs=batch, loss_fn=...))")
    step = as_train_step(model, step)
    # The user's RNG streams go on where they were: the check seeds every generator twice
    # (torch.manual_seed reseeds every CUDA device's, not only the model's).
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with step_mode(model, step.train_mode), torch.random.fork_rng(devices=devices), host_rng.preserved(), \
            _configs_kept(model):
        return _check(model, plan, step, seed)


@contextlib.contextmanager
def _configs_kept(model: torch.nn.Module):
    """HF configs' attributes as they were: a classifier's first forward sets
    ``config.problem_type`` (ViT, ConvNeXtV2, Swin: None -> 'single_label_classification'), and
    the check must leave the model as it found it."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "__dict__") and type(c).__name__.endswith("Config")}
    saved = {k: dict(c.__dict__) for k, c in configs.items()}
    try:
        yield
    finally:
        for k, c in configs.items():
            c.__dict__.clear()
            c.__dict__.update(saved[k])


def _check(model: torch.nn.Module, plan: Plan, step: TrainStep, seed: int) -> GradientCheck:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Parameters and every buffer (non-persistent ones too): BatchNorm statistics move in a step.
    state = {k: v.detach().clone() for k, v in _tensors(model).items()}
    grads = {n: p.grad for n, p in params}
    # Generators the model owns start both runs alike (a block's own torch.Generator drew the
    # planned run's masks from where the reference run left it: "equal=False", 3.24 off).
    owned = host_rng.owned_states(model)

    def put_back() -> None:
        _restore(model, state)
        host_rng.set_owned_states(owned)
        for n, p in params:
            p.grad = grads[n]

    try:
        ref_loss, ref = _run(model, step, seed, params)
        with apply_plan(model, plan):
            put_back()  # the planned run starts from the state the reference run started from
            loss, got = _run(model, step, seed, params)
    finally:
        put_back()
    differing, worst = _compare(params, loss, got, ref_loss, ref)
    equal = not differing and _bits(loss) == _bits(ref_loss)
    cache_off = None
    if not equal and hf_cache_note(model) is not None:
        # The plan turns HF's cache off: is the difference the plan's, or the cache's?
        try:
            with hf_cache_off(model):
                off_loss, off = _run(model, step, seed, params)
        finally:
            put_back()
        cache_off = not _compare(params, loss, got, off_loss, off)[0] and _bits(loss) == _bits(off_loss)
    return GradientCheck(
        equal=equal, n_params_compared=len(params), max_abs_diff=worst, loss_planned=loss,
        loss_reference=ref_loss, differing=tuple(differing), seed=seed, equal_with_cache_off=cache_off,
    )


def _compare(params, loss, got, ref_loss, ref) -> tuple[list[str], float]:
    """(parameters whose gradients differ, the largest |difference| of loss and gradients)."""
    differing, worst = [], _diff(torch.tensor(loss), torch.tensor(ref_loss))
    for n, _ in params:
        a, b = got[n], ref[n]
        if a is None or b is None:
            if a is not b:
                differing.append(n)
                worst = math.inf
            continue
        if not _same_bits(a, b):  # bitwise: NaN gradients of the same bits are equal
            differing.append(n)
        worst = max(worst, _diff(a, b))
    return differing, worst


def _run(model, step: TrainStep, seed: int, params) -> tuple[float, dict[str, torch.Tensor | None]]:
    """One forward + backward of ``step`` (no optimizer step): its loss and every gradient, a
    DTensor's as this rank's local shard (compared locally: no collective)."""
    for _, p in params:
        p.grad = None
    host_rng.seed_all(seed)  # torch's, and Python's / numpy's (Wav2Vec2 masks with np.random)
    loss = run_step(model, step.inputs, step.loss_fn, None, keep_output=step.keep_output,
                    autocast_dtype=step.autocast_dtype, context=step.context)
    if loss is None:
        raise ValueError("the gradient check needs real tensors (the model is fake or on meta)")
    return loss, {n: (local_tensor(p.grad).detach().clone() if p.grad is not None else None) for n, p in params}


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _restore(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in _tensors(model).items():
            v.copy_(state[k])


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    d = (a.double() - b.double()).abs()
    return float(d.max()) if d.numel() else 0.0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, or the same bits (NaN where both hold the same NaN)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.layout is not torch.strided or b.layout is not torch.strided:
        return False
    # reshape(-1): a 0-dim tensor (CLIP's logit_scale) cannot be viewed as bytes.
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _bits(x: float) -> bytes:
    return torch.tensor(x, dtype=torch.float64).numpy().tobytes()
