"""Softmax, log-softmax and logsumexp: one row-wise kernel family.

All three see their input as ``[rows, features]`` (the reduced axes moved
last and flattened, :func:`ops.reduction._rows.rows_over_axes`) and share one
forward kernel in the layout of :mod:`ops.reduction._rows`: each program owns
``block_rows`` full rows and walks them in power-of-two column chunks.

* Pass 1 (every mode): the online normalizer (Milakov & Gimelshein 2018,
  "Online normalizer calculation for softmax") keeps, per row, the running
  maximum ``m`` and the running sum ``s`` of ``exp(x - m)``, rescaling ``s``
  whenever a chunk raises ``m`` (:func:`~ops.reduction._rows.online_logsumexp_update`).
  One read of the row gives both statistics, however wide the row.
* Pass 2 (softmax / log_softmax): a second walk writes ``exp(x - m) / s`` or
  ``(x - m) - log(s)``. The row is read again from the block the program
  already holds (VMEM on TPU; on GPU the chunk is usually still in L2); a
  row that fits in one chunk is read once. logsumexp writes ``m + log(s)``.

Results are formed from ``x - m``, never ``x - logsumexp``: with logits near
1e4 the float32 logsumexp is only known to ~1e-3, which would show up as a
1e-3 relative error in every probability.

Backward (``jax.custom_vjp``), one kernel family with the same two-pass shape:

* softmax: ``dx = y * (g - sum(g * y))``, residual ``y`` (the output);
* log_softmax: ``dx = g - exp(y) * sum(g)``, residual ``y`` (the output);
* logsumexp: ``dx = g * exp(x - m) / s`` in one pass, residuals ``x`` and the
  float32 statistics ``m`` and ``s`` (``[rows]`` each; the rounded output would
  cost the gradient its accuracy on large logits).

Arithmetic is float32 throughout; outputs and gradients are in x's dtype.
An ``axis`` other than the trailing ones is moved last by a transpose (a copy
of x in, and of the result back out); the trailing axes cost nothing.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops import _op
from ops._checks import check_array, check_broadcasts_to, check_where
from ops._partitioning import PER_ROW, ROW, STAT, reshape, rowwise
from ops.reduction._rows import (RowLayout, check_axis_op, chunk_slice, for_each_chunk, load_chunk,
                                 logsumexp_shift, online_logsumexp_update, register_row_op,
                                 row_compiler_params, row_example, rows_over_axes,
                                 select_row_layout)

MODES = ("softmax", "log_softmax", "logsumexp")
# The pallas_core backends these kernels are written and tested for. pallas_core's
# own "triton" lowering needs power-of-two blocks, which row_layout does not
# pad to for it yet; JAX's Mosaic GPU lowering does not take these kernels
# (array-per-warpgroup programming model).


def softmax(x, axis=-1, where=None, *, implementation: str | None = None,
            max_chunk: int | None = None) -> jax.Array:
    """``exp(x) / sum(exp(x), axis)``, computed stably, as ``jax.nn.softmax``.

    Args:
      x: float32 / bfloat16 / float16 array.
      axis: the normalized axis: an int, a tuple of ints (normalized jointly)
        or None (every axis); negative counts from the end. Axes other than
        the trailing ones are moved last by a transpose (a copy each way).
      where: optional boolean array broadcastable to x: only those elements take
        part, and the others' output is 0, as ``jax.nn.softmax``'s ``where``
        (x is masked with ``-inf`` in one elementwise pass before the kernel).
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton" (ours),
        "pallas_triton", "mosaic_tpu".
        "mosaic_gpu" raises NotImplementedError (no kernel for it yet). Or a
        sequence of these tried in order (:mod:`ops._implementation`).
      max_chunk: keyword-only tuning/test hook: caps the column chunk an
        in-kernel loop step covers (a power of two >= 128, passed to
        :func:`~ops.reduction._rows.row_layout`); small values make short rows
        take several chunks. None: the default for the dtype.

    Returns:
      x's shape and dtype. Computed in float32 (running max and rescaled sum
      over chunks, so rows of any width work).

    Raises:
      TypeError: a non-array, an integer dtype, a non-int axis, a non-boolean where.
      ValueError: an axis out of range or repeated, a where that does not
        broadcast, an unknown implementation, a bad max_chunk.

    Differentiable (``jax.custom_vjp`` with a Pallas backward kernel); jit-
    and vmap-compatible. A row of all ``-inf`` gives NaN, as in JAX.
    """
    return _masked_family(x, axis, where, "softmax", implementation, max_chunk, fill=0.0)


def log_softmax(x, axis=-1, where=None, *, implementation: str | None = None,
                max_chunk: int | None = None) -> jax.Array:
    """``x - logsumexp(x, axis)``, as ``jax.nn.log_softmax``.

    Arguments, result and errors as :func:`softmax`; elements outside ``where``
    give ``-inf``, as jax.nn's. Computed as ``(x - max) - log(sum(exp(x - max)))``
    in float32, so it is exact to float32 rounding even for logits of magnitude 1e4.
    """
    return _masked_family(x, axis, where, "log_softmax", implementation, max_chunk,
                          fill=-jnp.inf)


def logsumexp(x, axis=None, b=None, keepdims=False, return_sign=False, where=None, *,
              implementation: str | None = None, max_chunk: int | None = None):
    """``log(sum(b * exp(x), axis))``, computed stably, as ``jax.nn.logsumexp``.

    Arguments and errors as :func:`softmax`, and:

      axis: an int, a tuple of ints, or None (the default, as
        ``jax.nn.logsumexp``: every axis). Pass ``axis=-1`` for one value per
        row, as :func:`softmax` normalizes.
      b: optional weights broadcastable to x (``jax.nn.logsumexp``'s ``b``,
        negative ones included). Computed by the XLA reference
        (``jax.nn.logsumexp`` in float32), not the kernel; the result has
        ``jnp.result_type(x, b)``.
      keepdims: keep the reduced axes with size 1.
      return_sign: also return the sign of the sum (1, or 0 for an empty sum;
        with ``b``, -1 where the weighted sum is negative, whose logsumexp is
        then that of its magnitude). Without it a negative weighted sum gives NaN.
      where: optional boolean array broadcastable to x: only those elements
        are summed (a row with none gives ``-inf``).

    Returns:
      x's dtype, x's shape without ``axis`` (kept as 1s with ``keepdims``); with
      ``return_sign``, the pair ``(logsumexp, sign)``. A row of all ``-inf``
      gives ``-inf``; a row holding ``+inf`` gives ``+inf`` (as JAX).

    Raises:
      TypeError / ValueError: as :func:`softmax`; b not a float array or not
        broadcastable to x; keepdims or return_sign not a bool.
    """
    axes, impl = check_axis_op(x, axis, "logsumexp", implementation, max_chunk)
    for name, flag in (("keepdims", keepdims), ("return_sign", return_sign)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"logsumexp: {name} must be a bool, got {type(flag).__name__}.")
    if where is not None:
        check_where(where, x, "logsumexp")
    if b is not None:
        check_array(b, "b", "logsumexp")
        if not jnp.issubdtype(b.dtype, jnp.floating) and not jnp.issubdtype(b.dtype, jnp.integer):
            raise TypeError(f"logsumexp: b must be a real array, got {np.dtype(b.dtype).name}.")
        check_broadcasts_to(b, "b", x, "logsumexp")
        dtype = jnp.result_type(x.dtype, b.dtype)
        return jax.tree.map(lambda v: v.astype(dtype), jax.nn.logsumexp(
            jnp.asarray(x, jnp.float32), axis=axes, b=jnp.asarray(b, jnp.float32),
            keepdims=keepdims, return_sign=return_sign, where=where))
    masked = x if where is None else jnp.where(where, x, jnp.asarray(-jnp.inf, x.dtype))
    out = _softmax_family(masked, axes, "logsumexp", impl, max_chunk)
    if keepdims:
        out = jnp.expand_dims(out, axes)
    if not return_sign:
        return out
    sign = jnp.where(jnp.isnan(out), jnp.nan, jnp.where(out == -jnp.inf, 0.0, 1.0))
    return out, lax.stop_gradient(sign.astype(out.dtype))


def _masked_family(x, axis, where, mode, implementation, max_chunk, fill):
    """softmax / log_softmax of x restricted to ``where`` (``fill`` outside it)."""
    axes, impl = check_axis_op(x, axis, mode, implementation, max_chunk)
    if where is None:
        return _softmax_family(x, axes, mode, impl, max_chunk)
    check_where(where, x, mode)
    y = _softmax_family(jnp.where(where, x, jnp.asarray(-jnp.inf, x.dtype)), axes, mode, impl,
                        max_chunk)
    return jnp.where(where, y, jnp.asarray(fill, y.dtype))


def _softmax_family(x, axes, mode, implementation, max_chunk):
    return _op.get(mode).run(implementation, x=x, axes=axes, mode=mode, max_chunk=max_chunk)


def _softmax_family_on(impl, x, axes, mode, max_chunk):
    if impl == "xla" or x.size == 0:
        # Nothing to compute for an empty array: XLA's answer (and gradient) is exact.
        return REFERENCES[mode](x, axes)
    view = rows_over_axes(jnp.asarray(x), axes)
    out2 = _family(view.x2, _Config(mode=mode, backend=impl, max_chunk=max_chunk))
    if mode == "logsumexp":
        return reshape(out2, view.kept_shape)
    return view.restore(out2)


# --------------------------------------------------------------------------
# XLA references (also the "xla" implementation): float32 math, x's dtype out
# --------------------------------------------------------------------------

def softmax_reference(x, axis=-1):
    """``jax.nn.softmax`` on x upcast to float32, the result in x's dtype."""
    return jax.nn.softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def log_softmax_reference(x, axis=-1):
    """``jax.nn.log_softmax`` on x upcast to float32, the result in x's dtype."""
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def logsumexp_reference(x, axis=-1):
    """``jax.nn.logsumexp`` on x upcast to float32, the result in x's dtype."""
    return jax.nn.logsumexp(x.astype(jnp.float32), axis=axis).astype(x.dtype)


