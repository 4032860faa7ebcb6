"""Host cost of a plan's selective policy per op it sees, beside torch's own selective checkpoint.

    python benchmarks/selective_policy_cost.py                 # ~1 minute on an idle core
    python benchmarks/selective_policy_cost.py --rounds 21 --profile

A small GPT decoder (many small ops: the host's costs dominate), each block checkpointed four ways,
the same ops saved in the selective ones (every matmul and the attention's ``bmm``\\ s):

* ``plan``: ``apply_module_plans`` with a selective ``ModulePlan`` (the planner's policy);
* ``torch_sac``: ``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts`` and a
  plain policy function that counts ops as the plan does;
* ``plan_full`` / ``torch_full``: full checkpointing, the planner's and torch's;
* ``none``: no checkpoint.

One intra-op thread; each forward+backward timed by the thread's CPU time
(``time.thread_time``), the variants interleaved in a rotating order, after a warm-up round.
Printed: each variant's median step and spread (min..max); per op a selective policy sees
(forward ops plus the ops its recompute replays, counted once beforehand), the selective step less
the full step of the same family (median of the per-round differences), in us; the load average
beside it. ``--profile`` adds cProfile's top lines of the planner's selective step.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.checkpoint import (  # noqa: E402
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from examples.gpt import GPTConfig, build_gpt, gpt_loss  # noqa: E402
from planner.applying import planned_forward as pf_mod  # noqa: E402
from planner.applying.checkpointing import apply_module_plans  # noqa: E402
from planner.plan import ModulePlan, op_key  # noqa: E402

_SAVED = {"aten.addmm.default", "aten.mm.default", "aten.bmm.default"}


class _Keys(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAC_IGNORED_OPS:
            self.keys.append(op_key(str(func)))
        return func(*args, **(kwargs or {}))


def _saved_ops(model, x) -> tuple:
    """(key, occurrence) of every matmul of a block's forward."""
    block = model.blocks[0]
    rec = _Keys()
    with rec:
        block(x)
    seen: Counter = Counter()
    out = []
    for k in rec.keys:
        if k in _SAVED:
            out.append((k, seen[k]))
        seen[k] += 1
    return tuple(out), len(rec.keys)


def _torch_wrap(block, saved: frozenset | None) -> None:
    forward = block.forward

    def context():
        counts: dict[str, int] = {}

        def policy(ctx, op, *args, **kwargs):
            key = op_key(str(op))
            occ = counts.get(key, 0)
            counts[key] = occ + 1
            return CheckpointPolicy.MUST_SAVE if (key, occ) in saved else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    kw = {"use_reentrant": False}
    if saved is not None:
        kw["context_fn"] = context
    block.forward = functools.partial(checkpoint, forward, **kw)


def build(cfg: GPTConfig, batch: int):
    variants = {}
    for kind in ("none", "plan", "plan_full", "torch_sac", "torch_full"):
        model, inputs = build_gpt(cfg, batch_size=batch, seed=0)
        variants[kind] = model
    x = torch.randn(batch, cfg.seq_len, cfg.dim)
    saved, n_ops = _saved_ops(variants["none"], x)
    names = [f"GPT.blocks.{i}" for i in range(cfg.n_layer)]
    apply_module_plans(variants["plan"], [ModulePlan(fqn=n, discard_ratio=0.5, full=False, saved_ops=saved)
                                          for n in names])
    apply_module_plans(variants["plan_full"], [ModulePlan(fqn=n, discard_ratio=1.0, full=True) for n in names])
    for b in variants["torch_sac"].blocks:
        _torch_wrap(b, frozenset(saved))
    for b in variants["torch_full"].blocks:
        _torch_wrap(b, None)
    return variants, inputs, saved, n_ops


def step(model, inputs) -> None:
    gpt_loss(model(*inputs), inputs).backward()
    model.zero_grad(set_to_none=True)


def policy_ops_seen(model, inputs) -> int:
    """Ops the planner's recording and replay modes dispatch in one step (SAC-ignored ops too)."""
    n = [0]
    rec, rep = pf_mod._RecordingMode.__torch_dispatch__, pf_mod._ReplayMode.__torch_dispatch__

    def count(f):
        def wrapped(self, func, types, args=(), kwargs=None):
            if func not in SAC_IGNORED_OPS:
                n[0] += 1
            return f(self, func, types, args, kwargs)
        return wrapped

    pf_mod._RecordingMode.__torch_dispatch__ = count(rec)
    pf_mod._ReplayMode.__torch_dispatch__ = count(rep)
    try:
        step(model, inputs)
    finally:
        pf_mod._RecordingMode.__torch_dispatch__, pf_mod._ReplayMode.__torch_dispatch__ = rec, rep
    return n[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--profile", action="store_true", help="cProfile the planner's selective step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq, n_layer=args.layers, n_head=2, dim=args.dim,
                    attn_impl="math", dropout=0.1)
    variants, inputs, saved, n_ops = build(cfg, batch=2)
    seen = policy_ops_seen(variants["plan"], inputs)
    print(f"GPT {args.layers}x{args.dim}, seq {args.seq}, math attention: {n_ops} forward ops a block, "
          f"{len(saved)} saved; the policy sees {seen} ops a step (forward + replay)")
    times: dict[str, list[float]] = {k: [] for k in variants}
    kinds = list(variants)
    load0 = open("/proc/loadavg").read().split()[:3]
    for r in range(args.rounds + 1):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            t0 = time.thread_time_ns()
            step(variants[kind], inputs)
            if r:
                times[kind].append((time.thread_time_ns() - t0) / 1e6)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"load average {' '.join(load0)} -> {' '.join(load1)}; {args.rounds} rounds, thread CPU time")
    for kind in kinds:
        t = times[kind]
        print(f"  {kind:<11} {statistics.median(t):8.2f} ms  ({min(t):.2f}..{max(t):.2f})")
    for sel, full in (("plan", "plan_full"), ("torch_sac", "torch_full")):
        d = [(s - f) * 1e3 / seen for s, f in zip(times[sel], times[full])]
        print(f"  {sel} - {full}: {statistics.median(d):6.1f} us per policy op  "
              f"({min(d):.1f}..{max(d):.1f})")
    d = [(s - t) * 1e3 / seen for s, t in zip(times["plan"], times["torch_sac"])]
    print(f"  plan - torch_sac: {statistics.median(d):6.1f} us per policy op  ({min(d):.1f}..{max(d):.1f})")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step(variants["plan"], inputs)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
