"""``tgmm``: the grouped matmul's ``drhs[g] = lhs_g^T @ dout_g`` kernel.

Each output block ``[block_k, block_n]`` of group ``g`` reduces over the
group's rows, a range ``[begin_g, end_g)`` known only on the device, on the
tiled-matmul core's walks (:mod:`ops.matmul.tiled`) with the contraction
masked outside the group's rows:

* ``interpret`` and ``mosaic_tpu`` (programs in order): the grid is (K
  tile, N tile, visit) with the visits of
  :func:`ops.moe.group_table.group_visits` last and ``"arbitrary"``; a
  group's visits are consecutive, the accumulator starts on its first visit
  and is stored on its last; an empty group has one visit that stores
  zeros (megablox's scheme).
* ``triton`` and ``pallas_triton`` (concurrent programs): the grid is
  (group, K tile, N tile), all parallel; each program loops over its
  group's row tiles (a trip count read from the group bounds, in scalar
  memory, or as ordinary operands on pallas_triton; none for an empty
  group, which stores zeros).

Every output block has exactly one writer: no atomics, deterministic.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_core as pl
from ops.matmul import tiled
from ops.moe import group_table
from ops.moe.config import RaggedDotConfig


def _grid_kernel(tile_ref, group_ref, lo_ref, hi_ref, active_ref, first_ref, last_ref, lhs_ref,
                 dout_ref, out_ref, acc_ref, *, block_m: int):
    v = pl.program_id(2)

    def finish(acc):
        out_ref[...] = acc.astype(out_ref.dtype)

    tiled.grid_accumulate(lhs_ref, dout_ref, acc_ref, finish, ca=0, cb=0, k_axis=2,
                          block_k=block_m, k_size=hi_ref[v], k_lo=lo_ref[v],
                          k0=tile_ref[v] * block_m, active=active_ref[v] != 0,
                          first=first_ref[v] != 0, last=last_ref[v] != 0)


def _loop_kernel(begins_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, block_m: int):
    g = pl.program_id(0)
    lo, hi = begins_ref[g], ends_ref[g]
    first_tile = lo // block_m
    trips = jnp.where(hi > lo, (hi - 1) // block_m - first_tile + 1, 0)
    acc = tiled.loop_accumulate(lhs_ref, dout_ref, ca=0, cb=0, block_k=block_m, num_k=trips,
                                out_shape=out_ref.shape, k_size=hi, k_lo=lo, first_k=first_tile,
                                masked_loads=True)
    out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(lhs, dout, group_sizes, group_offset, num_local: int, *, config: RaggedDotConfig,
         backend: str, out_dtype, walk: str, scalar_prefetch: bool = True,
         name: str = "ragged_dot_drhs"):
    """``[G_local, K, N]``: ``lhs[rows of g]^T @ dout[rows of g]`` per owned group.

    Args:
      lhs: ``[M, K]``; dout: ``[M, N]``.
      group_sizes, group_offset, num_local: the groups (as :func:`ops.ragged_dot`).
      config: tiles by role: output ``(block_k, block_n)``, rows per step
        ``block_m``.
      walk: ``"grid"`` or ``"loop"`` (:func:`ops.moe.gmm.walk`).
      scalar_prefetch: the loop walk reads the group bounds through scalar
        prefetch; False (pallas_triton) passes them as ordinary operands.
    """
    bm, bn, bk = config.blocks
    m, k = lhs.shape
    n = dout.shape[1]
    out_shape = jax.ShapeDtypeStruct((num_local, k, n), out_dtype)
    out_block = (None, bk, bn)
    if walk == tiled.GRID:
        visits = group_table.group_visits(group_sizes, num_local, group_offset, m, bm)
        grid = (pl.cdiv(k, bk), pl.cdiv(n, bn), visits.tile.shape[0])
        spec = pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7, grid=grid,
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, v, tile, *_: (tile[v], i)),
                      pl.BlockSpec((bm, bn), lambda i, j, v, tile, *_: (tile[v], j))],
            out_specs=pl.BlockSpec(out_block, lambda i, j, v, tile, group, *_: (group[v], i, j)),
            scratch_shapes=[pl.tpu.VMEM((bk, bn), jnp.float32)])
        return pl.pallas_call(
            functools.partial(_grid_kernel, block_m=bm), out_shape=out_shape, grid_spec=spec,
            compiler_params=pl.CompilerParams((pl.PARALLEL, pl.PARALLEL, pl.ARBITRARY)),
            backend=backend, name=name)(*visits.tables(), lhs, dout)
    begins, ends = group_table.group_bounds(group_sizes, num_local, group_offset, m)
    grid = (num_local, pl.cdiv(k, bk), pl.cdiv(n, bn))
    # Bands of 8 K tiles over the N tiles (grouped ordering on our triton backend): each
    # column tile of dout is reused by 8 K tiles while in L2.
    params = pl.triton.CompilerParams(
        num_warps=config.num_warps or tiled.default_num_warps(bk, bn),
        num_stages=config.num_stages or 3, group_size=config.group_size or 8,
        dimension_semantics=(pl.PARALLEL, pl.PARALLEL, pl.PARALLEL))
    kernel = functools.partial(_loop_kernel, block_m=bm)
    if not scalar_prefetch:
        # pallas_triton: the bounds as ordinary operands, every block a power of two.
        rows = pl.next_power_of_2(m)
        bound = pl.BlockSpec((pl.next_power_of_2(num_local),), lambda g, i, j: (0,))
        return pl.pallas_call(
            kernel, out_shape=out_shape, grid=grid,
            in_specs=[bound, bound, pl.BlockSpec((rows, bk), lambda g, i, j: (0, i)),
                      pl.BlockSpec((rows, bn), lambda g, i, j: (0, j))],
            out_specs=pl.BlockSpec(out_block, lambda g, i, j: (g, i, j)),
            compiler_params=params, backend=backend, name=name)(begins, ends, lhs, dout)
    rows = tiled.loop_k_width(m, bm, "mask")
    spec = pl.tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid,
        in_specs=[pl.BlockSpec((rows, bk), lambda g, i, j, *_: (0, i)),
                  pl.BlockSpec((rows, bn), lambda g, i, j, *_: (0, j))],
        out_specs=pl.BlockSpec(out_block, lambda g, i, j, *_: (g, i, j)))
    return pl.pallas_call(kernel, out_shape=out_shape, grid_spec=spec, compiler_params=params,
                          backend=backend, name=name)(begins, ends, lhs, dout)
