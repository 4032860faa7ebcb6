"""FSDP2-aware memory for the solver, without changing the solver: the rules R1-R8.

    units = ["GPT", *(f"GPT.blocks.{i}" for i in range(4))]     # what you will fully_shard
    info2 = fsdp_module_info(est.module_info, units, world_size=8)
    SACMilp(info2, world_size=8, fsdp_units=units)               # per-rank memory, FSDP included

The solver's memory model (``estimators/contract/module_info.py``) divides the parameter, gradient and
optimizer bytes of every MemoryPoint by ``world_size`` and adds ``other_bytes`` as they are.
``fsdp_module_info`` returns a copy of the ModuleInfo whose points carry, in ``other_bytes``, what
FSDP2 holds *on top of* the sharded state at that instant, so the unchanged solver computes the
per-rank memory of a ``fully_shard``-ed training step. Each rule below is how ``fully_shard`` in
torch 2.13 behaves with its defaults (``reshard_after_forward`` left unset, implicit prefetching,
no mixed precision, no CPU offload); ``W`` is the world size and a unit's *own* parameter bytes are
its ``ModStats.param_bytes`` minus those of the units nested in it (likewise for gradients).
Every rule has a test on a hand-built ModuleInfo (tests/planner/fsdp/test_memory.py).

R1  sharded state: parameters, gradients (after their reduce-scatter) and optimizer state are
    1/W per rank. The points' param/grad/optimizer bytes stay as traced; the solver divides them.
R2  the root stays gathered: the root unit is not resharded after forward (``_lazy_init`` clears
    its ``post_forward_mesh_info``) and its post-backward runs in the final backward callback, so
    its own unsharded parameters are held at every forward and backward point from its forward on.
R3  running units are gathered: at a forward or backward point, every unit that is the point's
    module or one of its ancestors (found from ``MemoryPoint.fqn``) holds its own unsharded
    parameters (``pre_forward``/``pre_backward`` all-gather, ``post_forward``/``post_backward``
    reshard). Ops outside every module (the loss) have no running unit but the root (R2).
R4  forward all-gather buffer (W > 1): the flat all-gather output of the unit gathered last in
    forward is kept (``comm_ctx.all_gather_state``) until the next unit's copy-out or the root's
    post-forward: at a forward point before the root's forward ends, add the own parameter bytes
    of the unit with the latest forward start at or before the point.
R5  backward prefetch (W > 1): a unit's ``pre_backward`` all-gathers the unit before it in
    post-forward order; that flat buffer is held until the prefetched unit's own
    ``pre_backward`` copies it out: add its own parameter bytes at backward points in
    ``[unit.bw_pre_op, prefetched.bw_pre_op)``. The root prefetches the last unit.
R6  reduce-scatter buffer: a non-root unit's ``post_backward`` copies its unsharded gradients into
    a flat reduce-scatter input that stays referenced (``comm_ctx.reduce_scatter_states``) until
    the next ``post_backward``: add its own gradient bytes at backward points after its
    ``bw_post_op`` up to the next unit's ``bw_post_op`` (up to the end of backward for the last
    non-root unit: the root's post-backward in the final callback frees it).
R7  unsharded gradients: a unit's gradients are full-size until its reduce-scatter, the root's
    until the end of backward. At a backward point, of the traced ``grad_bytes`` all but the own
    gradients of non-root units whose backward ended are unsharded, so add their
    ``(W - 1) / W`` (the solver already counts ``1 / W``): ``u - u // W`` for ``u`` such bytes.
R7a gradients kept across steps (the traced step starts with every gradient allocated: gradient
    accumulation, ``ZeroGrad.ZERO``): the kept gradients are the sharded ones (the solver counts
    ``1 / W`` of the traced ``grad_bytes``); this backward's new gradients are extra and
    unsharded until their unit's reduce-scatter adds them in: add the gradient bytes the
    backward has written by the point (``MemoryPoint.grad_written_bytes``; the points split
    backward at every write, so this holds over each point's interval) less the own gradient
    bytes of the non-root units whose backward ended. A ModuleInfo without them (imported)
    gets every running unit's whole own gradient bytes and the root's from its backward's
    start (an upper bound while a unit's backward is part-way). This
    is FSDP2's default, a reduce-scatter after every micro-batch; with
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch the gradients stay
    unsharded instead, which is not modelled.
R8  mixed precision (``mp_policy``: FSDP2's ``MixedPrecisionPolicy``, or anything with its
    ``param_dtype`` / ``reduce_dtype``): the sharded parameters, gradients and optimizer state keep
    the traced dtype (``traced_param_dtype``, float32 by default); the all-gather gathers in
    ``param_dtype``, so gathered parameters, all-gather buffers and the unsharded gradients
    (R2-R5, R7, R7a) scale by ``param_dtype``'s size over the traced one; the reduce-scatter
    input (R6) by ``reduce_dtype``'s (default ``param_dtype``). ``param_dtype`` also makes the
    forward compute in that dtype: the activations are what the trace holds, so trace the step
    in that dtype (e.g. ``TrainStep(autocast_dtype=torch.bfloat16)``, close to but not the same
    as bf16 parameters: autocast keeps some ops in float32).

Simplifications (stated, not hidden):

* FSDP2 pads each parameter's dim 0 to a multiple of W; ModuleInfo has no per-parameter shapes,
  so padding is not counted (exact when W divides every dim 0).
* Copy-out transients (the flat all-gather output and the per-parameter unsharded tensors both
  alive for one copy) fall between two traced ops; memory points sit on ops, so they are not
  counted. The same holds for the root's reduce-scatter buffer (allocated and freed inside the
  final backward callback).
* The solver only evaluates the points the estimator picked (the unsharded step's highest op per
  interval); FSDP's additions are constant over most of an interval but not all of it.
* Each unit is assumed to run once per step (``n_calls == 1``; a warning says otherwise).
* Optimizer-step temporaries stay at their traced (unsharded) size in ``other_bytes``:
  conservative, and the optimizer step rarely holds the peak.
* The traced inputs are one rank's batch; activations are per rank and are not divided.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from estimators.contract.module_info import MemoryPoint, ModuleInfo, Phase
from planner.distributed.fsdp.units import Unit, check_world_size, unit_table

__all__ = ["FSDPExtraBytes", "FsdpPrecision", "fsdp_extra_bytes", "fsdp_module_info", "per_rank_info"]


@dataclass(frozen=True, kw_only=True)
class FSDPExtraBytes:
    """What FSDP2 holds at one memory point on top of the sharded state, in bytes (one rank).

    >>> FSDPExtraBytes(unsharded_param_bytes=8, all_gather_buffer_bytes=4).total_bytes
    12
    """

    unsharded_param_bytes: int = 0
    """Own parameters of the gathered units (R2, R3)."""
    all_gather_buffer_bytes: int = 0
    """Flat all-gather outputs held for overlap (R4 in forward, R5 in backward)."""
    reduce_scatter_buffer_bytes: int = 0
    """Flat reduce-scatter input of the unit reduced last (R6)."""
    unsharded_grad_bytes: int = 0
    """(W - 1) / W of the gradients not yet reduce-scattered (R7)."""

    @property
    def total_bytes(self) -> int:
        return (
            self.unsharded_param_bytes
            + self.all_gather_buffer_bytes
            + self.reduce_scatter_buffer_bytes
            + self.unsharded_grad_bytes
        )


def _post_forward_order(units: dict[str, Unit]) -> list[Unit]:
    """FSDP's ``post_forward_order``: units by forward end, a nested unit before its parent."""
    ran = [u for u in units.values() if u.stats.fw_post_op >= 0]
    return sorted(ran, key=lambda u: (u.stats.fw_post_op, -u.fqn.count(".")))


