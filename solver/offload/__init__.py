"""Keep, recompute or offload: the three-way MILP (``milp``) and what a module can offload (``cost``)."""
