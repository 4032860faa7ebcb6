"""CUDA autocast's op policy, applied to a fake trace on CPU tensors for a CUDA target.

A trace for a GPU runs on fake CPU tensors (fake CUDA tensors cannot run autograd on a CPU-only
torch build), so ``torch.autocast`` there applies the CPU's op lists. CUDA's differ: it runs
``layer_norm``, ``group_norm``, ``rms_norm``, ``softmax`` / ``log_softmax``, ``exp``, ``pow``,
``rsqrt``, ``sum`` / ``prod`` / ``cumsum``, the norms and the losses in float32, or promotes mixed
arguments to float32, where CPU autocast lets them follow a low-precision input; it casts
``einsum``, ``mv``, ``addmv``, ``addr``, the RNN cells down where CPU autocast does not; it leaves
alone what only the CPU's lists hold (``cat`` / ``stack`` promotion, the FFTs and linear algebra
in float32, 3-D pooling and padding, ``cross_entropy_loss`` as one float32 op: on CUDA it
decomposes and its ``log_softmax`` and ``nll_loss`` meet the policy one by one), and it refuses
``binary_cross_entropy``.

``with CudaAutocast():`` around a fake step makes every CPU autocast region inside follow CUDA's
policy op by op, with CPU autocast's enabled flag and dtype standing for the target's (a model
that turns autocast off for ``x.device.type`` turns it off here too). The lists are torch's own
(``estimators.tracing.autocast_policy``); the semantics of each policy are ``autocast_mode.h``'s
``WrapFunction_``:

* lower precision: each floating tensor argument (not float64) cast to the autocast dtype;
* float32: each cast to float32;
* float32 via ``dtype``: ``dtype=None`` becomes float32 when the first tensor is floating; a
  float16 ``softmax`` / ``log_softmax`` then runs CUDA's fused ``half_to_float`` kernel (no
  float32 copy of its input), a bfloat16 one is copied to float32 first (``SoftMax.cpp``);
* float32 by redispatch: ``norm`` runs its overload with ``dtype=float32``;
* promote: each floating argument cast to the widest of them;
* banned: CUDA autocast's own error;
* left alone (only the CPU's lists hold the op): run as called; a composite op decomposes and its
  parts meet the policy, as on CUDA.

How: a Python kernel per op that differs is registered, while any ``CudaAutocast`` is active, on
the ``AutocastPrivateUse1`` dispatch key (no kernels there on a torch without a PrivateUse1
backend; dispatched before ``AutocastCPU``), which is switched on in the active thread only. Each
kernel acts while CPU autocast is enabled and skips the CPU's kernel; outside autocast each runs
its op as called. Registering them (a backend fallback and about two hundred kernels: every
operator's dispatch table updated, and again when they go) is a twentieth of a small model's
trace, so a step that does not announce autocast (no autocast dtype, no context of the user's, no
TorchScript) is traced without them under an :class:`AutocastWatch`, and again with them if the
watch saw CPU autocast on (``estimation._trace_step``). Registering them mid-step instead is not
safe: a guard that restores the thread's dispatch keys (``torch._C._DisableTorchDispatch``, which
the tracer's module hooks enter) drops the routing key a call inside it switched on.

The weight-cast cache: CUDA autocast keeps the low-precision copy of each float32 leaf that
requires grad (the parameters) until the outermost autocast region ends. Ops on CUDA's
lower-precision list that have a CPU autocast kernel too (``linear``, ``matmul``, ``mm``,
``addmm``, ``bmm``, ``baddbmm``, the convolutions, ``prelu``, SDPA...; the tests check each casts
down on the CPU) are not taken over: the CPU kernel casts them the same way with the same
``cached_cast`` code, so their parameter copies live exactly as CUDA's do, in the forward and in
a checkpoint's recompute. The ops only CUDA casts down (``einsum``, ``mv``, ``addmv``, ``addr``,
``chain_matmul``, ``linalg_multi_dot``, the RNN cells, ``convolution``) keep their own cache
under the same rule, dropped when the forward's autocast region ends (:meth:`CudaAutocast.on_phase`);
in a checkpoint's recompute they cast on every use, and a parameter fed to both kinds of op in
one region is copied once by each cache where CUDA keeps one copy.

Not modelled: autocast regions the model opens for ``"cuda"`` by name (off in a CPU trace);
kernels CUDA runs differently outside autocast (``rms_norm`` runs the fused ``_fused_rms_norm``
on CUDA and keeps less than the CPU composite traced here).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

from estimators.contract.module_info import Phase
from estimators.tracing.autocast_policy import CastPolicy, PolicyUnavailableError, autocast_kernel_ops, cuda_policy

__all__ = ["AutocastWatch", "CudaAutocast", "taken_over"]

_aten = torch.ops.aten
_ROUTE = torch._C.DispatchKey.AutocastPrivateUse1
_CPU = torch._C.DispatchKey.AutocastCPU
_HALF_TO_FLOAT = {_aten.softmax.int: _aten._softmax.default, _aten.log_softmax.int: _aten._log_softmax.default}


def taken_over() -> dict[str, CastPolicy | None]:
    """The ops whose kernels :class:`CudaAutocast` registers: CUDA's policy, or None to leave the
    op alone (only the CPU's lists hold it). Lower-precision ops with a CPU kernel are left to it."""
    cuda, cpu = cuda_policy(), autocast_kernel_ops("AutocastCPU")
    # Other namespaces' autocast kernels (torchvision's) are their own, for both devices: kept.
    ops: dict[str, CastPolicy | None] = {n: None for n in cpu if n not in cuda and n.startswith("aten::")}
    ops.update({n: p for n, p in cuda.items() if not (p is CastPolicy.LOWER and n in cpu)})
    return ops


class CudaAutocast:
    """``with CudaAutocast():`` around a fake-mode step (see the module docstring)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._caching = True
        self._prev: tuple[bool, bool] = (False, True)

    def __enter__(self) -> "CudaAutocast":
        _registration.acquire()
        _active().append(self)
        self._prev = (torch._C._dispatch_tls_is_dispatch_key_included(_ROUTE),
                      torch._C._dispatch_tls_is_dispatch_key_excluded(_ROUTE))
        torch._C._dispatch_tls_set_dispatch_key_included(_ROUTE, True)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_ROUTE, False)
        self._caching = True
        return self

    def __exit__(self, *exc) -> None:
        included, excluded = self._prev
        torch._C._dispatch_tls_set_dispatch_key_included(_ROUTE, included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_ROUTE, excluded)
        self._cache.clear()
        _active().remove(self)
        _registration.release()

    def on_phase(self, set_phase: Callable[[Any], None]) -> Callable[[Any], None]:
        """A ``run_step`` ``on_phase`` callback: ``set_phase``, with the forward's weight-cast cache
        dropped first once the step leaves its forward (its autocast region has ended)."""

        def on_phase(phase) -> None:
            if phase is not Phase.FW:
                self._cache.clear()
                self._caching = False
            set_phase(phase)
        return on_phase

    def cast(self, t: Any, to: torch.dtype, low: torch.dtype) -> Any:
        """autocast_mode.cpp ``cached_cast``: tensors and lists of them; anything else as is."""
        if isinstance(t, (list, tuple)):
            return type(t)(self.cast(x, to, low) for x in t)
        if not _eligible(t) or t.dtype == to:
            return t
        if (self._caching and to == low and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                and not t._is_view() and torch.is_autocast_cache_enabled()):
            hit = self._cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            out = t.to(to)
            self._cache[id(t)] = (weakref.ref(t), out)
            return out
        return t.to(to)


class AutocastWatch:
    """Whether CPU autocast was on at any call or op it was shown (``note``), for a step traced
    without :class:`CudaAutocast`: outside autocast its kernels run every op as called, so such a
    step's trace is the one it would make with them; one that saw autocast on is traced again
    with them. Shown every torch-function call (``CudaSemanticsMode(watch=...)``, before the
    call's ops reach the autocast keys) and every op the tracer records (``StepTracer``)."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False

    def note(self) -> None:
        if torch.is_autocast_enabled("cpu"):
            self.seen = True


# ----------------------------------------------------------------------------- registration

_local = threading.local()


def _active() -> list[CudaAutocast]:
    if not hasattr(_local, "active"):
        _local.active = []
    return _local.active


class _Registration:
    """The kernels, registered while at least one CudaAutocast is active in any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._libs: list[torch.library.Library] = []

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._libs = _register()
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for lib in self._libs:
                    lib._destroy()
                self._libs = []


_registration = _Registration()


def _register() -> list[torch.library.Library]:
    ops = taken_over()
    libs = [torch.library.Library("_", "IMPL"), torch.library.Library("aten", "IMPL")]
    try:
        # Ops without a kernel here go on to the next key, as on autocast's own keys.
        libs[0].fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        for name, policy in ops.items():
            libs[1].impl(name.split("::")[1], _kernel(_op(name), policy), "AutocastPrivateUse1")
    except RuntimeError as e:
        for lib in libs:
            lib._destroy()
        if "multiple backend fallbacks" in str(e):
            raise PolicyUnavailableError(
                "CUDA autocast is modelled on the AutocastPrivateUse1 dispatch key, which a "
                "PrivateUse1 backend loaded in this process already uses; plan in a process "
                "without it, or trace with CPU autocast's policy (EstimateOptions(cuda_autocast=False))"
            ) from None
        raise
    return libs


@functools.cache
def _op(name: str) -> torch._ops.OpOverload:
    """The OpOverload named ``aten::op.overload`` (one object per overload: looked up once)."""
    op, _, overload = name.split("::")[1].partition(".")
    return getattr(getattr(_aten, op), overload or "default")


# ----------------------------------------------------------------------------- kernels


class _Exclude:
    """``ExcludeDispatchKeyGuard`` over several keys."""

    def __init__(self, *keys: Any) -> None:
        self.keys = keys

    def __enter__(self) -> None:
        self.prev = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in self.keys]
        for k in self.keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, True)

    def __exit__(self, *exc) -> None:
        for k, was in zip(self.keys, self.prev):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def _kernel(op: torch._ops.OpOverload, policy: CastPolicy | None) -> Callable:
    if policy is None:
        has = functools.partial(torch._C._dispatch_has_kernel_for_dispatch_key, op.name())
        return functools.partial(_leave_alone, op, has("CompositeImplicitAutograd") and not has("Autograd"))
    run = _RUN[policy]

    def kernel(*args, **kwargs):
        active = _active()
        if not active or not _enabled():  # a region the model turned autocast off in
            with _Exclude(_ROUTE):
                return op(*args, **kwargs)
        # As WrapFunction_: the op and everything it calls run without autocast (CPU's included).
        with _Exclude(_ROUTE, _CPU):
            return run(active[-1], op, torch.get_autocast_dtype("cpu"), args, kwargs)
    return kernel


def _eligible(t: Any) -> bool:
    # autocast_mode.h is_eligible: a floating tensor, not float64 (every traced tensor stands for
    # one on the target device).
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast_all(ctx: CudaAutocast, args, kwargs, to, low):
    return (tuple(ctx.cast(a, to, low) for a in args), {k: ctx.cast(v, to, low) for k, v in kwargs.items()})


def _lower(ctx, op, low, args, kwargs):
    args, kwargs = _cast_all(ctx, args, kwargs, low, low)
    return op(*args, **kwargs)


def _fp32(ctx, op, low, args, kwargs):
    args, kwargs = _cast_all(ctx, args, kwargs, torch.float32, low)
    return op(*args, **kwargs)


def _promote(ctx, op, low, args, kwargs):
    to = low
    for t in _tensors((args, kwargs)):
        to = _prioritize(to, t, low)
    args, kwargs = _cast_all(ctx, args, kwargs, to, low)
    return op(*args, **kwargs)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _prioritize(current: torch.dtype, t: torch.Tensor, low: torch.dtype) -> torch.dtype:
    """autocast_mode.h ``prioritize``: float32 wins, float64 is ignored, another low-precision
    dtype than autocast's is an error (as on CUDA)."""
    if not t.is_floating_point() or t.dtype == torch.float64:
        return current
    if current == torch.float32 or t.dtype == torch.float32:
        return torch.float32
    if current == low and t.dtype == low:
        return low
    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")


def _first_tensor(args, kwargs) -> Any:
    return args[0] if args else next(iter(kwargs.values()), None)


def _fp32_set_opt_dtype(ctx, op, low, args, kwargs):
    if not _eligible(_first_tensor(args, kwargs)):
        return op(*args, **kwargs)
    i = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    if i < len(args):
        if args[i] is None:
            args = (*args[:i], torch.float32, *args[i + 1:])
        dtype = args[i]
    else:
        kwargs = {**kwargs, "dtype": kwargs.get("dtype") or torch.float32}
        dtype = kwargs["dtype"]
    fused = _HALF_TO_FLOAT.get(op)
    if fused is not None and args[0].dtype == torch.float16 and dtype == torch.float32:
        # SoftMax.cpp: a CUDA half input with dtype=float runs the fused half_to_float kernel.
        return fused(args[0], args[1], True)
    return op(*args, **kwargs)


@functools.cache
def _append_target(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The overload ``fp32_append_dtype`` redispatches to: the same arguments and a ``dtype``."""
    names = [a.name for a in op._schema.arguments]
    packet = getattr(_aten, op._schema.name.split("::")[1])
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        args = candidate._schema.arguments
        if [a.name for a in args] == [*names, "dtype"] and not any(a.is_out for a in args):
            return candidate
    raise PolicyUnavailableError(f"no overload of {op} takes a trailing dtype")


def _fp32_append_dtype(ctx, op, low, args, kwargs):
    x = _first_tensor(args, kwargs)
    return _append_target(op)(*args, **kwargs, dtype=torch.float32 if _eligible(x) else x.dtype)


def _banned(ctx, op, low, args, kwargs):
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
        "(CUDA autocast refuses them; the CPU's runs them in float32): use "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss on the "
        "logits before the sigmoid, which are safe to autocast")


_RUN = {
    CastPolicy.LOWER: _lower, CastPolicy.FP32: _fp32, CastPolicy.FP32_SET_OPT_DTYPE: _fp32_set_opt_dtype,
    CastPolicy.FP32_APPEND_DTYPE: _fp32_append_dtype, CastPolicy.PROMOTE: _promote, CastPolicy.BANNED: _banned,
}


def _leave_alone(op, composite: bool, *args, **kwargs):
    """An op only the CPU's lists hold: CUDA runs it as called. A composite one decomposes here and
    its parts meet the policy (as on CUDA: their CPU kernels are excluded, and the policy's read
    autocast as on through :func:`_enabled`); any other runs past both autocast keys."""
    if composite and _enabled():  # outside autocast CUDA runs it as called too: no policy for its parts
        _local.decomposing = getattr(_local, "decomposing", 0) + 1
        try:
            with _Exclude(_CPU):
                return op.decompose(*args, **kwargs)
        finally:
            _local.decomposing -= 1
    with _Exclude(_ROUTE, _CPU):
        return op(*args, **kwargs)


def _enabled() -> bool:
    """CPU autocast on (the target's stand-in), also inside a left-alone composite, which excludes
    the CPU's autocast key (the flag ``is_autocast_enabled`` reads) to keep its kernels out."""
    return torch.is_autocast_enabled("cpu") or getattr(_local, "decomposing", 0) > 0
