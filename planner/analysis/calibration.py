"""Calibrate a DeviceSpec on the machine at hand: the roofline's figures, and the host cost of
the checkpoints a plan applies.

    from planner.analysis.calibration import calibrate_device
    cal = calibrate_device("cpu")               # 40-60 s on a CPU core
    print(cal.report())                         # the spec, each kernel fitted, the host costs
    plan = solve_sac(model, budget_gib, step, options=PlanOptions(device=cal.spec))

The roofline's figures (launch time, compute and bandwidth efficiencies) are fitted by
``estimators.runtime.calibrate.fit_device_spec``. The checkpoint's host costs are measured here,
on the planner's own apply path (``apply_module_plans``), with B blocks of small
transformer-like steps (layer norm, linear, GELU, views, dropout, a residual add, tanh: tiny
tensors, so the host's costs dominate), n forward ops a block, the last saving its output:
unplanned, fully and selectively (the first op cached) checkpointed. Every block is entered
after a copy of 32 MiB, in the forward and in the backward, as a step's kernels evict the
host's working set between a checkpoint's calls; and every call of its forward that dispatches
runs after one of 4 MiB (numpy's, untimed), in the forward and in the recompute: a step's
kernels stream megabytes between two ops of a module, so its host runs each op, hook and policy
look-up cold (3-8x its time hot here), and so does a recompute. The kernels (the forward without
grad) are timed hot, as the benchmark runtime times them: what a re-run op costs beyond that is
its recompute cost. The same two chains without the copies between ops give the warm cost of a
re-run op (``DeviceSpec.recompute_op_warm_ms``: after an op that streams little). Per block, a full
checkpoint adds ``call + n * (kernel + recompute_op)`` and a selective one
``call + selective_call + (n - 1) * (kernel + recompute_op) + 2 n * selective_op`` (its policy
sees n forward ops and n replayed ones; its modes and op log cost a call beside them); blocks of
two lengths, each checkpointed fully and selectively, give the four costs, the kernel time being
the block's forward without grad. A third model, the short blocks each with S nested modules that
run no op, gives the cost per submodule a call (its full checkpoint less the short one's, over
S): the wrapper walks the checkpointed module's tree on every call. On a CUDA device they are
left at 0: the host runs ahead of the kernels there and the model does not add them
(``DeviceSpec.selective_op_ms``).

The chains are timed in interleaved rounds, one round of each in turn (``CheckpointCostRounds``):
the machine's speed drifts over minutes, and chains timed one after another put that drift into
the fitted slope and intercept. A caller that times something else in rounds can run one of
these rounds in each of its own, for costs of the same minutes (``time_fidelity.py`` does).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from estimators.runtime.calibrate import DeviceFit, fit_device_spec
from estimators.runtime.device import DeviceSpec
from planner.applying.checkpointing import apply_module_plans
from planner.plan import ModulePlan, op_key

__all__ = ["CheckpointCostRounds", "CheckpointHostCosts", "Calibration", "calibrate_device", "fit_checkpoint_costs",
           "measure_checkpoint_costs", "with_host_costs"]

_BLOCKS = 8
"""Checkpointed blocks per model: per-block figures are the model's over this many."""
_SUBMODULES = 24
"""Modules nested in each block of a third model (the short chain's ops, plus that many
``nn.Identity``, which run no op): its full checkpoint less the short chain's, over this many,
is the per-submodule cost (``DeviceSpec.checkpoint_submodule_ms``)."""
_EVICT_MIB = 32
"""Copied between blocks, forward and backward: a step's kernels stream tens of MiB between a
checkpoint's calls (a decoder block's forward, a conv stage's) and evict the host's working set
(the interpreter's objects, the checkpoint's state, its RNG and state bookkeeping), and its host
costs are paid that way. 8 MiB (past a core's L2) left the per-call cost at 0.67-0.74 ms here,
32 and 64 MiB put it at 1.3-2.3 ms, what a checkpointed call cost in the conv net's step
(docs/accuracy.md#runtimes); measured hot it is lower still."""
_OP_EVICT_MIB = 4
"""Copied (numpy, no torch op) before every call of a block's forward that dispatches, in the
forward and in the recompute: twice a core's L2 here (2 MiB); 8 MiB gave the same host costs,
2 MiB lower ones. A step's kernels stream that much between two ops of a module, so the host runs
every op cold: on this CPU a layer norm, linear or batch norm call cost 36-63 us so, 8-13 us hot."""
_HOST_CACHE_BYTES = 2 * _OP_EVICT_MIB * 2**20
"""What the copy before each op reads and writes: an op moving this much before another leaves
that op's host work cold, one moving nothing (a view) warm; in between in proportion (a batch
norm call after a copy moving 2 / 4 / 8 / 16 MiB: 22.5 / 45.1 / 62.4 / 63.4 us, 12.9 after
none) (``DeviceSpec.host_cache_bytes``)."""
_CHAINS = (1, 6)
"""Steps of the short and the long block (15 and 90 forward ops): the difference gives the
per-op costs, the short block the per-call one."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointHostCosts:
    """The host costs of a checkpoint on this machine, as ``DeviceSpec`` holds them (ms)."""

    checkpoint_call_ms: float
    checkpoint_submodule_ms: float
    recompute_op_ms: float
    selective_op_ms: float
    selective_call_ms: float
    recompute_op_warm_ms: float
    """``recompute_op_ms`` measured with the host's caches warm (no copy between ops); the spec
    prices a re-run op between the two (``DeviceSpec.recompute_op_host_ms``)."""
    clock: str
    """"thread" (the calling thread's CPU time, one intra-op thread) or "wall"."""

    def scaled(self, plain: float, policy: float) -> "CheckpointHostCosts":
        """These costs with the plain checkpoint's (call, submodule, re-run op, cold and warm)
        multiplied by ``plain`` and the selective policy's (per op, per call) by ``policy``: the
        cold factor a step measured beside the chains (``benchmarks/step_host.py``)."""
        return dataclasses.replace(
            self, checkpoint_call_ms=self.checkpoint_call_ms * plain,
            checkpoint_submodule_ms=self.checkpoint_submodule_ms * plain,
            recompute_op_ms=self.recompute_op_ms * plain, recompute_op_warm_ms=self.recompute_op_warm_ms * plain,
            selective_op_ms=self.selective_op_ms * policy, selective_call_ms=self.selective_call_ms * policy)

    def summary(self) -> str:
        return (f"checkpoint host costs ({self.clock} clock): {self.checkpoint_call_ms * 1e3:.1f} us per call, "
                f"{self.checkpoint_submodule_ms * 1e3:.1f} us per submodule a call, {self.recompute_op_ms * 1e3:.1f} us "
                f"per re-run op ({self.recompute_op_warm_ms * 1e3:.1f} us warm), {self.selective_op_ms * 1e3:.1f} us per "
                f"op a selective policy sees, {self.selective_call_ms * 1e3:.1f} us per selective call")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """A spec fitted on this machine and what it was fitted to."""

    spec: DeviceSpec
    """The fitted spec: pass it as ``PlanOptions(device=cal.spec)``."""
    fit: DeviceFit
    checkpoint: CheckpointHostCosts | None
    """None on a CUDA device (not measured, not modelled)."""

    def report(self) -> str:
        lines = [f"spec: {self.spec.summary()}", f"kernels timed by the {self.fit.clock} clock:"]
        lines += [f"  {p}" for p in self.fit.points]
        c = self.checkpoint
        if c is None:
            lines.append("checkpoint host costs: not modelled on a CUDA device (hidden behind its kernels)")
        else:
            lines.append(c.summary())
        return "\n".join(lines)


class _Chain(nn.Module):
    """``k`` small transformer-like steps, each ending in an op that saves its output (so a full
    checkpoint re-runs every op): layer norm, linear (a view and addmm), GELU, views, dropout
    (random draws, kept masks), a residual add, tanh. Tiny tensors: the host costs dominate.
    ``evict`` (an :class:`_Evictor`) runs before every call that dispatches, in the forward and
    in the recompute, as a step's kernels run between them."""

    def __init__(self, k: int, submodules: int = 0, evict: "_Evictor | None" = None) -> None:
        super().__init__()
        self.k, self.w, self.b = k, nn.Parameter(torch.rand(8, 8)), nn.Parameter(torch.rand(8))
        self.subs = nn.ModuleList(nn.Identity() for _ in range(submodules))
        self.evict = evict if evict is not None else _no_evict

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (4, 8)
        e = self.evict
        for sub in self.subs:  # modules that run no op: what the wrapper walks on every call
            e()
            x = sub(x)
        for _ in range(self.k):
            e()
            y = F.layer_norm(x, (8,))
            e()
            y = F.linear(y, self.w, self.b)
            e()
            y = F.gelu(y)
            e()
            y = y.view(32)
            e()
            y = F.dropout(y.view(4, 8), 0.1, training=True)
            e()
            y = x + y
            e()
            x = torch.tanh(y)
        return x


def _no_evict() -> None:
    pass


class _Evictor:
    """Called before every call of a block's forward that dispatches (:class:`_Chain`): copies
    ``_OP_EVICT_MIB`` with numpy (no torch op: no dispatch mode, hook or policy sees it) and adds
    the time that took, by the calibration's clock, to :attr:`spent`, which the measurements
    leave out. ``on`` False: does nothing (the kernels timed hot)."""

    def __init__(self, now) -> None:
        n = _OP_EVICT_MIB * 2**20 // 8
        self.src, self.dst = np.random.default_rng(0).random(n), np.empty(n)
        self.now, self.spent, self.on, self.calls = now, 0, True, 0

    def __call__(self) -> None:
        if self.on:
            t0 = self.now()
            self._evict()
            self.spent += self.now() - t0
            self.calls += 1

    def _evict(self) -> None:
        np.copyto(self.dst, self.src)


class _Evict(torch.autograd.Function):
    """Passes ``x`` through; copies ``src`` into ``dst`` in its forward and again in its backward."""

    @staticmethod
    def forward(ctx, x, src, dst):
        dst.copy_(src)
        ctx.buffers = (src, dst)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        src, dst = ctx.buffers
        dst.copy_(src)
        return grad, None, None


@functools.lru_cache(maxsize=1)
def _scratch() -> tuple[torch.Tensor, torch.Tensor]:
    """The ``_EVICT_MIB`` copy's source and destination, one pair for every model: the chains run
    one at a time, and ``CheckpointCostRounds`` holds thirteen models at once."""
    n = _EVICT_MIB * 2**20 // 4
    return torch.rand(n), torch.empty(n)


class _Blocks(nn.Module):
    """The blocks in a row, each entered (forward and backward) after an ``_EVICT_MIB`` copy."""

    def __init__(self, k: int, submodules: int = 0, evict: _Evictor | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Chain(k, submodules, evict) for _ in range(_BLOCKS))
        self.src, self.dst = _scratch()
        self.evict = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.evict:
                x = _Evict.apply(x, self.src, self.dst)
            x = b(x)
        return x


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(op_key(str(func)))
        return func(*args, **(kwargs or {}))


def host_clock():
    """("thread", thread_time_ns) with one intra-op thread: the calling thread's CPU time, what
    the work ran and not what other processes took from it; else ("wall", perf_counter_ns)."""
    if torch.get_num_threads() == 1:
        return "thread", time.thread_time_ns
    return "wall", time.perf_counter_ns


@dataclasses.dataclass(frozen=True)
class _ChainCosts:
    ops: int
    """Forward ops of one block, as a trace counts them."""
    full_ms: float
    selective_ms: float
    kernels_ms: float


class _ChainRounds:
    """One chain's models (unplanned, full, selective), timed a round at a time (``run``), so
    that the chains a fit compares are timed in the same minutes (``CheckpointCostRounds``).
    ``costs``, per block in ms: full - unplanned, selective (its first op cached) - unplanned,
    the forward without grad (its kernels); medians over paired rounds. ``full_only``: the first
    alone (the others 0). ``cold`` False: no copy before each op (the host's caches warm)."""

    def __init__(self, k: int, now, submodules: int = 0, *, full_only: bool = False, cold: bool = True) -> None:
        self.x = x = torch.rand(4, 8, requires_grad=True)
        counter = _Count()
        with counter:
            _Chain(k)(x)
        self.ops = len(counter.ops)
        first = (counter.ops[0], 0)
        names = [f"_Blocks.blocks.{i}" for i in range(_BLOCKS)]
        plans = {"none": None, "full": [ModulePlan(fqn=n, discard_ratio=1.0, full=True) for n in names],
                 "selective": [ModulePlan(fqn=n, discard_ratio=0.5, full=False, saved_ops=(first,)) for n in names]}
        if full_only:
            del plans["selective"]
        self.now, self.full_only, self.cold = now, full_only, cold
        self.evict = evict = _Evictor(now)
        evict.on = cold
        self.models = {}
        for kind, mods in plans.items():
            self.models[kind] = m = _Blocks(k, submodules, evict)
            if mods:
                apply_module_plans(m, mods)
        self.times: dict[str, list[float]] = {kind: [] for kind in (*self.models, "no_grad", "selective")}

    def run(self, record: bool) -> None:
        now, evict, x = self.now, self.evict, self.x
        for kind, m in self.models.items():
            t0, spent = now(), evict.spent
            m(x).sum().backward()
            if record:  # the evictions' own time left out
                self.times[kind].append((now() - t0 - (evict.spent - spent)) / 1e6)
        if self.full_only:
            return
        with torch.no_grad():
            # The kernels alone, hot, as the benchmark times them: what the recompute pays
            # beyond that (cold) is the per-op cost.
            self.models["none"].evict, evict.on = False, False
            t0 = now()
            self.models["none"](x)
            if record:
                self.times["no_grad"].append((now() - t0) / 1e6)
            self.models["none"].evict, evict.on = True, self.cold

    def costs(self) -> _ChainCosts:
        t = self.times
        full = statistics.median(f - n for f, n in zip(t["full"], t["none"])) / _BLOCKS
        if self.full_only:
            return _ChainCosts(self.ops, full, 0.0, 0.0)
        sel = statistics.median(s - n for s, n in zip(t["selective"], t["none"])) / _BLOCKS
        return _ChainCosts(self.ops, full, sel, statistics.median(t["no_grad"]) / _BLOCKS)


def _fit_full(ops: tuple[int, int], full: tuple[float, float], kernels: float) -> tuple[float, float, float]:
    """(call, recompute_op, kernel + recompute_op) ms from the full checkpoints of two chains."""
    (n1, n2), (f1, f2) = ops, full
    per_op = (f2 - f1) / (n2 - n1)
    return f1 - n1 * per_op, per_op - kernels / n2, per_op


def fit_checkpoint_costs(ops: tuple[int, int], full: tuple[float, float], selective: tuple[float, float],
                         kernels: float) -> tuple[float, float, float, float]:
    """(call, recompute_op, selective_op, selective_call) ms from per-block figures of two
    chains of ``ops`` forward ops: the ``full`` and ``selective`` overheads of both and the
    no-grad forward ``kernels`` of the longer (the model of the module docstring, solved; each
    at least 0)."""
    (n1, n2), (f1, f2), (s1, s2) = ops, full, selective
    call, recompute_op, per_op = _fit_full(ops, full, kernels)
    # s(n) - f(n) = selective_call - per_op + 2 n selective_op; the per-call cost is solved
    # from the clamped per-op one (a negative policy cost would otherwise inflate it)
    policy = max(0.0, ((s2 - f2) - (s1 - f1)) / (2 * (n2 - n1)))
    selective_call = ((s1 - f1) + (s2 - f2)) / 2 + per_op - (n1 + n2) * policy
    return max(0.0, call), max(0.0, recompute_op), policy, max(0.0, selective_call)


_CONFIGS = (dict(k=_CHAINS[0]), dict(k=_CHAINS[1]), dict(k=_CHAINS[0], submodules=_SUBMODULES, full_only=True),
            dict(k=_CHAINS[0], full_only=True, cold=False), dict(k=_CHAINS[1], cold=False))
"""The chains the fit reads: short and long (cold), the short with nested modules, and the two
warm (no copies between ops)."""


class CheckpointCostRounds:
    """The checkpoint's host costs measured a round at a time: each ``run()`` times one round of
    every chain the fit reads (``_fit_chain_costs``), one chain after another, and ``costs()``
    fits what the rounds so far measured. A caller that times something else in rounds runs one
    of these in each of its own, and the costs it gets are those of the same minutes: the
    machine's speed drifts between minutes, and these costs with it (docs/accuracy.md, round 30).
    Built with one warm-up round; one intra-op thread, as ``calibrate_device``."""

    def __init__(self) -> None:
        self.clock, now = host_clock()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._chains = [_ChainRounds(now=now, **c) for c in _CONFIGS]
            for c in self._chains:
                c.run(record=False)
        self.rounds = 0

    def run(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in self._chains:
                c.run(record=True)
        self.rounds += 1

    def costs(self) -> CheckpointHostCosts:
        if not self.rounds:
            raise ValueError("CheckpointCostRounds.costs() before any run(): nothing was timed")
        return _fit_chain_costs([c.costs() for c in self._chains], self.clock)


def _fit_chain_costs(chains: list[_ChainCosts], clock: str) -> CheckpointHostCosts:
    """The host costs from the per-block figures of the chains of ``_CONFIGS``, in that order."""
    short, long, nested, short_warm, long_warm = chains
    call, recompute_op, policy, selective_call = fit_checkpoint_costs(
        (short.ops, long.ops), (short.full_ms, long.full_ms), (short.selective_ms, long.selective_ms),
        long.kernels_ms)
    warm = _fit_full((short.ops, long.ops), (short_warm.full_ms, long_warm.full_ms), long_warm.kernels_ms)[1]
    return CheckpointHostCosts(checkpoint_call_ms=call, recompute_op_ms=recompute_op, selective_op_ms=policy,
                               selective_call_ms=selective_call,
                               checkpoint_submodule_ms=max(0.0, (nested.full_ms - short.full_ms) / _SUBMODULES),
                               recompute_op_warm_ms=max(0.0, min(warm, recompute_op)), clock=clock)


def measure_checkpoint_costs(rounds: int = 15) -> CheckpointHostCosts:
    """The host costs of a checkpoint on this CPU (see the module docstring), ``rounds`` rounds
    of every chain, interleaved (``CheckpointCostRounds``): timed one chain after another, the
    machine's drift between them went into the fitted slope and intercept. The copies take most
    of its time."""
    timed = CheckpointCostRounds()
    for _ in range(rounds):
        timed.run()
    return timed.costs()


def with_host_costs(spec: DeviceSpec, costs: CheckpointHostCosts) -> DeviceSpec:
    """``spec`` with the checkpoint's host costs of ``costs`` (and the host's cache size the
    warm cost is fitted for)."""
    return spec.replace(checkpoint_call_ms=costs.checkpoint_call_ms,
                        checkpoint_submodule_ms=costs.checkpoint_submodule_ms,
                        recompute_op_ms=costs.recompute_op_ms, selective_op_ms=costs.selective_op_ms,
                        selective_call_ms=costs.selective_call_ms,
                        recompute_op_warm_ms=costs.recompute_op_warm_ms, host_cache_bytes=_HOST_CACHE_BYTES)


def calibrate_device(base: DeviceSpec | str = "cpu", *, device: str | torch.device | None = None,
                     rounds: int = 15) -> Calibration:
    """``base`` fitted to this machine: its roofline figures and, on a CPU, the checkpoint's
    host costs (see the module docstring). Use one intra-op thread for the figures a one-thread
    step runs at (``torch.set_num_threads(1)``); the kernels are then timed in thread CPU time."""
    fit = fit_device_spec(base, device=device)
    if fit.spec.is_cuda or (device is not None and torch.device(device).type == "cuda"):
        return Calibration(spec=fit.spec, fit=fit, checkpoint=None)
    costs = measure_checkpoint_costs(rounds)
    return Calibration(spec=with_host_costs(fit.spec, costs), fit=fit, checkpoint=costs)
