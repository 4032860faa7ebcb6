"""One plan for every rank of an FSDP2 job: rank 0 plans, every rank gets the same plan, checked.

    dist.init_process_group("gloo")                  # NCCL: torch.cuda.set_device(local_rank) first
    model, batch = build_model()                     # unsharded (or built on the meta device)
    units = ["GPT", *(f"GPT.blocks.{i}" for i in range(n_layer))]
    step = TrainStep(inputs=batch, optimizer="adamw")
    plan = solve_sac_distributed(model, 70, step, options=PlanOptions(fsdp_units=units))
    apply_plan(model, plan)                          # then shard exactly ``units``:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

The protocol, on the ranks of ``group`` (default: the whole job):

1. every rank checks its own arguments and describes what it was asked (model fingerprint,
   budget, step, options: ``planner.distributed.agreement``); one all-gather compares them, and
   any rank's refusal or any difference from rank 0 raises the same
   :class:`RankDisagreementError` on every rank, naming the ranks, before anyone traces;
2. every rank traces one step of the *unsharded* model in fake mode (``step.inputs`` is one
   rank's batch; in parallel, rank 0's trace being the one planned) and a second all-gather
   compares the outcomes: a loss that raises on one rank stops every rank there. Rank 0 makes
   the memory FSDP-aware (``planner.distributed.fsdp.memory.fsdp_module_info``) and solves per
   rank; the plan's notes state FSDP's all-gather / reduce-scatter time per step
   (``fsdp_comm_ms`` on the device's default link). With
   ``PlanOptions(trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK))`` a shared benchmark comes
   first (:func:`share_benchmarks`): every rank traces the step once in fake mode recording the
   distinct op signatures, rank ``r`` times those with index ``% world_size == r``, the timings
   are all-gathered and merged, and the ranks trace with the merged cache: they time no kernel
   unless a trace meets a signature the split missed (the plan's notes give rank 0's hits /
   misses);
3. rank 0 broadcasts the plan's JSON (``dist.broadcast_object_list``), or, if planning raised, an
   error payload: rank 0 re-raises its exception and every other rank raises
   :class:`RemotePlanningError` with the same message, so no rank is left waiting;
4. every rank hashes the plan it rebuilt (:func:`plan_hash`, sha256 of canonical JSON) and the
   hashes are all-gathered (``dist.all_gather_object``); any difference raises
   :class:`PlanHashMismatchError` naming the ranks on every rank.

No rank waits for another that has failed: every failure a rank can report reaches the others
in the next collective, which every rank reaches. A rank that never arrives (a hard crash) makes
the others raise torch's timeout error after the group's timeout (``init_process_group``'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from estimators.runtime.collectives import AnalyticCollectiveModel
from estimators.runtime.device import DeviceSpec
from estimators.tracing.estimation import TraceMode, as_train_step, estimate
from estimators.runtime.kernel_bench import BenchmarkRuntime
from estimators.runtime.op_signatures import SignatureRecorder
from estimators.runtime.models import RuntimeKind, benchmark_runtime_override, make_runtime_model
from planner.distributed.agreement import agree, request_fields
from planner.errors import PlanHashMismatchError, RemotePlanningError
from planner.applying.checkpointing import hf_cache_off
from planner.distributed.fsdp.comm import fsdp_comm_ms
from planner.distributed.layout import check_parallel_support, fsdp_options
from planner.format import GiB
from planner.plan import Plan
from planner.format import check_budget_gib
from planner.planning.solve import default_reserve_bytes, plan_for_budget
from planner.options import PlanOptions
from estimators.step.train_step import TrainStep

__all__ = [
    "solve_sac_distributed",
    "plan_hash",
    "check_same_plan",
    "PlanHashMismatchError",
    "RemotePlanningError",
    "SharedBenchmark",
    "share_benchmarks",
]

logger = logging.getLogger(__name__)



def plan_hash(plan: Plan) -> str:
    """sha256 (hex) of the plan's canonical JSON (sorted keys, no whitespace).

    >>> len(plan_hash(plan))   # doctest: +SKIP
    64
    """
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_plan(plan: Plan, group: dist.ProcessGroup | None = None) -> str:
    """All-gather every rank's :func:`plan_hash`; raise :class:`PlanHashMismatchError` (on every
    rank) naming the ranks whose plan differs from rank 0's. Returns the common hash.

    >>> check_same_plan(plan)   # doctest: +SKIP
    '3f1c...'
    """
    mine = plan_hash(plan)
    hashes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, mine, group=group)
    differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if differ:
        raise PlanHashMismatchError(
            f"ranks {differ} hold a different SAC plan than rank 0 (sha256 "
            f"{', '.join(f'rank {r}: {hashes[r][:12]}' for r in [0, *differ])}); every rank must "
            "apply the same plan: plan once with solve_sac_distributed and do not edit it per rank",
            differ,
        )
    return mine


def solve_sac_distributed(
    model: torch.nn.Module,
    budget_gib: float,
    step: TrainStep | None = None,
    *,
    options: PlanOptions | None = None,
    group: dist.ProcessGroup | None = None,
    benchmark: "SharedBenchmark | None" = None,
) -> Plan:
    """:func:`planner.solve_sac` for a running torch.distributed job: the same plan on every rank.

    Call it on every rank of ``group`` with the same arguments, before ``fully_shard`` or after it
    (a sharded model gives its own units and group size; a model built on the meta device is
    fine). ``budget_gib`` is per rank, ``step.inputs`` one rank's batch. ``options.fsdp_units``
    names the modules you will ``fully_shard`` (ModuleInfo names: ``"GPT"``, ``"GPT.blocks.0"``...;
    the root included): parameters, gradients and optimizer state are then sharded over
    ``options.world_size`` ranks (1, the default: the whole group; the ``dp`` size of a ``dp x tp``
    mesh) and FSDP2's gathered parameters and communication buffers are counted
    (``planner.distributed.fsdp``). Without ``fsdp_units`` the model is planned replicated (e.g.
    DDP; its gradient buckets are not modelled): per-rank memory is one rank's traced step, a
    tensor-parallel model's at its local shard shapes (``planner.distributed.layout``). With
    ``options.trace.runtime == RuntimeKind.BENCHMARK`` the op timings are measured across the
    ranks first (:func:`share_benchmarks`), unless ``benchmark`` passes timings already shared
    that way (e.g. to plan several budgets).

    Example::

        options = PlanOptions(device="h100", fsdp_units=units)
        plan = solve_sac_distributed(model, 70, TrainStep(inputs=batch, optimizer="adamw"), options=options)
        apply_plan(model, plan)
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "solve_sac_distributed needs an initialised torch.distributed job "
            "(dist.init_process_group(...)); in a single process use solve_sac"
        )
    world_size = dist.get_world_size(group)
    asked, error = None, None
    try:  # every check of this rank's own arguments; what they raise goes to every rank
        options, units, fsdp_world, step = _checked(model, budget_gib, step, options, world_size, benchmark)
        asked = request_fields(model=model, budget_gib=budget_gib, step=step, options=options,
                               benchmark="given" if benchmark is not None else "none")
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree
        error = e
    agree("the arguments", asked, error, group)
    shared = benchmark
    if shared is None and options.trace.runtime is RuntimeKind.BENCHMARK:
        shared = share_benchmarks(model, step, options=options, group=group)
    runtime = shared.runtime(options.spec) if shared is not None else None
    # Every rank traces its own step (in parallel: rank 0 needs its trace anyway), so that a
    # loss that raises, or a step that traces otherwise, on one rank stops every rank now.
    est, traced, error = None, None, None
    try:
        est = _trace(model, step, options, runtime)
        traced = {"trace": f"peak {est.module_info.peak_bytes:,} B, {len(est.trace.ops):,} ops"}
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree
        error = e
    agree("the traced step", traced, error, group)
    solve = functools.partial(_solve, model, budget_gib, est, options, units, fsdp_world, runtime)
    plan = _receive(_plan_on_rank0(solve, group), group)
    check_same_plan(plan, group)
    return plan


