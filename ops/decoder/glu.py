"""Gated linear unit: ``activation(x @ weights[:, 0]) * (x @ weights[:, 1])``.

Dauphin et al. 2017, "Language Modeling with Gated Convolutional Networks"
(section 3) and Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU with
silu, GeGLU with gelu, ReGLU with relu, the bilinear layer with no
activation). Tokamax's semantics and layout: the gate and up projections
stacked as ``weights [K, 2, N]`` (gate at index 0), the activation on the
gate, the product in float32, the result in x's dtype.

Forward: one tiled-matmul kernel (the walk of :mod:`ops.matmul.tiled`) with
two float32 accumulators: each program owns a ``block_m x block_n`` tile of
the output, loads each ``x`` tile once per contraction step and multiplies it
by the gate and the up tiles of ``weights`` (two Refs of the one array, the
middle dim squeezed), then applies the activation and the product in the
epilogue. When gradients are wanted the same kernel also stores the two
pre-activations ``z = [x @ weights[:, 0], x @ weights[:, 1]]`` as one
``[M, 2, N]`` array in x's dtype (as Tokamax's residuals and
``ops.fused_matmul``'s pre-activation): recomputing them would cost the
forward's ``4 M N K`` flops again.

Backward (``jax.custom_vjp``): one elementwise kernel turns ``(g, z)`` into
``dz = [g * up * act'(gate), g * act(gate)]``, written over ``z`` in place
(``input_output_aliases``: the backward holds no ``[M, N]`` array beyond the
two pre-activations), then, with ``[M, 2, N]`` viewed as ``[M, 2N]`` and
``weights`` as ``[K, 2N]`` (free reshapes), ``dx = dz @ weights^T`` and ``dw =
x^T @ dz`` are one matmul each on the shared tiled core. ``act'`` comes from
JAX autodiff of the activation, traced inside the kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops._checks import check_array, check_float_dtype, check_same_dtype
from ops._op import Device, KernelConfig, Op, Problem, Tuning, register, tunable
from ops._partitioning import psum, reduced_axes, reshape, run
from ops._tiles import dot
from ops.activations import resolve_activation
from ops.decoder.reference import gated_linear_unit_reference, glu_backward_reference
from ops.matmul import tiled

_OP = "gated_linear_unit"


def gated_linear_unit(x, weights, *, activation=None, implementation=None,
                      block_sizes=None) -> jax.Array:
    """``activation(x @ weights[:, 0]) * (x @ weights[:, 1])`` with float32 accumulation.

    Args:
      x: ``[..., K]`` float32 / bfloat16 / float16; any number of leading dims.
      weights: ``[K, 2, N]``, x's dtype: the gate (``[:, 0]``) and up (``[:, 1]``)
        projections stacked (a transformers ``gate_proj.weight.T`` and
        ``up_proj.weight.T`` stacked on axis 1).
      activation: None (the bilinear GLU), a name ``ops.fused_matmul`` accepts
        (``"silu"`` for SwiGLU, ``"gelu"`` (tanh) or ``"gelu_exact"`` for GeGLU,
        ``"relu"``, ``"sigmoid"``, ...; :data:`ops.ACTIVATIONS`) or an
        elementwise JAX callable, applied to the float32 gate.
      implementation: None (cpu -> "xla", gpu -> "triton", tpu -> "mosaic_tpu"),
        "xla", "interpret", "triton", "pallas_triton" or "mosaic_tpu", or a
        sequence of these tried in order (:mod:`ops._implementation`).
        ``mosaic_tpu`` needs ``block_n`` to divide N (its heuristic finds one
        when N <= 512 or N is a multiple of 128) and raises NotImplementedError
        otherwise.
      block_sizes: optional ``(block_m, block_n, block_k)`` of the forward kernel
        (``block_n`` columns of each of the two accumulators); None takes the
        tuning cache's entry, else the heuristic (:class:`GluConfig`). The
        backward's matmuls reuse them by role.

    Returns:
      ``[..., N]`` in x's dtype. With ``K = 0``: ``activation(0) * 0`` (zeros).

    Raises:
      TypeError: non-arrays, an integer / unsupported dtype, weights' dtype not
        x's, an activation that is neither None, a name nor a callable.
      ValueError: weights not ``[K, 2, N]`` with x's K, an unknown activation name
        or a non-elementwise callable, bad block_sizes or implementation.

    Differentiable in x and weights (``jax.custom_vjp`` with Pallas backward
    kernels); jit- and vmap-compatible.
    """
    act, explicit = _check(x, weights, activation, block_sizes)
    return OP.run(implementation, lambda impl: _glu_on(impl, x, weights, act, explicit))


def _check(x, weights, activation, block_sizes):
    check_array(x, "x", _OP)
    check_array(weights, "weights", _OP)
    check_float_dtype(x, "x", _OP)
    check_same_dtype(weights, x, "weights", "x", _OP)
    if x.ndim < 1:
        raise ValueError(f"{_OP}: x must have rank >= 1 [..., K], got a scalar.")
    if weights.ndim != 3 or weights.shape[1] != 2:
        raise ValueError(f"{_OP}: weights must have shape [K, 2, N] (gate and up stacked on "
                         f"axis 1), got {tuple(weights.shape)}.")
    if weights.shape[0] != x.shape[-1]:
        raise ValueError(f"{_OP}: x's last dim ({x.shape[-1]}) must equal weights' first dim "
                         f"({weights.shape[0]}); got x {tuple(x.shape)} and weights "
                         f"{tuple(weights.shape)}.")
    act = resolve_activation(activation, _OP)
    explicit = None
    if block_sizes is not None:
        sizes = tuple(block_sizes)
        if len(sizes) != 3 or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                                      and b > 0 for b in sizes):
            raise ValueError(f"{_OP}: block_sizes must be three positive ints (block_m, block_n, "
                             f"block_k), got {block_sizes!r}.")
        explicit = GluConfig(*(int(b) for b in sizes))
    return act, explicit


def _glu_on(impl, x, weights, act, explicit):
    """The checked call on one implementation."""
    if impl == "xla" or x.size == 0 or weights.size == 0:
        # Nothing to multiply (M, K or N zero): XLA's answer is exact, with its gradients.
        return gated_linear_unit_reference(x, weights, act)
    k, _, n = weights.shape
    x2 = reshape(x, (-1, k))
    config = OP.select(OP.problem((x2.shape[0], n, k), x.dtype), impl, explicit)
    out = _glu(x2, weights, _Kernel(impl, config, act))
    return reshape(out, (*x.shape[:-1], n))


def glu_backward(x, weights, preactivations, g, *, activation=None, implementation=None,
                 block_sizes=None) -> tuple[jax.Array, jax.Array]:
    """The backward pass alone: ``(dx, dweights)`` from the forward's residuals.

    What ``jax.vjp`` of :func:`gated_linear_unit` runs after the forward (the
    benchmarks time it as the "bwd" pass; the "xla" implementation is
    :func:`ops.decoder.reference.glu_backward_reference`).

    Args:
      x, weights, activation, implementation, block_sizes: as :func:`gated_linear_unit`.
      preactivations: ``[..., 2, N]`` in x's dtype: ``x @ weights[:, 0]`` and
        ``x @ weights[:, 1]`` stacked on axis -2 (the forward's residual).
      g: ``[..., N]``, the output's cotangent.

    Raises:
      as :func:`gated_linear_unit`; ValueError when preactivations or g do not
      have the shapes above.
    """
    act, explicit = _check(x, weights, activation, block_sizes)
    k, _, n = weights.shape
    lead = tuple(x.shape[:-1])
    for name, a, shape in (("preactivations", preactivations, (*lead, 2, n)), ("g", g, (*lead, n))):
        check_array(a, name, _OP)
        if tuple(a.shape) != shape:
            raise ValueError(f"{_OP}: {name} must have shape {shape}, got {tuple(a.shape)}.")

    def body(impl):
        if impl == "xla" or x.size == 0 or weights.size == 0:
            return glu_backward_reference(x, weights, preactivations, g.astype(x.dtype), act)
        x2 = reshape(x, (-1, k))
        config = OP.select(OP.problem((x2.shape[0], n, k), x.dtype), impl, explicit)
        dx, dw = _glu_bwd(_Kernel(impl, config, act),
                          (x2, weights, reshape(preactivations.astype(x.dtype), (-1, 2, n))),
                          reshape(g.astype(x.dtype), (-1, n)))
        return reshape(dx, x.shape), dw

    return OP.run(implementation, body)


# --------------------------------------------------------------------------
# Config and heuristic
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GluConfig(KernelConfig):
    """The forward kernel's launch configuration.

    Attributes:
      block_m, block_n, block_k: the output tile (``block_n`` columns of each of
        the gate and up accumulators) and the contraction step.
      num_warps, num_stages, group_size: Triton launch parameters (None: the tiled
        core's heuristic: 8 warps from 128 x 128 accumulator elements, 3 stages,
        bands of 8 row blocks).
    """

    block_m: int = tunable()
    block_n: int = tunable()
    block_k: int = tunable()
    num_warps: int | None = tunable(None)
    num_stages: int | None = tunable(None)
    group_size: int | None = tunable(None)

    @property
    def blocks(self) -> tuple[int, int, int]:
        return self.block_m, self.block_n, self.block_k

    @classmethod
    def heuristic(cls, problem: Problem, device: Device) -> "GluConfig":
        """The tiled core's tiles for ``[M, K] @ [K, N]``, with ``block_n`` halved on the
        Triton backends: two ``block_m x block_n`` float32 accumulators then hold
        what one 128 x 128 matmul tile holds (64 KiB of registers at 8 warps), and
        each x tile feeds 128 output columns, as in ``ops.fused_matmul``."""
        m, n, k = problem.shape
        if device.interpreter:
            return cls(*tiled.interpreter_block_sizes(m, n, k))
        bm, bn, bk = tiled.default_block_sizes(m, n, k, problem.dtype, device.backend)
        if device.backend in pl.TRITON_BACKENDS:
            bn = max(16, bn // 2)
        elif device.backend == "mosaic_tpu" and n % bn:
            # The gate and up tiles are column blocks of one [K, 2N] view: block_n divides N.
            bn = next((c for c in (512, 384, 256, 128) if c <= bn and n % c == 0), bn)
        return cls(bm, bn, bk)

    @classmethod
    def candidates(cls, problem: Problem, device: Device) -> tuple["GluConfig", ...]:
        """Tiles around the heuristic's on the Triton backends (64 / 128 rows and
        columns, 32 / 64 contraction steps, 4 or 8 warps, 3 or 4 stages)."""
        base = cls.heuristic(problem, device)
        if device.backend not in pl.TRITON_BACKENDS or device.interpreter:
            return (base,)
        m, n, k = problem.shape
        p2 = pl.next_power_of_2
        out = [base]
        for bm, bn, bk, warps, stages in ((128, 64, 64, 8, 3), (128, 64, 64, 4, 4),
                                          (64, 128, 64, 8, 3), (128, 128, 32, 8, 3),
                                          (64, 64, 64, 4, 4), (128, 64, 32, 8, 4)):
            c = cls(min(bm, max(16, p2(m))), min(bn, max(16, p2(n))), min(bk, max(16, p2(k))),
                    warps, stages)
            if c not in out:
                out.append(c)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    backend: str
    config: GluConfig
    activation: object


# --------------------------------------------------------------------------
# Forward kernel: the tiled walk with two accumulators
# --------------------------------------------------------------------------

def _epilogue(gate, up, out_ref, z_ref, activation):
    if z_ref is not None:
        z_ref[:, 0, :] = gate.astype(z_ref.dtype)
        z_ref[:, 1, :] = up.astype(z_ref.dtype)
    if activation is not None:
        gate = activation(gate)
    out_ref[...] = (gate * up).astype(out_ref.dtype)


def _grid_kernel(x_ref, wg_ref, wu_ref, out_ref, *refs, activation, want_z):
    """K is grid axis 2 ("arbitrary"); both accumulators live in scratch."""
    z_ref = refs[0] if want_z else None
    gate_acc, up_acc = refs[-2:]
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        gate_acc[...] = jnp.zeros(gate_acc.shape, jnp.float32)
        up_acc[...] = jnp.zeros(up_acc.shape, jnp.float32)

    x = x_ref[...]  # one load of the x tile feeds both products
    gate_acc[...] += dot(x, wg_ref[...], 1, 0)
    up_acc[...] += dot(x, wu_ref[...], 1, 0)

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        _epilogue(gate_acc[...], up_acc[...], out_ref, z_ref, activation)


def _loop_kernel(x_ref, wg_ref, wu_ref, out_ref, *refs, activation, want_z, block_k, num_k):
    """Full-K blocks walked by an in-kernel loop; the accumulators are loop carries."""
    z_ref = refs[0] if want_z else None

    def step(k, accs):
        x = x_ref[:, pl.ds(k * block_k, block_k)]
        rows = pl.ds(k * block_k, block_k)
        return (accs[0] + dot(x, wg_ref[rows, :], 1, 0), accs[1] + dot(x, wu_ref[rows, :], 1, 0))

    zeros = jnp.zeros(out_ref.shape, jnp.float32)
    gate, up = lax.fori_loop(0, num_k, step, (zeros, zeros))
    _epilogue(gate, up, out_ref, z_ref, activation)


def _forward_call(x, weights, kernel: _Kernel, *, want_z: bool, out_dtype=None):
    """``(out,)`` or ``(out, z)``: x ``[M, K]``, weights ``[K, 2, N]``, z ``[M, 2, N]``.
    With ``out_dtype`` float32 and no activation (the partial products of a split
    contraction) the caller applies the epilogue itself."""
    cfg, backend = kernel.config, kernel.backend
    bm, bn, bk = cfg.blocks
    m, k = x.shape
    n = weights.shape[2]
    num_k = max(1, pl.cdiv(k, bk))
    kp = num_k * bk
    x, weights = tiled.pad_axis(x, 1, kp), tiled.pad_axis(weights, 0, kp)
    out_dtype = out_dtype or x.dtype
    out_shapes = [jax.ShapeDtypeStruct((m, n), out_dtype)]
    if want_z:
        out_shapes.append(jax.ShapeDtypeStruct((m, 2, n), out_dtype))
    walk = tiled.strategy(backend)
    kw = dict(activation=kernel.activation, want_z=want_z)
    params = tiled.launch_params(walk, backend, (bm, 2 * bn, bk), num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages, group_size=cfg.group_size)
    w_operand = weights
    if walk == tiled.GRID and backend == "mosaic_tpu":
        # Mosaic cannot squeeze the second-minor dim of a block: the gate and up tiles
        # are column blocks j and j + N / block_n of weights viewed as [K, 2N].
        if n % bn:
            raise NotImplementedError(f"{_OP}: implementation='mosaic_tpu' needs block_n "
                                      f"({bn}) to divide N ({n}).")
        w_operand = weights.reshape(kp, 2 * n)
        grid = (pl.cdiv(m, bm), n // bn, num_k)
        in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                    pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
                    pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j + n // bn))]
        out_specs = [pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
                     pl.BlockSpec((bm, 2, bn), lambda i, j, kk: (i, 0, j))]
        body = functools.partial(_grid_kernel, **kw)
        scratch = [pl.tpu.VMEM((bm, bn), jnp.float32)] * 2
    elif walk == tiled.GRID:
        grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), num_k)
        in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                    pl.BlockSpec((bk, None, bn), lambda i, j, kk: (kk, 0, j)),
                    pl.BlockSpec((bk, None, bn), lambda i, j, kk: (kk, 1, j))]
        out_specs = [pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
                     pl.BlockSpec((bm, 2, bn), lambda i, j, kk: (i, 0, j))]
        body = functools.partial(_grid_kernel, **kw)
        scratch = [pl.tpu.VMEM((bm, bn), jnp.float32)] * 2
    else:
        grid = (pl.cdiv(m, bm), pl.cdiv(n, bn))
        in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                    pl.BlockSpec((kp, None, bn), lambda i, j: (0, 0, j)),
                    pl.BlockSpec((kp, None, bn), lambda i, j: (0, 1, j))]
        out_specs = [pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                     pl.BlockSpec((bm, 2, bn), lambda i, j: (i, 0, j))]
        body = functools.partial(_loop_kernel, block_k=bk, num_k=num_k, **kw)
        scratch = []
    act = getattr(kernel.activation, "__name__", None) or "act"
    outs = pl.pallas_call(
        body, out_shape=out_shapes, grid=grid, in_specs=in_specs,
        out_specs=out_specs[:len(out_shapes)], scratch_shapes=scratch, compiler_params=params,
        backend=backend, name="gated_linear_unit" + (f"_{act}" if kernel.activation else ""),
    )(x, w_operand, w_operand)
    return tuple(outs)


# --------------------------------------------------------------------------
# Backward: dz in place of z, then dx and dw on the tiled core
# --------------------------------------------------------------------------

def _dz_kernel(g_ref, z_ref, dz_ref, *, activation):
    g = g_ref[...].astype(jnp.float32)
    gate = z_ref[:, 0, :].astype(jnp.float32)
    up = z_ref[:, 1, :].astype(jnp.float32)
    if activation is None:
        act, dgate = gate, g * up
    else:
        act, pullback = jax.vjp(activation, gate)
        (dgate,) = pullback(g * up)
    dz_ref[:, 0, :] = dgate.astype(dz_ref.dtype)
    dz_ref[:, 1, :] = (g * act).astype(dz_ref.dtype)


def _dz_call(g, z, kernel: _Kernel):
    """``dz [M, 2, N]`` written over ``z`` (aliased): ``[g * up * act'(gate), g * act(gate)]``."""
    bm, bn, _ = kernel.config.blocks
    m, n = g.shape
    backend = kernel.backend
    params = None
    if backend in pl.TRITON_BACKENDS:
        # No loop: one stage; twice the forward's warps keep act' and the two products
        # of a 2 x block_m x block_n tile in registers (fused_matmul's dz kernel does the same).
        params = pl.triton.CompilerParams(num_warps=2 * tiled.default_num_warps(bm, 2 * bn),
                                          num_stages=1)
    return pl.pallas_call(
        functools.partial(_dz_kernel, activation=kernel.activation),
        out_shape=jax.ShapeDtypeStruct(z.shape, z.dtype), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                  pl.BlockSpec((bm, 2, bn), lambda i, j: (i, 0, j))],
        out_specs=pl.BlockSpec((bm, 2, bn), lambda i, j: (i, 0, j)),
        input_output_aliases={1: 0}, compiler_params=params, backend=backend,
        name="gated_linear_unit_dz")(g, z)


