"""Checking and showing plans: gradient checks, measured steps, reports and plots."""
