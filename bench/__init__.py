"""Benchmarks for ckptfix (`python -m bench.run --help`). Not part of the installed package."""
