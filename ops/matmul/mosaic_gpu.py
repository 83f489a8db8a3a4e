"""``fused_matmul(..., implementation="mosaic_gpu")``: the op on the warp-specialized Mosaic GPU core.

Registered beside the op's other implementations
(:func:`ops._op.register_implementation`, docs/design.md §5.2): the op's
checks, custom_vjp and partitioning are :mod:`ops.matmul.fused_matmul`'s; the
products are :mod:`ops.matmul.mosaic_gpu_core`'s (:class:`FusedKernels`):

* forward: one kernel, ``act(x @ w + bias)`` applied on each consumer
  warpgroup's float32 accumulator in registers (bias a column vector loaded
  by TMA per tile), stored by TMA in epilogue tiles; when gradients are wanted
  the same epilogue also stores ``z = x @ w + bias`` (x's dtype), as the
  Triton path does;
* backward: ``dz = g * act'(z)`` from the saved ``z`` (one XLA elementwise
  fusion with ``dbias``'s column sums: it is memory-bound either way; ``act'``
  by JAX autodiff of the activation), then ``dx = dz @ w^T`` and ``dw = x^T @
  dz`` on the core with ``w`` and ``x`` read in place and transposed in
  ``wgmma`` (no transposed copy in memory).

The activation runs in the kernel as JAX primitives (its calls inlined,
``log1p`` / ``expm1`` in Kahan's forms: :func:`ops.matmul.mosaic_gpu_core.inlined`);
one that Mosaic GPU's lowering cannot take makes :func:`supported` refuse the
call before anything is traced, so ``implementation=("mosaic_gpu", "xla")``
falls back. So do float32 operands (``wgmma`` would run them as TF32), a
``MatmulConfig`` (the Triton kernels' tiles) as ``block_sizes``, and a GPU
older than sm_90.

Static view (``plgpu.mosaic_modules`` of the bfloat16 forward, 128 x 256 x 64
blocks, consumers side by side: each warpgroup 128 x 128): per contraction
step and warpgroup 8 ``wgmma.mma_async m64n128k16`` (two 64-row halves x
four 16-deep steps) then one ``wgmma.wait_group``; the producer's TMA loads
(``cp.async.bulk.tensor.shared.cluster.global``) of one 128 x 64 and one
64 x 256 tile per step, ``mbarrier.arrive.expect_tx`` on the stage's barrier,
``mbarrier.try_wait.parity`` for free slots; ``setmaxregister`` twice (the
producer down to 40, the consumers up); per output tile 4 TMA stores
(``cp.async.bulk.tensor.global.shared.cta``) of 64 x 64 epilogue tiles per
warpgroup, 8 with the pre-activation.

Predicted (H200, bfloat16, to be measured: ``benchmarks/lease_queue.json``,
experiments ``mosaic-gpu-matmul-*`` and ``mosaic-gpu-bias-gelu-fwd``): JAX's
kernel of this design reaches 83.6% of the H100's 990 TFLOP/s dense peak at
4096 x 8192 x 4096; the H200 has the same SMs and clocks. Less a margin for the
epilogue's wait on the previous tile's stores, the forward at 8192^3 is
predicted at about 730 TFLOP/s, 1.18x XLA's 621 measured there (torch's cuBLAS
call: 705), as-predicted between 1.0x and 1.35x; at 4096^3 (128 tiles of
128 x 256 for 132 SMs: no persistence) about 1.05x. bias + gelu_exact about 5-7%
below the plain forward (the float32 epilogue, ~5 us per 128 x 256 tile against
72 us of products, is not overlapped within the block), 1.12x XLA; forward +
backward about 1.12x (dx and dw run the same kernel with transposed operands,
no transposed copy; the dz fusion reads 2 and writes 1 ``M x N`` arrays, none
without an activation).
"""
from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp

from ops import _op
from ops.matmul import mosaic_gpu_core as core
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig

# The module (the package's name ``fused_matmul`` is the function).
fm = importlib.import_module("ops.matmul.fused_matmul")

IMPLEMENTATION = "mosaic_gpu"


def device_unsupported(call: _op.Call) -> str | None:
    """Why the call's GPU cannot run Mosaic GPU's warpgroup kernels (a GPU older than
    sm_90), or None (:func:`pallas_core.gpu.target.why_not_gpu`)."""
    from pallas_core.gpu import target
    t = call.target
    return target.why_not_gpu(t.platform, t.device_kind, t.sm,
                              f"{call.op.name}: implementation='mosaic_gpu'")


def block_sizes_unsupported(block_sizes) -> str | None:
    """Why ``block_sizes`` (checked by the op) are not tiles of the Mosaic GPU core, or None:
    a :class:`MosaicMatmulConfig`, None, or three ints that make a valid one."""
    if block_sizes is None or isinstance(block_sizes, MosaicMatmulConfig):
        return None
    if isinstance(block_sizes, _op.KernelConfig):
        return (f"block_sizes is a {type(block_sizes).__name__} (tiles of the Triton, interpret "
                "and Mosaic TPU kernels); pass a MosaicMatmulConfig")
    try:
        MosaicMatmulConfig(*block_sizes).check("block_sizes")
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def as_config(block_sizes) -> MosaicMatmulConfig | None:
    """The caller's tiles as a :class:`MosaicMatmulConfig` (None stays None)."""
    if block_sizes is None or isinstance(block_sizes, MosaicMatmulConfig):
        return block_sizes
    return MosaicMatmulConfig(*block_sizes)


