"""solve_sac from several threads at once (planner/planning/solve.py, estimators/tracing/thread_state.py):
planning changes no process-wide state that outlives it, and nothing another thread sees while it runs
(torch.compile compiles there; the model trains there)."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from estimators.tracing.estimation import EstimateOptions, TraceMode
from planner import PlanOptions, TrainStep, solve_sac

pytestmark = pytest.mark.slow  # each plans two models in two threads (dynamo compiles in some)


def _process_settings() -> dict:
    """torch's (and Python's) settings shared by every thread."""
    import torch._dynamo
    from torch._dynamo import eval_frame

    stance = eval_frame._stance
    return {
        "stance object": (id(stance), type(stance), stance.stance, stance.skip_guard_eval_unsafe, stance.backend),
        "dynamo config": torch._dynamo.config.get_config_copy(),
        "default dtype": torch.get_default_dtype(),
        "default device": str(torch.get_default_device()),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "matmul precision": torch.get_float32_matmul_precision(),
        "backends": (torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                     torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32),
        "warn always": torch._C._get_warnAlways(),
        "fx tracing": torch.fx._symbolic_trace._is_fx_tracing_flag,
        "cpu rng": torch.get_rng_state().tolist(),
        "fullgraph frame count": torch._C._dynamo.eval_frame.set_fullgraph_compiled_frame_count(-1),
        "python gc": gc.isenabled(),
        "recursion limit": sys.getrecursionlimit(),
        "warning filters": list(warnings.filters),
        "root log level": logging.getLogger().level,
        "autocast kernels": torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "AutocastPrivateUse1"),
    }


def _thread_settings() -> dict:
    """torch's settings of the calling thread."""
    return {
        "grad": (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "saved tensors hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "dispatch keys": (repr(torch._C._dispatch_tls_local_include_set()),
                          repr(torch._C._dispatch_tls_local_exclude_set())),
        "functorch layers": torch._C._functorch.get_dynamic_layer_stack_depth(),
        "eval frame callback": torch._C._dynamo.eval_frame.get_eval_frame_callback(),
        "tracing context": torch._guards.TracingContext.try_get(),
    }


def _model(seed: int, compiled: bool) -> nn.Module:
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16))
    return nn.Sequential(torch.compile(body, backend="eager") if compiled else body, nn.Linear(16, 4))


def _run_threads(*targets) -> list:
    results: list = [None] * len(targets)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # reported in the test's thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_two_threads_planning_leave_every_torch_global_as_they_found_it():
    models = {seed: _model(seed, compiled=seed == 1) for seed in (1, 2)}
    batch = torch.randn(8, 16)
    torch.manual_seed(7)
    before = _process_settings()

    def plan(seed: int, mode: TraceMode):
        model = models[seed]
        mine = _thread_settings()
        solve_sac(model, 1.0, TrainStep(inputs=batch, optimizer="adamw"),
                  options=PlanOptions(device="cpu", trace=EstimateOptions(mode=mode)))
        assert _thread_settings() == mine  # the planning thread's own settings too
        return True

    for _ in range(2):  # the race that left the stance at force_eager is not every time
        _run_threads(lambda: plan(1, TraceMode.FAKE), lambda: plan(2, TraceMode.REAL))
    after = _process_settings()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    torch._dynamo.reset()


def _gate() -> tuple[nn.Module, threading.Event, threading.Event]:
    """A module that holds the trace (its forward on fake tensors, once) until ``done`` is set,
    ``in_trace`` set meanwhile. The events are in the closure: the fake copy deep-copies modules."""
    in_trace, done = threading.Event(), threading.Event()

    class Gate(nn.Module):
        def forward(self, x):
            if is_fake(x) and not in_trace.is_set():
                in_trace.set()
                done.wait(120)
            return x

    return Gate(), in_trace, done


def _plan_while(model: nn.Module, in_trace: threading.Event, done: threading.Event, meanwhile) -> list:
    """solve_sac(model) in one thread, ``meanwhile()`` in another while the trace is held."""
    def plan():
        try:
            return solve_sac(model, 1.0, TrainStep(inputs=torch.randn(8, 16), optimizer="adamw"),
                             options=PlanOptions(device="cpu"))
        finally:
            in_trace.set()

    def other():
        assert in_trace.wait(120)
        try:
            return meanwhile()
        finally:
            done.set()

    return _run_threads(plan, other)


def test_a_compiled_model_planned_while_another_thread_compiles():
    """The other thread compiles while the trace runs (it waits for it); the planned model's
    compiled block compiles nothing while planned, and compiles when it trains after."""
    graphs = {"block": 0, "other": 0}

    def counting(key):
        def backend(gm, example_inputs):
            graphs[key] += 1
            return gm.forward
        return backend

    gate, in_trace, done = _gate()
    body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = nn.Sequential(gate, torch.compile(body, backend=counting("block")), nn.Linear(16, 4))
    other = torch.compile(lambda x: torch.sin(x) * 2, backend=counting("other"))
    _plan_while(model, in_trace, done, lambda: other(torch.randn(3)))
    assert graphs == {"block": 0, "other": 1}, graphs  # other: 0 when planning turned compile off
    model(torch.randn(8, 16)).sum().backward()
    assert graphs["block"] == 1, "the planned model's compiled block no longer compiles"
    torch._dynamo.reset()


def test_another_thread_trains_the_model_while_it_is_planned():
    """The trace's hooks on the user's model (calls of the model itself from the step are
    refused, buffer-only modules put back) act on the planning thread's calls only."""
    gate, in_trace, done = _gate()
    torch.manual_seed(0)
    model = nn.Sequential(gate, nn.Linear(16, 16), nn.BatchNorm1d(16, affine=False), nn.Linear(16, 4))

    def train():
        model(torch.randn(8, 16) + 3).sum().backward()  # raised "calls ... of the model itself"
        return model[2].running_mean.clone()

    _, stats = _plan_while(model, in_trace, done, train)
    assert stats.abs().sum() > 0 and torch.equal(model[2].running_mean, stats)  # its step counted, kept
