"""Layer normalization and RMS normalization over the last axis: one kernel family.

* LayerNorm (Ba, Kiros & Hinton 2016, "Layer Normalization"):
  ``y = (x - mean) * rsqrt(var + epsilon) * scale + bias``, with ``mean`` and
  the biased ``var = mean((x - mean)**2)`` taken over the last axis (or, with
  ``use_fast_variance=True``, ``var = max(0, mean(x**2) - mean**2)``).
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

1. statistics, in one of two forms chosen by ``use_fast_variance`` (a
   static flag of :func:`layer_norm`; RMSNorm has no mean and always takes
   the running sum of squares, which cannot cancel).

   * ``use_fast_variance=False`` (the default of :func:`layer_norm`): the
     two-pass variance ``mean((x - mean)**2)``. Each chunk's ``(count, mean,
     M2)`` is computed from the chunk held in registers / VMEM (mean first,
     then the sum of squared deviations from that mean: the exact two-pass
     formula within the chunk), and merged into the running ``(count, mean,
     M2)`` with the pairwise update of Chan, Golub & LeVeque (1979, "Updating
     formulae and a pairwise algorithm for computing sample variances"), the
     chunked form of Welford's (1962) online algorithm: ``delta = mean_b -
     mean_a``, ``mean += delta * n_b / n``, ``M2 = M2_a + M2_b + delta**2 *
     n_a * n_b / n``. This needs one read of the row for both moments and is
     as stable as the two-pass formula. With one chunk it *is* the two-pass
     formula (the merge with the empty prefix is exact).
   * ``use_fast_variance=True``: the one-pass "textbook" variance
     ``max(0, E[x**2] - E[x]**2)``, Flax's default (``flax.nnx`` /
     ``flax.linen`` ``_compute_stats`` with ``use_fast_variance=True``, the
     same float32 formula, clipped at 0 as Flax clips it). The chunks
     accumulate running float32 sums of ``x`` and ``x**2``; ``mean = sum_x /
     N``, ``var = max(0, sum_xx / N - mean**2)``. It cancels catastrophically
     when the mean is large against the spread (Chan, Golub & LeVeque 1983,
     "Algorithms for computing the sample variance: analysis and
     recommendations"), which is why it is not the default here.

2. output: ``y = (x - mean) * (rstd * scale) + bias`` chunk by chunk, the
   order of operations of Flax's ``_normalize`` (``mul = rsqrt(var + eps);
   mul *= scale; y = (x - mean) * mul; y += bias``), so that equal
   statistics give bit-equal outputs.

Agreement with Flax (the source of :func:`reference` and the tests of
``tests/test_norms.py``): the formulas are Flax's operation for operation, so
what separates the outputs from ``flax.nnx.LayerNorm`` / ``RMSNorm``'s (and
Linen's) is float32 rounding in three places:

* the order in which a row's sums are added (XLA:CPU itself adds a row in an
  order that depends on the row's length and on the fusion around it);
* whether the final ``(x - mean) * mul + bias`` is one fused multiply-add:
  XLA:CPU fuses it under ``jit`` and inside the kernels, not when Flax runs op
  by op (Flax eager and Flax under ``jit`` differ by the same rounding);
* for two-pass rows longer than one chunk (``features > max_chunk``: 2048
  float32 / 4096 16-bit features by default), the Chan merge, whose chunks
  take deviations from their own means.

So: the ``"xla"`` implementation (:func:`reference`) is bit-identical to
Flax on CPU (eager against eager, jit against jit). The Pallas kernels
(measured with ``implementation="interpret"`` on CPU) are bit-identical to
Flax under ``jit`` whenever the row sums are exact in float32 (small
integers, say), except the two-pass rows longer than one chunk. In general,
on rows whose ``|mean|`` is at most their standard deviation, they differ
from Flax (eager or jit) by at most 6 float32 ulps with the fast variance and
4 with the two-pass variance and for RMSNorm, and 16-bit outputs (the float32
result rounded once) by at most one ulp of their dtype; the ulp is that of
the row's largest ``|y|`` or ``|y - bias|`` (not each element's own ulp: an
output near zero where ``x - mean`` or ``+ bias`` cancels has a tiny ulp of
its own). Measured on 2 to 5000 features, 4096 rows each, scale ``1 + N(0,
0.5)``, bias ``N(0, 0.5)``. The bound grows with ``|mean| / std`` (an error
of one ulp of the mean enters ``x - mean``), and the fast form's error with
``mean**2 / var`` (the cancellation below), for Flax and these kernels alike.

When gradients are wanted the forward kernel also writes the per-row ``mean``
(LayerNorm only) and ``rstd = rsqrt(var + epsilon)`` as float32 ``[rows, 1]``
residuals: 8 bytes per row, and the backward pass then needs no statistics
pass of its own. With the fast variance it also writes ``w``, the derivative
of the clip ``max(0, v)`` at the row's unclipped ``v = E[x**2] - E[x]**2``
(1 where ``v > 0``, 0 where ``v < 0``, and 1/2 at ``v == 0``, the value JAX
gives ``jnp.maximum`` at a tie), 4 more bytes per row.

Backward (``jax.custom_vjp``). With ``xhat = (x - mean) * rstd`` and
``gs = g * scale`` (``g`` when there is no scale), the standard closed form
(the chain rule through the normalization, as derived for batch statistics by
Ioffe & Szegedy 2015, "Batch Normalization", section 3, here applied per row
over the features; ``N`` = features) is::

    dx     = rstd * (gs - mean(gs) - w * xhat * mean(gs * xhat))    # LayerNorm
    dx     = rstd * (gs - xhat * mean(gs * xhat))                   # RMSNorm
    dscale = sum over rows of g * xhat
    dbias  = sum over rows of g

``w`` is 1 for the two-pass variance. Both variance formulas are the same
function of x (``E[x**2] - E[x]**2 = E[(x - E[x])**2]``), so both have the
gradient ``dvar/dx_i = 2 (x_i - mean) / N`` and share this closed form; the
fast form's clip contributes the factor ``w`` (where the clip is active the
computed variance is the constant 0 and the ``xhat`` term vanishes), which
makes the result the gradient of the function the forward pass computes, as
``jax.grad`` of Flax's code gives it.

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
from ops import _op
from ops._checks import check_array, check_float_dtype, check_same_dtype
from ops._implementation import check_implementation
from ops._partitioning import PARAM, ROW, STAT, psum, reshape, rowwise
from ops.reduction._rows import register_row_op, row_example
from ops.reduction._rows import (RowLayout, check_max_chunk, as_rows, chunk_slice, column_mask, for_each_chunk,
                                 load_chunk, row_compiler_params, row_layout, select_row_layout, row_mask)

__all__ = ["layer_norm", "rms_norm", "reference", "layer_norm_reference", "rms_norm_reference",
           "default_block_rows"]



def layer_norm(x, scale=None, bias=None, *, epsilon: float = 1e-6,
               use_fast_variance: bool = False, residual=None, scale_offset: float = 0.0,
               implementation: str | None = None,
               max_chunk: int | None = None):
    """Layer normalization over the last axis: ``(x - mean) * (rsqrt(var + eps) * scale) + bias``.

    Matches ``flax.nnx.LayerNorm`` (and ``flax.linen.LayerNorm``) with the
    feature axis last: ``mean`` and the biased variance ``var`` are taken over
    the last axis in float32, ``epsilon`` is added inside the rsqrt, and the
    operations are Flax's in Flax's order (see the module docstring for how
    close to Flax's bits each implementation comes).

    Args:
      x: ``[..., features]`` float32 / bfloat16 / float16; any leading dims,
        any feature size >= 1.
      scale: ``[features]`` or None (no scaling); float32 / bfloat16 /
        float16, not necessarily x's dtype (it is read as float32, so float32
        params with 16-bit x lose nothing).
      bias: ``[features]`` or None (no offset); dtypes as scale.
      epsilon: a static non-negative number added to the variance.
      residual: None, or an array of x's shape and dtype to add to x first:
        the call then normalizes ``h = x + residual`` (the sum rounded to x's
        dtype, as the unfused ``x + residual`` is) and returns ``(y, h)``, both
        from one kernel (pre-norm transformers' "add, then norm" of the
        residual stream; see the module docstring). The backward pass takes
        the cotangents of both outputs; x and residual get the same gradient.
      scale_offset: a static real number added to ``scale`` inside the
        kernel, so the multiplier is ``scale + scale_offset``: 1.0 gives
        Gemma's ``(1 + scale)`` with a zero-initialised scale. The gradient
        with respect to ``scale`` is unchanged in meaning (that of the
        ``scale`` argument). Must be 0 when ``scale`` is None.
      use_fast_variance: a static bool. False (the default): the two-pass
        variance ``mean((x - mean)**2)`` (chunked with Chan et al.'s merge),
        accurate whatever the mean. True: Flax's fast form ``max(0,
        mean(x**2) - mean(x)**2)`` (Flax's own default, one pass of running
        sums), which loses precision, down to a variance of 0, on rows whose
        mean is large against their spread; set it to match a Flax module
        with ``use_fast_variance=True`` bit for bit (the layers pass their
        setting through).
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton" (ours), "pallas_triton"
        or "mosaic_tpu".
        "mosaic_gpu" raises NotImplementedError (no kernel for it yet). Or a
        sequence of these tried in order (:mod:`ops._implementation`).
      max_chunk: optional cap on the column chunk the kernels walk a row in
        (a power of two >= 128; None picks 4096 for 16-bit inputs, 2048 for
        float32). Results do not depend on it beyond float rounding; tests use
        a small cap to exercise multi-chunk rows on small shapes.

    Returns:
      ``y [..., features]`` in x's dtype; with ``residual``, the pair ``(y,
      x + residual)``. Statistics and arithmetic are float32.

    Raises:
      TypeError: a non-array argument, an integer / unsupported dtype of x,
        scale, bias or residual, residual's dtype not x's, a non-numeric
        epsilon or scale_offset, a use_fast_variance that is not a bool.
      ValueError: x a scalar or with 0 features, scale / bias not
        ``[features]``, residual not x's shape, a negative or NaN epsilon, a
        non-finite scale_offset or a non-zero one without scale, a bad
        max_chunk, an unknown implementation.
      NotImplementedError: implementation "mosaic_gpu" (no kernel for it yet).

    Differentiable in x, residual, scale and bias (``jax.custom_vjp`` with
    Pallas backward kernels; the gradients have the dtypes of x, scale and bias);
    jit- and vmap-compatible. The gradient is that of the formula chosen by
    ``use_fast_variance``, clip included (module docstring).
    """
    return _normalize("layer_norm", x, scale, bias, epsilon=epsilon, center=True,
                      fast_variance=_check_flag(use_fast_variance, "use_fast_variance",
                                                "layer_norm"),
                      residual=residual, scale_offset=scale_offset,
                      implementation=implementation, max_chunk=max_chunk)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, residual=None, scale_offset: float = 0.0,
             implementation: str | None = None, max_chunk: int | None = None):
    """RMS normalization over the last axis: ``x * rsqrt(mean(x**2) + eps) * scale``.

    Matches ``flax.nnx.RMSNorm`` (and ``flax.linen.RMSNorm``) with the feature
    axis last: the mean of squares is taken over the last axis in float32 and
    ``epsilon`` is added inside the rsqrt. No centering, no bias.

    Args:
      x: ``[..., features]`` float32 / bfloat16 / float16; any leading dims,
        any feature size >= 1.
      scale: ``[features]`` or None (no scaling); float32 / bfloat16 /
        float16, not necessarily x's dtype (read as float32).
      epsilon, residual, scale_offset, implementation, max_chunk: as in
        :func:`layer_norm`. (There is no ``use_fast_variance``: without
        centering the statistic is ``mean(x**2)`` either way, as in Flax's
        RMSNorm.) ``residual`` is the fused add of a pre-norm decoder layer
        (``h = x + residual; y = rms_norm(h)``); ``scale_offset=1.0`` is
        Gemma's ``x * rsqrt(mean(x**2) + eps) * (1 + scale)``.

    Returns:
      ``[..., features]`` in x's dtype; with ``residual``, ``(y, x + residual)``.

    Raises:
      As :func:`layer_norm`.

    Per-head norms (Qwen3's and Gemma 3's q/k norms): pass ``q [B, T, N, H]``
    with ``scale [H]``; the rows are the ``B * T * N`` heads. Merging the
    leading dims of a row-major array is a bitcast (XLA emits no copy for it),
    so the kernel reads q in place; no transpose is involved.

    Differentiable in x, residual and scale; jit- and vmap-compatible.
    """
    return _normalize("rms_norm", x, scale, None, epsilon=epsilon, center=False,
                      fast_variance=False, residual=residual, scale_offset=scale_offset,
                      implementation=implementation, max_chunk=max_chunk)


def _normalize(op, x, scale, bias, *, epsilon, center, fast_variance, residual, scale_offset,
               implementation, max_chunk):
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
        check_float_dtype(p, name, op)
        if tuple(p.shape) != (features,):
            raise ValueError(f"{op}: {name} must have shape [features] = ({features},), got "
                             f"{tuple(p.shape)}.")
    if residual is not None:
        check_array(residual, "residual", op)
        check_float_dtype(residual, "residual", op)
        check_same_dtype(residual, x, "residual", "x", op)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got "
                             f"{tuple(residual.shape)}.")
    epsilon = _check_epsilon(epsilon, op)
    scale_offset = _check_scale_offset(scale_offset, scale, op)
    check_max_chunk(max_chunk, op)
    check_implementation(implementation, op)
    return _op.get(op).run(implementation, op=op, x=x, residual=residual, scale=scale, bias=bias,
                           epsilon=epsilon, center=center, fast_variance=fast_variance,
                           scale_offset=scale_offset, max_chunk=max_chunk)


def _norm_on(impl, op, x, residual, scale, bias, epsilon, center, fast_variance, scale_offset,
             max_chunk):
    """The checked call on one implementation (see :func:`layer_norm`, :func:`rms_norm`)."""
    features = x.shape[-1]
    x2, lead = as_rows(x)
    if impl == "xla" or x2.shape[0] == 0:  # (no rows: keep autodiff through the reference)
        h = x if residual is None else x + residual
        y = reference(h, scale, bias, epsilon=epsilon, center=center,
                      use_fast_variance=fast_variance, scale_offset=scale_offset)
        return y if residual is None else (y, h)
    config = _Config(op=op, backend=impl, center=center, epsilon=epsilon,
                     fast_variance=fast_variance,
                     max_chunk=None if max_chunk is None else int(max_chunk),
                     scale_offset=scale_offset, residual=residual is not None)
    if residual is None:
        return reshape(_norm(x2, scale, bias, config), (*lead, features))
    y2, h2 = _norm_residual(x2, as_rows(residual)[0], scale, bias, config)
    return reshape(y2, (*lead, features)), reshape(h2, (*lead, features))


def _check_flag(value, name: str, op: str) -> bool:
    """A static Python / NumPy bool (it selects the compiled kernel)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool (True or False), got "
                        f"{type(value).__name__} {value!r}.")
    return bool(value)


