"""Benchmarks. Each script runs as a module from the repository root, e.g.
``python -m bench.onoff``; those that drive a whole stack start it through
``bench.harness``."""
