"""The tables that walk row tiles by group, built on the device from ``group_sizes``.

Rows ``[0, M)`` split into segments: the rows before the owned groups (a
zero segment), each owned group in order, and the rows after them (a zero
segment: rows past ``sum(group_sizes)`` and rows of groups after the owned
ones). A **visit** is one (row tile, segment) pair whose rows meet: a tile
that a segment boundary cuts is visited once per segment it touches, an
empty segment is not visited at all, so the visits number at most
``cdiv(M, block_m) + segments - 1`` (the static extent of the grid axis
that walks them). Visits past the real count are inactive and cover no rows.

Everything here is ``jnp`` on int32 vectors of length about ``M / block_m +
G``: cheap next to the matmul, traced under ``jit``, run on the device.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ops.moe.reference import owned_rows


@dataclasses.dataclass(frozen=True)
class Visits:
    """Per-visit int32 vectors (scalar-prefetch operands of the kernels).

    Attributes:
      tile: the row tile (of lhs and the output) the visit works on.
      group: the owned group's local index (the slice of ``rhs``), 0 for a
        zero segment or an inactive visit (so it indexes a valid slice).
      lo, hi: the visit's rows are ``[lo, hi)`` (inside its tile).
      active: 1 where the visit multiplies (an owned group with rows), else 0.
      first, last: (``tgmm``'s only, else None) 1 on a group's first / last
        visit, where its accumulator starts / is stored.
    """

    tile: jax.Array
    group: jax.Array
    lo: jax.Array
    hi: jax.Array
    active: jax.Array
    first: jax.Array | None = None
    last: jax.Array | None = None

    def tables(self) -> tuple[jax.Array, ...]:
        return tuple(t for t in (self.tile, self.group, self.lo, self.hi, self.active, self.first,
                                 self.last) if t is not None)


def group_bounds(group_sizes, num_local: int, group_offset, m: int):
    """``(begins, ends)``: the owned groups' row ranges, int32 ``[num_local]``,
    clamped to ``[0, M]``."""
    start, local = owned_rows(group_sizes, num_local, group_offset)
    ends = jnp.minimum(start + jnp.cumsum(local), m)
    begins = jnp.minimum(ends - local, m)
    begins = jnp.maximum(begins, 0)
    return begins, jnp.maximum(ends, begins)


def num_row_visits(m: int, block_m: int, num_local: int) -> int:
    """The static bound on the forward's visits: row tiles plus one per inner boundary
    of the ``num_local + 2`` segments."""
    return max(1, -(-m // block_m)) + num_local + 1


def row_visits(group_sizes, num_local: int, group_offset, m: int, block_m: int) -> Visits:
    """The forward's (and ``dlhs``'s) visits: every row of ``[0, M)`` in exactly one
    visit; owned groups active, the zero segments inactive (their rows stored as 0)."""
    begins, ends = group_bounds(group_sizes, num_local, group_offset, m)
    first, last = begins[:1], ends[-1:]
    zero = jnp.zeros((1,), jnp.int32)
    seg_lo = jnp.concatenate([zero, begins, last])
    seg_hi = jnp.concatenate([first, ends, jnp.full((1,), m, jnp.int32)])
    seg_group = jnp.concatenate([zero, jnp.arange(num_local, dtype=jnp.int32), zero])
    seg_active = jnp.concatenate([zero, jnp.ones((num_local,), jnp.int32), zero])
    return _visits(seg_lo, seg_hi, seg_group, seg_active, num_row_visits(m, block_m, num_local),
                   block_m, m)


def num_group_visits(m: int, block_m: int, num_local: int) -> int:
    """The static bound on ``tgmm``'s visits: row tiles, one per inner group boundary,
    and one per empty group."""
    return max(1, -(-m // block_m)) + 2 * num_local


def group_visits(group_sizes, num_local: int, group_offset, m: int, block_m: int) -> Visits:
    """``tgmm``'s visits: the owned groups only, in order, an empty group visited once
    with no rows (so its gradient is stored as zeros)."""
    begins, ends = group_bounds(group_sizes, num_local, group_offset, m)
    return _visits(begins, ends, jnp.arange(num_local, dtype=jnp.int32),
                   (ends > begins).astype(jnp.int32), num_group_visits(m, block_m, num_local),
                   block_m, m, visit_empty=True)


def _visits(seg_lo, seg_hi, seg_group, seg_active, num_visits: int, block_m: int, m: int, *,
            visit_empty: bool = False) -> Visits:
    nonempty = seg_hi > seg_lo
    first_tile = seg_lo // block_m
    last_tile = jnp.maximum(seg_hi - 1, seg_lo) // block_m
    count = jnp.where(nonempty, last_tile - first_tile + 1, 1 if visit_empty else 0)
    cum = jnp.cumsum(count)
    begin = cum - count
    v = jnp.arange(num_visits, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cum, v, side="right").astype(jnp.int32), seg_lo.shape[0] - 1)
    real = v < cum[-1]
    last_real = jnp.maximum(cum[-1] - 1, 0)
    last_seg = jnp.minimum(jnp.searchsorted(cum, last_real, side="right").astype(jnp.int32),
                           seg_lo.shape[0] - 1)
    tile = jnp.where(real, first_tile[seg] + v - begin[seg],
                     first_tile[last_seg] + last_real - begin[last_seg])
    tile = jnp.clip(tile, 0, max(0, -(-m // block_m) - 1))
    lo = jnp.where(real, jnp.maximum(seg_lo[seg], tile * block_m), 0)
    hi = jnp.where(real, jnp.minimum(seg_hi[seg], (tile + 1) * block_m), 0)
    group = jnp.where(real, seg_group[seg], seg_group[last_seg])
    active = jnp.where(real, seg_active[seg], 0)
    flags = {}
    if visit_empty:  # a group's first and last visit: where its accumulator starts and is stored
        flags = dict(first=(real & (v == begin[seg])).astype(jnp.int32),
                     last=(real & (v == cum[seg] - 1)).astype(jnp.int32))
    return Visits(tile.astype(jnp.int32), group.astype(jnp.int32), lo.astype(jnp.int32),
                  hi.astype(jnp.int32), active.astype(jnp.int32), **flags)
