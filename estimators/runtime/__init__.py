"""Runtime models: target devices, the roofline, measured kernel and collective timings."""
