"""Fake (meta) kernels that disagree with the real ones, corrected for a fake-mode trace.

A fake-mode trace takes every output's dtype, shape and bytes from torch's meta kernels. Where
those differ from what the real kernel allocates, the trace counts the wrong bytes; where a meta
kernel refuses arguments the real kernel takes, the trace fails. :class:`RealKernelsMode` sits
between the tracer and the ``FakeTensorMode`` (the tracer records what it returns) and applies
one rule per op, each measured against the real CPU kernel (tests/estimators/test_fake_kernels.py):

1. ``native_layer_norm``: the saved ``mean`` / ``rstd`` are float32 when a low-precision input
   (bf16 / fp16, e.g. under autocast, which lets ``layer_norm`` follow a bf16 input on CPU) has
   float32 weight or bias (ATen's "mixed type"); the meta kernel gives them the input's dtype.
   On a CUDA target they are float32 for every low-precision input (CUDA's kernel accumulates
   and saves in float32).
2. ``native_group_norm``: the same mixed-type rule on every device.
3. ``native_group_norm_backward``: ``grad_input`` has the input's dtype; the meta kernel takes
   the dtype of ``mean`` (float32 after rule 2: twice the bytes of a bf16 gradient).
4. ``native_layer_norm_backward``: ``grad_input`` is contiguous (the kernels write it over the
   contiguous input); the meta kernel copies the incoming gradient's strides, so behind a
   transpose (Swin's patch merging) the next linear's backward would copy it to reshape.
5. ``_grouped_mm`` (MoE experts in transformers 5): the meta kernel checks CUDA's limits (bf16
   only, 16-byte aligned strides) and refuses what the CPU kernel runs, e.g. float32 experts fed
   by autocast's float32 activations; the output is computed here as the CPU kernel makes it:
   ``out_dtype`` or the inputs' dtype, contiguous, shape from the 2-D / 3-D operand rules.

6. ``native_batch_norm`` (and its ``_legit`` forms): the saved ``mean`` / ``invstd`` follow
   rule 1 (float32 for a bf16 input with float32 weight, as BatchNorm2d under autocast runs on
   CPU; float32 for every low-precision input on CUDA). The
   output is dense in the input's suggested memory format (the kernels' ``empty_like(input,
   suggest_memory_format())``): channels_last stays so, a transposed 3-D input gives a contiguous
   output, where the meta kernel kept the transposed strides. PatchTST normalises behind a
   transpose: with the meta strides the trace sees a view where the next ``Linear`` copies.

7. ``_embedding_bag`` (and its forward-only form) on the CPU: ``offset2bag`` is empty on the
   sum fast path, which the meta kernel takes for float32 weights only, and otherwise sits on
   ``numel + 1`` elements, as ``bag_size`` with ``include_last_offset`` does on ``bags + 1``
   (the kernel allocates one more and narrows).

8. ``mse_loss``, ``smooth_l1_loss``, ``soft_margin_loss``, ``binary_cross_entropy`` with a
   ``mean`` or ``sum`` reduction: the 0-dim loss keeps the storage of the unreduced loss (the
   kernels compute it into their output and resize that to 0-dim, which keeps the storage),
   ``max(1, n)`` elements of the loss's dtype, ``n`` the broadcast size of input and target
   (``soft_margin_loss`` and ``binary_cross_entropy``: the input's size); the fake kernels give
   one element. The loss lives through the backward, so the fake kernels count the target's
   bytes too little. Found by a sweep over
   every ``torch.nn.functional`` loss and reduction (tests/estimators/tracing/
   test_fake_kernels_losses.py). CUDA's kernels make the same allocation (the same structured kernel
   for mse / smooth_l1, a device-generic one for soft_margin, and CUDA's
   ``binary_cross_entropy`` resizes its output alike), so the rule holds for a CUDA target;
   read from the kernels' source, not measured on a GPU here.
9. ``_ctc_loss`` (``F.ctc_loss``): the meta kernel refuses (its ``log_alpha`` output is
   ``[batch, T, 2 L + 1]``, ``L`` the longest target, a value); with target lengths given as
   ints ``L`` is known, with a tensor of them (fake: no values) ``L`` is the most the targets
   can hold (padded ``[batch, S]`` targets: ``S``; concatenated 1-D targets: all of them),
   exact when the longest target fills the padding and an upper bound otherwise.

10. ``embedding`` and ``_embedding_bag``: a fake tensor has no values, so ids past the table
    (or negative) were planned, where the real step raises "index out of range". Where the ids
    are a batch tensor the trace was given (or a view of one), its real values are checked
    against the table's rows (``values=`` maps each fake batch tensor to the real one).

Any other meta kernel that raises is reported by :class:`FakeKernelError`, naming the op and its
arguments and saying what the real kernel does with the same arguments (run on zeros where they
are small), with the way out: trace in real mode.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from estimators.tracing.fake_dispatch import FakeDispatchMemo

__all__ = ["FakeKernelError", "RealKernelsMode"]

aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)
_PROBE_BYTES = 16 * 2**20  # inputs up to this size are run for real to say what the kernel does


class FakeKernelError(RuntimeError):
    """torch's fake (meta) kernel for an op raised where the real kernel may not."""


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor with ``t``'s shape and strides in ``dtype`` (fake under fake mode)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def _mixed(x: torch.Tensor, *params: Any) -> bool:
    """ATen's ``is_mixed_type``: a low-precision input with float32 parameters."""
    return x.dtype in _LOW and any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)


