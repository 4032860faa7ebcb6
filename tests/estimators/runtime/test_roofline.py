"""estimators/runtime/roofline.py: exact roofline numbers computed by hand."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from estimators.runtime.device import get_device_spec
from estimators.runtime.roofline import RooflineRuntime, op_flops
from estimators.runtime.models import RuntimeModel

aten = torch.ops.aten
H100_LAUNCH_MS = 0.004


@pytest.fixture
def h100():
    return RooflineRuntime(get_device_spec("h100"))


def price(model, func, *args, **kwargs):
    """Run ``func`` like the tracer does, then price it."""
    out = func(*args, **kwargs)
    return model.op_runtime_ms(func, args, kwargs, out)


class _Recorder(TorchDispatchMode):
    """Records (func, args, kwargs, out) of every aten op, like the step tracer."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out



def test_mm_compute_bound_h100_bf16(h100):
    m = k = n = 4096
    with FakeTensorMode():
        a = torch.empty(m, k, dtype=torch.bfloat16)
        b = torch.empty(k, n, dtype=torch.bfloat16)
        ms = price(h100, aten.mm.default, a, b)
    # 2*M*N*K = 137,438,953,472 FLOPs at 989.4e12 * 0.75 = 742.05e12 FLOP/s -> 0.185215219287 ms.
    # Memory: 3 * 4096^2 * 2 B = 100,663,296 B at 3350e9 * 0.85 B/s -> 0.0354 ms: compute-bound.
    assert ms == pytest.approx(0.18521521928711 + H100_LAUNCH_MS, rel=1e-9)


def test_mm_dtype_is_first_floating_input(h100):
    with FakeTensorMode():
        a, b = torch.empty(4096, 4096), torch.empty(4096, 4096)  # float32: 66.9 TFLOP/s peak
        ms = price(h100, aten.mm.default, a, b)
    assert ms == pytest.approx(2 * 4096**3 / (66.9e12 * 0.75) * 1e3 + H100_LAUNCH_MS, rel=1e-9)


def test_add_memory_bound(h100):
    x, y = torch.ones(10**6), torch.ones(10**6)
    ms = price(h100, aten.add.Tensor, x, y)
    # 2 reads + 1 write of 1e6 float32 = 12e6 B at 3350e9 * 0.85 B/s.
    assert ms == pytest.approx(3 * 4e6 / (3350e9 * 0.85) * 1e3 + H100_LAUNCH_MS, rel=1e-12)


def test_broadcast_input_is_read_once(h100):
    x = torch.ones(1000, 1000)
    bias = torch.ones(1000).expand(1000, 1000)  # stride-0 rows: 4e3 bytes, not 4e6
    ms = price(h100, aten.add.Tensor, x, bias)
    assert ms == pytest.approx((4e6 + 4e3 + 4e6) / (3350e9 * 0.85) * 1e3 + H100_LAUNCH_MS, rel=1e-12)


def test_inplace_foreach_counts_mutated_args_as_written(h100):
    xs = [torch.ones(1000), torch.ones(3000)]
    ms = price(h100, aten._foreach_add_.Scalar, xs, 1.0)  # returns nothing
    assert ms == pytest.approx(2 * 4 * 4000 / (3350e9 * 0.85) * 1e3 + H100_LAUNCH_MS, rel=1e-12)


def test_copy_does_not_read_its_destination(h100):
    dst, src = torch.empty(10**6), torch.ones(10**6)
    ms = price(h100, aten.copy_.default, dst, src)
    assert ms == pytest.approx(2 * 4e6 / (3350e9 * 0.85) * 1e3 + H100_LAUNCH_MS, rel=1e-12)


def test_out_variant_buffer_is_written_not_read(h100):
    x, y, out = torch.ones(10**6), torch.ones(10**6), torch.empty(10**6)
    ms = price(h100, aten.add.out, x, y, out=out)
    assert ms == pytest.approx(3 * 4e6 / (3350e9 * 0.85) * 1e3 + H100_LAUNCH_MS, rel=1e-12)


@pytest.mark.parametrize(
    "func, args",
    [
        (aten.view.default, ([8, 8],)),
        (aten._unsafe_view.default, ([8, 8],)),
        (aten.t.default, ()),
        (aten.transpose.int, (0, 1)),
        (aten.permute.default, ([1, 0],)),
        (aten.expand.default, ([3, 4, 16],)),
        (aten.unsqueeze.default, (0,)),
        (aten.squeeze.dim, (0,)),
        (aten.slice.Tensor, (0, 0, 2)),
        (aten.select.int, (0, 1)),
        (aten.split.Tensor, (2,)),
        (aten.unbind.int, (0,)),
        (aten.alias.default, ()),
        (aten.detach.default, ()),
        (aten.as_strided.default, ([2, 2], [1, 1])),
        (aten.t_.default, ()),  # in-place view: metadata only
        (aten.empty_like.default, ()),  # allocation only
        (aten.is_same_size.default, "same"),
    ],
    ids=lambda v: str(v) if not isinstance(v, tuple) else "",
)
def test_views_and_metadata_cost_zero(h100, func, args):
    x = torch.ones(4, 16)
    args = (x,) if args == "same" else args
    assert price(h100, func, x, *args) == 0.0


def test_prim_device_costs_zero(h100):
    x = torch.ones(4)
    assert h100.op_runtime_ms(torch.ops.prim.device.default, (x,), {}, x.device) == 0.0


def test_zero_sized_output_costs_zero(h100):
    x = torch.ones(0, 16)
    assert price(h100, aten.add.Tensor, x, x) == 0.0
    assert price(h100, aten.mm.default, torch.ones(0, 8), torch.ones(8, 4)) == 0.0


