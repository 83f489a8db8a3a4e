"""Linear cross-entropy's logits tiles on the Mosaic GPU core (``linear_cross_entropy(...,
implementation="mosaic_gpu")``, registered by :mod:`ops.reduction.linear_cross_entropy`).

The op's checks, custom_vjp, partitioning, XLA loop over vocabulary chunks and
statistics merge are :mod:`ops.reduction.linear_cross_entropy`'s (Wijmans et al.
2024, "Cut Your Losses in Large-Vocabulary Language Models"); the kernels here
are :mod:`ops.matmul.mosaic_gpu_core`'s:

* forward: the logits tiles ``x @ w`` with a *row epilogue*: each consumer
  warpgroup reduces its float32 tile (soft-capped, columns past V masked) to
  per-row statistics, the maximum, the sum of ``exp(z - max)``, the label's
  logit (labels a row vector loaded by TMA) and with label smoothing the sum
  of the logits, stored as ``[column blocks, N]`` float32 arrays: the
  vocabulary split into warpgroup-wide column blocks, merged by XLA like the
  other kernels' splits. No ``N x V`` array is written: ``4 N V / block``
  bytes of statistics (at N = 8192, V = 131072 and 64-column blocks, 64 MiB
  per statistic against XLA's 4 GiB of float32 logits);
* backward, per vocabulary chunk: ``dz = g * (softmax - onehot)`` (soft cap,
  smoothing and the z-loss's ``g_lse * softmax`` as in the Triton kernels) as
  the tile epilogue of the recomputed logits, from row vectors of the saved
  max and log-sum; then ``dx += dz @ w_chunk^T`` (float32) and ``dw_chunk = x^T
  @ dz`` on the core, ``w_chunk`` and ``x`` read in place and transposed.

Predicted (H200, bfloat16, 8192 x 4096 x 131072, to be measured:
``benchmarks/lease_queue.json``): the forward is the matmul's work (2 N D V)
at the core's rate less the row epilogue's exponentials (one per logit,
``V / 64`` reductions per row: under 10% at 128 x 128 blocks); the backward
three products per chunk (8 N D V flops in all, against XLA's 6 N D V with
the logits kept) at the core's rate: about 0.85x XLA's speed at about 0.3x its
peak memory (the ``D x V`` weight gradient, one ``N x chunk`` dz buffer and a
float32 ``dx`` against XLA's float32 logits and their gradient).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ops import _op
from ops.matmul import mosaic_gpu_core as core
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig
from ops.reduction.lm_loss import soft_cap as _soft_cap


@dataclasses.dataclass(frozen=True)
class MosaicLceConfig(MosaicMatmulConfig):
    """:class:`~ops.matmul.mosaic_gpu_config.MosaicMatmulConfig` of the logits tiles
    (``block_m`` rows, ``block_n`` vocabulary columns, ``block_k`` of D), chosen for the
    problem ``(rows, d, vocab)``: 128 x 128 x 64 with the consumers side by side (each
    reduces a 128 x 64 tile: its exponentials fit beside the accumulator's registers)."""

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "MosaicLceConfig":
        rows, d, vocab = problem.shape[:3]
        return cls(128 if rows > 64 else 64, 128, 64)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["MosaicLceConfig", ...]:
        """128 x 128 either way of splitting the consumers, 128 x 256, 3 or 4 stages."""
        out = [cls.heuristic(problem, device)]
        for bm, bn, wgm in ((128, 128, 2), (128, 256, 1), (256, 128, 2)):
            for stages in (4, 3):
                c = cls(bm, bn, 64, stages, wgm)
                if c not in out:
                    out.append(c)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class LceKernels:
    """The kernels of :mod:`ops.reduction.linear_cross_entropy` on the Mosaic GPU core
    (``_Config.kernels``); ``explicit``: the caller's config for every product (None:
    the logits tiles' from the op's selection, the dx / dw products' by shape)."""

    explicit: MosaicMatmulConfig | None = None

    def block_vocab(self, config: MosaicMatmulConfig) -> int:
        return config.block_n

    def forward_stats(self, x2, w, labels2, config: MosaicMatmulConfig, *, soft_cap=None,
                      smoothing: bool = False) -> list:
        """Per-split ``(max, sum of exp(z - max), picked logit[, logit sum])``, each
        float32 ``[splits, rows, 1]`` (a split: one warpgroup-wide column block)."""
        n, d = x2.shape
        vocab = w.shape[1]

        def stats(tile: core.Tile):
            z = _soft_cap(tile.accs[0], soft_cap)
            col = tile.col_ids()
            inside = col < vocab
            z = jnp.where(inside, z, -jnp.inf)
            m = z.max(axis=1)
            shift = jnp.where(m == -jnp.inf, 0.0, m)
            s = jnp.exp(z - lax.broadcast_in_dim(shift, z.shape, [0])).sum(axis=1)
            picked = jnp.where(col == tile.row(0), z, 0.0).sum(axis=1)
            if not smoothing:
                return m, s, picked
            return m, s, picked, jnp.where(inside, z, 0.0).sum(axis=1)

        _, outs = core.matmul([core.Operand(x2)], [core.Operand(w)], m=n, n=vocab, k=d,
                              config=config, epilogue=None, rows=[labels2[:, 0]],
                              num_row_outputs=4 if smoothing else 3, row_epilogue=stats,
                              name="linear_cross_entropy_fwd")
        return [o[:, :, None] for o in outs]

    def dz(self, x2, w_chunk, local_labels, m, log_s, g2, config: MosaicMatmulConfig, *,
           soft_cap=None, smoothing: float = 0.0, num_classes: int = 0, g_lse2=None):
        """``g * (softmax - onehot)`` (and the z-loss's ``g_lse * softmax``) for the columns
        of ``w_chunk``: ``[rows, chunk]``, x's dtype."""
        n, d = x2.shape
        chunk = w_chunk.shape[1]
        lse_grad = g_lse2 is not None

        def epilogue(tile: core.Tile):
            z = tile.accs[0]
            onehot = (tile.col_ids() == tile.row(0)).astype(jnp.float32)
            if smoothing:
                onehot = (1.0 - smoothing) * onehot + smoothing / num_classes
            if soft_cap is not None:
                t = jnp.tanh(z / soft_cap)
                z = soft_cap * t
            p = jnp.exp((z - tile.row(1)) - tile.row(2))
            dz = tile.row(3) * (p - onehot)
            if lse_grad:
                dz = dz + tile.row(4) * p
            if soft_cap is not None:
                dz = dz * (1.0 - t * t)
            return (dz,)

        rows = [local_labels[:, 0], m[:, 0], log_s[:, 0], g2[:, 0]]
        rows += [g_lse2[:, 0]] if lse_grad else []
        (dz,), _ = core.matmul([core.Operand(x2)], [core.Operand(w_chunk)], m=n, n=chunk, k=d,
                               config=config, out_dtype=x2.dtype, epilogue=epilogue, rows=rows,
                               name="linear_cross_entropy_dz")
        return dz

    def products(self, x2, w_chunk, dz):
        """``(dx contribution float32 [rows, D], dw_chunk [D, chunk])``."""
        n, d = x2.shape
        chunk = w_chunk.shape[1]

        def config(m, n_, k):
            return self.explicit or MosaicMatmulConfig.for_shape(m, n_, k)

        (dx,), _ = core.matmul([core.Operand(dz)], [core.Operand(w_chunk, transposed=True)], m=n,
                               n=d, k=chunk, config=config(n, d, chunk), out_dtype=jnp.float32,
                               name="linear_cross_entropy_dx")
        (dw,), _ = core.matmul([core.Operand(x2, transposed=True)], [core.Operand(dz)], m=d,
                               n=chunk, k=n, config=config(d, chunk, n), out_dtype=w_chunk.dtype,
                               name="linear_cross_entropy_dw")
        return dx, dw
