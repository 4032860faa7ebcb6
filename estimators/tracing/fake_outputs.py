"""The tensors of a FakeTensorMode cache hit, built without the mode's generic Python.

On a cache hit ``FakeTensorMode._output_from_cache_entry`` builds each output from the entry's
``TensorMetadata``: an empty meta tensor of that shape, strides and dtype (over the input's storage
for a view), wrapped by ``FakeTensor(mode, elem, device)``. Half of a fake trace's per-op cost is
that code's generality (symbolic sizes, devices to normalise, five memo descriptors set one by
one). :class:`OutputBuilder` builds the same tensors directly: the same ``empty_strided`` /
``set_`` calls, ``Tensor._make_subclass`` with the arguments ``FakeTensor.__new__`` passes, the
same data-pointer guard, and the instance attributes copied from a tensor the mode built itself.

It mirrors what torch's code does, so it is used only where that code is the code it mirrors:

* the source of each torch function it stands for (``_REPLICATED``) must hash to the value
  recorded for the torch it was written against; any other torch builds through the mode;
* in each process, its first tensor must equal one ``FakeTensor()`` built: type, dispatch keys,
  every instance attribute;
* each memo entry (``estimators.tracing.fake_dispatch``) is built once both ways and compared
  before the entry is used; outputs on a device other than the CPU, or with non-integer sizes,
  are the mode's to build.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from typing import Any

import torch
from torch._subclasses import fake_tensor as _ft

try:
    from torch._subclasses._fake_tensor_utils import _CacheKeyState
except ImportError:  # pragma: no cover - another torch: OutputBuilder is off (the hashes differ)
    _CacheKeyState = None

__all__ = ["OutputBuilder"]

logger = logging.getLogger(__name__)

_REPLICATED = {
    "FakeTensor.__new__": "edc72218ee23ca6c",
    "FakeTensor.__init__": "79b87fdbed0518e2",
    "FakeTensor.fake_device": "66f781feb8735d3f",
    "FakeTensorMode._output_from_cache_entry": "f7abdd8b80c8dd89",
    "FakeTensorMode._get_output_tensor_from_cache_entry": "548bbfc0ecc471e9",
    "in_kernel_invocation_manager": "24e0b9912707f1e5",
    "SymNumberMemoDescriptor.__set__": "7efe44d498279dfb",
}
"""sha256[:16] of the source of each torch function this module builds outputs as, in torch
2.13 (``_source_hashes()`` prints them for the installed torch)."""

_CPU = torch.device("cpu")
_META = torch.device("meta")  # a device object: a string is parsed at every call


def _source_hashes() -> dict[str, str]:
    ft = _ft
    funcs = {
        "FakeTensor.__new__": ft.FakeTensor.__new__,
        "FakeTensor.__init__": ft.FakeTensor.__init__,
        "FakeTensor.fake_device": ft.FakeTensor.fake_device.fset,
        "FakeTensorMode._output_from_cache_entry": ft.FakeTensorMode._output_from_cache_entry,
        "FakeTensorMode._get_output_tensor_from_cache_entry": ft.FakeTensorMode._get_output_tensor_from_cache_entry,
        "in_kernel_invocation_manager": ft.in_kernel_invocation_manager,
        "SymNumberMemoDescriptor.__set__": ft.SymNumberMemoDescriptor.__set__,
    }
    return {name: hashlib.sha256(inspect.getsource(inspect.unwrap(f)).encode()).hexdigest()[:16]
            for name, f in funcs.items()}


@functools.cache
def _same_torch_code() -> bool:
    if _CacheKeyState is None:
        return False
    try:
        found = _source_hashes()
    except (AttributeError, OSError, TypeError):  # another torch, or no sources to read
        return False
    if found != _REPLICATED:
        logger.debug("FakeTensor outputs built by the mode: torch's code differs from the one replicated "
                     "(%s)", sorted(k for k in found if found[k] != _REPLICATED.get(k)))
        return False
    return not _ft.FakeTensorConfig.debug


class OutputBuilder:
    """``build(entry, mode_key, func, args)``: the output(s) of ``mode``'s cache entry for this
    call, as ``mode._output_from_cache_entry`` makes them; called with torch dispatch off (the mode
    makes them so, in ``in_kernel_invocation_manager``), below autograd. ``official(...)``: the
    mode's own function, called with the fake mode unset (as inside the mode's dispatch)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._template: dict[str, Any] | None = None
        self.enabled = _same_torch_code() and mode.shape_env is None

    def official(self, entry: Any, mode_key: Any, func, args: tuple) -> Any:
        return self.mode._output_from_cache_entry(_CacheKeyState(None), entry, mode_key, func, args)

    def build(self, entry: Any, mode_key: Any, func, args: tuple) -> Any:
        if not self.enabled or (self._template is None and not self._learn_template()):
            return self.official(entry, mode_key, func, args)
        is_view = isinstance(func, torch._ops.OpOverload) and func.is_view
        if entry.is_output_tuple:
            return tuple(self._one(info, is_view, args) for info in entry.output_infos)
        return self._one(entry.output_infos[0], is_view, args)

    @staticmethod
    def can_build(entry: Any) -> bool:
        """Every output of ``entry`` is one this builder makes (a CPU tensor of integer sizes, an
        argument, or a constant)."""
        for info in entry.output_infos:
            md = info.metadata
            if md is None:
                continue
            ints = (*md.shape, *md.stride, md.storage_offset)
            if (md.device != _CPU or md.layout is not torch.strided or md.is_sparse
                    or not all(type(v) is int for v in ints)):
                return False
        return True

    def _one(self, info: Any, is_view: bool, args: tuple) -> Any:
        if info.inplace_idx is None and info.metadata is None and info.view_idx is None:
            return info.constant_value
        if info.inplace_idx is not None:
            return args[info.inplace_idx]
        md = info.metadata
        empty = torch.empty_strided(md.shape, md.stride, dtype=md.dtype, layout=md.layout, device=_META,
                                    requires_grad=md.requires_grad)
        if md.is_conj:
            torch._C._set_conj(empty, True)
        if md.is_neg:
            torch._C._set_neg(empty, True)
        if is_view:
            empty.set_(args[info.view_idx].untyped_storage(), md.storage_offset, md.shape, md.stride)
        return self._wrap(empty)

    def _wrap(self, elem: torch.Tensor) -> torch.Tensor:
        """``FakeTensor(mode, elem, cpu)``, ``FakeTensor.__new__``'s steps."""
        t = torch.Tensor._make_subclass(_ft.FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                        device_for_backend_keys=_CPU)
        if not self.mode._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(t)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        t.__dict__.update(self._template)
        return t

    def _learn_template(self) -> bool:
        """The attributes of a tensor the mode builds, and a check that one built here is it."""
        def elem() -> torch.Tensor:
            return torch.empty_strided((2, 3), (3, 1), dtype=torch.float32, device="meta")

        ref = _ft.FakeTensor(self.mode, elem(), _CPU)
        self._template = dict(vars(ref))
        theirs, ours = _ft.FakeTensor(self.mode, elem(), _CPU), self._wrap(elem())
        same = (type(theirs) is type(ours) and vars(theirs) == vars(ours)
                and torch._C._dispatch_key_set(theirs) == torch._C._dispatch_key_set(ours)
                and theirs.device == ours.device and theirs.requires_grad == ours.requires_grad)
        if not same:
            logger.debug("FakeTensor outputs built by the mode: a tensor built here differs from FakeTensor()'s")
            self.enabled = False
        return same
