"""Checking and showing plans: gradient checks, measured steps, the policies used today, reports
and plots.

    from planner.analysis import hand_made_baselines, measure_steps, plot_tradeoff, tradeoff_table_text
"""

from planner.analysis.gradcheck import GradientCheck, check_gradients
from planner.analysis.measure import MeasuredStep, StepPeaks, measure_run, measure_steps
from planner.analysis.plotting import plot_tradeoff
from planner.analysis.report import (
    gradient_check_text,
    prediction_vs_measurement,
    step_time_curves_text,
    steps_vs_prediction,
    tradeoff_table_text,
)
from planner.planning.baselines import BaselinePoint, hand_made_baselines
from planner.planning.tradeoff import StepTimeCurves, TradeoffTable, step_time_curves

__all__ = [
    "check_gradients",
    "GradientCheck",
    "measure_steps",
    "measure_run",
    "MeasuredStep",
    "StepPeaks",
    "hand_made_baselines",
    "BaselinePoint",
    "step_time_curves",
    "StepTimeCurves",
    "TradeoffTable",
    "plot_tradeoff",
    "tradeoff_table_text",
    "step_time_curves_text",
    "gradient_check_text",
    "prediction_vs_measurement",
    "steps_vs_prediction",
]
