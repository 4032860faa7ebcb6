"""The roofline runtime model: each op's time on a DeviceSpec from its FLOPs and bytes (no GPU).

``args`` / ``kwargs`` / ``out`` may hold FakeTensors (a FakeTensorMode may be active) or real
tensors; both give the same number. Example::

    from estimators.runtime.roofline import RooflineRuntime
    model = RooflineRuntime(get_device_spec("h100"))
    model.op_runtime_ms(torch.ops.aten.mm.default, (a, b), {}, a @ b)

What the roofline models, exactly:

* ``time = max(flops / (peak(dtype) * compute_efficiency),
  bytes / (bandwidth * bandwidth_efficiency)) + kernel_launch_ms``. ``peak(dtype)`` is the spec's
  peak for the dtype of the op's first floating tensor input (its output's when it has none).
* FLOPs come from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention), plus
  the CPU / "overrideable" fused-attention ops and ``_addmm_activation`` that torch's registry
  lacks. Attention follows torch's convention: ``is_causal`` does not halve the count. Other ops
  count 0 FLOPs, so they are memory-bound by construction.
* Bytes = tensor inputs read + tensor outputs written, per view (not whole storages). A stride-0
  (broadcast) dimension is read once, as torch's own ``get_num_bytes`` does. ``out=`` arguments
  and the ``self`` of write-only ops (``copy_``, ``fill_``, ``zero_``, in-place RNG) are not read.
  Ops that return nothing (``_foreach_add_``) write their mutated arguments.
* Free (0 ms, no launch): views and in-place view ops, metadata queries, allocation-only ops
  (``empty*``, ``resize_``, ``set_``), profiler markers, ``_local_scalar_dense`` (a host read; a
  device sync is not modelled), ops whose written tensors are all empty, ops that touch no bytes.
* Not modelled: collectives and host<->device copies (priced as plain memory ops at device
  bandwidth), cache effects, kernel fusion.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._ops import OpOverload
from torch.utils import flop_counter

from estimators.runtime.device import DeviceSpec
from estimators.runtime.op_facts import (
    cache_key,
    hint,
    is_empty,
    op_facts,
    read_tensors,
    tensor_bytes,
    written_tensors,
)

__all__ = ["RooflineRuntime", "op_flops"]

logger = logging.getLogger(__name__)
aten = torch.ops.aten

FlopFormula = Callable[..., Any]
Args = Sequence[Any]
Kwargs = Mapping[str, Any]


# Same convention as torch's registry: the op's raw args, its output as ``out_val``.
def _sdpa_forward_flop(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_backward_flop(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


def _addmm_activation_flop(bias: Any, mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.mm_flop(mat1.shape, mat2.shape)


def _extra_formulas() -> dict[Any, FlopFormula]:
    """Formulas torch's flop_registry lacks; same call convention (raw args, ``out_val=``)."""
    pairs = [
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward_flop),
        ("_scaled_dot_product_fused_attention_overrideable", _sdpa_forward_flop),
        ("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_backward_flop),
        ("_addmm_activation", _addmm_activation_flop),
    ]
    return {getattr(aten, n): f for n, f in pairs if hasattr(aten, n)}


# torch's entries first: where both exist (a future torch), torch's formula wins.
_FLOP_FORMULAS: dict[Any, FlopFormula] = {**_extra_formulas(), **flop_counter.flop_registry}


def _first_float_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
    for t in tensors:
        if t.is_floating_point():
            return t.dtype
    return None


def op_flops(func: Any, args: Args, kwargs: Kwargs, out: Any) -> int:
    """FLOPs of one aten op by torch's flop_counter formulas (plus CPU attention); 0 if none.

    >>> op_flops(torch.ops.aten.mm.default, (torch.ones(2, 3), torch.ones(3, 4)), {}, None)
    48
    """
    formula = _flop_formula(func)
    if formula is None:
        return 0
    return _call_formula(func, formula, args, kwargs, out)


_FORMULA_OF: dict[Any, FlopFormula | None] = {}


def _flop_formula(func: Any) -> FlopFormula | None:
    if func not in _FORMULA_OF:
        _FORMULA_OF[func] = _FLOP_FORMULAS.get(getattr(func, "_overloadpacket", func))
    return _FORMULA_OF[func]


