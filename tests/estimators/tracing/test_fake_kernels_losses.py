"""estimators/tracing/fake_kernels.py, the losses: every torch.nn.functional loss and reduction
swept op by op (fake outputs keep the real kernels' storage), and traced on a tiny net against a
measured step."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from estimators.step.train_step import TrainStep
from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
from estimators.tracing.fake_kernels import RealKernelsMode
from planner.analysis.measure import measure_steps

aten = torch.ops.aten
N, C = 8, 5


def _sign(*shape):
    return torch.randint(0, 2, shape) * 2.0 - 1


def _x(*shape):
    return torch.randn(*shape, requires_grad=True)


# name -> (function, arguments before ``reduction``); every loss of torch.nn.functional.
LOSSES = {
    "binary_cross_entropy": (F.binary_cross_entropy, lambda: (torch.rand(N, C).clamp(0.05, 0.95).requires_grad_(), torch.rand(N, C))),
    "binary_cross_entropy_with_logits": (F.binary_cross_entropy_with_logits, lambda: (_x(N, C), torch.rand(N, C))),
    "cosine_embedding_loss": (F.cosine_embedding_loss, lambda: (_x(N, C), _x(N, C), _sign(N))),
    "cross_entropy": (F.cross_entropy, lambda: (_x(N, C), torch.randint(0, C, (N,)))),
    "ctc_loss": (F.ctc_loss, lambda: (torch.randn(12, N, C).log_softmax(2).requires_grad_(), torch.randint(1, C, (N, 4)),
                                      torch.full((N,), 12), torch.full((N,), 4))),
    "gaussian_nll_loss": (F.gaussian_nll_loss, lambda: (_x(N, C), torch.randn(N, C), torch.rand(N, C) + 0.1)),
    "hinge_embedding_loss": (F.hinge_embedding_loss, lambda: (_x(N, C), _sign(N, C))),
    "huber_loss": (F.huber_loss, lambda: (_x(N, C), torch.randn(N, C))),
    "kl_div": (F.kl_div, lambda: (_x(N, C), torch.rand(N, C))),
    "l1_loss": (F.l1_loss, lambda: (_x(N, C), torch.randn(N, C))),
    "linear_cross_entropy": (lambda x, w, t, reduction: F.linear_cross_entropy(x, w, t, reduction=reduction),
                             lambda: (_x(N, 6), _x(C, 6), torch.randint(0, C, (N,)))),
    "margin_ranking_loss": (F.margin_ranking_loss, lambda: (_x(N), _x(N), _sign(N))),
    "mse_loss": (F.mse_loss, lambda: (_x(N, C), torch.randn(N, C))),
    "multi_margin_loss": (F.multi_margin_loss, lambda: (_x(N, C), torch.randint(0, C, (N,)))),
    "multilabel_margin_loss": (F.multilabel_margin_loss, lambda: (_x(N, C), torch.randint(-1, C, (N, C)))),
    "multilabel_soft_margin_loss": (F.multilabel_soft_margin_loss, lambda: (_x(N, C), torch.randint(0, 2, (N, C)).float())),
    "nll_loss": (F.nll_loss, lambda: (_x(N, C), torch.randint(0, C, (N,)))),
    "poisson_nll_loss": (F.poisson_nll_loss, lambda: (_x(N, C), torch.rand(N, C))),
    "smooth_l1_loss": (F.smooth_l1_loss, lambda: (_x(N, C), torch.randn(N, C))),
    "soft_margin_loss": (F.soft_margin_loss, lambda: (_x(N, C), _sign(N, C))),
    "triplet_margin_loss": (F.triplet_margin_loss, lambda: (_x(N, C), _x(N, C), _x(N, C))),
    "triplet_margin_with_distance_loss": (F.triplet_margin_with_distance_loss, lambda: (_x(N, C), _x(N, C), _x(N, C))),
}

_READS_VALUES = {aten._local_scalar_dense.default}
"""Ops that read a value (gaussian_nll_loss checks ``torch.any(var < 0)``): no fake output to compare."""


def test_the_sweep_covers_every_functional_loss():
    named = {n for n in dir(F) if not n.startswith("_") and ("loss" in n or "entropy" in n or n == "kl_div")}
    assert named == set(LOSSES), "a loss torch added (or dropped): add it to LOSSES"


def _storages(out) -> list:
    return [(t.dtype, tuple(t.shape), t.stride(), t.untyped_storage().nbytes())
            for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


class _EachOpFake(TorchDispatchMode):
    """Runs every op for real, and again on fake copies of its arguments under RealKernelsMode
    (as a fake trace runs it); collects where the two outputs' storages differ."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.cuda, self.differ, self.ops = cuda, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _READS_VALUES:
            return out
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        with mode, RealKernelsMode(cuda=self.cuda):
            fake_out = func(*tree_map(fake, args), **tree_map(fake, kwargs))
        self.ops.add(str(func))
        if _storages(fake_out) != _storages(out):
            self.differ.append((str(func), _storages(out), _storages(fake_out)))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", LOSSES)
