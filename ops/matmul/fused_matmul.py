"""Fused matmul with a bias + activation epilogue: ``act(x @ w + bias)``.

The kernel is the classic tiled matmul (Triton tutorial "Matrix
Multiplication"; the templated matmul of the Pallas design notes): each program owns one
``block_m x block_n`` output tile, walks the contraction dim in ``block_k``
steps with a float32 accumulator, and applies bias and activation to the
accumulator before the single store, so the pre-activation never makes a
round trip through memory.

The tile loop is the shared core, :mod:`ops.matmul.tiled`: K walked as the
last grid axis with a scratch accumulator (interpret, mosaic_tpu, triton, where
our Triton lowering runs that axis as a loop inside each program, pipelined
like Triton's tutorial matmul: sm_90 cp.async, num_stages=3, wgmma), or as a
``fori_loop`` over ``pl.ds`` slices of full-K blocks (pallas_triton); this
module supplies the epilogue. ``implementation="mosaic_gpu"`` runs the same
custom_vjp and partitioning on the warp-specialized Mosaic GPU core instead
(:mod:`ops.matmul.mosaic_gpu`, which registers it and hands its products in
as ``_Config.kernels``).

Backward (``jax.custom_vjp``): ``dz = g * act'(z)`` by one elementwise kernel
that also emits per-row-block partial sums for ``dbias``; then
``dx = dz @ w.T`` and ``dw = x.T @ dz`` by the same tiled kernel with
transposed operands, on the forward's tiles by role (their contraction steps
capped on GPUs so wide tiles fit shared memory, :func:`backward_step`) and its
epilogue subtile. ``act'`` comes from JAX autodiff of the activation,
traced inside the kernel.

Residual choice: the forward kernel also writes ``z = x @ w + bias`` (in x's
dtype) when an activation is present and gradients are wanted. Recomputing z
in the backward pass would cost another ``2*M*N*K`` flops (half the backward
matmul work again) to save ``M*N`` elements that XLA's own autodiff keeps
too; keeping it is the better trade on every accelerator we target.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops import _op
from ops._checks import check_array, check_matmul_operands, check_same_dtype
from ops._implementation import KERNEL_BACKENDS, check_implementation
from ops._partitioning import psum, reduced_axes, reshape, run
from ops.activations import resolve_activation
from ops.matmul import tiled
from ops.matmul.config import MatmulConfig, check_block_sizes
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig
from ops.matmul.tiled import default_block_sizes
from pallas_core.triton import backend as triton_backend

_OP = "fused_matmul"


def fused_matmul(x, w, bias=None, *, activation=None, implementation: str | None = None,
                 block_sizes: Sequence[int] | None = None) -> jax.Array:
    """``activation(x @ w + bias)`` in one kernel, with float32 accumulation.

    Args:
      x: ``[..., K]`` float32 / bfloat16 / float16; any number of leading dims.
      w: ``[K, N]``, same dtype as x.
      bias: ``[N]`` or None, same dtype as x.
      activation: None; a name with JAX's meaning ("relu", "relu6", "gelu" =
        ``jax.nn.gelu`` (tanh form), "gelu_exact" (erf form), "silu"/"swish",
        "sigmoid", "tanh", "softplus"); or any elementwise JAX callable. It runs
        on the float32 accumulator inside the kernel's epilogue.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton" (pallas_core's own Triton
        lowering), "pallas_triton" (JAX's), "mosaic_tpu" or "mosaic_gpu" (the
        warp-specialized sm_90 kernels of :mod:`ops.matmul.mosaic_gpu`: bfloat16 /
        float16, activations its lowering takes; NotImplementedError otherwise,
        :func:`ops.matmul.mosaic_gpu.supported`). Or a sequence of
        these tried in order, each that raises NotImplementedError skipped
        (:mod:`ops._implementation`).
      block_sizes: optional ``(block_m, block_n, block_k)`` tile sizes (a
        :class:`~ops.matmul.config.MatmulConfig` with the heuristic's launch
        parameters and walk), or a ``MatmulConfig`` itself, or for "mosaic_gpu" a
        :class:`~ops.matmul.mosaic_gpu_config.MosaicMatmulConfig` (a config of one
        implementation's kernels makes the others raise NotImplementedError); None
        takes the tuning cache's entry for the device, dtype
        and shape bucket (:mod:`ops.tuning`), else picks them by shape, dtype
        and backend (:func:`default_block_sizes`); see :func:`select_tiles`. The backward
        pass reuses them by role.

    Returns:
      ``[..., N]`` in x's dtype. With ``K = 0`` that is ``activation(bias)`` (or of
      zeros) in every row, on every implementation.

    Raises:
      TypeError: non-array inputs, integer or mismatched dtypes, a bad activation.
      ValueError: w not rank 2, K mismatch, bias not ``[N]``, unknown activation
        name or implementation, bad block_sizes.

    Differentiable in x, w and bias (``jax.custom_vjp`` with Pallas backward
    kernels); jit- and vmap-compatible.
    """
    act, blocks = _check(x, w, bias, activation, implementation, block_sizes)
    return OP.run(implementation, x=x, w=w, bias=bias, act=act, blocks=blocks)


def _check(x, w, bias, activation, implementation, block_sizes):
    """The argument checks of :func:`fused_matmul` (before anything is traced); returns the
    resolved activation and the checked block sizes."""
    check_matmul_operands(x, w, _OP)
    if bias is not None:
        check_array(bias, "bias", _OP)
        check_same_dtype(bias, x, "bias", "x", _OP)
        if tuple(bias.shape) != (w.shape[1],):
            raise ValueError(f"{_OP}: bias must have shape [N] = ({w.shape[1]},), got "
                             f"{tuple(bias.shape)}.")
    act = resolve_activation(activation, _OP)
    check_implementation(implementation, _OP)
    return act, _check_block_sizes(block_sizes)


def _fused_matmul_on(impl, x, w, bias, act, blocks, kernels=None):
    """The checked call on one implementation (see :func:`fused_matmul`); ``kernels``:
    another core's products (:class:`_Config`), None for the tiled core's."""
    if impl == "xla" or x.size == 0 or w.size == 0:
        # Nothing to multiply (M, K or N zero): XLA's answer is exact, bias + activation of
        # zeros for K = 0, with its gradients.
        return reference(x, w, bias, act)
    if kernels is None and isinstance(blocks, MosaicMatmulConfig):
        raise NotImplementedError(f"{_OP}: block_sizes is a MosaicMatmulConfig, the tiles of "
                                  f"implementation='mosaic_gpu', not of {impl!r}.")
    lead = x.shape[:-1]
    x2 = reshape(x, (-1, x.shape[-1]))
    config = _Config(backend=impl, block_sizes=blocks, kernels=kernels)
    out = _fused_matmul(x2, w, bias, config, act)
    return reshape(out, (*lead, w.shape[1]))


def _problem_of(x, w, **_):
    """The call's problem ``(m, n, k)`` (:attr:`ops._op.Op.problem_of`)."""
    return (math.prod(x.shape[:-1]), w.shape[1], w.shape[0]), x.dtype, None


