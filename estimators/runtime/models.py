"""Which runtime model prices the ops of a trace: the protocol, the kinds, and the factory.

The step tracer calls, for every aten op it records (after running it)::

    runtime_ms = model.op_runtime_ms(func, args, kwargs, out)

Two models implement it: ``estimators.runtime.roofline.RooflineRuntime`` (FLOPs and bytes on a
DeviceSpec, no GPU needed) and ``estimators.runtime.kernel_bench.BenchmarkRuntime`` (real kernel timings
on this machine); ``estimators.runtime.op_signatures.SignatureRecorder`` stands in for the benchmark to
record what a trace would time. Example::

    from estimators.runtime.models import make_runtime_model
    model = make_runtime_model("roofline", get_device_spec("h100"))
    model.op_runtime_ms(torch.ops.aten.mm.default, (a, b), {}, a @ b)
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch._ops import OpOverload

from estimators.runtime.device import DeviceSpec
from estimators.runtime.kernel_bench import BenchmarkRuntime
from estimators.runtime.roofline import RooflineRuntime

__all__ = ["RuntimeModel", "RuntimeKind", "make_runtime_model", "benchmark_runtime_override"]

Args = Sequence[Any]
Kwargs = Mapping[str, Any]


@runtime_checkable
class RuntimeModel(Protocol):
    """Anything that prices one aten op in milliseconds."""

    name: str
    """Short label recorded with the estimates, e.g. ``"roofline:h100"``."""

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        """Estimated runtime of ``func(*args, **kwargs)`` that produced ``out``."""
        ...


class RuntimeKind(enum.Enum):
    """Which RuntimeModel :func:`make_runtime_model` builds."""

    ROOFLINE = "roofline"
    BENCHMARK = "benchmark"


_BENCHMARK_OVERRIDE: contextvars.ContextVar[RuntimeModel | None] = contextvars.ContextVar(
    "benchmark_runtime_override", default=None
)


@contextlib.contextmanager
def benchmark_runtime_override(model: RuntimeModel):
    """While active, ``make_runtime_model(BENCHMARK, spec)`` (no options) returns ``model``
    instead of a new :class:`BenchmarkRuntime`: how a trace records signatures or uses timings
    shared between processes. Other kinds and calls with options are unaffected.
    """
    token = _BENCHMARK_OVERRIDE.set(model)
    try:
        yield model
    finally:
        _BENCHMARK_OVERRIDE.reset(token)


# ----------------------------------------------------------------------------- factory


def make_runtime_model(kind: RuntimeKind | str, spec: DeviceSpec, **kw: Any) -> RuntimeModel:
    """Build the RuntimeModel of ``kind`` for the target ``spec``.

    ``ROOFLINE`` takes no options. ``BENCHMARK`` takes :class:`BenchmarkRuntime`'s keywords: it
    times kernels on ``device`` (default ``"cuda"`` for a CUDA spec, else ``"cpu"``); ops that
    cannot run get ``spec``'s roofline when ``spec`` is that kind of device, else the cpu spec's.

    >>> from estimators.runtime.device import get_device_spec
    >>> make_runtime_model("roofline", get_device_spec("h100")).name
    'roofline:h100'
    """
    kind = _parse_kind(kind)
    if kind is RuntimeKind.ROOFLINE:
        if kw:
            raise TypeError(f"the roofline runtime model takes no options, got {sorted(kw)}")
        return RooflineRuntime(spec)
    override = _BENCHMARK_OVERRIDE.get()
    if override is not None and not kw:
        return override
    device = torch.device(kw.pop("device", "cuda" if spec.is_cuda else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"benchmarking for {spec.name!r} needs a CUDA device and this machine has none: use "
            f"RuntimeKind.ROOFLINE to plan for {spec.name!r} here, or device='cpu' to time this CPU"
        )
    kw.setdefault("fallback_spec", spec if spec.kind == device.type else "cpu")
    return BenchmarkRuntime(device=device, **kw)


def _parse_kind(kind: RuntimeKind | str) -> RuntimeKind:
    if isinstance(kind, RuntimeKind):
        return kind
    try:
        return RuntimeKind(str(kind).strip().lower())
    except ValueError:
        known = ", ".join(k.value for k in RuntimeKind)
        raise ValueError(f"unknown runtime model kind {kind!r}; known kinds: {known}") from None
