"""planner/format.py: byte units at their edges."""

import pytest

from planner.format import byte_unit, fmt_bytes


def test_byte_units_at_their_edges():
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 2**20 - 1, 2**20, 2**30, -3 * 2**20)] == [
        "0 B", "1023 B", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1.00 GiB", "-3.00 MiB"]
    assert fmt_bytes(1536, digits=0) == "2 KiB" and fmt_bytes(1536, digits=3) == "1.500 KiB"
    assert [byte_unit(n) for n in (5, 2**10, 2**20 + 1, 2**40)] == [
        (1, "B"), (2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB")]




@pytest.mark.parametrize("budget_gib", [1e-12, 5e-10, 9.3e-10])
def test_a_budget_under_one_byte_says_so(budget_gib):
    # Issue 33, row 12. Before: solve_sac(model, 1e-12) blamed "the reserve (0 B)", which must be
    # "below the budget (0 B)".
    from planner.errors import PlanningError
    from planner.format import check_budget_gib

    with pytest.raises(PlanningError, match=rf"budget_gib={budget_gib:g} GiB is .* bytes, less than one byte: budgets are in GiB"):
        check_budget_gib(budget_gib)
    assert check_budget_gib(1 / 2**30) == 1 / 2**30  # one byte is a budget (an infeasible one)
