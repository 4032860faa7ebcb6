"""Plan, apply and check selective activation checkpointing from the command line.

With no arguments it runs the built-in example end to end on this machine: trace one step of a
small GPT in fake mode, solve for a budget between the smallest reachable peak and the no-AC peak,
print the plan, apply it, check that the planned step gives bitwise the unplanned loss and
gradients, run three real training steps (the first of a fresh run, then the steady state the
plan is made for) and print the predicted peak beside each measured one.

    python -m planner.apply
    python -m planner.apply --model examples:convnet_demo --budget-gib 0.011
    python -m planner.apply --model mypkg.models:make --loss-fn mypkg.losses:lm_loss --budget-gib 20
    python -m planner.apply --model examples:llama3_70b --device h100 --budget-gib 80 \\
        --world-size 64 --no-verify --plan-out llama70b.json
    python -m planner.apply --model mypkg.models:make --plan-in plan.json   # re-check a saved plan
    python -m planner.apply --model mypkg.models:make --keep-output   # out = model(**b); out.loss.backward()
    python -m planner.apply --model examples:llama_tiny --offload --host-budget-gib 1 \\
        --optimizer adamw --budget-gib 0.00193       # keep, recompute or offload to host memory

``--model MODULE:FACTORY`` names a zero-argument callable returning ``(model, inputs)`` or
``(model, inputs, loss_fn)`` (see examples/__init__.py); the loss is ``--loss-fn MODULE:FN`` if
given, else the factory's, else ``model.loss_fn(output, inputs)``, else the planner's default.

``planner/apply.py`` runs :func:`main` so that ``python -m planner.apply`` keeps working; this
module is the command line itself.

Exit status: 0 done (and every check passed), 1 a check failed (gradients differ, the measured
peak is above the usable budget, or an offloading plan copied other bytes to host than predicted), 2 bad input or a request that cannot be planned: one
``error: ...`` line on stderr (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json
import logging
import math
import os
import re
import sys
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from estimators.runtime.device import DEVICE_SPECS, UnknownDeviceError, get_device_spec
from estimators.tracing.estimation import DEFAULT_DEVICE, EstimateOptions, TraceMode, estimate
from estimators.step.train_step import StepError, TrainStep, ZeroGrad
from planner.errors import AlreadyCheckpointedError, FileRefusedError, PlanMismatchError
from planner.applying.checkpointing import apply_plan, check_plan_modules, hf_cache_off, other_model
from planner.applying.offload import OffloadError
from planner.distributed.fsdp import FsdpPrecision, per_rank_info
from planner.distributed.fsdp.units import FSDPUnitError
from planner.distributed.layout import layout_mismatch
from planner.analysis.gradcheck import GradientCheck, check_gradients
from planner.analysis.measure import MeasuredStep, measure_steps
from planner.format import GiB
from planner.errors import PlanFormatError, StepMismatchError
from planner.plan import TRAIN_MODES, Plan
from planner.plan_fields import MAX_COUNT
from planner.analysis.report import gradient_check_text, steps_vs_prediction
from planner.format import fmt_bytes
from planner.errors import PlanningError
from planner.format import check_budget_gib
from planner.planning.reserve import check_budget_on_device
from planner.planning.solve import default_reserve_bytes, plan_for_budget, unplanned_peak_bytes
from solver import SACMilp, SolverOptions
from solver.errors import SolverError

__all__ = ["main"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "examples:gpt_demo"
VERIFY_STEPS = 3


class CLIError(Exception):
    """Bad command-line input; the message says what to change."""


# Errors a user can cause and fix: one line, exit status 2 (a traceback only with --debug).
_EXPECTED = (CLIError, PlanningError, PlanFormatError, PlanMismatchError, AlreadyCheckpointedError,
             StepError, StepMismatchError, SolverError, OSError, FileRefusedError, OffloadError,
             FSDPUnitError, UnknownDeviceError)


def load_callable(spec: str, flag: str, example: str) -> Callable:
    """``MODULE:NAME`` -> the callable, with errors that say what to fix."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise CLIError(f"{flag} must look like MODULE:NAME (e.g. {example}), got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        # As `python -m planner.apply` does: a module in the current directory imports.
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module itself raising on import
        raise CLIError(f"cannot import module {mod_name!r} for {flag}: {type(e).__name__}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        # Its functions (not typing aliases or classes), the closest names first: a typo of
        # llama_tiny was listed behind Callable, Factory, LossFn... and cut before it.
        funcs = [n for n in dir(mod) if not n.startswith("_") and inspect.isfunction(getattr(mod, n))]
        close = difflib.get_close_matches(fn_name, funcs, n=3, cutoff=0.5)
        known = close + [n for n in sorted(funcs) if n not in close]
        shown = ", ".join(known[:12]) + (f", ... ({len(known) - 12} more)" if len(known) > 12 else "")
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CLIError(f"{mod_name} has no callable {fn_name!r} for {flag}{hint}; functions there: "
                       f"{shown or 'none'}")
    return fn


def load_factory(spec: str) -> Callable:
    """``MODULE:FACTORY`` for ``--model``."""
    return load_callable(spec, "--model", DEFAULT_MODEL)


def _build(spec: str, loss_spec: str | None) -> tuple[torch.nn.Module, Any, Any]:
    factory = load_factory(spec)
    try:
        made = factory()
    except Exception as e:
        raise CLIError(f"--model {spec}: the factory raised {type(e).__name__}: {e}") from e
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module)):
        if isinstance(made, tuple) and len(made) in (2, 3):
            got = f"a tuple whose first element is a {type(made[0]).__name__}, not a torch.nn.Module"
        else:
            got = f"a tuple of {len(made)}" if isinstance(made, tuple) else type(made).__name__
        raise CLIError(f"--model {spec} must return (model, inputs) or (model, inputs, loss_fn); got {got}")
    model, inputs = made[0], made[1]
    if loss_spec is not None:
        loss_fn = load_callable(loss_spec, "--loss-fn", "mypkg.losses:lm_loss")
    else:
        loss_fn = made[2] if len(made) == 3 else getattr(model, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise CLIError(f"the loss function of --model {spec} is not callable: {loss_fn!r}")
    return model, inputs, loss_fn


def _positive_gib(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # refused below with the rest
        try:
            return check_budget_gib(value, flag)
        except PlanningError as e:
            if math.isfinite(value) and value > 0:  # bytes typed for GiB: its words give the GiB figure
                raise argparse.ArgumentTypeError(str(e)) from None
            raise argparse.ArgumentTypeError(
                f"must be a positive, finite number of GiB (e.g. 40 or 0.5), got {text!r}") from None
    parse.__name__ = flag
    return parse


def _finite_float(ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse type: a finite float for which ``ok`` holds, else "must be <what>"."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and ok(v)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return v

    return parse


_reserve_gib = _finite_float(lambda v: v >= 0, "a finite number of GiB >= 0")
_positive_seconds = _finite_float(lambda v: v > 0, "a positive, finite number of seconds")


def _positive_int(text: str) -> int:
    """An integer in [1, MAX_COUNT] (what a plan file records: --micro-batches 10**20 overflowed
    in the loss's division, --world-size 10**20 was refused only after the trace)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_COUNT:,}], got {text[:40]!r}")
    return v


def _seed(text: str) -> int:
    """torch.manual_seed's range (a 64-bit seed, signed or not): a larger one raised from torch
    with a traceback."""
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not -2**63 <= v < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64), got {text[:40]!r}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other error of this command
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="sac-plan" if os.path.basename(sys.argv[0] or "") == "sac-plan" else "python -m planner.apply",
        description="Plan selective activation checkpointing for a memory budget, apply it, check it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[1],
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"MODULE:FACTORY returning (model, inputs) or (model, inputs, loss_fn) (default {DEFAULT_MODEL})")
    p.add_argument("--loss-fn", metavar="MODULE:FN", help="loss_fn(output, inputs) -> scalar tensor (default: the factory's, else model.loss_fn, else the planner's default)")
    p.add_argument("--budget-gib", type=_positive_gib("--budget-gib"), help="memory budget per GPU in GiB (default: halfway between the smallest reachable peak and the no-AC peak)")
    p.add_argument("--device", choices=sorted(DEVICE_SPECS), help="target device the step is planned for (default cpu: this machine, so --verify compares like with like; with --plan-in, the plan's)")
    p.add_argument("--optimizer", help="adam, adamw, sgd, or none (its state is counted) (default adam; with --plan-in, the plan's)")
    p.add_argument("--micro-batches", type=_positive_int, help="forward/backward passes per optimizer step (gradient accumulation) (default 1; with --plan-in, the plan's)")
    p.add_argument("--autocast", choices=sorted(_AUTOCAST), help="forward and loss under torch.autocast with this dtype (default none; with --plan-in, the plan's)")
    p.add_argument("--train-mode", choices=sorted(TRAIN_MODES), help="the modules' training flags in the step: auto (a model left in eval mode trains as model.train() leaves it), train (always model.train()), as_is (the flags as the factory returns them; a loop that trains in eval mode) (default auto; with --plan-in, the plan's)")
    p.add_argument("--keep-output", action=argparse.BooleanOptionalAction, help="the training loop holds the model output through backward and the optimizer step (out = model(**batch); out.loss.backward()): count it, e.g. a causal LM's logits (default: the output is dropped once the loss is computed; with --plan-in, the plan's)")
    p.add_argument("--world-size", type=_positive_int, default=1, help="ranks sharing parameters, gradients and optimizer state (FSDP) (default 1)")
    p.add_argument("--fsdp-units", metavar="NAMES", help="with --world-size: the modules you will fully_shard, comma-separated, root included, as the plan names them; '*' stands for one name part (e.g. 'Transformer,Transformer.layers.*'): FSDP2's gathered parameters and buffers are counted per rank (default: none, the state divided by --world-size)")
    p.add_argument("--fsdp-param-dtype", choices=sorted(_DTYPES), help="with --fsdp-units: FSDP2 MixedPrecisionPolicy(param_dtype=...): parameters gathered, and gradients unsharded, in this dtype (default: the model's)")
    p.add_argument("--fsdp-reduce-dtype", choices=sorted(_DTYPES), help="with --fsdp-units: MixedPrecisionPolicy(reduce_dtype=...) (default: --fsdp-param-dtype)")
    p.add_argument("--reserve-gib", type=_reserve_gib, help="held back from the budget for CUDA context and fragmentation (default: 1 GiB + 5%% of the budget on CUDA targets, 0 on cpu)")
    p.add_argument("--mode", choices=[m.value for m in TraceMode], default="fake", help="trace with fake tensors (default) or real ones")
    p.add_argument("--plan-out", help="write the plan as JSON here")
    p.add_argument("--plan-in", help="skip solving: load this plan and apply/verify it")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True, help="check the plan on real tensors: the planned step's loss and gradients against the unplanned step's (bitwise), then three real training steps with their measured peaks (default on)")
    p.add_argument("--json", action="store_true", help="print one JSON object (plan, gradient check, measurement) instead of tables")
    p.add_argument("--offload", action="store_true", help="plan keep / recompute / offload to host memory (least step time on the step timeline), not recompute alone; --verify then also compares the bytes copied to host per step with the prediction")
    p.add_argument("--host-budget-gib", type=_positive_gib("--host-budget-gib"), help="with --offload: host memory per rank for offloaded activations, in GiB (default: not limited)")
    p.add_argument("--time-limit-s", type=_positive_seconds, default=60.0, help="MILP time limit in seconds (default 60)")
    p.add_argument("--seed", type=_seed, default=0, help="torch seed of the verification steps (dropout masks) (default 0)")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    return p


def _optimizer_arg(name: str) -> str | None:
    return None if name.lower() == "none" else name


def _check_args(args) -> None:
    if args.plan_in and args.budget_gib is not None:
        raise CLIError("--budget-gib has no effect with --plan-in (the plan is already made); drop one")
    if args.host_budget_gib is not None and not args.offload:
        raise CLIError("--host-budget-gib only applies with --offload; add --offload or drop it")
    if args.plan_in and args.offload:
        raise CLIError("--offload has no effect with --plan-in (the plan is already made); drop one")
    if args.plan_in:  # flags that only shape the planning: silently ignored before
        for flag, given in (("--world-size", args.world_size != 1), ("--reserve-gib", args.reserve_gib is not None),
                            ("--mode", args.mode != "fake"), ("--time-limit-s", args.time_limit_s != 60.0)):
            if given:
                raise CLIError(f"{flag} has no effect with --plan-in (the plan is already made, with its "
                               "own); drop one")
    if args.fsdp_units is None and (args.fsdp_param_dtype or args.fsdp_reduce_dtype):
        raise CLIError("--fsdp-param-dtype / --fsdp-reduce-dtype are FSDP2's mixed precision: add --fsdp-units")
    if args.plan_in and args.fsdp_units is not None:
        raise CLIError("--fsdp-units has no effect with --plan-in (the plan is already made, with its own); drop one")
    if args.optimizer is not None and args.optimizer.lower() not in _OPTIMIZER_NAMES:
        raise CLIError(f"--optimizer must be adam, adamw, sgd or none, got {args.optimizer!r}")


_AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "none")
# The step flags, their defaults, and how a plan's StepRecord spells each value as the flag takes it.
_STEP_FLAGS = {
    "optimizer": ("--optimizer", "adam", lambda r: r.optimizer),
    "micro_batches": ("--micro-batches", 1, lambda r: r.micro_batches),
    "autocast": ("--autocast", "none", lambda r: {"bfloat16": "bf16", "float16": "fp16"}.get(r.autocast, r.autocast)),
    "keep_output": ("--keep-output", False, lambda r: r.keep_output),
    "train_mode": ("--train-mode", "auto", lambda r: r.train_mode),
}


def _flag_text(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}"


def _settle_step(args, plan: Plan | None) -> None:
    """Fill the step flags left out: from the step a --plan-in plan was made for (its peaks hold
    only for that loop), else the defaults. A flag given against the plan's step is refused."""
    args.zero_grad = ZeroGrad.SET_TO_NONE  # no flag: the loop calls optimizer.zero_grad()
    record = plan.step if plan is not None else None
    if plan is not None and record is None:
        logger.warning("--plan-in %s does not record the training step it was made for (an older plan "
                       "file): it is run with the step of the flags; its peaks hold only if that is the "
                       "step it was made for (re-plan to record it)", args.plan_in)
    for name, (flag, default, of_plan) in _STEP_FLAGS.items():
        given = getattr(args, name)
        if name == "optimizer" and given is not None:
            given = given.lower()
        planned = of_plan(record) if record is not None else None
        if planned is not None and given is not None and given != planned:
            raise CLIError(
                f"{_flag_text(flag, given)}: the plan in {args.plan_in} was made for a step with "
                f"{_flag_text(flag, planned)}, so its peaks do not hold for this one; drop "
                f"{_flag_text(flag, given).split()[0]} to run "
                "the plan's step, or re-plan for this step (leave out --plan-in)"
            )
        setattr(args, name, given if given is not None else planned if planned is not None else default)
    if record is not None:
        if args.optimizer not in _OPTIMIZER_NAMES:
            raise CLIError(f"--plan-in {args.plan_in}: the plan was made for the optimizer {args.optimizer!r}, "
                           f"which this command line cannot build ({', '.join(_OPTIMIZER_NAMES)}); "
                           "check it from Python with that optimizer (measure_steps), or re-plan")
        args.zero_grad = ZeroGrad(record.zero_grad)


def _step(args, inputs, loss_fn) -> TrainStep:
    try:
        step = TrainStep(inputs=inputs, loss_fn=loss_fn, optimizer=_optimizer_arg(args.optimizer),
                         micro_batches=args.micro_batches, autocast_dtype=_AUTOCAST[args.autocast],
                         keep_output=args.keep_output, zero_grad=args.zero_grad,
                         train_mode=TRAIN_MODES[args.train_mode])
    except TypeError as e:  # a loss function that cannot take (output, inputs)
        raise CLIError(f"the loss function: {e}") from e
    try:
        step.check_target(get_device_spec(args.device))
    except ValueError as e:
        raise CLIError(f"--autocast {args.autocast}: {e}") from e
    return step


def _solve(args, model, inputs, loss_fn) -> Plan:
    spec = get_device_spec(args.device)
    opts = EstimateOptions(mode=TraceMode(args.mode), progress=not args.quiet)
    if args.budget_gib is not None and args.reserve_gib is not None and args.reserve_gib >= args.budget_gib:
        raise CLIError(f"--reserve-gib ({args.reserve_gib:g}) must be below --budget-gib ({args.budget_gib:g})")
    if args.budget_gib is not None:
        check_budget_on_device(int(args.budget_gib * GiB), spec, "--budget-gib")
    if args.budget_gib is not None and args.reserve_gib is None:
        default = default_reserve_bytes(spec, int(args.budget_gib * GiB))
        if default >= args.budget_gib * GiB:
            raise CLIError(
                f"--budget-gib {args.budget_gib:g} leaves nothing once the default reserve for "
                f"{spec.name} is held back ({default / GiB:.3f} GiB: 1 GiB + 5 %); pass a larger "
                "--budget-gib, or --reserve-gib 0 to plan for the whole budget"
            )
    with hf_cache_off(model):  # trace the step as it runs once the plan is applied
        est = estimate(model, _step(args, inputs, loss_fn), device=spec, options=opts)
    units, precision = _fsdp(args, model, est.module_info)
    info = est.module_info if units is None else per_rank_info(est.module_info, units, args.world_size, precision)
    solver_options = SolverOptions(time_limit_s=args.time_limit_s)
    fixed_reserve = int(args.reserve_gib * GiB) if args.reserve_gib is not None else None
    if args.budget_gib is not None:
        budget = int(args.budget_gib * GiB)
        reserve = fixed_reserve if fixed_reserve is not None else default_reserve_bytes(spec, budget)
    else:
        # The usable budget (budget - reserve) is the midpoint; the reserve is added on top.
        milp = SACMilp(info, world_size=args.world_size, fsdp_units=units, options=solver_options)
        low, high = milp.min_reachable_peak_bytes(), milp.no_ac_peak_bytes  # per rank
        usable = (low + high) // 2
        reserve = fixed_reserve if fixed_reserve is not None else default_reserve_bytes(spec, usable)
        budget = usable + reserve
        logger.info(
            "no --budget-gib: using %s (usable %s), halfway between the smallest reachable peak %s "
            "and the no-AC peak %s%s", fmt_bytes(budget), fmt_bytes(usable), fmt_bytes(low), fmt_bytes(high),
            " (per rank)" if args.world_size > 1 else ""
        )
    return plan_for_budget(
        model, est, budget, world_size=args.world_size, reserve_bytes=reserve, fsdp_units=units,
        fsdp_mp_policy=precision,
        solver_options=solver_options, verify=True, offload=args.offload,
        host_budget_bytes=int(args.host_budget_gib * GiB) if args.host_budget_gib is not None else None,
        unplanned_peak_bytes=unplanned_peak_bytes(model, est),
    )


def _fsdp(args, model, info) -> tuple[list[str] | None, FsdpPrecision | None]:
    """``--fsdp-units`` as the traced module names (each pattern's '*' one name part), and the
    mixed precision of ``--fsdp-param-dtype`` / ``--fsdp-reduce-dtype``."""
    if args.fsdp_units is None:
        return None, None
    names = [s.fqn for s in info.mod_stats]
    units = []
    for pattern in (p.strip() for p in args.fsdp_units.split(",")):
        regex = re.compile("[^.]+".join(re.escape(part) for part in pattern.split("*")) + r"\Z")
        found = [n for n in names if regex.match(n)]
        if not pattern or not found:
            close = difflib.get_close_matches(pattern, names, n=3)
            raise CLIError(f"--fsdp-units: {pattern!r} names no module of the traced model (names start with "
                           f"{names[0]!r}" + (f"; did you mean {', '.join(map(repr, close))}?)" if close else ")"))
        units += [n for n in found if n not in units]
    param, reduce = (_DTYPES[d] if d else None for d in (args.fsdp_param_dtype, args.fsdp_reduce_dtype))
    policy = SimpleNamespace(param_dtype=param, reduce_dtype=reduce)
    return units, FsdpPrecision.of(policy, model)


def _verify(args, plan: Plan, model, inputs, loss_fn
            ) -> tuple[GradientCheck | None, list[MeasuredStep] | None, str | None, int | None]:
    """Gradient check, measured steps, a note, and the bytes copied to host per step (None when
    the plan offloads nothing)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return None, None, "the model is on the meta device: nothing to run (use --no-verify)", None
    spec = get_device_spec(args.device)  # the plan's, or the one named for a custom spec's plan
    note = None
    if spec.name != "cpu" and next(model.parameters()).device.type == "cpu":
        note = f"plan made for {spec.name} but verified on this CPU: peaks are not comparable"
    elif plan.world_size > 1:
        note = (f"plan made per rank for {plan.world_size} ranks but verified in this one process, "
                "which holds every rank's parameters, gradients and optimizer state: peaks are not "
                "comparable")
    # First the same forward + backward with and without the plan, from the same state and seed
    # (the model is left as it was), then real training steps with the plan.
    step = _step(args, inputs, loss_fn)
    check = check_gradients(model, plan, step, seed=args.seed)
    torch.manual_seed(args.seed)
    # Three steps: the first of a fresh run, then the steady state the plan is made for; the
    # step's optimizer is built over the model's trainable parameters by measure_steps.
    with apply_plan(model, plan) as handle:
        measured = measure_steps(model, step, n_steps=VERIFY_STEPS)
        host = handle.host_bytes_offloaded // VERIFY_STEPS if plan.offloading else None
    return check, measured, note, host


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _report(args, plan: Plan, check: GradientCheck | None, measured: list[MeasuredStep] | None,
            note: str | None, host: int | None = None) -> None:
    if args.json:
        out: dict[str, Any] = {"plan": plan.to_dict()}
        if check is not None:
            out["gradient_check"] = {**dataclasses.asdict(check),
                                     "max_abs_diff": _json_number(check.max_abs_diff)}
        if measured is not None:
            steps = [{"step": i + 1, "peak_bytes": m.peak_bytes, "loss": m.loss,
                      "step_time_ms": m.step_time_ms, "tracker": m.tracker} for i, m in enumerate(measured)]
            out["measured"] = max(steps, key=lambda s: s["peak_bytes"])  # the binding step
            out["measured_steps"] = steps
        if host is not None:
            out["host_bytes_per_step"] = {"predicted": plan.host_bytes_per_step, "measured": host}
        if note:
            out["note"] = note
        print(json.dumps(out, indent=1))
        return
    print(plan.summary())
    if args.plan_out:
        print(f"\nplan written to {args.plan_out}")
    if check is not None:
        print("\nThe planned step against the unplanned one (same state, same seed):")
        print(gradient_check_text(check))
    if measured is not None:
        print(f"\n{len(measured)} real training steps with the plan applied:")
        print(steps_vs_prediction(plan, measured, comparable=note is None))
    if host is not None:
        same = "as predicted" if host == plan.host_bytes_per_step else "DIFFERS from the prediction"
        print(f"  host copies      {fmt_bytes(host)} ({host:,} B) per step to host memory, predicted "
              f"{plan.host_bytes_per_step:,} B: {same}")
    if note:
        print(f"  note: {note}")


def target_device(args, plan: Plan | None) -> str:
    """``--device``; with ``--plan-in``, the plan's (another ``--device`` is refused: checked
    against another device's figures, an h100 plan re-checked as "cpu" failed at +22.67 % and a
    cpu plan as "h100" skipped the budget check), unless the plan was made for a DeviceSpec of
    the user's own, which the command line cannot name; else ``DEFAULT_DEVICE``."""
    if plan is None:
        return args.device or DEFAULT_DEVICE
    if plan.device not in DEVICE_SPECS:  # a DeviceSpec of the user's own: checked as --device
        return args.device or DEFAULT_DEVICE
    if args.device is not None and args.device != plan.device:
        raise CLIError(f"--device {args.device}: the plan in {args.plan_in} was made for "
                       f"{plan.device}; --plan-in checks it for that device (drop --device)")
    return plan.device


def _check_plan_in_layout(args, model, plan: Plan) -> None:
    """A --plan-in plan made for a pipeline stage or a tensor-parallel layout: the command line
    runs one process's ordinary step, against which its per-rank figures mean nothing (they were
    printed as this process's, and a stage's peak over its schedule was reported "within")."""
    if plan.pipeline is not None:
        raise CLIError(f"--plan-in {args.plan_in}: the plan is for pipeline {plan.pipeline.describe()}, whose "
                       "peak is its rank's over the schedule; the command line runs one process's step. "
                       "Check it on the stage's schedule (benchmarks/pipeline_e2e.py measures one)")
    why = layout_mismatch(plan.layout, model)
    if why is not None:
        raise CLIError(f"--plan-in {args.plan_in}: {why}; its figures are per rank of that layout, the command "
                       "line runs one process. Check it on the parallelized model (apply_plan, measure_steps)")


def _run(args) -> int:
    _check_args(args)
    model, inputs, loss_fn = _build(args.model, args.loss_fn)
    if not any(True for _ in model.parameters()):
        # The step of such a model trains nothing: no plan to make, no gradients to check (the
        # check raised from measure_steps with a traceback, exit 1).
        raise CLIError(f"--model {args.model}: {type(model).__name__} has no parameters, so its step "
                       "trains nothing and there is nothing to plan; check that --model returns the "
                       "model you train")
    if args.plan_in:
        try:
            plan = Plan.load(args.plan_in)
        except OSError as e:
            raise CLIError(f"--plan-in {args.plan_in}: cannot read it ({e.strerror or e})") from e
        other = other_model(model, plan)
        if other is not None:
            # Before anything else, --no-verify included: a plan for another model was printed
            # and exit 0 ("the README's 70B re-check flow").
            raise CLIError(f"--plan-in {args.plan_in}: the plan was made for {plan.model_name} "
                           f"(fingerprint {plan.model_fingerprint}), not this {other[0]} "
                           f"(fingerprint {other[1]}); re-plan for it (drop --plan-in)")
        # The fingerprint does not cover the module list, which a file can have edited: checked
        # with --no-verify too (a missing module and a parameter's name were printed, exit 0).
        check_plan_modules(model, plan)
        _check_plan_in_layout(args, model, plan)  # --no-verify included
        args.device = target_device(args, plan)
        _settle_step(args, plan)
        plan.check_step(_step(args, inputs, loss_fn))  # the flags above make them agree
    else:
        args.device = target_device(args, None)
        _settle_step(args, None)
        plan = _solve(args, model, inputs, loss_fn)
    if args.plan_out:
        try:
            plan.save(args.plan_out)
        except OSError as e:
            raise CLIError(f"--plan-out {args.plan_out}: cannot write it ({e.strerror or e})") from e
    check, measured, note, host = (_verify(args, plan, model, inputs, loss_fn) if args.verify
                                   else (None, None, None, None))
    _report(args, plan, check, measured, note, host)
    failed = []
    if check is not None and not check.equal:
        failed.append(f"the planned step's loss or gradients differ from the unplanned step's "
                      f"({len(check.differing)} parameters, max |diff| {check.max_abs_diff:.3g})")
    peak = max((m.peak_bytes for m in measured), default=0) if measured is not None else 0
    if measured is not None and note is None and peak > plan.usable_budget_bytes:
        failed.append(f"the measured peak {fmt_bytes(peak)} is above the usable budget "
                      f"{fmt_bytes(plan.usable_budget_bytes)}")
    if host is not None and host != plan.host_bytes_per_step:
        failed.append(f"{host:,} B per step went to host memory where the plan predicted "
                      f"{plan.host_bytes_per_step:,} B")
    for f in failed:
        print(f"check failed: {f}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 a check failed, 2 bad input).
    ``sac-plan search ...`` is the launch advisor (``planner.search.cli``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["search"]:
        from planner.search.cli import main as search_main

        return search_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, its line already printed)
        return e.code if isinstance(e.code, int) else 2
    if not args.quiet and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return _run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130  # as a shell reports a command Ctrl-C ended (128 + SIGINT)
    except _EXPECTED as e:
        if args.debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
