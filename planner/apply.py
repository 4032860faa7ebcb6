"""Plan, apply and check selective activation checkpointing from the command line.

With no arguments it runs the built-in example end to end on this machine: trace one step of a
small GPT in fake mode, solve for a budget between the smallest reachable peak and the no-AC peak,
print the plan, apply it, run one real training step and print the predicted peak beside the
measured one.

    python -m planner.apply
    python -m planner.apply --model examples:convnet_demo --budget-gib 0.011
    python -m planner.apply --model examples:llama3_70b --device h100 --budget-gib 80 \\
        --world-size 64 --no-verify --plan-out llama70b.json
    python -m planner.apply --model mypkg.models:make --plan-in plan.json   # re-check a saved plan

``--model MODULE:FACTORY`` names a zero-argument callable returning ``(model, inputs)`` (see
examples/__init__.py); a model with a ``loss_fn(output, inputs)`` method is trained on it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any, Sequence

import torch

from estimators.device import DEVICE_SPECS, get_device_spec
from estimators.estimate import EstimateOptions, TraceMode, estimate, resolve_optimizer
from estimators.step import TrainStep
from planner.checkpointing import apply_plan
from planner.measure import measure_steps
from planner.plan import GiB, Plan
from planner.report import fmt_bytes, steps_vs_prediction
from planner.solve import default_reserve_bytes, plan_for_budget
from solver import SolverOptions, min_reachable_peak_bytes

__all__ = ["main"]

logger = logging.getLogger("planner.apply")

DEFAULT_MODEL = "examples:gpt_demo"
VERIFY_STEPS = 3


class CLIError(SystemExit):
    def __init__(self, msg: str) -> None:
        super().__init__(f"error: {msg}")


def load_factory(spec: str):
    """``MODULE:FACTORY`` -> the callable, with errors that say what to fix."""
    if ":" not in spec:
        raise CLIError(f"--model must look like MODULE:FACTORY (e.g. {DEFAULT_MODEL}), got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise CLIError(f"cannot import module {mod_name!r} for --model: {e}") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        known = sorted(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n)))
        raise CLIError(f"{mod_name} has no factory {fn_name!r}; callables there: {', '.join(known[:12])}")
    return fn


def _build(spec: str) -> tuple[torch.nn.Module, Any, Any]:
    made = load_factory(spec)()
    if not (isinstance(made, tuple) and len(made) >= 2 and isinstance(made[0], torch.nn.Module)):
        raise CLIError(f"{spec} must return (model, inputs); got {type(made).__name__}")
    model, inputs = made[0], made[1]
    loss_fn = made[2] if len(made) > 2 else getattr(model, "loss_fn", None)
    return model, inputs, loss_fn


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m planner.apply",
        description="Plan selective activation checkpointing for a memory budget, apply it, check it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[1],
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"MODULE:FACTORY returning (model, inputs) (default {DEFAULT_MODEL})")
    p.add_argument("--budget-gib", type=float, help="memory budget per GPU in GiB (default: halfway between the smallest reachable peak and the no-AC peak)")
    p.add_argument("--device", default="cpu", choices=sorted(DEVICE_SPECS), help="target device the step is planned for (default cpu: this machine, so --verify compares like with like)")
    p.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, or none (its state is counted) (default adam)")
    p.add_argument("--world-size", type=int, default=1, help="ranks sharing parameters, gradients and optimizer state (FSDP) (default 1)")
    p.add_argument("--reserve-gib", type=float, help="held back for CUDA context and fragmentation (default: 1 GiB + 5%% on CUDA targets, 0 on cpu)")
    p.add_argument("--mode", choices=[m.value for m in TraceMode], default="fake", help="trace with fake tensors (default) or real ones")
    p.add_argument("--plan-out", help="write the plan as JSON here")
    p.add_argument("--plan-in", help="skip solving: load this plan and apply/verify it")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True, help="run one real training step with the plan applied and measure its peak (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON object (plan + measurement) instead of tables")
    p.add_argument("--time-limit-s", type=float, default=60.0, help="MILP time limit in seconds (default 60)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the verification step (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    return p


def _optimizer_arg(name: str) -> str | None:
    return None if name.lower() == "none" else name


def _step(args, inputs, loss_fn) -> TrainStep:
    return TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer=_optimizer_arg(args.optimizer))


def _solve(args, model, inputs, loss_fn) -> Plan:
    spec = get_device_spec(args.device)
    opts = EstimateOptions(mode=TraceMode(args.mode), progress=not args.quiet)
    est = estimate(model, step=_step(args, inputs, loss_fn), device=spec, options=opts)
    info = est.module_info
    solver_options = SolverOptions(time_limit_s=args.time_limit_s)
    fixed_reserve = int(args.reserve_gib * GiB) if args.reserve_gib is not None else None
    if args.budget_gib is not None:
        budget = int(args.budget_gib * GiB)
        reserve = fixed_reserve if fixed_reserve is not None else default_reserve_bytes(spec, budget)
    else:
        # The usable budget (budget - reserve) is the midpoint; the reserve is added on top.
        low = min_reachable_peak_bytes(info, world_size=args.world_size, options=solver_options)
        high = info.peak_bytes
        usable = (low + high) // 2
        reserve = fixed_reserve if fixed_reserve is not None else default_reserve_bytes(spec, usable)
        budget = usable + reserve
        logger.info(
            "no --budget-gib: using %s (usable %s), halfway between the smallest reachable peak %s "
            "and the no-AC peak %s", fmt_bytes(budget), fmt_bytes(usable), fmt_bytes(low), fmt_bytes(high)
        )
    return plan_for_budget(
        model, est, budget, world_size=args.world_size, reserve_bytes=reserve,
        solver_options=solver_options, verify=True,
    )


def _verify(args, plan: Plan, model, inputs, loss_fn):
    if any(p.device.type == "meta" for p in model.parameters()):
        return None, "the model is on the meta device: nothing to run (use --no-verify)"
    spec = get_device_spec(args.device)
    note = None
    if spec.name != "cpu" and next(model.parameters()).device.type == "cpu":
        note = f"plan made for {spec.name} but verified on this CPU: peaks are not comparable"
    params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    optimizer = resolve_optimizer(_optimizer_arg(args.optimizer), params, spec, fake=False)
    torch.manual_seed(args.seed)
    # Three steps: the first of a fresh run, then the steady state the plan is made for.
    with apply_plan(model, plan):
        measured = measure_steps(model, _step(args, inputs, loss_fn), optimizer, n_steps=VERIFY_STEPS)
    return measured, note


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.quiet and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    model, inputs, loss_fn = _build(args.model)
    if args.plan_in:
        plan = Plan.load(args.plan_in)
    else:
        plan = _solve(args, model, inputs, loss_fn)
    if args.plan_out:
        plan.save(args.plan_out)
    measured, note = _verify(args, plan, model, inputs, loss_fn) if args.verify else (None, None)
    if args.json:
        out = {"plan": plan.to_dict()}
        if measured is not None:
            steps = [{"step": i + 1, "peak_bytes": m.peak_bytes, "loss": m.loss,
                      "step_time_ms": m.step_time_ms, "tracker": m.tracker} for i, m in enumerate(measured)]
            out["measured"] = max(steps, key=lambda s: s["peak_bytes"])  # the binding step
            out["measured_steps"] = steps
        print(json.dumps(out, indent=1))
        return 0
    print(plan.summary())
    if args.plan_out:
        print(f"\nplan written to {args.plan_out}")
    if measured is not None:
        print(f"\n{len(measured)} real training steps with the plan applied:")
        print(steps_vs_prediction(plan, measured))
    if note:
        print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
