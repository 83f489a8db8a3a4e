"""What the Mosaic GPU attention kernels share: register layouts, shared-memory tiles, the
ping-pong schedule, the key/value ring and the block-range table.

* :data:`WGMMA`: the :class:`~ops.attention.tile_math.RegisterLayout` of tiles held
  in ``wgmma`` accumulator registers, so the per-tile math of
  :mod:`ops.attention.tile_math` (masking, online softmax, the backward tile)
  runs on them unchanged: index tiles come from ``plgpu.broadcasted_iota`` in
  the accumulator's layout and per-row / per-column statistics are broadcast
  with ``broadcast_in_dim`` from its reduced layouts (a reshape cannot change
  a register layout).
* :func:`smem`: a shared-memory tile in the 128-byte-swizzled layout ``wgmma``
  and TMA read (the widest swizzle the minor dim allows).
* :class:`Schedule`: the barrier two compute warpgroups meet at, offset by one
  meeting, so that one's softmax runs while the other's matrix products do
  (FlashAttention-3, Shah et al. 2024, section 3.1, "ping-pong scheduling").
* :class:`Ring`: ``stages`` shared-memory slots filled by a TMA producer
  warpgroup and released by the compute warpgroups, each slot with a "full"
  barrier (TMA bytes landed) and an "empty" barrier (every consumer done).
* :func:`range_table`: each thread block's walked blocks ``[lo, hi)`` and each
  compute warpgroup's fully visible sub-range, from
  :func:`ops.attention.masking.block_ranges` (the same block skipping as the
  other kernels), read in the kernel with scalar loads.
* :func:`stream_keys`: the producer warpgroup of the forward and dQ kernels
  (the key/value tiles of each walked step into their rings).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention.masking import MaskSpec, block_full_visibility, block_ranges, block_visibility
from ops.attention.tile_math import RegisterLayout, rem
from pallas_core import gpu as plgpu
from pallas_core.gpu.kernel_context import interpreting

# Registers per thread of the TMA producer warpgroup after setmaxregister (it only
# issues copies; the compute warpgroups get the rest).
PRODUCER_REGISTERS = 40

# The column of a range-table row where a block's walk and warpgroup w's full range sit.
LO, HI = 0, 1


def _full_columns(wg):
    return 2 + 2 * wg, 3 + 2 * wg


class WGMMALayout(RegisterLayout):
    """Tiles in ``wgmma`` accumulator registers (``plgpu.Layout.WGMMA``); their per-row
    statistics in ``WGMMA.reduce(1)``, per-column ones in ``WGMMA.reduce(0)``."""

    def iota(self, shape, axis: int):
        return plgpu.broadcasted_iota(jnp.int32, tuple(shape), axis, layout=plgpu.Layout.WGMMA)

    def expand(self, x, like, axis: int):
        if x.ndim == 1 < like.ndim:
            return lax.broadcast_in_dim(x, like.shape, [axis])
        return x

    def pair(self, x, transposed: bool):
        return x  # the kernels load bias tiles in the tile's orientation


WGMMA = WGMMALayout()


def row_layout():
    """The layout of a per-row statistic of a ``wgmma`` tile."""
    return plgpu.Layout.WGMMA.reduce(1)


def col_layout():
    """The layout of a per-column statistic of a ``wgmma`` tile."""
    return plgpu.Layout.WGMMA.reduce(0)


def rows_vector(value, rows: int):
    """A float32 ``[rows]`` vector of ``value`` in the per-row layout (a loop carry
    must keep one layout throughout, so it starts in it)."""
    return plgpu.layout_cast(jnp.full((rows,), value, jnp.float32), row_layout())


def zeros_tile(shape):
    """A float32 zero tile in the accumulator layout."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def acc_set(acc_ref, value):
    """Registers ``value`` into the ``wgmma`` accumulator ``acc_ref`` (a ``pl.run_scoped``
    ``ACC``), so ``wgmma`` adds to it: JAX's accumulator store, and in the GPU interpret
    mode, whose interpreter has no rule for that store, a plain one."""
    if interpreting():
        from jax._src.state import primitives as state_primitives
        state_primitives.ref_set(acc_ref, (), value)
    else:
        acc_ref[...] = value


