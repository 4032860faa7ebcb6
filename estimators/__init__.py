"""Estimators: one traced training step -> module tree, memory timeline, runtimes, SAC trade-offs.

    from estimators import estimate
    est = estimate(model, inputs, optimizer="adamw", device="h100")   # fake mode, no GPU needed
    info = est.module_info                                            # what the solver takes

The names below are loaded on first use (module ``__getattr__``): ``import estimators`` and
``from estimators.module_info import ModuleInfo`` do not import torch, so the solver, which only
reads a ModuleInfo, stays torch-free.
"""

import importlib
from typing import Any

_EXPORTS = {
    "estimate": "estimators.estimation",
    "Estimate": "estimators.estimation",
    "EstimateOptions": "estimators.estimation",
    "TraceMode": "estimators.estimation",
    "TraceError": "estimators.estimation",
    "TrainStep": "estimators.step",
    "ZeroGrad": "estimators.step",
    "DEVICE_SPECS": "estimators.device",
    "DeviceSpec": "estimators.device",
    "UnknownDeviceError": "estimators.device",
    "get_device_spec": "estimators.device",
    "MemoryPoint": "estimators.module_info",
    "ModOrder": "estimators.module_info",
    "ModStats": "estimators.module_info",
    "ModuleInfo": "estimators.module_info",
    "ModuleInfoFormatError": "estimators.module_info",
    "Phase": "estimators.module_info",
    "SACOp": "estimators.module_info",
    "TradeoffCurve": "estimators.module_info",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'estimators' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
