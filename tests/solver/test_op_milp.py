"""solver/op_milp.py on hand-built op tables with exact expected decisions."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimators.contract.module_info import SACOp
from solver.op_milp import OpDecision, solve_op_milp

MiB = 2**20
S, R = OpDecision.SAVE, OpDecision.RECOMPUTE


def op(func: str, ms: float, mib: float, *, view: bool = False, inplace: int = -1,
       rand: bool = False) -> SACOp:
    return SACOp(func=func, occurrence=0, runtime_ms=ms, memory_bytes=int(mib * MiB), is_view=view,
                 inplace_parent=inplace, is_random=rand)


def block() -> list[SACOp]:
    """Groups: {0,1} in-place pair 50 MiB / 3.2 ms; random {2,5} 40 MiB / 0.2 ms; {3} 50 / 0.5;
    {4} a view; {6} 60 / 2."""
    return [op("aten.addmm", 3.0, 50), op("aten.add_", 0.2, 0, inplace=0),
            op("aten.bernoulli", 0.1, 20, rand=True), op("aten.mul", 0.5, 50),
            op("aten.view", 0.0, 0, view=True), op("aten.bernoulli", 0.1, 20, rand=True),
            op("aten.gelu", 2.0, 60)]


@pytest.mark.parametrize("keep_mib, expected, recompute_ms", [
    # 110: {0,1}+{6} saves 5.2 ms; beats {0,1}+{3} (3.7) and {6}+{3} (2.5).
    (110, (S, S, R, R, R, R, S), 0.7),
    # 90: {0,1}+random (3.4) beats {0,1} alone (3.2) and {6} (2).
    (90, (S, S, S, R, R, S, R), 2.5),
    # 89: the random pair no longer fits beside {0,1}; splitting it is not allowed.
    (89, (S, S, R, R, R, R, R), 2.7),
    # 0: everything that holds memory is recomputed.
    (0, (R, R, R, R, R, R, R), 5.9),
])
def test_groups_knapsack(keep_mib: int, expected: tuple[OpDecision, ...], recompute_ms: float) -> None:
    plan = solve_op_milp(block(), keep_bytes=keep_mib * MiB)
    assert plan.decisions == expected
    assert plan.recompute_ms == pytest.approx(recompute_ms)
    saved = sum(o.memory_bytes for o, d in zip(block(), expected) if d is S)
    assert plan.saved_bytes == saved <= keep_mib * MiB
    assert plan.discarded_bytes == 200 * MiB - saved


def test_slack_budget_saves_all_but_views() -> None:
    plan = solve_op_milp(block(), keep_ratio=1.0)
    assert plan.decisions == (S, S, S, S, R, S, S)
    assert plan.recompute_ms == 0.0 and plan.discarded_bytes == 0


def test_keep_ratio_is_floored_bytes() -> None:
    ops = [op("aten.mm", 5.0, 40), op("aten.mm", 4.0, 30), op("aten.relu", 0.5, 40)]
    plan = solve_op_milp(ops, keep_ratio=70 / 110)  # floor(70/110 * 110 MiB) = 70 MiB exactly
    assert plan.keep_bytes == 70 * MiB
    assert plan.decisions == (S, S, R)
    assert solve_op_milp(ops, keep_ratio=70 / 110 - 1e-9).decisions == (S, R, R)


def test_free_ops_saved_and_zero_time_ops_recomputed() -> None:
    ops = [op("aten.addmm", 1.0, 10), op("aten.sum", 0.3, 0), op("aten.empty", 0.0, 10)]
    assert solve_op_milp(ops, keep_bytes=0).decisions == (R, S, R)
    assert solve_op_milp(ops, keep_bytes=100 * MiB).decisions == (S, S, R)


def test_inplace_chain_follows_its_root() -> None:
    ops = [op("aten.addmm", 1.0, 10), op("aten.relu_", 0.5, 0, inplace=0),
           op("aten.mul_", 0.5, 0, inplace=1), op("aten.mm", 1.5, 10)]
    assert solve_op_milp(ops, keep_bytes=10 * MiB).decisions == (S, S, S, R)  # 2.0 ms > 1.5 ms


def test_inplace_on_a_view_is_recomputed() -> None:
    ops = [op("aten.view", 0.0, 0, view=True), op("aten.add_", 1.0, 0, inplace=0)]
    assert solve_op_milp(ops, keep_ratio=1.0).decisions == (R, R)


def test_ties_prefer_the_earlier_op() -> None:
    ops = [op("aten.mm", 1.0, 10), op("aten.mm", 1.0, 10)]
    assert [solve_op_milp(ops, keep_bytes=15 * MiB).decisions for _ in range(2)] == [(S, R)] * 2


def test_empty_table() -> None:
    plan = solve_op_milp([], keep_ratio=0.5)
    assert plan.decisions == () and plan.saved_bytes == 0


@pytest.mark.parametrize("kw", [{}, {"keep_bytes": 1, "keep_ratio": 0.5}, {"keep_bytes": -1},
                                {"keep_ratio": 1.5}, {"keep_ratio": float("nan")}, {"keep_bytes": 1.5}])
def test_bad_budget(kw) -> None:
    with pytest.raises(ValueError, match="keep_"):
        solve_op_milp(block(), **kw)


def test_inplace_on_outside_storage_is_saved_outside_the_budget() -> None:
    """inplace_parent == own index: the op mutates a module input; recomputing it would apply
    the mutation twice, so its group (here: with the random ops) is saved and not budgeted."""
    ops = [op("aten.bernoulli_", 0.2, 0, inplace=0, rand=True), op("aten.bernoulli", 0.2, 10, rand=True),
           op("aten.mm", 2.0, 10), op("aten.mul_", 0.1, 0, inplace=2)]
    plan = solve_op_milp(ops, keep_ratio=0.0)
    assert plan.decisions == (S, S, R, R)
    assert (plan.keep_bytes, plan.saved_bytes, plan.discarded_bytes) == (0, 0, 10 * MiB)
    assert solve_op_milp(ops, keep_ratio=1.0).decisions == (S, S, S, S)


@pytest.mark.parametrize("parent", [5, 2, -2])
def test_bad_inplace_parent(parent: int) -> None:
    ops = [op("aten.mm", 1.0, 10), op("aten.add_", 1.0, 0, inplace=parent)]
    with pytest.raises(ValueError, match="inplace_parent"):
        solve_op_milp(ops, keep_bytes=0)


def test_bad_op_numbers() -> None:
    with pytest.raises(ValueError, match="runtime_ms"):
        solve_op_milp([op("aten.mm", -1.0, 10)], keep_bytes=0)


@st.composite
def op_tables(draw) -> tuple[list[SACOp], int]:
    n = draw(st.integers(1, 9))
    odd = draw(st.booleans())  # unaligned sizes force the coarse (inexact) row
    ops = []
    for i in range(n):
        kind = draw(st.sampled_from(["plain", "plain", "view", "inplace", "random"]))
        tail = draw(st.integers(0, 7)) if odd else 512 * draw(st.integers(0, 3))
        mem = draw(st.integers(0, 300)) * MiB + tail
        ms = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 3.0]))
        if kind == "view":
            ops.append(op("aten.view", 0.0, 0, view=True))
        elif kind == "inplace":  # parent i itself: mutates an input of the module
            ops.append(SACOp(func="aten.add_", occurrence=0, runtime_ms=ms, memory_bytes=0,
                             inplace_parent=draw(st.integers(0, i)), is_random=draw(st.booleans())))
        else:
            ops.append(SACOp(func="aten.op", occurrence=0, runtime_ms=ms, memory_bytes=mem,
                             is_random=kind == "random"))
    total = sum(o.memory_bytes for o in ops)
    return ops, draw(st.integers(0, total))


def _forced(ops: list[SACOp]) -> set[int]:
    """Ops tied (in-place links, shared randomness) to an in-place op on outside storage."""
    forced = {i for i, o in enumerate(ops) if o.inplace_parent == i}
    grew = True
    while grew:
        before = len(forced)
        for i, o in enumerate(ops):
            if o.inplace_parent >= 0 and (i in forced or o.inplace_parent in forced):
                forced |= {i, o.inplace_parent}
        if any(o.is_random and i in forced for i, o in enumerate(ops)):
            forced |= {i for i, o in enumerate(ops) if o.is_random}
        grew = len(forced) > before
    return forced


def _brute_force_ms(ops: list[SACOp], keep: int, unit: int = 1) -> float:
    """Least recompute over all legal decisions, budgeted sizes rounded up to ``unit`` bytes."""
    forced = _forced(ops)
    size = [0 if i in forced else -(-o.memory_bytes // unit) * unit for i, o in enumerate(ops)]
    best = math.inf
    for bits in itertools.product((0, 1), repeat=len(ops)):
        if any(not b for i, b in enumerate(bits) if i in forced):
            continue
        if any(b and o.is_view for i, (b, o) in enumerate(zip(bits, ops)) if i not in forced):
            continue
        if any(o.inplace_parent >= 0 and b != bits[o.inplace_parent] for b, o in zip(bits, ops)):
            continue
        if len({b for b, o in zip(bits, ops) if o.is_random}) > 1:
            continue
        if sum(m for b, m in zip(bits, size) if b) > keep:
            continue
        best = min(best, sum(o.runtime_ms for b, o in zip(bits, ops) if not b))
    return best


@pytest.mark.property
@settings(max_examples=80, deadline=None)
@given(op_tables())
def test_matches_brute_force(table) -> None:
    """Byte-exact when sizes share a small unit; otherwise optimal for sizes rounded up to
    unit_bytes, which can only cost more than the byte-exact optimum."""
    ops, keep = table
    plan = solve_op_milp(ops, keep_bytes=keep)
    assert plan.saved_bytes <= keep
    exact = _brute_force_ms(ops, keep)
    if plan.exact:
        assert plan.recompute_ms == pytest.approx(exact, abs=1e-9)
    else:
        assert exact - 1e-9 <= plan.recompute_ms
        assert plan.recompute_ms == pytest.approx(_brute_force_ms(ops, keep, plan.unit_bytes), abs=1e-9)
        assert plan.unit_bytes <= 2 * sum(o.memory_bytes for o in ops) / 2**20  # rounding stays tiny
    forced = _forced(ops)
    views = [i for i, o in enumerate(ops) if o.is_view]
    assert all(plan.decisions[i] is (S if i in forced else R) for i in views)
    assert len({d for d, o in zip(plan.decisions, ops) if o.is_random}) <= 1


def test_unaligned_sizes_use_a_coarser_row_and_say_so() -> None:
    """gcd 1 with 100 MiB ops would need 1e8-sized coefficients: sizes round up to 128 bytes.
    Byte-exact, A + B (200 MiB + 1) fits exactly; rounded up it does not, so A + C is chosen."""
    ops = [op("aten.mm", 2.0, 100),
           SACOp(func="aten.mm", occurrence=1, runtime_ms=1.0, memory_bytes=100 * MiB + 1),
           op("aten.mm", 0.5, 100)]
    plan = solve_op_milp(ops, keep_bytes=200 * MiB + 1)
    assert plan.decisions == (S, R, S)
    assert (plan.exact, plan.unit_bytes, plan.recompute_ms) == (False, 128, 1.0)
    aligned = solve_op_milp(ops[:1] + ops[2:], keep_bytes=100 * MiB)
    assert aligned.exact and aligned.unit_bytes == 100 * MiB
