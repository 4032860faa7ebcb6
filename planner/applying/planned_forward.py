"""What a planned module runs instead of its forward: a checkpoint whose recompute cannot diverge
silently, and that leaves the module's state as one forward would.

Why a selective checkpoint can diverge
--------------------------------------
torch's selective checkpoint (``create_selective_checkpoint_contexts``) stores every forward op's
decision under ``(op, n-th call of that op)`` and, in the recompute, looks each op up by the same
counter. The counters agree only if the recompute runs exactly the forward's ops. They do not when
the forward reads state it also writes: a KV cache (HF ``use_cache``: the recompute finds the
cache already holding this layer's keys, so it slices and concatenates again), a lazily built
table (rotary ``cos``/``sin`` caches: built in the forward, found in the recompute), autocast's
weight-cast cache (a cast the forward found cached is re-run in the recompute), a training flag or
step counter flipped between forward and backward. torch then either raises from its internals
(``aten.slice.Tensor encountered during backward but not found in storage``) or -- worse, when the
shifted counter lands on an op of the same name -- hands back another op's cached output:
a different gradient without a word.

The design here
---------------
1. *Agree by construction* where the cause is known: planned modules run with HF's cache off
   (``planner.applying.checkpointing``), and the recompute starts from the state the forward started from
   (``planner.applying.forward_state``: buffers, random states, the arguments as given).
2. *Align, don't count*: the forward records its op sequence (op, input shapes and dtypes) and the
   outputs the plan saves, by position. The recompute walks the same sequence; a cached output is
   returned only while every op so far matched. At the first mismatch the rest of the recompute
   simply runs every op -- exactly what full checkpointing does from that point, so the gradient
   is the one full checkpointing gives, and nothing is raised. The module is switched to full
   checkpointing for every later call and a warning names the module, the op and the position.

What else runs twice
--------------------
The recompute re-runs the module's Python ``forward``: forward hooks and pre-hooks of its
*submodules* run again (the planned module's own hooks do not: ``forward`` is patched, not
``__call__``), and so does any Python side effect (counters, prints, appending to lists). Buffers
mutated in place (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``) are
copied when a recompute starts and put back when it ends, so they change once per step.
Other state written by Python (plain attributes) is not tracked: keep such logic out of
checkpointed modules, or leave them out of the plan (``ac_units``).
"""

from __future__ import annotations

from collections import defaultdict
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._guards import active_fake_mode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _detach_helper,
    _is_compiling,
    _VersionWrapper,
    checkpoint,
)

from estimators.tracing.sharded_model import ShardedModelError, fsdp_layout
from estimators.tracing.subclasses import SYNC_OPS, defers, in_sharding_propagation
from planner.applying import offload
from planner.applying.forward_state import Bookkeeping, in_bookkeeping, StateKeeper
from estimators.tracing.trace import tensor_numel
from planner.plan import ModelShape, ModulePlan, dtype_names as _dtype_names, model_shape, op_key

__all__ = ["PlannedForward", "CheckpointDivergenceWarning", "StalePlanWarning"]

_HF_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


class CheckpointDivergenceWarning(UserWarning):
    """A planned module's recompute ran other ops than its forward; it now checkpoints fully."""

    def __init__(self, message: str, fqn: str | None = None) -> None:
        super().__init__(message)
        self.fqn = fqn
        """The module (plan fqn) whose recompute diverged."""


class StalePlanWarning(UserWarning):
    """The model changed after the plan was applied in a way the plan did not trace (its
    parameters' dtype, HF gradient checkpointing turned on): its peaks no longer hold."""


def _param_dtypes(module: torch.nn.Module) -> frozenset[torch.dtype]:
    return frozenset(p.dtype for p in module.parameters())


def _meta(args: Any, kwargs: Any) -> tuple:
    flat, _ = tree_flatten((args, kwargs))
    return tuple((tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor))


