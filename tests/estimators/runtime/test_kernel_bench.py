"""estimators/runtime/kernel_bench.py: benchmark caching, fallback, persistence, one fill path."""

import json
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from estimators.runtime.device import get_device_spec
from estimators.runtime.json_cache import BenchmarkCacheError
from estimators.runtime.kernel_bench import BenchmarkRuntime
from estimators.runtime.roofline import RooflineRuntime

aten = torch.ops.aten


def price(model, func, *args, **kwargs):
    """Run ``func`` like the tracer does, then price it."""
    out = func(*args, **kwargs)
    return model.op_runtime_ms(func, args, kwargs, out)


_counted_calls = {"n": 0}


@torch.library.custom_op("sac_planner_test::counted_mm", mutates_args=())
def _counted_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _counted_calls["n"] += 1
    return a @ b


counted_mm = torch.ops.sac_planner_test.counted_mm.default


@pytest.fixture
def one_thread():
    # The CI box has 2 shared cores: one intra-op thread keeps timings free of thread-pool stalls.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_benchmark_second_identical_call_is_a_cache_hit():
    bench = BenchmarkRuntime(warmup_runs=2, timed_runs=3)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    _counted_calls["n"] = 0
    first = bench.op_runtime_ms(counted_mm, (a, b), {}, None)
    runs = _counted_calls["n"]
    assert runs >= 3 and first > 0
    second = bench.op_runtime_ms(counted_mm, (torch.zeros(16, 16), torch.zeros(16, 16)), {}, None)
    assert second == first
    assert _counted_calls["n"] == runs  # not re-run
    assert (bench.hits, bench.misses, bench.fallbacks) == (1, 1, 0)


def test_benchmark_mm_positive_and_scales_with_size(one_thread):
    bench = BenchmarkRuntime(warmup_runs=2, timed_runs=7)

    def mm_ms(n):
        a, b = torch.randn(n, n), torch.randn(n, n)
        return bench.op_runtime_ms(aten.mm.default, (a, b), {}, None)

    small, large = mm_ms(256), mm_ms(512)  # 8x the FLOPs
    assert small > 0
    assert large > 2 * small  # order of magnitude only: timings on a shared box are noisy


def test_benchmark_works_on_fake_tensors_under_fake_mode():
    bench = BenchmarkRuntime(timed_runs=2)
    with FakeTensorMode():
        a, b = torch.empty(32, 32), torch.empty(32, 16)
        ms = price(bench, aten.mm.default, a, b)
        idx = torch.empty(5, dtype=torch.long)  # materialised as zeros: a valid index
        idx_ms = price(bench, aten.index_select.default, a, 0, idx)
    assert ms > 0 and idx_ms > 0 and bench.fallbacks == 0


def test_benchmark_never_mutates_callers_tensors():
    bench = BenchmarkRuntime(timed_runs=2)
    x = torch.ones(64)
    bench.op_runtime_ms(aten.add_.Scalar, (x, 1.0), {}, x)
    bench.op_runtime_ms(aten.bernoulli_.float, (x, 0.5), {}, x)
    assert torch.equal(x, torch.ones(64))


def test_benchmark_views_cost_zero_without_running():
    bench = BenchmarkRuntime()
    x = torch.ones(4, 4)
    assert price(bench, aten.view.default, x, [16]) == 0.0
    assert (bench.hits, bench.misses) == (0, 0)


def test_benchmark_falls_back_to_roofline_for_ops_that_cannot_run(caplog):
    bench = BenchmarkRuntime()
    # More samples than categories without replacement: multinomial refuses to run.
    with FakeTensorMode():
        probs = torch.empty(8, 16)
        args, out = (probs, 32), torch.empty(8, 32, dtype=torch.long)
        probs2 = torch.empty(4, 16)
    with caplog.at_level(logging.DEBUG, logger="estimators.runtime.kernel_bench"):
        ms = bench.op_runtime_ms(aten.multinomial.default, args, {}, out)
        bench.op_runtime_ms(aten.multinomial.default, (probs2, 32), {}, out)
    expected = RooflineRuntime(get_device_spec("cpu")).op_runtime_ms(aten.multinomial.default, args, {}, out)
    assert ms == expected > 0
    assert bench.fallbacks == 2 and bench.misses == 2
    assert sum("multinomial" in r.getMessage() for r in caplog.records) == 1  # once per func


