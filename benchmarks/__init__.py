"""Benchmark suite for the ops (docs/design.md §8).

``python -m benchmarks`` times every registered op against a plain-JAX (XLA)
baseline on the default device and writes results.json / .md / .png;
``pytest benchmarks --benchmark-only`` runs the same cases under
pytest-benchmark. Timing helpers live in :mod:`benchmarks.harness`, one module
per op lists that op's cases (today :mod:`benchmarks.matmul`).
"""