def _backward(x, weights, z, g, kernel: _Kernel):
    """One device: ``(dx, dweights)``."""
    m, k = x.shape
    n = weights.shape[2]
    bm, bn, bk = kernel.config.blocks
    dz = _dz_call(g.astype(x.dtype), z, kernel).reshape(m, 2 * n)
    w2 = weights.reshape(k, 2 * n)
    # dx[M, K] = dz[M, 2N] @ w[K, 2N]^T: output tiles (bm, bk), contraction over 2N by 2 bn.
    dx = tiled.matmul(dz, w2, ca=1, cb=1, blocks=(bm, bk, 2 * bn), backend=kernel.backend,
                      out_dtype=x.dtype, name="gated_linear_unit_dx")
    # dw[K, 2N] = x[M, K]^T @ dz[M, 2N]: output tiles (bk, 2 bn), contraction over M by bm.
    dw = tiled.matmul(x, dz, ca=0, cb=0, blocks=(bk, 2 * bn, bm), backend=kernel.backend,
                      out_dtype=weights.dtype, name="gated_linear_unit_dw")
    return dx, dw.reshape(k, 2, n)


# --------------------------------------------------------------------------
# custom_vjp and partitioning
# --------------------------------------------------------------------------

def _partitioned_forward(x, weights, kernel: _Kernel, *, want_z: bool):
    """Rows of x ("m") and columns of the weights ("n") run where they live. A
    contraction ("k") split on both gives each device partial products of both
    accumulators: the kernel stores them in float32 without its epilogue, one
    psum adds them, and the activation and product follow in XLA."""
    def local(x, weights, *, reduced):
        if not reduced_axes(reduced, "k"):
            return _forward_call(x, weights, kernel, want_z=want_z)
        partial = dataclasses.replace(kernel, activation=None)
        _, zp = _forward_call(x, weights, partial, want_z=True, out_dtype=jnp.float32)
        z = psum(zp, reduced, "k")
        gate, up = z[:, 0], z[:, 1]
        if kernel.activation is not None:
            gate = kernel.activation(gate)
        out = (gate * up).astype(x.dtype)
        return (out, z.astype(x.dtype)) if want_z else (out,)

    return run(_OP, local, (x, weights), ("m k", "k two n"),
               ("m n", "m two n") if want_z else ("m n",), reduce=("k",))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _glu(x, weights, kernel: _Kernel):
    return _partitioned_forward(x, weights, kernel, want_z=False)[0]