def test_benchmark_cache_round_trips_through_json(tmp_path):
    path = tmp_path / "bench.json"
    a, b = torch.randn(24, 24), torch.randn(24, 24)
    first = BenchmarkRuntime(cache_path=path, timed_runs=2)
    ms = first.op_runtime_ms(counted_mm, (a, b), {}, None)
    first.save()
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["device"] == first.device_label and len(data["entries"]) == 1

    second = BenchmarkRuntime(cache_path=path)
    _counted_calls["n"] = 0
    assert second.op_runtime_ms(counted_mm, (a, b), {}, None) == ms
    assert _counted_calls["n"] == 0  # answered from the file, not re-run
    assert (second.hits, second.misses) == (1, 0)


def test_benchmark_runtimes_sharing_a_cache_file_merge(tmp_path):
    path = tmp_path / "bench.json"
    one, two = BenchmarkRuntime(cache_path=path, timed_runs=1), BenchmarkRuntime(cache_path=path, timed_runs=1)
    one.op_runtime_ms(aten.add.Tensor, (torch.ones(4), torch.ones(4)), {}, None)
    two.op_runtime_ms(aten.mul.Tensor, (torch.ones(4), torch.ones(4)), {}, None)
    one.save()
    two.save()
    assert len(json.loads(path.read_text())["entries"]) == 2


def test_benchmark_fallbacks_are_not_persisted(tmp_path):
    path = tmp_path / "bench.json"
    bench = BenchmarkRuntime(cache_path=path)
    bench.op_runtime_ms(aten.multinomial.default, (torch.randn(4, 8), 2), {}, None)
    bench.save()
    assert json.loads(path.read_text())["entries"] == {}


def test_benchmark_refuses_a_foreign_or_corrupt_cache(tmp_path):
    path = tmp_path / "bench.json"
    bench = BenchmarkRuntime(cache_path=path)
    bench.op_runtime_ms(aten.add.Tensor, (torch.ones(4), torch.ones(4)), {}, None)
    bench.save()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "device": "cuda:NVIDIA H100 80GB HBM3"}))
    with pytest.raises(BenchmarkCacheError, match="measured on"):
        BenchmarkRuntime(cache_path=path)
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(BenchmarkCacheError, match="version"):
        BenchmarkRuntime(cache_path=path)
    path.write_text("{not json")
    with pytest.raises(BenchmarkCacheError, match="unreadable"):
        BenchmarkRuntime(cache_path=path)


def test_benchmark_rejects_bad_options():
    with pytest.raises(ValueError):
        BenchmarkRuntime(timed_runs=0)
    with pytest.raises(ValueError):
        BenchmarkRuntime(device="meta")
    with pytest.raises(ValueError, match="clock"):
        BenchmarkRuntime(clock="cycles")


def test_synthetic_inputs_are_in_every_op_domain():
    """Fake inputs are drawn in [0.5, 1): sqrt / log / pow make no NaN (a slow path on some
    CPUs, never taken on training data such as AdamW's second moment) and probabilities are
    valid, so multinomial runs standalone instead of falling back to the roofline."""
    from estimators.runtime.op_signatures import synthetic_tensor

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = synthetic_tensor(4096, dtype, torch.device("cpu")).float()
        assert 0.5 <= x.min() and x.max() <= 1  # bf16 rounds the top of [0.5, 1) to 1
    bench = BenchmarkRuntime(timed_runs=1)
    with FakeTensorMode():
        probs = torch.empty(8, 16)
        out = torch.multinomial(probs, 4)
    assert bench.op_runtime_ms(aten.multinomial.default, (probs, 4), {}, out) > 0
    assert bench.fallbacks == 0


def test_thread_clock_times_this_thread_only(one_thread):
    """clock='auto' on one intra-op thread is the calling thread's CPU time: a sleep inside the
    op (time another process could take) is not counted, as the wall clock counts it; the
    clock is part of the cache identity, and 'thread' is refused with several threads."""
    import time as _time

    @torch.library.custom_op("sac_planner_test::sleepy", mutates_args=())
    def sleepy(a: torch.Tensor) -> torch.Tensor:
        _time.sleep(0.02)
        return a.clone()

    op = torch.ops.sac_planner_test.sleepy.default
    x = torch.ones(4)
    thread, wall = BenchmarkRuntime(timed_runs=1, warmup_runs=1), BenchmarkRuntime(timed_runs=1, warmup_runs=1, clock="wall")
    assert thread.clock == "thread" and wall.clock == "wall" and thread.device_label != wall.device_label
    assert thread.op_runtime_ms(op, (x,), {}, None) < 5 < wall.op_runtime_ms(op, (x,), {}, None)
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="set_num_threads"):
        BenchmarkRuntime(clock="thread")
    assert BenchmarkRuntime().clock == "wall"


