"""Estimators: one traced training step -> module tree, memory timeline, runtimes, SAC trade-offs.

    from estimators import estimate
    est = estimate(model, TrainStep(inputs=batch, optimizer="adamw"), device="h100")  # fake mode
    info = est.module_info                                            # what the solver takes

The names below are loaded on first use (module ``__getattr__``): ``import estimators`` and
``from estimators.contract.module_info import ModuleInfo`` do not import torch, so the solver, which only
reads a ModuleInfo, stays torch-free.
"""

import importlib
from typing import Any

_EXPORTS = {
    "estimate": "estimators.tracing.estimation",
    "Estimate": "estimators.tracing.estimation",
    "EstimateOptions": "estimators.tracing.estimation",
    "TraceMode": "estimators.tracing.estimation",
    "TraceError": "estimators.tracing.estimation",
    "TrainStep": "estimators.step.train_step",
    "ZeroGrad": "estimators.step.train_step",
    "DEVICE_SPECS": "estimators.runtime.device",
    "DeviceSpec": "estimators.runtime.device",
    "UnknownDeviceError": "estimators.runtime.device",
    "get_device_spec": "estimators.runtime.device",
    "MemoryPoint": "estimators.contract.module_info",
    "ModOrder": "estimators.contract.module_info",
    "ModStats": "estimators.contract.module_info",
    "ModuleInfo": "estimators.contract.module_info",
    "ModuleInfoFormatError": "estimators.contract.module_info",
    "Phase": "estimators.contract.module_info",
    "SACOp": "estimators.contract.module_info",
    "TradeoffCurve": "estimators.contract.module_info",
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
