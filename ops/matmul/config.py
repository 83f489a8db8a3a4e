"""The fused matmul's config on the op layer (:mod:`ops._op`): tiles, launch parameters
and how the contraction is walked."""
from __future__ import annotations

import dataclasses

import numpy as np

from ops import _op
from ops.matmul import tiled

# (block_m, block_n, block_k, num_warps, num_stages, group_size, epilogue_subtile):
# the shapes tensor-core matmuls run well (Triton's matmul tutorial searches the
# same region), with the default grouped ordering (bands of 8 row blocks), then
# two other bands on the default tile. The 128 x 256 tiles run their epilogue in
# halves (and quarters, once): whole, the forward that also writes the
# pre-activation for the backward spills 272 bytes at 255 registers on sm_90 (bf16,
# bias + gelu, 8 warps); in halves it takes 216 registers and no spill, in
# quarters 196 (benchmarks.static, the subtiled row); with TMA stores 172 against
# 255 (ops.matmul.tiled's table). The 64 x 256 tile at 4 warps runs in quarters:
# whole, that forward spills 1788 bytes (halves: 512); in quarters 195 registers.
_SPACE = ((128, 256, 64, 8, 3, 8, 2), (256, 128, 64, 8, 3, 8, None), (128, 128, 64, 8, 3, 8, None),
          (128, 128, 64, 4, 4, 8, None), (128, 128, 32, 4, 4, 8, None), (128, 64, 64, 4, 4, 8, None),
          (64, 128, 64, 4, 4, 8, None), (64, 64, 64, 4, 4, 8, None), (128, 128, 128, 8, 3, 8, None),
          (128, 256, 64, 8, 4, 8, 2), (64, 256, 64, 4, 4, 8, 4), (128, 128, 64, 8, 4, 8, None),
          (128, 128, 64, 8, 3, 4, None), (128, 128, 64, 8, 3, 16, None), (128, 256, 64, 8, 3, 8, 4))