def why_not(dtype, *, block_sizes=None, activation=None, call=None) -> str | None:
    """Why the Mosaic GPU core cannot run a call, every reason joined: its dtype, its
    tiles, its activation, its device (None when it can). What the matmul family's
    ``supported`` returns."""
    found = [core.unsupported_dtype(dtype), block_sizes_unsupported(block_sizes),
             core.unlowerable(activation, "the activation"),
             device_unsupported(call) if call is not None else None]
    return "; ".join(r for r in found if r) or None


def supported(call: _op.Call) -> str | None:
    """None when ``fused_matmul(..., implementation="mosaic_gpu")`` runs ``call``, else why
    not (read before anything is traced): float32 operands, an activation Mosaic GPU's
    lowering cannot take, Triton tiles as ``block_sizes``, a GPU older than sm_90."""
    a = call.args
    return why_not(a["x"].dtype, block_sizes=a["blocks"], activation=a["act"], call=call)


@dataclasses.dataclass(frozen=True)
class FusedKernels:
    """fused_matmul's products on the Mosaic GPU core (``_Config.kernels`` of
    :mod:`ops.matmul.fused_matmul`).

    ``explicit``: the caller's config, used by the forward and both backward
    products alike; None: each product's own from the tuning cache or the
    heuristic (:meth:`ops._op.Op.select` on its ``(m, n, k)``).
    """

    explicit: MosaicMatmulConfig | None = None

    def config(self, m: int, n: int, k: int, dtype) -> MosaicMatmulConfig:
        return fm.OP.select(fm.OP.problem((m, n, k), dtype), IMPLEMENTATION, self.explicit)

    def forward(self, x, w, bias, activation, *, want_preact: bool, out_dtype=None) -> tuple:
        """``(act(x @ w + bias),)``, with ``z = x @ w + bias`` after it if ``want_preact``."""
        (m, k), n = x.shape, w.shape[1]
        act = core.inlined(activation) if activation is not None else None
        has_bias = bias is not None

        def epilogue(tile: core.Tile):
            z = tile.accs[0]
            if has_bias:
                z = z + tile.col(0).astype(jnp.float32)
            out = act(z) if act is not None else z
            return (out, z) if want_preact else (out,)

        outs, _ = core.matmul([core.Operand(x)], [core.Operand(w)], m=m, n=n, k=k,
                              config=self.config(m, n, k, x.dtype),
                              out_dtype=out_dtype or x.dtype,
                              num_tile_outputs=2 if want_preact else 1, epilogue=epilogue,
                              cols=[bias] if has_bias else [],
                              name=fm._kernel_name(activation, bias))
        return tuple(outs)

    def backward(self, x, w, z, bias, g, activation):
        """``(dx, dw, dbias float32 or None)`` from the saved pre-activation ``z``."""
        (m, k), n = x.shape, w.shape[1]
        if activation is not None:
            _, pullback = jax.vjp(activation, z.astype(jnp.float32))
            (dz32,) = pullback(g.astype(jnp.float32))
            dz = dz32.astype(x.dtype)
        else:  # dz is g itself: no copy
            dz32, dz = g.astype(jnp.float32), g.astype(x.dtype)
        dbias = jnp.sum(dz32, axis=0) if bias is not None else None
        # dx [M, K] = dz [M, N] @ w [K, N]^T: w read in place, transposed in wgmma.
        (dx,), _ = core.matmul([core.Operand(dz)], [core.Operand(w, transposed=True)], m=m, n=k,
                               k=n, config=self.config(m, k, n, x.dtype), out_dtype=x.dtype,
                               name="fused_matmul_dx")
        # dw [K, N] = x [M, K]^T @ dz [M, N]: x read in place, transposed in wgmma.
        (dw,), _ = core.matmul([core.Operand(x, transposed=True)], [core.Operand(dz)], m=k, n=n,
                               k=m, config=self.config(k, n, m, x.dtype), out_dtype=w.dtype,
                               name="fused_matmul_dw")
        return dx, dw, dbias


def run(call: _op.Call):
    """The checked call on the Mosaic GPU core."""
    a = call.args
    kernels = FusedKernels(as_config(a["blocks"]))
    return fm._fused_matmul_on(IMPLEMENTATION, a["x"], a["w"], a["bias"], a["act"],
                               kernels.explicit, kernels=kernels)


_op.register_implementation(fm._OP, _op.Implementation(
    IMPLEMENTATION, run, config=MosaicMatmulConfig, supported=supported, platforms=("gpu",)))