# ----------------------------------------------------------------------------- factory


def test_recorded_signatures_fill_the_same_layers_as_calls(tmp_path, caplog):
    """benchmark_signature and a call miss share one path: both persist measurements, autosave,
    and log a fallback once per op."""
    from estimators.runtime.op_signatures import SignatureRecorder

    path = tmp_path / "bench.json"
    recorder = SignatureRecorder()
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    recorder.op_runtime_ms(aten.mm.default, (a, b), {}, a @ b)
    recorder.op_runtime_ms(aten.multinomial.default, (torch.rand(4, 8), 16), {}, None)  # 16 > 8: refused
    mm_sig, bad_sig = sorted(recorder.signatures(), key=lambda s: s.func is aten.multinomial.default)
    bench = BenchmarkRuntime(cache_path=path, timed_runs=1, autosave_every=1)
    with caplog.at_level(logging.DEBUG, logger="estimators.runtime.kernel_bench"):
        ms = bench.benchmark_signature(mm_sig)
        fallback_ms = bench.benchmark_signature(bad_sig)
    assert json.loads(path.read_text())["entries"] == {mm_sig.key_repr: ms}  # autosaved
    assert bench.fallbacks == 1 and fallback_ms > 0
    assert sum("multinomial" in r.getMessage() for r in caplog.records) == 1
    _counted_calls["n"] = 0
    assert bench.op_runtime_ms(aten.mm.default, (a, b), {}, a @ b) == ms  # a hit, not re-run
    assert (bench.hits, bench.misses, bench.measurements) == (1, 0, 1)


def test_stream_floor_prices_a_kernel_no_faster_than_its_bytes_at_the_streaming_bandwidth(tmp_path):
    """An add of two 256 KiB float tensors moves 768 KiB (two read, one written): at 1 KiB per ms
    it is priced 768 ms whatever its warm timing; at an unreachable bandwidth, at its timing; a
    view moves nothing and stays 0. The cache file keeps the warm timing, not the floor; without
    ``stream_floor`` (the default) the warm timing is the price."""
    x, y = torch.rand(256, 256), torch.rand(256, 256)
    slow = BenchmarkRuntime(stream_floor=True, stream_bytes_per_ms=1024.0, cache_path=tmp_path / "t.json")
    assert price(slow, torch.ops.aten.add.Tensor, x, y) == pytest.approx(768.0)
    assert all(ms < 100 for ms in slow.export_cache().values())
    assert price(slow, torch.ops.aten.view.default, x, [65536]) == 0.0
    slow.stream_floor = False
    raw = price(slow, torch.ops.aten.add.Tensor, x, y)
    assert 0 < raw < 100 and slow.hits == 1
    fast = BenchmarkRuntime(stream_floor=True, stream_bytes_per_ms=1e15)
    fast.import_cache(slow.export_cache())
    assert price(fast, torch.ops.aten.add.Tensor, x, y) == raw
    plain = BenchmarkRuntime(stream_bytes_per_ms=1024.0)
    plain.import_cache(slow.export_cache())
    assert price(plain, torch.ops.aten.add.Tensor, x, y) == raw


def test_the_streaming_bandwidth_is_measured_once_and_checked():
    """Timed on first use (a copy past the caches: some GB/s on any CPU), then kept; a given
    figure must be a finite number > 0."""
    bench = BenchmarkRuntime()
    first = bench.stream_bytes_per_ms
    assert 1e5 < first < 1e9 and bench.stream_bytes_per_ms == first
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stream_bytes_per_ms"):
            BenchmarkRuntime(stream_bytes_per_ms=bad)


def test_the_streaming_bandwidth_is_timed_on_real_tensors_inside_a_fake_trace():
    """First asked while a trace's FakeTensorMode is active (the first op it prices), the copy
    still runs on real memory: the same order of bandwidth as outside (a fake copy is free, and
    gave 1.3 TB/s here)."""
    outside = BenchmarkRuntime().stream_bytes_per_ms
    bench = BenchmarkRuntime(stream_floor=True)
    with FakeTensorMode():
        x = torch.empty(64, 64)
        price(bench, torch.ops.aten.add.Tensor, x, x)
    assert bench.stream_bytes_per_ms < 5 * outside
