"""The registered benchmark case modules, shared by the CLI and pytest-benchmark.

To benchmark another op, add a module with ``cases(platform, quick) ->
list[harness.Case]`` and list it in :data:`CASE_MODULES`.
"""
from __future__ import annotations

from benchmarks import (attention, cross_entropy, decode, decoder_ops, harness, matmul, moe, norms,
                        serving, softmax)

CASE_MODULES = (matmul, norms, softmax, cross_entropy, attention, decode, decoder_ops, serving, moe)


def collect_cases(platform: str, quick: bool = False, substring: str | None = None) -> list[harness.Case]:
    """Every registered case for ``platform`` whose name contains ``substring``."""
    found = [c for module in CASE_MODULES for c in module.cases(platform, quick=quick)]
    return [c for c in found if substring is None or substring in c.name]
