"""Target devices: the numbers a roofline needs and the memory semantics of the device kind.

A DeviceSpec lets a CPU-only machine plan for a GPU: runtimes come from peak FLOP/s and memory
bandwidth, memory accounting follows the device's allocator (``allocator_block_bytes``).
Peak numbers are the vendors' dense (no sparsity) datasheet figures.

An :class:`Interconnect` is one kind of link collectives run over (NVLink, InfiniBand, PCIe); a
DeviceSpec names its default link in ``interconnect``, read through
:attr:`DeviceSpec.collective_link` (``estimators.runtime.collectives`` prices all-gather,
reduce-scatter, all-reduce and broadcast on it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

__all__ = [
    "DeviceSpec",
    "DEVICE_SPECS",
    "get_device_spec",
    "UnknownDeviceError",
    "Interconnect",
    "INTERCONNECTS",
    "get_interconnect",
    "UnknownInterconnectError",
]

_TF = 1e12
_GB = 1e9
_GiB = 2**30


class UnknownDeviceError(ValueError):
    """A device name that has no DeviceSpec."""


class UnknownInterconnectError(ValueError):
    """A link name that has no Interconnect."""


@dataclass(frozen=True, kw_only=True)
class Interconnect:
    """One kind of link collectives run over, as the analytic collective model sees it.

    A collective on it costs ``latency_s + factor * bytes / bandwidth_bytes_per_s`` (the factor is
    the ring algorithm's, see ``estimators.runtime.collectives``). Bandwidths are datasheet figures: NCCL
    reaches roughly 70-90 % of them; fit a model to benchmark points for measured numbers.

    Example::

        link = get_interconnect("nvlink4")
        link.bandwidth_bytes_per_s   # 450e9: per GPU, one direction
    """

    name: str
    """Registry key, e.g. ``"nvlink4"``."""
    bandwidth_bytes_per_s: float
    """Per-rank bandwidth in one direction (what a ring step moves per second)."""
    latency_s: float
    """Fixed cost of one collective on this link (launch + handshakes), seconds."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Interconnect.name must be a non-empty string")
        if not self.bandwidth_bytes_per_s > 0:  # also rejects NaN
            raise ValueError(
                f"Interconnect.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}"
            )
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(
                f"Interconnect.latency_s must be finite and >= 0, got {self.latency_s}"
            )


# Latencies are the order of a small-message NCCL ring collective on that link (a few us within a
# node, more across a network), not a measurement: fit a model where the number matters.
INTERCONNECTS: dict[str, Interconnect] = {
    link.name: link
    for link in (
        Interconnect(name="nvlink3", bandwidth_bytes_per_s=300 * _GB, latency_s=10e-6),  # A100
        Interconnect(name="nvlink4", bandwidth_bytes_per_s=450 * _GB, latency_s=10e-6),  # H100/H200
        Interconnect(name="nvlink5", bandwidth_bytes_per_s=900 * _GB, latency_s=10e-6),  # B200
        Interconnect(name="pcie4", bandwidth_bytes_per_s=32 * _GB, latency_s=15e-6),  # x16
        Interconnect(name="pcie5", bandwidth_bytes_per_s=64 * _GB, latency_s=15e-6),  # x16
        Interconnect(name="infiniband-hdr", bandwidth_bytes_per_s=25 * _GB, latency_s=25e-6),
        Interconnect(name="infiniband-ndr", bandwidth_bytes_per_s=50 * _GB, latency_s=25e-6),
    )
}
_LINK_ALIASES = {
    "nvlink": "nvlink4",
    "infiniband": "infiniband-ndr",
    "ib": "infiniband-ndr",
    "pcie": "pcie5",
}


