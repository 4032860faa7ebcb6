"""Solver: plain numbers in (a ModuleInfo), a SAC plan out. Never imports torch.

    from solver import solve_milp
    res = solve_milp(info, budget_bytes=int(40 * 2**30))
    res.decisions, res.predicted_peak_bytes, res.recompute_ms
"""

from solver.errors import InfeasibleBudgetError
from solver.graph import Graph
from solver.sac_milp import SACMilp, min_reachable_peak_bytes, predict_peak_bytes, solve_milp
from solver.op_milp import OpDecision, solve_op_milp
from solver.options import Backend, SolveResult, SolverOptions, SolveStatus

__all__ = [
    "solve_milp",
    "SACMilp",
    "min_reachable_peak_bytes",
    "predict_peak_bytes",
    "solve_op_milp",
    "OpDecision",
    "Graph",
    "SolverOptions",
    "Backend",
    "SolveResult",
    "SolveStatus",
    "InfeasibleBudgetError",
]