def _check_scale_offset(scale_offset, scale, op) -> float:
    """A static finite real number; non-zero only with a scale."""
    if (isinstance(scale_offset, bool)
            or not isinstance(scale_offset, (int, float, np.integer, np.floating))):
        raise TypeError(f"{op}: scale_offset must be a static real number (it is compiled into "
                        f"the kernel), got {type(scale_offset).__name__}.")
    scale_offset = float(scale_offset)
    if not np.isfinite(scale_offset):
        raise ValueError(f"{op}: scale_offset must be finite, got {scale_offset}.")
    if scale_offset != 0.0 and scale is None:
        raise ValueError(f"{op}: scale_offset={scale_offset} needs a scale (it is added to "
                         "scale); pass scale, or scale_offset=0.")
    return scale_offset


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

def reference(x, scale=None, bias=None, *, epsilon: float = 1e-6, center: bool = True,
              use_fast_variance: bool = False, scale_offset: float = 0.0):
    """LayerNorm (``center=True``) or RMSNorm (``center=False``) with XLA, float32 inside.

    Flax's arithmetic operation for operation (``_compute_stats`` then
    ``_normalize`` of ``flax.nnx.nn.normalization``): ``var`` is the biased
    two-pass ``mean((x - mean)**2)``, or with ``use_fast_variance``
    ``max(0, mean(x**2) - mean**2)``; then ``(x - mean) * (rsqrt(var + eps) *
    scale) + bias``. On CPU it is bit-identical to the Flax modules with the
    same ``use_fast_variance``. x, scale and bias may have different float
    dtypes (all are computed in float32); the output has x's dtype. A
    non-zero ``scale_offset`` multiplies by ``scale + scale_offset`` (float32).
    """
    xf = x.astype(jnp.float32)
    if not center:
        mean, var = None, jnp.mean(lax.square(xf), axis=-1, keepdims=True)
    elif use_fast_variance:
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        mean2 = jnp.mean(lax.square(xf), axis=-1, keepdims=True)
        var = jnp.maximum(0.0, mean2 - lax.square(mean))
    else:
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(lax.square(xf - mean), axis=-1, keepdims=True)
    y = xf if mean is None else xf - mean
    mul = lax.rsqrt(var + epsilon)
    if scale is not None:
        mul = mul * _offset(scale.astype(jnp.float32), scale_offset)
    y = y * mul
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _offset(scale, scale_offset: float):
    """``scale + scale_offset`` (float32), with no add at all for an offset of 0."""
    return scale if scale_offset == 0.0 else scale + scale_offset


