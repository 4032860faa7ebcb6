"""Plans for multi-rank jobs: one plan for every rank, FSDP2's per-rank memory."""
