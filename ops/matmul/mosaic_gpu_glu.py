"""The gated linear unit's products on the Mosaic GPU core (``gated_linear_unit(...,
implementation="mosaic_gpu")``, registered by :mod:`ops.decoder.glu`).

``activation(x @ gate) * (x @ up)`` (Shazeer 2020, "GLU Variants Improve
Transformer"), with the op's checks, custom_vjp and partitioning in
:mod:`ops.decoder.glu` and the products here, on
:mod:`ops.matmul.mosaic_gpu_core`:

* forward: one kernel with two accumulators per consumer warpgroup (gate and
  up, ``block_n`` columns each): each stage loads the x tile once and the gate
  and up tiles beside it, and each step issues the two products on the shared
  x tile; the epilogue applies the activation and the product on the float32
  accumulators and stores ``out`` and, when gradients are wanted, the two
  pre-activations. Weights as a pair ``(gate, up)`` are two operands read in
  place; stacked ``[K, 2, N]`` weights are read as their free ``[K, 2N]`` view,
  the up tiles ``N`` columns in (a gate tile that runs past ``N`` reads up's
  columns, whose products land in output columns past ``N``, never stored),
  and their pre-activations are stored into one ``[M, 2N]`` (that is ``[M, 2,
  N]``) array, the up half ``N`` columns in, when ``N`` is a multiple of the
  epilogue tile's columns (else into two arrays stacked by XLA: a copy);
* backward: ``dz = (g * up * act'(gate), g * act(gate))`` by one XLA
  elementwise fusion from the saved pre-activations (memory-bound either way),
  then for stacked weights ``dx = dz @ w^T`` and ``dw = x^T @ dz`` over the
  ``[M, 2N]`` / ``[K, 2N]`` views (one kernel each), for a pair ``dx = dz_gate
  @ gate^T + dz_up @ up^T`` (one kernel, two products into one accumulator per
  step) and ``(dgate, dup) = (x^T @ dz_gate, x^T @ dz_up)`` (one kernel, two
  accumulators on the shared transposed x tile), every transposed operand read
  in place.

Predicted (H200, bfloat16, SwiGLU 8192 x 4096 -> 14336, pair; to be measured,
``benchmarks/lease_queue.json``): the forward is a 128 x 128 x 64 block with
two 128 x 64 accumulators per consumer (48 KiB per stage: 4 stages), the same
wgmma work per byte loaded as the 128 x 256 matmul; at the matmul's predicted
~800 TFLOP/s the forward + backward (6 products of 8192 x 4096 x 14336) is
about 1.1x XLA's (which runs the two projections as separate cuBLAS calls and
the backward's four products likewise).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ops import _op
from ops.matmul import mosaic_gpu_core as core
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig


@dataclasses.dataclass(frozen=True)
class MosaicGluConfig(MosaicMatmulConfig):
    """:class:`~ops.matmul.mosaic_gpu_config.MosaicMatmulConfig` of the gated linear unit's
    forward kernel: ``block_n`` is the columns of each of the gate and up accumulators
    (a consumer warpgroup holds two of its tiles). Its heuristic is 128 x 128 x 64
    (two 128 x 64 float32 accumulators per consumer: what one 128 x 128 matmul tile
    holds); the candidates are the matmul's at that width."""

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "MosaicGluConfig":
        m, n, k = problem.shape[:3]
        return cls.for_shape(m, n, k, products_per_step=2)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["MosaicGluConfig", ...]:
        """128 x 128 blocks either way of splitting the consumers, 64 x 128, 128 x 256 with
        the consumers stacked (each 64 x 256 x 2: 256 accumulator registers, a register-
        pressure probe), 3 or 4 stages, bands of 8 row or column tiles."""
        m, n, k = problem.shape[:3]
        out = [cls.heuristic(problem, device)]
        for bm, bn, wgm in ((128, 128, 1), (128, 128, 2), (64, 128, 1), (128, 256, 2)):
            for stages in (4, 3):
                for band_m, band_n in ((8, None), (None, 8)):
                    c = cls(bm, bn, 64, stages, wgm, band_m=band_m, band_n=band_n)
                    if c not in out:
                        out.append(c)
        return tuple(out)


def _matmul_config(m: int, n: int, k: int, explicit, products: int = 1) -> MosaicMatmulConfig:
    """A backward product's block: the caller's config, else the core's default for its shape."""
    if explicit is not None:
        return explicit
    return MosaicMatmulConfig.for_shape(m, n, k, products_per_step=products)