def _check_block_sizes(block_sizes):
    if isinstance(block_sizes, MosaicMatmulConfig):
        block_sizes.check(_OP)
        return block_sizes
    return check_block_sizes(block_sizes, _OP)


# --------------------------------------------------------------------------
# XLA reference (also the "xla" implementation)
# --------------------------------------------------------------------------

def reference(x, w, bias=None, activation: Callable | None = None):
    """``act(x @ w + bias)`` with XLA: float32 accumulation, output in x's dtype."""
    z = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if activation is not None:
        z = activation(z)
    return z.astype(x.dtype)


# --------------------------------------------------------------------------
# Forward kernel: the tiled-matmul core with this op's epilogue
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    """What the custom_vjp carries: the implementation, the caller's tiles and, where the
    products run on another core than :mod:`ops.matmul.tiled`, that core's kernels
    (``forward(x, w, bias, activation, want_preact=, out_dtype=) -> tuple`` and
    ``backward(x, w, z, bias, g, activation) -> (dx, dw, dbias)``, hashable:
    :class:`ops.matmul.mosaic_gpu.FusedKernels`)."""

    backend: str
    block_sizes: "tuple[int, int, int] | MatmulConfig | MosaicMatmulConfig | None" = None
    kernels: object = None


def _epilogue(acc, refs: tiled.TileRefs, *, has_bias, want_preact, activation):
    """bias, the pre-activation residual, the activation and the store of one output tile."""
    bias_ref = refs.extras[0] if has_bias else None
    out_ref = refs.outs[0]
    preact_ref = refs.outs[1] if want_preact else None
    z = acc
    if bias_ref is not None:
        z = z + bias_ref[...].astype(jnp.float32)
    if preact_ref is not None:
        preact_ref[...] = z.astype(preact_ref.dtype)
    if activation is not None:
        z = activation(z)
    out_ref[...] = z.astype(out_ref.dtype)


