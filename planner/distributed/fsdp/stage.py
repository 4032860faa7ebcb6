"""A pipeline stage sharded by FSDP2, as one rank holds it: read from FSDP2's own state for the
rank's memory over its schedule (``estimators.pipeline.fsdp``, rules F1-F6).

    stage = stage_fsdp(module, "adamw", spec)     # None: fully_shard was never called on it

Every size is FSDP2's, on this rank: a parameter's padded shard (``padded_sharded_param_size``),
its all-gather output (``world_size`` padded shards), its unsharded gradient (the parameter's
shape before FSDP2), the reduce-scatter input and output (padded), and the optimizer state made
over the rank's own (unpadded) shards. The units are FSDP2's parameter groups in the order its
``all_states`` holds them (the root's first, then by module order), which is the order the
pipeline's reduce takes them. What the rules do not model is refused with what to do.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from estimators.pipeline.fsdp import FsdpStage, FsdpUnit
from estimators.step.optimizer import resolve_optimizer
from estimators.tracing.optimizer_state import make_first_step_state
from estimators.tracing.sharded_model import fsdp_layout, original_class_name
from planner.errors import PlanningError

__all__ = ["stage_fsdp"]

_HOW = ("shard the stage as torchtitan does under pipeline parallelism (examples.pipeline_stages."
        "shard_llama_stage: every unit reshard_after_forward=False, then the stage's module)")


def _states(module: torch.nn.Module) -> list[Any]:
    """FSDP2's states of ``module`` in ``all_states`` order (``FSDPState._lazy_init``)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out = []
    for _, m in module.named_modules():
        state = fully_shard.state(m) if isinstance(m, FSDPModule) else None
        if state is not None and all(state is not s for s in out):
            out.append(state)
    return out


def _check_group(group: Any, is_root: bool, name: str) -> None:
    if group.post_forward_mesh_info is not None and not is_root:
        raise PlanningError(f"FSDP2 unit {name} reshards after forward: under a pipeline schedule it would gather "
                            f"again in every micro-batch's forward and backward, which is not modelled; {_HOW}")
    for fp in group.fsdp_params:
        if fp.offload_to_cpu:
            raise PlanningError(f"FSDP2 unit {name} offloads its parameters to the CPU, which is not modelled "
                                "inside a pipeline stage; shard it without offload_policy")
        if fp.fsdp_placement.dim != 0:
            raise PlanningError(f"FSDP2 unit {name} shards a parameter on dim {fp.fsdp_placement.dim}: only "
                                "Shard(0) (FSDP2's default) is modelled inside a pipeline stage")
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise PlanningError(f"FSDP2 unit {name} gathers through a tensor subclass's fsdp_pre_all_gather "
                                "(e.g. float8), which is not modelled inside a pipeline stage")


