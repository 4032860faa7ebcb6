"""What the framework integrations share: a step read from a trainer, planning it without
changing the run, the default target and budget, and the plan's notes."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from estimators.step.train_step import TrainStep
from planner.format import GiB
from planner.options import PlanOptions
from planner.plan import Plan

__all__ = ["FrameworkStep", "rng_kept", "peek_batch", "plan_options", "budget_gib_of", "with_notes",
           "tensors_of", "scalars"]


@dataclass(frozen=True)
class FrameworkStep:
    """A training step read from a framework's trainer."""

    step: TrainStep
    """The step the framework runs, as the planner traces and measures it."""
    notes: tuple[str, ...] = ()
    """What was read or changed, and what the framework's step does that the plan does not
    count (gradient clipping, a scheduler); they go into the plan's notes."""


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Torch's, Python's and numpy's global generators as they were, after the block: planning
    draws a batch from the trainer's dataloader (its sampler draws a seed), and the run must then
    draw exactly what it would have drawn unplanned (same shuffle, same dropout masks)."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=_cuda_devices()):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def peek_batch(loader: Any) -> Any:
    """The first batch ``loader`` (a ``torch.utils.data.DataLoader``) yields, taking nothing
    from the run. A map-style dataset: from a fresh iterator of the loader, the generators put
    back (the run draws the same shuffle). An ``IterableDataset`` read in this process: its
    first examples, collated as the loader collates them, then put back in front of the rest
    (``_put_back``), so a single-pass stream still gives the run every example, in order."""
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, torch.utils.data.IterableDataset) or getattr(loader, "num_workers", 0):
        with rng_kept():
            return next(iter(loader))
    it = iter(dataset)
    n = loader.batch_size
    items = list(itertools.islice(it, 1 if n is None else n))
    if not items:
        raise ValueError("the train dataset yields no example: there is no step to plan")
    _put_back(dataset, items, it)
    return loader.collate_fn(items[0] if n is None else items)


def _put_back(dataset: Any, items: list, rest: Iterator) -> None:
    """The next ``iter(dataset)`` yields ``items`` and then ``rest`` (the iterator they came
    from), once; after it, ``dataset`` is as it was. Done by giving the object a one-use subclass
    of its own class (``iter`` looks ``__iter__`` up on the class)."""
    cls = type(dataset)

    def __iter__(self):
        self.__class__ = cls
        return itertools.chain(items, rest)

    try:
        dataset.__class__ = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
    except TypeError as e:  # a class whose instances cannot change class (slots, an extension type)
        raise NotImplementedError(
            f"the train dataset ({cls.__name__}) is an IterableDataset whose examples cannot be put back after "
            f"planning reads a batch ({e}): plan with solve_sac and a TrainStep of one batch, then train") from None


def _cuda_devices() -> list[int]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


_GPU_NAMES = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"), ("b200", "b200"), ("l4", "l4"))


def plan_options(options: PlanOptions | None, device: torch.device) -> PlanOptions:
    """``options``, or the defaults with the target the run trains on: ``"cpu"``, or the CUDA
    device's DeviceSpec found by its name (H100, H200, A100 40/80 GB, L4, B200, GH200)."""
    if options is not None:
        if not isinstance(options, PlanOptions):
            raise TypeError(f"options must be a planner.PlanOptions, got {type(options).__name__}")
        return options
    if device.type != "cuda":
        return PlanOptions(device="cpu")
    props = torch.cuda.get_device_properties(device)
    name = props.name.lower()
    for key, spec in _GPU_NAMES:
        if key in name:
            return PlanOptions(device=spec)
    if "a100" in name:
        return PlanOptions(device="a100-80gb" if props.total_memory > 48 * GiB else "a100-40gb")
    raise ValueError(f"no DeviceSpec for the GPU {props.name!r}: pass options=PlanOptions(device=...) "
                     "with a known name or a DeviceSpec of its FLOP/s and bandwidth")


def budget_gib_of(budget_gib: float | None, device: torch.device, options: PlanOptions) -> float:
    """``budget_gib``, or the memory of the device the run trains on (a CUDA device's total
    memory; otherwise the target DeviceSpec's)."""
    if budget_gib is not None:
        return budget_gib
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GiB
    return options.spec.memory_bytes / GiB


def with_notes(plan: Plan, notes: tuple[str, ...]) -> Plan:
    """The plan with the framework's notes after its own."""
    return dataclasses.replace(plan, notes=(*plan.notes, *notes))


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors in a batch (a tensor, or nested dicts, lists and tuples of them)."""
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def scalars(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """``n`` 0-d tensors standing for the scalars a framework keeps beside the step
    (``TrainStep.held``: counted resident through it)."""
    return tuple(torch.zeros((), dtype=dtype, device=device) for _ in range(n))
