"""The exact chain program: the module-level MILP solved by dynamic programming where the step
is a clean nest (``prefix_dp``), over piecewise-linear value functions (``pwl``)."""