def _matmul_call(a, b, *, ca: int, cb: int, blocks, backend, walk, out_dtype, bias=None,
                 activation=None, want_preact=False, num_warps=None, num_stages=None,
                 group_size=None, epilogue_subtile=None, name=None):
    """``act(A @ B + bias)`` with A = a contracting dim ca, B = b contracting dim cb,
    on the tiled-matmul core (:func:`ops.matmul.tiled.matmul_call`).

    ``blocks = (block_rows, block_cols, block_k)`` for the output's two dims
    and the contraction, ``walk`` the contraction's (the config's); ``num_warps``
    / ``num_stages`` / ``group_size`` (Triton
    backends; the last on ``triton`` only) None for the heuristic's;
    ``epilogue_subtile`` the column pieces the epilogue runs in (None: whole
    tiles; :func:`ops.matmul.tiled.subtiled`). The
    contraction dim is zero-padded to a multiple of block_k (exact for a sum; a
    copy only when K does not divide); the free dims use edge blocks, whose
    out-of-bounds rows are discarded. ``name`` names the kernel (None: from the
    activation and bias, :func:`_kernel_name`).
    """
    name = name or _kernel_name(activation, bias)
    m, n = a.shape[1 - ca], b.shape[1 - cb]
    params = tiled.launch_params(walk, backend, blocks, num_warps=num_warps,
                                 num_stages=num_stages, group_size=group_size)
    out_shapes = [jax.ShapeDtypeStruct((m, n), out_dtype)] * (2 if want_preact else 1)
    extras = [(bias.reshape(1, n), tiled.COLS)] if bias is not None else []
    epilogue = functools.partial(_epilogue, has_bias=bias is not None, want_preact=want_preact,
                                 activation=activation)
    outs = tiled.matmul_call(a, b, ca=ca, cb=cb, blocks=blocks, backend=backend,
                             out_shape=out_shapes, epilogue=epilogue, extras=extras, walk=walk,
                             compiler_params=params, epilogue_subtile=epilogue_subtile, name=name)
    return tuple(outs) if want_preact else outs[0]


def _kernel_name(activation, bias):
    act = getattr(activation, "__name__", None) or getattr(getattr(activation, "func", None),
                                                           "__name__", "act")
    return "fused_matmul" + ("_bias" if bias is not None else "") + (f"_{act}" if activation else "")


# --------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------

def _dz_kernel(*refs, activation, want_dz, want_dbias, rows, block_rows):
    """dz = g * act'(z); per-row-block column sums of dz for dbias."""
    refs = list(refs)
    g_ref = refs.pop(0)
    z_ref = refs.pop(0) if activation is not None else None
    dz_ref = refs.pop(0) if want_dz else None
    dbias_ref = refs.pop(0) if want_dbias else None
    g = g_ref[...].astype(jnp.float32)
    if activation is not None:
        _, pullback = jax.vjp(activation, z_ref[...].astype(jnp.float32))
        (dz,) = pullback(g)
    else:
        dz = g
    if dz_ref is not None:
        dz_ref[...] = dz.astype(dz_ref.dtype)
    if dbias_ref is not None:
        if rows % block_rows:  # edge block: rows past the end hold garbage
            row = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, dz.shape, 0)
            dz = jnp.where(row < rows, dz, 0.0)
        dbias_ref[...] = jnp.sum(dz, axis=0, keepdims=True)


