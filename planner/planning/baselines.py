"""The hand-made checkpointing policies people use today, costed by the planner's own model.

    from planner.planning.baselines import hand_made_baselines
    for b in hand_made_baselines(info):
        print(b.name, b.predicted_peak_bytes, b.recompute_ms)

Every policy becomes ``{module fqn: discarded bytes}``; its peak is ``predict_peak_bytes`` of that
(the exact model the MILP uses, checkpoint-held inputs and recompute transients included) and its
recompute time is what each checkpointed module re-runs, so a baseline and a point of
``planner.planning.tradeoff.tradeoff_curve`` are directly comparable.

Policies:

* ``no_ac``: nothing checkpointed.
* ``full_ac``: every block (or every k-th block, torchtitan's ``selective`` int mode: the blocks
  whose 1-based index is a multiple of k) fully checkpointed.
* ``op_sac``: torchtitan's op-level selective AC applied to every block: matmul-like outputs
  (``aten.mm``/``addmm``/``bmm``/``baddbmm``/``linear``/``matmul`` and fused SDPA, ``MATMUL_OPS``)
  are saved, every other op recomputed. torchtitan additionally recomputes every second
  ``aten.mm``; this keeps the plain save-list policy.
* ``attention_core_ac``: Megatron-style selective recompute: every attention core module
  (fqn ending in ``attn.core`` unless given) fully checkpointed.

"Blocks" are found generically (``find_blocks``): the largest group of sibling, non-leaf modules
named ``<prefix>.<int>`` (``GPT.blocks.0..N``, ``Llama.layers.0..N``).
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from estimators.tracing.sac import greedy_units
from solver.plan_cost import module_recompute_ms, predict_peak_bytes

if TYPE_CHECKING:
    from estimators.contract.module_info import ModStats, ModuleInfo

__all__ = [
    "BaselinePoint",
    "MATMUL_OPS",
    "find_blocks",
    "find_attention_cores",
    "no_ac",
    "full_ac",
    "op_sac",
    "op_sac_module",
    "attention_core_ac",
    "hand_made_baselines",
]

logger = logging.getLogger(__name__)

MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_scaled_dot_product_*"})
"""Aten packet names (``fnmatch`` patterns) whose outputs torchtitan's op-level policy saves:
matmuls and fused attention in any backend flavour."""


@dataclass(frozen=True, kw_only=True)
class BaselinePoint:
    """A hand-made policy and what the planner's model predicts for it.

    >>> b = BaselinePoint(name="no AC", predicted_peak_bytes=10, recompute_ms=0.0)
    >>> b.checkpointed
    ()
    """

    name: str
    predicted_peak_bytes: int
    """Per-rank peak of the exact memory model (``solver.predict_peak_bytes``)."""
    recompute_ms: float
    """Recompute time per step of all checkpointed modules."""
    recompute_pct_of_step: float | None = None
    """``recompute_ms`` as a percentage of the no-AC step time."""
    discarded_bytes: Mapping[str, int] = field(default_factory=dict)
    """Checkpointed module fqn -> activation bytes it discards (gross, as ``predict_peak_bytes``
    takes them)."""
    recompute_ms_by_module: Mapping[str, float] = field(default_factory=dict)
    description: str = ""

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return tuple(self.discarded_bytes)


# ----------------------------------------------------------------------------- module discovery
_INDEXED = re.compile(r"^(?P<prefix>.+)\.(?P<index>\d+)$")


def find_blocks(info: ModuleInfo) -> tuple[str, ...]:
    """The repeated blocks: the largest group of sibling non-leaf modules ``<prefix>.<int>``.

    Ties go to the shallower prefix, then the one that runs first. Raises ``ValueError`` when the
    model has no such group (pass ``blocks=`` explicitly then).

    >>> find_blocks(info)                                   # doctest: +SKIP
    ('GPT.blocks.0', 'GPT.blocks.1', 'GPT.blocks.2', 'GPT.blocks.3')
    """
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for s in info.mod_stats:
        m = _INDEXED.match(s.fqn)
        if m and not s.is_leaf:
            groups[m["prefix"]].append((int(m["index"]), s.fqn))
    if not groups:
        raise ValueError(
            "no repeated blocks found (sibling modules named <prefix>.<int>, e.g. GPT.blocks.0); "
            "pass blocks=[...] with the fqns to checkpoint"
        )
    order = {s.fqn: i for i, s in enumerate(info.mod_stats)}
    prefix = min(groups, key=lambda p: (-len(groups[p]), p.count("."), order[groups[p][0][1]]))
    return tuple(fqn for _, fqn in sorted(groups[prefix]))


def find_attention_cores(info: ModuleInfo, suffix: str = "attn.core") -> tuple[str, ...]:
    """Modules whose fqn ends with ``.<suffix>`` (Megatron's "core attention"), in run order."""
    return tuple(s.fqn for s in info.mod_stats if s.fqn.endswith("." + suffix))


# ----------------------------------------------------------------------------- costing
def _point(info: ModuleInfo, name: str, description: str, discarded: dict[str, int],
           recompute: dict[str, float], world_size: int) -> BaselinePoint:
    step_ms = info.step_runtime_ms
    total_ms = sum(recompute.values())
    return BaselinePoint(
        name=name,
        predicted_peak_bytes=predict_peak_bytes(info, discarded, world_size=world_size),
        recompute_ms=total_ms,
        recompute_pct_of_step=100.0 * total_ms / step_ms if step_ms > 0 else None,
        discarded_bytes=discarded,
        recompute_ms_by_module=recompute,
        description=description,
    )


def _stats(info: ModuleInfo, fqns: Iterable[str], what: str) -> list[ModStats]:
    if isinstance(fqns, str):
        raise TypeError(f"{what} must be a list of module fqns, not the string {fqns!r}")
    out = [info.stats(f) for f in fqns]  # KeyError names the unknown module
    if not out:
        raise ValueError(f"{what} is empty; pass at least one module fqn")
    return out


def _checkpointable(s: ModStats) -> bool:
    return not s.is_leaf and s.sac_memory_bytes > 0


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


# ----------------------------------------------------------------------------- the policies
def no_ac(info: ModuleInfo, *, world_size: int = 1) -> BaselinePoint:
    """Nothing checkpointed."""
    return _point(info, "no AC", "no activation checkpointing", {}, {}, world_size)


def full_ac(info: ModuleInfo, blocks: Sequence[str] | None = None, *, every: int = 1,
            world_size: int = 1) -> BaselinePoint:
    """Full checkpointing of every ``every``-th block (1-based index a multiple of ``every``,
    torchtitan's convention); ``blocks`` default: ``find_blocks(info)``."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    stats = _stats(info, blocks if blocks is not None else find_blocks(info), "blocks")
    chosen = [s for i, s in enumerate(stats) if (i + 1) % every == 0 and _checkpointable(s)]
    discarded = {s.fqn: s.sac_memory_bytes for s in chosen}
    recompute = {s.fqn: module_recompute_ms(s, s.sac_memory_bytes) for s in chosen}
    name = "full AC, every block" if every == 1 else f"full AC, every {_ordinal(every)} block"
    return _point(info, name, f"torch.utils.checkpoint on {len(chosen)} of {len(stats)} blocks",
                  discarded, recompute, world_size)


def _is_saved_by_op_policy(func: str, save_ops: frozenset[str]) -> bool:
    """Whether the packet name (``aten.addmm.default`` -> ``addmm``) matches a save pattern."""
    parts = func.split(".")
    packet = parts[1] if parts[0] == "aten" and len(parts) > 1 else func
    return any(fnmatch.fnmatchcase(packet, pattern) for pattern in save_ops)


def op_sac_module(s: ModStats, save_ops: frozenset[str] = MATMUL_OPS) -> tuple[int, float]:
    """(discarded bytes, recompute ms) of the op-level policy on one module.

    Ops are taken in the units the planner uses (``estimators.tracing.sac.greedy_units``: an in-place op
    with its parent, all random ops together); a unit is saved when any of its ops is on the save
    list. The recompute re-runs the module's fixed part (``recompute_fixed_ms``: ops autograd does
    not save, which the planner's model always recomputes, matmul or not) plus every recomputed
    unit."""
    discarded, ms = 0, s.recompute_fixed_ms
    for unit in greedy_units(s.ops):
        if not any(_is_saved_by_op_policy(s.ops[i].func, save_ops) for i in unit.ops):
            discarded += unit.memory_bytes
            ms += unit.runtime_ms
    return discarded, ms


def op_sac(info: ModuleInfo, blocks: Sequence[str] | None = None, *,
           save_ops: Iterable[str] = MATMUL_OPS, world_size: int = 1) -> BaselinePoint:
    """torchtitan's op-level selective AC on every block: save matmul outputs, recompute the rest.

    Costed inside the planner's model: a matmul output autograd does not save (e.g. a fused qkv
    projection read only through views) is recomputed, as the planner's model always does, where
    torchtitan would cache it. So this point sits at a little less memory and a little more
    recompute time than torchtitan's run of the same policy."""
    save = frozenset(save_ops)
    stats = [s for s in _stats(info, blocks if blocks is not None else find_blocks(info), "blocks")
             if _checkpointable(s)]
    costs = {s.fqn: op_sac_module(s, save) for s in stats}
    discarded = {f: d for f, (d, _) in costs.items()}
    recompute = {f: ms for f, (_, ms) in costs.items()}
    return _point(info, "op-level SAC (torchtitan 'op')",
                  f"save {', '.join(sorted(save))} outputs in {len(stats)} blocks, "
                  "recompute the rest", discarded, recompute, world_size)


