"""From a traced step to a verified Plan: solve, floor, verification, trade-off curves."""