def layer_norm_reference(x, scale=None, bias=None, *, epsilon: float = 1e-6,
                         use_fast_variance: bool = False, scale_offset: float = 0.0):
    """:func:`reference` with centering: what ``layer_norm(..., implementation="xla")`` runs
    (without ``residual``; with it, the reference of ``x + residual``)."""
    return reference(x, scale, bias, epsilon=epsilon, center=True,
                     use_fast_variance=use_fast_variance, scale_offset=scale_offset)


def rms_norm_reference(x, scale=None, *, epsilon: float = 1e-6, scale_offset: float = 0.0):
    """:func:`reference` without centering: what ``rms_norm(..., implementation="xla")`` runs
    (without ``residual``; with it, the reference of ``x + residual``)."""
    return reference(x, scale, None, epsilon=epsilon, center=False, scale_offset=scale_offset)


# --------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    op: str
    backend: str
    center: bool
    epsilon: float
    fast_variance: bool = False
    max_chunk: int | None = None
    scale_offset: float = 0.0   # added to scale in the kernels (Gemma's 1 + scale)
    residual: bool = False      # normalizes x + residual, writes the sum too


def _chunk_loader(ref, layout: RowLayout):
    """``c -> chunk c of ref`` as float32 (padding 0); one load when the row is one chunk.

    With a single chunk the value is loaded once here and reused by every
    pass, so the kernel reads x (and g) from memory exactly once.
    """
    if layout.num_chunks == 1:
        value = load_chunk(ref, layout, 0)
        return lambda c: value
    return lambda c: load_chunk(ref, layout, c)