def attention_core_ac(info: ModuleInfo, cores: Sequence[str] | None = None, *,
                      world_size: int = 1) -> BaselinePoint:
    """Megatron's selective recompute: every attention core fully checkpointed. ``cores``
    default: ``find_attention_cores(info)``; ``ValueError`` if there are none."""
    names = cores if cores is not None else find_attention_cores(info)
    if not names:
        raise ValueError("no attention core modules (fqn ending in 'attn.core'); pass cores=[...]")
    stats = [s for s in _stats(info, names, "cores") if _checkpointable(s)]
    discarded = {s.fqn: s.sac_memory_bytes for s in stats}
    recompute = {s.fqn: module_recompute_ms(s, s.sac_memory_bytes) for s in stats}
    return _point(info, "attention core (Megatron)",
                  f"torch.utils.checkpoint on {len(stats)} attention cores", discarded, recompute,
                  world_size)


def hand_made_baselines(
    info: ModuleInfo,
    *,
    world_size: int = 1,
    blocks: Sequence[str] | None = None,
    every_k: Sequence[int] = (2, 3),
    attention_cores: Sequence[str] | None = None,
) -> tuple[BaselinePoint, ...]:
    """All the policies above on one model: no AC, full AC of every block and of every k-th block
    for k in ``every_k``, op-level SAC, and the attention-core policy when the model has cores.

    >>> for b in hand_made_baselines(est.module_info):       # doctest: +SKIP
    ...     print(f"{b.name:32} {b.predicted_peak_bytes / 2**30:6.2f} GiB {b.recompute_ms:8.2f} ms")
    """
    blocks = tuple(blocks) if blocks is not None else find_blocks(info)
    out = [no_ac(info, world_size=world_size), full_ac(info, blocks, world_size=world_size)]
    out += [full_ac(info, blocks, every=k, world_size=world_size) for k in every_k if k > 1]
    out.append(op_sac(info, blocks, world_size=world_size))
    cores = attention_cores if attention_cores is not None else find_attention_cores(info)
    if cores:
        out.append(attention_core_ac(info, cores, world_size=world_size))
    else:
        logger.info("no attention core modules: the Megatron baseline is left out")
    return tuple(out)
