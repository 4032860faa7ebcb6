"""estimators/pipeline/makespan.py: the schedule's step time, against hand-computed cases."""

import pytest

from estimators.pipeline.makespan import DeadlockError, bubble_fractions, makespan_ms, simulate


def _1f1b(p: int, n: int) -> dict[int, list]:
    out = {}
    for s in range(p):
        warm = min(n, p - s)
        acts = [(s, "F", m) for m in range(warm)]
        f = warm
        for b in range(n):
            acts.append((s, "B", b))
            if f < n:
                acts.append((s, "F", f))
                f += 1
        out[s] = acts
    return out


def test_1f1b_makespan_is_n_plus_p_minus_1_times_f_plus_b():
    spans = simulate(_1f1b(4, 8), {s: s for s in range(4)}, lambda _s, k: {"F": 1.0, "B": 2.0}[k])
    assert makespan_ms(spans) == pytest.approx((8 + 4 - 1) * 3.0)
    assert makespan_ms(spans, {0: 0.5}) == pytest.approx(33.5)
    # every rank works n (F + B) = 24 of the 33: 9 idle
    assert all(b == pytest.approx(9 / 33) for b in bubble_fractions(spans).values())


def test_recompute_in_a_bubble_costs_less_than_on_the_critical_path():
    dur = lambda s, k, extra: {"F": 1.0, "B": 2.0}[k] + (extra if k == "B" else 0.0)
    acts, ranks = _1f1b(4, 8), {s: s for s in range(4)}
    first = makespan_ms(simulate(acts, ranks, lambda s, k: dur(s, k, 0.5 if s == 0 else 0.0)))
    last = makespan_ms(simulate(acts, ranks, lambda s, k: dur(s, k, 0.5 if s == 3 else 0.0)))
    assert (first, last) == (pytest.approx(35.5), pytest.approx(37.0))


def test_hops_between_ranks_and_deadlocks():
    acts = {0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    spans = simulate(acts, {0: 0, 1: 1}, lambda _s, _k: 1.0, hop_ms=lambda _a, _b: 0.25)
    assert makespan_ms(spans) == pytest.approx(4.5)  # F0 1, hop, F1 2.25, B1 3.25, hop, B0 4.5
    with pytest.raises(DeadlockError, match="wait on each other"):
        simulate({0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]}, {0: 0, 1: 1}, lambda _s, _k: 1.0)


def test_a_long_pipeline_is_simulated_in_linear_time():
    """A backward flows back one stage per pass over the ranks: visiting the ranks in turn took
    a pass per stage (1,024 GPipe stages: 2 s, quadratic in the stages)."""
    import time

    n_stages, n = 1024, 4
    acts = {r: [(r, "F", m) for m in range(n)] + [(r, "B", m) for m in range(n)] for r in range(n_stages)}
    t = time.thread_time()
    spans = simulate(acts, {s: s for s in range(n_stages)}, lambda s, k: 1.0)
    assert time.thread_time() - t < 0.5
    assert makespan_ms(spans) == 2 * (n_stages + n - 1)  # GPipe: fill, drain, then back
