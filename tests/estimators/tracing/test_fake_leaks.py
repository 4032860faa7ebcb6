"""estimators/tracing/fake_leaks.py: what a fake trace leaves in the user's process is cleared or named."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import estimators.tracing.fake_leaks as fake_leaks
from estimators.tracing.estimation import estimate
from estimators.step.train_step import TrainStep
from estimators.tracing.fake_leaks import FakeTensorLeakWarning

pytestmark = pytest.mark.usefixtures("whole_heap")  # the leak search scans the heap (tests/conftest.py)


@functools.lru_cache(maxsize=4)
def _positions(n: int) -> torch.Tensor:
    return torch.arange(n).flip(0)


@functools.cache
def _positions_and_count(n: int) -> tuple[torch.Tensor, int]:
    return torch.arange(n).flip(0), n


_DICT_CACHE: dict[int, torch.Tensor] = {}


class _Cached(torch.nn.Module):
    """Memoises an index tensor across calls, as BEiT's relative position index does."""

    def __init__(self, cache: str) -> None:
        super().__init__()
        self.cache = cache
        self.lin = torch.nn.Linear(16, 16)
        self.bias = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x):
        if self.cache == "lru":
            index = _positions(16)
        elif self.cache == "cache_tuple":
            index = _positions_and_count(16)[0]
        else:
            index = _DICT_CACHE.setdefault(16, torch.arange(16).flip(0))
        return self.lin(x) + self.bias[index]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["lru", "cache_tuple"])
def test_an_lru_cache_the_trace_filled_is_cleared_and_real_training_stays_real(cache):
    # BEiT / Data2VecVision / DINOv3: after planning, real training got the cached FakeTensor
    # back, and its loss and gradients were fake (loss.item() raised). functools.cache keeps
    # its results in a dict, here inside a tuple: found through them.
    _positions.cache_clear()
    _positions_and_count.cache_clear()
    model = _Cached(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FakeTensorLeakWarning)
        estimate(model, TrainStep(inputs=(torch.randn(4, 16),), optimizer="adamw"))
    assert _positions.cache_info().currsize == 0 and _positions_and_count.cache_info().currsize == 0
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    assert type(loss) is torch.Tensor and type(model.bias.grad) is torch.Tensor
    assert loss.item() == loss.item()  # a real value


@pytest.mark.slow
def test_a_holder_the_planner_cannot_clear_is_named():
    _DICT_CACHE.clear()
    with pytest.warns(FakeTensorLeakWarning, match=r"left 1 fake tensor\(s\) .*held by a global of "
                                                   r"tests\.estimators\.test_fake_leaks|held by a dict"):
        estimate(_Cached("dict"), TrainStep(inputs=(torch.randn(4, 16),)))
    assert isinstance(_DICT_CACHE.pop(16), FakeTensor)


def test_a_trace_that_leaves_nothing_costs_no_scan(monkeypatch):
    scans = []
    monkeypatch.setattr(fake_leaks, "_clear", lambda mode, report: scans.append(mode))
    estimate(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), TrainStep(inputs=(torch.randn(2, 8),), optimizer="adamw"))
    assert scans == []


class _RaisesMidForward(torch.nn.Module):
    """Many fake tensors alive when the forward raises (a T5 without decoder_start_token_id)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(40))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        raise AttributeError("config has no attribute 'decoder_start_token_id'")


@pytest.mark.slow
def test_a_trace_that_raises_scans_the_heap_once_a_level_not_once_a_tensor(monkeypatch):
    # The traceback keeps the whole fake trace alive; one gc.get_referrers call per fake tensor
    # (each a scan of the heap) took 4 minutes on a T5-large before the error reached the user.
    import gc

    calls = []
    real = gc.get_referrers
    monkeypatch.setattr(fake_leaks.gc, "get_referrers", lambda *objs: calls.append(len(objs)) or real(*objs))
    _positions.cache_clear()
    _positions(16)  # a real entry, left alone
    with pytest.raises(Exception, match="decoder_start_token_id"):
        estimate(_RaisesMidForward(), TrainStep(inputs=(torch.randn(2, 8),), optimizer="adamw"))
    assert calls and max(calls) >= 40  # a tensor of each of the 40 layers, at least, in one call
    assert len(calls) <= fake_leaks._CACHE_SEARCH_DEPTH
    assert _positions.cache_info().currsize == 1


_HOOKED = '''
import warnings, torch
from estimators.tracing.estimation import estimate
from estimators.step.train_step import TrainStep
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 1)
        self.kept = []
        self.b.register_forward_hook(lambda m, i, o: self.kept.append(o.detach().mean()))
    def forward(self, x):
        self.kept.clear()
        return self.c(torch.relu(self.b(self.a(x))))
warnings.simplefilter("ignore")
torch.manual_seed(0)
m = M()
for _ in range(5):
    estimate(m, TrainStep(inputs=(torch.randn(4, 64, 16),), optimizer="adamw"))
print("ok", len(m.kept))
'''


@pytest.mark.multiproc
def test_a_model_a_trace_left_fake_tensors_in_is_traced_again_without_copying_them():
    """A forward hook (a closure over the real model) appends its output to a list on the
    model: each trace leaves a fake tensor there (named in a warning). The next trace's copy of
    the model deep-copied it, and the third trace died in a segfault; the tensors left behind
    are now shared with the copy, not copied. In a child process: a crash must fail this test,
    not end the run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _HOOKED], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "ok"  # the 5 fake tensors stay on the model (warned)