def swizzle_transforms(minor: int, dtype):
    """The tiling and swizzle of a tile whose minor dim is ``minor`` elements of ``dtype``:
    the widest swizzle (128, 64 or 32 bytes) that divides the minor dim's bytes."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def smem(shape, dtype):
    """A shared-memory buffer of 16-bit tiles ``shape`` (leading dims: slots) in the
    swizzled layout ``wgmma`` and TMA read."""
    return plgpu.SMEM(tuple(shape), dtype, transforms=swizzle_transforms(shape[-1], dtype))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The ping-pong schedule of two compute warpgroups (FlashAttention-3 section 3.1).

    ``barrier`` completes when both warpgroups arrive; :meth:`meet` is one meeting
    (arrive, then wait). Warpgroup 1 meets once before its first step and
    warpgroup 0 once after its last (:meth:`stagger` / :meth:`unstagger`), so
    warpgroup 0's ``k``-th meeting is warpgroup 1's ``(k+1)``-th. Each step
    meets twice: after issuing ``q k^T`` and after its softmax; so while one
    warpgroup runs its softmax (between its two meetings), the other issues
    its ``p v`` and next ``q k^T`` on the tensor cores. With one compute
    warpgroup (``barrier`` None) nothing waits.
    """

    barrier: Any
    wg: Any

    def meet(self):
        if self.barrier is not None:
            plgpu.barrier_arrive(self.barrier)
            plgpu.barrier_wait(self.barrier)

    def arrive(self):
        if self.barrier is not None:
            plgpu.barrier_arrive(self.barrier)

    def wait(self):
        if self.barrier is not None:
            plgpu.barrier_wait(self.barrier)

    def stagger(self):
        if self.barrier is not None:
            pl.when(self.wg == 1)(self.meet)

    def unstagger(self):
        if self.barrier is not None:
            pl.when(self.wg == 0)(self.meet)


@dataclasses.dataclass(frozen=True)
class Ring:
    """``stages`` slots of the operands a producer streams (one SMEM buffer per operand,
    slots leading), with a ``full`` barrier per slot (the TMA copies of the step
    arrive on it) and an ``empty`` barrier per slot (every compute warpgroup
    arrives once it has read the slot). Step ``t`` of a walk uses slot ``t % stages``."""

    buffers: tuple
    full: Any
    empty: Any
    stages: int

    def slot(self, t):
        return rem(t, self.stages)

    def produce(self, t, sources):
        """The producer's step ``t``: wait until the slot is free (from its second use),
        then copy ``sources`` (GMEM Refs, one per buffer, None to skip) into it."""
        slot = self.slot(t)

        @pl.when(t >= self.stages)
        def _():
            plgpu.barrier_wait(self.empty.at[slot])

        for src, buf in zip(sources, self.buffers):
            if src is not None:
                plgpu.copy_gmem_to_smem(src, buf.at[slot], self.full.at[slot])

    def wait_full(self, t):
        plgpu.barrier_wait(self.full.at[self.slot(t)])

    def release(self, t):
        plgpu.barrier_arrive(self.empty.at[self.slot(t)])


