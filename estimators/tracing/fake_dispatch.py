"""FakeTensorMode's cache hits without its cache key: the per-op cost of a fake trace, cut.

Every op of a fake trace reaches ``FakeTensorMode``, whose dispatch cache turns the op's arguments
into a key (each fake tensor's full ``TensorMetadata``, flattened with type markers) and, on a hit,
builds the output from the stored entry. Building that key is most of the cost of a hit.
:class:`FakeDispatchMemo` sits where the trace calls the op (``RealKernelsMode.run``) and keeps,
per op and cheaper key, the mode's own cache entry: a hit builds the output from that entry exactly
as the mode's own hit does (``FakeTensorMode._output_from_cache_entry``), so the trace sees the
tensors the mode would have returned.

Why the cheaper key is enough: the mode's key is a function of the op, four global settings (the
default dtype and device, inference mode, whether a proxy mode traces) and, per argument, its
Python type and value, or for a fake tensor of the mode its ``TensorMetadata``. Of those fields
this key reads the dtype, shape, strides, device, storage offset, storage bytes, requires_grad,
conj / neg / inference / quantized bits; the rest follow from them for a strided tensor (memory
format from shape and strides; the sparse fields are empty). Two calls with one key here therefore
have one key there, and get the same entry. Anything else -- a symbolic size, a plain (real)
tensor, a tensor with a constant, another subclass, an argument type not listed in
``_SCALARS``, a mode with a shape environment -- is no key here: the op takes the mode's own path.

Each memo entry is checked once, when made: the output built from it must match the one the mode
returned (metadata, aliasing, dispatch keys), or that key stays on the plain path. Where torch's
internals this relies on are missing or differ (another torch version), the memo is off and every
op takes the plain path: the figures never depend on it, only the time.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from estimators.tracing.fake_outputs import OutputBuilder
from estimators.tracing.op_args import HotPathMode

__all__ = ["FakeDispatchMemo", "MemoMode", "memo_available"]

logger = logging.getLogger(__name__)

try:  # torch internals; without them the memo is off (see the module docstring)
    from torch._subclasses._fake_tensor_utils import _CacheKeyState
    from torch._subclasses.fake_tensor import (
        _DISPATCH_HANDLE_DIRECTLY,
        _DISPATCH_META_HANDLERS,
        FakeTensor,
        FakeTensorMode,
        _BypassDispatchCache,
        _DispatchCacheBypassEntry,
        _DispatchCacheEntryOutputInfo,
        _DispatchCacheValidEntry,
        extract_tensor_metadata,
        unset_fake_temporarily,
    )
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from torch.utils._mode_utils import no_dispatch

    _INTERNALS = all(
        callable(getattr(FakeTensorMode, name, None))
        for name in ("_cache_key", "_output_from_cache_entry")
    ) and isinstance(getattr(FakeTensorMode, "cache", None), dict)
except ImportError:  # pragma: no cover - depends on the torch version
    _INTERNALS = False

_FAKE = torch._C._TorchDispatchModeKey.FAKE
_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format})
"""Argument types the key holds as (type, value), as the mode's key does."""
_NO_KEY = object()
"""Memo value of a key whose op the mode does not cache (or whose entry failed its check)."""
_READ = torch.ops.aten._local_scalar_dense.default
_CONSTANT_READS: bool | None = None
"""Whether a constant's value is read here (None: not checked yet in this process)."""
_MEMO: dict[tuple, Any] = {}
"""key -> (the mode's key, its cache entry) or ``_NO_KEY``. Process-wide, like the mode's cache
(a class attribute) whose entries it points to; entries hold metadata only, never a tensor."""
_MISMATCHED: set[tuple] = set()
"""Keys whose output built from the entry differed once from the mode's (tried once more)."""


class _NotKeyable(Exception):
    """An argument this key does not describe: the op takes the mode's own path."""


def memo_available() -> bool:
    """Whether this torch has the internals the memo uses."""
    return _INTERNALS