def get_interconnect(link: str | Interconnect) -> Interconnect:
    """Look up an Interconnect by name (case-insensitive) or pass one through.

    >>> get_interconnect("NVLink4").bandwidth_bytes_per_s
    450000000000.0
    """
    if isinstance(link, Interconnect):
        return link
    key = str(link).strip().lower()
    key = _LINK_ALIASES.get(key, key)
    if key not in INTERCONNECTS:
        raise UnknownInterconnectError(
            f"unknown interconnect {link!r}; known links: {', '.join(sorted(INTERCONNECTS))}. "
            "For another link pass "
            "Interconnect(name=..., bandwidth_bytes_per_s=..., latency_s=...)."
        )
    return INTERCONNECTS[key]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """Peak throughput and memory semantics of one accelerator (or the host CPU)."""

    name: str
    """Registry key, e.g. ``"h100"``."""
    kind: str
    """``"cuda"`` or ``"cpu"``: decides the memory semantics applied to a CPU trace."""
    peak_flops_per_s: Mapping[torch.dtype, float]
    """Dense matrix-multiply peak per dtype; dtypes not listed fall back to float32."""
    memory_bandwidth_bytes_per_s: float
    """Main-memory (HBM / DRAM) bandwidth."""
    memory_bytes: int
    """Device memory capacity."""
    allocator_block_bytes: int = 1
    """Allocations are rounded up to a multiple of this (CUDA caching allocator: 512)."""
    compute_efficiency: float = 0.75
    """Fraction of peak FLOP/s a well-shaped kernel reaches (roofline derating)."""
    bandwidth_efficiency: float = 0.85
    """Fraction of peak bandwidth a memory-bound kernel reaches."""
    kernel_launch_ms: float = 0.0
    """Fixed per-kernel overhead added to every non-view op."""
    interconnect_bytes_per_s: float = 0.0
    """Per-GPU collective bandwidth (NVLink etc.); 0 when not modelled. When > 0 it is the
    bandwidth of :attr:`collective_link`, overriding ``interconnect``'s own."""
    interconnect: Interconnect | None = None
    """Default link between devices of this kind (within a node): its name and latency, and its
    bandwidth where ``interconnect_bytes_per_s`` is 0. ``None``: no link named."""
    extra: Mapping[str, float] = field(default_factory=dict)
    host_link_bytes_per_s: float = 0.0
    """Device <-> host memory bandwidth, one direction (the link activation offload copies
    cross), datasheet figure; 0: no host link modelled (offload is not planned). SXM H100 / H200
    / B200 hosts: PCIe 5.0 x16, 32 GT/s x 16 lanes x 128/130 = 63 GB/s per direction (PCI-SIG
    PCIe 5.0 base specification; NVIDIA H100 datasheet "PCIe Gen5 128 GB/s" bidirectional);
    A100 and L4 hosts: PCIe 4.0 x16, half that (31.5 GB/s).
    GH200: NVLink-C2C, 900 GB/s bidirectional = 450 GB/s per direction (NVIDIA GH200 datasheet).
    CPU target: the "host" is other DRAM of the same socket, so a copy is a memcpy, which reads
    and writes: half of ``memory_bandwidth_bytes_per_s``."""
    host_link_efficiency: float = 0.8
    """Fraction of ``host_link_bytes_per_s`` a pinned-memory ``cudaMemcpyAsync`` reaches: about
    50-55 GB/s of the 63 GB/s on PCIe 5.0 x16 (NVIDIA's bandwidthTest on H100 SXM hosts)."""

    host_copy_latency_s: float = 5e-6
    """Fixed time of one offload copy on the copy stream, beside its bytes / bandwidth: what
    makes many small copies cost more than one large one, so the planner prices tiny tensors
    out instead of excluding them by a size rule. CUDA hosts: about 5 us -- the
    ``cudaMemcpyAsync`` call and its DMA setup (2-3 us on the launching thread, as a kernel
    launch: ``kernel_launch_ms``) plus the PCIe round trip (about 1-2 us for a small pinned
    transfer; NVIDIA's bandwidthTest / nvbandwidth latency figures on PCIe 4/5 hosts). An
    approximate, not a measured, figure for any one machine. CPU target: the planner's CPU host
    store per storage (numpy allocation and a memcpy call, wrapped in the pack hook), measured
    on this project's machine at 5.7-6.1 us for 256 B to 32 KiB storages (a bare numpy
    ``empty`` + ``copyto`` of 256 B: 0.55 us)."""

    checkpoint_call_ms: float = 0.0
    """Host time one call of a checkpointed module adds beside the ops it re-runs: the
    checkpoint's forward wrapper (saved-tensor hooks, RNG state) and its recompute's setup in
    backward. Paid by every checkpoint, full or selective."""
    checkpoint_submodule_ms: float = 0.0
    """Host time one call of a checkpointed module adds per module nested in it (its submodules
    that ran, at any depth), beside ``checkpoint_call_ms``: the wrapper walks the module's tree on
    every call (its buffers, batch norms, generators held as attributes, parameter dtypes), so
    a checkpoint of a whole block costs more per call than one of a leaf-like module."""
    recompute_op_ms: float = 0.0
    """Host time per op a recompute re-runs, beside the op's kernel time: autograd records the
    op again and the checkpoint's hooks hand its saved tensors over. Counted per re-run op,
    views included (they launch no kernel but are dispatched and recorded). With the host's
    caches evicted (cold); see ``recompute_op_warm_ms``."""
    recompute_op_warm_ms: float | None = None
    """The same with the host's caches warm: after an op that moved no data (a view). A re-run
    op's host cost is between the two by the bytes the op before it in the module's forward
    read and wrote, over ``host_cache_bytes`` (``recompute_op_host_ms``): a step's kernels that
    stream megabytes evict the host's working set, small ones leave it. None: always
    ``recompute_op_ms``."""
    host_cache_bytes: int = 0
    """Bytes a kernel reads and writes from which the next op's host work runs fully cold (0:
    every re-run op at ``recompute_op_ms``)."""
    selective_op_ms: float = 0.0
    """Host time a selective policy adds per op it sees: each forward op of the module and each
    op its recompute replays up to the last saved one, cached or re-run. A plain (full)
    checkpoint runs no policy and does not pay it."""
    selective_call_ms: float = 0.0
    """Host time a selective checkpoint adds per call beside ``checkpoint_call_ms`` and its
    policy's ops: its recording and replay modes entered and left, its op log and cache made
    and walked. A small selective module pays it as a large one does.

    The five host costs add to the step on a CPU, where the host runs the kernels. On a GPU
    the host runs ahead of the device's queue and they are hidden where kernels are longer, so
    the CUDA specs leave them at 0 (not modelled). They are the host's, not the chip's: every
    built-in spec has 0 (not priced); ``planner.analysis.calibration.calibrate_device`` measures
    them on the machine at hand (this project's CPU: docs/accuracy.md#runtimes), cold, as a step
    runs them: its kernels stream megabytes between two ops and evict the host's caches (a
    layer norm or linear call cost 36-63 us so on this CPU, 8-13 us hot), and the benchmark
    runtime times each op hot, so what a re-run op costs beyond that is in ``recompute_op_ms``."""

    def recompute_op_host_ms(self, moved_before: int | None) -> float:
        """Host time of re-running an op after one that read and wrote ``moved_before`` bytes
        (None: unknown, the module's first op: cold): ``recompute_op_warm_ms`` plus the cold
        cost's excess in proportion to ``moved_before / host_cache_bytes``, at most all of it.

        >>> s = get_device_spec("cpu").replace(recompute_op_ms=0.06, recompute_op_warm_ms=0.01, host_cache_bytes=8)
        >>> [round(s.recompute_op_host_ms(b), 3) for b in (0, 2, 8, 80, None)]
        [0.01, 0.022, 0.06, 0.06, 0.06]
        """
        warm, cold = self.recompute_op_warm_ms, self.recompute_op_ms
        if warm is None or self.host_cache_bytes <= 0 or moved_before is None:
            return cold
        return warm + (cold - warm) * min(1.0, moved_before / self.host_cache_bytes)

    @property
    def host_copy_bytes_per_s(self) -> float:
        """Bytes per second an offload copy moves in one direction (0: no host link)."""
        return self.host_link_bytes_per_s * self.host_link_efficiency

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceSpec.name must be a non-empty string")
        if not (math.isfinite(self.host_link_bytes_per_s) and self.host_link_bytes_per_s >= 0):
            raise ValueError(
                f"DeviceSpec.host_link_bytes_per_s must be finite and >= 0, got {self.host_link_bytes_per_s}"
            )
        if not (math.isfinite(self.host_copy_latency_s) and self.host_copy_latency_s >= 0):
            raise ValueError(
                f"DeviceSpec.host_copy_latency_s must be finite and >= 0, got {self.host_copy_latency_s}"
            )
        if not 0 < self.host_link_efficiency <= 1:
            raise ValueError(
                f"DeviceSpec.host_link_efficiency must be in (0, 1], got {self.host_link_efficiency}"
            )
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"DeviceSpec.kind must be 'cuda' or 'cpu', got {self.kind!r}")
        self._check_peaks()
        if self.memory_bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"DeviceSpec.memory_bandwidth_bytes_per_s must be > 0, "
                f"got {self.memory_bandwidth_bytes_per_s}"
            )
        if self.memory_bytes <= 0:
            raise ValueError(f"DeviceSpec.memory_bytes must be > 0, got {self.memory_bytes}")
        if not (0 < self.compute_efficiency <= 1 and 0 < self.bandwidth_efficiency <= 1):
            raise ValueError("DeviceSpec efficiencies must be in (0, 1]")
        if self.allocator_block_bytes < 1:
            raise ValueError("DeviceSpec.allocator_block_bytes must be >= 1")
        for name in ("checkpoint_call_ms", "checkpoint_submodule_ms", "recompute_op_ms", "selective_op_ms",
                     "selective_call_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"DeviceSpec.{name} must be finite and >= 0, got {v}")
        w = self.recompute_op_warm_ms
        if w is not None and not (math.isfinite(w) and 0 <= w):
            raise ValueError(f"DeviceSpec.recompute_op_warm_ms must be None or finite and >= 0, got {w}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"DeviceSpec.host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.kernel_launch_ms < 0 or self.interconnect_bytes_per_s < 0:
            raise ValueError("DeviceSpec.kernel_launch_ms and interconnect_bytes_per_s must be >= 0")
        if self.interconnect is not None and not isinstance(self.interconnect, Interconnect):
            raise ValueError(
                f"DeviceSpec.interconnect must be an Interconnect or None, "
                f"got {self.interconnect!r}; "
                "look one up with get_interconnect(name)"
            )

    def _check_peaks(self) -> None:
        if not self.peak_flops_per_s:
            raise ValueError("DeviceSpec.peak_flops_per_s needs at least one dtype")
        for dtype, peak in self.peak_flops_per_s.items():
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"DeviceSpec.peak_flops_per_s keys must be torch.dtype, got {dtype!r}")
            if not peak > 0:  # also rejects NaN
                raise ValueError(f"DeviceSpec.peak_flops_per_s[{dtype}] must be > 0, got {peak}")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def collective_link(self) -> Interconnect | None:
        """The link collectives between these devices run over; ``None`` when none is modelled.

        ``interconnect`` with ``interconnect_bytes_per_s`` (when > 0) as its bandwidth; without
        ``interconnect``, a link of that bandwidth whose latency is not modelled (0 s).

        >>> get_device_spec("h100").collective_link.name
        'nvlink4'
        """
        link, bw = self.interconnect, self.interconnect_bytes_per_s
        if link is None:
            if bw <= 0:
                return None
            return Interconnect(name=f"{self.name}-link", bandwidth_bytes_per_s=bw, latency_s=0.0)
        if bw > 0 and bw != link.bandwidth_bytes_per_s:
            return dataclasses.replace(link, bandwidth_bytes_per_s=bw)
        return link

    def flops_per_s(self, dtype: torch.dtype) -> float:
        peaks = self.peak_flops_per_s
        return peaks.get(dtype) or peaks.get(torch.float32) or max(peaks.values())

    def round_bytes(self, nbytes: int) -> int:
        """Bytes the allocator really reserves for a request of ``nbytes``."""
        b = self.allocator_block_bytes
        return nbytes if b == 1 or nbytes == 0 else -(-nbytes // b) * b

    def replace(self, **changes) -> "DeviceSpec":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line: the spec's name and the figures a runtime model prices ops with.

        >>> get_device_spec("h100").summary()[:46]
        'h100 (cuda): fp32 66.9 TFLOP/s x 0.75 eff, bf16'
        """
        return (
            f"{self.name} ({self.kind}): fp32 {self.flops_per_s(torch.float32) / _TF:.3g} TFLOP/s x "
            f"{self.compute_efficiency:.3g} eff, bf16 {self.flops_per_s(torch.bfloat16) / _TF:.3g} TFLOP/s, "
            f"{self.memory_bandwidth_bytes_per_s / _GB:,.0f} GB/s x {self.bandwidth_efficiency:.3g} eff, "
            f"launch {self.kernel_launch_ms * 1e3:.3g} us; checkpoint {self.checkpoint_call_ms * 1e3:.3g} us "
            f"per call + {self.checkpoint_submodule_ms * 1e3:.3g} us per submodule + "
            f"{self.recompute_op_ms * 1e3:.3g} us per re-run op"
            + (f" ({self.recompute_op_warm_ms * 1e3:.3g} us warm, cold after {self.host_cache_bytes / 2**20:.3g} MiB)"
               if self.recompute_op_warm_ms is not None and self.host_cache_bytes else "")
            + f" + {self.selective_op_ms * 1e3:.3g} us per selective-policy op"
            + (f" + {self.selective_call_ms * 1e3:.3g} us per selective call" if self.selective_call_ms else "")
        )


_PCIE5_X16_BYTES_PER_S = 32e9 * 16 / 8 * 128 / 130  # 63.0 GB/s per direction
_PCIE4_X16_BYTES_PER_S = 16e9 * 16 / 8 * 128 / 130  # 31.5 GB/s per direction (A100, L4)
_NVLINK_C2C_BYTES_PER_S = 450 * _GB  # GH200: 900 GB/s bidirectional


def _cuda(name, bf16_tflops, fp32_tflops, bw_gbps, mem_bytes, fp8_tflops=None, link=None,
          host_link_bytes_per_s=_PCIE5_X16_BYTES_PER_S):
    peaks = {
        torch.bfloat16: bf16_tflops * _TF,
        torch.float16: bf16_tflops * _TF,
        torch.float32: fp32_tflops * _TF,
        torch.float64: fp32_tflops / 2 * _TF,
    }
    if fp8_tflops:
        peaks[torch.float8_e4m3fn] = fp8_tflops * _TF
        peaks[torch.float8_e5m2] = fp8_tflops * _TF
    return DeviceSpec(
        name=name,
        kind="cuda",
        peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=bw_gbps * _GB,
        memory_bytes=mem_bytes,
        allocator_block_bytes=512,
        kernel_launch_ms=0.004,
        interconnect_bytes_per_s=INTERCONNECTS[link].bandwidth_bytes_per_s if link else 0.0,
        interconnect=INTERCONNECTS[link] if link else None,
        host_link_bytes_per_s=host_link_bytes_per_s,
    )


DEVICE_SPECS: dict[str, DeviceSpec] = {
    # fp32 column is plain FP32 (no TF32), the default of torch.matmul on CUDA.
    "h100": _cuda("h100", 989.4, 66.9, 3350, 80 * _GiB, fp8_tflops=1978.9, link="nvlink4"),
    # "141 GB" on the datasheet is what CUDA reports as ~140 GiB (HBM sizes are binary in
    # practice, as for the "80 GB" H100), so GiB, not 10**9: 141e9 would understate it by 10 GiB.
    "h200": _cuda("h200", 989.4, 66.9, 4800, 141 * _GiB, fp8_tflops=1978.9, link="nvlink4"),
    "a100-40gb": _cuda("a100-40gb", 312.0, 19.5, 1555, 40 * _GiB, link="nvlink3",
                       host_link_bytes_per_s=_PCIE4_X16_BYTES_PER_S),
    "a100-80gb": _cuda("a100-80gb", 312.0, 19.5, 2039, 80 * _GiB, link="nvlink3",
                       host_link_bytes_per_s=_PCIE4_X16_BYTES_PER_S),
    "l4": _cuda("l4", 121.0, 30.3, 300, 24 * _GiB, fp8_tflops=242.0,
                host_link_bytes_per_s=_PCIE4_X16_BYTES_PER_S),
    "b200": _cuda("b200", 2250.0, 75.0, 8000, 180 * _GiB, fp8_tflops=4500.0, link="nvlink5"),
    # Grace Hopper: an H100 (96 GB HBM3, 4.0 TB/s) whose host link is NVLink-C2C, not PCIe.
    "gh200": _cuda("gh200", 989.4, 66.9, 4000, 96 * _GiB, fp8_tflops=1978.9, link="nvlink4",
                   host_link_bytes_per_s=_NVLINK_C2C_BYTES_PER_S),
    # A modest server CPU core pair: numbers for relative costing, not a promise.
    "cpu": DeviceSpec(
        name="cpu",
        kind="cpu",
        # float16 as bfloat16: CPUs without native half matmuls convert both to float32.
        peak_flops_per_s={torch.float32: 0.2 * _TF, torch.bfloat16: 0.1 * _TF, torch.float16: 0.1 * _TF},
        memory_bandwidth_bytes_per_s=20 * _GB,
        memory_bytes=24 * _GiB,
        compute_efficiency=0.5,
        bandwidth_efficiency=0.5,
        host_link_bytes_per_s=10 * _GB,  # memcpy: reads and writes the 20 GB/s DRAM
        host_link_efficiency=1.0,
    ),
}
_ALIASES = {"h100-sxm": "h100", "a100": "a100-80gb", "h100_sxm": "h100"}


def get_device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """Look up a DeviceSpec by name (case-insensitive) or pass one through."""
    if isinstance(device, DeviceSpec):
        return device
    if not isinstance(device, str):
        raise UnknownDeviceError(f"device must be a name or a DeviceSpec, got {type(device).__name__}")
    key = device.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DEVICE_SPECS:
        raise UnknownDeviceError(
            f"unknown device {device!r}; known devices: {', '.join(sorted(DEVICE_SPECS))}. "
            "For another accelerator pass a DeviceSpec(...) with its peak FLOP/s and bandwidth."
        )
    return DEVICE_SPECS[key]
