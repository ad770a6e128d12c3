"""Benchmarks, run from the repository root as modules: ``python -m benchmarks.offline --help``."""
