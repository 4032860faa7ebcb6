"""What a plan's recompute overhead is made of, measured in the step, beside the runtime model's terms.

    python benchmarks/recompute_breakdown.py --families gpt --rounds 7

For each family and plan of ``time_fidelity.py`` (same calibration, same kernel prices), on
one intra-op thread, by the thread's CPU time:

* forward and backward of the step, unplanned and planned, interleaved rounds, each timed step
  right after an untimed one of the same variant (as ``time_fidelity.py``): the overhead split
  into what the forward adds (the checkpoint's entry, saved-tensor hooks, the policy's recording)
  and what the backward adds (the recompute and what wraps it);
* inside the backward, each planned module's recompute timed whole (``StateKeeper``'s second
  call), in rounds of their own;
* the checkpoint's saved-tensor hooks, timed whole (the unpack hook runs the recompute);
* in other rounds, every op the step dispatches timed one by one by an outer dispatch mode (so
  under the plan's own modes: kernels and what dispatch does below Python), split into forward,
  backward and recompute ops: what is left of each phase is host time;
* in the first round, every op the recompute dispatches timed one by one (a dispatch mode pushed
  inside the recompute, under the plan's replay mode: a cached op is timed as its look-up),
  summed per op over each plan's recompute beside the kernel time the trace priced it at
  (cached ops left out).

Printed per plan: measured forward / backward / step overhead; the recompute's in-step time and
its op kernels' in-step time beside the predicted kernels, host per-op, per-call and policy terms.
Exploratory: it has no pass line; docs/accuracy.md#runtimes quotes what it found.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import time_fidelity as tf  # noqa: E402
from benchmarks.step_host import op_host_ms, predicted_terms  # noqa: E402
from estimators.runtime.models import RuntimeKind, benchmark_runtime_override  # noqa: E402
from estimators.step.train_step import split_inputs  # noqa: E402
from estimators.tracing.estimation import EstimateOptions  # noqa: E402
from estimators.tracing.sac import last_saved  # noqa: E402
from planner.analysis.calibration import calibrate_device  # noqa: E402
from planner.analysis.measure import gc_frozen  # noqa: E402
from planner.applying import forward_state  # noqa: E402
from planner.applying.checkpointing import apply_plan  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.plan import op_key  # noqa: E402


class _OpTimer(TorchDispatchMode):
    def __init__(self, sink: list, tag=None) -> None:
        super().__init__()
        self.sink = sink
        self.tag = tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time_ns()
        out = func(*args, **(kwargs or {}))
        t = (time.thread_time_ns() - t0) / 1e6
        if self.tag is None:
            self.sink.append((op_key(str(func)), t))
        else:
            self.sink.append((self.tag(), op_key(str(func)), t))
        return out


class _Probe:
    """Patches ``StateKeeper.__call__``: times each recompute (whole, or op by op)."""

    def __init__(self) -> None:
        self.mode = "off"
        self.whole: dict[str, float] = defaultdict(float)
        self.ops: dict[str, list] = defaultdict(list)
        self.names: dict[int, str] = {}
        self._orig = forward_state.StateKeeper.__call__

    def __enter__(self):
        probe, orig = self, self._orig
        self.hook_ms = defaultdict(float)
        hooks_init = self._hooks_init = torch.autograd.graph.saved_tensors_hooks.__init__

        def init(hooks, pack, unpack):
            if type(hooks).__name__ != "_checkpoint_hook":
                return hooks_init(hooks, pack, unpack)

            def timed(f, name):
                def g(x):
                    t0 = time.thread_time_ns()
                    try:
                        return f(x)
                    finally:
                        probe.hook_ms[name] += (time.thread_time_ns() - t0) / 1e6
                return g
            return hooks_init(hooks, timed(pack, "pack"), timed(unpack, "unpack"))

        torch.autograd.graph.saved_tensors_hooks.__init__ = init

        def call(keeper, *args, **kwargs):
            if keeper.calls == 0 or probe.mode == "off":
                return orig(keeper, *args, **kwargs)
            name = probe.names.get(id(keeper.module), "?")
            if probe.mode == "whole":
                t0 = time.thread_time_ns()
                try:
                    return orig(keeper, *args, **kwargs)
                finally:
                    probe.whole[name] += (time.thread_time_ns() - t0) / 1e6
            sink = probe.ops[name]
            with _OpTimer(sink):
                return orig(keeper, *args, **kwargs)

        forward_state.StateKeeper.__call__ = call
        return self

    def __exit__(self, *exc):
        forward_state.StateKeeper.__call__ = self._orig
        torch.autograd.graph.saved_tensors_hooks.__init__ = self._hooks_init


def _fw_bw(model, step, opt) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    gc.collect()
    args, kwargs = split_inputs(step.inputs)
    t0 = time.thread_time_ns()
    loss = step.loss_fn(model(*args, **kwargs), step.inputs) if step.loss_fn else model(*args, **kwargs)
    t1 = time.thread_time_ns()
    loss.backward()
    t2 = time.thread_time_ns()
    opt.step()
    return (t1 - t0) / 1e6, (t2 - t1) / 1e6


def _kernel_split(model, step, opt) -> dict[str, float]:
    """One step under an outer op timer: per phase, its total time and its ops' time (the ops
    run below the plan's modes, so their time is kernels and what dispatch does under Python);
    backward ops split into the recompute's and the rest."""
    from planner.applying.offload import in_recompute

    model.zero_grad(set_to_none=True)
    gc.collect()
    args, kwargs = split_inputs(step.inputs)
    sink: list = []
    phase = ["fw"]
    out: dict[str, float] = defaultdict(float)
    with _OpTimer(sink, lambda: "rc" if in_recompute() else phase[0]):
        t0 = time.thread_time_ns()
        loss = step.loss_fn(model(*args, **kwargs), step.inputs)
        t1 = time.thread_time_ns()
        phase[0] = "bw"
        loss.backward()
        t2 = time.thread_time_ns()
    opt.step()
    out["fw total"], out["bw total"] = (t1 - t0) / 1e6, (t2 - t1) / 1e6
    for tag, _, t in sink:
        out[f"{tag} ops"] += t
        out[f"{tag} n"] += 1
    return dict(out)


