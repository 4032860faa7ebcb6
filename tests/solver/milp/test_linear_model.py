"""solver/milp/linear_model.py: HiGHS answers checked where its tolerances decide.

HiGHS 1.16 answers some small models wrongly at either integrality tolerance, each time right at
the other (``LinearModel.solve``). The stacks here were drawn by property runs of 200 to 1,000
examples; each pins what a correct backend gives: CBC's MILP value, or its smallest peak and the
recompute of its plan there. Every solve here is HiGHS alone (``dynamic_program=False``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimators.contract.module_info import ModuleInfo
from solver import SACMilp, SolverOptions, predict_peak_bytes

DATA = Path(__file__).parents[1] / "data"
HIGHS = SolverOptions(rel_gap=0.0, count_branching=False, dynamic_program=False)


def _milp_ms(m: SACMilp, budget: int) -> float | None:
    """The MILP's optimal recompute time at ``budget`` (None: infeasible) straight from the
    backend, before ``solve`` settles the ratios in bytes."""
    model = m.milp()
    sol = model.solve(budget, m.options)
    assert sol.outcome.proven or not sol.outcome.has_solution
    return float(sum(sol.values[j] for j in model.rct)) if sol.outcome.has_solution else None


def _plans_fit(info: ModuleInfo, frac: float) -> None:
    """The plan fits in exact bytes and a second solve gives the same plan; at the smallest
    reachable peak (a sliver the backend's tolerances decide) the model plans its own stated
    smallest budget."""
    m = SACMilp(info, options=HIGHS)
    lo, hi = m.min_reachable_peak_bytes(), m.no_ac_peak_bytes
    budget = lo + int(frac * (hi - lo)) if lo + int(frac * (hi - lo)) - lo > 1e-6 * hi else lo
    res = m.solve(budget)
    assert res.predicted_peak_bytes <= budget
    assert predict_peak_bytes(info, res.discarded_bytes) == res.predicted_peak_bytes
    assert m.solve(budget).decisions == res.decisions


def _presolve_stacks() -> list[tuple[float, ModuleInfo, float | None]]:
    return [(c["frac"], ModuleInfo.from_dict(c["info"]), c["expected_ms"])
            for c in json.loads((DATA / "highs_presolve_stacks.json").read_text())]


@pytest.mark.parametrize("case", range(5))
def test_stacks_that_misled_highs(case) -> None:
    """One HiGHS solve of each answers wrongly: at integrality tolerance 1e-8 "infeasible"
    where CBC proves 1.8817 ms, 3.0258 ms "optimal" against 2.6508 ms, "infeasible" holding an
    8.5 ms plan at the smallest peak; at 1e-6, 7.55 ms "optimal" against 7.50 ms and
    "infeasible" where 0.5 ms is optimal. The checked answer is CBC's (on the first stack, at
    the smallest peak, CBC contradicts itself: there only the plan's fit is checked)."""
    frac, info, expected = _presolve_stacks()[case]
    _plans_fit(info, frac)
    if expected is not None:
        m = SACMilp(info, options=HIGHS)
        lo, hi = m.min_reachable_peak_bytes(), m.no_ac_peak_bytes
        got = _milp_ms(m, lo + int(frac * (hi - lo)))
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("case", range(3))
def test_smallest_peak_plans_of_stacks_that_misled_highs(case) -> None:
    """Stacks of two blocks planned at their smallest reachable peak: the min-peak model was
    called infeasible at 1e-8 with every presolve; 7.1 ms was proven "optimal" where 2.1 ms fits
    (a plan one byte past a 5 ms step of a curve); the budget was called infeasible where one
    byte fewer in each block fits at 2.1 ms. Pinned: CBC's smallest peak and its plan's
    recompute there."""
    c = json.loads((DATA / "highs_smallest_peak_stacks.json").read_text())[case]
    info, min_peak, expected_ms = ModuleInfo.from_dict(c["info"]), c["min_peak_bytes"], c["recompute_ms"]
    for options in (HIGHS, SolverOptions()):
        m = SACMilp(info, options=options)
        assert m.min_reachable_peak_bytes() == min_peak
        res = m.solve(min_peak)
        assert res.predicted_peak_bytes <= min_peak
        assert res.recompute_ms == pytest.approx(expected_ms, rel=1e-9)


def test_where_highs_finds_no_plan_at_the_smallest_peak_cbc_plans_it() -> None:
    """A stack of four blocks at its smallest reachable peak, whose recompute growth varies with
    the ratio (the program's two runs do not settle it): HiGHS finds no plan, and the least-peak
    plan costs 19.4 ms; CBC plans the same budget at 17.94 ms, and that plan is returned."""
    case = json.loads((DATA / "highs_refuses_smallest_peak_stack.json").read_text())
    info = ModuleInfo.from_dict(case["info"])
    for options in (HIGHS, SolverOptions()):
        res = SACMilp(info, options=options).solve(case["budget"])
        assert res.predicted_peak_bytes <= case["budget"]
        assert res.recompute_ms == pytest.approx(case["cbc_recompute_ms"], rel=1e-9)


def test_where_every_tight_solve_is_a_solve_error_a_looser_referee_proves_the_optimum() -> None:
    """A stack of two blocks at its smallest reachable peak (drawn by CI's property run): HiGHS
    at 1e-8 ends in "Solve error" with every presolve, and the 1e-6 plan's integers cost 9.06 ms
    at 1e-8 against an optimum of 0.0625 ms. The referee's 1e-7 solve proves the optimum:
    CBC's (HiGHS at 1e-9 agrees to 2e-9)."""
    case = json.loads((DATA / "highs_solve_error_stack.json").read_text())
    info = ModuleInfo.from_dict(case["info"])
    m = SACMilp(info, options=HIGHS)
    assert m.min_reachable_peak_bytes() == case["budget"]
    assert _milp_ms(m, case["budget"]) == pytest.approx(case["cbc_milp_ms"], rel=1e-6)
    _plans_fit(info, 0.0)


@pytest.mark.multiproc
def test_the_first_highs_of_a_process_prints_nothing_on_stdout() -> None:
    """HiGHS prints its banner on stdout whatever its options: it would land in the user's own
    output (and break ``--json``). The first instance of a process is made with stdout closed."""
    import subprocess
    import sys

    code = ("from tests.solver.builders import chain, MiB\n"
            "from solver import SolverOptions, solve_milp\n"
            "solve_milp(chain(), 300 * MiB, options=SolverOptions(dynamic_program=False))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
