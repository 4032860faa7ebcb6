"""The optimizer state of step 2, made without running step 1, for torch's common optimizers.

A fake trace plans the loop's steady state: the optimizer's state exists when the step starts
(``estimators.tracing.steady_state``). The general way to get it is one optimizer step on zero
gradients, which costs as much as the traced step's own optimizer phase and computes nothing the
trace keeps. For the optimizers below the state is made here as that first step leaves it: the
same entries in the same order (``optimizer.state`` is keyed by parameter, in group order), each
tensor made by the call torch's own code makes it with, and Adam's step count at 1:

* ``Adam`` / ``AdamW`` (``torch/optim/adam.py``, ``_init_group``): ``step`` =
  ``torch.tensor(0.0, dtype=_get_scalar_dtype())`` on the CPU, which the first step turns into 1
  (so it is made as 1.0: a fake mode keeps the value of such a small tensor, and the traced step
  reads it); ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq`` =
  ``torch.zeros_like(p, memory_format=torch.preserve_format)``. The step updates them in place.
* ``SGD`` (``torch/optim/sgd.py``): with ``momentum == 0`` no state; otherwise
  ``momentum_buffer`` = ``grad.detach().clone()`` of the first step's gradient (a zero gradient
  ``torch.zeros_like(p)`` here, as the warm-up gives it).

Only the exact classes (a subclass may override ``step``), with no step hooks (global or on the
optimizer: a hook may do anything), no group ``fused`` / ``capturable`` / ``differentiable`` (they
put ``step`` elsewhere or run other code), no tensor ``lr`` (Adam refuses it with ``foreach`` in
its first step: that error stays where torch raises it), and for SGD no ``weight_decay`` or
``maximize`` when it keeps momentum (its buffer is then a sum, not the gradient's copy). Anything
else returns False and the caller runs the step; tests/estimators/tracing/test_optimizer_state.py
compares each supported case with the state a real step leaves.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["make_first_step_state"]


def make_first_step_state(opt: torch.optim.Optimizer, stepped: list[torch.Tensor]) -> bool:
    """Give ``opt`` the state its first step would leave, when that step runs with a zero dense
    gradient on each parameter of ``stepped`` (and any gradient the others hold already). True if
    done; False (nothing changed) where this optimizer is not one made here (module docstring)."""
    maker = _MAKERS.get(type(opt))
    if maker is None or opt.state or _has_step_hooks(opt) or not all(maker.accepts(g) for g in opt.param_groups):
        return False
    ids = {id(p) for p in stepped}
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None or id(p) in ids:  # torch: the parameters with a gradient
                maker.make(opt, group, p)
    return True


def _has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module

    pre = getattr(optim_module, "_global_optimizer_pre_hooks", None)
    post = getattr(optim_module, "_global_optimizer_post_hooks", None)
    if pre is None or post is None:
        return True  # another torch: the hooks cannot be checked
    return bool(pre or post or getattr(opt, "_optimizer_step_pre_hooks", None)
                or getattr(opt, "_optimizer_step_post_hooks", None))


class _Maker(NamedTuple):
    accepts: Callable[[dict], bool]
    """Whether a param group's settings are ones this state is made for."""
    make: Callable[[torch.optim.Optimizer, dict, torch.Tensor], None]
    """Make one parameter's state entry."""


def _plain_group(group: dict) -> bool:
    return not (group.get("fused") or group.get("capturable") or group.get("differentiable"))


def _adam_accepts(group: dict) -> bool:
    return (_plain_group(group) and not torch.is_tensor(group.get("lr")) and "amsgrad" in group
            and _scalar_dtype() is not None)


def _scalar_dtype() -> torch.dtype | None:
    """torch's dtype for Adam's CPU step count (``torch.optim.optimizer._get_scalar_dtype``)."""
    from torch.optim import optimizer as optim_module

    get = getattr(optim_module, "_get_scalar_dtype", None)
    return get() if callable(get) else None


def _step_count() -> torch.Tensor:
    """``torch.tensor(1.0, dtype=_get_scalar_dtype(), device="cpu")``. Under a fake mode that is
    the mode's fake tensor keeping the value, which the mode makes for ``torch.tensor`` as
    ``from_real_tensor(..., make_constant=True)`` of the real one: a ``FakeTensor`` over a meta
    tensor of the same shape with the real one as ``constant``, and the real one memoized to it (a
    kernel run on the constant, ``step += 1``, maps its result back to this tensor). Made so here
    directly: the converter's general description of a tensor costs most of the optimizer's
    state-making, and a fresh 0-dim CPU tensor needs none of it. A FakeTensor constructor this
    does not fit (another torch) falls back to the converter."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    converter = getattr(mode, "fake_tensor_converter", None)
    if converter is None:
        return torch.tensor(1.0, dtype=_scalar_dtype(), device="cpu")
    dtype = _scalar_dtype()
    # Python dispatch off rather than every mode popped and pushed back (``_disable_current_modes``,
    # a third of this function's time): the two plain tensors and the FakeTensor's constructor
    # run no op any mode would see.
    with no_dispatch():
        real = torch.tensor(1.0, dtype=dtype, device="cpu")
        try:
            fake = FakeTensor(mode, torch.empty((), dtype=dtype, device=_META), _CPU, constant=real)
        except TypeError:
            fake = None
    if fake is None:
        with _disable_current_modes():
            return converter.from_real_tensor(mode, real, make_constant=True)
    converter.set_tensor_memo(real, fake)
    return fake


_META, _CPU = torch.device("meta"), torch.device("cpu")


def _adam_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
    state = opt.state[p]
    state["step"] = _step_count()
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sgd_accepts(group: dict) -> bool:
    momentum = group.get("momentum")
    if momentum is None or not _plain_group(group):
        return False
    return momentum == 0 or (group.get("weight_decay") == 0 and not group.get("maximize"))


def _sgd_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
    if group["momentum"] == 0:
        return
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    opt.state[p]["momentum_buffer"] = grad.detach().clone()


_MAKERS: dict[type, _Maker] = {
    torch.optim.Adam: _Maker(_adam_accepts, _adam_state),
    torch.optim.AdamW: _Maker(_adam_accepts, _adam_state),
    torch.optim.SGD: _Maker(_sgd_accepts, _sgd_state),
}