def _sum_loader(x_ref, residual_ref, layout: RowLayout):
    """``c -> chunk c of h = x + residual`` as float32 (padding 0), the sum rounded to
    x's dtype as the unfused add rounds it; one load of each when the row is one chunk."""
    def load(c):
        h = load_chunk(x_ref, layout, c) + load_chunk(residual_ref, layout, c)
        return h.astype(x_ref.dtype).astype(jnp.float32)
    if layout.num_chunks == 1:
        value = load(0)
        return lambda c: value
    return load


def _scale_loader(scale_ref, layout: RowLayout, config: "_Config"):
    """``c -> chunk c of scale + scale_offset`` as float32, or None without a scale."""
    if scale_ref is None:
        return None
    return lambda c: _offset(load_chunk(scale_ref, layout, c), config.scale_offset)


def _valid_count(layout: RowLayout, c):
    """How many real features chunk ``c`` holds, as float32 (only the last chunk is short)."""
    if not layout.needs_column_mask:
        return jnp.float32(layout.chunk)
    if isinstance(c, int):
        return jnp.float32(min(layout.chunk, layout.features - c * layout.chunk))
    return jnp.minimum(layout.chunk, layout.features - c * layout.chunk).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Stats:
    """Per-row statistics, float32 ``[block_rows, 1]`` (mean and weight None where unused).

    ``weight`` is ``d max(0, v) / dv`` of the fast variance (module docstring).
    """

    mean: jax.Array | None
    rstd: jax.Array
    weight: jax.Array | None = None