def _layer_norm(out, args, kwargs, cuda: bool):
    x, weight, bias = args[0], _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")
    if x.dtype in _LOW and (cuda or _mixed(x, weight, bias)) and out[1].dtype != torch.float32:
        return out[0], _like(out[1], torch.float32), _like(out[2], torch.float32)
    return out


def _group_norm(out, args, kwargs, cuda: bool):
    x, weight, bias = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    if _mixed(x, weight, bias) and out[1].dtype != torch.float32:
        return out[0], _like(out[1], torch.float32), _like(out[2], torch.float32)
    return out


def _layer_norm_backward(out, args, kwargs, cuda: bool):
    x = args[1]
    g = out[0]
    if g is not None and (g.dtype != x.dtype or not g.is_contiguous()):
        return (torch.empty(g.shape, dtype=x.dtype, device=g.device), *out[1:])
    return out


def _group_norm_backward(out, args, kwargs, cuda: bool):
    x = args[1]
    if out[0] is not None and out[0].dtype != x.dtype:
        return (_like(out[0], x.dtype), *out[1:])
    return out


def _batch_norm(out, args, kwargs, cuda: bool):
    x, weight, bias = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    out = list(out)
    fmt = suggest_memory_format(x)
    if not out[0].is_contiguous(memory_format=fmt):
        out[0] = torch.empty(out[0].shape, dtype=out[0].dtype, device=out[0].device, memory_format=fmt)
    # Mixed also by float32 running statistics alone (affine=False): measured on the CPU.
    stats = _arg(args, kwargs, 3, "running_mean"), _arg(args, kwargs, 4, "running_var")
    if x.dtype in _LOW and (cuda or _mixed(x, weight, bias, *stats)) and out[1].dtype != torch.float32:
        out[1], out[2] = _like(out[1], torch.float32), _like(out[2], torch.float32)
    return tuple(out)


def _embedding_bag(out, args, kwargs, cuda: bool, forward_only: bool = False):
    """The CPU kernel's index tensors (measured over dtypes, modes, padding_idx, per-sample
    weights and include_last_offset): ``offset2bag`` is empty on the sum fast path (float32 /
    bf16 / fp16 weights, no padding_idx; the meta kernel takes it for float32 only) and
    otherwise sits on ``numel + 1`` elements; ``bag_size`` with ``include_last_offset`` on
    ``bags + 1``; the forward-only op's ``max_indices`` of a sum has ``bags + 1`` elements."""
    if cuda:
        return out
    weight, offsets = args[0], args[2]
    mode = _arg(args, kwargs, 4, "mode") or 0
    last = bool(_arg(args, kwargs, 7, "include_last_offset"))
    pad = _arg(args, kwargs, 8, "padding_idx")
    bags = offsets.shape[0] - (1 if last else 0)
    out = list(out)
    if mode == 0 and (pad is None or pad < 0) and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
        out[1] = torch.empty(0, dtype=out[1].dtype, device=out[1].device)
    elif out[1].dim() == 1:
        out[1] = _one_more(torch.empty(args[1].numel(), dtype=out[1].dtype, device=out[1].device))
    if last and out[2].dim() == 1 and not (forward_only and mode == 0):  # that one shows bags + 1
        out[2] = _one_more(torch.empty(bags, dtype=out[2].dtype, device=out[2].device))
    if forward_only and mode == 0 and last and out[3].dim() == 1 and out[3].shape[0] == bags:
        out[3] = torch.empty(bags + 1, dtype=out[3].dtype, device=out[3].device)
    return tuple(out)


