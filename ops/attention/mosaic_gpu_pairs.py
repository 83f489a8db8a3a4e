"""Bias and mask arrays in the Mosaic GPU attention kernels, read tile by tile and never
broadcast in memory.

A bias or mask ``[B', N', T', S']`` (each dim 1 or full, as the op checks them)
reaches a kernel in one of four forms, by which of its sequence dims are full
(:attr:`Pair.mode`):

* ``"tile"`` (``T'`` and ``S'`` full): for each walked step, the thread block's
  2-D tile (its ``compute_wgs`` warpgroups' rows by the step's columns), copied by
  TMA with the step's key/value (or query) tiles into the same ring slot and
  read into the ``wgmma`` accumulator layout;
* ``"keys"`` (``S'`` full): a float32 ``[B', N', S]`` row;
* ``"queries"`` (``T'`` full): a float32 ``[B', N', T]`` column;
* ``"scalar"``: one float32 per ``(b', n')``, read from global memory.

The forward and dQ kernels walk keys for their query rows; the dK/dV kernel
walks queries for its key rows, and reads the tile form transposed (``[B', N',
S, T]``, one XLA transpose of the array) so its tiles come in the orientation of
its ``k q^T`` products (a register tile cannot be transposed). Every form but
the scalar rides on the ring with each step (a vector along the owned rows
too: in the dK/dV kernel it changes with the query head a step belongs to).

A mask becomes an additive bias first (:func:`additive_mask`: 0 where it
attends, -inf elsewhere, bfloat16): the masked logits are then -inf as the
mask would make them, and a bias gradient is unchanged (the probability there
is 0).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

import pallas_core as pl
from ops.attention.mosaic_gpu_tiles import WGMMA, col_layout, row_layout, swizzle_transforms
from pallas_core import gpu as plgpu

MODES = ("tile", "keys", "queries", "scalar")
_DIMS = "BNTS"


@dataclasses.dataclass(frozen=True)
class Pair:
    """The static description of a bias or mask operand: which dims are full, and the
    itemsize of its tile form (bias: its dtype; mask: bfloat16)."""

    full: tuple[bool, bool, bool, bool]
    itemsize: int

    @classmethod
    def of(cls, x, mask: bool = False) -> "Pair":
        """The pair of a 4-D ``[B', N', T', S']`` array (``mask``: a boolean mask)."""
        itemsize = 2 if mask else np.dtype(x.dtype).itemsize
        return cls(tuple(d != 1 for d in x.shape), itemsize)

    @classmethod
    def from_variant(cls, dims: str | None, dtype: str | None) -> "Pair | None":
        """The pair a tuning variant describes (``dims``: the full dims among "BNTS";
        ``dtype``: the bias dtype, None for a mask), or None when absent."""
        if dims is None:
            return None
        return cls(tuple(d in dims for d in _DIMS), np.dtype(dtype).itemsize if dtype else 2)

    @property
    def mode(self) -> str:
        t, s = self.full[2], self.full[3]
        return "tile" if t and s else "keys" if s else "queries" if t else "scalar"

    def smem_bytes(self, rows: int, walked: int, compute_wgs: int, stages: int,
                   transposed: bool) -> int:
        """Shared memory in a kernel whose warpgroups own ``rows`` rows each and walk steps
        of ``walked`` (``transposed``: rows are keys, the dK/dV kernel)."""
        kind = _kind(self.mode, transposed)
        if kind == "tile":
            return stages * compute_wgs * rows * walked * self.itemsize
        if kind == "walked":
            return stages * walked * 4
        if kind == "rows":
            return stages * compute_wgs * rows * 4
        return 0


def _kind(mode: str, transposed: bool) -> str:
    """What a kernel reads: "tile", "walked" (a vector along the walked sequence),
    "rows" (a vector along the owned rows) or "scalar"."""
    if mode in ("tile", "scalar"):
        return mode
    keys_walked = not transposed
    return "walked" if (mode == "keys") == keys_walked else "rows"


def additive_mask(mask):
    """A boolean mask as an additive bias: 0 where it attends, -inf elsewhere (bfloat16)."""
    return jnp.where(mask, 0.0, -jnp.inf).astype(jnp.bfloat16)


def _swizzle_bytes(minor_bytes: int) -> int:
    for swizzle in (128, 64, 32):
        if minor_bytes % swizzle == 0:
            return swizzle
    return 0


def operand(pair: Pair, x, transposed: bool):
    """The array a kernel reads for ``x`` (the bias, or an additive mask): the tile form
    ``[B', N', rows, walked]`` (transposed for the dK/dV kernel), padded so TMA can
    tile it (rows to a multiple of 8, the minor dim to 32 bytes); the vectors float32
    ``[B', N', L]`` padded to a multiple of 4; the scalars float32 ``[B', N']``."""
    mode = pair.mode
    if mode == "tile":
        tile = jnp.swapaxes(x, 2, 3) if transposed else x
        minor = -tile.shape[3] % (32 // pair.itemsize)
        rows = -tile.shape[2] % 8
        if minor or rows:
            tile = jnp.pad(tile, ((0, 0), (0, 0), (0, rows), (0, minor)))
        return tile
    if mode == "scalar":
        return x[:, :, 0, 0].astype(jnp.float32)
    vector = (x[:, :, 0, :] if mode == "keys" else x[:, :, :, 0]).astype(jnp.float32)
    extra = -vector.shape[2] % 4
    return jnp.pad(vector, ((0, 0), (0, 0), (0, extra))) if extra else vector


def scratch(pair: Pair, array, rows: int, walked: int, compute_wgs: int, stages: int,
            transposed: bool):
    """The operand's shared memory (None for a scalar): a ring of tiles or vectors
    (``stages`` slots); ``array`` is :func:`operand`'s result."""
    kind = _kind(pair.mode, transposed)
    if kind == "tile":
        shape = (stages, compute_wgs * rows, walked)
        swizzle = _swizzle_bytes(math.gcd(array.shape[3] * pair.itemsize, walked * pair.itemsize))
        transforms = swizzle_transforms(swizzle // pair.itemsize, array.dtype)
        return plgpu.SMEM(shape, array.dtype, transforms=transforms)
    if kind == "walked":
        return plgpu.SMEM((stages, walked), jnp.float32)
    if kind == "rows":
        return plgpu.SMEM((stages, compute_wgs * rows), jnp.float32)
    return None


@dataclasses.dataclass(frozen=True)
class Access:
    """One bias / mask operand inside one kernel: its GMEM Ref, its shared memory, and
    how a warpgroup gets its ``[rows, walked]`` float32 tile of it.

    Attributes:
      pair: the operand's static description.
      transposed: the dK/dV kernel (rows are keys, the walk is over queries).
      gmem: :func:`operand`'s array as a GMEM Ref.
      smem: :func:`scratch`'s buffer (None for a scalar).
      rows, walked: a warpgroup's rows and a step's columns.
      compute_wgs: the compute warpgroups of a thread block.
    """

    pair: Pair
    transposed: bool
    gmem: object
    smem: object
    rows: int
    walked: int
    compute_wgs: int

    @property
    def kind(self) -> str:
        return _kind(self.pair.mode, self.transposed)

    def _bn(self, b, n):
        return (b if self.pair.full[0] else 0), (n if self.pair.full[1] else 0)

    def step_source(self, b, n, block_first_row, step):
        """The GMEM Ref the producer copies into the ring with walked step ``step`` for
        query head ``n`` (None for a scalar): the thread block's rows from
        ``block_first_row``, the step's columns."""
        bb, nn = self._bn(b, n)
        rows = pl.ds(block_first_row, self.compute_wgs * self.rows)
        cols = pl.ds(step * self.walked, self.walked)
        if self.kind == "tile":
            return self.gmem.at[bb, nn, rows, cols]
        if self.kind == "walked":
            return self.gmem.at[bb, nn, cols]
        if self.kind == "rows":
            return self.gmem.at[bb, nn, rows]
        return None

    def value(self, b, n, slot, wg, like):
        """The warpgroup's float32 values for the tile ``like`` ``[rows, walked]``: a tile
        in the accumulator layout, or a scalar."""
        kind = self.kind
        if kind == "tile":
            tile = self.smem.at[slot, pl.ds(wg * self.rows, self.rows)]
            return plgpu.load(tile, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        if kind == "walked":
            return WGMMA.expand(plgpu.load(self.smem.at[slot], (), layout=col_layout()), like, 1)
        if kind == "rows":
            own = self.smem.at[slot, pl.ds(wg * self.rows, self.rows)]
            return WGMMA.expand(plgpu.load(own, (), layout=row_layout()), like, 0)
        bb, nn = self._bn(b, n)
        return self.gmem[bb, nn]


def combined(accesses, b, n, slot, wg, like):
    """The sum of the operands' values (the bias and the additive mask), or None."""
    total = None
    for access in accesses:
        value = access.value(b, n, slot, wg, like)
        total = value if total is None else total + value
    return total