def _dz_call(g, z, *, activation, want_dbias, blocks, backend):
    """Returns (dz or None, dbias float32 [N] or None)."""
    bm, bn, _ = blocks
    m, n = g.shape
    want_dz = activation is not None
    grid = (pl.cdiv(m, bm), pl.cdiv(n, bn))
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    in_specs, operands = [tile], [g]
    if activation is not None:
        in_specs.append(tile)
        operands.append(z)
    out_shapes, out_specs = [], []
    if want_dz:
        out_shapes.append(jax.ShapeDtypeStruct((m, n), g.dtype))
        out_specs.append(tile)
    if want_dbias:
        out_shapes.append(jax.ShapeDtypeStruct((grid[0], 1, n), jnp.float32))
        out_specs.append(pl.BlockSpec((None, 1, bn), lambda i, j: (i, 0, j)))
    outs = pl.pallas_call(
        functools.partial(_dz_kernel, activation=activation, want_dz=want_dz,
                          want_dbias=want_dbias, rows=m, block_rows=bm),
        out_shape=out_shapes, grid=grid, in_specs=in_specs, out_specs=out_specs,
        # Twice the forward's warps, one stage (no loop): at a 128 x 128 float32 tile,
        # act' and the dbias column sums spill on sm_90 with 4 warps (4 KiB) and 8
        # (128 bytes), and take 60 registers with 16 (benchmarks.static).
        compiler_params=pl.triton.CompilerParams(num_warps=2 * tiled.default_num_warps(bm, bn), num_stages=1)
        if pl.backend_traits(backend).triton else None,
        backend=backend, name="fused_matmul_dz")(*operands)
    outs = list(outs)
    dz = outs.pop(0) if want_dz else g
    dbias = jnp.sum(outs.pop(0), axis=(0, 1)) if want_dbias else None
    return dz, dbias


# --------------------------------------------------------------------------
# custom_vjp wiring
# --------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_matmul(x, w, bias, config: _Config, activation):
    return _partitioned_forward(x, w, bias, config, activation, want_preact=False)[0]


def _fused_matmul_fwd(x, w, bias, config, activation):
    want_preact = activation is not None
    out, *z = _partitioned_forward(x, w, bias, config, activation, want_preact=want_preact)
    return out, (x, w, z[0] if want_preact else None, bias)


def _fused_matmul_bwd(config, activation, residuals, g):
    x, w, z, bias = residuals

    def local(x, w, z, bias, g, *, reduced):
        dx, dw, dbias = _backward(x, w, z, bias, g, config, activation)
        # dx sums over N, dw and dbias over M: partial sums where those are split.
        return (psum(dx, reduced, "n"), psum(dw, reduced, "m"),
                *(() if bias is None else (psum(dbias, reduced, "m"),)))

    dx, dw, *dbias = run(_OP, local, (x, w, z, bias, g), ("m k", "k n", "m n", "n", "m n"),
                         ("m k", "k n") + (() if bias is None else ("n",)),
                         reduce=("m", "n"), out_like=(0, 1, 3))
    return dx, dw, (dbias[0].astype(bias.dtype) if bias is not None else None)


def _partitioned_forward(x, w, bias, config: _Config, activation, *, want_preact: bool) -> tuple:
    """``(out,)`` or ``(out, z)`` on a mesh (:mod:`ops._partitioning`).

    Rows of x ("m") and columns of w and bias ("n") run where they live. A
    contraction dim ("k") split on both operands gives each device a partial
    product: the kernel runs without its epilogue, one psum in float32 sums
    the partials, and bias and activation (not linear) are applied after it.
    """
    def local(x, w, bias, *, reduced):
        if not reduced_axes(reduced, "k"):
            return _forward(x, w, bias, config, activation, want_preact=want_preact)
        if config.kernels is not None:
            (partial,) = config.kernels.forward(x, w, None, None, want_preact=False,
                                                out_dtype=jnp.float32)
        else:
            partial = _partial_product(x, w, config)
        z = psum(partial, reduced, "k")
        if bias is not None:
            z = z + bias.astype(jnp.float32)
        out = (z if activation is None else activation(z)).astype(x.dtype)
        return (out, z.astype(x.dtype)) if want_preact else (out,)

    return run(_OP, local, (x, w, bias), ("m k", "k n", "n"),
               ("m n", "m n") if want_preact else ("m n",), reduce=("k",))


