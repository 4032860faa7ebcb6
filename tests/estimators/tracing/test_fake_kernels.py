"""estimators/tracing/fake_kernels.py: fake outputs as the real CPU kernels make them, and named failures."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimators.tracing.estimation import EstimateOptions, TraceError, TraceMode, estimate
from estimators.tracing.fake_kernels import FakeKernelError, RealKernelsMode
from estimators.step.train_step import TrainStep
from planner.analysis.measure import measure_steps

aten = torch.ops.aten
bf16 = torch.bfloat16


def _layout(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [None if t is None else (t.dtype, tuple(t.shape), t.stride()) for t in outs]


def _fake_run(func, *args, cuda=False):
    """``func`` on fake copies of ``args`` under RealKernelsMode (as the trace runs it)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode, RealKernelsMode(cuda=cuda):
        return func(*fake)


def _stats(x, weight):
    return aten.native_layer_norm(x, [x.shape[-1]], weight, weight, 1e-5)


CASES = {
    # bf16 input (autocast lets layer_norm follow it on CPU) with float32 weights: float32 mean/rstd.
    "layer_norm mixed": (aten.native_layer_norm, lambda: (torch.randn(4, 8, dtype=bf16), [8], torch.randn(8), torch.randn(8), 1e-5)),
    "layer_norm bf16": (aten.native_layer_norm, lambda: (torch.randn(4, 8, dtype=bf16), [8], torch.randn(8, dtype=bf16), None, 1e-5)),
    "group_norm mixed": (aten.native_group_norm, lambda: (torch.randn(2, 8, 4, 4, dtype=bf16), torch.randn(8), torch.randn(8), 2, 8, 16, 2, 1e-5)),
    "group_norm no affine": (aten.native_group_norm, lambda: (torch.randn(2, 8, 4, 4, dtype=bf16), None, None, 2, 8, 16, 2, 1e-5)),
    # BatchNorm2d under bf16 autocast on CPU: bf16 activations, float32 weight and running stats.
    "batch_norm mixed": (aten.native_batch_norm, lambda: (torch.randn(2, 8, 4, 4, dtype=bf16), torch.randn(8), torch.randn(8), torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)),
    # affine=False: float32 running statistics alone make it mixed (bf16 statistics before).
    "batch_norm mixed by its statistics": (aten.native_batch_norm, lambda: (torch.randn(2, 8, 4, 4, dtype=bf16), None, None, torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)),
    # Behind a transpose (PatchTST's batch norm over [batch, d_model, patches]): a contiguous
    # output, where the meta kernel kept the input's strides; channels_last stays channels_last.
    "batch_norm transposed": (aten.native_batch_norm, lambda: (torch.randn(2, 32, 16).transpose(1, 2), torch.randn(16), torch.randn(16), torch.zeros(16), torch.ones(16), True, 0.1, 1e-5)),
    "batch_norm permuted 4-D": (aten.native_batch_norm, lambda: (torch.randn(2, 8, 4, 4).permute(0, 1, 3, 2), torch.randn(8), torch.randn(8), torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)),
    "batch_norm channels_last": (aten.native_batch_norm, lambda: (torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last), torch.randn(8), torch.randn(8), torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)),
    "batch_norm eval transposed": (aten._native_batch_norm_legit_no_training, lambda: (torch.randn(2, 32, 16).transpose(1, 2), torch.randn(16), torch.randn(16), torch.zeros(16), torch.ones(16), 0.1, 1e-5)),
}


@pytest.mark.parametrize("case", CASES)
def test_norm_statistics_have_the_real_kernels_dtype(case):
    func, make = CASES[case]
    args = make()
    assert _layout(_fake_run(func, *args)) == _layout(func(*args))


def test_group_norm_backward_gives_grad_input_the_input_dtype():
    x, w = torch.randn(2, 8, 4, 4, dtype=bf16), torch.randn(8)
    _, mean, rstd = aten.native_group_norm(x, w, w, 2, 8, 16, 2, 1e-5)
    args = (torch.randn_like(x), x, mean, rstd, w, 2, 8, 16, 2, [True, True, True])
    real = aten.native_group_norm_backward(*args)
    assert real[0].dtype == bf16 and mean.dtype == torch.float32
    # torch's meta kernel made it float32 (the statistics' dtype): twice the bytes
    assert _layout(_fake_run(aten.native_group_norm_backward, *args)) == _layout(real)