def _row_stats(load_x, layout: RowLayout, config: "_Config") -> _Stats:
    """The row statistics in one pass over the chunks (the module docstring's step 1)."""
    shape = (layout.block_rows, 1)
    zeros = jnp.zeros(shape, jnp.float32)
    epsilon = config.epsilon
    if not config.center:
        def sum_squares(c, acc):
            x = load_x(c)
            return acc + jnp.sum(x * x, axis=1, keepdims=True)
        ms = for_each_chunk(layout, sum_squares, zeros) / layout.features
        return _Stats(None, lax.rsqrt(ms + epsilon))

    if config.fast_variance:
        def sums(c, carry):
            # Padding columns are 0: they add nothing to either sum.
            sum_x, sum_xx = carry
            x = load_x(c)
            return (sum_x + jnp.sum(x, axis=1, keepdims=True),
                    sum_xx + jnp.sum(x * x, axis=1, keepdims=True))

        sum_x, sum_xx = for_each_chunk(layout, sums, (zeros, zeros))
        mean = sum_x / layout.features
        v = sum_xx / layout.features - mean * mean  # Flax: mean(x**2) - mean(x)**2
        weight = jnp.where(v > 0.0, 1.0, jnp.where(v == 0.0, 0.5, 0.0))
        return _Stats(mean, lax.rsqrt(jnp.maximum(v, 0.0) + epsilon), weight)

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
    return _Stats(mean, lax.rsqrt(m2 / layout.features + epsilon))


def _stat_names(config: "_Config") -> tuple[str, ...]:
    """The residual statistics the forward kernel writes for the backward, in order."""
    if not config.center:
        return ("rstd",)
    return ("mean", "rstd", "weight") if config.fast_variance else ("mean", "rstd")


