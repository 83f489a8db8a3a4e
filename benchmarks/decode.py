"""Benchmark cases for decode with ``ops.dot_product_attention``: split-KV decode.

One new query per sequence against a dense key/value cache, every sequence
full: ``query [B, 1, N, H]``, ``key / value [B, S, K, H]``. Our kernels
(:func:`benchmarks.harness.kernel_implementations`; the op picks split-KV
decode, :mod:`ops.attention.decode`, by its heuristic) against the baseline a
user writes without us, ``jax.nn.dot_product_attention(implementation="xla")``
in the inputs' dtype, jitted, and on GPUs jax.nn's cuDNN path (an error row
where cuDNN rejects the shape).

Decode is memory-bound (``ceiling="copy"``): one call reads the keys and
values once, ``2 B S K H s`` bytes at ``s`` bytes per element, plus the
queries and outputs (``2 B N H s``); GB/s is of those bytes and ``%
ceiling`` the fraction of a copy of as many bytes on the same device.
FLOPs: ``4 B N S H``. Tokens per second, one new token per sequence per
call, is ``B / time``.

Accuracy is against exact attention in float64
(:func:`benchmarks.attention.exact_reference`, independent of ``ops``).

Shapes ``(B, T, S, N, K, H)`` as attention's: GPUs decode batches of 1, 8
and 64 at contexts of 1k, 8k, 32k and 128k tokens, GQA 8:1 (32 query heads
over 4 key/value heads of 128, Llama-3-8B's attention), bfloat16; CPUs run
the interpreters at tiny sizes.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from benchmarks import attention, harness

OP = "dot_product_attention"

ACCELERATOR_SHAPES = tuple(attention.Shape(b, 1, s, 32, 4, 128, False, "bfloat16")
                           for b in (1, 8, 64) for s in (1024, 8192, 32768, 131072))
CPU_SHAPES = (attention.Shape(2, 1, 1000, 8, 1, 32, False, "float32"),
              attention.Shape(1, 1, 2048, 16, 2, 64, False, "bfloat16"))
QUICK_SHAPES = {"cpu": (CPU_SHAPES[0],),
                "accelerator": (attention.Shape(8, 1, 8192, 32, 4, 128, False, "bfloat16"),)}


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """The decode rows for ``platform`` (forward only: generation runs no backward)."""
    shapes = harness.pick_shapes(platform, quick, cpu=CPU_SHAPES, accelerator=ACCELERATOR_SHAPES,
                                 quick_shapes=QUICK_SHAPES)
    ours = harness.kernel_implementations(platform)
    extra = attention.extra_implementations(platform)
    return [make_case(shape, ours, extra) for shape in shapes]


def kv_bytes(shape: attention.Shape) -> float:
    """Bytes one decode call must move: the keys and values once, the queries and outputs."""
    b, t, s, n, k, h = shape.dims
    itemsize = jnp.dtype(shape.dtype).itemsize
    return float(2 * b * s * k * h * itemsize + 2 * b * t * n * h * itemsize)


def make_case(shape: attention.Shape, implementations, extra=()) -> harness.Case:
    case = attention.make_case(shape, "fwd", implementations, extra)
    b, t, s, n, _, h = shape.dims
    return harness.Case(
        op=OP, variant=f"decode+gqa{shape.heads // shape.kv_heads}", shape=shape.dims,
        dtype=shape.dtype, pass_name="fwd", flops=4.0 * b * t * n * s * h,
        make_inputs=functools.partial(attention._make_inputs, shape=shape, with_cotangent=False),
        implementations=case.implementations, reference=case.reference, ceiling="copy",
        bytes_accessed=kv_bytes(shape))