def test_fake_outputs_keep_the_real_kernels_storage(name, reduction, dtype):
    # Before: mse_loss, smooth_l1_loss, soft_margin_loss and binary_cross_entropy reduced to a
    # 0-dim loss over a storage of the input's size (160 B here), the fake one 4 B; ctc_loss's
    # fake kernel raised (a data-dependent output shape).
    fn, make = LOSSES[name]
    args = tree_map(lambda t: t.detach().to(dtype).requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() else t, make())
    mode = _EachOpFake()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with mode:
                loss = fn(*args, reduction=reduction)
                (loss.sum() if reduction == "none" else loss).backward()
        except (RuntimeError, NotImplementedError) as e:
            if dtype is torch.float32 or "not implemented for" not in str(e):
                raise
            pytest.skip(f"no {dtype} kernel on the CPU: {str(e).splitlines()[0]}")
    assert mode.ops and not mode.differ


@pytest.mark.parametrize("func, args, reduction_at", [
    (aten.mse_loss.default, (torch.randn(8, 1), torch.randn(8, 5)), 2),  # broadcast past the input
    (aten.mse_loss.default, (torch.randn(8, 5), torch.randn(5)), 2),
    (aten.mse_loss.default, (torch.randn(8, 5, dtype=torch.bfloat16), torch.randn(8, 5, dtype=torch.bfloat16)), 2),
    (aten.mse_loss.default, (torch.randn(0, 5), torch.randn(0, 5)), 2),  # one element, as the kernel's resize
    (aten.smooth_l1_loss.default, (torch.randn(8, 5), torch.randn(5), 1, 1.0), 2),
    (aten.smooth_l1_loss.default, (torch.randn(8, 5), torch.randn(8, 5), 2, 0.0), 2),  # beta 0 runs l1_loss
    (aten.soft_margin_loss.default, (torch.randn(8, 5), torch.randn(5)), 2),
    (aten.binary_cross_entropy.default, (torch.rand(8, 5), torch.rand(8, 5), torch.rand(5)), 3),
    (aten.binary_cross_entropy.default, (torch.rand(8, 5, dtype=torch.bfloat16), torch.rand(8, 5, dtype=torch.bfloat16), None), 3),
])
@pytest.mark.parametrize("cuda", [False, True])
def test_a_reduced_loss_keeps_the_storage_of_the_unreduced_one(func, args, reduction_at, cuda):
    # One rule per op (fake_kernels rule 8); a CUDA target keeps it, CUDA's kernels resizing
    # their output alike.
    for reduction in (0, 1, 2):
        full = (*args[:reduction_at], reduction, *args[reduction_at + 1:])
        real = func(*full)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, RealKernelsMode(cuda=cuda):
            fake = func(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in full])
        assert _storages(fake) == _storages(real), reduction


@pytest.mark.parametrize("int_lengths", [False, True])
def test_ctc_loss_traces_with_the_real_kernels_outputs(int_lengths):
    log_probs = torch.randn(12, N, C).log_softmax(2)
    targets, lengths = torch.randint(1, C, (N, 4)), [4] * N
    given = lengths if int_lengths else torch.tensor(lengths)
    func = aten._ctc_loss.default if int_lengths else aten._ctc_loss.Tensor
    inputs = [12] * N if int_lengths else torch.full((N,), 12)
    real = func(log_probs, targets, inputs, given, 0, False)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, RealKernelsMode():
        fake = func(mode.from_tensor(log_probs), mode.from_tensor(targets),
                    inputs if int_lengths else mode.from_tensor(inputs),
                    given if int_lengths else mode.from_tensor(given), 0, False)
    assert _storages(fake) == _storages(real)


# ------------------------------------------------------------------ traced on a net, measured
_D, _CLASSES = 32, 16


class _Net(torch.nn.Module):
    def __init__(self, heads: int = 1, dim: int = _CLASSES):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(_D, 64), torch.nn.ReLU())
        self.heads = torch.nn.ModuleList(torch.nn.Linear(64, dim) for _ in range(heads))

    def forward(self, x, target=None):
        h = self.body(x)
        outs = [head(h) for head in self.heads]
        return outs[0] if len(outs) == 1 else tuple(outs)


def _sign64(*shape):
    return torch.randint(0, 2, shape) * 2.0 - 1