REFERENCES = {"softmax": softmax_reference, "log_softmax": log_softmax_reference,
              "logsumexp": logsumexp_reference}


# --------------------------------------------------------------------------
# Shared pieces of both kernel families
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    mode: str
    backend: str
    max_chunk: int | None = None


def _chunk_reader(layout: RowLayout):
    """``read(ref, c, fill)``: chunk ``c`` of ``ref`` as float32, padding = ``fill``.

    A row of a single chunk is loaded once and reused by the second pass.
    """
    cache = {}

    def read(ref, c, fill):
        if layout.num_chunks != 1:
            return load_chunk(ref, layout, c, fill=fill)
        key = (id(ref), fill)
        if key not in cache:
            cache[key] = load_chunk(ref, layout, 0, fill=fill)
        return cache[key]

    return read


def _write_chunks(layout: RowLayout, out_ref, value_of_chunk):
    """Second pass: ``out[:, chunk c] = value_of_chunk(c)`` for every chunk."""
    def body(c, carry):
        out_ref[:, chunk_slice(layout, c)] = value_of_chunk(c).astype(out_ref.dtype)
        return carry
    for_each_chunk(layout, body, 0)


# --------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------

def _forward_kernel(x_ref, *out_refs, layout: RowLayout, mode: str, want_stats: bool):
    read = _chunk_reader(layout)
    neg_inf = -jnp.inf
    init = (jnp.full((layout.block_rows, 1), neg_inf, jnp.float32),
            jnp.zeros((layout.block_rows, 1), jnp.float32))
    m, s = for_each_chunk(
        layout, lambda c, ms: online_logsumexp_update(*ms, read(x_ref, c, neg_inf)), init)
    if mode == "logsumexp":
        lse_ref, *stat_refs = out_refs
        lse_ref[...] = m + jnp.log(s)
        if want_stats:
            m_ref, s_ref = stat_refs
            m_ref[...] = m
            s_ref[...] = s
        return
    (y_ref,) = out_refs
    shift = logsumexp_shift(m)
    if mode == "softmax":
        inv_s = 1.0 / s
        _write_chunks(layout, y_ref, lambda c: jnp.exp(read(x_ref, c, neg_inf) - shift) * inv_s)
    else:
        log_s = jnp.log(s)
        _write_chunks(layout, y_ref, lambda c: (read(x_ref, c, neg_inf) - shift) - log_s)


