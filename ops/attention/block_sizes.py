"""Tile sizes of the attention kernels: :class:`BlockSizes` and the per-backend heuristic."""
from __future__ import annotations

import dataclasses

import numpy as np

import pallas_core as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the attention kernels (``block_sizes=`` of :func:`ops.dot_product_attention`).

    Attributes:
      block_q, block_k: query / key-value rows per tile of the forward and dQ
        kernels.
      block_q_dkv, block_k_dkv: the same for the dK/dV kernel (None: as the
        forward's).
      num_warps, num_stages: Triton launch parameters (None: the heuristic's).

    On ``pallas_triton`` block sizes must be powers of two; on ``mosaic_tpu``
    a query block must be a multiple of 8 (or T) and a key block a multiple of
    128 (or S); every backend needs them positive, and ``triton`` needs them
    >= 16 (``tl.dot``'s minimum).
    """

    block_q: int
    block_k: int
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def resolved(self) -> "BlockSizes":
        return dataclasses.replace(self, block_q_dkv=self.block_q_dkv or self.block_q,
                                   block_k_dkv=self.block_k_dkv or self.block_k)


def default_block_sizes(T: int, S: int, head_dim: int, dtype, backend: str) -> BlockSizes:
    """The heuristic (untuned until a GPU run): tiles that fit each backend's memories.

    * triton / pallas_triton: 128-row query tiles and 64-row key tiles for
      16-bit inputs (32 for float32, whose tiles take twice the shared memory),
      halved for head dims above 128, as FlashAttention-2's Triton kernels on
      sm_80/sm_90; never more than the (power-of-two rounded) sequence.
    * mosaic_tpu: 128 x 128 (the MXU and lane width), or the whole sequence
      when shorter.
    * interpret: 64 x 64, or the whole (rounded) sequence when shorter.
    """
    wide = np.dtype(dtype).itemsize >= 4
    if backend in pl.TRITON_BACKENDS:
        bq, bk = (128, 32 if wide else 64) if head_dim <= 128 else (64, 32)
        bq = min(bq, max(16, pl.next_power_of_2(T)))
        bk = min(bk, max(16, pl.next_power_of_2(S)))
        return BlockSizes(bq, bk, block_q_dkv=min(bk, bq), block_k_dkv=bk)
    if backend == "mosaic_tpu":
        return BlockSizes(T if T <= 128 else 128, S if S <= 128 else 128)
    return BlockSizes(min(64, pl.next_power_of_2(T)), min(64, pl.next_power_of_2(S)))
