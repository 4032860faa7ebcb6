"""Estimators: one traced training step -> module tree, memory timeline, runtimes, SAC trade-offs.

    from estimators import estimate
    est = estimate(model, inputs, optimizer="adamw", device="h100")   # fake mode, no GPU needed
    info = est.module_info                                            # what the solver takes
"""

from estimators.device import DEVICE_SPECS, DeviceSpec, UnknownDeviceError, get_device_spec
from estimators.estimate import Estimate, EstimateOptions, TraceError, TraceMode, estimate
from estimators.step import TrainStep, ZeroGrad
from estimators.module_info import (
    MemoryPoint,
    ModOrder,
    ModStats,
    ModuleInfo,
    ModuleInfoFormatError,
    SACOp,
    TradeoffCurve,
)

__all__ = [
    "estimate",
    "TrainStep",
    "ZeroGrad",
    "Estimate",
    "EstimateOptions",
    "TraceMode",
    "TraceError",
    "DEVICE_SPECS",
    "DeviceSpec",
    "UnknownDeviceError",
    "get_device_spec",
    "MemoryPoint",
    "ModOrder",
    "ModStats",
    "ModuleInfo",
    "ModuleInfoFormatError",
    "SACOp",
    "TradeoffCurve",
]
