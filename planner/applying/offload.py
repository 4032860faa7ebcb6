"""Offload applied in eager: saved activations of a planned module go to host memory in forward and
come back in backward, one module ahead of their use.

What is offloaded
-----------------
``ModulePlan.offloaded_ops`` names ops of the module (``(op key, occurrence)``, counted as the
selective-checkpoint policy counts them in ``planner.applying.planned_forward``). A storage is offloaded when
an offloaded op created it (its output is not a view or in-place result of an input) and it is kept
for backward:

* *offload only* (``full=False``, no ``saved_ops``): the module is not checkpointed. While its
  forward runs, a dispatch mode maps every new output storage to the op that made it, and a
  ``saved_tensors_hooks`` pack hook hands the tensors autograd saves from offloaded storages to the
  host store; every other saved tensor goes to the hooks outside (unchanged behaviour);
* *with SAC* (``saved_ops`` given): the module is checkpointed; the outputs the policy caches
  (MUST_SAVE) of offloaded ops go to the host store, and the recompute takes them back from it.
  ``offloaded_ops`` must then be among ``saved_ops`` (an op that is recomputed has nothing kept).

Never offloaded: views and in-place results whose storage no offloaded op created, parameters and
buffers (no op of the forward creates them), storages under :data:`MIN_OFFLOAD_BYTES`, tensor
subclasses other than fake tensors, dtypes whose bytes cannot be reinterpreted. A saved storage
that was written in place after autograd saved it is ambiguous (which bytes does the backward
want?): it stays on the device, is counted in ``OffloadCounter.ambiguous``, and its unpack raises
autograd's own "modified by an inplace operation" error, as the unplanned backward does. (A saved
tensor written in place *after* the module's forward, before backward, is not detected once
offloaded, as with torch's ``save_on_cpu``: autograd checks no versions through hooks.)

When
----
The bytes leave the device when the module's forward returns (all its saved tensors are known by
then). They come back when the backward of the next module in forward order starts -- the next
planned module, or an unplanned module beside the offloading one (same parent: a forward hook is
put on those while the plan is applied) -- through a gradient hook on that module's outputs: one
module ahead of their use. Without such a module (the last block), at the first unpack
(synchronously). A storage is rebuilt exactly: same bytes, dtype, size, stride and
storage offset, so gradients are bitwise those of the unplanned step. Several saved tensors of one
storage share one host copy and one restored storage.

Where the bytes go
------------------
* CPU, real tensors: a numpy array, outside torch's allocator, so torch's MemTracker (and the
  planner's real-mode tracer) see the bytes leave the device and come back;
* fake / meta tensors (the planner traces the applied plan to predict its peak): only metadata is
  kept and an empty tensor of the same metadata comes back, so the trace follows the memory curve
  of the real run;
* CUDA: pinned host buffers filled on a dedicated copy stream (``non_blocking``), with events and
  ``record_stream`` so the caching allocator frees nothing the copy still reads; the compute
  stream waits for the host-to-device copy before it uses a restored tensor. UNTESTED ON A GPU:
  written without one at hand; CPU and fake mode are what the test suite checks.

Offload is eager only: under ``torch.compile`` nothing is offloaded (the compiled graph keeps
what the plan saves).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from planner.plan import OpKey, op_key

__all__ = ["MIN_OFFLOAD_BYTES", "OffloadCounter", "OffloadError", "is_checkpointed", "predicted_host_bytes"]

logger = logging.getLogger(__name__)

MIN_OFFLOAD_BYTES = 1
"""Empty storages stay on the device (nothing to free). No size rule beyond that: the planner
prices each copy's fixed cost (``DeviceSpec.host_copy_latency_s``) and offloads small outputs
only where that pays; a hand-written plan that names an op offloads it, however small."""


class OffloadError(ValueError):
    """An offload plan that cannot be applied as written; the message says what to change."""


@dataclass
class OffloadCounter:
    """What one planned module offloaded, summed over its calls (reset with ``reset()``)."""

    host_bytes: int = 0
    """Bytes copied to host memory (whole storages)."""
    storages: int = 0
    """Storages copied to host memory."""
    prefetched: int = 0
    """Storages brought back by a prefetch (one module ahead)."""
    loaded_on_demand: int = 0
    """Storages brought back synchronously, at their first unpack."""
    ambiguous: int = 0
    """Saved storages of offloaded ops kept on the device: written in place after autograd saved
    them, or of a kind the store cannot rebuild exactly."""

    def reset(self) -> None:
        self.host_bytes = self.storages = self.prefetched = self.loaded_on_demand = self.ambiguous = 0


def is_checkpointed(mp) -> bool:
    """Whether a module plan checkpoints its module: every plan but an offload-only one
    (``offloaded_ops`` given, no ``saved_ops``, not ``full``)."""
    return mp.full or bool(mp.saved_ops) or not mp.offloaded_ops


def check_module_plan(mp) -> None:
    """OffloadError unless ``mp``'s offload can be applied as written."""
    if is_checkpointed(mp) and mp.offloaded_ops:
        extra = sorted(set(mp.offloaded_ops) - set(mp.saved_ops))
        if extra:
            raise OffloadError(
                f"module {mp.fqn!r}: offloaded op {list(extra[0])} is not in saved_ops, so the "
                "selective checkpoint recomputes it and nothing is kept to offload; add it to "
                "saved_ops, or give no saved_ops at all to offload without checkpointing"
            )


