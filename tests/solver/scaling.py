"""The made-up models of benchmarks/solver_scaling.py (random module trees, synthetic decoders),
which the solver's tests share with the benchmark."""

from __future__ import annotations

import importlib
import string
import sys
from pathlib import Path

from estimators.contract.module_info import ModuleInfo

__all__ = ["scaling", "decoder_info", "random_tree_info"]


def scaling():
    """The benchmark module (benchmarks/ is not a package)."""
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("solver_scaling")


def decoder_info(n_blocks: int, *, numbered: bool = True) -> ModuleInfo:
    """A synthetic decoder of ``n_blocks`` blocks; ``numbered=False`` names them ``block_a``,
    ``block_b``, ... (the same blocks, equal curves, no numeric path components)."""
    sc = scaling()
    root = sc.decoder_modules(n_blocks)
    if not numbered:
        letters = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
        for m in sc.walk_modules(root):
            for i in range(n_blocks):
                m.fqn = m.fqn.replace(f"blocks.{i}.", f"block_{letters[i]}.")
                if m.fqn.endswith(f"blocks.{i}"):
                    m.fqn = m.fqn[: -len(f"blocks.{i}")] + f"block_{letters[i]}"
    return sc.module_info_of(root)


def random_tree_info(n_modules: int, seed: int = 0) -> ModuleInfo:
    """A random module tree of ``n_modules`` (no repeated blocks)."""
    sc = scaling()
    return sc.module_info_of(sc.random_module_tree(n_modules, seed=seed))