def _partial_product(x, w, config: _Config):
    """``x @ w`` in float32 without the epilogue (one device's share of a split K)."""
    tiles = select_tiles(x.shape[0], w.shape[1], x.shape[1], x.dtype, config.backend,
                         config.block_sizes)
    return _matmul_call(x, w, ca=1, cb=0, blocks=tiles.blocks, backend=config.backend,
                        walk=tiles.walk, out_dtype=jnp.float32, num_warps=tiles.num_warps,
                        num_stages=tiles.num_stages, group_size=tiles.group_size,
                        epilogue_subtile=tiles.epilogue_subtile)


def _forward(x, w, bias, config: _Config, activation, *, want_preact: bool) -> tuple:
    """One device: ``(act(x @ w + bias),)``, with ``z = x @ w + bias`` too if ``want_preact``."""
    if config.kernels is not None:
        return config.kernels.forward(x, w, bias, activation, want_preact=want_preact)
    tiles = select_tiles(x.shape[0], w.shape[1], x.shape[1], x.dtype, config.backend,
                         config.block_sizes)
    outs = _matmul_call(x, w, ca=1, cb=0, blocks=tiles.blocks, backend=config.backend,
                        walk=tiles.walk, out_dtype=x.dtype, bias=bias, activation=activation,
                        want_preact=want_preact, num_warps=tiles.num_warps,
                        num_stages=tiles.num_stages, group_size=tiles.group_size,
                        epilogue_subtile=tiles.epilogue_subtile)
    return tuple(outs) if want_preact else (outs,)


def _backward(x, w, z, bias, g, config: _Config, activation):
    """One device: ``(dx, dw, dbias float32 or None)``."""
    if config.kernels is not None:
        return config.kernels.backward(x, w, z, bias, g, activation)
    m, k = x.shape
    n = w.shape[1]
    # The backward kernels reuse the forward's tiles by role; their warps and
    # stages stay the heuristic's (the tuner times the forward kernel).
    tiles = select_tiles(m, n, k, x.dtype, config.backend, config.block_sizes)
    (bm, bn, bk), walk = tiles.blocks, tiles.walk
    backend, itemsize = config.backend, jnp.dtype(x.dtype).itemsize
    if activation is not None or bias is not None:
        dz, dbias = _dz_call(g, z, activation=activation, want_dbias=bias is not None,
                             blocks=(bm, bn, bk), backend=backend)
    else:
        dz, dbias = g, None
    # dx[M, K] = dz[M, N] @ w[K, N]^T: output tiles (bm, bk), contraction over N by bn.
    # Distinct kernel names, so the static gate budgets the two K loops apart.
    dx = _matmul_call(dz, w, ca=1, cb=1, blocks=(bm, bk, backward_step(bm, bk, bn, backend, itemsize)),
                      backend=backend, walk=walk, out_dtype=x.dtype,
                      epilogue_subtile=tiles.epilogue_subtile, name="fused_matmul_dx")
    # dw[K, N] = x[M, K]^T @ dz[M, N]: output tiles (bk, bn), contraction over M by bm.
    dw = _matmul_call(x, dz, ca=0, cb=0, blocks=(bk, bn, backward_step(bk, bn, bm, backend, itemsize)),
                      backend=backend, walk=walk, out_dtype=w.dtype,
                      epilogue_subtile=tiles.epilogue_subtile, name="fused_matmul_dw")
    return dx, dw, dbias


_fused_matmul.defvjp(_fused_matmul_fwd, _fused_matmul_bwd)

# The most bytes the two operand blocks of one backward K step may hold: the
# default 16-bit 128 x 128 x 64 tile's dx and dw steps ((128 + 64) x 128 elements:
# 48 KiB per pipeline stage, 144 KiB at 3 stages).
_BACKWARD_STEP_BYTES = (128 + 64) * 128 * 2