def test_layer_norm_backward_gives_a_contiguous_grad_input():
    x, w = torch.randn(2, 16, 16), torch.randn(16)
    _, mean, rstd = aten.native_layer_norm(x, [16], w, w, 1e-5)
    grad = torch.randn(2, 16, 16).transpose(1, 2)  # behind a transpose, as in Swin's patch merging
    args = (grad, x, [16], mean, rstd, w, w, [True, True, True])
    real = aten.native_layer_norm_backward(*args)
    assert real[0].is_contiguous()
    assert _layout(_fake_run(aten.native_layer_norm_backward, *args)) == _layout(real)


def test_layer_norm_statistics_are_float32_on_a_cuda_target():
    x, w = torch.randn(4, 8, dtype=bf16), torch.randn(8, dtype=bf16)
    _, mean, rstd = _fake_run(aten.native_layer_norm, x, [8], w, w, 1e-5, cuda=True)
    assert mean.dtype == rstd.dtype == torch.float32


_OFFS = torch.tensor([8, 16, 24], dtype=torch.int32)
GROUPED = {  # (mat_a, mat_b, offs) of each operand form the CPU kernel takes
    "2d x 3d": lambda: (torch.randn(24, 16), torch.randn(3, 16, 8), _OFFS),  # MoE experts
    "3d x 2d": lambda: (torch.randn(3, 24, 16), torch.randn(16, 24), _OFFS),
    "2d x 2d": lambda: (torch.randn(16, 24), torch.randn(24, 8), _OFFS),
    "3d x 3d": lambda: (torch.randn(3, 8, 16), torch.randn(3, 16, 8), None),
}


@pytest.mark.parametrize("dtype", [torch.float32, bf16])
@pytest.mark.parametrize("form", GROUPED)
def test_grouped_mm_runs_as_on_the_cpu(form, dtype):
    a, b, offs = GROUPED[form]()
    real = aten._grouped_mm(a.to(dtype), b.to(dtype), offs)
    # the meta kernel refuses float32 (CUDA's bf16-only check) and 16-byte-unaligned strides
    assert _layout(_fake_run(aten._grouped_mm, a.to(dtype), b.to(dtype), offs)) == _layout(real)


class _LayerNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


class _GroupNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.conv2 = torch.nn.Conv2d(3, 16, 3), torch.nn.GroupNorm(4, 16), torch.nn.Conv2d(16, 4, 3)

    def forward(self, x):
        return self.conv2(self.norm(self.conv(x)))


class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.conv2 = torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.Conv2d(16, 4, 3)

    def forward(self, x):
        return self.conv2(torch.relu(self.norm(self.conv(x))))


@pytest.mark.parametrize("net, shape", [(_LayerNormNet, (64, 32)), (_GroupNormNet, (4, 3, 16, 16)),
                                        (_BatchNormNet, (4, 3, 16, 16))])
def test_bf16_autocast_norm_nets_are_predicted_to_the_byte(net, shape):
    # Before: the LayerNorm net's statistics counted in bf16 (mean and rstd, 64 x 1 each) and the
    # GroupNorm net's grad_input in float32, so fake and real traces and MemTracker disagreed.
    model = net()
    step = TrainStep(inputs=(torch.randn(*shape),), optimizer="adamw", autocast_dtype=bf16)
    fake = estimate(model, step).module_info.peak_bytes
    real = estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL)).module_info.peak_bytes
    measured = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=2)[1].peak_bytes
    assert fake == real == measured


