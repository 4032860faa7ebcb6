"""What a traced step is made of: one record per op, storage and module call, and the trace itself.

Plain dataclasses filled by ``estimators.tracing.trace.StepTracer`` and read by every estimator
(memory, aggregate, sac) and by the apply side's offload accounting.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from estimators.contract.module_info import Phase

__all__ = ["StorageKind", "StorageRecord", "OpRecord", "ModuleCall", "StepTrace", "tensor_numel", "held_tensors", "final_storage_kind"]


class StorageKind(enum.IntEnum):
    """What a storage is, decided once the step is over."""

    PARAM = 0
    BUFFER = 1
    INPUT = 2
    GRAD = 3
    OPTIMIZER = 4
    ACTIVATION = 5  # saved for backward by autograd
    TEMP = 6  # everything else


@dataclass(slots=True)
class StorageRecord:
    sid: int
    nbytes: int
    alloc_op: int  # -1: existed before the step
    free_op: int | None = None  # last op during which it was alive; None: alive at the end
    kind: StorageKind = StorageKind.TEMP
    phase: Phase = Phase.FW
    owner_call: int = -1  # module call whose op created it
    saved: bool = False  # packed by autograd in the forward
    saved_by_calls: set[int] = field(default_factory=set)  # innermost calls whose ops packed it


@dataclass(slots=True)
class OpRecord:
    index: int
    func: Any  # torch._ops.OpOverload
    phase: Phase
    call: int  # innermost module call, -1 outside every module
    runtime_ms: float
    new_sids: tuple[int, ...]
    arg_sids: tuple[int, ...]
    is_view: bool
    mutated_sids: tuple[int, ...]
    is_random: bool


@dataclass(slots=True)
class ModuleCall:
    cid: int
    fqn: str
    parent: int  # enclosing call, -1 for the root call
    depth: int
    seq_start: int
    seq_end: int = -1
    fw_first_op: int = -1
    fw_last_op: int = -1
    bw_first_op: int = -1
    bw_last_op: int = -1
    input_sids: tuple[int, ...] = ()
    output_sids: tuple[int, ...] = ()
    post_rank: int = -1  # order in which forward post hooks fired
    input_numel: int = 0  # elements of the tensors the call was given


@dataclass
class StepTrace:
    """Everything recorded in one step, complete (``StepTracer.finish`` builds it once);
    estimators.tracing.memory / aggregate / sac derive from it."""

    ops: list[OpRecord]
    storages: list[StorageRecord]
    calls: list[ModuleCall]
    leaf_fqns: set[str]
    param_bytes_by_module: dict[str, int]
    grad_bytes_by_module: dict[str, int]
    device: str
    previous_output_sids: tuple[int, ...] = ()
    """Records standing for the previous micro-batch's (or step's) output, which a loop that keeps
    the output holds until this forward returns (``StepTracer(previous_output=True)``)."""
    collective_ms: dict[int, float] = field(default_factory=dict)
    """Whole communication time of each collective op (by op index); its ``runtime_ms`` is the
    part the compute stream waits for (``estimators.tracing.comm_overlap``)."""
    marks: dict[str, int] = field(default_factory=dict)
    """Named positions the step announced (``StepTracer.mark``): the index of the first op after
    each name, e.g. where a pipeline stage's backward or its weight half begins."""
    marked_sids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Named storages the step announced (a pipeline stage's loss, its received output gradient,
    the input gradient it sends)."""
    twin_of: dict[int, int] = field(default_factory=dict)
    """Call id -> id of the call it is a copy of: the blocks of a stack laid in from one traced
    block (``estimators.tracing.replicate``), whose ops and storages are that call's at another
    place. Estimators may reuse what they derived from the call's own ops."""


def tensor_numel(obj: Any) -> int:
    """Elements of the tensors in ``obj`` (a module call's arguments), however nested."""
    return sum(int(t.numel()) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


def held_tensors(obj: Any, max_depth: int = 6) -> list[torch.Tensor]:
    """The tensors a model output holds: its pytree leaves and the tensors of objects pytree does
    not open (HF's ``DynamicCache`` keeps the K/V cache in ``cache.layers[i].keys / .values``);
    none for None."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [(obj, 0)]
    while todo:
        o, depth = todo.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
            continue
        if depth >= max_depth or isinstance(o, (type, torch.nn.Module)):
            continue
        if isinstance(o, dict):
            inner = list(o.values())
        elif isinstance(o, (list, tuple)):
            inner = list(o)
        elif hasattr(o, "__dict__"):
            inner = list(vars(o).values())
        else:
            continue
        todo.extend((x, depth + 1) for x in inner)
    return found


def final_storage_kind(s: StorageRecord, grad_sids: set[int | None], optimizer_sids: set[int | None]) -> StorageKind:
    """The category of a storage made during the step, decided once the step is over."""
    if s.sid in grad_sids:
        return StorageKind.GRAD
    if s.sid in optimizer_sids or s.phase is Phase.OPTIM:
        # Step temporaries count with the state: both scale with the (sharded) parameters.
        return StorageKind.OPTIMIZER
    if s.saved and s.phase is Phase.FW:
        return StorageKind.ACTIVATION
    return StorageKind.TEMP