@dataclasses.dataclass(frozen=True)
class MatmulConfig(_op.KernelConfig):
    """The forward kernel's launch configuration of an ``[m, k] @ [k, n]`` product
    (``block_sizes=(block_m, block_n, block_k)`` of :func:`ops.fused_matmul` becomes one).

    Attributes:
      block_m, block_n, block_k: the output tile and the contraction step.
      num_warps, num_stages: Triton launch parameters; None: the heuristic's
        (8 warps from a 128 x 128 tile, 3 stages).
      group_size: grouped program ordering on ``triton``
        (:class:`pallas_core.triton.CompilerParams`); None: 8.
      walk: how the contraction is walked, ``"grid"`` or ``"loop"``; None (what
        a caller's config may leave it): the backend's
        (:func:`ops.matmul.tiled.strategy`: ``"loop"`` on pallas_triton, ``"grid"``
        elsewhere). Not tuned.
      epilogue_subtile: 1, 2 or 4: the accumulator is split along N into that
        many ``block_m x block_n / epilogue_subtile`` pieces, each run through
        the epilogue (bias, activation, ...) and stored before the next
        (:func:`ops.matmul.tiled.matmul_call`); fewer live registers and a
        smaller shared-memory buffer for the store's layout conversion at wide
        tiles. None or 1: the whole tile at once. Results do not depend on it.
    """

    block_m: int = _op.tunable()
    block_n: int = _op.tunable()
    block_k: int = _op.tunable()
    num_warps: int | None = _op.tunable(None)
    num_stages: int | None = _op.tunable(None)
    group_size: int | None = _op.tunable(None)
    walk: str | None = None
    epilogue_subtile: int | None = _op.tunable(None)

    @property
    def blocks(self) -> tuple[int, int, int]:
        return (self.block_m, self.block_n, self.block_k)

    def check(self, op: str) -> None:
        """Raises ValueError naming ``block_sizes`` when a tile is not a positive int, a
        launch parameter neither None nor a positive int, ``walk`` unknown, or
        ``epilogue_subtile`` not None, 1, 2 or 4 dividing ``block_n``."""
        for name in self.tunable_fields():
            value = getattr(self, name)
            required = name.startswith("block_")
            if (value is None and not required) or (
                    isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0):
                continue
            raise ValueError(f"{op}: block_sizes.{name} must be a positive int"
                             f"{'' if required else ' or None'}, got {value!r}.")
        if self.walk not in (None, tiled.GRID, tiled.LOOP):
            raise ValueError(f"{op}: block_sizes.walk must be None, {tiled.GRID!r} or "
                             f"{tiled.LOOP!r}, got {self.walk!r}.")
        parts = self.epilogue_subtile
        if parts is not None and (parts not in tiled.SUBTILES or self.block_n % parts):
            raise ValueError(f"{op}: block_sizes.epilogue_subtile must be None or one of "
                             f"{tiled.SUBTILES} dividing block_n = {self.block_n}, got {parts!r}.")

    @classmethod
    def from_blocks(cls, blocks, backend: str) -> "MatmulConfig":
        """``(block_m, block_n, block_k)`` on ``backend``, launch parameters the heuristic's."""
        return cls(*blocks, walk=tiled.strategy(backend))

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "MatmulConfig":
        """:func:`ops.matmul.tiled.default_block_sizes`, or in Triton's CPU interpreter
        :func:`ops.matmul.tiled.interpreter_block_sizes`."""
        m, n, k = problem.shape
        if device.interpreter:
            return cls.from_blocks(tiled.interpreter_block_sizes(m, n, k), device.backend)
        return cls.from_blocks(tiled.default_block_sizes(m, n, k, problem.dtype, device.backend),
                               device.backend)

    @classmethod
    def from_tuned(cls, tuned, problem: _op.Problem, device: _op.Device) -> "MatmulConfig":
        """A cache entry over the device's own (not the interpreter's) heuristic."""
        base = cls.heuristic(problem, dataclasses.replace(device, interpreter=False))
        return dataclasses.replace(base, **tuned)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["MatmulConfig", ...]:
        """Tensor-core tiles clamped to the problem (block_k at most 32 for float32,
        128 otherwise), with Triton's warps, stages and group sizes; the 256-column
        tiles with their epilogue in halves or quarters (``epilogue_subtile``;
        dropped where N clamps the tile to 128 columns or fewer)."""
        m, n, k = problem.shape
        cap_k = 32 if problem.dtype == "float32" else 128
        walk = tiled.strategy(device.backend)
        configs = []
        for bm, bn, bk, w, s, g, parts in _SPACE:
            bn = _op.fit(bn, n)
            parts = parts if bn > 128 else None  # a clamped tile is one of the others
            configs.append(cls(_op.fit(bm, m), bn, _op.fit(min(bk, cap_k), k), w, s, g, walk=walk,
                               epilogue_subtile=parts))
        return tuple(dict.fromkeys(configs))


def check_block_sizes(block_sizes, op: str, config_type: type = MatmulConfig):
    """A matmul-shaped op's ``block_sizes=``: None, a ``config_type`` (its fields
    checked, :meth:`MatmulConfig.check`), or three positive ints ``(block_m, block_n,
    block_k)``, returned as a tuple of ints.

    Raises:
      ValueError: anything else, naming ``block_sizes`` and ``op``.
    """
    if block_sizes is None:
        return None
    if isinstance(block_sizes, config_type):
        block_sizes.check(op)
        return block_sizes
    sizes = tuple(block_sizes) if isinstance(block_sizes, (tuple, list)) else ()
    if len(sizes) != 3 or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                                  and b > 0 for b in sizes):
        raise ValueError(f"{op}: block_sizes must be three positive ints (block_m, block_n, "
                         f"block_k) or a {config_type.__name__}, got {block_sizes!r}.")
    return tuple(int(b) for b in sizes)
