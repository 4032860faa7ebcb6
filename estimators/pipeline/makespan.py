"""A pipeline step's time: every rank runs its actions in order, each as soon as its rank is free
and its inputs have arrived; the makespan is the last end plus the optimizer step (torch-free).

    spans = simulate({r: layout.actions(r) for r in ranks}, layout.stage_to_rank(), duration_ms)
    makespan_ms(spans, optim_ms), bubble_fractions(spans), timeline_text(spans)

Dependencies are torch's: F(s, m) after F(s-1, m); B or I(s, m) after F(s, m) and after
B or I(s+1, m); W(s, m) after I(s, m). A hand-over between ranks costs ``hop_ms(from, to)``;
stages on one rank hand over for free. Recompute belongs in a backward's duration (under a split
backward in both halves: the input half recomputes, and the weight half again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Span", "simulate", "makespan_ms", "bubble_fractions", "timeline_text", "DeadlockError"]


class DeadlockError(ValueError):
    """The action lists wait on each other (not one schedule's)."""


@dataclass(frozen=True)
class Span:
    stage: int
    kind: str
    microbatch: int
    start_ms: float
    end_ms: float


def _deps(s: int, kind: str, m: int, n_stages: int) -> list[tuple[tuple[int, str, int], ...]]:
    """Each dependency as alternatives (a backward is a full B or an input half I)."""
    if kind == "F":
        return [((s - 1, "F", m),)] if s > 0 else []
    if kind in ("B", "I"):
        deps = [((s, "F", m),)]
        if s < n_stages - 1:
            deps.append(((s + 1, "B", m), (s + 1, "I", m)))
        return deps
    return [((s, "I", m),)]


def simulate(actions_by_rank: dict[int, list[tuple[int, str, int]]], stage_rank: dict[int, int],
             duration_ms: Callable[[int, str], float],
             hop_ms: Callable[[int, int], float] = lambda _a, _b: 0.0) -> dict[int, list[Span]]:
    """Start and end of every action (see the module docstring). A rank runs until its next
    action waits on another's, and resumes when that one is done: linear in the actions (going
    over the ranks in turn until none moved took a pass per stage for a backward to flow back,
    quadratic in the stages). An action's times depend only on its rank's previous action and
    its inputs, not on the order ranks are visited."""
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in actions_by_rank}
    free = {r: 0.0 for r in actions_by_rank}
    out: dict[int, list[Span]] = {r: [] for r in actions_by_rank}
    n_stages = len(stage_rank)
    waiting: dict[tuple[int, str, int], list[int]] = {}
    runnable = list(reversed(list(actions_by_rank)))
    while runnable:
        r = runnable.pop()
        acts = actions_by_rank[r]
        while pos[r] < len(acts):
            s, kind, m = acts[pos[r]]
            ready = 0.0
            for alternatives in _deps(s, kind, m, n_stages):
                key = next((k for k in alternatives if k in done), None)
                if key is None:
                    for k in alternatives:
                        waiting.setdefault(k, []).append(r)
                    break
                hop = hop_ms(key[0], s) if stage_rank[key[0]] != stage_rank[s] else 0.0
                ready = max(ready, done[key] + hop)
            else:
                start = max(ready, free[r])
                end = start + duration_ms(s, kind)
                done[(s, kind, m)] = free[r] = end
                out[r].append(Span(s, kind, m, start, end))
                pos[r] += 1
                runnable += waiting.pop((s, kind, m), ())
                continue
            break
    stuck = {r: acts[pos[r]] for r, acts in actions_by_rank.items() if pos[r] < len(acts)}
    if stuck:
        shown = dict(list(stuck.items())[:8])
        raise DeadlockError(f"the action lists wait on each other: next actions {shown}"
                            + (f" and {len(stuck) - 8} more ranks" if len(stuck) > 8 else ""))
    return out


def makespan_ms(spans: dict[int, list[Span]], optim_ms: dict[int, float] | None = None) -> float:
    """The step's end: the last rank's last action plus its optimizer step."""
    optim_ms = optim_ms or {}
    return max(((sp[-1].end_ms if sp else 0.0) + optim_ms.get(r, 0.0) for r, sp in spans.items()), default=0.0)


def bubble_fractions(spans: dict[int, list[Span]]) -> dict[int, float]:
    """Per rank: the idle share of the time up to the pipeline's last action."""
    end = max((sp[-1].end_ms for sp in spans.values() if sp), default=0.0)
    return {r: (1 - sum(x.end_ms - x.start_ms for x in sp) / end) if end else 0.0 for r, sp in spans.items()}


def timeline_text(spans: dict[int, list[Span]], width: int = 96) -> str:
    """One line per rank: each action as kind + micro-batch over a shared time axis."""
    end = max((sp[-1].end_ms for sp in spans.values() if sp), default=0.0) or 1.0
    lines = []
    for r in sorted(spans):
        row = [" "] * width
        for x in spans[r]:
            a = int(x.start_ms / end * (width - 1))
            b = max(a + 1, int(x.end_ms / end * (width - 1)))
            for i in range(a, min(b, width)):
                row[i] = "-"
            for i, ch in enumerate(f"{x.kind}{x.microbatch}"[: b - a]):
                row[a + i] = ch
        lines.append(f"rank {r} |{''.join(row)}|")
    return "\n".join(lines)