def range_table(spec: MaskSpec, batch: int, block: int, walked: int, compute_wgs: int,
                q_seg=None, kv_seg=None, *, transpose: bool = False):
    """int32 ``[B, programs, 2 + 2 * compute_wgs]``: per thread block, the walked blocks
    ``lo, hi`` and each compute warpgroup's fully visible sub-range ``full_lo,
    full_hi`` (:func:`ops.attention.masking.block_ranges`).

    A thread block owns ``compute_wgs`` blocks of ``block`` rows (query rows; key
    rows with ``transpose``) and walks blocks of ``walked`` rows of the other
    sequence: ``[lo, hi)`` covers what any of its warpgroups can see, so both
    walk the same steps (their barriers meet as often); a warpgroup evaluates
    the mask on every step outside its own full range.
    """
    own = block * compute_wgs
    bq, bk = (walked, own) if transpose else (own, walked)
    vis = block_visibility(spec, bq, bk, q_seg, kv_seg)
    whole = block_ranges(vis, batch, transpose=transpose)
    bq1, bk1 = (walked, block) if transpose else (block, walked)
    vis1 = block_visibility(spec, bq1, bk1, q_seg, kv_seg)
    full1 = block_full_visibility(spec, bq1, bk1, q_seg, kv_seg)
    per_wg = block_ranges(vis1, batch, transpose=transpose, full=full1, sides=(True, True))
    programs = whole.lo.shape[1]
    columns = [whole.lo, whole.hi]
    for w in range(compute_wgs):
        flo = per_wg.full_lo[:, w::compute_wgs]
        fhi = per_wg.full_hi[:, w::compute_wgs]
        pad = programs - flo.shape[1]  # a last block with fewer warpgroup blocks
        if pad:
            flo = jnp.pad(flo, ((0, 0), (0, pad)))
            fhi = jnp.pad(fhi, ((0, 0), (0, pad)))
        columns += [flo, fhi]
    return jnp.stack(columns, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Walk:
    """One compute warpgroup's walk, read from :func:`range_table`: the block's
    ``[lo, hi)`` and this warpgroup's fully visible ``[full_lo, full_hi)``,
    clamped into it (an empty full range: every step masked)."""

    lo: Any
    hi: Any
    full_lo: Any
    full_hi: Any

    @classmethod
    def read(cls, table_gmem, b, program, wg=None):
        lo = table_gmem[b, program, LO]
        hi = table_gmem[b, program, HI]
        if wg is None:
            return cls(lo, hi, lo, lo)
        c_lo, c_hi = _full_columns(0)
        flo0, fhi0 = table_gmem[b, program, c_lo], table_gmem[b, program, c_hi]
        if table_gmem.shape[-1] > 4:
            c_lo1, c_hi1 = _full_columns(1)
            flo = jnp.where(wg == 0, flo0, table_gmem[b, program, c_lo1])
            fhi = jnp.where(wg == 0, fhi0, table_gmem[b, program, c_hi1])
        else:
            flo, fhi = flo0, fhi0
        flo = jnp.minimum(jnp.maximum(flo, lo), hi)
        fhi = jnp.minimum(jnp.maximum(fhi, flo), hi)
        return cls(lo, hi, flo, fhi)

    def loops(self, step, carry, start=None):
        """``carry = step(j, carry, masked)`` over ``[lo, hi)`` (``[start, hi)`` from a
        ``start`` in ``[lo, hi]``): masked before the full range, unmasked in it,
        masked after (the causal diagonal, window edges, ragged ends)."""
        lo, full_lo, full_hi = self.lo, self.full_lo, self.full_hi
        if start is not None:
            lo, full_lo, full_hi = start, jnp.maximum(full_lo, start), jnp.maximum(full_hi, start)
        carry = lax.fori_loop(lo, full_lo, lambda j, c: step(j, c, True), carry)
        carry = lax.fori_loop(full_lo, full_hi, lambda j, c: step(j, c, False), carry)
        return lax.fori_loop(full_hi, self.hi, lambda j, c: step(j, c, True), carry)


def stream_keys(table_gmem, b, prog, n, kh, k_ring: Ring, v_ring: Ring, k_gmem, v_gmem,
                kseg_gmem, accesses, block_kv: int, block_rows: int):
    """The producer warpgroup of a kernel that walks key/value blocks for its query rows
    (the forward and dQ kernels): registers lowered to :data:`PRODUCER_REGISTERS`, then
    for each step ``t`` of the thread block's walk (``prog``'s row of
    :func:`range_table`) the key tile (with its segment ids and the bias / mask
    operands' step tiles) into ``k_ring`` and the value tile into ``v_ring``.
    ``k_gmem`` / ``v_gmem`` ``[B, S, K, H]`` are read at batch ``b`` and key/value head
    ``kh``, ``kseg_gmem`` ``[B, S]`` at ``b`` (None without segment ids); ``accesses``:
    the :class:`~ops.attention.mosaic_gpu_pairs.Access` of each bias / mask operand,
    read for query head ``n`` from the block's first query row (``block_rows`` rows a
    thread block)."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    walk = Walk.read(table_gmem, b, prog)

    @pl.loop(walk.lo, walk.hi)
    def _(j):
        t, keys = j - walk.lo, pl.ds(j * block_kv, block_kv)
        k_ring.produce(t, (k_gmem.at[b, keys, kh],
                           None if kseg_gmem is None else kseg_gmem.at[b, keys],
                           *(a.step_source(b, n, prog * block_rows, j) for a in accesses)))
        v_ring.produce(t, (v_gmem.at[b, keys, kh],))


__all__ = ["Ring", "Schedule", "WGMMA", "WGMMALayout", "Walk", "acc_set", "col_layout",
           "range_table", "row_layout", "rows_vector", "smem", "stream_keys", "swizzle_transforms",
           "zeros_tile"]
