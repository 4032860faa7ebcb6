"""estimators/runtime/models.py: the factory picks and configures the runtime model."""

import pytest
import torch

from estimators.runtime.device import get_device_spec
from estimators.runtime.kernel_bench import BenchmarkRuntime
from estimators.runtime.roofline import RooflineRuntime
from estimators.runtime.models import RuntimeKind, make_runtime_model


def test_make_runtime_model_roofline():
    spec = get_device_spec("h100")
    assert isinstance(make_runtime_model(RuntimeKind.ROOFLINE, spec), RooflineRuntime)
    assert isinstance(make_runtime_model(" Roofline", spec), RooflineRuntime)


def test_make_runtime_model_benchmark_on_cpu():
    model = make_runtime_model("benchmark", get_device_spec("cpu"), timed_runs=2)
    assert isinstance(model, BenchmarkRuntime) and model.fallback.spec.name == "cpu"
    explicit = make_runtime_model("benchmark", get_device_spec("h100"), device="cpu")
    assert explicit.device.type == "cpu" and explicit.fallback.spec.name == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_make_runtime_model_benchmark_for_gpu_without_gpu_says_what_to_do():
    with pytest.raises(ValueError, match="ROOFLINE"):
        make_runtime_model(RuntimeKind.BENCHMARK, get_device_spec("h100"))


def test_make_runtime_model_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="roofline, benchmark"):
        make_runtime_model("analytic", get_device_spec("h100"))


def test_make_runtime_model_roofline_takes_no_options():
    with pytest.raises(TypeError):
        make_runtime_model("roofline", get_device_spec("h100"), cache_path="x.json")
