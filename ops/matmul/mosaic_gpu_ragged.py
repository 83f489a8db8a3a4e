"""The grouped matmul's kernels on the Mosaic GPU core (``ragged_dot(...,
implementation="mosaic_gpu")``, registered by :mod:`ops.moe.ragged_dot`).

The op's checks, custom_vjp, partitioning and group tables are
:mod:`ops.moe.ragged_dot`'s and :mod:`ops.moe.group_table`'s (the grouped GEMM
of megablox: Gale et al. 2023, "MegaBlocks", section 5); the kernels are
:mod:`ops.matmul.mosaic_gpu_core`'s walks over those tables (JAX's grouped
Mosaic GPU matmuls, ``ragged_dot_mgpu`` / ``transposed_ragged_dot_mgpu``, were
read for the technique; the code is ours):

* ``gmm`` (forward, and ``dlhs = dout @ rhs[g]^T`` with ``rhs`` read in place
  and transposed): the persistent loop walks (visit, column tile) pairs of the
  visit table :func:`ops.moe.group_table.row_visits` builds on the device:
  every row tile once per group it holds rows of, ``rhs[group]`` its right
  operand, only the visit's rows stored (a tile a boundary cuts is stored by
  two visits, each its own rows: TMA stores of power-of-two row counts, the
  count known on the device); zero segments (rows no owned group holds) store
  zeros without a product; visits past the table's real length do nothing;
* ``tgmm`` (``drhs[g] = lhs_g^T @ dout_g``): the loop walks (group, K tile,
  N tile); each contracts only the row tiles that hold the group's rows (a
  trip count read on the device), both operands read in place (``lhs``
  transposed), and the consumers zero the ``dout`` rows outside the group in
  shared memory on the first and last step, each its own columns; an empty
  group's gradient is stored as zeros. Every output tile has one writer.

Predicted (H200, bfloat16, 8 experts, 32768 x 4096 x 14336, even groups; to be
measured, ``benchmarks/lease_queue.json``): a boundary cuts at most 7 of the
256 row tiles (128 rows), so the forward does 1.03x the dense matmul's work and
runs at 0.95-0.97x the core's dense TFLOP/s, about 1.05x the per-expert cuBLAS
products' (the ``dense_loop`` baseline, which pays a launch and a tail wave per
expert); ``drhs`` contracts 4096-row groups (64 steps each) at the dense rate.
"""
from __future__ import annotations

import dataclasses

from ops import _op
from ops.matmul import mosaic_gpu_core as core
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig


@dataclasses.dataclass(frozen=True)
class MosaicRaggedConfig(MosaicMatmulConfig):
    """:class:`~ops.matmul.mosaic_gpu_config.MosaicMatmulConfig` of the grouped matmul,
    chosen for the problem ``(m, k, n, groups)``: the dense product's block
    (:meth:`MosaicMatmulConfig.for_shape` of ``(m, n, k)``); ``block_m`` is also the
    row tile of the visit table."""

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "MosaicRaggedConfig":
        m, k, n = problem.shape[:3]
        return cls.for_shape(m, n, k)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["MosaicRaggedConfig", ...]:
        """128 x 256 and 128 x 128 blocks either way of splitting the consumers, 64-row
        tiles (fewer rows wasted where a boundary cuts a tile), 3 or 4 stages."""
        out = [cls.heuristic(problem, device)]
        for bm, bn, wgm in ((128, 256, 1), (128, 128, 1), (128, 128, 2), (64, 256, 1)):
            for stages in (4, 3):
                c = cls(bm, bn, 64, stages, wgm)
                if c not in out:
                    out.append(c)
        return tuple(out)


def _tgmm_config(k: int, n: int, explicit) -> MosaicMatmulConfig:
    """``tgmm``'s block: the consumers side by side (each zeroes its own columns)."""
    if explicit is not None and explicit.warpgroups_m == 1:
        return explicit
    return MosaicMatmulConfig(128 if k > 64 else 64, 256 if n > 128 else 128, 64)


@dataclasses.dataclass(frozen=True)
class RaggedKernels:
    """:mod:`ops.moe.ragged_dot`'s kernels on the Mosaic GPU core (``_Kernel.products``);
    ``explicit``: the caller's config (None: the op's selection / defaults by shape)."""

    explicit: MosaicMatmulConfig | None = None

    def gmm(self, lhs, rhs, visits, *, transpose_rhs: bool, config: MosaicMatmulConfig,
            out_dtype, name: str):
        """``out[rows of visit v] = lhs[rows] @ rhs[group[v]]`` (``rhs [G, K, N]``; with
        ``transpose_rhs`` ``rhs[g]^T``, contracting N), zero where no owned group holds
        the rows; ``visits`` from :func:`ops.moe.group_table.row_visits` at
        ``config.block_m``."""
        m, k = lhs.shape
        n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        (out,), _ = core.matmul(
            [core.Operand(lhs)], [core.Operand(rhs, transposed=transpose_rhs)], m=m, n=n, k=k,
            config=config, out_dtype=out_dtype, walk=core.Visits(int(visits.tile.shape[0])),
            tables=(visits.tile, visits.group, visits.lo, visits.hi, visits.active), name=name)
        return out

    def tgmm(self, lhs, dout, begins, ends, *, out_dtype):
        """``drhs[g] = lhs[begins[g]:ends[g]]^T @ dout[begins[g]:ends[g]]``, ``[G, K, N]``."""
        m, k = lhs.shape
        n = dout.shape[1]
        (out,), _ = core.matmul(
            [core.Operand(lhs, transposed=True)], [core.Operand(dout)], m=k, n=n, k=m,
            config=_tgmm_config(k, n, self.explicit), out_dtype=out_dtype,
            walk=core.Groups(int(begins.shape[0])), tables=(begins, ends),
            name="ragged_dot_drhs")
        return out