@dataclasses.dataclass(frozen=True)
class GluKernels:
    """The products of :mod:`ops.decoder.glu` on the Mosaic GPU core (``_Kernel.products``).

    ``explicit``: the caller's config, which the backward's products use too (None:
    each takes the core's default for its shape)."""

    explicit: MosaicMatmulConfig | None = None

    def forward(self, x, weights, config: MosaicMatmulConfig, activation, *, want_z: bool,
                out_dtype=None) -> tuple:
        """``(out,)`` or ``(out, *z)`` as :func:`ops.decoder.glu._forward_call` returns them."""
        m, k = x.shape
        paired = isinstance(weights, tuple)
        n = weights[0].shape[1] if paired else weights.shape[2]
        if paired:
            rhs = [core.Operand(weights[0]), core.Operand(weights[1])]
        else:
            w2 = weights.reshape(k, 2 * n)
            rhs = [core.Operand(w2), core.Operand(w2, offset=n)]
        act = core.inlined(activation) if activation is not None else None

        def epilogue(tile: core.Tile):
            gate, up = tile.accs
            out = (act(gate) if act is not None else gate) * up
            return (out, gate, up) if want_z else (out,)

        in_place = not paired and want_z and n % config.epilogue_tile[1] == 0
        name = "gated_linear_unit" + (f"_{getattr(activation, '__name__', 'act')}"
                                      if activation is not None else "")
        outs, _ = core.matmul(
            [core.Operand(x)], rhs, m=m, n=n, k=k, config=config,
            products=(core.Product(0, 0, 0), core.Product(0, 1, 1)), num_accs=2,
            out_dtype=out_dtype or x.dtype, num_tile_outputs=3 if want_z else 1,
            epilogue=epilogue, out_shapes=[(m, n), (m, 2 * n)] if in_place else None,
            stores=[(0, 0), (1, 0), (1, n)] if in_place else None, name=name)
        if not want_z or paired:
            return tuple(outs)
        if in_place:
            return outs[0], outs[1].reshape(m, 2, n)
        return outs[0], jnp.stack(outs[1:], axis=1)

    def backward(self, x, weights, zs: tuple, g, config: MosaicMatmulConfig, activation):
        """``(dx, dweights)`` as :func:`ops.decoder.glu._backward` returns them."""
        m, k = x.shape
        paired = isinstance(weights, tuple)
        if paired:
            gate, up = (z.astype(jnp.float32) for z in zs)
        else:
            gate, up = zs[0][:, 0].astype(jnp.float32), zs[0][:, 1].astype(jnp.float32)
        n = gate.shape[1]
        g = g.astype(jnp.float32)
        if activation is None:
            act, dgate = gate, g * up
        else:
            act, pullback = jax.vjp(activation, gate)
            (dgate,) = pullback(g * up)
        dup = g * act
        if not paired:
            dz = jnp.stack([dgate, dup], axis=1).astype(x.dtype).reshape(m, 2 * n)
            w2 = weights.reshape(k, 2 * n)
            # dx [M, K] = dz [M, 2N] @ w [K, 2N]^T; dw [K, 2N] = x^T @ dz.
            (dx,), _ = core.matmul([core.Operand(dz)], [core.Operand(w2, transposed=True)], m=m,
                                   n=k, k=2 * n, config=_matmul_config(m, k, 2 * n, self.explicit),
                                   out_dtype=x.dtype, name="gated_linear_unit_dx")
            (dw,), _ = core.matmul([core.Operand(x, transposed=True)], [core.Operand(dz)], m=k,
                                   n=2 * n, k=m, config=_matmul_config(k, 2 * n, m, self.explicit),
                                   out_dtype=weights.dtype, name="gated_linear_unit_dw")
            return dx, dw.reshape(k, 2, n)
        wg, wu = weights
        dzg, dzu = dgate.astype(x.dtype), dup.astype(x.dtype)
        # dx = dz_gate @ gate^T + dz_up @ up^T: two products into one accumulator per step.
        (dx,), _ = core.matmul(
            [core.Operand(dzg), core.Operand(dzu)],
            [core.Operand(wg, transposed=True), core.Operand(wu, transposed=True)],
            m=m, n=k, k=n, config=_matmul_config(m, k, n, self.explicit),
            products=(core.Product(0, 0, 0), core.Product(1, 1, 0)), out_dtype=x.dtype,
            name="gated_linear_unit_dx")
        # (dgate, dup) = (x^T @ dz_gate, x^T @ dz_up): two accumulators on the shared x tile.
        dws, _ = core.matmul(
            [core.Operand(x, transposed=True)], [core.Operand(dzg), core.Operand(dzu)],
            m=k, n=n, k=m, config=_matmul_config(k, n, m, self.explicit, products=2),
            products=(core.Product(0, 0, 0), core.Product(0, 1, 1)), num_accs=2,
            out_dtype=wg.dtype, num_tile_outputs=2, epilogue=lambda tile: tile.accs,
            name="gated_linear_unit_dw")
        return dx, tuple(dws)
