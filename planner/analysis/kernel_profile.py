"""Kernel prices taken from real steps of the model: each op timed where the step runs it.

    from planner.analysis.kernel_profile import profile_step_kernels
    prof = profile_step_kernels(model, step)          # 5 real steps on a copy, op by op
    bench = prof.runtime()                             # a BenchmarkRuntime holding those timings
    with benchmark_runtime_override(bench):
        plan = solve_sac(model, budget_gib, step, options=PlanOptions(
            device=cal.spec, trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK)))

Why: ``RuntimeKind.BENCHMARK`` times each kernel alone, warm, on the same operands run after
run. In a step the kernels around it have evicted its operands and its output's memory, and the
one before it is another op: on this project's CPU the decoder's kernels ran 8 % over their
isolated benchmark in the step (element-wise ops and reductions 1.2-2.4x, matmuls 1.0-1.07x),
and a recompute re-runs those ops at their in-step cost. Timed in the step, each signature's
price is the median of its calls over a few steady-state steps (every layer's call of it, every
step), what a recompute of it costs there. A signature the profiled steps did not run (an op
only a plan's recompute runs) is benchmarked as before.

The steps run on a deep copy of the model with its own optimizer (the loop of ``step``:
micro-batches, autocast, gradient reset), under ``torch.random.fork_rng``: the model, its
gradients and the caller's random state are as they were (the gradients of inputs and of tensors
the loss closes over, which the copy's backward can reach, are put back). The step has to run: where the
unplanned step does not fit, profile a copy with a plan applied (full AC runs every forward op,
twice). CPU only, one process: a GPU's kernels are timed by ``BenchmarkRuntime(device="cuda")``
with CUDA events, where the host's cache state does not move them.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from estimators.runtime.device import get_device_spec
from estimators.runtime.kernel_bench import BenchmarkRuntime
from estimators.runtime.op_facts import timed_key
from estimators.step.optimizer import check_optimizer_params, resolve_optimizer
from estimators.step.train_step import TrainStep, run_step, step_mode, zero_grads
from planner.analysis.calibration import host_clock
from planner.analysis.measure import check_real, gc_frozen

__all__ = ["KernelProfile", "OpTimer", "profile_step_kernels"]


@dataclass(frozen=True, kw_only=True)
class KernelProfile:
    """Each op signature's median time in the profiled steps (ms), keyed as the benchmark
    runtime's cache names it (``estimators.runtime.op_facts.timed_key``)."""

    timings_ms: dict[str, float]
    calls: int
    """Op calls timed, over every profiled step."""
    steps: int
    clock: str
    """"thread" (the calling thread's CPU time, one intra-op thread) or "wall"."""

    def runtime(self, **kwargs: Any) -> BenchmarkRuntime:
        """A CPU ``BenchmarkRuntime`` on this profile's clock (``kwargs`` passed on) that prices
        these signatures by their in-step times and benchmarks any other. No cache file: in-step
        times are not the isolated timings a cache file holds for later runs."""
        if "cache_path" in kwargs or torch.device(kwargs.get("device", "cpu")).type != "cpu":
            raise ValueError("KernelProfile.runtime() is a CPU runtime without a cache file: in-step times "
                             "are not isolated benchmarks; drop cache_path / device")
        if kwargs.setdefault("clock", self.clock) != self.clock:
            raise ValueError(f"the profile was timed by the {self.clock} clock; its runtime must be too, "
                             f"got clock={kwargs['clock']!r}")
        bench = BenchmarkRuntime(**kwargs)
        bench.import_cache(self.timings_ms)
        return bench

    def summary(self) -> str:
        return (f"{len(self.timings_ms)} op signatures timed in {self.steps} steps "
                f"({self.calls:,} calls, {self.clock} clock)")


