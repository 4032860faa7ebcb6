"""estimators/tracing/cuda_autocast.py against torch's own CUDA autocast kernels, op by op over
torch's autocast test lists (tests/estimators/tracing/autocast_oracle.py, in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal imports it
pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[3]
KERNEL_DIFFERENCES = {"lstm_cell": "CUDA runs the fused _thnn_fused_lstm_cell kernel; the CPU its composite"}
"""Calls whose bytes differ for a reason outside autocast (same dtypes and casts)."""


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def oracle(request):
    out = subprocess.run([sys.executable, "-m", "tests.estimators.tracing.autocast_oracle", request.param],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_policy_casts_as_cuda_autocast_does(oracle):
    compared = 0
    for name, r in oracle.items():
        cuda, policy = r["cuda"], r["policy"]
        if "error" in cuda and not cuda["error"].startswith("RuntimeError: Unexpected floating") and \
                not cuda["error"].startswith("RuntimeError: torch.nn.functional.binary_cross_entropy"):
            continue  # CUDA-only code the oracle cannot run on this build (gru_cell's CUDA check)
        compared += 1
        if "error" in cuda:
            assert "error" in policy, name  # refused on CUDA: refused in the trace
            continue
        assert (policy.get("out"), policy.get("casts")) == (cuda["out"], cuda["casts"]), name
        if name.rsplit(".", 1)[1] not in KERNEL_DIFFERENCES:
            assert policy["bytes"] == cuda["bytes"], name
    assert compared >= 140  # of 149 calls


def test_the_lists_differ_where_the_policy_matters(oracle):
    """The oracle can tell the two policies apart: a CPU-policy trace would fail the test above."""
    differ = sum(1 for r in oracle.values() if "error" not in r["cuda"] and r["cuda"] != r["cpu"])
    assert differ >= 60
