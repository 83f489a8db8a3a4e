"""``gmm``: the grouped matmul's forward (and ``dlhs``) kernel on the tiled-matmul core.

``out[rows of group g] = lhs[rows of g] @ B[g]`` where ``B`` is ``rhs``
(forward, contracting K) or ``rhs`` transposed (``dlhs = dout @ rhs[g]^T``,
contracting N). Programs walk (row-tile visit, column tile); the visits come
from :func:`ops.moe.group_table.row_visits` through scalar prefetch: visit
``v`` reads row tile ``tile[v]`` of lhs and ``rhs[group[v]]``, multiplies
(skipped for a zero segment), and stores only rows ``[lo[v], hi[v])`` of
the output tile. Every output row belongs to exactly one visit.

How the partial stores are made depends on how programs run:

* ``interpret`` and ``mosaic_tpu`` run the grid in order: the grid is
  (column tile, visit, K), so the visits of one output tile are consecutive
  and the block stays resident across them; each visit merges its rows into
  it (``where(row in [lo, hi), value, block)``), megablox's scheme.
* ``triton``'s programs run concurrently: the grid is (visit, column tile),
  both parallel, K walked by an in-kernel loop whose trip count is 0 for a
  zero segment; each visit stores its rows with a masked store, so visits of
  one tile write disjoint rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.matmul import tiled
from ops.moe import group_table
from ops.moe.config import RaggedDotConfig


def walk(backend: str) -> str:
    """The grouped kernels' walk: programs in order (grid) on interpret and mosaic_tpu,
    concurrent programs with in-kernel loops on the Triton backends."""
    return tiled.LOOP if backend in pl.TRITON_BACKENDS else tiled.GRID


def _store_rows(acc, refs: tiled.TileRefs, *, block_m: int, masked_store: bool):
    """Stores rows ``[lo, hi)`` of the visit's tile: the accumulator (zeros where inactive)."""
    tile_ref, _, lo_ref, hi_ref, _ = refs.scalars
    v = pl.program_id(refs.row_axis)
    row = tile_ref[v] * block_m + lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    keep = (row >= lo_ref[v]) & (row < hi_ref[v])
    out_ref = refs.outs[0]
    value = acc.astype(out_ref.dtype)
    if masked_store:
        pl.store(out_ref, (slice(None), slice(None)), value, mask=keep)
    else:
        out_ref[...] = jnp.where(keep, value, out_ref[...])


def gmm(lhs, rhs, visits: group_table.Visits, *, transpose_rhs: bool, config: RaggedDotConfig,
        backend: str, out_dtype, walk_override: str | None = None, name: str = "ragged_dot"):
    """``[M, N_out]``: each row of ``lhs`` times its group's ``rhs`` slice.

    Args:
      lhs: ``[M, C]`` (C contracted).
      rhs: ``[G_local, C, N_out]``, or ``[G_local, N_out, C]`` with
        ``transpose_rhs``.
      visits: the row visits (:func:`ops.moe.group_table.row_visits` with
        ``config.block_m``).
      config: tiles ``(block_m, block_n, block_k)``: output rows, output
        columns, contraction step (for ``dlhs`` the caller passes them by role).
      walk_override: force ``"grid"`` / ``"loop"`` (tests run both on the
        interpreter); None: :func:`walk` of the backend.
    """
    w = walk_override or walk(backend)
    bm, bn, bk = config.blocks
    m = lhs.shape[0]
    n_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_visits = visits.tile.shape[0]
    rows = tiled.RowTable(
        tables=visits.tables(), num_visits=num_visits,
        row_block=lambda v, tile, group, lo, hi, active: tile[v],
        b_index=lambda v, tile, group, lo, hi, active: group[v],
        active=lambda v, tile, group, lo, hi, active: active[v] != 0)
    if w == tiled.GRID:
        params = pl.CompilerParams((pl.PARALLEL, pl.ARBITRARY, pl.ARBITRARY))
    else:
        params = pl.triton.CompilerParams(
            num_warps=config.num_warps or tiled.default_num_warps(bm, bn),
            num_stages=config.num_stages or 3, dimension_semantics=(pl.PARALLEL, pl.PARALLEL))
    epilogue = functools.partial(_store_rows, block_m=bm, masked_store=w == tiled.LOOP)
    return tiled.matmul_call(
        lhs, rhs, ca=1, cb=1 if transpose_rhs else 0, blocks=(bm, bn, bk), backend=backend,
        out_shape=[jax.ShapeDtypeStruct((m, n_out), out_dtype)], epilogue=epilogue, walk=w,
        k_edge="mask", compiler_params=params, rows=rows, cols_outer=w == tiled.GRID,
        name=name)[0]
