"""Benchmarks (run as modules: python -m bench.data_bench, ...)."""