def _chain(fqn: str, units: dict[str, Unit]) -> list[Unit]:
    """Units that are ``fqn`` or one of its ancestors."""
    parts = fqn.split(".") if fqn else []
    prefixes = (".".join(parts[:k]) for k in range(len(parts), 0, -1))
    return [units[p] for p in prefixes if p in units]


# ------------------------------------------------------------------------------ the rules
def _gathered_param_bytes(p: MemoryPoint, units: dict[str, Unit], root: Unit) -> int:
    """R2 + R3."""
    if p.phase not in (Phase.FW, Phase.BW) or root.stats.fw_pre_op < 0 or p.op_index < root.stats.fw_pre_op:
        return 0
    gathered = {u.fqn: u for u in _chain(p.fqn, units)}
    gathered[root.fqn] = root
    return sum(u.own_param_bytes for u in gathered.values())


def _forward_all_gather_bytes(p: MemoryPoint, order_fw: list[Unit], root: Unit, world_size: int) -> int:
    """R4: the flat all-gather output of the unit gathered last in forward."""
    if world_size == 1 or p.phase is not Phase.FW or not root.stats.fw_pre_op <= p.op_index < root.stats.fw_post_op:
        return 0
    started = [u for u in order_fw if 0 <= u.stats.fw_pre_op <= p.op_index]
    return started[-1].own_param_bytes if started else 0