def _forward_kernel(*refs, layout: RowLayout, config, has_scale, has_bias, want_stats):
    refs = list(refs)
    x_ref = refs.pop(0)
    residual_ref = refs.pop(0) if config.residual else None
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    y_ref = refs.pop(0)
    h_ref = refs.pop(0) if config.residual else None
    stat_refs = dict(zip(_stat_names(config), refs)) if want_stats else {}

    # With a residual, "x" below is h = x + residual, which the kernel also writes.
    load_x = (_chunk_loader(x_ref, layout) if residual_ref is None
              else _sum_loader(x_ref, residual_ref, layout))
    load_scale = _scale_loader(scale_ref, layout, config)
    stats = _row_stats(load_x, layout, config)
    mean, rstd = stats.mean, stats.rstd

    def store(c, carry):
        # Flax's order: mul = rstd * scale; y = (x - mean) * mul; y += bias.
        x = load_x(c)
        mul = rstd if load_scale is None else rstd * load_scale(c)
        y = (x if mean is None else x - mean) * mul
        if bias_ref is not None:
            y = y + load_chunk(bias_ref, layout, c)
        y_ref[:, chunk_slice(layout, c)] = y.astype(y_ref.dtype)
        if h_ref is not None:
            h_ref[:, chunk_slice(layout, c)] = x.astype(h_ref.dtype)
        return carry

    for_each_chunk(layout, store, ())
    for name, ref in stat_refs.items():
        ref[...] = getattr(stats, name)


def _param_spec(layout: RowLayout) -> pl.BlockSpec:
    """scale / bias as ``[1, features]``: every program reads the whole (padded) row."""
    return pl.BlockSpec((1, layout.padded_cols), lambda i: (0, 0))