def rerun_ops_table(plan, dispatched: list, info, spec, trace=None) -> list[tuple[str, int, float, float]]:
    """(op, times re-run, in-step ms, priced ms) per op key the plan's recompute re-runs, most
    time first: the in-step figure sums the op's dispatches in the first timed round (a cached
    op's look-up is left out: it is not re-run), the priced one the trace's kernel time."""
    rerun_keys = set()
    priced: dict[str, float] = defaultdict(float)
    for mp in plan.modules:
        s = info.stats(mp.fqn)
        saved = set(mp.saved_ops)
        for o, host in zip(s.ops[: last_saved(s.ops) + 1], op_host_ms(info, mp.fqn, spec, trace)):
            if (op_key(o.func), o.occurrence) not in saved:
                rerun_keys.add(op_key(o.func))
                priced[op_key(o.func)] += o.runtime_ms - host
    cached = {k for mp in plan.modules for k, _ in mp.saved_ops} - rerun_keys
    measured: dict[str, list[float]] = defaultdict(list)
    for k, t in dispatched:
        if k not in cached:
            measured[k].append(t)
    rows = [(k, len(measured[k]), sum(measured[k]), priced.get(k, 0.0)) for k in measured]
    return sorted(rows, key=lambda r: -r[2])


def print_ops(v, dispatched: list, info, spec, trace=None, top: int = 12) -> None:
    rows = rerun_ops_table(v.plan, dispatched, info, spec, trace)
    print(f"{'op (' + v.name + ' recompute)':40} {'n':>4} {'in-step ms':>10} {'priced ms':>10}")
    for k, n, ms, pr in rows[:top]:
        print(f"{k:40} {n:4d} {ms:10.2f} {pr:10.2f}")
    rest = rows[top:]
    if rest:
        print(f"{'(' + str(len(rest)) + ' more)':40} {sum(r[1] for r in rest):4d} {sum(r[2] for r in rest):10.2f} "
              f"{sum(r[3] for r in rest):10.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["gpt"], choices=list(tf.FAMILIES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--kernels", choices=("step", "benchmark"), default="step",
                   help="as time_fidelity.py: kernels priced by their time in unplanned steps (default) or alone")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    tf.keep_freed_memory()
    cal = calibrate_device("cpu")
    print(f"load {tf.load_average()}\n{cal.report()}\n")
    options = PlanOptions(device=cal.spec, reserve_gib=0, trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
    for family in args.families:
        model, step = tf.FAMILIES[family]()
        bench, how = tf.kernel_runtime(model, step, args.kernels)
        print(f"{family}: {how}")
        with benchmark_runtime_override(bench):
            variants, est = tf.variants_of(model, step, options)
        info = est.module_info
        runs = []
        for v in variants:
            m = copy.deepcopy(model)
            if v.plan is not None:
                apply_plan(m, v.plan)
            runs.append((v, m, torch.optim.AdamW(m.parameters(), lr=1e-4)))
        with _Probe() as probe, gc_frozen():
            for v, m, _ in runs:
                for fqn, mod in m.named_modules():
                    probe.names[id(mod)] = fqn
            for _ in range(2):
                for _, m, opt in runs:
                    _fw_bw(m, step, opt)
            fw, bw = defaultdict(list), defaultdict(list)
            whole = defaultdict(list)
            split = defaultdict(list)
            hooks = defaultdict(list)
            ops: dict[str, list] = defaultdict(list)
            for r in range(args.rounds):
                for k in range(len(runs)):
                    v, m, opt = runs[(r + k) % len(runs)]
                    probe.mode = "off"
                    _fw_bw(m, step, opt)  # settles: the timed step follows one of its own (time_fidelity)
                    f, b = _fw_bw(m, step, opt)
                    fw[v.name].append(f)
                    bw[v.name].append(b)
                    probe.mode, probe.whole, probe.hook_ms = "whole", defaultdict(float), defaultdict(float)
                    _fw_bw(m, step, opt)
                    whole[v.name].append(sum(probe.whole.values()))
                    hooks[v.name].append(dict(probe.hook_ms))
                    probe.mode = "off"
                    split[v.name].append(_kernel_split(m, step, opt))
                    if r == 0:
                        probe.mode, probe.ops = "ops", defaultdict(list)
                        _fw_bw(m, step, opt)
                        ops[v.name] = [x for lst in probe.ops.values() for x in lst]
        print(f"== {family}  load {tf.load_average()}")
        base = variants[0].name
        for v, m, _ in runs[1:]:
            d_fw = statistics.median(a - b for a, b in zip(fw[v.name], fw[base]))
            d_bw = statistics.median(a - b for a, b in zip(bw[v.name], bw[base]))
            rec = statistics.median(whole[v.name])
            op_ms = sum(t for _, t in ops[v.name])
            terms = predicted_terms(info, v.plan, options.spec, est.trace)
            n_mod = len(v.plan.modules)
            n_sel = sum(1 for mp in v.plan.modules if mp.saved_ops)
            print(f"{v.name:20} {n_mod} modules ({n_sel} selective); pred {v.predicted_recompute_ms:7.1f} = "
                  + ", ".join(f"{k} {x:.1f}" for k, x in terms.items()))
            print(f"{'':20} measured: fw {d_fw:+7.1f}  bw {d_bw:+7.1f}  step {d_fw + d_bw:+7.1f}; "
                  f"recompute in-step {rec:7.1f} ({len(ops[v.name])} ops dispatched, their time {op_ms:.1f}); "
                  f"pack hooks {statistics.median(h.get('pack', 0) for h in hooks[v.name]):.1f}, unpack hooks "
                  f"{statistics.median(h.get('unpack', 0) for h in hooks[v.name]):.1f}")
        keys = ("fw total", "fw ops", "fw n", "bw total", "bw ops", "bw n", "rc ops", "rc n")
        print(f"{'split (median over rounds)':20} " + " ".join(f"{k:>9}" for k in keys))
        for v, _, _ in runs:
            med = {k: statistics.median(d.get(k, 0.0) for d in split[v.name]) for k in keys}
            print(f"{v.name:20} " + " ".join(f"{med[k]:9.1f}" for k in keys))
        # per op kernel: in-step time vs the trace's, for every plan (what its recompute re-ran)
        for v, _, _ in runs[1:]:
            print_ops(v, ops[v.name], info, options.spec, est.trace)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