def _checked(model, budget_gib, step, options, world_size: int, benchmark) -> tuple:
    """``(options, fsdp units, ranks FSDP2 shards over, step)`` after every local check of one
    rank's arguments (``world_size``: the group's)."""
    options = options if options is not None else PlanOptions()
    if not isinstance(options, PlanOptions):
        raise TypeError(f"options must be a PlanOptions, got {type(options).__name__}")
    _check_world_size(options.world_size, world_size)
    units, fsdp_world = _fsdp_of(model, options, world_size)
    check_parallel_support(model, options, traced_on_one_rank=True)
    check_budget_gib(budget_gib)
    if benchmark is not None and options.trace.runtime is not RuntimeKind.BENCHMARK:
        raise ValueError(
            "benchmark= holds measured op timings, which only the BENCHMARK runtime uses; pass "
            "options=PlanOptions(trace=EstimateOptions(runtime=RuntimeKind.BENCHMARK)) or drop benchmark="
        )
    return options, units, fsdp_world, as_train_step(model, step)


# ------------------------------------------------------------------------------ local checks
def _check_world_size(asked: int, group_size: int) -> None:
    if group_size % asked:
        raise ValueError(
            f"world_size={asked!r} does not match the process group, which has {group_size} ranks "
            "(dist.get_world_size(group)); leave world_size at 1 (FSDP2 over the whole group), or pass "
            "the size of the mesh dim FSDP2 shards over (it divides the group: dp of a dp x tp mesh)"
        )