def _glu_fwd(x, weights, kernel):
    out, z = _partitioned_forward(x, weights, kernel, want_z=True)
    return out, (x, weights, z)


def _glu_bwd(kernel, residuals, g):
    x, weights, z = residuals

    def local(x, weights, z, g, *, reduced):
        dx, dw = _backward(x, weights, z, g, kernel)
        # dx sums over N, dw over M: partial sums where those are split.
        return psum(dx, reduced, "n"), psum(dw, reduced, "m")

    return run(_OP, local, (x, weights, z, g), ("m k", "k two n", "m two n", "m n"),
               ("m k", "k two n"), reduce=("m", "n"), out_like=(0, 1))


_glu.defvjp(_glu_fwd, _glu_bwd)


# --------------------------------------------------------------------------
# Registration with the op layer
# --------------------------------------------------------------------------

def _example(problem: Problem, implementation: str):
    m, n, k = problem.shape
    args = [jax.ShapeDtypeStruct((m, k), problem.dtype),
            jax.ShapeDtypeStruct((k, 2, n), problem.dtype)]

    def fn(x, weights):
        return gated_linear_unit(x, weights, activation="silu", implementation=implementation)
    return fn, args


OP = register(Op(
    name=_OP, dims=("m", "n", "k"),
    configs={b: GluConfig for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
    reference=gated_linear_unit_reference,
    tuning=Tuning(example=_example, shapes=((8192, 14336, 4096), (8192, 8192, 2048)),
                  quick=((256, 512, 256),), order=10),
    missing_reason=" (mosaic_gpu needs a Hopper wgmma kernel: JAX's Mosaic GPU lowering has no "
                   "generic dot_general)"))
