"""The registered benchmark case modules, shared by the CLI and pytest-benchmark.

To benchmark another op, add a module with ``cases(platform, quick) ->
list[harness.Case]`` and list it in :data:`CASE_MODULES`.

:func:`run_order` is the order the CLI runs cases in: the cases the project's
targets are judged on first (:data:`HEADLINE_CASES`), then the rest taking one
case of each op in turn, so that a run cut short by its time budget has
measured the headline numbers and something of every op.
"""
from __future__ import annotations

from benchmarks import (attention, cross_entropy, decode, decoder_ops, harness, matmul, moe, norms,
                        serving, softmax)

CASE_MODULES = (matmul, norms, softmax, cross_entropy, attention, decode, decoder_ops, serving, moe)

# Name prefixes of the cases the targets are judged on (attention at T = 8k against
# cuDNN, matmul against cuBLAS, the memory-bound ops against the copy bandwidth, linear
# cross-entropy's memory at V = 128k), then one main shape of each other op family:
# run first, in this order. Every prefix names at least one accelerator case (a test
# checks), so a renamed case cannot drop out of the headline silently.
HEADLINE_CASES = (
    "dot_product_attention/causal/2x8192x8192x16x16x128/bfloat16/",
    "dot_product_attention/full/2x8192x8192x16x16x128/bfloat16/",
    "fused_matmul/plain/8192x8192x8192/bfloat16/",
    "fused_matmul/bias+gelu_exact/8192x8192x8192/bfloat16/",
    "fused_matmul/plain/4096x4096x4096/bfloat16/",
    "rms_norm/scale/16384x4096/bfloat16/",
    "layer_norm/scale+bias/16384x4096/bfloat16/",
    "softmax/axis=-1/16384x4096/bfloat16/",
    "cross_entropy/plain/8192x131072/bfloat16/",
    "linear_cross_entropy/plain/8192x4096x131072/bfloat16/",
    "dot_product_attention/causal/2x8192x8192x32x32x64/bfloat16/",
    "dot_product_attention/causal+gqa8/",
    "gated_linear_unit/swiglu/8192x4096x14336/bfloat16/",
    "gated_linear_unit/swiglu/pair/8192x4096x14336/bfloat16/",
    "paged_attention/decode+gqa8/8x32768x",
    "ragged_paged_attention/",
    "ragged_dot/8-experts/32768x4096x14336/bfloat16/",
    "apply_rotary_embedding/rotate_half/4x4096x32x128/bfloat16/",
)


def collect_cases(platform: str, quick: bool = False, substring: str | None = None) -> list[harness.Case]:
    """Every registered case for ``platform`` whose name contains ``substring``."""
    found = [c for module in CASE_MODULES for c in module.cases(platform, quick=quick)]
    return [c for c in found if substring is None or substring in c.name]


def headline_rank(name: str) -> int | None:
    """Position of the first :data:`HEADLINE_CASES` prefix of ``name``; None if none."""
    return next((i for i, prefix in enumerate(HEADLINE_CASES) if name.startswith(prefix)), None)


def headline(cases: list[harness.Case], quick: bool = False) -> list[harness.Case]:
    """The headline cases among ``cases``, in :data:`HEADLINE_CASES` order. ``quick`` cases
    are small and named otherwise: there, each op of the headline its first case."""
    if not quick:
        return [c for c in run_order(cases) if headline_rank(c.name) is not None]
    ops = list(dict.fromkeys(prefix.split("/")[0] for prefix in HEADLINE_CASES))
    first = {}
    for c in cases:
        first.setdefault(c.op, c)
    return [first[op] for op in ops if op in first]


def run_order(cases: list[harness.Case]) -> list[harness.Case]:
    """``cases`` in the order to run them: headline cases by :func:`headline_rank`, then
    the others one op at a time in turn (each op's cases keep their registered order)."""
    headline = sorted((c for c in cases if headline_rank(c.name) is not None),
                      key=lambda c: headline_rank(c.name))  # stable: fwd before fwd+bwd
    queues: dict[str, list[harness.Case]] = {}
    for c in cases:
        if headline_rank(c.name) is None:
            queues.setdefault(c.op, []).append(c)
    rest = []
    while any(queues.values()):
        rest += [queue.pop(0) for queue in queues.values() if queue]
    return headline + rest