def _fsdp_of(model: torch.nn.Module, options: PlanOptions, group_size: int) -> tuple[list[str] | None, int]:
    """(FSDP2 units, ranks each parameter is sharded over): the options' (world_size 1: the whole
    group), or those of a model ``fully_shard`` sharded already; (None, 1) without FSDP2."""
    units, size = fsdp_options(model, options.fsdp_units, options.world_size)
    if units is None:
        return None, group_size  # replicated (tensor parallel only, DDP): the notes give the group
    return list(units), size if size > 1 else group_size


# ------------------------------------------------------------------------------ rank 0 plans
def _plan_on_rank0(solve: Callable[[], Plan], group) -> tuple:
    """The payload rank 0 broadcasts: ("plan", json) or ("error", type name, message); other
    ranks return () and receive it. On failure rank 0 sends the error, then raises."""
    if dist.get_rank(group) != 0:
        return ()
    try:
        return ("plan", json.dumps(solve().to_dict()))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks
        _broadcast(("error", type(e).__name__, str(e)), group)
        raise


def _trace(model, step: TrainStep, options: PlanOptions, runtime: BenchmarkRuntime | None):
    """One rank's trace of its step; with ``runtime`` (a shared benchmark), ops priced from it."""
    override = benchmark_runtime_override(runtime) if runtime is not None else contextlib.nullcontext()
    with override, hf_cache_off(model):  # trace the step as it runs once the plan is applied
        return estimate(model, step, device=options.spec, options=options.trace)


def _solve(model, budget_gib, est, options: PlanOptions, units, world_size,
           runtime: BenchmarkRuntime | None = None) -> Plan:
    """Rank 0's plan from its trace ``est`` (the same path as :func:`planner.solve_sac`;
    ``plan_for_budget`` adds FSDP2's per-rank memory for ``units``); with ``runtime``, every
    verification trace prices ops from the shared timings too."""
    budget = int(check_budget_gib(budget_gib) * GiB)
    spec = options.spec
    notes = [] if runtime is None else [_bench_note(runtime, world_size)]
    shard = world_size if units is not None else 1
    reserve = (int(options.reserve_gib * GiB) if options.reserve_gib is not None
               else default_reserve_bytes(spec, budget))
    with benchmark_runtime_override(runtime) if runtime is not None else contextlib.nullcontext():
        plan = plan_for_budget(
            model, est, budget, world_size=shard, reserve_bytes=reserve, ac_units=options.ac_units,
            fsdp_units=units, solver_options=options.solver, verify=options.verify,
        )
    note = (
        f"FSDP2 over {world_size} ranks, {len(units)} units: per-rank memory counts gathered "
        "parameters and all-gather / reduce-scatter buffers (planner/distributed/fsdp/memory.py)"
        if units is not None
        else f"no FSDP2 over the {world_size} ranks: per-rank memory of one rank's traced program"
    )
    if units is not None:
        notes.append(_comm_note(est.module_info, units, world_size, spec))
    logger.info("rank 0 planned %d checkpointed modules, predicted per-rank peak %d bytes",
                len(plan.modules), plan.predicted_peak_bytes)
    return dataclasses.replace(plan, notes=(*plan.notes, note, *notes))


def _comm_note(info, units: list[str], world_size: int, spec: DeviceSpec) -> str:
    """The plan note on FSDP's collective time per step, from ``spec``'s default link."""
    try:
        model = AnalyticCollectiveModel.from_device(spec)
    except ValueError:
        return (f"FSDP collectives: not estimated (device {spec.name!r} names no interconnect; "
                "see planner.distributed.fsdp.comm.fsdp_comm_ms)")
    return fsdp_comm_ms(info, units, world_size, model).note()