_FORMULA_FAILED: set[Any] = set()


def _call_formula(func: Any, formula: FlopFormula, args: Args, kwargs: Kwargs, out: Any) -> int:
    try:
        # The registry's own convention (FlopCounterMode._count_flops): raw args, output as out_val;
        # its shape_wrapper turns tensors into shapes.
        return int(hint(formula(*args, **kwargs, out_val=out)))
    except Exception as exc:  # noqa: BLE001 -- any formula bug must not kill a whole trace
        if func not in _FORMULA_FAILED:
            _FORMULA_FAILED.add(func)
            logger.warning("FLOP formula for %s failed (%s); pricing it as memory-bound", func, exc)
        return 0


_ANNOUNCED: set[str] = set()


_PRICES: dict[tuple, dict[tuple, float]] = {}
"""The figures a price is made of (:func:`_pricing_figures`) -> that cache: shared by every
RooflineRuntime with those figures in the process (a trace makes its own runtime; a search plans
hundreds of candidates that run the same ops)."""


def _pricing_figures(spec: DeviceSpec) -> tuple:
    """Everything of ``spec`` that :meth:`RooflineRuntime.price` reads."""
    return (spec.memory_bandwidth_bytes_per_s, spec.bandwidth_efficiency, spec.compute_efficiency,
            spec.kernel_launch_ms, tuple(sorted((str(k), v) for k, v in spec.peak_flops_per_s.items())))


class RooflineRuntime:
    """Roofline time of each op on a DeviceSpec; see the module docstring for what is modelled.

    Results are cached by (func, input shapes / strides / dtypes, non-tensor args), so a step with
    tens of thousands of ops prices each distinct op once; the cache is shared by every instance
    whose spec has the same pricing figures (a price is a function of the key and those alone).
    """

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.name = f"roofline:{spec.name}"
        summary = spec.summary()
        if summary not in _ANNOUNCED:  # which spec and efficiencies price the ops, once per spec
            _ANNOUNCED.add(summary)
            logger.info("roofline on %s", summary)
        self._cache: dict[tuple, float] = _PRICES.setdefault(_pricing_figures(spec), {})
        self._bytes_per_ms = spec.memory_bandwidth_bytes_per_s * spec.bandwidth_efficiency / 1e3

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        facts = op_facts(func)
        if facts.free:
            return 0.0
        try:
            key = cache_key(func, facts, args, kwargs, out, safe=False)
            ms = self._cache.get(key)
        except (TypeError, RuntimeError, NotImplementedError):
            # Symbolic shapes are unhashable, sparse tensors have no strides: slower exact key.
            key = cache_key(func, facts, args, kwargs, out, safe=True)
            ms = self._cache.get(key)
        if ms is None:
            ms = self._cache[key] = self.price(func, args, kwargs, out)
        return ms

    def price(self, func: Any, args: Args, kwargs: Kwargs, out: Any) -> float:
        """Uncached roofline time in ms of one call (0 for an op that launches no kernel)."""
        facts = op_facts(func)
        if facts.free:
            return 0.0
        reads = read_tensors(facts, args, kwargs)
        writes = written_tensors(facts, args, kwargs, out)
        if writes and all(map(is_empty, writes)):
            return 0.0  # empty outputs: kernels early-exit or are skipped
        moved_bytes = sum(map(tensor_bytes, writes)) + sum(map(tensor_bytes, reads))
        flops = op_flops(func, args, kwargs, out)
        if moved_bytes == 0 and flops == 0:
            return 0.0
        memory_ms = moved_bytes / self._bytes_per_ms
        compute_ms = 0.0
        if flops:
            dtype = _first_float_dtype(reads) or _first_float_dtype(writes) or torch.float32
            compute_ms = flops / (self.spec.flops_per_s(dtype) * self.spec.compute_efficiency) * 1e3
        return max(memory_ms, compute_ms) + self.spec.kernel_launch_ms

    def __repr__(self) -> str:
        return f"RooflineRuntime({self.spec.name!r}, cached={len(self._cache)})"