def _some_ops():
    q = torch.randn(2, 4, 64, 32)
    return [
        (aten.mm.default, (torch.randn(64, 128), torch.randn(128, 32))),
        (aten.add.Tensor, (torch.randn(64, 128), torch.randn(128))),
        (aten.native_layer_norm.default, (torch.randn(8, 64), [64], torch.ones(64), torch.zeros(64), 1e-5)),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q)),
        (aten.gelu.default, (torch.randn(8, 64),)),
    ]


@pytest.mark.parametrize("index", range(len(_some_ops())))
def test_fake_and_real_tensors_price_the_same(index):
    func, real_args = _some_ops()[index]
    real = RooflineRuntime(get_device_spec("a100-80gb"))
    fake = RooflineRuntime(get_device_spec("a100-80gb"))
    expected = price(real, func, *real_args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real_args]
        got = price(fake, func, *fake_args)
    assert expected > 0 and got == expected


def test_sdpa_cpu_ops_get_torchs_sdpa_flop_count():
    b, h, s, d = 2, 4, 128, 64
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with _Recorder() as rec:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    by_name = {str(f): (f, a, kw, o) for f, a, kw, o in rec.ops}
    fwd = by_name["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    bwd = by_name["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    # Forward: QK^T and PV, 2 bmm of 2*b*h*s*s*d each; is_causal halves nothing (torch's convention).
    assert op_flops(*fwd) == 4 * b * h * s * s * d == 33_554_432
    # Backward: recomputed QK^T plus 4 gradient bmm = 5 bmm.
    assert op_flops(*bwd) == 10 * b * h * s * s * d == 83_886_080


def test_sdpa_cpu_op_is_priced_by_its_flops(h100):
    b, h, s, d = 8, 16, 4096, 128
    with FakeTensorMode():
        q = torch.empty(b, h, s, d, dtype=torch.bfloat16)
        ms = price(h100, aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, 0.0, True)
    flops = 4 * b * h * s * s * d
    assert ms == pytest.approx(flops / (989.4e12 * 0.75) * 1e3 + H100_LAUNCH_MS, rel=1e-9)


def test_op_flops_zero_without_formula():
    x = torch.ones(4)
    assert op_flops(aten.add.Tensor, (x, x), {}, x + x) == 0


def test_roofline_caches_by_signature(h100, monkeypatch):
    from estimators.runtime import roofline

    monkeypatch.setattr(roofline, "_PRICES", {})  # not what earlier tests priced
    h100 = RooflineRuntime(get_device_spec("h100"))
    calls = []
    original = RooflineRuntime.price

    def counting(self, *a, **kw):
        calls.append(a[0])
        return original(self, *a, **kw)

    monkeypatch.setattr(RooflineRuntime, "price", counting)
    first = price(h100, aten.mm.default, torch.ones(8, 4), torch.ones(4, 2))
    second = price(h100, aten.mm.default, torch.zeros(8, 4), torch.zeros(4, 2))  # same signature
    third = price(h100, aten.mm.default, torch.ones(8, 4), torch.ones(4, 3))  # new shape
    assert first == second and third != first
    assert len(calls) == 2


def test_runtimes_with_the_same_pricing_figures_share_their_prices(monkeypatch):
    """Each trace makes its own runtime; a price depends on the op's key and the spec's pricing
    figures alone, so runtimes of specs with the same figures share one cache, others do not."""
    from estimators.runtime import roofline

    monkeypatch.setattr(roofline, "_PRICES", {})
    calls = []
    original = RooflineRuntime.price
    monkeypatch.setattr(RooflineRuntime, "price", lambda self, *a, **kw: calls.append(a[0]) or original(self, *a, **kw))
    spec = get_device_spec("h100")
    args = (torch.ones(8, 4), torch.ones(4, 2))
    first = price(RooflineRuntime(spec), aten.mm.default, *args)
    again = price(RooflineRuntime(spec.replace(name="renamed", checkpoint_call_ms=1.0)), aten.mm.default, *args)
    assert first == again and len(calls) == 1
    slower = spec.replace(memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s / 100)
    assert price(RooflineRuntime(slower), aten.mm.default, *args) > first and len(calls) == 2
    fewer = spec.replace(peak_flops_per_s={k: v / 1e6 for k, v in spec.peak_flops_per_s.items()})
    assert price(RooflineRuntime(fewer), aten.mm.default, *args) > first and len(calls) == 3


def test_symbolic_shapes_are_priced_by_their_hints(h100):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        a = mode.from_tensor(torch.empty(64, 32), static_shapes=False)
        b = mode.from_tensor(torch.empty(32, 16))
        symbolic = price(h100, aten.mm.default, a, b)
    assert symbolic == price(RooflineRuntime(get_device_spec("h100")), aten.mm.default, torch.ones(64, 32), torch.ones(32, 16))


def test_roofline_is_a_runtime_model(h100):
    assert isinstance(h100, RuntimeModel)
    assert h100.name == "roofline:h100"


def test_the_roofline_says_which_spec_and_efficiencies_it_prices_with(caplog):
    """Once per spec, at INFO: the spec's one-line summary (name, peaks, efficiencies, launch
    time, checkpoint host costs), so a calibrated spec's figures are on record where it is used."""
    import logging

    spec = get_device_spec("cpu").replace(name="cpu-announced-test", compute_efficiency=0.31,
                                          bandwidth_efficiency=0.62)
    with caplog.at_level(logging.INFO, logger="estimators.runtime.roofline"):
        RooflineRuntime(spec)
        RooflineRuntime(spec)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("roofline on")]
    assert said == [f"roofline on {spec.summary()}"]
    assert "cpu-announced-test" in said[0] and "x 0.31 eff" in said[0] and "x 0.62 eff" in said[0]