@dataclass
class _Entry:
    func: Any
    meta: tuple
    value: Any = None  # the cached outputs (wrapped), None: recompute
    key: tuple | None = None  # (op key, occurrence), as the policy counted it
    fresh: bool = False  # every cached output is a storage this op created (not a view / in-place)


def _storage_ids(flat: list) -> set[int]:
    out = set()
    for t in flat:
        if isinstance(t, torch.Tensor):
            try:
                out.add(t.untyped_storage()._cdata)
            except (NotImplementedError, RuntimeError):
                pass
    return out


def _step_op(func, fake_mode) -> bool:
    """An op of the module's own forward, as the plan's trace recorded it: not DTensor's
    output-metadata ops (run on fake global shapes, under another fake mode when the step is
    real), not a collective's wait (it runs where the output is first used, which a recompute
    may do elsewhere; a cached output is complete) (``estimators.tracing.subclasses``)."""
    return not (func in SYNC_OPS or in_sharding_propagation() or active_fake_mode() is not fake_mode)


class _RecordingMode(_CachingTorchDispatchMode):
    """Forward side: log every op in order; keep the outputs the policy saves."""

    def __init__(self, policy_fn, storage, log: list[_Entry], key_of: Callable[[], tuple]) -> None:
        super().__init__(policy_fn, storage)
        self.log = log
        self.key_of = key_of
        self.fake_mode = None

    def __enter__(self):
        self.fake_mode = active_fake_mode()  # the trace's (None in a real step)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if _is_compiling(func, args, kwargs):  # the compiler partitions by policy itself
            return super().__torch_dispatch__(func, types, args, kwargs)
        if defers(types):
            return NotImplemented  # a DTensor op: decide on its local ops, as the plan's trace saw them
        if func in SAC_IGNORED_OPS or in_bookkeeping() or not _step_op(func, self.fake_mode):
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        policy = self.policy_fn(SelectiveCheckpointContext(is_recompute=False, op_output=out), func, *args, **kwargs)
        entry = _Entry(func, _meta(args, kwargs), key=self.key_of())
        if policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            entry.value = tree_map(lambda x: _VersionWrapper(_detach_helper(x)), out)
            outs = _storage_ids(tree_flatten(out)[0])
            entry.fresh = bool(outs) and not (outs & _storage_ids(tree_flatten((args, kwargs))[0]))
        self.log.append(entry)
        return out