def _forward_call(x2, config: _Config, want_stats: bool):
    """softmax / log_softmax: ``y [rows, features]``; logsumexp: ``lse`` float32
    ``[rows, 1]``, plus ``(m, s)`` float32 ``[rows, 1]`` when ``want_stats``."""
    rows, features = x2.shape
    layout = _layout(rows, features, x2.dtype, config)
    mode = config.mode
    n, itemsize = rows * features, x2.dtype.itemsize
    if mode == "logsumexp":
        stat = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
        out_shape = [stat] * (3 if want_stats else 1)
        out_specs = [layout.stat_spec()] * len(out_shape)
        bytes_accessed = n * itemsize + rows * 4 * len(out_shape)
    else:
        out_shape = [jax.ShapeDtypeStruct((rows, features), x2.dtype)]
        out_specs = [layout.row_spec()]
        bytes_accessed = 2 * n * itemsize
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, layout=layout, mode=mode, want_stats=want_stats),
        out_shape=out_shape, grid=layout.grid, in_specs=[layout.row_spec()],
        out_specs=out_specs, compiler_params=row_compiler_params(layout, config.backend),
        backend=config.backend, name=f"{mode}_fwd",
        cost_estimate=dict(flops=4 * n, transcendentals=n * (1 if mode == "logsumexp" else 2),
                           bytes_accessed=bytes_accessed))(x2)
    return tuple(outs) if len(outs) > 1 else outs[0]


