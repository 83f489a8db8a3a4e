"""The Mosaic GPU matmul core's config: :class:`MosaicMatmulConfig` (docs/design.md §5.1).

Everything that changes the kernel of :mod:`ops.matmul.mosaic_gpu_core`: the
block's output tile and contraction step, how its two consumer warpgroups
split it, the TMA pipeline's depth, the epilogue tile and the order the
persistent programs walk the output tiles in. Every field is a positive int
(or None for "the core's choice"), so the tuning cache stores it as it is.

Hardware facts behind the checks (NVIDIA Hopper, sm_90, PTX ISA "wgmma"):

* a consumer warpgroup's accumulator is ``m64nNk16`` instructions: its rows a
  multiple of 64, its columns a multiple of 8 up to 256 per instruction;
* every ``wgmma`` operand tile sits in shared memory under one 128-byte
  swizzle (the lowering needs the left and right operands' swizzles equal),
  so each tile's minor dim is a multiple of 64 16-bit elements: ``block_m``,
  ``block_n`` and ``block_k`` are multiples of 64 (a transposed operand's
  minor dim is its free dim);
* a block has at most 227 KiB of shared memory (``cudaFuncSetAttribute``'s
  ``MaxDynamicSharedMemorySize`` on sm_90): the pipeline's stages of operand
  tiles, the epilogue's store slots and the vectors the epilogue reads.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ops import _op

# Bytes of shared memory a block may use on sm_90, less a KiB for the barriers.
SMEM_BYTES = 227 * 1024 - 1024
# 16-bit elements in one 128-byte swizzle row: every wgmma operand tile's minor dim.
SWIZZLE_ELEMS = 64
MAX_STAGES = 4
MIN_STAGES = 2
# The default band of the planar snake (row tiles per band).
DEFAULT_BAND = 8


def _positive(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class MosaicMatmulConfig(_op.KernelConfig):
    """One block of the warp-specialized Mosaic GPU matmul (:mod:`ops.matmul.mosaic_gpu_core`).

    Attributes:
      block_m, block_n: the block's output tile (both consumer warpgroups
        together), multiples of 64. In a gated linear unit ``block_n`` is the
        columns of each of its two accumulators.
      block_k: the contraction step of one pipeline stage, a multiple of 64.
      num_stages: K steps the producer warpgroup keeps in flight (TMA loads
        issued ahead; the pipeline's shared-memory slots); None: the most, up to
        4, whose tiles fit shared memory beside the epilogue's buffers.
      warpgroups_m: 2: the two consumer warpgroups stack along M (each owns
        ``block_m / 2`` rows and reads the whole right-operand tile: they share
        it); 1: they sit side by side along N (each owns ``block_n / 2``
        columns, sharing the left-operand tile).
      epilogue_m, epilogue_n: the epilogue tile: each warpgroup's accumulator
        is handed to the epilogue and stored (through shared memory, by TMA) in
        pieces of this size, two store slots in flight; None: 64 (clamped to
        the warpgroup's tile).
      band_m / band_n: the order the persistent programs take output tiles in
        (JAX's ``planar_snake``): bands of ``band_m`` row tiles walked column by
        column, alternating direction from band to band, or bands of ``band_n``
        column tiles walked row by row; at most one is given; neither: bands of
        8 row tiles.
    """

    block_m: int = _op.tunable()
    block_n: int = _op.tunable()
    block_k: int = _op.tunable()
    num_stages: int | None = _op.tunable(None)
    warpgroups_m: int = _op.tunable(1)
    epilogue_m: int | None = _op.tunable(None)
    epilogue_n: int | None = _op.tunable(None)
    band_m: int | None = _op.tunable(None)
    band_n: int | None = _op.tunable(None)

    @property
    def blocks(self) -> tuple[int, int, int]:
        return (self.block_m, self.block_n, self.block_k)

    @property
    def wg_tile(self) -> tuple[int, int]:
        """One consumer warpgroup's output tile ``(rows, columns)``."""
        if self.warpgroups_m == 2:
            return self.block_m // 2, self.block_n
        return self.block_m, self.block_n // 2

    @property
    def epilogue_tile(self) -> tuple[int, int]:
        rows, cols = self.wg_tile
        return (min(self.epilogue_m or 64, rows), min(self.epilogue_n or 64, cols))

    @property
    def band(self) -> tuple[int, int]:
        """``(minor dim, band width)`` of JAX's ``planar_snake``: 0 for bands of row tiles."""
        if self.band_n is not None:
            return 1, self.band_n
        return 0, self.band_m or DEFAULT_BAND

    def check(self, op: str) -> None:
        """Raises ValueError naming ``block_sizes`` for a field out of its range (see the
        class docstring): tiles multiples of 64, a warpgroup's columns at most 256,
        ``warpgroups_m`` 1 or 2, an epilogue tile of 64-row multiples and 32-column
        multiples dividing the warpgroup's tile, at most one band, stages >= 2."""
        for name in self.tunable_fields():
            value = getattr(self, name)
            required = name.startswith("block_") or name == "warpgroups_m"
            if (value is None and not required) or _positive(value):
                continue
            raise ValueError(f"{op}: block_sizes.{name} must be a positive int"
                             f"{'' if required else ' or None'}, got {value!r}.")
        if self.warpgroups_m not in (1, 2):
            raise ValueError(f"{op}: block_sizes.warpgroups_m must be 1 (consumer warpgroups "
                             f"side by side along N) or 2 (stacked along M), got "
                             f"{self.warpgroups_m!r}.")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) % SWIZZLE_ELEMS:
                raise ValueError(f"{op}: block_sizes.{name} must be a multiple of {SWIZZLE_ELEMS} "
                                 f"(wgmma operand tiles under a 128-byte swizzle), got "
                                 f"{getattr(self, name)}.")
        rows, cols = self.wg_tile
        if rows % 64 or cols % SWIZZLE_ELEMS or cols > 256:
            raise ValueError(f"{op}: block_sizes gives each consumer warpgroup a {rows} x {cols} "
                             "tile; it needs rows a multiple of 64 and columns a multiple of 64 "
                             "up to 256 (wgmma m64nNk16, N <= 256).")
        em, en = self.epilogue_tile
        if em % 64 or en % 32 or rows % em or cols % en:
            raise ValueError(f"{op}: block_sizes' epilogue tile {em} x {en} must divide the "
                             f"warpgroup's {rows} x {cols} tile in multiples of 64 rows and 32 "
                             "columns.")
        if self.band_m is not None and self.band_n is not None:
            raise ValueError(f"{op}: block_sizes gives band_m and band_n; give at most one.")
        if self.num_stages is not None and self.num_stages < MIN_STAGES:
            raise ValueError(f"{op}: block_sizes.num_stages must be at least {MIN_STAGES}, got "
                             f"{self.num_stages}.")

    # ----- choices by shape ----------------------------------------------------------------

    @classmethod
    def for_shape(cls, m: int, n: int, k: int, *, products_per_step: int = 1) -> "MosaicMatmulConfig":
        """The default block of an ``[m, k] @ [k, n]`` product (``products_per_step``
        right-operand tiles per step: 2 for a gated linear unit's gate and up).

        128 x 256 x 64 blocks (each warpgroup 128 x 128: 128 float32 accumulator
        registers per thread), 128 x 128 with two accumulators per warpgroup; the
        rows halved (64) when M is that small; the consumers stacked along M
        (128 x 64) when N fits one 64-column tile. Four stages where they fit.
        """
        block_k = SWIZZLE_ELEMS
        if n <= SWIZZLE_ELEMS:
            return cls(128, SWIZZLE_ELEMS, block_k, warpgroups_m=2)
        block_m = 128 if m > 64 else 64
        block_n = 256 if n > 128 and products_per_step == 1 else 128
        return cls(block_m, block_n, block_k)

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "MosaicMatmulConfig":
        """:meth:`for_shape` of the problem's ``(m, n, k)`` (the first three dims)."""
        m, n, k = problem.shape[:3]
        return cls.for_shape(m, n, k)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["MosaicMatmulConfig", ...]:
        """The tuner's space around the heuristic (JAX's Hopper matmul searched the same
        region): 128 x 256 and 256 x 128 blocks (each consumer 128 x 128), 128 x 128 with
        the consumers either way, 3 or 4 stages, bands of 8 or 16 row tiles or 8 column
        tiles; the big blocks also with 64 x 128 epilogue tiles. Those whose tiles do not
        fit shared memory (one left and one right operand, 16-bit) are left out."""
        m, n, k = problem.shape[:3]
        out = [cls.heuristic(problem, device)]
        space = [(bm, bn, wgm, stages, band, 64)
                 for bm, bn, wgm in ((128, 256, 1), (256, 128, 2), (128, 128, 1), (128, 128, 2))
                 for stages in (4, 3) for band in ((8, None), (16, None), (None, 8))]
        space += [(128, 256, 1, 3, (8, None), 128), (256, 128, 2, 3, (8, None), 128)]
        for bm, bn, wgm, stages, (band_m, band_n), en in space:
            c = cls(bm, bn, 64, stages, wgm, 64, en, band_m, band_n)
            try:
                c.check("candidates")
            except ValueError:
                continue
            if c.block_m > 2 * max(64, m) or c.block_n > 2 * max(64, n):
                continue
            if _smem_bytes(c, stages) > SMEM_BYTES or _resolved(c) in map(_resolved, out):
                continue
            out.append(c)
        return tuple(out)


def _resolved(config: MosaicMatmulConfig) -> tuple:
    """A plain product's kernel as ``config`` builds it (the core's defaults filled in):
    two configs that resolve alike are one candidate."""
    stages = config.num_stages or next(
        (s for s in range(MAX_STAGES, MIN_STAGES - 1, -1) if _smem_bytes(config, s) <= SMEM_BYTES),
        MIN_STAGES)
    return (config.blocks, stages, config.warpgroups_m, config.epilogue_tile, config.band)


def _smem_bytes(config: MosaicMatmulConfig, stages: int, itemsize: int = 2) -> int:
    """Shared memory of a plain product's block: the stages' operand tiles and the two
    consumers' two epilogue slots (:func:`ops.matmul.mosaic_gpu_core.smem_bytes` in full)."""
    bm, bn, bk = config.blocks
    em, en = config.epilogue_tile
    return (bm + bn) * bk * itemsize * stages + 2 * 2 * em * en * itemsize