def backward_step(rows: int, cols: int, step: int, backend: str, itemsize: int = 2) -> int:
    """The contraction step of a backward product with ``rows x cols`` output tiles,
    whose step by role is ``step`` (a forward tile dim), for operands of
    ``itemsize`` bytes. On a GPU (the Triton backends outside Triton's CPU
    interpreter) it is halved (down to 16) until both operand blocks of one step
    hold at most :data:`_BACKWARD_STEP_BYTES`: the role's step of a 128 x 256
    bf16 forward tile would take 288 KiB (dx) and 240 KiB (dw) of shared memory at
    3 stages, over sm_90's 227 KiB; every 16-bit tile up to 128 x 128 keeps its
    step. Float32 operands take half the step of 16-bit ones: the default float32
    tile (128 x 128 x 32) would give dx and dw a 128-deep step of 80 KiB per stage,
    where dw (x read transposed) spilled 1080 bytes at 255 registers on sm_90; at
    64 deep it takes 72 registers and half the shared memory (benchmarks.static).
    Elsewhere (TPU VMEM tiles, the interpreters) the role's step."""
    if not pl.backend_traits(backend).triton or triton_backend.wants_interpreter_tiles(backend):
        return step
    while step > 16 and (rows + cols) * step * itemsize > _BACKWARD_STEP_BYTES:
        step //= 2
    return step


# --------------------------------------------------------------------------
# Block-size heuristic
# --------------------------------------------------------------------------


# default_block_sizes and interpreter_block_sizes: the core's (ops.matmul.tiled);
# the config class: ops.matmul.config.MatmulConfig.


def select_tiles(m: int, n: int, k: int, dtype, backend: str,
                 block_sizes: tuple[int, int, int] | None = None) -> MatmulConfig:
    """The config of an ``[m, k] @ [k, n]`` product (:meth:`ops._op.Op.select`):
    explicit ``block_sizes``, else the tuning cache (key ``(m, n, k)``), else
    :meth:`MatmulConfig.heuristic` (:func:`default_block_sizes`, or in Triton's CPU
    interpreter :func:`ops.matmul.tiled.interpreter_block_sizes`).

    Raises:
      ops.tuning.TuningCacheError: a malformed user or packaged cache file.
    """
    explicit = block_sizes
    if block_sizes is not None and not isinstance(block_sizes, MatmulConfig):
        explicit = MatmulConfig.from_blocks(block_sizes, backend)
    elif block_sizes is not None and block_sizes.walk is None:
        explicit = dataclasses.replace(block_sizes, walk=tiled.strategy(backend))
    return OP.select(OP.problem((m, n, k), dtype), backend, explicit)


def _example(problem: _op.Problem, implementation: str):
    m, n, k = problem.shape
    return (lambda x, w: fused_matmul(x, w, implementation=implementation),
            [jax.ShapeDtypeStruct((m, k), problem.dtype), jax.ShapeDtypeStruct((k, n), problem.dtype)])


def _training(problem: _op.Problem, implementation: str):
    """The tuner's training step: the bias + gelu forward that also stores the
    pre-activation, and its backward (dz, dx = dz @ w.T, dw = x.T @ dz), whose
    tiles follow the config by role (:func:`backward_step`)."""
    m, n, k = problem.shape

    def step(x, w, bias, g):
        out, pullback = jax.vjp(lambda x, w, bias: fused_matmul(
            x, w, bias, activation="gelu", implementation=implementation), x, w, bias)
        return out, pullback(g)

    sds = functools.partial(jax.ShapeDtypeStruct, dtype=problem.dtype)
    return step, [sds((m, k)), sds((k, n)), sds((n,)), sds((m, n))]


# The tuner fills the cache for 4096^3 and 8192^3 products (the static gate's sizes)
# first: compute-bound ops are where tuning moves most.
OP = _op.register(_op.Op(
    name=_OP, dims=("m", "n", "k"), configs=dict.fromkeys(KERNEL_BACKENDS, MatmulConfig),
    reference=reference, check=_check, entry=_fused_matmul_on, problem_of=_problem_of,
    function=fused_matmul,
    tuning=_op.Tuning(example=_example, shapes=((4096,) * 3, (8192,) * 3), quick=((512,) * 3,),
                      order=10, training=_training)))