# --------------------------------------------------------------------------
# Backward kernel
# --------------------------------------------------------------------------

def _backward_kernel(*refs, layout: RowLayout, mode: str):
    read = _chunk_reader(layout)
    if mode == "logsumexp":
        x_ref, m_ref, s_ref, g_ref, dx_ref = refs
        shift = logsumexp_shift(m_ref[...])
        scale = g_ref[...] / s_ref[...]
        _write_chunks(layout, dx_ref, lambda c: jnp.exp(read(x_ref, c, -jnp.inf) - shift) * scale)
        return
    y_ref, g_ref, dx_ref = refs
    zeros = jnp.zeros((layout.block_rows, 1), jnp.float32)
    if mode == "softmax":
        # Padding columns read as 0 in both, so they add nothing to sum(g * y).
        dot = for_each_chunk(layout, lambda c, acc: acc + jnp.sum(
            read(g_ref, c, 0.0) * read(y_ref, c, 0.0), axis=1, keepdims=True), zeros)
        _write_chunks(layout, dx_ref, lambda c: read(y_ref, c, 0.0) * (read(g_ref, c, 0.0) - dot))
    else:
        total = for_each_chunk(layout, lambda c, acc: acc + jnp.sum(
            read(g_ref, c, 0.0), axis=1, keepdims=True), zeros)
        _write_chunks(layout, dx_ref,
                      lambda c: read(g_ref, c, 0.0) - jnp.exp(read(y_ref, c, 0.0)) * total)