def _prefetch_bytes(p: MemoryPoint, order_post: list[Unit], world_size: int) -> int:
    """R5: flat all-gather outputs prefetched in backward and not yet copied out."""
    if world_size == 1 or p.phase is not Phase.BW:
        return 0
    held = 0
    for prev, unit in zip(order_post, order_post[1:]):
        start, end = unit.stats.bw_pre_op, prev.stats.bw_pre_op
        if start >= 0 and end > start and start <= p.op_index < end:
            held += prev.own_param_bytes
    return held


def _reduce_scatter_bytes(p: MemoryPoint, order_bw_end: list[Unit]) -> int:
    """R6: the reduce-scatter input of the non-root unit whose backward ended last."""
    if p.phase is not Phase.BW:
        return 0
    done = [u for u in order_bw_end if u.stats.bw_post_op < p.op_index]
    return done[-1].own_grad_bytes if done else 0


def _unsharded_grad_bytes(p: MemoryPoint, order_bw_end: list[Unit], world_size: int,
                          kept: bool, units: dict[str, Unit], root: Unit, scale: float = 1.0) -> int:
    """R7, or R7a when the gradients are ``kept`` across steps; unsharded gradients have the
    gathered parameters' dtype (``scale``: its size over the traced one, R8)."""
    if p.phase is not Phase.BW:
        return 0
    if kept and p.grad_written_bytes is not None:  # written so far, less the units reduced
        reduced = sum(u.own_grad_bytes for u in order_bw_end if u.stats.bw_post_op < p.op_index)
        return int(scale * max(0, p.grad_written_bytes - reduced))
    if kept:  # not recorded: every unit whose backward runs, whole (an upper bound)
        running = [u for u in units.values() if not u.is_root and u.stats.bw_pre_op <= p.op_index <= u.stats.bw_post_op]
        root_new = root.own_grad_bytes if 0 <= root.stats.bw_pre_op <= p.op_index else 0
        return int(scale * (sum(u.own_grad_bytes for u in running) + root_new))
    sharded = sum(u.own_grad_bytes for u in order_bw_end if u.stats.bw_post_op < p.op_index)
    unsharded = max(0, p.grad_bytes - sharded)
    return max(0, int(scale * unsharded) - unsharded // world_size)


def _dtype_scales(mp_policy: Any, traced_param_dtype: torch.dtype) -> tuple[float, float]:
    """R8: (gathered parameter / unsharded gradient scale, reduce-scatter scale)."""
    if mp_policy is None:
        return 1.0, 1.0
    base = torch.empty((), dtype=traced_param_dtype).element_size()
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or param_dtype

    def scale(dtype):
        return 1.0 if dtype is None else torch.empty((), dtype=dtype).element_size() / base

    return scale(param_dtype), scale(reduce_dtype)


def _grads_kept(info: ModuleInfo) -> bool:
    """The traced step starts with gradients allocated (R7a): they are there at its first point."""
    first = next((p for p in info.memory_points if p.phase is Phase.FW), None)
    return first is not None and first.grad_bytes > 0


def fsdp_extra_bytes(
    info: ModuleInfo, fsdp_units: Iterable[str], world_size: int, *, mp_policy: Any = None,
    traced_param_dtype: torch.dtype = torch.float32,
) -> tuple[FSDPExtraBytes, ...]:
    """What FSDP2 adds at each of ``info.memory_points`` (same order), by rule; see the module doc.

    >>> extras = fsdp_extra_bytes(info, ["GPT", "GPT.blocks.0"], world_size=2)  # doctest: +SKIP
    >>> max(e.total_bytes for e in extras)                                       # doctest: +SKIP
    """
    world_size = check_world_size(world_size)
    units = unit_table(info, fsdp_units)
    root = units[info.mod_stats[0].fqn]
    order_fw = sorted((u for u in units.values() if u.stats.fw_pre_op >= 0), key=lambda u: u.stats.fw_pre_op)
    order_post = _post_forward_order(units)
    order_bw_end = sorted(
        (u for u in units.values() if not u.is_root and u.stats.bw_post_op >= 0),
        key=lambda u: u.stats.bw_post_op,
    )
    kept = _grads_kept(info)
    ps, rs = _dtype_scales(mp_policy, traced_param_dtype)
    return tuple(
        FSDPExtraBytes(
            unsharded_param_bytes=int(ps * _gathered_param_bytes(p, units, root)),
            all_gather_buffer_bytes=int(ps * (_forward_all_gather_bytes(p, order_fw, root, world_size)
                                              + _prefetch_bytes(p, order_post, world_size))),
            reduce_scatter_buffer_bytes=int(rs * _reduce_scatter_bytes(p, order_bw_end)),
            unsharded_grad_bytes=_unsharded_grad_bytes(p, order_bw_end, world_size, kept, units, root, ps),
        )
        for p in info.memory_points
    )


def fsdp_module_info(
    info: ModuleInfo, fsdp_units: Iterable[str], world_size: int, *, mp_policy: Any = None,
    traced_param_dtype: torch.dtype = torch.float32,
) -> ModuleInfo:
    """A copy of ``info`` whose memory points also hold FSDP2's per-rank additions (in
    ``other_bytes``, which the solver does not divide by ``world_size``).

    Solve it with the same ``world_size`` and ``fsdp_units``::

        info2 = fsdp_module_info(est.module_info, units, world_size=8)
        res = SACMilp(info2, world_size=8, fsdp_units=units).solve(budget_bytes)

    ``peak_bytes`` and the per-module stats are kept as traced (one unsharded rank); the per-rank
    peak is ``predict_peak_bytes(info2, {}, world_size=8)``.
    """
    extras = fsdp_extra_bytes(info, fsdp_units, world_size, mp_policy=mp_policy,
                              traced_param_dtype=traced_param_dtype)
    points = tuple(
        dataclasses.replace(p, other_bytes=p.other_bytes + e.total_bytes)
        for p, e in zip(info.memory_points, extras)
    )
    return dataclasses.replace(info, memory_points=points)


@dataclass(frozen=True)
class FsdpPrecision:
    """FSDP2's mixed precision as the rules read it (R8): the policy's dtypes and the dtype the
    model's parameters were traced in (the sharded state's)."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    traced_param_dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, policy: Any, model: torch.nn.Module) -> "FsdpPrecision | None":
        """``policy`` (a ``MixedPrecisionPolicy``, or None) for ``model``, whose first floating
        parameter gives the traced dtype."""
        if policy is None or (policy.param_dtype is None and policy.reduce_dtype is None):
            return None
        traced = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return cls(policy.param_dtype, policy.reduce_dtype, traced)

    def describe(self) -> str:
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        param, reduce = (name.get(d, str(d)) if d is not None else None for d in (self.param_dtype, self.reduce_dtype))
        return (f"FSDP2 mixed precision: parameters gathered in {param or name.get(self.traced_param_dtype)}, "
                f"gradients reduced in {reduce or param or name.get(self.traced_param_dtype)}")


def per_rank_info(info: ModuleInfo, fsdp_units: Iterable[str], world_size: int,
                  precision: FsdpPrecision | None = None) -> ModuleInfo:
    """``fsdp_module_info`` with ``precision`` (None: the traced dtype throughout)."""
    if precision is None:
        return fsdp_module_info(info, fsdp_units, world_size)
    return fsdp_module_info(info, fsdp_units, world_size, mp_policy=precision,
                            traced_param_dtype=precision.traced_param_dtype)