class _ReplayMode(_CachedTorchDispatchMode):
    """Recompute side: return a cached output only while the op sequence matches the forward's."""

    def __init__(self, storage, log: list[_Entry], on_diverge: Callable[[Any, int, _Entry | None], None]) -> None:
        super().__init__(None, storage, True)
        self.log = log
        self.on_diverge = on_diverge
        self.pos = 0
        self.diverged = False
        self.fake_mode = None

    def __enter__(self):
        self.pos, self.diverged = 0, False
        self.fake_mode = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if _is_compiling(func, args, kwargs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        if defers(types):
            return NotImplemented
        if func in SAC_IGNORED_OPS or in_bookkeeping() or not _step_op(func, self.fake_mode):
            return func(*args, **kwargs)
        if not self.diverged:
            meta = _meta(args, kwargs)
            i = self._skip_forward_only_views(self.pos, func, meta)
            self.pos = i + 1
            e = self.log[i] if i < len(self.log) else None
            if e is None or e.func is not func or e.meta != meta:
                self.diverged = True
                self.on_diverge(func, i, e)
            elif e.value is not None:
                value, e.value = e.value, None  # consumed: its memory goes with the last use
                # An in-place op shares its parent's decision (estimators/tracing/sac.py): a cached output
                # is only mutated by ops cached with it, so the value is already final.
                # An offloaded output comes back from the host store (planner.applying.offload).
                with Bookkeeping():
                    return tree_map(lambda x: offload.materialize(x.get_val(True)), value)
        return func(*args, **kwargs)


    def _skip_forward_only_views(self, i: int, func, meta: tuple) -> int:
        """Where the forward's log resumes for this op: past views the forward ran and the
        recompute does not, when no output of theirs was saved. Hooks make them: torch's
        ModTracker (so MemTracker) calls ``t.view_as(t)`` on a submodule's grad-requiring inputs
        in the forward only, e.g. a spectral-norm weight's parameter; a view allocates nothing."""
        j = i
        while j < len(self.log) and self.log[j].value is None and getattr(self.log[j].func, "is_view", False):
            if self.log[j].func is func and self.log[j].meta == meta:
                return j
            j += 1
        if j < len(self.log) and j > i and self.log[j].func is func and self.log[j].meta == meta:
            return j
        return i


class PlannedForward:
    """Stored as ``module.forward`` (instance attribute) while a plan is applied.

    It holds the module by weak reference and resolves it at call time; ``copy.deepcopy`` rebinds
    it to the copy, and pickling stores the module-plan so an unpickled model stays planned."""

    def __init__(self, module: torch.nn.Module, mp: ModulePlan, original: Callable | None = None) -> None:
        self._module = weakref.ref(module)
        self.mp = mp
        self.original = original  # an instance-level forward the module had before; None: its class's
        self.fallback: str | None = None  # why this module now checkpoints fully
        self._saved = frozenset(mp.saved_ops)
        self.saved_hits = 0  # forward ops the policy saved, over every call: the plan's ops matched
        self._offloaded = frozenset(mp.offloaded_ops)
        self.offload_counter = offload.OffloadCounter()  # host bytes etc., over every call
        # The parameters' dtypes as applied; None until the first call where the module was
        # still being built (deepcopy and unpickling make this object before its parameters).
        self._dtypes = _param_dtypes(module) if "_parameters" in module.__dict__ else None
        self._stale_warned = False
        self._ancestors: list[weakref.ref] = []  # the modules above it, root first
        self._watch: ModelShape | None = None  # the whole model as applied (see watch)
        self._expected: tuple | None = None  # what the plan was made for, checked at the first call
        self.handle = 0  # the number of the AppliedPlan that installed it (planner.applying.checkpointing)

    def set_ancestors(self, modules: list[torch.nn.Module]) -> None:
        """The modules that contain this one: HF gradient checkpointing turned on for any of
        them (Trainer(gradient_checkpointing=True) sets it on every decoder layer) nests a
        checkpoint around this module's."""
        self._ancestors = [weakref.ref(m) for m in modules]

    def watch(self, shape: ModelShape) -> None:
        """Check, once per call, the whole model (the root of its ancestors) against ``shape``,
        its parameters when the plan was applied: one planned module does it for the plan. A
        change elsewhere moves every figure of the plan with no planned module changed
        (``resize_token_embeddings``, ``.double()``, unfreezing layers after apply)."""
        self._watch = shape

    def expect(self, layout: Any, pipeline: Any, *, check_stage: bool = True) -> None:
        """At the first call, check how the model runs against the plan's ``LayoutRecord`` and
        ``PipelineRecord`` (None: one process): what ``apply_plan`` cannot see yet, in
        torchtitan's order (apply, then ``fully_shard`` over another number of ranks than
        planned; a bare stage module, wrapped in another ``PipelineStage`` than the plan's).
        ``check_stage`` False: the plan was applied to its ``PipelineStage``, checked then."""
        self._expected = (layout, pipeline, check_stage)

    def _check_expected(self) -> None:
        from planner.applying.pipeline import enclosing_stage, stage_mismatch
        from planner.distributed.layout import layout_mismatch

        (layout, pipeline, check_stage), self._expected = self._expected, None
        root = self._ancestors[0]() if self._ancestors else self.module
        why = stage_mismatch(pipeline, enclosing_stage(sys._getframe(2))) if check_stage else None
        try:  # never fail a step over a check: a layout the FSDP rules do not model is left alone
            if why is None and root is not None and fsdp_layout(root) is not None:
                why = layout_mismatch(layout, root)
        except ShardedModelError:
            pass
        if why is not None:
            warnings.warn(f"the plan for {self.mp.fqn} does not match how the model runs: {why}; its predicted "
                          "peak does not hold. remove_plan(model) and plan the model as it runs",
                          StalePlanWarning, stacklevel=3)

    @property
    def checkpointed(self) -> bool:
        """False for an offload-only module plan (``offloaded_ops`` without ``saved_ops``):
        nothing is recomputed, saved tensors of the offloaded ops go to the host store."""
        return offload.is_checkpointed(self.mp)

    # ------------------------------------------------------------------ identity across copies
    def __deepcopy__(self, memo):
        import copy

        module = self._module()
        new_module = memo.get(id(module), module)
        new = PlannedForward(new_module, self.mp, copy.deepcopy(self.original, memo))
        new.fallback = self.fallback
        new._dtypes = self._dtypes
        # The whole model is watched only in a copy of the whole model, not in a block copied out.
        root_copied = not self._ancestors or id(self._ancestors[0]()) in memo
        new._watch = self._watch if root_copied else None
        new.handle = self.handle
        # Only ancestors copied with it: a block copied out of its model is no longer inside it.
        new._ancestors = [weakref.ref(memo[id(a())]) for a in self._ancestors if id(a()) in memo]
        return new

    def __reduce__(self):
        ancestors = [a() for a in self._ancestors if a() is not None]
        return (_rebuild, (self._module(), self.mp, self.original, self.fallback, self._dtypes, ancestors,
                           self._watch))

    @property
    def module(self) -> torch.nn.Module:
        m = self._module()
        if m is None:  # pragma: no cover - the module owns this object
            raise RuntimeError(f"the module planned as {self.mp.fqn} no longer exists")
        return m

    def _warn_if_stale(self, args: tuple, kwargs: dict) -> None:
        """Once per module: the model or its inputs changed since the plan was made in a way its
        trace did not see: a dtype change (``.to(torch.bfloat16)``) after apply, HF gradient
        checkpointing enabled after apply (a second checkpoint nested around the plan's), a
        bigger batch than planned (every activation grows with it, silently over the budget)."""
        module, why = self.module, None
        numel = tensor_numel((args, kwargs)) if self.mp.input_numel else 0
        if self._dtypes is None:
            self._dtypes = _param_dtypes(module)
        # Under FSDP2 a mixed-precision policy swaps in parameters of another dtype for the forward.
        sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
        dtypes = self._dtypes if sharded else _param_dtypes(module)
        if dtypes != self._dtypes:
            why = f"its parameters are {_dtype_names(dtypes)} now, {_dtype_names(self._dtypes)} when it was applied"
        if why is None and self._watch is not None:
            root = self._ancestors[0]() if self._ancestors else module
            why = None if root is None else self._watch.change(model_shape(root), dtypes=not sharded)
        if why is None and any(getattr(m, "gradient_checkpointing", False) is True
                               for m in [module, *(a() for a in self._ancestors)] if m is not None):
            why = ("Hugging Face gradient checkpointing is on for it or a module around it "
                   "(gradient_checkpointing_enable() after apply_plan, Trainer(gradient_checkpointing="
                   "True)): it is checkpointed twice")
        if why is None and numel > self.mp.input_numel:
            why = (f"its inputs have {numel:,} elements, {self.mp.input_numel:,} when it was planned "
                   "(a bigger batch, a longer sequence, or an input it was planned without, such as "
                   "an attention mask: activations grow with them)")
        if why is not None:
            self._stale_warned = True
            warnings.warn(f"the plan for {self.mp.fqn} no longer matches the model: {why}; its "
                          "predicted peak no longer holds. remove_plan(model) and plan again "
                          "(with the inputs it trains on; HF: gradient_checkpointing_disable() "
                          "first)", StalePlanWarning, stacklevel=3)

    def bound_original(self) -> Callable:
        module = self.module
        if self.original is not None:
            return self.original
        return type(module).forward.__get__(module)

    # ------------------------------------------------------------------ the call
    def __call__(self, *args, **kwargs):
        forward = self.bound_original()
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing is saved without grad: no checkpoint
        kwargs = _without_hf_cache(kwargs)
        # Offload runs in the eager forward only: not in a recompute (backward), not compiled.
        eager = not torch.compiler.is_compiling() and not offload.in_recompute()
        if eager and self._expected is not None:
            self._check_expected()
        if eager and not self._stale_warned:
            self._warn_if_stale(args, kwargs)
        claimed = offload.take_pending() if eager else []  # this module's backward prefetches them
        store = offload.CallStore(self.offload_counter) if eager and self._offloaded else None
        if not self.checkpointed:
            if store is None:
                out = forward(*args, **kwargs)
            else:
                out = offload.run_offloading(forward, args, kwargs, self._offloaded, store,
                                             in_bookkeeping, Bookkeeping)
        else:
            log: list[_Entry] = []
            kw: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
            if not self.mp.full and self.fallback is None:
                # torch.compile accepts a bound method only (no store when compiling: no log)
                kw["context_fn"] = self._contexts if store is None else (lambda: self._contexts(log))
            out = checkpoint(StateKeeper(self.module, forward), *args, **kwargs, **kw)
            if store is not None:
                try:
                    with Bookkeeping():
                        offload.offload_cached(log, self._offloaded, store)
                except Exception as e:  # never fail a step over an optimisation: what did not
                    # go keeps its device tensor (a handle holds it until finish_forward)
                    store.counter.ambiguous += 1
                    warnings.warn(f"SAC Planner: {self.mp.fqn} kept its cached outputs on the device, "
                                  f"offloading them failed: {e}", stacklevel=2)
        if claimed:
            offload.prefetch_on_backward(out, claimed)
        if store is not None and store.stored:
            offload.set_pending(store)
        return out

    def _contexts(self, log: list[_Entry] | None = None):
        counts: dict[str, int] = {}
        saved = self._saved
        last: list[tuple | None] = [None]

        def policy(ctx, op, *args, **kwargs):
            key = op_key(str(op))
            occ = counts.get(key, 0)
            counts[key] = occ + 1
            last[0] = (key, occ)
            if (key, occ) in saved:
                self.saved_hits += 1
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        storage: dict = defaultdict(dict)  # torch's format, used only under torch.compile
        log = [] if log is None else log
        return (_RecordingMode(policy, storage, log, lambda: last[0]),
                _ReplayMode(storage, log, self._diverged))

    def _diverged(self, func, index: int, expected: _Entry | None) -> None:
        if self.fallback is not None:
            return
        what = f"forward ran {expected.func}" if expected is not None else "the forward had ended"
        self.fallback = f"op #{index}: recompute ran {func}, {what}"
        warning = CheckpointDivergenceWarning(
            f"SAC Planner: the recompute of {self.mp.fqn} diverged from its forward at {self.fallback}. "
            "This step's gradients are those of full checkpointing from that op on; the module is "
            "fully checkpointed from now on. Usual causes: state the forward writes and reads "
            "(a cache, a counter), or a mode changed between forward and backward.",
            self.mp.fqn,
        )
        warnings.warn(warning, stacklevel=2)


def _rebuild(module, mp, original, fallback, dtypes=None, ancestors=(), watch=None) -> PlannedForward:
    pf = PlannedForward(module, mp, original)
    pf.fallback = fallback
    pf._dtypes = dtypes
    pf.set_ancestors(list(ancestors))
    pf._watch = watch
    return pf


def _without_hf_cache(kwargs: dict) -> dict:
    """What HF's GradientCheckpointingLayer does: a checkpointed layer neither uses nor writes a
    KV cache (the recompute would write it a second time)."""
    drop = {k for k in _HF_CACHE_KWARGS if kwargs.get(k) is not None}
    if not drop and not kwargs.get("use_cache"):
        return kwargs
    kwargs = {**kwargs, **{k: None for k in drop}}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs
