"""One training step, recorded op by op: the single trace every estimator reads.

``StepTracer`` is a TorchDispatchMode. For each aten op of forward, loss, backward and optimizer
step it records the phase, the innermost module call, the new storages the op allocated, whether
it is a view / in-place / random op, and its estimated runtime. Storage lifetimes come from weak
references: a storage's free is stamped with the index of the last op that ran before it.

Module attribution
------------------
Forward: module pre/post hooks keep a call stack. Backward: every autograd Node carries a
thread-local sequence number assigned at creation; the tracer stamps the counter at each module
call's entry and exit, so a backward op belongs to the innermost call whose range contains
``torch._C._current_autograd_node()._sequence_nr()``. Unlike output/input grad hooks this also
sees the backward of modules whose inputs do not require grad, of modules called several times,
and of custom autograd Functions.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from estimators.contract.module_info import Phase
from estimators.tracing.op_args import PRIM_DEVICE, HotPathMode, active_fake_mode, fake_device, op_tensors
from estimators.tracing.records import (
    ModuleCall,
    OpRecord,
    StepTrace,
    StorageKind,
    StorageRecord,
    final_storage_kind,
    held_tensors,
    tensor_numel,
)
from estimators.runtime.op_facts import op_facts, written_args
from estimators.tracing.foreign_leaves import ForeignLeaves
from estimators.tracing.subclasses import WAIT, defers, in_sharding_propagation, mark_sharding_propagation
from estimators.tracing.module_tree import module_tree
from estimators.tracing.subclasses import storage_of as _storage_of  # a DTensor's: its local shard's

if TYPE_CHECKING:
    from estimators.runtime.models import RuntimeModel

__all__ = ["OpRecord", "StorageRecord", "ModuleCall", "StepTrace", "StepTracer", "held_tensors"]

logger = logging.getLogger(__name__)

_NO_SEQ = 2**64 - 1  # AccumulateGrad nodes carry UINT64_MAX as sequence number


_VALUE_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default})
"""Ops by which Python code reads a tensor's value (``.item()``, ``bool()``, ``if t:``)."""
_DRAWN_NUMEL = 64
"""Outputs of random ops up to this many elements are decisions a model may branch on."""


def _call(func, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


def _freed(tracer_ref: weakref.ref, key: int, sid: int, _ref: Any) -> None:
    if (tracer := tracer_ref()) is not None:  # weak: the tracer holds the references
        tracer._on_free(key, sid)


class InplaceModifiedError(RuntimeError):
    """The traced step's backward reads a saved tensor that was modified in place: the step
    fails in torch itself."""


class StepTracer(HotPathMode):
    """Records every aten op and storage of one step of ``model``; see the module docstring.

    Usage: build it (the state that exists before the step is registered then), ``attach()`` the
    module hooks, run the step inside ``with tracer`` (and the saved-tensor hooks), ``detach()``,
    then ``finish()`` returns the complete :class:`StepTrace`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        root_name: str,
        runtime_model: RuntimeModel,
        *,
        inputs: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: str = "",
        round_bytes: Callable[[int], int] = lambda n: n,
        progress: Callable[[str], None] | None = None,
        previous_output: bool = False,
        held: Any = (),
        fake_mode: Any = None,
    ) -> None:
        """
        Args:
            model: the module whose step is traced (its parameters, buffers, gradients).
            root_name: the root's name in fqns (its class name, as torch's ModTracker names it).
            runtime_model: prices every recorded op.
            inputs: the step's inputs (their tensors count as inputs).
            optimizer: its state counts as optimizer state, before and after the step.
            device: name of the DeviceSpec the trace stands for (``StepTrace.device``).
            round_bytes: storage size as the target's allocator counts it.
            progress: called with a short message now and then.
            previous_output: the loop holds the previous micro-batch's (or step's) output until
                this forward returns (``out = model(**batch)`` rebinds ``out`` only then;
                ``TrainStep.keep_output``): the trace runs one micro-batch, so the storages of
                this one's output stand in for it, counted from the step's start to the root
                forward's last op.
            held: tensors the loop holds through the step besides the model, the batch and the
                optimizer (``TrainStep.held``: an EMA copy), resident for the whole step, counted
                with the inputs.
            fake_mode: the FakeTensorMode below this tracer in a fake trace. A real tensor the
                step meets (one made outside it: a global index) reaches the kernels as that
                mode's fake copy of it, and autograd saves the copy: both are one storage.
        """
        super().__init__()
        if "torch.distributed.tensor" in sys.modules:  # no DTensor can exist before it is imported
            mark_sharding_propagation()
        self.model, self.root_name, self.optimizer, self.device = model, root_name, optimizer, device
        self.runtime_model, self.round_bytes, self.progress = runtime_model, round_bytes, progress
        self.ops: list[OpRecord] = []
        self.storages: list[StorageRecord] = []
        self.calls: list[ModuleCall] = []
        self.phase = Phase.FW
        self._live: dict[int, int] = {}  # id(storage pyobject) -> sid
        self._free_refs: dict[int, weakref.ref] = {}  # sid -> its storage's; calls _on_free when it dies
        self._kept_twins: list[torch.Tensor] = []  # fake copies of held tensors, alive for the trace
        self._self_ref = weakref.ref(self)  # the callbacks' (a weakref.finalize costs twenty times more)
        self._stack: list[int] = []  # module call ids, forward
        self._seq_probe = torch.zeros(1, requires_grad=True)  # real, tiny, outside every mode
        self._seq_index: tuple[list[int], list[int]] | None = None
        self._last_bw_call = -1
        self._hooks: list[Any] = []
        self._calls_done = 0
        self._last_progress = time.monotonic()
        self._sealed = False  # after finish(): later frees (the caller dropping tensors) are not the step's
        self._previous_output = previous_output
        self._packing = False  # inside pack_hook: its own alias is not an op of the step
        self._output_sids: tuple[int, ...] = ()  # the root call's output, with what pytree does not open
        self._fake_mode = fake_mode
        self._foreign = ForeignLeaves({id(p) for p in model.parameters()}, real=fake_mode is None)
        """Leaves outside the model the step reads (``estimators.tracing.foreign_leaves``)."""
        self._drawn: set[int] = set()  # sids of small tensors computed from torch's RNG draws
        self.random_value_reads: list[str] = []
        """Modules (fqns) whose Python code read the value of a small tensor drawn from torch's
        RNG (LayerDrop's ``torch.rand([]) < p``): the trace followed that one draw."""
        self.autocast_watch: Any = None
        """Shown every op (``estimators.tracing.cuda_autocast.AutocastWatch``), where set."""
        self.run_op: Callable[[Any, tuple, dict], Any] = _call
        """Runs each op the step dispatches; a mode below the tracer may lend its own work here
        instead of being entered (``RealKernelsMode.run``): one dispatch level less per op."""
        self._register_state(inputs, held)

    def set_phase(self, phase: Phase) -> None:
        if phase is not self.phase and self.progress is not None and phase is not Phase.FW:
            self.progress(f"{phase.name.lower()} ... ({len(self.ops)} ops so far)")
        self.phase = phase

    # ------------------------------------------------------------------ storages
    def _sid(self, st: torch.UntypedStorage) -> int | None:
        return self._live.get(id(st))

    def sid_of(self, t: torch.Tensor) -> int | None:
        """The id of ``t``'s storage in this trace; None where the trace does not track it."""
        st = _storage_of(t)
        return self._sid(st) if st is not None else None

    def _register_state(self, inputs: Any, held: Any = ()) -> None:
        for p in self.model.parameters():
            self._register(p, StorageKind.PARAM)
            if p.grad is not None:
                self._register(p.grad, StorageKind.GRAD)
        for b in self.model.buffers():
            self._register(b, StorageKind.BUFFER)
        for t in tree_flatten(inputs)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t, StorageKind.INPUT)
        for t in self._optimizer_tensors():
            self._register(t, StorageKind.OPTIMIZER)
        for t in held:  # real in a fake trace too (labels a loss closes over): so is their fake twin
            if (sid := self._register(t, StorageKind.INPUT)) is not None:
                self._alias_fake_copy(t, sid, keep=True)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        flat = tree_flatten(list(self.optimizer.state.values()))[0]
        return [t for t in flat if isinstance(t, torch.Tensor)]

    def _register(self, t: torch.Tensor, kind: StorageKind) -> int | None:
        """Track a tensor that exists before the step (parameter, buffer, input, state); the
        sid of one already tracked."""
        st = _storage_of(t)
        if st is None:
            return None
        sid = self._sid(st)
        if sid is None:
            sid = self._new_storage(st, alloc_op=-1)
            self.storages[sid].kind = kind
        return sid

    def _alias_fake_copy(self, t: torch.Tensor, sid: int, keep: bool = False) -> None:
        """In a fake trace, the mode's (memoised) fake copy of real tensor ``t`` is storage ``sid``
        too: a global index used by three blocks was counted again in backward. ``keep``: held
        until ``finish`` (made before any op holds it, it would die and be made again)."""
        from torch._subclasses.fake_tensor import FakeTensor

        if self._fake_mode is None or isinstance(t, FakeTensor):
            return
        twin = _storage_of(fake := self._fake_mode.from_tensor(t))
        self._kept_twins += [fake] if keep else []
        if twin is not None and self._sid(twin) is None:
            self._live[id(twin)] = sid
            # Gone before the real one: its id may be reused by a new storage, which is not sid.
            weakref.finalize(twin, self._drop_alias, id(twin), sid)

    def _fake_twin_sid(self, t: torch.Tensor) -> int | None:
        """In a fake trace, the storage already tracked that real tensor ``t`` stands for: the
        fake copy the mode made of it (or of what it views) as a step input. A loss closing over
        the batch it is also given (an autoencoder's ``F.mse_loss(out, x)``, ``inputs=(x,)``)
        reads the real ``x``: the input, not a second tensor to count."""
        from torch._subclasses.fake_tensor import FakeTensor

        if self._fake_mode is None or isinstance(t, FakeTensor):
            return None
        twin = _storage_of(self._fake_mode.from_tensor(t))
        return self._sid(twin) if twin is not None else None

    def _drop_alias(self, key: int, sid: int) -> None:
        if self._live.get(key) == sid:
            del self._live[key]

    def _new_storage(self, st: torch.UntypedStorage, alloc_op: int) -> int:
        sid = len(self.storages)
        rec = StorageRecord(sid, self.round_bytes(st.nbytes()), alloc_op, phase=self.phase)
        rec.owner_call = self._stack[-1] if self._stack else -1
        self.storages.append(rec)
        key = id(st)
        self._live[key] = sid
        self._free_refs[sid] = weakref.ref(st, functools.partial(_freed, self._self_ref, key, sid))
        return sid

    def _on_free(self, key: int, sid: int) -> None:
        if self._sealed:
            return
        if self._live.get(key) == sid:
            del self._live[key]
        # Freed after the last op that ran: alive during it, not during the next one.
        self.storages[sid].free_op = len(self.ops) - 1

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE:
            # C++ asks a fake tensor's device for nearly every op (the autograd engine, foreach
            # grouping): answered here as FakeTensor itself answers, not through every mode below.
            device = fake_device(args[0])
            if device is not None:
                return device
        # Below dispatch every call is an aten op or a tensor query: a torch-function mode of the
        # step (CudaSemanticsMode) acts on none of them, and would cost a Python call per query.
        with torch._C.DisableTorchFunction():
            return self._dispatch(func, types, args, kwargs)

    def _dispatch(self, func, types, args, kwargs):
        kwargs = kwargs or {}
        watch = self.autocast_watch
        if watch is not None and not watch.seen:
            watch.note()
        if defers(types):
            # A DTensor (or other wrapper) op: the rank runs its local ops and collectives, which
            # come back through this mode at local shapes (estimators.tracing.subclasses).
            self._foreign.note(op_tensors(args, kwargs))
            return NotImplemented
        if in_sharding_propagation() or active_fake_mode(self._fake_mode) is not self._fake_mode:
            return func(*args, **kwargs)  # DTensor's output-metadata ops on fake global shapes
        # Eagerly a wait returns its input; its fake kernel makes a new tensor (a second buffer).
        out = args[0] if func is WAIT and self._fake_mode is not None else self.run_op(func, args, kwargs)
        facts = op_facts(func)
        if self._drawn and not self._packing and func in _VALUE_READS:
            self._note_value_read(args)
        if facts.is_query or self._packing:
            return out
        index = len(self.ops)
        in_tensors = op_tensors(args, kwargs)
        self._foreign.note(in_tensors)
        arg_sids = []
        for t in in_tensors:
            st = _storage_of(t)
            sid = self._sid(st) if st is not None else None
            if sid is None and st is not None:
                sid = self._fake_twin_sid(t)
            if sid is None and st is not None:
                # Made outside the trace (a constant, the user's): from here on, a temporary of this op.
                sid = self._new_storage(st, alloc_op=index)
                self._alias_fake_copy(t, sid)
            if sid is not None:
                arg_sids.append(sid)
        mutated = self._mutated_sids(written_args(facts, args, kwargs)) if facts.written else ()
        new_sids = []
        flat_out = op_tensors(out if isinstance(out, (tuple, list)) else (out,))
        for t in flat_out:
            if isinstance(t, torch.Tensor):
                st = _storage_of(t)
                if st is not None and self._sid(st) is None:
                    new_sids.append(self._new_storage(st, alloc_op=index))
        # A drawn value stays one through ops on drawn values alone (``torch.rand([]) < p``);
        # mixed with data (a dropout mask times the activations) it is data.
        if ((facts.is_random and "dropout" not in func.__name__)
                or (self._drawn and arg_sids and self._drawn.issuperset(arg_sids))):
            self._note_drawn(flat_out)
        call = self._current_call()
        runtime_ms = self.runtime_model.op_runtime_ms(func, args, kwargs, out)
        self.ops.append(
            OpRecord(
                index=index,
                func=func,
                phase=self.phase,
                call=call,
                runtime_ms=runtime_ms,
                new_sids=tuple(new_sids),
                arg_sids=tuple(arg_sids),
                # The one meaning of "view" (see estimators/runtime/op_facts.py): no new storage, no write.
                is_view=not new_sids and not mutated,
                mutated_sids=mutated,
                is_random=facts.is_random,
            )
        )
        if self.phase is Phase.BW and call >= 0:
            self._last_bw_call = call
        if self.progress is not None and self.phase is not Phase.FW and index % 256 == 0 and self._progress_due():
            where = self.calls[call].fqn if call >= 0 else "-"
            self.progress(f"{self.phase.name.lower()}: {index} ops, in {where}")
        return out

    def foreign_leaves(self) -> list[torch.Tensor]:
        """The leaves outside the model that the step's ops read with ``requires_grad`` (alive)."""
        return self._foreign.alive()

    def restore_foreign_grads(self) -> None:
        """Put back the ``.grad`` of every leaf outside the model that the step's backward reached."""
        self._foreign.restore()

    def _note_drawn(self, flat_out: list) -> None:
        """Small outputs of a random op, or of an op on drawn values only, are drawn values (a
        drop decision, a random index); big ones (a random init) are data, not decisions."""
        small = [t for t in flat_out if isinstance(t, torch.Tensor) and t.numel() <= _DRAWN_NUMEL]
        self._drawn.update(self._tensor_sids(small))

    def _note_value_read(self, args: tuple) -> None:
        if not self._drawn.isdisjoint(self._tensor_sids(args[:1])):
            call = self._stack[-1] if self._stack else -1
            fqn = self.calls[call].fqn if call >= 0 else self.root_name
            if fqn not in self.random_value_reads:
                self.random_value_reads.append(fqn)

    def _mutated_sids(self, values: list[Any]) -> tuple[int, ...]:
        sids = []
        for a in values:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    st = _storage_of(t)
                    sid = self._sid(st) if st is not None else None
                    if sid is not None:
                        sids.append(sid)
        return tuple(sids)

    def _current_call(self) -> int:
        if self.phase is not Phase.BW:
            return self._stack[-1] if self._stack else -1
        node = torch._C._current_autograd_node()
        if node is None:
            return self._last_bw_call
        seq = node._sequence_nr()
        if seq == _NO_SEQ:
            return self._last_bw_call  # AccumulateGrad: stays with the module that fed it
        return self._call_of_seq(seq)

    # ------------------------------------------------------------------ saved tensors
    def pack_hook(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage_of(t)
        if st is not None:
            sid = self._sid(st)
            if sid is not None:
                rec = self.storages[sid]
                rec.saved = True
                rec.saved_by_calls.add(self._stack[-1] if self._stack else -1)
        # Not ``t`` itself when it has a grad_fn: a saved own output (tanh, softmax) would hold
        # output -> grad_fn -> saved output, a cycle only gc frees (an unused pooler's output
        # outlived its last reference). The detach is the hook's: not recorded.
        if t.grad_fn is None:
            return t, t._version
        self._packing = True
        try:
            alias = t.detach()  # shares t's version counter
        finally:
            self._packing = False
        return alias, alias._version

    @staticmethod
    def unpack_hook(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        """Autograd checks that a saved tensor was not modified in place since it was saved,
        but not for tensors that saved-tensor hooks hand back: the check is repeated here, or a
        model whose own backward fails (in-place dropout on a softmax output) was planned."""
        t, version = packed
        if t._version != version:
            raise InplaceModifiedError(
                f"the step's backward needs a tensor of shape {tuple(t.shape)} that was modified "
                f"in place after the forward saved it (version {t._version}, saved at {version}): "
                "torch raises \"one of the variables needed for gradient computation has been "
                "modified by an inplace operation\" for this step without the planner too. Make "
                "that op out of place (e.g. dropout(inplace=False))")
        return t

    # ------------------------------------------------------------------ module calls
    def _peek_seq(self) -> int:
        """The autograd sequence number the next Node will get (consumes one number). Torch-function
        modes off too: the step's (CudaSemanticsMode) act on none of these calls, and saw three per
        module call (grad mode set, ``view_as``, grad mode restored)."""
        with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
            enabled = torch.is_grad_enabled()
            torch._C._set_grad_enabled(True)
            try:
                return self._seq_probe.view_as(self._seq_probe).grad_fn._sequence_nr() + 1
            finally:
                torch._C._set_grad_enabled(enabled)

    def attach(self) -> None:
        """Install the module hooks that attribute forward ops to module calls."""
        for name, mod in self.model.named_modules(remove_duplicate=True):
            fqn = f"{self.root_name}.{name}" if name else self.root_name
            self._hooks.append(
                mod.register_forward_pre_hook(self._make_pre_hook(fqn), with_kwargs=True)
            )
            self._hooks.append(
                mod.register_forward_hook(self._make_post_hook(), with_kwargs=True, always_call=True)
            )

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _make_pre_hook(self, fqn: str):
        def pre_hook(module, args, kwargs):
            if self.phase is not Phase.FW:
                return None  # a module called from the optimizer or a hook: not part of forward
            parent = self._stack[-1] if self._stack else -1
            call = ModuleCall(
                cid=len(self.calls),
                fqn=fqn,
                parent=parent,
                depth=len(self._stack),
                seq_start=self._peek_seq(),
                fw_first_op=len(self.ops),
                input_sids=self._tensor_sids((args, kwargs)),
                input_numel=tensor_numel((args, kwargs)),
            )
            self.calls.append(call)
            self._stack.append(call.cid)
            self._seq_index = None
            return None

        return pre_hook

    def _make_post_hook(self):
        def post_hook(module, args, kwargs, output):
            if self.phase is not Phase.FW or not self._stack:
                return None
            call = self.calls[self._stack.pop()]
            call.seq_end = self._peek_seq()
            call.fw_last_op = len(self.ops) - 1
            call.output_sids = self._tensor_sids(output)
            call.post_rank = self._calls_done
            self._calls_done += 1
            if call.parent < 0 and self._previous_output and not self._output_sids:
                sids = (self._sid(st) for st in map(_storage_of, held_tensors(output)) if st is not None)
                self._output_sids = tuple(dict.fromkeys(s for s in sids if s is not None))
            if self.progress is not None and (call.depth <= 1 or self._progress_due()):
                self.progress(f"forward: {call.fqn} done ({len(self.ops)} ops)")
            return None

        return post_hook

    def _progress_due(self, every_s: float = 2.0) -> bool:
        """At most one progress message every ``every_s`` seconds for deep modules."""
        now = time.monotonic()
        if now - self._last_progress < every_s:
            return False
        self._last_progress = now
        return True

    def _tensor_sids(self, obj: Any) -> tuple[int, ...]:
        flat, _ = tree_flatten(obj)
        sids = []
        for t in flat:
            if isinstance(t, torch.Tensor):
                st = _storage_of(t)
                sid = self._sid(st) if st is not None else None
                if sid is not None and sid not in sids:
                    sids.append(sid)
        return tuple(sids)

    def _call_of_seq(self, seq: int) -> int:
        if self._seq_index is None:
            self._seq_index = self._build_seq_index()
        bounds, owners = self._seq_index
        return owners[bisect.bisect_right(bounds, seq) - 1] if bounds else -1

    def _build_seq_index(self) -> tuple[list[int], list[int]]:
        """Boundaries of the laminar call intervals -> innermost call of each gap."""
        events: list[tuple[int, int, int]] = []  # (seq, order, call) ; ends sort before starts
        for c in self.calls:
            end = c.seq_end if c.seq_end >= 0 else 2**63
            events.append((c.seq_start, 1, c.cid))
            events.append((end, 0, c.cid))
        events.sort()
        bounds: list[int] = [-1]
        owners: list[int] = [-1]
        stack: list[int] = []
        for seq, is_start, cid in events:
            if is_start:
                stack.append(cid)
            elif stack and stack[-1] == cid:
                stack.pop()
            else:  # ill-nested (should not happen): drop it wherever it is
                stack.remove(cid)
            owner = stack[-1] if stack else -1
            if bounds[-1] == seq:
                owners[-1] = owner
            else:
                bounds.append(seq)
                owners.append(owner)
        return bounds, owners

    # ------------------------------------------------------------------ results
    def finish(self) -> StepTrace:
        """End the recording and return the complete trace: backward attribution closed, every
        storage in its final category, the module tree's leaves and parameter bytes."""
        self._sealed = True
        self._kept_twins.clear()
        self._close_backward()
        # State the step created (gradients, new optimizer state) is known only now.
        grads = {self._register(p.grad, StorageKind.GRAD) for p in self.model.parameters() if p.grad is not None}
        state = {self._register(t, StorageKind.OPTIMIZER) for t in self._optimizer_tensors()}
        storages = [
            s if s.alloc_op < 0 else dataclasses.replace(s, kind=final_storage_kind(s, grads, state))
            for s in self.storages
        ]
        held = self._previous_output_records(storages)
        leaves, param_bytes, grad_bytes = module_tree(self.model, self.root_name, self.round_bytes)
        trace = StepTrace(
            ops=self.ops, storages=storages + held, calls=self.calls, leaf_fqns=leaves,
            param_bytes_by_module=param_bytes, grad_bytes_by_module=grad_bytes, device=self.device,
            previous_output_sids=tuple(r.sid for r in held),
        )
        self.model = self.optimizer = None  # the trace holds numbers only
        return trace

    def _previous_output_records(self, storages: list[StorageRecord]) -> list[StorageRecord]:
        """One record per storage of the root's output made in the step (not a parameter or an
        input it returns), alive from the step's start through the root forward's last op, as
        the previous output is; counted with the inputs, which the loop holds too."""
        root = next((c for c in self.calls if c.parent < 0), None)
        made = [storages[s] for s in self._output_sids if storages[s].alloc_op >= 0]
        if root is None or not made:
            return []
        return [StorageRecord(len(storages) + i, s.nbytes, -1, free_op=root.fw_last_op, kind=StorageKind.INPUT)
                for i, s in enumerate(made)]

    def _close_backward(self) -> None:
        """First/last backward op of every call and its ancestors."""
        for op in self.ops:
            if op.phase is not Phase.BW:
                continue
            c = op.call
            while c >= 0:
                call = self.calls[c]
                if call.bw_first_op < 0:
                    call.bw_first_op = op.index
                call.bw_last_op = op.index
                c = call.parent
