"""The scalar table of an attention call: the dropout seed and every program's block range.

Each attention kernel walks, per program, only the blocks a mask can let
through (:func:`ops.attention.masking.block_ranges` computes them in XLA).
Those ranges reach the kernel in one flat int32 array, with the dropout seed:

* entry 0: the seed (0 without dropout);
* then one :class:`BlockRange` per program row ``r = b * blocks + i``
  (``blocks`` is the number of blocks a batch entry has along the axis the
  programs own: query blocks for the forward and dQ kernels, key/value blocks
  for the dK/dV kernel), its fields at entries ``1 + RANGE_FIELDS * r + f``
  in :class:`BlockRange`'s field order;
* zeros up to a power-of-two length, so the table is one whole-array block on
  every backend (scalar memory on Mosaic TPU).

:func:`pack` writes that layout in XLA, :class:`RangeTable` reads it in a
kernel; nothing else indexes the table.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

import pallas_core as pl


class BlockRange(NamedTuple):
    """The blocks one program walks along the other sequence.

    Attributes:
      lo, hi: the blocks that can hold a visible pair, ``[lo, hi)``.
      full_lo, full_hi: a sub-range ``lo <= full_lo <= full_hi <= hi`` of
        blocks every pair of which is visible (the loop strategy walks it
        without evaluating the mask); empty (``hi, hi`` or ``lo, lo``) when
        there is none usable (:func:`ops.attention.masking.block_ranges`).

    In XLA each field is an int32 ``[B, blocks]`` array; in a kernel, one
    program's int32 scalars.
    """

    lo: Any
    hi: Any
    full_lo: Any
    full_hi: Any


RANGE_FIELDS = len(BlockRange._fields)  # table entries per program row
_SEED = 0  # the seed's entry
_FIRST_ROW = 1  # the entry where row 0 starts


def _padded(flat):
    """``flat`` zero-padded to a power-of-two length (at least 2)."""
    size = pl.next_power_of_2(max(flat.shape[0], 2))
    return jnp.pad(flat, (0, size - flat.shape[0]))


def pack(seed, ranges: BlockRange):
    """The flat int32 table of ``seed`` (a scalar, or None without dropout) and
    ``ranges`` (a :class:`BlockRange` of ``[B, blocks]`` arrays), in the layout
    :class:`RangeTable` reads."""
    rows = _padded(jnp.stack(list(ranges), axis=-1).reshape(-1))
    seed = jnp.zeros((), jnp.int32) if seed is None else seed.astype(jnp.int32)
    return _padded(jnp.concatenate([seed.reshape(1), rows]))


@dataclasses.dataclass(frozen=True)
class RangeTable:
    """A kernel's view of a :func:`pack`\\ ed table.

    Attributes:
      ref: the table (a whole-array Ref; any integer-indexable array works).
      blocks: program rows per batch entry (see the module docstring).
    """

    ref: Any
    blocks: int

    @property
    def seed(self):
        """The dropout seed (one read of the table)."""
        return self.ref[_SEED]

    def row(self, b, i) -> "RangeRow":
        """Program row ``(b, i)``: batch entry ``b``, block ``i`` of its axis. Nothing is
        read until a field is asked for."""
        return RangeRow(self.ref, _FIRST_ROW + RANGE_FIELDS * (b * self.blocks + i))


@dataclasses.dataclass(frozen=True)
class RangeRow:
    """One program's :class:`BlockRange` in a table; each field access is one read."""

    ref: Any
    start: Any  # the entry of the row's first field

    def field(self, name: str):
        """The field ``name`` of :class:`BlockRange` (one read)."""
        offset = BlockRange._fields.index(name)
        return self.ref[self.start + offset if offset else self.start]

    lo = property(lambda self: self.field("lo"))
    hi = property(lambda self: self.field("hi"))
    full_lo = property(lambda self: self.field("full_lo"))
    full_hi = property(lambda self: self.field("full_hi"))

    def read(self) -> BlockRange:
        """Every field, read in field order."""
        return BlockRange(*(self.field(name) for name in BlockRange._fields))
