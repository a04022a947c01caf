"""Benchmarking: prompt sets, runs and the figures `appliance bench` and `appliance sweep` report."""