class _TransposedBatchNormNet(torch.nn.Module):
    """PatchTST's norm: BatchNorm1d over d_model behind a transpose, then a Linear."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)

    def forward(self, x):
        h = self.norm(self.fc(x).transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def test_batch_norm_behind_a_transpose_is_predicted_to_the_byte():
    # The fake output kept the transposed strides, so the head's matmul took a view where the
    # real step copies: the fake trace was 113,912 B under on a PatchTST-like net.
    model = _TransposedBatchNormNet()
    step = TrainStep(inputs=(torch.randn(4, 32, 16),), optimizer="adamw")
    fake = estimate(model, step).module_info.peak_bytes
    real = estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL)).module_info.peak_bytes
    measured = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=2)[1].peak_bytes
    assert fake == real == measured


_BAGS = [(mode, last, pad, psw) for mode in (0, 1, 2) for last in (False, True) for pad in (-1, 5)
         for psw in (False, True) if not (psw and mode)]


@pytest.mark.parametrize("func", [aten._embedding_bag.default, aten._embedding_bag_forward_only.default])
@pytest.mark.parametrize("dtype", [torch.float32, bf16])
@pytest.mark.parametrize("mode, last, pad, psw", _BAGS)
def test_embedding_bag_index_tensors_have_the_real_kernels_storage(func, dtype, mode, last, pad, psw):
    # offset2bag sits on numel + 1 elements off the sum fast path (mean, max, padding_idx) and is
    # empty on it (bf16 too: the meta kernel gave a bf16 sum 96); bag_size with
    # include_last_offset on bags + 1.
    w, ids = torch.randn(64, 32, dtype=dtype), torch.randint(0, 64, (96,))
    offsets = torch.arange(0, 96 + (3 if last else 0), 3)
    weights = torch.rand(96, dtype=dtype) if psw else None
    args = (w, ids, offsets, False, mode, False, weights, last, pad)
    real, fake = func(*args), _fake_run(func, *args)
    assert _layout(fake) == _layout(real)
    assert [t.untyped_storage().nbytes() for t in fake] == [t.untyped_storage().nbytes() for t in real]


class _EmbeddingBagNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(64, 32, mode="mean", include_last_offset=True)
        self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 4)

    def forward(self, ids, offsets):
        return self.fc2(torch.relu(self.fc1(self.emb(ids, offsets))))


def test_an_embedding_bag_net_is_predicted_to_the_byte():
    # 16 B under before (offset2bag and bag_size, 8 B each), the peak being in the backward.
    model = _EmbeddingBagNet()
    step = TrainStep(inputs=(torch.randint(0, 64, (96,)), torch.arange(0, 99, 3)), optimizer="sgd")
    fake = estimate(model, step).module_info.peak_bytes
    measured = measure_steps(model, step, n_steps=2)[1].peak_bytes
    assert fake == measured


@pytest.mark.hf
def test_tiny_mixtral_traces_under_bf16_autocast_to_the_byte():
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16))
    ids = torch.randint(0, 64, (2, 16))
    step = TrainStep(inputs={"input_ids": ids, "labels": ids}, optimizer="adamw", autocast_dtype=bf16)
    # Before: TraceError "Expected inputs of BF16 type" from aten._grouped_mm's meta kernel.
    fake = estimate(model, step).module_info.peak_bytes
    real = estimate(model, step, options=EstimateOptions(mode=TraceMode.REAL)).module_info.peak_bytes
    assert fake == real


@torch.library.custom_op("sac_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_doubled.register_fake
def _(x):
    raise RuntimeError("no fake kernel for this shape")


def test_a_failing_fake_kernel_is_named_with_the_real_kernels_answer():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.ops.sac_test.doubled(self.fc(x))

    with pytest.raises(TraceError) as err:
        estimate(Net(), TrainStep(inputs=(torch.randn(3, 4),)))
    msg = str(err.value)
    assert "sac_test.doubled" in msg and "no fake kernel for this shape" in msg
    assert "float32[3, 4]" in msg  # the argument, and what the real kernel returns
    assert "real CPU kernel runs them and returns float32[3, 4]" in msg
    assert "TraceMode.REAL" in msg
    assert isinstance(err.value.__cause__, FakeKernelError)


def test_a_sparse_result_is_named_and_torchs_meta_traceback_is_not_logged(caplog):
    # EmbeddingBag(sparse=True) with per-sample weights: the meta kernel of its backward fails.
    # torch logged a 20-line traceback before the error, which said the real kernel returns
    # "float32[64, 32]": it returns a sparse gradient.
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = torch.nn.EmbeddingBag(64, 32, mode="sum", sparse=True), torch.nn.Linear(32, 4)

        def forward(self, ids, offsets, weights):
            return self.fc(self.emb(ids, offsets, per_sample_weights=weights))

    inputs = (torch.randint(0, 64, (96,)), torch.arange(0, 96, 3), torch.rand(96))
    with caplog.at_level("ERROR"), pytest.raises(TraceError, match=r"returns float32\[64, 32\] \(sparse_coo\)"):
        estimate(Net(), TrainStep(inputs=inputs, optimizer="sgd"))
    assert not [r for r in caplog.records if "failed while attempting to run meta" in r.getMessage()]


def test_inputs_the_real_kernel_refuses_too_are_named_as_wrong_inputs():
    """A 4-channel image into a 3-channel conv fails in the real kernel as in the fake one: the
    message says to fix the inputs first (it said only "trace in real mode", which fails the
    same way)."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    with pytest.raises(TraceError) as err:
        estimate(net, TrainStep(inputs=(torch.randn(2, 4, 16, 16),)))
    msg = str(err.value)
    assert "real CPU kernel raises too" in msg
    assert "most likely does not run: check the inputs against the model" in msg
    assert msg.index("check the inputs") < msg.index("TraceMode.REAL")


