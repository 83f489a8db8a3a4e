"""Tile-level building blocks shared by the kernels of every op family.

:func:`dot` is the one product every kernel's tiles go through (attention's
per-tile math, the tiled matmul of ``fused_matmul`` and the logits tiles of
``linear_cross_entropy``); :func:`mosaic_tpu_matmul_blocks` is the tile
heuristic of matmul-shaped work on ``mosaic_tpu``.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# block_k candidates on mosaic_tpu, largest first: multiples of the 128-lane tiling.
_TPU_BLOCK_K = (512, 256, 128)


def dot(a, b, ca: int, cb: int):
    """``A @ B`` where A contracts a's dim ``ca`` and B contracts b's dim ``cb``
    (two-dimensional tiles), accumulated in float32: IEEE float32 products
    (``Precision.HIGHEST``) for float32 tiles, the hardware's 16-bit products
    otherwise."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def mosaic_tpu_matmul_blocks(m: int, n: int, k: int, *, max_m: int, max_n: int) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)`` of an ``[m, k] @ [k, n]`` tile loop on
    ``mosaic_tpu``: a dim no larger than its cap is one whole block (a block
    equal to the array's dim is always a legal Mosaic block, whatever its
    size); a larger one takes the op's cap ``max_m`` / ``max_n`` (multiples
    of the 8 x 128 tiling, chosen by the op for its VMEM budget). The
    contraction takes 512, or 256 or 128 when one of those divides K and 512
    does not, so no padded copy of the operands is made."""
    bm = m if m <= max_m else max_m
    bn = n if n <= max_n else max_n
    if k <= _TPU_BLOCK_K[0]:
        bk = k
    else:
        bk = next((c for c in _TPU_BLOCK_K if k % c == 0), _TPU_BLOCK_K[0])
    return bm, bn, bk
