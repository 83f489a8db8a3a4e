"""Layer normalization and RMS normalization over the last axis: one kernel family.

* LayerNorm (Ba, Kiros & Hinton 2016, "Layer Normalization"):
  ``y = (x - mean) * rsqrt(var + epsilon) * scale + bias``, with ``mean`` and
  the biased ``var = mean((x - mean)**2)`` taken over the last axis.
* RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"):
  ``y = x * rsqrt(mean(x**2) + epsilon) * scale``.

RMSNorm is LayerNorm without centering, so both ops run the same kernels,
parameterised by ``center`` (a static flag): with ``center=False`` the mean
is never computed and taken as zero. The semantics are those of
``flax.nnx.LayerNorm`` / ``flax.nnx.RMSNorm`` (epsilon inside the rsqrt,
statistics in float32 whatever the input dtype, the output in x's dtype).

Kernel layout: the shared row-wise layout of :mod:`ops.reduction._rows`. A
program owns ``block_rows`` full rows and walks them in power-of-two column
chunks with an in-kernel loop (the last chunk masked), so any feature size
works (384, 1000, 5120, 12288, ...) and no grid axis runs sequentially.

Forward algorithm (two passes over the chunks of a row block; one load when
the row fits in one chunk):

1. statistics. LayerNorm: each chunk's ``(count, mean, M2)`` is computed from
   the chunk held in registers / VMEM (mean first, then the sum of squared
   deviations from that mean: the exact two-pass formula within the chunk),
   and merged into the running ``(count, mean, M2)`` with the pairwise update
   of Chan, Golub & LeVeque (1979, "Updating formulae and a pairwise algorithm
   for computing sample variances"), the chunked form of Welford's (1962)
   online algorithm: ``delta = mean_b - mean_a``, ``mean += delta * n_b / n``,
   ``M2 = M2_a + M2_b + delta**2 * n_a * n_b / n``. This needs one read of
   the row for both moments, and is as stable as the two-pass formula (unlike
   ``E[x**2] - E[x]**2``, which Flax uses by default as ``use_fast_variance``
   and which cancels catastrophically for rows with a large mean).
   RMSNorm: the running sum of squares (no cancellation is possible).
2. output: ``y = (x - mean) * rstd * scale + bias`` chunk by chunk.

When gradients are wanted the forward kernel also writes the per-row ``mean``
(LayerNorm only) and ``rstd = rsqrt(var + epsilon)`` as float32 ``[rows, 1]``
residuals: 8 bytes per row, and the backward pass then needs no statistics
pass of its own.

Backward (``jax.custom_vjp``). With ``xhat = (x - mean) * rstd`` and
``gs = g * scale`` (``g`` when there is no scale), the standard closed form
(the chain rule through the normalization, as derived for batch statistics by
Ioffe & Szegedy 2015, "Batch Normalization", section 3, here applied per row
over the features; ``N`` = features) is::

    dx     = rstd * (gs - mean(gs) - xhat * mean(gs * xhat))    # LayerNorm
    dx     = rstd * (gs - xhat * mean(gs * xhat))               # RMSNorm
    dscale = sum over rows of g * xhat
    dbias  = sum over rows of g

One kernel computes all three: a first pass over the chunks accumulates the
two row sums, a second writes dx and the dscale / dbias column sums. The
sums over rows cross programs, and on ``pallas_triton`` every program runs
concurrently, so no output block may be shared: each program writes the
column sums of its own rows into its own row of a float32 ``[num_row_blocks,
1, padded_cols]`` partial-sum array (rows past the end masked out), and a
tiny ``jnp.sum`` over the block axis finishes them outside the kernel.
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
from ops._implementation import resolve_implementation
from ops.reduction._rows import (RowLayout, check_max_chunk, as_rows, chunk_slice, column_mask, for_each_chunk,
                                 load_chunk, row_compiler_params, row_layout, row_mask)

__all__ = ["layer_norm", "rms_norm", "reference", "layer_norm_reference", "rms_norm_reference",
           "default_block_rows"]



def layer_norm(x, scale=None, bias=None, *, epsilon: float = 1e-6,
               implementation: str | None = None, max_chunk: int | None = None) -> jax.Array:
    """Layer normalization over the last axis: ``(x - mean) * rsqrt(var + eps) * scale + bias``.

    Matches ``flax.nnx.LayerNorm`` (and ``flax.linen.LayerNorm``) with the
    feature axis last: ``mean`` and the biased variance ``var`` are taken over
    the last axis in float32, ``epsilon`` is added inside the rsqrt.

    Args:
      x: ``[..., features]`` float32 / bfloat16 / float16; any leading dims,
        any feature size >= 1.
      scale: ``[features]`` or None (no scaling), same dtype as x.
      bias: ``[features]`` or None (no offset), same dtype as x.
      epsilon: a static non-negative number added to the variance.
      implementation: None (cpu -> "xla", gpu -> "triton", tpu ->
        "mosaic_tpu"), "xla", "interpret", "triton" (ours), "pallas_triton" or "mosaic_tpu".
        "mosaic_gpu" raises NotImplementedError (no kernel for it yet).
      max_chunk: optional cap on the column chunk the kernels walk a row in
        (a power of two >= 128; None picks 4096 for 16-bit inputs, 2048 for
        float32). Results do not depend on it beyond float rounding; tests use
        a small cap to exercise multi-chunk rows on small shapes.

    Returns:
      ``[..., features]`` in x's dtype. Statistics and arithmetic are float32.

    Raises:
      TypeError: a non-array argument, an integer / unsupported dtype, scale or
        bias of another dtype than x, a non-numeric epsilon.
      ValueError: x a scalar or with 0 features, scale / bias not
        ``[features]``, a negative or NaN epsilon, a bad max_chunk, an
        unknown implementation.
      NotImplementedError: implementation "mosaic_gpu" (no kernel for it yet).

    Differentiable in x, scale and bias (``jax.custom_vjp`` with Pallas
    backward kernels); jit- and vmap-compatible.
    """
    return _normalize("layer_norm", x, scale, bias, epsilon=epsilon, center=True,
                      implementation=implementation, max_chunk=max_chunk)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, implementation: str | None = None,
             max_chunk: int | None = None) -> jax.Array:
    """RMS normalization over the last axis: ``x * rsqrt(mean(x**2) + eps) * scale``.

    Matches ``flax.nnx.RMSNorm`` (and ``flax.linen.RMSNorm``) with the feature
    axis last: the mean of squares is taken over the last axis in float32 and
    ``epsilon`` is added inside the rsqrt. No centering, no bias.

    Args:
      x: ``[..., features]`` float32 / bfloat16 / float16; any leading dims,
        any feature size >= 1.
      scale: ``[features]`` or None (no scaling), same dtype as x.
      epsilon, implementation, max_chunk: as in :func:`layer_norm`.

    Returns:
      ``[..., features]`` in x's dtype.

    Raises:
      As :func:`layer_norm`.

    Differentiable in x and scale; jit- and vmap-compatible.
    """
    return _normalize("rms_norm", x, scale, None, epsilon=epsilon, center=False,
                      implementation=implementation, max_chunk=max_chunk)


def _normalize(op, x, scale, bias, *, epsilon, center, implementation, max_chunk):
    check_array(x, "x", op)
    check_float_dtype(x, "x", op)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have rank >= 1 [..., features], got a scalar.")
    features = x.shape[-1]
    if features < 1:
        raise ValueError(f"{op}: x's last dim (features) must be >= 1, got shape "
                         f"{tuple(x.shape)}.")
    for name, p in (("scale", scale), ("bias", bias)):
        if p is None:
            continue
        check_array(p, name, op)
        check_same_dtype(p, x, name, "x", op)
        if tuple(p.shape) != (features,):
            raise ValueError(f"{op}: {name} must have shape [features] = ({features},), got "
                             f"{tuple(p.shape)}.")
    epsilon = _check_epsilon(epsilon, op)
    check_max_chunk(max_chunk, op)
    impl = resolve_implementation(implementation, op)
    if impl == "xla":
        return reference(x, scale, bias, epsilon=epsilon, center=center)
    x2, lead = as_rows(x)
    if x2.shape[0] == 0:  # nothing to normalize; keep autodiff through the reference
        return reference(x, scale, bias, epsilon=epsilon, center=center)
    config = _Config(op=op, backend=impl, center=center, epsilon=epsilon,
                     max_chunk=None if max_chunk is None else int(max_chunk))
    return _norm(x2, scale, bias, config).reshape(*lead, features)


def _check_epsilon(epsilon, op) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.integer, np.floating)):
        if not (isinstance(epsilon, (np.ndarray, jax.Array)) and np.ndim(epsilon) == 0):
            raise TypeError(f"{op}: epsilon must be a static real number, got "
                            f"{type(epsilon).__name__}.")
        try:
            epsilon = float(epsilon)
        except (TypeError, jax.errors.ConcretizationTypeError):
            raise TypeError(f"{op}: epsilon must be a static real number (it is compiled into "
                            "the kernel), got a traced value.") from None
    epsilon = float(epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon}.")
    return epsilon


# --------------------------------------------------------------------------
# XLA reference (also the "xla" implementation)
# --------------------------------------------------------------------------

def reference(x, scale=None, bias=None, *, epsilon: float = 1e-6, center: bool = True):
    """LayerNorm (``center=True``) or RMSNorm (``center=False``) with XLA, float32 inside.

    ``var`` is the mean of squared deviations (biased), computed two-pass;
    the output has x's dtype.
    """
    xf = x.astype(jnp.float32)
    if center:
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + epsilon)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def layer_norm_reference(x, scale=None, bias=None, *, epsilon: float = 1e-6):
    """:func:`reference` with centering: what ``layer_norm(..., implementation="xla")`` runs."""
    return reference(x, scale, bias, epsilon=epsilon, center=True)


def rms_norm_reference(x, scale=None, *, epsilon: float = 1e-6):
    """:func:`reference` without centering: what ``rms_norm(..., implementation="xla")`` runs."""
    return reference(x, scale, None, epsilon=epsilon, center=False)


# --------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    op: str
    backend: str
    center: bool
    epsilon: float
    max_chunk: int | None = None


def _chunk_loader(ref, layout: RowLayout):
    """``c -> chunk c of ref`` as float32 (padding 0); one load when the row is one chunk.

    With a single chunk the value is loaded once here and reused by every
    pass, so the kernel reads x (and g) from memory exactly once.
    """
    if layout.num_chunks == 1:
        value = load_chunk(ref, layout, 0)
        return lambda c: value
    return lambda c: load_chunk(ref, layout, c)


def _valid_count(layout: RowLayout, c):
    """How many real features chunk ``c`` holds, as float32 (only the last chunk is short)."""
    if not layout.needs_column_mask:
        return jnp.float32(layout.chunk)
    if isinstance(c, int):
        return jnp.float32(min(layout.chunk, layout.features - c * layout.chunk))
    return jnp.minimum(layout.chunk, layout.features - c * layout.chunk).astype(jnp.float32)


def _row_stats(load_x, layout: RowLayout, center: bool, epsilon: float):
    """``(mean or None, rstd)``, float32 ``[block_rows, 1]``, in one pass over the chunks."""
    shape = (layout.block_rows, 1)
    zeros = jnp.zeros(shape, jnp.float32)
    if not center:
        def sum_squares(c, acc):
            x = load_x(c)
            return acc + jnp.sum(x * x, axis=1, keepdims=True)
        ms = for_each_chunk(layout, sum_squares, zeros) / layout.features
        return None, lax.rsqrt(ms + epsilon)

    def merge(c, carry):
        # Chan, Golub & LeVeque's pairwise update of (count, mean, M2); the
        # running count n_a = c * chunk, since every chunk before the last is full.
        mean_a, m2_a = carry
        x = load_x(c)
        n_b = _valid_count(layout, c)
        mean_b = jnp.sum(x, axis=1, keepdims=True) / n_b  # padding columns are 0
        dev = x - mean_b
        mask = column_mask(layout, c, x.shape)
        if mask is not None:
            dev = jnp.where(mask, dev, 0.0)
        m2_b = jnp.sum(dev * dev, axis=1, keepdims=True)
        n_a = jnp.asarray(c * layout.chunk).astype(jnp.float32)
        n = n_a + n_b
        delta = mean_b - mean_a
        mean = mean_a + delta * (n_b / n)
        m2 = m2_a + m2_b + delta * delta * (n_a * n_b / n)
        return mean, m2

    mean, m2 = for_each_chunk(layout, merge, (zeros, zeros))
    return mean, lax.rsqrt(m2 / layout.features + epsilon)


def _forward_kernel(*refs, layout: RowLayout, center, epsilon, has_scale, has_bias, want_stats):
    refs = list(refs)
    x_ref = refs.pop(0)
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    y_ref = refs.pop(0)
    mean_ref = refs.pop(0) if want_stats and center else None
    rstd_ref = refs.pop(0) if want_stats else None

    load_x = _chunk_loader(x_ref, layout)
    mean, rstd = _row_stats(load_x, layout, center, epsilon)

    def store(c, carry):
        x = load_x(c)
        y = ((x - mean) if center else x) * rstd
        if scale_ref is not None:
            y = y * load_chunk(scale_ref, layout, c)
        if bias_ref is not None:
            y = y + load_chunk(bias_ref, layout, c)
        y_ref[:, chunk_slice(layout, c)] = y.astype(y_ref.dtype)
        return carry

    for_each_chunk(layout, store, ())
    if mean_ref is not None:
        mean_ref[...] = mean
    if rstd_ref is not None:
        rstd_ref[...] = rstd


def _param_spec(layout: RowLayout) -> pl.BlockSpec:
    """scale / bias as ``[1, features]``: every program reads the whole (padded) row."""
    return pl.BlockSpec((1, layout.padded_cols), lambda i: (0, 0))


def _forward_call(x, scale, bias, config: _Config, *, want_stats: bool):
    """``y`` or ``(y, mean, rstd)`` (``(y, rstd)`` without centering) for ``x [rows, F]``."""
    rows, features = x.shape
    layout = _layout_for(rows, features, x.dtype, config)
    operands, in_specs = [x], [layout.row_spec()]
    for p in (scale, bias):
        if p is not None:
            operands.append(p.reshape(1, features))
            in_specs.append(_param_spec(layout))
    out_shapes = [jax.ShapeDtypeStruct((rows, features), x.dtype)]
    out_specs = [layout.row_spec()]
    if want_stats:
        n_stats = 2 if config.center else 1
        out_shapes += [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * n_stats
        out_specs += [layout.stat_spec()] * n_stats
    kernel = functools.partial(
        _forward_kernel, layout=layout, center=config.center, epsilon=config.epsilon,
        has_scale=scale is not None, has_bias=bias is not None, want_stats=want_stats)
    outs = pl.pallas_call(
        kernel, out_shape=out_shapes, grid=layout.grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=row_compiler_params(layout, config.backend), backend=config.backend,
        name=f"{config.op}_fwd",
        cost_estimate=_cost(operands, out_shapes, rows, flops_per_element=8))(*operands)
    return tuple(outs) if want_stats else outs[0]


# --------------------------------------------------------------------------
# Backward kernel: dx, and per-row-block partial sums for dscale and dbias
# --------------------------------------------------------------------------

def _backward_kernel(*refs, layout: RowLayout, center, has_scale, want_dscale, want_dbias):
    refs = list(refs)
    x_ref = refs.pop(0)
    scale_ref = refs.pop(0) if has_scale else None
    g_ref = refs.pop(0)
    mean_ref = refs.pop(0) if center else None
    rstd_ref = refs.pop(0)
    dx_ref = refs.pop(0)
    dscale_ref = refs.pop(0) if want_dscale else None
    dbias_ref = refs.pop(0) if want_dbias else None

    rstd = rstd_ref[...]
    mean = mean_ref[...] if center else None
    load_x, load_g = _chunk_loader(x_ref, layout), _chunk_loader(g_ref, layout)
    scale_chunk = ((lambda c: load_chunk(scale_ref, layout, c)) if has_scale
                   else (lambda c: None))

    def xhat_gs(c):
        # Padding columns have g = 0, hence gs = 0: they add nothing to any sum.
        x, g, s = load_x(c), load_g(c), scale_chunk(c)
        xhat = ((x - mean) if center else x) * rstd
        return xhat, g, (g if s is None else g * s)

    def row_sums(c, carry):
        sum_gs, sum_gs_xhat = carry
        xhat, _, gs = xhat_gs(c)
        return (sum_gs + jnp.sum(gs, axis=1, keepdims=True),
                sum_gs_xhat + jnp.sum(gs * xhat, axis=1, keepdims=True))

    zeros = jnp.zeros((layout.block_rows, 1), jnp.float32)
    sum_gs, sum_gs_xhat = for_each_chunk(layout, row_sums, (zeros, zeros))
    mean_gs = sum_gs / layout.features
    mean_gs_xhat = sum_gs_xhat / layout.features

    def write(c, carry):
        xhat, g, gs = xhat_gs(c)
        dx = gs - xhat * mean_gs_xhat
        if center:
            dx = dx - mean_gs
        dx_ref[:, chunk_slice(layout, c)] = (rstd * dx).astype(dx_ref.dtype)
        if dscale_ref is not None or dbias_ref is not None:
            rows = row_mask(layout, g.shape)  # rows past the end hold garbage (NaN)
            keep = (lambda v: v) if rows is None else (lambda v: jnp.where(rows, v, 0.0))
            if dscale_ref is not None:
                dscale_ref[:, chunk_slice(layout, c)] = jnp.sum(keep(g * xhat), axis=0,
                                                                keepdims=True)
            if dbias_ref is not None:
                dbias_ref[:, chunk_slice(layout, c)] = jnp.sum(keep(g), axis=0, keepdims=True)
        return carry

    for_each_chunk(layout, write, ())


def _backward_call(x, scale, g, mean, rstd, config: _Config, *, want_dscale, want_dbias):
    """``(dx, dscale float32 [F] or None, dbias float32 [F] or None)``."""
    rows, features = x.shape
    layout = _layout_for(rows, features, x.dtype, config)
    operands, in_specs = [x], [layout.row_spec()]
    if scale is not None:
        operands.append(scale.reshape(1, features))
        in_specs.append(_param_spec(layout))
    operands.append(g)
    in_specs.append(layout.row_spec())
    if config.center:
        operands.append(mean)
        in_specs.append(layout.stat_spec())
    operands.append(rstd)
    in_specs.append(layout.stat_spec())

    out_shapes = [jax.ShapeDtypeStruct((rows, features), x.dtype)]
    out_specs = [layout.row_spec()]
    num_blocks = layout.grid[0]
    # One row of partial column sums per program: no two programs share a block.
    partial_shape = jax.ShapeDtypeStruct((num_blocks, 1, layout.padded_cols), jnp.float32)
    partial_spec = pl.BlockSpec((None, 1, layout.padded_cols), lambda i: (i, 0, 0))
    n_partials = int(want_dscale) + int(want_dbias)
    out_shapes += [partial_shape] * n_partials
    out_specs += [partial_spec] * n_partials

    kernel = functools.partial(_backward_kernel, layout=layout, center=config.center,
                               has_scale=scale is not None, want_dscale=want_dscale,
                               want_dbias=want_dbias)
    outs = list(pl.pallas_call(
        kernel, out_shape=out_shapes, grid=layout.grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=row_compiler_params(layout, config.backend), backend=config.backend,
        name=f"{config.op}_bwd",
        cost_estimate=_cost(operands, out_shapes, rows, flops_per_element=12))(*operands))
    dx = outs.pop(0)
    # Columns past the last chunk were never written: slice them off before use.
    finish = lambda partials: jnp.sum(partials[:, 0, :features], axis=0)
    dscale = finish(outs.pop(0)) if want_dscale else None
    dbias = finish(outs.pop(0)) if want_dbias else None
    return dx, dscale, dbias


# --------------------------------------------------------------------------
# custom_vjp wiring
# --------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, scale, bias, config: _Config):
    return _forward_call(x, scale, bias, config, want_stats=False)


def _norm_fwd(x, scale, bias, config):
    if config.center:
        y, mean, rstd = _forward_call(x, scale, bias, config, want_stats=True)
    else:
        (y, rstd), mean = _forward_call(x, scale, bias, config, want_stats=True), None
    # bias itself is not needed by the backward, only whether there is one: keep
    # a zero-size marker (None when there is no bias) rather than a Python bool.
    bias_marker = None if bias is None else jnp.zeros((0,), bias.dtype)
    return y, (x, scale, mean, rstd, bias_marker)


def _norm_bwd(config, residuals, g):
    x, scale, mean, rstd, bias_marker = residuals
    dx, dscale, dbias = _backward_call(x, scale, g, mean, rstd, config,
                                       want_dscale=scale is not None,
                                       want_dbias=bias_marker is not None)
    return (dx,
            None if scale is None else dscale.astype(scale.dtype),
            None if dbias is None else dbias.astype(x.dtype))


_norm.defvjp(_norm_fwd, _norm_bwd)


# --------------------------------------------------------------------------
# Block-size heuristic
# --------------------------------------------------------------------------

# Target float32 bytes of one row block on TPU (x's block itself is this or
# half of it for 16-bit inputs): large enough that the per-grid-step overhead
# (~0.35 us) is small next to the block's HBM transfer, small enough that the
# double-buffered x / g / dx blocks plus the float32 temporaries of the
# backward (x, g, xhat, g * scale at chunk width) stay well inside the default
# scoped VMEM (16 MiB).
_TPU_BLOCK_BYTES = 1 << 20
_TPU_MAX_BLOCK_ROWS = 512
# On GPU a program holds block_rows x chunk float32 values per tensor in
# registers: cap that product at 8192, which row_compiler_params spreads over
# 8 warps (32 values per thread per tensor).
_TRITON_MAX_ELEMENTS = 8192


def default_block_rows(rows: int, features: int, dtype, backend: str, *,
                       max_chunk: int | None = None) -> int | None:
    """Rows per program for a ``[rows, features]`` normalization on ``backend``.

    * mosaic_tpu: about 1 MiB per block counted in float32 (a multiple of 8
      rows, at most 512; all rows when fewer), so each grid step moves enough
      data to hide its fixed cost and the float32 working set fits VMEM.
    * pallas_triton: ``8192 / chunk`` rows (between 1 and 4): one or a few rows
      per program, the working set of a chunk in registers.
    * interpret: None, i.e. :func:`ops.reduction._rows.row_layout`'s default
      (4, or fewer for tiny inputs), so edge blocks are exercised by tests.
    """
    if backend == "mosaic_tpu":
        padded = row_layout(rows, features, dtype, backend, max_chunk=max_chunk).padded_cols
        br = _TPU_BLOCK_BYTES // (padded * 4)
        br = max(8, min(_TPU_MAX_BLOCK_ROWS, br // 8 * 8))
        return rows if rows <= br else br
    if backend in pl.TRITON_BACKENDS:
        chunk = row_layout(rows, features, dtype, backend, max_chunk=max_chunk).chunk
        br = max(1, min(4, _TRITON_MAX_ELEMENTS // chunk))
        return min(br, 1 << max(0, rows - 1).bit_length())
    return None


def _layout_for(rows, features, dtype, config: _Config) -> RowLayout:
    block_rows = default_block_rows(rows, features, dtype, config.backend,
                                    max_chunk=config.max_chunk)
    return row_layout(rows, features, dtype, config.backend, max_chunk=config.max_chunk,
                      block_rows=block_rows)


def _cost(operands, out_shapes, rows: int, *, flops_per_element: int):
    """What XLA schedules the custom call by: every operand read and output written once."""
    nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                 for a in (*operands, *out_shapes))
    return {"flops": flops_per_element * int(np.prod(operands[0].shape)),
            "transcendentals": rows, "bytes_accessed": nbytes}


