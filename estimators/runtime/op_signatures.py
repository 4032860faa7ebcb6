"""The distinct ops of a trace as data one process can hand to another, to be timed there.

A multi-rank planner (``planner/distributed/ranks.py``) traces the step once, records each distinct op
signature with :class:`SignatureRecorder`, shares the list, and every rank times its share with
:meth:`estimators.runtime.kernel_bench.BenchmarkRuntime.benchmark_signature`. A signature holds the
overload and its arguments with every tensor replaced by its layout (:class:`TensorSpec`), so it
holds no data and no FakeTensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
from torch._ops import OpOverload

from estimators.runtime.op_facts import hint, timed_key

__all__ = ["TensorSpec", "OpSignature", "SignatureRecorder", "synthetic_tensor"]

Args = Sequence[Any]
Kwargs = Mapping[str, Any]


def synthetic_tensor(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` elements of ``dtype``: uniform in [0.5, 1) if floating (or complex), zeros
    otherwise (so integer indices stay in range).

    Floating values are in the domain of every elementwise op a step runs (``sqrt``, ``log``,
    ``rsqrt``, ``pow``, ``acos``, probabilities for ``bernoulli`` / ``multinomial``) and far
    from denormals: outside an op's domain it makes NaN, which some CPUs compute on a slow path
    many times the op's time on training data (AdamW's second moment, for one, is >= 0)."""
    if dtype.is_floating_point or dtype.is_complex:
        # rand has no kernel for every float dtype (float8): draw in float32 and cast.
        if dtype.itemsize < 2 and not dtype.is_complex:
            return (torch.rand(numel, device=device) * 0.5 + 0.5).to(dtype)
        return torch.rand(numel, dtype=dtype, device=device) * 0.5 + 0.5
    return torch.zeros(numel, dtype=dtype, device=device)


def storage_extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements a view of ``shape`` / ``stride`` spans (broadcast and overlapping layouts kept)."""
    return 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a benchmark needs of one tensor argument: shape, strides, dtype (concrete ints)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        """The spec of ``t`` (symbolic sizes by their hints); non-strided layouts are refused."""
        return cls(tuple(map(hint, t.shape)), tuple(map(hint, t.stride())), t.dtype)

    def synthetic(self, device: torch.device) -> torch.Tensor:
        """A tensor of this layout on ``device``, values as :func:`synthetic_tensor` draws them."""
        shape, stride = list(self.shape), list(self.stride)
        return synthetic_tensor(storage_extent(shape, stride), self.dtype, device).as_strided(
            shape, stride, 0
        )


@dataclasses.dataclass(frozen=True, eq=False)
class OpSignature:
    """One distinct op a trace priced, with what :meth:`BenchmarkRuntime.benchmark_signature`
    needs to run it again: the overload and its arguments, tensors as :class:`TensorSpec`."""

    func: Any
    key: tuple
    """The runtime cache key (as :class:`BenchmarkRuntime` computes it)."""
    key_repr: str
    """``repr(key)``: how timings are named in the cache file and across processes."""
    args: tuple
    kwargs: dict
    out: Any


def _to_spec(value: Any, memo: dict[int, TensorSpec]) -> Any:
    """``value`` with every tensor replaced by its :class:`TensorSpec` (one per tensor object)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = TensorSpec.of(value)
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        items = [_to_spec(v, memo) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return hint(value)


class SignatureRecorder:
    """A runtime model that times nothing: it records the distinct op signatures of a trace
    (the ones :class:`BenchmarkRuntime` would time) and prices every op at 0 ms.

    Example::

        recorder = SignatureRecorder()
        with benchmark_runtime_override(recorder):
            estimate(model, inputs, options=EstimateOptions(runtime=RuntimeKind.BENCHMARK))
        bench = BenchmarkRuntime()
        for sig in recorder.signatures():
            bench.benchmark_signature(sig)
    """

    def __init__(self) -> None:
        self.name = "signatures"
        self.skipped = 0
        """Calls of ops with a non-strided tensor (sparse...): not recorded; a BenchmarkRuntime
        times them when it meets them."""
        self._seen: dict[str, OpSignature] = {}

    def op_runtime_ms(self, func: OpOverload, args: Args, kwargs: Kwargs, out: Any) -> float:
        keys = timed_key(func, args, kwargs, out)
        if keys is None:
            return 0.0
        key, key_repr = keys
        if key_repr not in self._seen:
            memo: dict[int, TensorSpec] = {}
            try:
                self._seen[key_repr] = OpSignature(
                    func=func, key=key, key_repr=key_repr, args=_to_spec(tuple(args), memo),
                    kwargs={k: _to_spec(v, memo) for k, v in kwargs.items()}, out=_to_spec(out, memo),
                )
            except (RuntimeError, NotImplementedError):  # non-strided tensors have no TensorSpec
                self.skipped += 1
        return 0.0

    def signatures(self) -> list[OpSignature]:
        """The distinct signatures, sorted by ``key_repr`` (the same order in every process that
        traced the same step)."""
        return [self._seen[k] for k in sorted(self._seen)]

    def __repr__(self) -> str:
        return f"SignatureRecorder(signatures={len(self._seen)})"
