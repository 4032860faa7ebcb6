"""FSDP2 (``fully_shard``) for the planner, one module per concern:

* ``memory.py``: what FSDP2 holds per rank at every memory point (rules R1-R8), as a ModuleInfo
  the unchanged solver plans per rank;
* ``comm.py``: all-gather / reduce-scatter time per step;
* ``model.py``: the units of a live sharded model and the class names FSDP2 swaps;
* ``units.py``: the unit table both rule sets share (own parameter / gradient bytes).

    units = ["GPT", *(f"GPT.blocks.{i}" for i in range(4))]     # what you will fully_shard
    info2 = fsdp_module_info(est.module_info, units, world_size=8)
    SACMilp(info2, world_size=8, fsdp_units=units)               # per-rank memory, FSDP included
"""

from planner.distributed.fsdp.comm import RECOMPUTE_EXTRA_ALL_GATHER_REASON, FsdpCommEstimate, FsdpUnitComm, fsdp_comm_ms
from planner.distributed.fsdp.memory import FSDPExtraBytes, FsdpPrecision, fsdp_extra_bytes, fsdp_module_info, per_rank_info
from planner.distributed.fsdp.model import fsdp_units_of, original_class_name
from planner.distributed.fsdp.units import FSDPUnitError

__all__ = [
    "FSDPUnitError",
    "FSDPExtraBytes",
    "fsdp_units_of",
    "fsdp_extra_bytes",
    "fsdp_module_info",
    "FsdpPrecision",
    "per_rank_info",
    "original_class_name",
    "FsdpUnitComm",
    "FsdpCommEstimate",
    "fsdp_comm_ms",
    "RECOMPUTE_EXTRA_ALL_GATHER_REASON",
]
