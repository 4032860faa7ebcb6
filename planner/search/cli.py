"""``sac-plan search``: the fastest parallel layout that fits, before launch.

    sac-plan search --model examples:llama3_70b --gpus 64xh100 --global-batch 512 --seq-len 8192
    sac-plan search --model examples:llama3_405b --gpus 1024xh100 --global-batch 1024 --seq-len 8192 --out out/
    sac-plan search --model mypkg.models:make --gpus 16xh100 --global-batch 64 --seq-len 4096 --tp 4,8 --pp 1

``--model MODULE:FACTORY`` names a callable taking ``seq_len=`` and returning ``(model, inputs)`` of
a Llama-style decoder (``examples.llama``). Prints the ranked table (memory: the planner's per-rank
figures; time: modelled) to stdout, progress to stderr; ``--out DIR`` also writes the table, a plot
(with matplotlib), the winner as a torchtitan job config and its plan files.

Exit status: 0 a layout fits, 1 none fits, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from planner.errors import PlanningError

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"integers >= 1, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sac-plan search", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="MODULE:FACTORY, a callable taking seq_len= (examples:llama3_70b)")
    p.add_argument("--gpus", required=True, help="COUNTxDEVICE, e.g. 64xh100")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--budget-gib", type=float, help="memory per GPU a plan may use (default: the device's)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing a node's link (default 8)")
    p.add_argument("--inter-node-link", default="infiniband-ndr", help="link between nodes (default infiniband-ndr)")
    p.add_argument("--tp", type=_ints, help="tensor parallel degrees to try (default: all that divide, up to a node)")
    p.add_argument("--cp", type=_ints, default=(1, 2), help="context parallel degrees (default 1,2)")
    p.add_argument("--pp", type=_ints, help="pipeline degrees (default: 1 and powers of two up to the layers)")
    p.add_argument("--schedules", default="1F1B,Interleaved1F1B,InterleavedZeroBubble",
                   help="pipeline schedules (torchtitan's names; default 1F1B,Interleaved1F1B,InterleavedZeroBubble)")
    p.add_argument("--micro-batches", type=_ints, default=(1, 2), help="sequences per forward to try (default 1,2)")
    p.add_argument("--no-bound", action="store_true",
                   help="plan every layout, also those a lower bound of their step proves slower than one planned "
                        "(a longer search; the table then ranks them all)")
    p.add_argument("--no-hsdp", action="store_true", help="shard over every data-parallel rank (no HSDP)")
    p.add_argument("--verify-top", type=int, default=3,
                   help="trace at most this many of the fastest planned layouts with their plans (default 3)")
    p.add_argument("--top", type=int, default=20, help="rows of the ranked table (default 20)")
    p.add_argument("--out", help="write search.txt, search.png, torchtitan_job.py and plans/ here")
    p.add_argument("--workers", type=int, help="processes screening side by side (default: one per core, at most 4)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one error line")
    return p


def _factory(spec: str):
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise PlanningError(f"--model must be MODULE:FACTORY (e.g. examples:llama3_70b), got {spec!r}")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise PlanningError(f"--model {spec}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit status (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    from planner.search.layouts import Cluster, SearchSpace
    from planner.search.report import write_outputs
    from planner.search.search import SearchOptions, search

    try:
        cluster = Cluster.parse(args.gpus, gpus_per_node=args.gpus_per_node, inter_node_link=args.inter_node_link,
                                budget_gib=args.budget_gib)
        space = SearchSpace(tp=args.tp, cp=args.cp, pp=args.pp, schedules=tuple(args.schedules.split(",")),
                            micro_batches=args.micro_batches, hsdp=not args.no_hsdp)
        options = SearchOptions(space=space, verify_top=args.verify_top, progress=not args.quiet,
                                workers=args.workers, bound=not args.no_bound)
        result = search(_factory(args.model), cluster, global_batch=args.global_batch, seq_len=args.seq_len,
                        options=options)
    except (PlanningError, ValueError) as e:
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(result.table_text(top=args.top))
    if args.out:
        for path in write_outputs(result, args.out, top=args.top):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if result.winner is not None else 1
