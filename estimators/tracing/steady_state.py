"""The steady state a trace starts from, and the first step beside it.

The step traced is the loop's steady state (step 2 on): before tracing, every parameter gets a
zero gradient (an empty sparse one for sparse embeddings) and the optimizer steps once, so its
state exists; then gradients are kept or dropped as ``TrainStep`` says. The first step of a fresh
run differs only in what it does not hold yet (optimizer state, gradients, a previous output):
``first_step_peak`` takes those bytes out of the steady-state timeline, ``first_step_module_info``
gives the solver the same view."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from estimators.tracing.memory import MemoryTimeline
from estimators.tracing.optimizer_state import make_first_step_state
from estimators.contract.module_info import ModuleInfo, Phase
from estimators.step.train_step import TrainStep, values_read_in
from estimators.tracing.trace import StepTrace, StorageKind

__all__ = ["steady_state", "grad_placement_hooks", "sparse_grad_params", "first_step_peak", "first_step_module_info"]


def steady_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer | None, step: TrainStep, without_grad: frozenset[str] = frozenset(),
    *, fake: bool = False, grad_placements: Mapping[str, tuple] | None = None,
) -> None:
    """Give the traced model the state the loop's binding micro-batch starts with: optimizer
    state created (one step on zero gradients), gradients allocated or not (see TrainStep).
    Parameters named in ``without_grad`` never get a gradient, so neither gradient nor state.
    ``fake``: the model's tensors are fake; the state of a common optimizer is then made as that
    step leaves it, without running it (``estimators.tracing.optimizer_state``).
    ``grad_placements``: DTensor parameters whose gradient the backward makes in these
    placements (``grad_placement_hooks``); their gradients are made so."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in without_grad]
    params = [p for _, p in named]
    sparse = sparse_grad_params(model)
    stepped = opt is not None and not (fake and not sparse and make_first_step_state(opt, params))
    if stepped or step.grads_alive_at_start:
        with torch.no_grad():
            for n, p in named:
                p.grad = (_empty_sparse_like(p) if id(p) in sparse else
                          _dtensor_zeros(p, grad_placements[n]) if grad_placements and n in grad_placements else
                          torch.zeros_like(p))
    if stepped:
        with values_read_in(f"the optimizer step ({type(opt).__name__})"):
            opt.step()
    for p in params:
        if not step.grads_alive_at_start:
            p.grad = None
        elif stepped:  # zero again after the step (the fresh zeros of a made state are zero already)
            p.grad.zero_()


def grad_placement_hooks(params: Mapping[str, torch.Tensor], placed: dict[str, tuple], *, kept: bool) -> list:
    """Hooks that note in ``placed`` each DTensor parameter whose gradient reaches it in other
    placements than its ``.grad`` has (a vocabulary-sharded embedding's gradient is replicated):
    with gradients ``kept`` across micro-batches, the loop's gradient is the one the first
    backward made, in its placements and size. None for ``kept=False``."""
    hooks = []
    for name, p in params.items() if kept else ():
        if _placements(p) is None:
            continue

        def seen(g: torch.Tensor, name: str = name, p: torch.Tensor = p) -> None:
            start = _placements(p.grad if p.grad is not None else p)
            if _placements(g) not in (None, start):
                placed.setdefault(name, _placements(g))
        hooks.append(p.register_hook(seen))
    return hooks


def _placements(t: torch.Tensor) -> tuple | None:
    """A DTensor's placements, None for a plain tensor."""
    placements = getattr(t, "placements", None)
    return None if placements is None else tuple(placements)


def _dtensor_zeros(p: torch.Tensor, placements: tuple) -> torch.Tensor:
    """Zeros of DTensor ``p``'s global shape and dtype on its mesh, in ``placements``."""
    from torch.distributed.tensor import zeros

    return zeros(p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=placements)


def sparse_grad_params(model: torch.nn.Module) -> set[int]:
    """Parameters whose gradient is sparse: the weights of ``Embedding`` / ``EmbeddingBag`` with
    ``sparse=True``. Their steady-state gradient is sparse too, and ``SparseAdam`` refuses a
    dense one ("does not support dense gradients", planning stopped where training runs)."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return {id(m.weight) for m in model.modules() if isinstance(m, kinds) and m.sparse}


def _empty_sparse_like(p: torch.Tensor) -> torch.Tensor:
    """A sparse COO gradient of ``p``'s shape with no rows: what the optimizer sees for an
    embedding none of whose rows were looked up."""
    rows = torch.zeros((1, 0), dtype=torch.long, device=p.device)
    values = torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(rows, values, p.shape, is_coalesced=True, check_invariants=False)


def first_step_peak(trace: StepTrace, timeline: MemoryTimeline, step: TrainStep) -> int:
    """The steady-state timeline without what the first step of a fresh run does not hold yet."""
    total = timeline.total.copy()
    if not len(total):
        return 0
    state = sum(s.nbytes for s in trace.storages if s.alloc_op < 0 and s.kind is StorageKind.OPTIMIZER)
    grads = sum(s.nbytes for s in trace.storages if s.alloc_op < 0 and s.kind is StorageKind.GRAD)
    optim = next((op.index for op in trace.ops if op.phase is Phase.OPTIM), len(total))
    total[:optim] -= state
    if step.micro_batches == 1 and grads:
        # The only micro-batch of step 1 starts with no gradient: none in its forward.
        bw = next((op.index for op in trace.ops if op.phase is Phase.BW), len(total))
        total[:bw] -= grads
    if step.micro_batches == 1:
        # ... and with no previous output held (a later micro-batch has its predecessor's).
        for sid in trace.previous_output_sids:
            s = trace.storages[sid]
            total[: s.free_op + 1] -= s.nbytes
    return int(total.max())


def first_step_module_info(info: ModuleInfo) -> ModuleInfo:
    """The first step's view of a steady-state ModuleInfo, for the solver: no optimizer state at
    forward and backward points (optimizer-phase points keep it: torch's optimizers create it
    before their update math). With it, ``predict_peak_bytes`` gives a plan's first-step peak."""
    points = tuple(
        dataclasses.replace(p, optimizer_bytes=0) if p.phase in (Phase.FW, Phase.BW) else p
        for p in info.memory_points
    )
    return dataclasses.replace(info, memory_points=points)
