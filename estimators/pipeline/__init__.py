"""Pipeline parallelism as the estimators see it: a torch schedule's action order per rank
(``schedule``), one traced micro-batch of a stage as numbers (``profile``, ``stage_trace``), the
rank's memory over its schedule (``memory``), the MILP's rows for it (``points``) and the step's
makespan (``makespan``)."""
