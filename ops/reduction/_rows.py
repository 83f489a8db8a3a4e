"""Shared machinery for row-wise kernels (norms, softmax family, cross-entropy).

Every row-wise op sees its input as ``[rows, features]`` and reduces along
``features``. One kernel layout serves all of them on every backend:

* a program owns ``block_rows`` rows and a *full-row* block, ``[block_rows,
  padded_cols]``, whose width covers every feature (padded per backend, see
  :func:`row_layout`);
* the kernel walks the row in ``chunk`` -wide column slices with an
  in-kernel loop (:func:`for_each_chunk`), so rows far wider than one chunk
  (V = 128k logits) work with a bounded working set, and no grid axis has to
  run sequentially (JAX's Pallas Triton runs every program concurrently);
* columns at or past ``features`` hold unspecified padding (seed 000), so the
  last chunk is masked with :func:`column_mask`; rows past the end are
  discarded on store and need no mask unless they feed a cross-row sum.

Block widths per backend: on ``pallas_triton`` the full-row block is the next
power of two (loads are what must be powers of two, and the loop never runs
past ``features``); on ``mosaic_tpu`` and ``interpret`` it is a whole number of
chunks (chunks are multiples of 128, the TPU lane width), so no slice runs
past the block.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How ``[rows, features]`` is tiled.

    Attributes:
      rows, features: the 2-D problem.
      block_rows: rows per program.
      chunk: columns per loop step (a power of two).
      num_chunks: loop trip count, ``cdiv(features, chunk)``.
      padded_cols: width of the full-row block (>= num_chunks * chunk).
    """

    rows: int
    features: int
    block_rows: int
    chunk: int
    num_chunks: int
    padded_cols: int

    @property
    def grid(self) -> tuple[int]:
        return (pl.cdiv(self.rows, self.block_rows),)

    @property
    def needs_column_mask(self) -> bool:
        return self.num_chunks * self.chunk != self.features

    def row_spec(self) -> pl.BlockSpec:
        """The full-row block of program ``i``: rows ``[i*block_rows, ...)``, all columns."""
        return pl.BlockSpec((self.block_rows, self.padded_cols), lambda i: (i, 0))

    def stat_spec(self) -> pl.BlockSpec:
        """A per-row statistic stored as ``[rows, 1]`` float32 (mean, rstd, logsumexp...)."""
        return pl.BlockSpec((self.block_rows, 1), lambda i: (i, 0))


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def row_layout(rows: int, features: int, dtype, backend: str, *, max_chunk: int | None = None,
               block_rows: int | None = None) -> RowLayout:
    """Tiles a ``[rows, features]`` row-wise problem for ``backend``.

    Args:
      dtype: the input dtype (wider dtypes get narrower chunks, so a chunk of a
        few rows stays within registers / VMEM).
      max_chunk: cap on the chunk width (a power of two >= 128); tests use a
        small cap to exercise multi-chunk rows on small shapes.
      block_rows: rows per program; None picks 8 on TPU (the sublane count)
        and 4 elsewhere, fewer for very small problems.
    """
    if max_chunk is None:
        max_chunk = 4096 if np.dtype(dtype).itemsize <= 2 else 2048
    if max_chunk < 128 or max_chunk & (max_chunk - 1):
        raise ValueError(f"max_chunk must be a power of two >= 128, got {max_chunk}.")
    chunk = min(max_chunk, max(128, _next_pow2(features)))
    num_chunks = max(1, pl.cdiv(features, chunk))
    if backend == "pallas_triton":
        padded = max(chunk, _next_pow2(features))
    else:
        padded = num_chunks * chunk
    if block_rows is None:
        block_rows = 8 if backend == "mosaic_tpu" else 4
        if rows < block_rows and backend != "mosaic_tpu":
            block_rows = max(1, _next_pow2(rows))
    if backend == "mosaic_tpu" and block_rows != rows and block_rows % 8:
        raise ValueError(f"block_rows must be a multiple of 8 on mosaic_tpu, got {block_rows}.")
    return RowLayout(rows=rows, features=features, block_rows=block_rows, chunk=chunk,
                     num_chunks=num_chunks, padded_cols=padded)


def as_rows(x) -> tuple[jax.Array, tuple[int, ...]]:
    """``x [..., features]`` as ``[rows, features]``, with the leading shape to undo it."""
    lead = x.shape[:-1]
    return x.reshape((-1, x.shape[-1])), lead


def chunk_slice(layout: RowLayout, c):
    """The column indexer of chunk ``c`` (may be traced): ``ref[:, chunk_slice(...)]``."""
    return pl.ds(c * layout.chunk, layout.chunk)


def column_mask(layout: RowLayout, c, shape) -> jax.Array | None:
    """True where chunk ``c``'s columns are real features; None when no chunk needs it."""
    if not layout.needs_column_mask:
        return None
    col = c * layout.chunk + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    return col < layout.features


def row_mask(layout: RowLayout, shape) -> jax.Array | None:
    """True where this program's rows are real (for sums across rows); None if all are."""
    if layout.rows % layout.block_rows == 0:
        return None
    row = pl.program_id(0) * layout.block_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    return row < layout.rows


def load_chunk(ref, layout: RowLayout, c, *, fill=0.0) -> jax.Array:
    """Chunk ``c`` of a full-row block as float32, padding columns set to ``fill``."""
    value = ref[:, chunk_slice(layout, c)].astype(jnp.float32)
    mask = column_mask(layout, c, value.shape)
    return value if mask is None else jnp.where(mask, value, fill)


def for_each_chunk(layout: RowLayout, body, init):
    """``carry = body(c, carry)`` for every chunk ``c``, as one loop (a single step unrolled)."""
    if layout.num_chunks == 1:
        return body(0, init)
    return lax.fori_loop(0, layout.num_chunks, body, init)
