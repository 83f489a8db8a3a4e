"""The attention kernels walking an in-kernel loop (triton, pallas_triton).

Each program walks only its visible range with ``lax.fori_loop(lo, hi)``
over ``pl.ds`` slices of whole-length blocks, the carries in registers. Our
Triton lowering emits that loop as ``for j in range(lo, hi)``, which Triton
software-pipelines (cp.async / TMA stages), and JAX's Pallas Triton lowering
runs programs concurrently, so it cannot walk a grid axis. Where a mask can
hide pairs, the range is walked as up to three loops: the fully visible
blocks in the middle skip the mask (:func:`walk_blocks`). The dK/dV kernel's
tiles are transposed (``[block_k, block_q]``, see
:func:`ops.attention.tile_math.backward_tile`). What a step computes is the
kernel's :class:`~ops.attention.programs.Body`.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention import programs
from ops.attention.config import Config
from ops.attention.masking import masked_sides
from ops.attention.programs import QueryBlock
from ops.attention.range_table import BlockRange
from ops.attention.tile_math import div, rem


def slice_rows(ref, start, size, axis=0):
    """``size`` entries of ``ref`` from ``start`` along ``axis`` (a ``pl.ds`` slice)."""
    idx = [slice(None)] * len(ref.shape)
    idx[axis] = pl.ds(start, size)
    return ref[tuple(idx)]


def _block_slice(ref, j, block, axis=0):
    """Walked block ``j`` of a whole-length block."""
    return slice_rows(ref, j * block, block, axis)


def walk_blocks(ranges: BlockRange, loop, init, sides: tuple[bool, bool]):
    """``loop(first, last, carry, masked)`` over the visible blocks ``[lo, hi)``.

    ``sides`` (:func:`ops.attention.masking.masked_sides`, the same the table
    was built with) says where masked blocks may lie. Up to three loops in
    block order: ``[lo, full_lo)`` masked, the fully visible ``[full_lo,
    full_hi)`` without evaluating the conditions, ``[full_hi, hi)`` masked. For
    causal attention that is FlashAttention-2's split of the loop into
    off-diagonal and diagonal blocks (Dao, 2023, section 3.1.1); windows,
    segments and ragged edges get the same: only the blocks a boundary crosses
    pay for the mask. Without sides, one loop with the conditions evaluated
    (they are then None: nothing is masked).
    """
    lo, hi, full_lo, full_hi = ranges
    leading, trailing = sides
    if not (leading or trailing):
        return loop(lo, hi, init, True)
    carry = loop(lo, full_lo, init, True) if leading else init
    carry = loop(full_lo, full_hi, carry, False)
    return loop(full_hi, hi, carry, True) if trailing else carry


def _each_block(step):
    """``loop`` for :func:`walk_blocks`: ``carry = step(j, carry, masked)`` for j in ``[first, last)``."""
    return lambda first, last, carry, masked: lax.fori_loop(
        first, last, lambda j, c: step(j, c, masked), carry)


def _walk(body: programs.Body, loop, sides):
    body.finish(*walk_blocks(BlockRange(body.lo, body.hi, *body.full()), loop, body.init, sides))


def forward_kernel(*refs, cfg: Config):
    body = programs.forward_body(cfg, refs, _block_slice, stats=(cfg.blocks.block_q,))
    _walk(body, _each_block(body.step),
          masked_sides(cfg.problem.spec, cfg.blocks.block_q, cfg.blocks.block_k))


def _write_dbias(ref, j, value):
    """Only visible blocks are written (the output starts as zeros)."""
    bk = value.shape[1]
    ref[:, pl.ds(j * bk, bk)] = value


def dq_kernel(*refs, cfg: Config, want_dbias: bool):
    body = programs.dq_body(cfg, refs, _block_slice, want_dbias, _write_dbias)
    sides = masked_sides(cfg.problem.spec, cfg.blocks.block_q, cfg.blocks.block_k, bound_q=True)
    _walk(body, _each_block(body.step), sides)


def _read_query_block(cfg: Config, refs, aux, n, i) -> QueryBlock:
    """Query head ``n``'s query block ``i``, sliced from the whole-length blocks of
    every head; per-query statistics and ids as ``[1, bq]`` rows (transposed tiles)."""
    bq = cfg.blocks.block_q_dkv
    q_ref, do_ref, lse_ref, delta_ref = refs
    rows = pl.ds(i * bq, bq)
    if cfg.backend.layout == "BTNH":
        q, do = q_ref[rows, n, :], do_ref[rows, n, :]
    else:
        q, do = q_ref[n, rows, :], do_ref[n, rows, :]
    lse = lse_ref[n, rows, :].reshape(1, bq)
    delta = delta_ref[n, rows, :].reshape(1, bq)
    q_seg = None if aux.q_seg is None else aux.q_seg[rows, :].reshape(1, bq)
    bias, mask = (_pair_rows(r, full, n, rows) for r, full in
                  ((aux.bias, cfg.problem.bias_full), (aux.mask, cfg.problem.mask_full)))
    return QueryBlock(q, do, lse, delta, q_seg, bias, mask)


def _pair_rows(ref, full, n, rows):
    """The bias/mask tile of query head ``n`` at query rows ``rows``."""
    if ref is None:
        return None
    idx = (n if full[1] else 0, rows if full[2] else slice(None), slice(None))
    return ref[idx]


def dkdv_kernel(*refs, cfg: Config):
    g = cfg.problem.group
    read = lambda refs, aux, n, i: _read_query_block(cfg, refs, aux, n, i)
    body = programs.dkdv_body(cfg, refs, read, transposed=True)

    def blocks(first, last, carry, masked):  # every query head of the group, blocks [first, last)
        count = last - first

        def flat_step(t, carry):  # t walks (query head of the group, query block)
            return body.step(div(t, count), first + rem(t, count), carry, masked)

        return lax.fori_loop(0, g * count, flat_step, carry)

    sides = masked_sides(cfg.problem.spec, cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv,
                         transpose=True, bound_q=True)
    _walk(body, blocks, sides)


def decode_kernel(*refs, cfg: Config):
    """Split-KV decode: program ``(b, kh, s)`` walks share ``s`` of ``cfg.blocks.k_splits``
    equal shares of its visible blocks ``[lo, hi)`` (split at run time, so a cache
    filled to a short length still spreads over every program)."""
    body = programs.decode_body(cfg, refs, _block_slice, stats=(refs[0].shape[0],))
    splits, s = cfg.blocks.k_splits, pl.program_id(2)
    lo, hi = body.lo, body.hi
    per = div(hi - lo + (splits - 1), splits)
    first = jnp.minimum(lo + s * per, hi)
    last = jnp.minimum(first + per, hi)
    body.finish(*_each_block(body.step)(first, last, body.init, True))