@pytest.mark.parametrize("case", ["float32 batch, bfloat16 model", "token ids into a Linear", "bmm"])
def test_operands_of_different_dtypes_are_refused_as_the_real_kernel_refuses_them(case):
    # The meta kernels of mm / addmm / bmm check shapes only: both steps were planned (17,320 B
    # and 22,328 B) though the real forward raises "mat1 and mat2 must have the same dtype".
    if case == "bmm":
        class _Bmm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(2, 8, 8))

            def forward(self, x):
                return torch.bmm(x, self.w)

        model, x = _Bmm(), torch.randn(2, 4, 8, dtype=torch.float64)
    elif case == "token ids into a Linear":
        model, x = torch.nn.Linear(8, 4), torch.randint(0, 8, (16, 8))
    else:
        model, x = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).bfloat16(), torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        model(x)  # the real step
    with pytest.raises(TraceError, match=r"operands .*the real kernel refuses mixed dtypes"):
        estimate(model, TrainStep(inputs=(x,)))
    if case == "float32 batch, bfloat16 model":  # under autocast the operands agree
        estimate(model, TrainStep(inputs=(x,), autocast_dtype=torch.bfloat16))


def test_ops_only_cuda_autocast_casts_are_not_refused_for_a_cuda_target():
    # torch.mv is on CUDA's autocast list, not CPU's: the fake trace for an h100 (CPU autocast)
    # saw a bf16 vector and an fp32 matrix and refused a step that runs on CUDA.
    class _Mv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w = torch.nn.Linear(16, 16), torch.nn.Parameter(torch.randn(4, 16))

        def forward(self, x):
            return torch.stack([torch.mv(self.w, r) for r in self.lin(x)])

    step = TrainStep(inputs=(torch.randn(3, 16),), autocast_dtype=torch.bfloat16)
    assert estimate(_Mv(), step, device="h100").steady_peak_bytes > 0
    with pytest.raises(TraceError, match="aten.mv.default gets bfloat16 and float32 operands"):
        estimate(_Mv(), step)  # the cpu target: CPU autocast leaves mv alone, as the real step does


class _TinyLM(torch.nn.Module):
    def __init__(self, bag: bool = False):
        super().__init__()
        self.bag = bag
        self.emb = torch.nn.EmbeddingBag(100, 16) if bag else torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100)

    def forward(self, input_ids):
        if self.bag:
            return self.head(self.emb(input_ids))
        return self.head(self.emb(input_ids.view(-1, input_ids.shape[-1])))  # a view, as GPT-2's


@pytest.mark.parametrize("bag", [False, True])
@pytest.mark.parametrize("ids, low, high", [(torch.full((4, 8), 100), 100, 100), (torch.full((4, 8), -1), -1, -1)])
def test_ids_past_the_table_are_refused_in_a_fake_trace(bag, ids, low, high):
    # Rule 10. Before: planned (28,712 B; fake tensors have no values); the real step raises
    # "index out of range".
    ids = ids.clone()
    ids[0, 0] = 3
    with pytest.raises(TraceError, match=rf"the batch's ids run from {min(low, 3)} to {max(high, 3)}, but the "
                                         r"embedding they index has 100 rows \(ids must be in \[0, 100\)\)"):
        estimate(_TinyLM(bag), TrainStep(inputs={"input_ids": ids}))
    estimate(_TinyLM(bag), TrainStep(inputs={"input_ids": torch.randint(0, 100, (4, 8))}))  # in range: traced


def test_labels_left_on_meta_are_named_not_sent_to_real_mode():
    """A meta model (a 72B has no real mode) whose loss closes over meta labels: the fake kernel's
    device mismatch advised a real-mode trace. It says what to make of the labels instead, and
    with CPU labels the step traces."""
    import torch.nn.functional as F

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.empty(8, 16, device="meta")
    labels = torch.empty(8, dtype=torch.long, device="meta")
    with pytest.raises(TraceError) as info:
        estimate(model, TrainStep(inputs=(x,), loss_fn=lambda out, inp: F.cross_entropy(out, labels)))
    msg = str(info.value)
    assert "still on meta, e.g. labels loss_fn closes over; make it a CPU tensor of its shape" in msg
    assert "real mode" not in msg
    cpu_labels = torch.zeros(8, dtype=torch.long)
    estimate(model, TrainStep(inputs=(x,), loss_fn=lambda out, inp: F.cross_entropy(out, cpu_labels)))
