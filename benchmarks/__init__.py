"""Reproducible benchmarks; each module prints its environment and a ratio against a baseline."""