def _embedding_bag_forward_only(out, args, kwargs, cuda: bool):
    return _embedding_bag(out, args, kwargs, cuda, forward_only=True)


def _one_more(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape and dtype over a storage of one element more (a narrowed allocation)."""
    return torch.empty(t.shape[0] + 1, dtype=t.dtype, device=t.device)[: t.shape[0]]


def _reduced_loss(out, args, kwargs, cuda: bool, *, reduction_at: int, broadcast: bool):
    """Rule 8: a reduced loss over the storage of the unreduced one."""
    reduction = _arg(args, kwargs, reduction_at, "reduction")
    if reduction == 0 or out.dim() != 0:  # Reduction::None: the loss is the full tensor already
        return out
    x, target = args[0], args[1]
    n = torch.broadcast_shapes(x.shape, target.shape).numel() if broadcast else x.numel()
    return torch.empty(max(n, 1), dtype=out.dtype, device=out.device).as_strided((), ())


def _mse_like(out, args, kwargs, cuda: bool):  # mse_loss(self, target, reduction=Mean[, beta])
    return _reduced_loss(out, args, kwargs, cuda, reduction_at=2, broadcast=True)


def _soft_margin(out, args, kwargs, cuda: bool):  # soft_margin_loss(self, target, reduction=Mean)
    return _reduced_loss(out, args, kwargs, cuda, reduction_at=2, broadcast=False)


def _bce(out, args, kwargs, cuda: bool):  # binary_cross_entropy(self, target, weight=None, reduction=Mean)
    return _reduced_loss(out, args, kwargs, cuda, reduction_at=3, broadcast=False)


_OUTPUT_RULES = {
    aten.mse_loss.default: _mse_like,
    aten.smooth_l1_loss.default: _mse_like,
    aten.soft_margin_loss.default: _soft_margin,
    aten.binary_cross_entropy.default: _bce,
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_forward_only.default: _embedding_bag_forward_only,
    aten.native_batch_norm.default: _batch_norm,
    aten._native_batch_norm_legit.default: _batch_norm,
    aten._native_batch_norm_legit_functional.default: _batch_norm,
    aten._native_batch_norm_legit_no_training.default: _batch_norm,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_group_norm.default: _group_norm,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
}


def _arg(args, kwargs, pos: int, name: str) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name)


def _grouped_mm(args, kwargs) -> torch.Tensor:
    """The CPU kernel's output of ``_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None)``."""
    a, b = args[0], args[1]
    offs = _arg(args, kwargs, 2, "offs")
    out_dtype = _arg(args, kwargs, 4, "out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:  # tokens sorted by group x per-group weights: [M, N]
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 2:  # [G, M, K] x [K, N] split along N by offs
        shape = (a.shape[0] if offs is None else a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2:  # one K split into groups: [G, M, N]
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    else:  # batched: [G, M, K] x [G, K, N]
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    return torch.empty(shape, dtype=out_dtype, device=a.device)


def _ctc_loss(args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 9: ``(neg_log_likelihood [batch], log_alpha [batch, T, 2 L + 1])`` of
    ``_ctc_loss(log_probs [T, batch, C], targets, input_lengths, target_lengths, ...)``."""
    log_probs, targets, target_lengths = args[0], args[1], args[3]
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    if isinstance(target_lengths, torch.Tensor):
        longest = targets.shape[1] if targets.dim() == 2 else targets.numel()
    else:
        longest = max(target_lengths, default=0)
    return (torch.empty(batch, dtype=log_probs.dtype, device=log_probs.device),
            torch.empty(batch, log_probs.shape[0], 2 * longest + 1, dtype=log_probs.dtype, device=log_probs.device))


_REPLACED = {
    aten._grouped_mm.default: _grouped_mm,
    aten._ctc_loss.default: _ctc_loss,
    aten._ctc_loss.Tensor: _ctc_loss,
}


class RealKernelsMode(TorchDispatchMode):
    """``with RealKernelsMode(cuda=...):`` inside a ``FakeTensorMode``, below the tracer: fake
    outputs as the real kernels make them (see the module docstring). ``cuda``: the trace stands
    for a CUDA target (CUDA's layer-norm statistics)."""

    def __init__(self, *, cuda: bool = False, values: dict[int, torch.Tensor] | None = None,
                 fake_mode: Any = None) -> None:
        super().__init__()
        self.cuda = cuda
        self.values = values or {}
        """``id(fake batch tensor) -> the real tensor``: values rule 10 can check."""
        self._call = FakeDispatchMemo(fake_mode) if fake_mode is not None else _call
        """Runs the op on the mode below: ``fake_mode``'s cache hits through the memo
        (estimators/tracing/fake_dispatch.py)."""
        self._checked: set[tuple[int, int]] = set()

    def __enter__(self):
        _quiet_torch(True)
        return super().__enter__()

    def __exit__(self, *exc):
        _quiet_torch(False)
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def inline(self):
        """``with kernels.inline() as run:`` the mode's work as a function, for the one caller
        above it that runs every op itself (``StepTracer.run_op``), without entering the mode
        (a dispatch level less per op)."""
        _quiet_torch(True)
        try:
            yield self.run
        finally:
            _quiet_torch(False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})

    def run(self, func, args, kwargs):
        """``func(*args, **kwargs)`` as the real kernel makes its outputs (the mode's work, for a
        caller above it that runs the op itself: ``StepTracer.run_op``)."""
        replace = _REPLACED.get(func)
        if replace is not None:
            # Not the meta kernel first: its CUDA-only checks fail (and torch logs every failure)
            # on what the CPU kernel runs.
            return replace(args, kwargs)
        if func in _SAME_DTYPE and not (self.cuda and func in _CUDA_AUTOCAST_ONLY):
            _check_same_dtype(func, args)
        if func in _EMBEDDINGS and self.values:
            self._check_ids(args[0], args[1])
        try:
            out = self._call(func, args, kwargs)
        except Exception as e:
            if _is_data_dependent(e):
                raise
            raise FakeKernelError(_explain(func, args, kwargs, e)) from e
        rule = _OUTPUT_RULES.get(func)
        return rule(out, args, kwargs, self.cuda) if rule is not None else out

    def _check_ids(self, table: torch.Tensor, ids: Any) -> None:
        """Rule 10: the real values behind ``ids`` (a batch tensor or a view of one) are row
        numbers of ``table``."""
        if not isinstance(ids, torch.Tensor):
            return
        real = self.values.get(id(ids))
        if real is None and ids._base is not None:
            real = self.values.get(id(ids._base))
        if real is None or (id(real), table.shape[0]) in self._checked or real.numel() == 0:
            return
        self._checked.add((id(real), table.shape[0]))
        with torch._C._DisableTorchDispatch():
            low, high = int(real.min()), int(real.max())
        rows = table.shape[0]
        if low < 0 or high >= rows:
            raise FakeKernelError(
                f"the batch's ids run from {low} to {high}, but the embedding they index has {rows:,} "
                f"rows (ids must be in [0, {rows:,})): the real step raises 'index out of range'; "
                "check the tokenizer against the model's vocabulary size (vocab_size) and that "
                "padding or ignored positions (-100) are not fed to the embedding")


def _call(func, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


_aten = torch.ops.aten
_EMBEDDINGS = frozenset({_aten.embedding.default, _aten._embedding_bag.default,
                         _aten._embedding_bag_forward_only.default})
_SAME_DTYPE = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.addbmm.default, _aten.mv.default, _aten.addmv.default, _aten.dot.default,
})
"""Ops whose CPU and CUDA kernels refuse operands of different dtypes ("expected m1 and m2 to have
the same dtype") where the meta kernel checks shapes only: a float32 batch into a bfloat16 model,
or token ids into a Linear, would be planned for a step that cannot run."""


_CUDA_AUTOCAST_ONLY = frozenset({_aten.mv.default, _aten.addmv.default})
"""On CUDA's autocast list, not on CPU's: a CUDA target traced with CPU autocast's policy
(``EstimateOptions(cuda_autocast=False)``) leaves their operands as they are where CUDA's would
cast them (``torch.mv(w_fp32, h_bf16)`` runs on an h100 under autocast). Under CUDA's policy (the
default, estimators/tracing/cuda_autocast.py) they arrive cast already."""


def _check_same_dtype(func, args: tuple) -> None:
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
    if len(dtypes) > 1:
        names = " and ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
        raise FakeKernelError(
            f"{func} gets {names} operands ({_describe(args, {})}); the real kernel refuses mixed "
            "dtypes (\"expected m1 and m2 to have the same dtype\"), so this step cannot run: give "
            "the model inputs of its parameters' dtype (batch.to(torch.bfloat16) for a bfloat16 "
            "model; token ids go to an embedding, not a Linear), or run the step under autocast "
            "(TrainStep(autocast_dtype=...)) where the op is on autocast's list")


def _quiet_torch(on: bool) -> None:
    """torch logs every failing meta kernel with its traceback ("failed while attempting to run
    meta for ...", 20 lines on stderr) before the exception reaches this mode, which raises it
    again as a FakeKernelError that names the op and the way out."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    (log.addFilter if on else log.removeFilter)(_quiet_meta_failures)


def _quiet_meta_failures(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed while attempting to run meta")


def _is_data_dependent(e: Exception) -> bool:
    name = type(e).__name__
    return "DataDependent" in name or "DynamicOutputShape" in name or "data-dependent" in str(e).lower()


def _tensor_text(t: torch.Tensor) -> str:
    """``float32[64, 32]``; a sparse or other non-strided layout is named (``sparse_coo``)."""
    layout = "" if t.layout is torch.strided else f" ({str(t.layout).replace('torch.', '')})"
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}{layout}"


def _describe(args: Any, kwargs: Any) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return _tensor_text(x)
        return repr(x) if not isinstance(x, (list, tuple)) else type(x)([one(y) for y in x])
    parts = [str(one(a)) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _real_behaviour(func, args, kwargs) -> tuple[str, bool | None]:
    """What the real CPU kernel does with zero-filled arguments of the same shapes and dtypes,
    and whether it raises too (None: not tried)."""
    tensors = [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _PROBE_BYTES:
        return "the real kernel was not run (arguments too large to try here)", None

    def real(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu").zero_()
        return x

    with torch._C._DisableTorchDispatch():
        try:
            r_args, r_kwargs = tree_map(real, args), tree_map(real, kwargs)
            out = func(*r_args, **r_kwargs)
        except Exception as e:  # noqa: BLE001 - reported as the real kernel's answer
            said = f"({type(e).__name__}: {str(e).splitlines()[0]})"
            # The CPU kernel lacking this op or dtype, or refusing zeros (a singular matrix),
            # says nothing about the inputs.
            unrelated = isinstance(e, NotImplementedError) or any(
                k in str(e) for k in ("not implemented for", "Could not run", "singular"))
            return f"the real CPU kernel raises too on zeros of those shapes {said}", None if unrelated else True
    outs = out if isinstance(out, (tuple, list)) else (out,)
    got = ", ".join(_tensor_text(t) for t in outs if isinstance(t, torch.Tensor))
    return f"the real CPU kernel runs them and returns {got or 'no tensor'}", False


_REAL_MODE_WAY = ("trace in real mode (solve_sac(..., options=PlanOptions(trace=EstimateOptions("
                  "mode=TraceMode.REAL))), --mode real on the command line)")


_META_MISMATCH = ("a tensor on the meta device met the trace's fake CPU tensors (a fake trace runs the model's "
                  "meta parameters and inputs as fake CPU ones): one the step holds outside the model and its "
                  "inputs is still on meta, e.g. labels loss_fn closes over; make it a CPU tensor of its shape "
                  "and dtype (torch.empty(shape, dtype=..., device='cpu'): planning reads none of its values), "
                  "or pass it in the inputs")


def _explain(func, args, kwargs, e: Exception) -> str:
    if "meta" in str(e) and ("DeviceMismatch" in type(e).__name__ or "two devices" in str(e)):
        # Not the real-mode advice: a model given on meta (a 72B) has no real mode.
        return (f"torch's fake (meta) kernel for {func} raised {type(e).__name__}: {str(e).splitlines()[0]} "
                f"(arguments: {_describe(args, kwargs)}); {_META_MISMATCH}")
    real, raises = _real_behaviour(func, args, kwargs)
    if raises:
        # Seen: a 4-channel image into a 3-channel conv, float input_ids into an embedding; the
        # advice to trace in real mode sent users to a run that fails the same way.
        way = ("the step itself most likely does not run: check the inputs against the model "
               "(their shapes, dtypes -- token ids are integers -- and devices); if they are right, "
               f"{_REAL_MODE_WAY}")
    elif raises is None:
        way = f"if the inputs are right for the model, a fake-mode trace cannot size this op: {_REAL_MODE_WAY}"
    else:  # the real kernel runs them: only a real-mode trace sizes this op
        way = f"a fake-mode trace cannot size this op: {_REAL_MODE_WAY}"
    return (f"torch's fake (meta) kernel for {func} raised {type(e).__name__}: {str(e).splitlines()[0]} "
            f"(arguments: {_describe(args, kwargs)}); {real}. {way}")
