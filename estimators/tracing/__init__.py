"""One training step traced op by op, and everything derived from that trace."""
