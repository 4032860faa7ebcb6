"""The module-level MILP for a backend: the model as arrays (``model``, ``linear_model``), HiGHS
called directly, CBC and the other PuLP models through ``backend``."""