# ------------------------------------------------------------------ thread-local state
_state = threading.local()


def _pending() -> list:
    p = getattr(_state, "pending", None)
    if p is None:
        p = _state.pending = []
    return p


def in_recompute() -> bool:
    return getattr(_state, "recompute", 0) > 0


class recompute_scope:
    """Entered by a planned module's recompute: nested planned forwards then neither offload nor
    take part in the prefetch chain (they run in backward)."""

    def __enter__(self):
        _state.recompute = getattr(_state, "recompute", 0) + 1

    def __exit__(self, *exc):
        _state.recompute -= 1


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, nested, functional wrappers
        return None


def _is_plain(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) in (torch.Tensor, FakeTensor) and t.layout is torch.strided and not t.is_nested


_viewable: dict[torch.dtype, bool] = {}


def _bytes_viewable(dtype: torch.dtype) -> bool:
    """Whether a uint8 buffer can be reinterpreted as ``dtype`` (the restore does exactly that)."""
    ok = _viewable.get(dtype)
    if ok is None:
        try:
            with torch._C._DisableTorchDispatch():
                torch.empty(64, dtype=torch.uint8).view(dtype)
            ok = True
        except (RuntimeError, TypeError):
            ok = False
        _viewable[dtype] = ok
    return ok


def _is_fake_or_meta(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


# ------------------------------------------------------------------ one offloaded storage
class _CopyStreams:
    """One copy stream per CUDA device (created on first use: ``import planner`` starts no CUDA)."""

    _streams: dict[int, Any] = {}

    @classmethod
    def get(cls, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = cls._streams.get(idx)
        if s is None:
            s = cls._streams[idx] = torch.cuda.Stream(device=idx)
        return s


class _Stored:
    """One device storage: on the device until offloaded, then in host memory until brought back.

    ``template`` is a 0-byte uint8 tensor of the storage's device (and fake mode, where there is
    one): the restored buffer is made from it, so the allocation goes through the same dispatch
    modes (tracers) as the original one."""

    __slots__ = ("nbytes", "template", "device_ref", "host", "restored", "event", "counter", "__weakref__")

    def __init__(self, t: torch.Tensor, counter: OffloadCounter) -> None:
        st = t.untyped_storage()
        self.nbytes = st.nbytes()
        self.template = t.new_empty((0,), dtype=torch.uint8)
        self.device_ref: torch.Tensor | None = t  # keeps the storage until offload()
        self.host: Any = None
        self.restored: torch.Tensor | None = None  # uint8 [nbytes] on the device, once back
        self.event: Any = None
        self.counter = counter

    # -------------------------------------------------------------- device -> host
    def offload(self) -> None:
        t, self.device_ref = self.device_ref, None
        if t is None:
            return
        if _is_fake_or_meta(t):
            self.host = "metadata"  # nothing to copy: the trace only needs the bytes to leave
        elif t.device.type == "cuda":
            self._offload_cuda(t)
        else:
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                src = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
                self.host = src.numpy().copy()  # numpy's memory: outside torch's allocator
        self.counter.host_bytes += self.nbytes
        self.counter.storages += 1

    def _offload_cuda(self, t: torch.Tensor) -> None:  # untested on a GPU (see module docstring)
        stream = _CopyStreams.get(t.device)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # the producer has written it
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        src.record_stream(stream)  # the allocator must not reuse it before the copy has read it
        self.host = host

    # -------------------------------------------------------------- host -> device
    def prefetch(self) -> None:
        if self.restored is not None or self.host is None:  # back already, or never left
            return
        self._restore()
        self.counter.prefetched += 1

    def _restore(self) -> None:
        buf = self.template.new_empty((self.nbytes,))  # through dispatch: trackers see it
        if isinstance(self.host, np.ndarray):
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                buf.copy_(torch.from_numpy(self.host))
        elif isinstance(self.host, torch.Tensor):  # CUDA, pinned; untested on a GPU
            stream = _CopyStreams.get(buf.device)
            stream.wait_stream(torch.cuda.current_stream(buf.device))  # buf's allocation
            with torch.cuda.stream(stream):
                stream.wait_event(self.event)  # the device -> host copy is complete
                buf.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            buf.record_stream(stream)
        self.restored = buf

    def device_bytes(self) -> torch.Tensor:
        """The storage's bytes on the device (uint8); brought back now if not prefetched."""
        if self.restored is None:
            self._restore()
            self.counter.loaded_on_demand += 1
        if isinstance(self.host, torch.Tensor) and self.event is not None:  # CUDA; untested on a GPU
            torch.cuda.current_stream(self.restored.device).wait_event(self.event)
            self.event = None
        self.host = None  # back on the device for as long as a handle needs it
        return self.restored


class _Handle:
    """What autograd (or the selective-checkpoint cache) holds instead of a saved tensor."""

    __slots__ = ("stored", "call", "tensor", "version", "dtype", "size", "stride", "offset")

    def __init__(self, stored: _Stored, call: "CallStore", t: torch.Tensor) -> None:
        self.stored = stored
        self.call = call  # keeps the call's store (its prefetch target) alive while needed
        # Until the forward ends; detached, as autograd saves it (no grad_fn: no cycle through
        # the C++ graph if the graph is dropped without a backward).
        self.tensor: torch.Tensor | None = t.detach()
        self.version = t._version
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:  # kept on the device (ambiguous, or the forward is running)
            if self.tensor._version != self.version:
                # What autograd says without hooks (with hooks it checks nothing): same behaviour.
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: [{self.tensor.type()} {list(self.size)}] is at version "
                    f"{self.tensor._version}; expected version {self.version} instead "
                    "(SAC Planner offload: the tensor was saved by an offloaded op)")
            return self.tensor
        buf = self.stored.device_bytes()
        with torch.no_grad():
            return buf.view(self.dtype).as_strided(self.size, self.stride, self.offset)


def materialize(x: Any) -> Any:
    return x.unpack() if isinstance(x, _Handle) else x


# ------------------------------------------------------------------ one call of a module
class CallStore:
    """The storages one call of a planned module offloads, and the handles that point at them."""

    def __init__(self, counter: OffloadCounter) -> None:
        self.counter = counter
        # storage cdata -> entry; weak once the forward is over, so an entry lives exactly as long
        # as the handles (autograd's saved tensors) that need it, as the storage did unplanned.
        self.stored: dict[int, _Stored] | weakref.WeakValueDictionary = {}
        self.handles: list[_Handle] = []

    def offloadable(self, t: Any, st: torch.UntypedStorage) -> bool:
        """Whether ``t``, of a storage an offloaded op created, can be offloaded exactly."""
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
            return False
        if st.nbytes() < MIN_OFFLOAD_BYTES:
            return False
        if not _is_plain(t) or not _bytes_viewable(t.dtype) or st.nbytes() % t.element_size():
            self.counter.ambiguous += 1
            return False
        return True

    def handle(self, t: torch.Tensor, st: torch.UntypedStorage) -> _Handle:
        stored = self.stored.get(st._cdata)
        if stored is None:
            stored = self.stored[st._cdata] = _Stored(t, self.counter)
        h = _Handle(stored, self, t)
        self.handles.append(h)
        return h

    def finish_forward(self) -> None:
        """The forward is over: offload every storage none of whose saved tensors was written
        in place since it was saved; drop the device references of those that went."""
        changed = {id(h.stored) for h in self.handles if h.tensor is not None and h.tensor._version != h.version}
        for stored in self.stored.values():
            if id(stored) not in changed:
                try:
                    stored.offload()
                    continue
                except Exception as e:  # never fail a training step over an optimisation
                    logger.warning("SAC Planner: kept a saved storage on the device, its offload failed: %s", e)
            self.counter.ambiguous += 1
            stored.device_ref = None  # the handles keep their own tensors: nothing moves
            changed.add(id(stored))
        for h in self.handles:
            if id(h.stored) not in changed:
                h.tensor = None
        self.handles = []
        self.stored = weakref.WeakValueDictionary(self.stored)

    def prefetch(self) -> None:
        for stored in list(self.stored.values()):
            stored.prefetch()

# ------------------------------------------------------------------ offload only: saved tensor hooks
class _OutputMap(TorchDispatchMode):
    """During the module's forward: the op (as the SAC policy counts it) that created each storage."""

    def __init__(self, offloaded: frozenset[OpKey], ignore: Callable[[], bool]) -> None:
        super().__init__()
        self.offloaded = offloaded
        self.ignore = ignore
        self.counts: dict[str, int] = {}
        self.made_by: dict[int, weakref.ref] = {}  # storage cdata -> the storage, if an offloaded op made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS or self.ignore():
            return out
        key = op_key(str(func))
        occ = self.counts.get(key, 0)
        self.counts[key] = occ + 1
        inputs = {st._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                  for st in (_storage(a),) if st is not None}
        offloaded = (key, occ) in self.offloaded
        for o in tree_flatten(out)[0]:
            st = _storage(o) if isinstance(o, torch.Tensor) else None
            if st is None or st._cdata in inputs:
                continue  # a view or an in-place result: the storage's creator decides
            if offloaded:
                self.made_by[st._cdata] = weakref.ref(st)
            else:
                self.made_by.pop(st._cdata, None)  # a new storage at a freed one's address
        return out

    def made_by_offloaded(self, st: torch.UntypedStorage) -> bool:
        ref = self.made_by.get(st._cdata)
        return ref is not None and ref() is st


def run_offloading(forward: Callable, args, kwargs, offloaded: frozenset[OpKey], store: CallStore,
                   ignore: Callable[[], bool], bookkeeping: Callable[[], Any]) -> Any:
    """Run ``forward`` (not checkpointed), packing saved tensors of offloaded ops into ``store``."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    mapping = _OutputMap(offloaded, ignore)

    def pack(t):
        st = _storage(t) if isinstance(t, torch.Tensor) else None
        if st is not None and mapping.made_by_offloaded(st):
            try:
                with bookkeeping():
                    if store.offloadable(t, st):
                        return store.handle(t, st)
            except Exception as e:  # an odd tensor: kept as without the plan, never a crash
                store.counter.ambiguous += 1
                logger.warning("SAC Planner: kept a saved tensor on the device, offloading it failed: %s", e)
        if outer_pack is not None:
            return (_Kept, outer_pack(t))
        # Not t itself: a saved output would hold its own grad_fn (output -> node -> saved
        # output), a cycle through autograd's C++ graph that Python's collector cannot free, so a
        # graph dropped without a backward kept every tensor and host copy of the call alive
        # (2.6 MB per metric forward on a ResNet, without bound). As autograd saves it: detached,
        # the same storage and version counter.
        return (_Kept, t.detach())

    def unpack(x):
        if isinstance(x, _Handle):
            return x.unpack()
        return outer_unpack(x[1]) if outer_unpack is not None else x[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), mapping:
        out = forward(*args, **kwargs)
    with bookkeeping():
        store.finish_forward()
    return out


class _Kept:
    """Tag of a saved tensor the offload hooks pass on to the hooks outside."""


# ------------------------------------------------------------------ with SAC: the policy's cache
def offload_cached(log: list, offloaded: frozenset[OpKey], store: CallStore) -> None:
    """After a checkpointed forward: offload the cached outputs of offloaded ops. ``log`` is the
    recording mode's op log (entries with ``key``, ``fresh`` and ``value``); cached outputs of
    other ops that alias an offloaded storage (in-place results) follow it, so nothing keeps
    the device copy alive."""
    wrappers = [(e, w) for e in log if e.value is not None
                for w in tree_flatten(e.value)[0] if hasattr(w, "val")]
    for e, w in wrappers:
        if e.key in offloaded and e.fresh:
            st = _storage(w.val) if isinstance(w.val, torch.Tensor) else None
            if st is not None and st._cdata not in store.stored and store.offloadable(w.val, st):
                store.stored[st._cdata] = _Stored(w.val, store.counter)
    for _, w in wrappers:
        st = _storage(w.val) if isinstance(w.val, torch.Tensor) else None
        if st is not None and st._cdata in store.stored:
            w.val = store.handle(w.val, st)
    store.finish_forward()


# ------------------------------------------------------------------ prefetch one module ahead
def take_pending() -> list:
    """The stores waiting for the next planned module (this one): it prefetches them."""
    p = _pending()
    out = [r for r in p if r() is not None]
    p.clear()
    return out


def set_pending(store: CallStore) -> None:
    _pending().append(weakref.ref(store))


def clear_pending() -> None:
    _pending().clear()


def sibling_post_hook(module, args, output) -> None:
    """Forward post-hook on the unplanned modules beside an offloading one (same parent): the
    stores left by the offloading module before it come back when its backward starts."""
    if torch.compiler.is_compiling() or in_recompute() or not torch.is_grad_enabled():
        return
    prefetch_on_backward(output, take_pending())


def remove_sibling_hooks(module: torch.nn.Module) -> bool:
    hooks = module._forward_hooks
    keys = [k for k, fn in hooks.items() if fn is sibling_post_hook]
    for k in keys:
        del hooks[k]
        module._forward_hooks_with_kwargs.pop(k, None)
        module._forward_hooks_always_called.pop(k, None)
    return bool(keys)


def prefetch_on_backward(output: Any, claimed: list) -> None:
    """Prefetch ``claimed`` stores when the gradient of ``output`` arrives: the backward of the
    module that made ``output`` is about to start."""
    if not claimed:
        return
    ts = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not ts:
        return  # nothing to hook: the stores load at their first unpack

    def fire(_grad) -> None:
        for ref in claimed:
            store = ref()
            if store is not None:
                store.prefetch()

    torch.autograd.graph.register_multi_grad_hook(ts, fire, mode="any")


# ------------------------------------------------------------------ what a plan offloads, predicted
def predicted_host_bytes(trace, modules, *, micro_batches: int = 1) -> dict[str, int]:
    """Host bytes per training step each offloading module plan copies, from the trace of the
    *unplanned* step (``Estimate.trace``): the storages its offloaded ops create that the
    mechanism above takes (autograd saves them inside the module when it is not checkpointed;
    the policy caches them when it is) and that reach :data:`MIN_OFFLOAD_BYTES`, times
    ``micro_batches`` (``Estimate.step.micro_batches``: the trace holds one). Ops are counted per
    call as the policy counts them. Storage sizes are the trace's (rounded to CUDA blocks for
    CUDA targets)."""
    from estimators.tracing.sac import subtree
    from estimators.tracing.trace import Phase

    plans = {mp.fqn: mp for mp in modules if mp.offloaded_ops}
    checkpointed = {mp.fqn for mp in modules if is_checkpointed(mp)}
    out = dict.fromkeys(plans, 0)

    def under_checkpoint(c: int, top: int) -> bool:
        """Whether call ``c`` runs inside a checkpointed module nested in call ``top``: autograd's
        saved tensors there go to that checkpoint, not to the offload hooks."""
        while c >= 0 and c != top:
            if trace.calls[c].fqn in checkpointed:
                return True
            c = trace.calls[c].parent
        return False

    for call in trace.calls:
        mp = plans.get(call.fqn)
        if mp is None or call.fw_first_op < 0:
            continue
        offloaded, cached = frozenset(mp.offloaded_ops), is_checkpointed(mp)
        inside = subtree(trace, call)
        counts: dict[str, int] = {}
        for rec in trace.ops[call.fw_first_op : call.fw_last_op + 1]:
            if rec.phase is not Phase.FW or rec.func in SAC_IGNORED_OPS:
                continue
            key = op_key(str(rec.func))
            occ = counts.get(key, 0)
            counts[key] = occ + 1
            if (key, occ) not in offloaded or (not cached and under_checkpoint(rec.call, call.cid)):
                continue
            for sid in rec.new_sids:
                st = trace.storages[sid]
                taken = cached or (st.saved and bool(st.saved_by_calls & inside))
                if taken and st.nbytes >= MIN_OFFLOAD_BYTES:
                    out[mp.fqn] += st.nbytes * micro_batches
    return out
