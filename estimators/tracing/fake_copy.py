"""The fake copy a fake trace runs: the user's model, its parameters and buffers fake tensors.

    copy, mapping = fake_copy(model, fake_mode)     # mapping: id(user's parameter) -> fake one

* A plain parameter on the CPU becomes the mode's fake copy of it; one on meta (or another
  device) a fake CPU tensor of its shape, stride and dtype.
* A DTensor parameter (tensor / sequence parallel) becomes a DTensor over a fake copy of its local
  shard, same mesh, placements and global shape (``estimators.tracing.subclasses.fake_copy_of``),
  so the trace runs the rank's program. Device meshes and process groups are shared, not copied.
* A model already sharded with ``fully_shard`` is copied as it was before: each unit an object of
  its original class without FSDP2's forward hooks, each sharded parameter a fake one of its
  pre-FSDP layout (``estimators.tracing.sharded_model``). FSDP2's memory is the FSDP rules' to add.
* Functions stored on a module (``module.forward = closure``, as HF's tensor-parallel styles
  and torchtitan's ``Module.parallelize`` install; a ``functools.partial`` such as DTensor's
  ``local_map`` wrapper; an object they close over, such as HF's expert-parallel implementation
  holding the experts' bound forward) are shared by ``copy.deepcopy``, so the copy would call
  the *user's* module and its real parameters (and leave fake gradients on them): they are
  rebuilt over the copied objects.
* Shared tensors stay shared; tensors an earlier trace left in the process are shared, not copied
  (``estimators.tracing.fake_leaks``); the blocks a truncated trace skips are never copied
  (``estimators.tracing.truncation``; their parameters map to None).
"""

from __future__ import annotations

import collections
import copy
import functools
import sys
import types
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimators.tracing import fake_leaks
from estimators.tracing.fake_dispatch import MemoMode
from estimators.tracing.sharded_model import original_class, unsharded_parts
from estimators.tracing.stacks import Stack
from estimators.tracing.subclasses import fake_copy_of
from estimators.tracing.truncation import skipped_param_ids, truncate_in_memo

__all__ = ["fake_tensor", "fake_buffer", "fake_copy", "FakeCopyError", "rebind_functions"]


class FakeCopyError(RuntimeError):
    """The model could not be copied to fake tensors; the message says what to do."""


