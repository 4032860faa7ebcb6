"""The published configurations the search places: torchtitan's recipes as its registry states them,
the Llama 3 paper's 405B layout scaled to the cluster asked."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from examples.llama import LlamaConfig
from planner.search.layouts import Cluster
from planner.search.published import TORCHTITAN_RECIPES, published_layouts


def _registry_source() -> str:
    spec = importlib.util.find_spec("torchtitan")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("torchtitan is not installed")
    return (Path(spec.origin).parent / "models" / "llama3" / "config_registry.py").read_text()


def _keywords(fn: ast.FunctionDef) -> dict[str, object]:
    out = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.keyword) and node.arg and isinstance(node.value, ast.Constant):
            out.setdefault(node.arg, node.value.value)
        if isinstance(node, ast.keyword) and node.arg == "activation_checkpoint":
            out["activation_checkpoint"] = ast.unparse(node.value)
    return out


@pytest.mark.parametrize("shape", sorted(TORCHTITAN_RECIPES))
def test_the_recipes_are_torchtitans(shape):
    name, tp, local, seq, ac, _ = TORCHTITAN_RECIPES[shape]
    tree = ast.parse(_registry_source())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    kw = _keywords(fn)
    assert kw.get("tensor_parallel_degree", 1) == tp
    assert (kw["local_batch_size"], kw["seq_len"]) == (local, seq)
    assert kw["activation_checkpoint"] == f"{ac}.Config()"
    assert "pipeline_parallel_degree" not in kw and "context_parallel_degree" not in kw


class _Family:
    def __init__(self, vocab_size=128_256, **shape) -> None:
        self.config = LlamaConfig(vocab_size=vocab_size, seq_len=8192, n_heads=128, n_kv_heads=8, ffn_dim=53_248,
                                  **shape)


def test_published_layouts_are_scaled_to_the_cluster():
    fam = _Family(n_layers=126, dim=16_384)
    tt, paper = published_layouts(fam, Cluster.parse("1024xh100"), global_batch=1024, seq_len=8192)
    assert tt.layout.describe() == "TP 8 x FSDP 128, mb 2 x 4" and tt.full_ac
    assert paper.layout.describe() == "PP 16 Interleaved1F1B x TP 8 x FSDP 8, mb 1 x 128"
    small = published_layouts(fam, Cluster.parse("64xh100"), global_batch=512, seq_len=8192)
    assert small[1].layout is None and "128 GPUs" in small[1].note
    assert published_layouts(_Family(n_layers=7, dim=16_384), Cluster.parse("64xh100"), global_batch=64,
                             seq_len=8192) == []
    # Mistral-7B's depth and width are Llama 3 8B's; its vocabulary is not: no recipe claimed
    assert published_layouts(_Family(n_layers=32, dim=4096, vocab_size=32_000), Cluster.parse("8xh100"),
                             global_batch=64, seq_len=4096) == []
