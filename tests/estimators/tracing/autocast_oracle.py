"""torch's own CUDA autocast, as an oracle for estimators/tracing/cuda_autocast.py.

    python -m tests.estimators.tracing.autocast_oracle bfloat16     # prints JSON

For every op call of torch's autocast test lists (``torch.testing._internal.autocast_test_lists``,
CUDA's and the CPU's), run it three ways on fake tensors and record the output dtypes, the casts
(``_to_copy``: from -> to) and the bytes of every non-view output:

* ``cuda``: fake CUDA tensors under torch's C++ ``AutocastCUDA`` kernels (compiled into the CPU
  build too). No gradients: autograd on a fake CUDA tensor aborts a CPU-only build's process, which
  is why the test runs this in a subprocess.
* ``policy``: fake CPU tensors under CPU autocast with ``CudaAutocast`` (what a trace for h100 does).
* ``cpu``: fake CPU tensors under CPU autocast alone.
"""

from __future__ import annotations

import json
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from estimators.tracing.cuda_autocast import CudaAutocast

_VIEWS = ("view", "t.", "transpose", "expand", "_unsafe_view", "unsqueeze", "squeeze", "permute",
          "slice", "select", "as_strided", "alias", "_reshape_alias", "detach", "prim.", "empty")


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func).replace("aten.", "")
        if name.startswith(_VIEWS):
            return out
        self.bytes += sum(o.numel() * o.element_size() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
        if func is torch.ops.aten._to_copy.default:
            self.casts.append(f"{str(args[0].dtype)[6:]}->{str(out.dtype)[6:]}")
        return out


def _fake(mode, device):
    def convert(x):
        if isinstance(x, torch.Tensor):
            meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return FakeTensor(mode, meta, torch.device(device))
        return x
    return convert


def run(fn, args, kwargs, how: str, low: torch.dtype) -> dict:
    mode = FakeTensorMode()
    args, kwargs = tree_map(_fake(mode, "cuda" if how == "cuda" else "cpu"), (args, kwargs))
    rec = _Record()
    try:
        with mode, torch.no_grad():
            if how == "cuda":
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", low)
                try:
                    with rec:
                        out = fn(*args, **kwargs)
                finally:
                    torch.set_autocast_enabled("cuda", False)
            else:
                with torch.autocast("cpu", dtype=low), (CudaAutocast() if how == "policy" else _Nothing()), rec:
                    out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the error is the answer
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    dtypes = [str(o.dtype)[6:] for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return {"out": dtypes, "casts": rec.casts, "bytes": rec.bytes}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def cases(low: torch.dtype):
    """(name, fn, args, kwargs) for every entry of torch's CUDA and CPU autocast test lists."""
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists, AutocastTestLists

    with torch.no_grad():
        cuda, cpu = AutocastTestLists("cpu"), AutocastCPUTestLists("cpu")
    lists = [(cuda, n, m) for n, m in (
        ("torch_fp16", torch), ("torch_fp32", torch), ("torch_need_autocast_promote", torch),
        ("nn_fp16", torch._C._nn), ("nn_fp32", torch._C._nn), ("linalg_fp16", torch._C._linalg),
        ("methods_fp16", None), ("methods_fp32", None), ("banned", torch._C._nn),
        ("torch_expect_builtin_promote", torch))]
    lists += [(cpu, n, m) for n, m in (("torch_16", torch), ("nn_16", torch._C._nn), ("torch_fp32", torch),
                                       ("nn_fp32", torch._C._nn), ("torch_need_autocast_promote", torch))]
    for owner, list_name, module in lists:
        for i, entry in enumerate(getattr(owner, list_name)):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            if owner is cpu and list_name == "torch_need_autocast_promote":
                args = entry[1] if low == torch.bfloat16 else entry[2]  # (bf16 args, fp16 args)
            if op == "einsum":
                equation, args = args[0], args[1:]
                fn = (lambda eq: lambda *a: torch.einsum(eq, *a))(equation)
            elif module is not None and hasattr(module, op):
                fn = getattr(module, op)
            else:
                fn = (lambda name: lambda x, *a, **k: getattr(x, name)(*a, **k))(op)
            yield f"{'cuda' if owner is cuda else 'cpu'}.{list_name}.{i}.{op}", fn, args, kwargs


def extra_cases(low: torch.dtype):
    """Calls that torch's lists do not hold and whose parts meet the policy (composites left alone
    by CUDA autocast), or that models make often."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(16, 100, generator=g), torch.randint(0, 100, (16,), generator=g)
    image, kernel = torch.randn(2, 3, 16, 16, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    x = torch.randn(16, 64, generator=g)
    yield "extra.cross_entropy_low_logits", F.cross_entropy, (logits.to(low), target), {}
    yield "extra.cross_entropy_fp32_logits", F.cross_entropy, (logits, target), {}
    yield "extra.conv2d_padding_same", F.conv2d, (image, kernel), {"padding": "same"}
    yield "extra.softmax_dtype_float32", F.softmax, (x.to(low), -1), {"dtype": torch.float32}
    yield "extra.gelu_tanh", F.gelu, (x.to(low),), {"approximate": "tanh"}
    yield "extra.layer_norm_fp32_input", F.layer_norm, (x, (64,), torch.ones(64).to(low), torch.zeros(64).to(low)), {}
    yield "extra.stack_mixed", torch.stack, ([x, x.to(low)],), {}


def main(argv=None) -> None:
    low = getattr(torch, (argv or sys.argv[1:])[0])
    results = {name: {how: run(fn, args, kwargs, how, low) for how in ("cuda", "policy", "cpu")}
               for name, fn, args, kwargs in [*cases(low), *extra_cases(low)]}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