def _forward_call(x, scale, bias, config: _Config, *, want_stats: bool, residual=None):
    """``y``, or ``(y, stats)`` with the float32 ``[rows, 1]`` statistics named by
    :func:`_stat_names` (a dict), for ``x [rows, F]``; with ``residual`` (and
    ``config.residual``), ``y`` is the pair ``(y, h = x + residual)``."""
    rows, features = x.shape
    layout = _layout_for(rows, features, x.dtype, config)
    operands, in_specs = [x], [layout.row_spec()]
    if config.residual:
        operands.append(residual)
        in_specs.append(layout.row_spec())
    for p in (scale, bias):
        if p is not None:
            operands.append(p.reshape(1, features))
            in_specs.append(_param_spec(layout))
    n_rows_out = 2 if config.residual else 1
    out_shapes = [jax.ShapeDtypeStruct((rows, features), x.dtype)] * n_rows_out
    out_specs = [layout.row_spec()] * n_rows_out
    names = _stat_names(config) if want_stats else ()
    out_shapes += [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * len(names)
    out_specs += [layout.stat_spec()] * len(names)
    kernel = functools.partial(
        _forward_kernel, layout=layout, config=config, has_scale=scale is not None,
        has_bias=bias is not None, want_stats=want_stats)
    outs = pl.pallas_call(
        kernel, out_shape=out_shapes, grid=layout.grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=row_compiler_params(layout, config.backend), backend=config.backend,
        name=_kernel_name(config, "fwd"),
        cost_estimate=_cost(operands, out_shapes, rows, flops_per_element=8))(*operands)
    y = tuple(outs[:2]) if config.residual else outs[0]
    return (y, dict(zip(names, outs[n_rows_out:]))) if want_stats else y


def _kernel_name(config: _Config, direction: str) -> str:
    """``rms_norm_fwd``, ``layer_norm_bwd``, ...; ``rms_norm_residual_fwd`` with a residual."""
    return f"{config.op}{'_residual' if config.residual else ''}_{direction}"


# --------------------------------------------------------------------------
# Backward kernel: dx, and per-row-block partial sums for dscale and dbias
# --------------------------------------------------------------------------

def _backward_kernel(*refs, layout: RowLayout, config, has_scale, want_dscale, want_dbias):
    refs = list(refs)
    center = config.center
    x_ref = refs.pop(0)   # h = x + residual with a residual
    scale_ref = refs.pop(0) if has_scale else None
    g_ref = refs.pop(0)
    gh_ref = refs.pop(0) if config.residual else None  # the cotangent of h
    stats = {name: refs.pop(0)[...] for name in _stat_names(config)}
    dx_ref = refs.pop(0)
    dscale_ref = refs.pop(0) if want_dscale else None
    dbias_ref = refs.pop(0) if want_dbias else None

    rstd = stats["rstd"]
    mean = stats.get("mean")
    load_x, load_g = _chunk_loader(x_ref, layout), _chunk_loader(g_ref, layout)
    scale_chunk = _scale_loader(scale_ref, layout, config) or (lambda c: None)

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
    if "weight" in stats:  # the fast variance's clip: d max(0, v) / dv
        mean_gs_xhat = stats["weight"] * mean_gs_xhat

    def write(c, carry):
        xhat, g, gs = xhat_gs(c)
        dx = gs - xhat * mean_gs_xhat
        if center:
            dx = dx - mean_gs
        dx = rstd * dx
        if gh_ref is not None:  # h also feeds the residual stream: add its cotangent
            dx = dx + load_chunk(gh_ref, layout, c)
        dx_ref[:, chunk_slice(layout, c)] = dx.astype(dx_ref.dtype)
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


def _backward_call(x, scale, g, stats, config: _Config, *, want_dscale, want_dbias, gh=None):
    """``(dx, dscale float32 [F] or None, dbias float32 [F] or None)``; ``stats`` as
    :func:`_forward_call` returns them. With ``config.residual``, ``x`` is the saved
    ``h = x + residual`` and ``gh`` its cotangent, added to dx."""
    rows, features = x.shape
    layout = _layout_for(rows, features, x.dtype, config)
    operands, in_specs = [x], [layout.row_spec()]
    if scale is not None:
        operands.append(scale.reshape(1, features))
        in_specs.append(_param_spec(layout))
    operands.append(g)
    in_specs.append(layout.row_spec())
    if config.residual:
        operands.append(gh)
        in_specs.append(layout.row_spec())
    for name in _stat_names(config):
        operands.append(stats[name])
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

    kernel = functools.partial(_backward_kernel, layout=layout, config=config,
                               has_scale=scale is not None, want_dscale=want_dscale,
                               want_dbias=want_dbias)
    outs = list(pl.pallas_call(
        kernel, out_shape=out_shapes, grid=layout.grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=row_compiler_params(layout, config.backend), backend=config.backend,
        name=_kernel_name(config, "bwd"),
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
    return _partitioned_forward(x, scale, bias, config, want_stats=False)[0]


def _norm_fwd(x, scale, bias, config):
    y, stats = _partitioned_forward(x, scale, bias, config, want_stats=True)
    # bias itself is not needed by the backward, only whether there is one and
    # its dtype: keep a zero-size marker (None when there is no bias).
    bias_marker = None if bias is None else jnp.zeros((0,), bias.dtype)
    return y, (x, scale, stats, bias_marker)


def _norm_bwd(config, residuals, g):
    x, scale, stats, bias_marker = residuals
    dx, dscale, dbias = _partitioned_backward(x, scale, g, stats, config,
                                              want_dscale=scale is not None,
                                              want_dbias=bias_marker is not None)
    return (dx,
            None if scale is None else dscale.astype(scale.dtype),
            None if dbias is None else dbias.astype(bias_marker.dtype))


# Multi-device (ops._partitioning): rows ("r") run where they live; a sharded
# feature dim ("f") is gathered, as one row's statistics need all of it; the
# backward's dscale / dbias, sums over rows, end in a psum over the row axes.

def _partitioned_forward(x, scale, bias, config: _Config, *, want_stats: bool, residual=None):
    """:func:`_forward_call` on each device's rows: ``(y, stats dict)`` (stats empty
    unless ``want_stats``); with a residual, ``y`` is the pair ``(y, h)``."""
    names = _stat_names(config) if want_stats else ()
    if config.residual:
        n_out = 2

        def local(x, residual, scale, bias, *, reduced):
            if not want_stats:
                return _forward_call(x, scale, bias, config, want_stats=False, residual=residual)
            y, stats = _forward_call(x, scale, bias, config, want_stats=True, residual=residual)
            return (*y, *(stats[n] for n in names))

        args, in_dims = (x, residual, scale, bias), (ROW, ROW, PARAM, PARAM)
    else:
        n_out = 1

        def local(x, scale, bias, *, reduced):
            if not want_stats:
                return (_forward_call(x, scale, bias, config, want_stats=False),)
            y, stats = _forward_call(x, scale, bias, config, want_stats=True)
            return (y, *(stats[n] for n in names))

        args, in_dims = (x, scale, bias), (ROW, PARAM, PARAM)
    outs = rowwise(config.op, local, args, in_dims, (ROW,) * n_out + (STAT,) * len(names),
                   out_like=(0,) * n_out)
    y = tuple(outs[:n_out]) if config.residual else outs[0]
    return y, dict(zip(names, outs[n_out:]))


def _partitioned_backward(x, scale, g, stats, config: _Config, *, want_dscale, want_dbias,
                          gh=None):
    """:func:`_backward_call` on each device's rows; dscale / dbias summed across devices.
    With ``config.residual``, ``gh`` (h's cotangent) rides along as one more row operand."""
    names = _stat_names(config)
    extra = (gh,) if config.residual else ()

    def local(x, scale, g, *rest, reduced):
        gh_local = rest[0] if config.residual else None
        row_stats = rest[len(extra):]
        dx, dscale, dbias = _backward_call(x, scale, g, dict(zip(names, row_stats)), config,
                                           want_dscale=want_dscale, want_dbias=want_dbias,
                                           gh=gh_local)
        return (dx, *(psum(d, reduced, "r") for d in (dscale, dbias) if d is not None))

    n_param_grads = int(want_dscale) + int(want_dbias)
    dx, *param_grads = rowwise(config.op, local,
                               (x, scale, g, *extra, *(stats[n] for n in names)),
                               (ROW, PARAM, ROW) + (ROW,) * len(extra) + (STAT,) * len(names),
                               (ROW,) + (PARAM,) * n_param_grads, sums_over_rows=True,
                               out_like=(0, 1) if want_dscale else (0,))
    dscale = param_grads.pop(0) if want_dscale else None
    dbias = param_grads.pop(0) if want_dbias else None
    return dx, dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_residual(x, residual, scale, bias, config: _Config):
    """``(norm(h), h)`` with ``h = x + residual`` from one forward kernel."""
    return _partitioned_forward(x, scale, bias, config, want_stats=False, residual=residual)[0]


def _norm_residual_fwd(x, residual, scale, bias, config):
    (y, h), stats = _partitioned_forward(x, scale, bias, config, want_stats=True,
                                         residual=residual)
    bias_marker = None if bias is None else jnp.zeros((0,), bias.dtype)
    return (y, h), (h, scale, stats, bias_marker)


def _norm_residual_bwd(config, residuals, cotangents):
    h, scale, stats, bias_marker = residuals
    gy, gh = cotangents
    dh, dscale, dbias = _partitioned_backward(h, scale, gy, stats, config,
                                              want_dscale=scale is not None,
                                              want_dbias=bias_marker is not None, gh=gh)
    return (dh, dh,  # h = x + residual: both get h's cotangent
            None if scale is None else dscale.astype(scale.dtype),
            None if dbias is None else dbias.astype(bias_marker.dtype))


_norm_residual.defvjp(_norm_residual_fwd, _norm_residual_bwd)


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
    traits = pl.backend_traits(backend)
    if traits.hardware == "tpu":
        padded = row_layout(rows, features, dtype, backend, max_chunk=max_chunk).padded_cols
        br = _TPU_BLOCK_BYTES // (padded * 4)
        br = max(8, min(_TPU_MAX_BLOCK_ROWS, br // 8 * 8))
        return rows if rows <= br else br
    if traits.triton:
        chunk = row_layout(rows, features, dtype, backend, max_chunk=max_chunk).chunk
        br = max(1, min(4, _TRITON_MAX_ELEMENTS // chunk))
        return min(br, 1 << max(0, rows - 1).bit_length())
    return None


def _layout_for(rows, features, dtype, config: _Config) -> RowLayout:
    """The tuning cache's layout, else :func:`default_block_rows`' (see select_row_layout)."""
    return select_row_layout(
        config.op, rows, features, dtype, config.backend, max_chunk=config.max_chunk,
        heuristic_block_rows=lambda max_chunk: default_block_rows(rows, features, dtype,
                                                                  config.backend,
                                                                  max_chunk=max_chunk))


def _cost(operands, out_shapes, rows: int, *, flops_per_element: int):
    """What XLA schedules the custom call by: every operand read and output written once."""
    nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                 for a in (*operands, *out_shapes))
    return {"flops": flops_per_element * int(np.prod(operands[0].shape)),
            "transcendentals": rows, "bytes_accessed": nbytes}


# The tuner fills the cache for both norms over 4096 rows of 4096..32768 features (the
# static gate's sizes); --quick tunes one small layer norm.
register_row_op("layer_norm", layer_norm_reference, row_example(layer_norm, params=2),
                shapes=[(4096, f) for f in (4096, 8192, 32768)], quick=[(256, 4096)], order=30,
                entry=_norm_on, function=layer_norm)
register_row_op("rms_norm", rms_norm_reference, row_example(rms_norm, params=1),
                shapes=[(4096, f) for f in (4096, 8192, 32768)], order=31, entry=_norm_on,
                function=rms_norm)