def _fake_plain(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and not isinstance(t, torch.nn.Parameter):
        return mode.from_tensor(t)
    with mode:
        return _fake_cpu_empty(t)


def _fake_cpu_empty(t: torch.Tensor) -> torch.Tensor:
    """Inside a fake mode: a tensor of ``t``'s shape, stride and dtype on the fake CPU (for a
    tensor on meta or another device)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _fake_cpu_parameter(t: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    """Inside a fake mode: ``torch.nn.Parameter(_fake_cpu_empty(t), requires_grad=requires_grad)``.

    For a tensor subclass the constructor returns ``data.detach().requires_grad_(requires_grad)``
    flagged ``_is_param``: the detach, one more op through the mode per parameter, makes a second
    tensor over the new tensor's storage, which nothing else holds. The flag and ``requires_grad``
    are set on the new tensor itself instead, once the first parameter made in this process both
    ways showed the two the same (:func:`_same_parameter`); the constructor wherever they differ."""
    global _SHORTCUT
    if _SHORTCUT:
        new = _fake_cpu_empty(t).requires_grad_(requires_grad)
        new._is_param = True
        return new
    made = torch.nn.Parameter(_fake_cpu_empty(t), requires_grad=requires_grad)
    if _SHORTCUT is None:
        short = _fake_cpu_empty(t).requires_grad_(requires_grad)
        short._is_param = True
        _SHORTCUT = _same_parameter(made, short)
    return made


_SHORTCUT: bool | None = None
"""Whether :func:`_fake_cpu_parameter` sets the flag itself (None: not checked yet in this process)."""


def _same_parameter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same kind of parameter: class, instance attributes, dispatch keys,
    autograd state, metadata, each over a storage of its own."""
    return (type(a) is type(b) and vars(a) == vars(b)
            and torch._C._dispatch_key_set(a) == torch._C._dispatch_key_set(b)
            and (a.requires_grad, a.is_leaf, a.grad_fn, a._version, a._is_view(), a._base)
            == (b.requires_grad, b.is_leaf, b.grad_fn, b._version, b._is_view(), b._base)
            and (a.dtype, a.shape, a.stride(), a.storage_offset(), a.device, a.untyped_storage().nbytes())
            == (b.dtype, b.shape, b.stride(), b.storage_offset(), b.device, b.untyped_storage().nbytes())
            and a.untyped_storage() is not b.untyped_storage())


def fake_tensor(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake copy of ``t`` (a DTensor: over a fake copy of its local shard)."""
    return fake_copy_of(t, lambda inner: _fake_plain(mode, inner))


def fake_buffer(mode: FakeTensorMode, b: torch.Tensor) -> torch.Tensor:
    """A fake buffer; a one-element integer one (a counter) keeps a copy of its value, so code
    that reads it goes on as in the real step: ``BatchNorm2d(momentum=None)`` divides by
    ``float(num_batches_tracked)``, which a plain fake tensor refuses (torch's fake tensors run
    ops on such constants and keep the result; a copy, so the user's buffer never changes)."""
    if b.device.type == "cpu" and b.numel() == 1 and not b.is_floating_point() and not b.is_complex():
        return mode.fake_tensor_converter.from_real_tensor(mode, b.detach().clone(), make_constant=True)
    return fake_tensor(mode, b)


def _pre_shard_fake(mode: FakeTensorMode, pre) -> torch.nn.Parameter:
    """A fake parameter of a sharded parameter's pre-FSDP layout."""
    if pre.spec is None:
        with mode:
            t = torch.empty(pre.size, dtype=pre.dtype, device="cpu")
    else:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        spec = pre.spec
        # Outside the fake mode: the offsets are computed on real index tensors.
        local_shape, _ = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
        with mode:
            local = torch.empty(local_shape, dtype=pre.dtype, device="cpu")
            t = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                   shape=spec.shape, stride=spec.stride)
    return torch.nn.Parameter(t, requires_grad=pre.requires_grad)


def _shared_meshes(model: torch.nn.Module) -> dict[int, Any]:
    """The meshes of the model's DTensors, and the meshes and process groups its modules keep as
    attributes (torchtitan's vocab-parallel ``Embedding.tp_group``): the copy shares them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    shared = {id(t.device_mesh): t.device_mesh for t in [*model.parameters(), *model.buffers()]
              if isinstance(t, DTensor)}
    if dist.is_available():
        kinds = (DeviceMesh, dist.ProcessGroup)
        for mod in model.modules():
            # isinstance against ProcessGroup is slow (a Python __instancecheck__): the attribute
            # types a module holds by the hundred are ruled out first.
            shared.update({id(v): v for v in vars(mod).values()
                           if type(v) not in _NOT_MESHES and isinstance(v, kinds)})
    return shared


_NOT_MESHES = frozenset({bool, int, float, str, type(None), dict, list, tuple, set, collections.OrderedDict,
                         torch.nn.Parameter, torch.Tensor})


def fake_copy(model: torch.nn.Module, mode: FakeTensorMode, stacks: list[Stack] = ()
              ) -> tuple[torch.nn.Module, dict[int, torch.Tensor | None]]:
    """Deep copy of ``model`` whose parameters and buffers are fake (shared ones stay shared),
    without the blocks of ``stacks`` a truncated trace skips; see the module docstring. Raises
    :class:`FakeCopyError`."""
    memo: dict[int, Any] = {}
    mapping: dict[int, torch.Tensor | None] = {}
    pre_shard, hooks, states = unsharded_parts(model)
    if stacks and hooks:
        raise FakeCopyError(f"{type(model).__name__} is sharded with fully_shard: its blocks are traced whole, "
                            "not once per stack; trace it without replicate_blocks")
    skipped = skipped_param_ids(model, stacks) if stacks else set()
    for st in states:
        memo[id(st)] = st
    off_cpu: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for p in model.parameters():
        if id(p) in skipped:
            mapping[id(p)] = None
        elif id(p) not in memo:
            pre = pre_shard.get(id(p))
            if pre is not None:
                memo[id(p)] = mapping[id(p)] = _pre_shard_fake(mode, pre)
                continue
            t = p.detach()
            if type(t) is torch.Tensor and t.device.type != "cpu":
                off_cpu.append((p, t))  # made below, all in one visit to the mode
                memo[id(p)] = mapping[id(p)] = None
                continue
            memo[id(p)] = mapping[id(p)] = torch.nn.Parameter(fake_tensor(mode, t), requires_grad=p.requires_grad)
    if off_cpu:
        # Plain parameters off the CPU (on meta: the usual large model), made as _fake_plain
        # makes them, in one visit to the mode and through the memo.
        with mode, MemoMode(mode):
            for p, t in off_cpu:
                memo[id(p)] = mapping[id(p)] = _fake_cpu_parameter(t, p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo and id(b) not in skipped:
            memo[id(b)] = fake_buffer(mode, b)
    for t in fake_leaks.left_behind():  # held through the copy: shared, not copied (see left_behind)
        memo.setdefault(id(t), t)
    if "torch.distributed.tensor" in sys.modules:
        memo.update(_shared_meshes(model))
    try:
        for mod in reversed(list(model.modules())):  # FSDP units bottom-up: children are in memo first
            if id(mod) in hooks:
                memo[id(mod)] = _unit_copy(mod, hooks[id(mod)], memo)
        _copy_module_tables(model, memo, _skipped_blocks(model, stacks))
        if stacks:
            truncate_in_memo(model, stacks, memo)
        out = memo[id(model)] if id(model) in memo else copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - user modules can hold anything
        raise FakeCopyError(
            f"could not copy {type(model).__name__} to fake tensors ({type(e).__name__}: {e}); "
            "give the model on the meta device, or trace in real mode") from e
    rebind_functions(out, memo)
    return out, mapping


_PLAIN = frozenset({type(None), bool, int, float, str})
"""What ``copy.deepcopy`` returns as is (its atomic types; a conservative few)."""


def _skipped_blocks(model: torch.nn.Module, stacks: list[Stack]) -> set[int]:
    """ids of the blocks a truncated copy leaves out."""
    out: set[int] = set()
    for st in stacks:
        container = model.get_submodule(st.container) if st.container else model
        out.update(id(container._modules[key]) for key in st.skipped_keys)
    return out


def _copy_module_tables(model: torch.nn.Module, memo: dict[int, Any], skipped: set[int] = frozenset()) -> None:
    """Put in ``memo`` the copy ``copy.deepcopy(model, memo)`` would make of each module's
    ``OrderedDict`` tables (its eleven hook tables) and sets (``_non_persistent_buffers_set``)
    whose keys and values it would return as they are or as ``memo`` maps them: a new table of
    the same class, those keys and values, in that order; deepcopy finds them there. It would
    copy each through ``__reduce_ex__``, whose ``copyreg._slotnames`` raises and catches two
    exceptions per table (``OrderedDict`` and ``set`` cannot keep the ``__slotnames__`` it
    computes): about half of a model copy's time. Anything else (a subclass, a table with
    instance attributes, a value of another type: a hook bound to its module) is left to
    deepcopy, and so are the plain dicts (``_parameters``, ``_modules``: its fast path). Not
    visited: the ``skipped`` blocks (never copied) and modules in ``memo`` (FSDP units, copied
    already), with what they hold."""
    seen: set[int] = set()
    todo = [model]
    while todo:
        mod = todo.pop()
        if id(mod) in seen or id(mod) in memo or id(mod) in skipped:
            continue
        seen.add(id(mod))
        todo.extend(m for m in mod._modules.values() if m is not None)
        for table in vars(mod).values():
            kind = type(table)
            if (kind is not collections.OrderedDict and kind is not set) or id(table) in memo:
                continue
            items = table.items() if kind is collections.OrderedDict else ((x, None) for x in table)
            copied = []
            for k, v in items:
                k_, v_ = memo.get(id(k), k), memo.get(id(v), v)
                if (k_ is k and type(k) not in _PLAIN) or (v_ is v and type(v) not in _PLAIN):
                    break
                copied.append((k_, v_))
            else:
                if kind is set:
                    memo[id(table)] = set([k for k, _ in copied])
                elif not vars(table):
                    memo[id(table)] = collections.OrderedDict(copied)


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _unit_copy(mod: torch.nn.Module, hook_ids: set[int], memo: dict[int, Any]) -> torch.nn.Module:
    """A copy of FSDP unit ``mod`` as an object of its original class, without FSDP's hooks."""
    cls = original_class(mod)
    new = cls.__new__(cls)
    memo[id(mod)] = new  # before its attributes: they may refer back to it
    new.__dict__.update(copy.deepcopy(dict(vars(mod)), memo))
    for table in _HOOK_TABLES:
        hooks = new.__dict__.get(table)
        if hooks is not None:
            for hid in hook_ids:
                hooks.pop(hid, None)
    return new


def rebind_functions(root: torch.nn.Module, memo: dict[int, Any]) -> int:
    """Rebuild the functions stored on ``root``'s modules whose closures (or bound ``self``)
    hold objects ``memo`` copied, over the copies; returns how many were rebuilt."""
    n = 0
    for mod in root.modules():
        for name, value in list(vars(mod).items()):
            if isinstance(value, (types.FunctionType, types.MethodType)):
                new = _remap(value, memo)
                if new is not value:
                    setattr(mod, name, new)
                    n += 1
    return n


def _remap(value: Any, memo: dict[int, Any], depth: int = 0) -> Any:
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, types.MethodType) and id(value.__self__) in memo:
        return types.MethodType(value.__func__, memo[id(value.__self__)])
    if isinstance(value, types.FunctionType) and value.__closure__ and depth < 4:
        return _rebuilt(value, lambda v: _remap(v, memo, depth + 1))
    if depth < 4 and _plain_object(value):  # an object the function closes over (HF's EP implementation)
        attrs = {k: _remap(v, memo, depth + 1) for k, v in vars(value).items()}
        if any(attrs[k] is not v for k, v in vars(value).items()):
            new = copy.copy(value)
            vars(new).update(attrs)
            memo[id(value)] = new  # one copy for every function that closes over it
            return new
    if isinstance(value, functools.partial) and depth < 4:
        func, args = _remap(value.func, memo, depth + 1), [_remap(a, memo, depth + 1) for a in value.args]
        keywords = {k: _remap(v, memo, depth + 1) for k, v in value.keywords.items()}
        if func is not value.func or any(a is not b for a, b in zip(args, value.args)) or any(
                keywords[k] is not v for k, v in value.keywords.items()):
            return functools.partial(func, *args, **keywords)
    return value


def _plain_object(value: Any) -> bool:
    """An instance of a user class (not a module, tensor, class, function or mesh): its attributes
    may hold what the copy copied (a bound forward of a copied module)."""
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type,
                                                                  types.FunctionType, types.MethodType,
                                                                  types.ModuleType, functools.partial))
            and type(value).__module__.split(".")[0] not in ("torch", "builtins"))


def _rebuilt(fn: types.FunctionType, remap: Callable[[Any], Any]) -> types.FunctionType:
    cells, changed = [], False
    for cell in fn.__closure__:
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        new = remap(v)
        changed |= new is not v
        cells.append(types.CellType(new))
    if not changed:
        return fn
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__ = fn.__qualname__
    return out
