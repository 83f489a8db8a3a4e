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
* ``pallas_triton`` (JAX's Triton lowering has no scalar prefetch, and
  pallas_core refuses an output block that concurrent programs share): the
  grid is (row tile, column tile) and each program loops over its tile's
  visits (:func:`gmm_by_tile`), merging each visit's rows into a register
  tile stored once; the tables are ordinary operands, rhs a whole block
  (padded to powers of two, as that lowering wants) whose group each visit
  indexes in the kernel.
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
    """The grouped kernels' walk: the backend's (``pl.backend_traits(backend).walk``):
    programs in order (grid) on interpret and mosaic_tpu, concurrent programs with
    in-kernel loops on the Triton backends."""
    return pl.backend_traits(backend).walk


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
        # Bands of 8 visits (Triton's grouped ordering on our triton backend): a column
        # tile of rhs[g] is read by 8 row tiles while it sits in L2, instead of every
        # row tile sweeping all of rhs[g] (117 MB at Mixtral's 4096 x 14336).
        params = pl.triton.CompilerParams(
            num_warps=config.num_warps or tiled.default_num_warps(bm, bn),
            num_stages=config.num_stages or 3, group_size=config.group_size or 8,
            dimension_semantics=(pl.PARALLEL, pl.PARALLEL))
    epilogue = functools.partial(_store_rows, block_m=bm, masked_store=w == tiled.LOOP)
    return tiled.matmul_call(
        lhs, rhs, ca=1, cb=1 if transpose_rhs else 0, blocks=(bm, bn, bk), backend=backend,
        out_shape=[jax.ShapeDtypeStruct((m, n_out), out_dtype)], epilogue=epilogue, walk=w,
        k_edge="mask", compiler_params=params, rows=rows, cols_outer=w == tiled.GRID,
        epilogue_subtile=config.epilogue_subtile, name=name)[0]


def tables_in_scalar_memory(backend: str) -> bool:
    """Whether ``backend`` reads the visit tables through scalar prefetch (all but
    pallas_triton, whose lowering has none: there they are ordinary operands)."""
    return pl.backend_traits(backend).scalar_prefetch


def _by_tile_kernel(first_ref, group_ref, lo_ref, hi_ref, active_ref, lhs_ref, rhs_ref, out_ref,
                    *, block_m: int, block_k: int, num_k: int, k_size, transpose_rhs: bool):
    i = pl.program_id(0)
    row = i * block_m + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)

    def visit(v, tile):
        trips = jnp.where(active_ref[v] != 0, num_k, 0)
        acc = tiled.loop_accumulate(
            lhs_ref, rhs_ref, ca=1, cb=1 if transpose_rhs else 0, block_k=block_k, num_k=trips,
            out_shape=out_ref.shape, k_size=k_size, b_lead=(group_ref[v],))
        return jnp.where((row >= lo_ref[v]) & (row < hi_ref[v]), acc, tile)

    tile = lax.fori_loop(first_ref[i], first_ref[i + 1], visit,
                         jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = tile.astype(out_ref.dtype)


def gmm_by_tile(lhs, rhs, visits: group_table.Visits, *, transpose_rhs: bool,
                config: RaggedDotConfig, backend: str, out_dtype, name: str = "ragged_dot"):
    """:func:`gmm` with programs over (row tile, column tile), each looping over its
    tile's visits, the tables as ordinary operands (pallas_triton's form; any backend
    runs it). Every output block has one program; rhs is one block per column tile
    holding every group (``[G, K, block_n]``, powers of two)."""
    bm, bn, bk = config.blocks
    m, k = lhs.shape
    g_local = rhs.shape[0]
    n_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    p2 = pl.next_power_of_2
    num_k = max(1, pl.cdiv(k, bk))
    kw = p2(max(k, num_k * bk))
    tiles_m = pl.cdiv(m, bm)
    # Visits come in row order: tile i's are [first[i], first[i + 1]).
    first = jnp.searchsorted(visits.tile, jnp.arange(tiles_m + 1, dtype=jnp.int32),
                             side="left").astype(jnp.int32)
    first = first.at[tiles_m].set(visits.tile.shape[0])
    tables = (first, visits.group, visits.lo, visits.hi, visits.active)
    table_specs = [pl.BlockSpec((p2(t.shape[0]),), lambda i, j: (0,)) for t in tables]
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((p2(g_local), bn, kw), lambda i, j: (0, j, 0))
    else:
        rhs_spec = pl.BlockSpec((p2(g_local), kw, bn), lambda i, j: (0, 0, j))
    kernel = functools.partial(_by_tile_kernel, block_m=bm, block_k=bk, num_k=num_k,
                               k_size=k if k % bk else None, transpose_rhs=transpose_rhs)
    params = pl.triton.CompilerParams(
        num_warps=config.num_warps or tiled.default_num_warps(bm, bn),
        num_stages=config.num_stages or 3, dimension_semantics=(pl.PARALLEL, pl.PARALLEL))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=(tiles_m, pl.cdiv(n_out, bn)),
        in_specs=table_specs + [pl.BlockSpec((bm, kw), lambda i, j: (i, 0)), rhs_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=params, backend=backend, name=name)(*tables, lhs, rhs)