def _backward_call(config: _Config, residuals, g):
    mode = config.mode
    if mode == "logsumexp":
        x2, m, s = residuals
        operands = (x2, m, s, g.astype(jnp.float32).reshape(-1, 1))
    else:
        (y2,) = residuals
        x2 = y2
        operands = (y2, g)
    rows, features = x2.shape
    layout = _layout(rows, features, x2.dtype, config)
    stat, row = layout.stat_spec(), layout.row_spec()
    in_specs = [row, stat, stat, stat] if mode == "logsumexp" else [row, row]
    n, itemsize = rows * features, x2.dtype.itemsize
    reads = 1 if mode == "logsumexp" else 2
    return pl.pallas_call(
        functools.partial(_backward_kernel, layout=layout, mode=mode),
        out_shape=jax.ShapeDtypeStruct((rows, features), x2.dtype), grid=layout.grid,
        in_specs=in_specs, out_specs=row,
        compiler_params=row_compiler_params(layout, config.backend),
        backend=config.backend, name=f"{mode}_bwd",
        cost_estimate=dict(flops=4 * n, transcendentals=0 if mode == "softmax" else n,
                           bytes_accessed=(reads + 1) * n * itemsize))(*operands)


# --------------------------------------------------------------------------
# custom_vjp wiring
# --------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _family(x2, config: _Config):
    """``[rows, features]`` -> the same shape, or ``[rows]`` for logsumexp (x's dtype)."""
    out = _partitioned_forward(x2, config, want_stats=False)[0]
    if config.mode == "logsumexp":
        return out[:, 0].astype(x2.dtype)
    return out


def _family_fwd(x2, config):
    if config.mode == "logsumexp":
        lse, m, s = _partitioned_forward(x2, config, want_stats=True)
        return lse[:, 0].astype(x2.dtype), (x2, m, s)
    (y2,) = _partitioned_forward(x2, config, want_stats=False)
    return y2, (y2,)


def _family_bwd(config, residuals, g):
    # Multi-device: rows stay where they are, a sharded feature dim is gathered.
    dims = (ROW, STAT, STAT, PER_ROW) if config.mode == "logsumexp" else (ROW, ROW)
    return rowwise(config.mode, lambda *a, reduced: (_backward_call(config, a[:-1], a[-1]),),
                   (*residuals, g), dims, (ROW,), out_like=(0,))


def _partitioned_forward(x2, config: _Config, want_stats: bool) -> tuple:
    """:func:`_forward_call` on each device's rows (a sharded feature dim gathered), as a tuple.
    A gathered softmax output goes back to x's layout (a local slice, no communication)."""
    def local(x2, *, reduced):
        out = _forward_call(x2, config, want_stats)
        return out if isinstance(out, tuple) else (out,)

    if config.mode == "logsumexp":
        return rowwise(config.mode, local, (x2,), (ROW,), (STAT,) * (3 if want_stats else 1))
    # Under explicit sharding y keeps x's layout (the custom_vjp's dx must have it too).
    return rowwise(config.mode, local, (x2,), (ROW,), (ROW,), out_like=(0,))


_family.defvjp(_family_fwd, _family_bwd)


# --------------------------------------------------------------------------
# Block-size heuristic
# --------------------------------------------------------------------------

def _layout(rows: int, features: int, dtype, config: _Config) -> RowLayout:
    """The shared row layout (:func:`~ops.reduction._rows.select_row_layout`): 8 rows
    per program on TPU (one sublane tile), 4 elsewhere; chunks of 4096
    columns for 16-bit dtypes and 2048 for float32 unless ``max_chunk`` caps
    them. The backward pass uses the same layout as the forward."""
    return select_row_layout(config.mode, rows, features, dtype, config.backend,
                             max_chunk=config.max_chunk)


# The tuner fills the cache for softmax over 4096 rows of 4096..32768 features (the static
# gate's sizes); log_softmax and logsumexp share its kernels' layout.
register_row_op("softmax", softmax_reference, row_example(softmax), check=check_axis_op,
                shapes=[(4096, f) for f in (4096, 8192, 32768)], order=32,
                entry=_softmax_family_on, function=softmax)
register_row_op("log_softmax", log_softmax_reference, row_example(log_softmax),
                check=check_axis_op, entry=_softmax_family_on, function=log_softmax)
register_row_op("logsumexp", logsumexp_reference, row_example(logsumexp), check=check_axis_op,
                entry=_softmax_family_on, function=logsumexp)
