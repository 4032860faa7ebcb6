"""What every rank of a planning job was asked, compared before anyone plans.

``solve_sac_distributed`` gives every rank rank 0's plan. That is right only when every rank
asked for the same plan: the same model, budget, training step and options. A rank that was
given another budget, another optimizer or another model got rank 0's plan without a word (a
different model then failed later, on that rank only), and a rank whose own arguments were
refused raised alone while the others waited in the next collective for the group's timeout
(30 minutes by default).

:func:`agree` is one all-gather that every rank reaches, whatever its own checks found: each
rank sends the error its checks raised, or what it was asked (``field -> text``, see
:func:`request_fields`), and every rank raises the same :class:`RankDisagreementError`, with the
same message naming the ranks, where any rank failed or any field differs from rank 0's. The
same call compares what each rank's own trace found, so a loss that raises on one rank only
stops every rank at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from planner.distributed.fsdp import original_class_name
from planner.plan import StepRecord, model_fingerprint
from planner.errors import RankDisagreementError

__all__ = ["RankDisagreementError", "agree", "request_fields"]

_MAX_VALUE_CHARS = 80
_MAX_FIELDS_NAMED = 4


def _text(value: Any) -> str:
    r = value if isinstance(value, str) else repr(value)
    r = " ".join(r.split())
    return r if len(r) <= _MAX_VALUE_CHARS else f"{r[:_MAX_VALUE_CHARS - 25]}... (sha256 {_digest(r)})"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _callable_name(fn: Any) -> str:
    if fn is None:
        return "default"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _batch_text(inputs: Any) -> str:
    """The batch as shapes and dtypes (``float32[4, 64], int64[4]``): values differ by rank."""
    leaves, spec = tree_flatten(inputs)
    parts = [f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" if isinstance(t, torch.Tensor)
             else type(t).__name__ for t in leaves]
    text = ", ".join(parts)
    return text if len(text) <= _MAX_VALUE_CHARS else f"{len(parts)} leaves (sha256 {_digest(text + str(spec))})"


def request_fields(*, model: torch.nn.Module, budget_gib: Any, step: Any, options: Any = None,
                   **extra: Any) -> dict[str, str]:
    """What a rank was asked, as text to compare: the model (class and fingerprint: module
    names, parameter shapes and dtypes), the budget, the step (its plan-file record, the loss
    function's qualified name, the batch's shapes and dtypes), every field of ``options`` (a
    dataclass) and each ``extra`` keyword (``fsdp_units=...``)."""
    fields = {"model": f"{original_class_name(model)} (fingerprint {model_fingerprint(model)})",
              "budget_gib": _text(budget_gib)}
    if step is not None:
        record = StepRecord.of(step)
        fields.update({f"step.{f.name}": _text(getattr(record, f.name)) for f in dataclasses.fields(record)})
        fields["step.loss_fn"] = _text(_callable_name(step.loss_fn))
        fields["step.inputs"] = _batch_text(step.inputs)
    if options is not None:
        fields.update({f"options.{f.name}": _text(getattr(options, f.name)) for f in dataclasses.fields(options)})
    fields.update({name: _text(value) for name, value in extra.items()})
    return fields


def agree(stage: str, fields: dict[str, str] | None, error: BaseException | None,
          group: dist.ProcessGroup | None = None) -> None:
    """All-gather this rank's ``error`` (what its own checks raised) or ``fields`` (what it
    has to compare); raise :class:`RankDisagreementError` on every rank, with the same message,
    where any rank failed or any field differs from rank 0's. ``stage`` names what was checked
    (``"the arguments"``, ``"the traced step"``). Call it on every rank of ``group``, and
    before raising ``error`` yourself: the others would wait for this rank until the group's
    timeout."""
    payload = ("error", _one_line(error)) if error is not None else ("ok", fields or {})
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    failed = [(r, p[1]) for r, p in enumerate(gathered) if p[0] == "error"]
    if failed:
        said = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise RankDisagreementError(
            f"planning stopped on every rank: {stage} failed on {_ranks([r for r, _ in failed])} "
            f"({said})", [r for r, _ in failed]) from error
    message, ranks = _differences([p[1] for p in gathered])
    if ranks:
        raise RankDisagreementError(
            f"ranks were asked for different plans ({stage}): {message}; call "
            "solve_sac_distributed with the same model, budget, step and options on every rank "
            "(a per-rank batch of the same shapes and dtypes)", ranks)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text[:600]}" + ("..." if len(text) > 600 else "")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _differences(per_rank: list[dict[str, str]]) -> tuple[str, list[int]]:
    """Each field whose value is not the same on every rank, as ``field: a on ranks 0, 2; b on
    rank 1``, and the ranks that differ from rank 0 anywhere."""
    names = sorted({k for fields in per_rank for k in fields})
    lines, ranks = [], set()
    for name in names:
        values = [fields.get(name, "(not given)") for fields in per_rank]
        if len(set(values)) == 1:
            continue
        ranks.update(r for r, v in enumerate(values) if v != values[0])
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        lines.append(f"{name}: " + "; ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items()))
    more = len(lines) - _MAX_FIELDS_NAMED
    text = " | ".join(lines[:_MAX_FIELDS_NAMED]) + (f" | and {more} more field(s)" if more > 0 else "")
    return text, sorted(ranks)