B, K = 64, _CLASSES
NETS = {  # name -> (heads, head width, loss(output, target), target)
    "binary_cross_entropy": (1, K, lambda o, t: F.binary_cross_entropy(torch.sigmoid(o), t), lambda: torch.rand(B, K)),
    "binary_cross_entropy_with_logits": (1, K, F.binary_cross_entropy_with_logits, lambda: torch.rand(B, K)),
    "cosine_embedding_loss": (2, K, lambda o, t: F.cosine_embedding_loss(o[0], o[1], t), lambda: _sign64(B)),
    "cross_entropy": (1, K, F.cross_entropy, lambda: torch.randint(0, K, (B,))),
    "ctc_loss": (1, K, lambda o, t: F.ctc_loss(o.view(8, 8, K).log_softmax(2), t, torch.full((8,), 8), torch.full((8,), 3)),
                 lambda: torch.randint(1, K, (8, 3))),
    "gaussian_nll_loss": (2, K, lambda o, t: F.gaussian_nll_loss(o[0], t, F.softplus(o[1])), lambda: torch.randn(B, K)),
    "hinge_embedding_loss": (1, K, F.hinge_embedding_loss, lambda: _sign64(B, K)),
    "huber_loss": (1, K, F.huber_loss, lambda: torch.randn(B, K)),
    "kl_div": (1, K, lambda o, t: F.kl_div(o.log_softmax(1), t), lambda: torch.softmax(torch.randn(B, K), 1)),
    "l1_loss": (1, K, F.l1_loss, lambda: torch.randn(B, K)),
    "linear_cross_entropy": (1, 64, lambda o, t: F.linear_cross_entropy(o, torch.ones(K, 64), t), lambda: torch.randint(0, K, (B,))),
    "margin_ranking_loss": (2, 1, lambda o, t: F.margin_ranking_loss(o[0].squeeze(1), o[1].squeeze(1), t), lambda: _sign64(B)),
    "mse_loss": (1, K, F.mse_loss, lambda: torch.randn(B, K)),
    "multi_margin_loss": (1, K, F.multi_margin_loss, lambda: torch.randint(0, K, (B,))),
    "multilabel_margin_loss": (1, K, F.multilabel_margin_loss, lambda: torch.randint(-1, K, (B, K))),
    "multilabel_soft_margin_loss": (1, K, F.multilabel_soft_margin_loss, lambda: torch.randint(0, 2, (B, K)).float()),
    "nll_loss": (1, K, lambda o, t: F.nll_loss(o.log_softmax(1), t), lambda: torch.randint(0, K, (B,))),
    "poisson_nll_loss": (1, K, F.poisson_nll_loss, lambda: torch.rand(B, K) * 3),
    "smooth_l1_loss": (1, K, F.smooth_l1_loss, lambda: torch.randn(B, K)),
    "soft_margin_loss": (1, K, F.soft_margin_loss, lambda: _sign64(B, K)),
    "triplet_margin_loss": (3, K, lambda o, t: F.triplet_margin_loss(*o), lambda: None),
    "triplet_margin_with_distance_loss": (3, K, lambda o, t: F.triplet_margin_with_distance_loss(*o), lambda: None),
}


def _net_step(name: str) -> tuple[torch.nn.Module, TrainStep]:
    heads, dim, fn, target = NETS[name]
    model = _Net(heads, dim)
    t = target()
    inputs = (torch.randn(B, _D),) if t is None else (torch.randn(B, _D), t)
    return model, TrainStep(inputs=inputs, loss_fn=lambda out, batch: fn(out, batch[-1]), optimizer="sgd")


def test_every_functional_loss_has_a_net():
    assert set(NETS) == set(LOSSES)


@pytest.mark.parametrize("name", sorted(set(NETS) - {"gaussian_nll_loss"}))
def test_every_functional_loss_is_predicted_to_the_byte(name):
    # Before: mse, smooth_l1, soft_margin and binary_cross_entropy 4,092 B under (the target's
    # bytes less the 4 B loss), ctc_loss a TraceError.
    model, step = _net_step(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake = estimate(model, step=step).module_info.peak_bytes
        measured = measure_steps(model, step, n_steps=2)[1].peak_bytes
    assert fake == measured


def test_a_loss_that_reads_values_is_traced_in_real_mode_to_the_byte():
    # gaussian_nll_loss checks torch.any(var < 0): a value no fake tensor has. The fake trace
    # says so and names the real-mode trace, which predicts the step.
    model, step = _net_step("gaussian_nll_loss")
    with pytest.raises(TraceError, match="reads tensor values.*real mode"):
        estimate(model, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = estimate(model, step=step, options=EstimateOptions(mode=TraceMode.REAL)).module_info.peak_bytes
        measured = measure_steps(model, step, n_steps=2)[1].peak_bytes
    assert real == measured


def test_ctc_targets_shorter_than_their_padding_are_an_upper_bound():
    # Target lengths as a tensor have no values in a fake trace: log_alpha is sized for targets
    # that fill the padding (5 here, the longest 3): 8 x 8 x (11 - 7) float32 = 1,024 B more.
    model = _Net(1, K)
    fn = lambda o, t: F.ctc_loss(o.view(8, 8, K).log_softmax(2), t, torch.full((8,), 8), torch.full((8,), 3))  # noqa: E731
    step = TrainStep(inputs=(torch.randn(B, _D), torch.randint(1, K, (8, 5))), loss_fn=lambda o, b: fn(o, b[-1]),
                     optimizer="sgd")
    fake = estimate(model, step=step).module_info.peak_bytes
    measured = measure_steps(model, step, n_steps=2)[1].peak_bytes
    assert 0 <= fake - measured <= 8 * 8 * 4 * 4