def _kept_grad_bytes(fp: Any, placements: tuple | None) -> int | None:
    """Bytes of ``fp``'s gradient as the backward makes it in ``placements`` (tensor parallel,
    the trace's), or None where they are the parameter's own."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec = getattr(fp, "_unsharded_dtensor_spec", None)
    if placements is None or spec is None or tuple(spec.placements) == tuple(placements):
        return None
    if len(spec.placements) != len(placements):
        raise PlanningError(f"a gradient in placements {placements} over a parameter of {spec.placements} inside an "
                            "FSDP2 stage is not modelled")
    shape, _ = compute_local_shape_and_global_offset(spec.shape, spec.mesh, placements)
    return math.prod(shape) * fp.sharded_param.dtype.itemsize


def _unit(group: Any, names: dict[int, str], world_size: int, grad_placements: dict[str, tuple],
          local: dict[int, str]) -> tuple[FsdpUnit, int, int, int, list]:
    """The unit, its padded shard bytes, its shard and full elements, its trainable shards."""
    gathered = grads = rs_in = rs_out = sharded = shard_numel = full_numel = last = 0
    trained, redistributed = [], []
    for fp in group.fsdp_params:
        dtype = fp.sharded_param.dtype
        pad, size = math.prod(fp.padded_sharded_param_size), dtype.itemsize
        full = math.prod(fp._orig_size)
        gathered, sharded = gathered + world_size * pad * size, sharded + pad * size
        shard_numel, full_numel = shard_numel + math.prod(fp.sharded_size), full_numel + full
        if fp.sharded_param.requires_grad:
            grads, last = grads + full * size, full * size
            rs_in, rs_out = rs_in + world_size * pad * size, rs_out + pad * size
            trained.append((tuple(fp.sharded_size), dtype))
            info = fp._module_info
            name = ".".join(n for n in (local[id(info.module)], info.param_name) if n)
            kept = _kept_grad_bytes(fp, grad_placements.get(name))
            if kept is not None:
                redistributed.append((kept, full * size))
    unit = FsdpUnit(modules=tuple(names[id(m)] for m in group.modules), gathered_bytes=gathered, grad_bytes=grads,
                    reduce_scatter_input_bytes=rs_in, reduce_scatter_output_bytes=rs_out, last_grad_bytes=last,
                    redistributed=tuple(redistributed))
    return unit, sharded, shard_numel, full_numel, trained


def _optimizer_state_bytes(optimizer: Any, shards: list, spec: Any) -> int | None:
    """The state ``optimizer`` keeps for parameters of ``shards``' shapes (fake, nothing
    allocated); None where it is not one whose state is made without a step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if optimizer is None or not shards:
        return 0
    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape, dtype in shards]
        opt = resolve_optimizer(optimizer, [{"params": params}], spec, fake=True)
        if opt is None or not make_first_step_state(opt, params):
            return None
        seen = {}
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return sum(seen.values())


def stage_fsdp(module: torch.nn.Module, optimizer: Any, spec: Any, *,
               grad_placements: dict[str, tuple] | None = None) -> FsdpStage | None:
    """``module`` (a pipeline stage) as FSDP2 sharded it on this rank, or None when
    ``fully_shard`` was never called on it. ``optimizer``: the ``TrainStep``'s (its state is
    made over the rank's shards); ``spec``: the target device's ``DeviceSpec``;
    ``grad_placements``: the stage trace's (``Estimate.grad_placements``, by parameter name
    under ``module``): gradients the backward makes in other placements. Raises
    ``PlanningError`` for what the rules do not model (mixed precision, HSDP, offload,
    resharding after forward, other shard placements)."""
    layout = fsdp_layout(module)
    if layout is None:
        return None
    if layout.param_dtype is not None or layout.reduce_dtype is not None:
        raise PlanningError("the stage is sharded with an FSDP2 MixedPrecisionPolicy, which is not modelled inside a "
                            "pipeline stage yet; shard it without mp_policy (or with the parameters' own dtype)")
    if layout.replicate_world_size > 1:
        raise PlanningError("the stage is sharded with HSDP (a replicate dim), which is not modelled inside a "
                            "pipeline stage yet; shard it over one data-parallel dim")
    root = original_class_name(module)
    names = {id(m): f"{root}.{n}" if n else root for n, m in module.named_modules()}
    local = {id(m): n for n, m in module.named_modules()}  # the trace's parameter names
    units, sharded, shard_numel, full_numel, trained = [], 0, 0, 0, []
    for state in _states(module):
        is_root = state._modules[0] is module
        for group in state._fsdp_param_groups:
            name = "+".join(names[id(m)] for m in group.modules)
            _check_group(group, is_root, name)
            unit, b, n, f, t = _unit(group, names, layout.shard_world_size, grad_placements or {}, local)
            units.append(unit)
            sharded, shard_numel, full_numel, trained = sharded + b, shard_numel + n, full_numel + f, trained + t
    return FsdpStage(world_size=layout.shard_world_size, units=tuple(units), sharded_param_bytes=sharded,
                     optimizer_state_bytes=_optimizer_state_bytes(optimizer, trained, spec),
                     shard_numel=shard_numel, full_numel=full_numel,
                     copies_reduce_scatter_input=not spec.is_cuda)  # a CPU target runs gloo, a CUDA one NCCL
