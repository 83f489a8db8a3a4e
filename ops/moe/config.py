"""``ops.ragged_dot``'s typed config (:mod:`ops._op`) and its tile heuristic.

The tiles are chosen by the tokens per expert (``M / G``), K and N: a row
tile much taller than a group wastes the rows of the groups it straddles
(each visit computes the whole tile and stores only its group's rows), so
the row tile follows ``M / G`` down to 16 rows; the column and contraction
tiles are the tensor-core shapes of the dense matmul
(:func:`ops.matmul.tiled.default_block_sizes`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ops._op import Device, Problem, fit
from ops.matmul.config import MatmulConfig
from ops._tiles import mosaic_tpu_matmul_blocks
from pallas_core.triton import backend as triton_backend


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig(MatmulConfig):
    """The grouped matmul's tiles and launch parameters: :class:`MatmulConfig`'s
    fields with their meaning for the forward's ``[M, K] @ [K, N]`` tiles
    (``group_size`` unused: the row tiles follow the groups), its own heuristic.

    ``walk``: None for the backend's (``"loop"`` on the Triton backends, whose
    programs run concurrently; ``"grid"`` on interpret and mosaic_tpu, in-order
    grids); the interpreter runs either (the tests check both there).

    The backward pass reuses the tiles by role: ``dlhs`` tiles (block_m,
    block_k) contracting N by block_n; ``drhs`` tiles (block_k, block_n)
    contracting each group's rows by block_m; both with the forward's warps.
    """

    @classmethod
    def heuristic(cls, problem: Problem, device: Device) -> "RaggedDotConfig":
        """By tokens per group ``M / G``, K and N (``problem.shape = (m, k, n, groups)``):

        * Triton GPUs: row tiles of 128 (64 when groups average fewer than 128
          rows, 32 below 64, 16 below 32), 128 columns, K steps of 64 for
          16-bit dtypes (32 for float32): the dense matmul's tensor-core tiles;
        * Triton's CPU interpreter: whole dims up to 512 (its cost is per
          operation, not per element), rows by M / G;
        * mosaic_tpu: rows a multiple of 8 up to 128 (the whole M when smaller),
          whole dims up to 512 columns, K steps of 512/256/128 dividing K;
        * interpret: powers of two from 8 to 128 by M / G, N and K, so edge
          tiles and group boundaries inside tiles are exercised.
        """
        m, k, n, groups = problem.shape
        per_group = max(1, -(-m // max(groups, 1)))
        traits = device.traits
        if traits.hardware == "tpu":
            bm, bn, bk = mosaic_tpu_matmul_blocks(m, n, k, max_m=128, max_n=512)
            if bm != m:
                bm = min(128, max(8, -(-per_group // 8) * 8))
            return cls(bm, bn, bk)
        if device.interpreter:
            bm, bn, bk = triton_backend.interpreter_tiles((per_group, n, k))
            return cls(max(16, bm), max(16, bn), max(16, bk))
        if traits.triton:
            cap_k = 32 if np.dtype(problem.dtype) == np.float32 else 64
            return cls(fit(128, per_group), fit(128, n), fit(cap_k, k))
        return cls(fit(128, per_group, floor=8), fit(128, n, floor=8), fit(128, k, floor=8))

    @classmethod
    def candidates(cls, problem: Problem, device: Device) -> tuple["RaggedDotConfig", ...]:
        """On Triton GPUs: row tiles 64 / 128, column tiles 64 / 128, K steps 32 / 64,
        4 or 8 warps, 3 or 4 stages (clamped to the problem, distinct; 128 x 256 tiles
        take more than sm_90's 227 KiB of shared memory in the backward kernels);
        elsewhere the heuristic's."""
        base = cls.heuristic(problem, device)
        if not device.traits.triton or device.interpreter:
            return (base,)
        m, k, n, groups = problem.shape
        per_group = max(1, -(-m // max(groups, 1)))
        out = [base]
        for bm in (64, 128):
            for bn in (64, 128):
                for bk in (32, 64):
                    for warps, stages in ((4, 3), (8, 3), (8, 4)):
                        c = cls(fit(bm, per_group), fit(bn, n), fit(bk, k), warps, stages)
                        if c not in out:
                            out.append(c)
        return tuple(out)