class FakeDispatchMemo:
    """``memo(func, args, kwargs)``: ``func(*args, **kwargs)`` for a caller directly above
    ``mode`` in the dispatch (no other dispatch mode in between), with the mode's cache hits taken
    without building its key (see the module docstring)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.enabled = bool(
            _INTERNALS and isinstance(mode, FakeTensorMode) and mode.cache_enabled
            and mode.shape_env is None and not mode.cache_crosscheck_enabled
        )
        self.hits = 0
        self._outputs = OutputBuilder(mode) if self.enabled else None
        self._fake_device_attr = self.enabled and self._outputs.enabled
        """A fake tensor's device read from its attribute (``FakeTensor.device``, a property, is
        that attribute while the mode runs no kernel): on the torch whose code OutputBuilder mirrors."""

    def __call__(self, func, args: tuple, kwargs: dict) -> Any:
        if not self.enabled or func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY:
            return func(*args, **kwargs)
        if func is _READ and not kwargs and len(args) == 1 and self._is_constant(args[0]):
            return self._read_constant(func, args)
        try:
            key = self._key(func, args, kwargs)
        except _NotKeyable:
            return func(*args, **kwargs)
        found = _MEMO.get(key)
        if found is _NO_KEY or not self._mode_is_next():
            return func(*args, **kwargs)
        if found is not None:
            mode_key, entry, built_here, as_list = found
            if built_here and self._outputs.enabled:
                with no_dispatch():  # the mode builds them with dispatch off too (in_kernel_invocation_manager)
                    out = self._outputs.build(entry, mode_key, func, args)
            else:
                with unset_fake_temporarily():  # as inside the mode's own dispatch
                    out = self._outputs.official(entry, mode_key, func, args)
            self.hits += 1
            if as_list:
                return list(out)
            FakeTensorMode.cache_hits += 1
            return out
        return self._learn(key, func, args, kwargs)

    @staticmethod
    def _is_constant(t: Any) -> bool:
        return type(t) is FakeTensor and t.constant is not None and not t._has_symbolic_sizes_strides

    def _read_constant(self, func, args: tuple) -> Any:
        """``.item()`` of a fake tensor that keeps its value (Adam's step count, read every
        step): the mode bypasses its cache for it and reads the value with dispatch off
        (``_dispatch_impl``'s constant path). Done here the same way once the mode's own answer
        matched it (first read in the process)."""
        global _CONSTANT_READS
        if not self._mode_is_next() or args[0].fake_mode is not self.mode or _CONSTANT_READS is False:
            return func(*args)
        with no_dispatch():
            value = func(args[0].constant)
        if _CONSTANT_READS is None:
            theirs = func(*args)
            _CONSTANT_READS = type(theirs) is type(value) and theirs == value
            return theirs
        return value

    def _mode_is_next(self) -> bool:
        """The op goes from here straight to ``mode``: it is the active fake mode and no user
        dispatch mode sits between (modes above the caller are popped while it runs)."""
        return (torch._C._get_dispatch_mode(_FAKE) is self.mode
                and torch._C._len_torch_dispatch_stack() == 1)

    def _learn(self, key: tuple, func, args: tuple, kwargs: dict) -> Any:
        """The plain path, and the mode's entry for this op memoised where the mode made one
        and an output built from it matches the one returned."""
        try:
            mode_key = self.mode._cache_key(_CacheKeyState(None), func, args, kwargs)
        except _BypassDispatchCache:
            _MEMO[key] = _NO_KEY
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        entry, as_list = FakeTensorMode.cache.get(mode_key), False
        if isinstance(entry, _DispatchCacheBypassEntry):
            entry, as_list = _list_entry(entry, func, out, args) or entry, True
        if isinstance(entry, _DispatchCacheValidEntry):
            with unset_fake_temporarily():
                again = self._outputs.official(entry, mode_key, func, args)
                built_here = self._outputs.enabled and OutputBuilder.can_build(entry)
                if built_here:
                    with no_dispatch():
                        ours = self._outputs.build(entry, mode_key, func, args)
                    built_here = self._outputs.enabled and _same_outputs(again, ours, args, attributes=True)
            # A list the op returned, of views (``split``), where the mode's entry is a tuple: its
            # own hits return the tuple, as the memo's do (entry.is_output_tuple).
            listed = as_list or type(out) is list
            if _same_outputs(tuple(out) if listed else out, again, args, attributes=listed):
                _MEMO[key] = (mode_key, entry, built_here, as_list)
            else:  # e.g. the mode's first run of a view kept requires_grad, its cache hits do not
                if key in _MISMATCHED:
                    _MEMO[key] = _NO_KEY
                _MISMATCHED.add(key)
        elif entry is not None:
            _MEMO[key] = _NO_KEY  # the mode bypasses its cache for this op
        return out

    def _key(self, func, args: tuple, kwargs: dict) -> tuple:
        if self.mode.in_kernel_invocation:
            raise _NotKeyable
        parts: list[Any] = [func, torch.get_default_dtype(), torch._C._get_default_device(),
                            torch.is_inference_mode_enabled(), get_proxy_mode() is not None]
        for a in args:
            parts.append(self._arg(a))
        if kwargs:
            for name, a in kwargs.items():
                parts.append(name)
                parts.append(self._arg(a))
        return tuple(parts)

    def _arg(self, a: Any) -> Any:
        kind = type(a)
        if kind is FakeTensor:
            if (a.fake_mode is not self.mode or a.constant is not None or a.layout is not torch.strided
                    or a._has_symbolic_sizes_strides):
                raise _NotKeyable
            return (a.dtype, a.size(), a.stride(), a.__dict__.get("_fake_device") if self._fake_device_attr else a.device,
                    a.storage_offset(), a.untyped_storage().nbytes(),
                    a.requires_grad, a.is_conj(), a.is_neg(), a.is_inference(), a.is_quantized)
        if kind in _SCALARS:
            return (kind, a)
        if kind is list or kind is tuple:
            return (kind, tuple(self._arg(x) for x in a))
        raise _NotKeyable


def _list_entry(bypass: Any, func, out: Any, args: tuple) -> Any:
    """A cache entry, as the mode would make it, for an op whose only reason to bypass the mode's
    cache is its list output (``_foreach_sqrt``, ``_foreach_add``: the mode caches single tensors
    and tuples only, "to avoid the complexity"): each output a new tensor (no argument, no
    constant, its own storage). None for anything else."""
    if bypass.reason != "non-FakeTensor output" or type(out) is not list or not out:
        return None
    if not getattr(func, "_opname", "").startswith("_foreach_") or func.is_view:
        return None
    flat = [t for a in args for t in (a if type(a) in (list, tuple) else (a,))]
    storages = {id(t.untyped_storage()) for t in flat if type(t) is FakeTensor}
    infos = []
    for t in out:
        if (type(t) is not FakeTensor or t.constant is not None or t.layout is not torch.strided
                or id(t.untyped_storage()) in storages):
            return None
        infos.append(_DispatchCacheEntryOutputInfo(inplace_idx=None, metadata=extract_tensor_metadata(t),
                                                   view_idx=None))
    return _DispatchCacheValidEntry(output_infos=tuple(infos), is_output_tuple=True)


def _same_outputs(out: Any, again: Any, args: tuple, attributes: bool = False) -> bool:
    """The output built from the cache entry is the one the mode returned: same structure, and
    each tensor the same argument (in-place), or the same metadata, dispatch keys and storage
    (shared with the same argument for a view, new otherwise); with ``attributes``, the same
    instance attributes too (two tensors built from one entry)."""
    if isinstance(out, tuple):
        return (isinstance(again, tuple) and len(out) == len(again)
                and all(_same_outputs(o, a, args, attributes) for o, a in zip(out, again)))
    if not isinstance(out, FakeTensor):
        return type(out) is type(again) and out == again
    if type(again) is not FakeTensor:
        return False
    if any(out is a for a in args) or any(again is a for a in args):
        return out is again
    arg_storages = {id(a.untyped_storage()): i for i, a in enumerate(args) if isinstance(a, FakeTensor)}
    return (
        (out.dtype, out.shape, out.stride(), out.device, out.storage_offset(), out.requires_grad,
         out.is_conj(), out.is_neg(), out.untyped_storage().nbytes())
        == (again.dtype, again.shape, again.stride(), again.device, again.storage_offset(), again.requires_grad,
            again.is_conj(), again.is_neg(), again.untyped_storage().nbytes())
        and torch._C._dispatch_key_set(out) == torch._C._dispatch_key_set(again)
        and arg_storages.get(id(out.untyped_storage())) == arg_storages.get(id(again.untyped_storage()))
        and (not attributes or vars(out) == vars(again))
    )


class MemoMode(HotPathMode):
    """``with MemoMode(fake_mode):`` inside ``fake_mode``: the ops of code that works on fake
    tensors outside a trace (the fake copy of the model, the optimizer state) run on the mode
    through a :class:`FakeDispatchMemo`. An op on another tensor subclass is left to it."""

    def __init__(self, fake_mode: Any) -> None:
        super().__init__()
        self._memo = FakeDispatchMemo(fake_mode)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _INTERNALS and any(t is not FakeTensor for t in types):
            return NotImplemented
        return self._memo(func, args, kwargs or {})