def _bench_note(runtime: BenchmarkRuntime, world_size: int) -> str:
    """The plan note on the shared benchmark, read right after rank 0's planning trace."""
    return (
        f"op timings benchmarked across {world_size} ranks and merged ({runtime.name}); rank 0's "
        f"planning trace: {runtime.hits} cache hits, {runtime.misses} misses "
        f"({runtime.measurements} timed on rank 0, {runtime.fallbacks} roofline fallbacks)"
    )


# ------------------------------------------------------------------------------ shared benchmark
@dataclasses.dataclass(frozen=True)
class SharedBenchmark:
    """Op timings measured by the ranks of a group, split between them and merged.

    ``entries`` maps the runtime cache key (``repr``) to ms, as :meth:`BenchmarkRuntime.export_cache`
    does; ``timed_by_rank[r]`` are the keys rank ``r`` benchmarked.
    """

    entries: dict[str, float]
    signature_count: int
    """Distinct op signatures of the step (what one process would time)."""
    timed_by_rank: tuple[tuple[str, ...], ...]

    def runtime(self, spec: DeviceSpec) -> BenchmarkRuntime:
        """A :class:`BenchmarkRuntime` for ``spec`` (as ``make_runtime_model`` builds it) holding
        the merged timings."""
        runtime = make_runtime_model(RuntimeKind.BENCHMARK, spec)
        runtime.import_cache(self.entries)
        return runtime


def share_benchmarks(
    model: torch.nn.Module,
    step: TrainStep | None = None,
    *,
    options: PlanOptions | None = None,
    group: dist.ProcessGroup | None = None,
) -> SharedBenchmark:
    """Benchmark the step's ops once across the ranks of ``group``; call on every rank.

    Every rank traces the step in fake mode, recording its distinct op signatures
    (:class:`SignatureRecorder`); rank ``r`` times those with index ``% world_size == r`` on its
    own device (``options.device``); the timings are all-gathered and merged. If any rank fails,
    every rank raises (the failing rank its own error, the others :class:`RemotePlanningError`).

    >>> shared = share_benchmarks(model, TrainStep(inputs=batch))   # doctest: +SKIP
    >>> bench = shared.runtime(get_device_spec("cpu"))               # hits only for this step
    """
    options = options if options is not None else PlanOptions()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    error: Exception | None = None
    try:
        payload: tuple = ("ok", *_benchmark_my_share(model, step, options, rank, world_size))
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        payload, error = ("error", rank, type(e).__name__, str(e)), e
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, payload, group=group)
    if error is not None:
        raise error
    failed = next((g for g in gathered if g[0] == "error"), None)
    if failed is not None:
        _, who, error_type, message = failed
        raise RemotePlanningError(f"benchmarking failed on rank {who}: {message}", error_type)
    return _merge(gathered)


def _benchmark_my_share(model, step, options: PlanOptions, rank: int,
                        world_size: int) -> tuple[int, tuple[str, ...], dict[str, float]]:
    """Trace recording signatures, time this rank's share: (signature count, keys, timings)."""
    spec = options.spec
    bench = make_runtime_model(RuntimeKind.BENCHMARK, spec)  # fails fast without the device
    trace = dataclasses.replace(options.trace, runtime=RuntimeKind.BENCHMARK, mode=TraceMode.FAKE,
                                progress=False)
    recorder = SignatureRecorder()
    with benchmark_runtime_override(recorder):
        estimate(model, step, device=spec, options=trace)
    signatures = recorder.signatures()
    share = signatures[rank::world_size]
    for sig in share:
        bench.benchmark_signature(sig)
    logger.info("rank %d timed %d of %d op signatures", rank, len(share), len(signatures))
    return len(signatures), tuple(sig.key_repr for sig in share), bench.export_cache()


def _merge(gathered: list[tuple]) -> SharedBenchmark:
    """One SharedBenchmark from every rank's ("ok", count, keys, timings)."""
    entries: dict[str, float] = {}
    for _, _, _, timings in gathered:
        entries.update(timings)
    return SharedBenchmark(
        entries=entries,
        signature_count=gathered[0][1],
        timed_by_rank=tuple(keys for _, _, keys, _ in gathered),
    )


# ------------------------------------------------------------------------------ every rank
def _broadcast(payload: tuple, group) -> tuple:
    box = [payload]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _receive(payload: tuple, group) -> Plan:
    payload = _broadcast(payload, group)
    if payload[0] == "error":
        _, error_type, message = payload
        raise RemotePlanningError(message, error_type)
    return Plan.from_dict(json.loads(payload[1]))