class OpTimer(TorchDispatchMode):
    """Times every op that launches a kernel by ``host_clock`` (fixed when it is built), under
    its benchmark key, while entered; it may be entered around many steps, and ``profile``
    gives each signature's median over them. Entered outermost, it times the kernel alone:
    modes entered inside it (a checkpoint's) run first. Keeps every sample: one profiled step
    of a small model is a few thousand calls."""

    def __init__(self) -> None:
        super().__init__()
        self.clock, self.now = host_clock()
        self.samples: defaultdict[str, list[int]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        t0 = self.now()
        out = func(*args, **kwargs)
        elapsed = self.now() - t0
        with _disable_current_modes():
            key = timed_key(func, args, kwargs, out)
        if key is not None:
            self.samples[key[1]].append(elapsed)
        return out

    def profile(self, steps: int) -> KernelProfile:
        """The medians of what was timed, as a profile of ``steps`` steps."""
        return KernelProfile(timings_ms={k: statistics.median(v) / 1e6 for k, v in self.samples.items()},
                             calls=sum(map(len, self.samples.values())), steps=steps, clock=self.clock)


def _copy_optimizer(optimizer: Any, model: torch.nn.Module, copied: torch.nn.Module) -> torch.optim.Optimizer | None:
    """``step.optimizer`` over the copy's parameters: built from a name or class, or (an
    instance) a new one of its type and hyper-parameters, group by group; never the user's
    instance, whose state would change."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        twin = {id(p): q for p, q in zip(model.parameters(), copied.parameters())}
        check_optimizer_params(model, optimizer, twin.keys(), "profile",
                               ": over another copy its step would not be timed")
        groups = [{"params": [twin[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    else:
        groups = [{"params": [p for p in copied.parameters() if p.requires_grad]}]
    return resolve_optimizer(optimizer, groups, get_device_spec("cpu"), fake=False)


@contextlib.contextmanager
def _grads_kept(model: torch.nn.Module, step: TrainStep):
    """The gradients of what the copy's steps can still reach, as they were on the way out: the
    batch's tensors and those the loss closes over are not copied (an input that requires grad,
    a loss that reads the user's model, e.g. a tied head), so their backward writes there."""
    reach = [*model.parameters(), *(t for t in tree_flatten(step.inputs)[0] if isinstance(t, torch.Tensor)),
             *step.loss_closure_tensors(model)]
    kept = [(t, t.grad, None if t.grad is None else t.grad.detach().clone()) for t in reach if t.requires_grad]
    try:
        yield
    finally:
        for t, grad, values in kept:
            if grad is not None:
                grad.copy_(values)  # accumulation writes into the same tensor
            t.grad = grad


def profile_step_kernels(model: torch.nn.Module, step: TrainStep, *, steps: int = 5,
                         warmup: int = 2) -> KernelProfile:
    """Run ``warmup`` + ``steps`` real training steps of ``step`` on a copy of ``model`` and
    time every op of the last ``steps`` (see the module docstring). Time it with one intra-op
    thread (``torch.set_num_threads(1)``) for thread CPU time, as the benchmark runtime does.
    The steps run under ``measure.gc_frozen``: a full ``gc.collect()`` on entry, the heap frozen
    until the profile returns."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or \
            isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"steps must be an int >= 1 and warmup an int >= 0, got {steps!r}, {warmup!r}")
    check_real(model, "profiling")
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    if devices - {"cpu"}:
        raise ValueError(f"profile_step_kernels times kernels on the CPU and the model is on {sorted(devices)}: "
                         "a GPU's kernels are timed by BenchmarkRuntime(device='cuda') (CUDA events)")
    m = copy.deepcopy(model)
    opt = _copy_optimizer(step.optimizer, model, m)
    timer = OpTimer()
    held: list = [None]

    def run() -> None:
        run_step(m, step.inputs, step.loss_fn, opt, micro_batches=step.micro_batches,
                 autocast_dtype=step.autocast_dtype, keep_output=step.keep_output, held_output=held,
                 context=step.context)

    with torch.random.fork_rng(devices=[]), step_mode(m, step.train_mode), _grads_kept(model, step), gc_frozen():
        for i in range(warmup + steps):
            if i:
                zero_grads(m, opt, step.zero_grad)
            gc.collect()
            if i < warmup:
                run()
            else:
                with timer:
                    run()
    return timer.profile(steps)
