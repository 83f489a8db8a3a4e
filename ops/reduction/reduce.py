"""sum, mean and max over any axes, as row-wise kernels.

The reduced axes are moved last and flattened into one feature dim
(:func:`ops.reduction._rows.rows_over_axes`): rows are the kept axes. This is
free when the reduced axes already are the trailing ones; otherwise it is a
transpose, one copy of x (a kernel reducing over leading axes in place would
avoid it; not built yet). The kernel is the shared row layout of
:mod:`ops.reduction._rows`: a program owns ``block_rows`` full rows, walks
them in chunks with a float32 ``[block_rows, chunk]`` accumulator (one
elementwise add or max per element, a single cross-lane reduction at the
end) and writes one float32 partial per row.

Few long rows (``axis=None`` is the extreme: one row holding everything) would
leave most of the machine idle while a handful of programs walk their rows
serially. So when there are fewer than :data:`SPLIT_BELOW_ROWS` rows wider
than ``2 * SPLIT_WIDTH``, each row is cut into ``S`` segments of a width
that divides it (a free reshape ``[rows, S*C] -> [rows*S, C]``; if the width
has no divisor in ``[SPLIT_WIDTH/8, SPLIT_WIDTH]`` the row is padded with the
reduction's identity to a multiple of ``SPLIT_WIDTH``, a copy), the kernel
writes ``rows * S`` partials, and a tiny jnp reduction over ``S`` finishes.
Every program runs concurrently, which JAX's Pallas Triton requires anyway
(no cross-program accumulation).

Only float dtypes are accepted (float32, bfloat16, float16, with float32
accumulation and the result in x's dtype); integer sums would need integer
accumulators and overflow rules of their own: use ``jnp.sum`` for those.

Backward (``jax.custom_vjp``) is plain elementwise XLA, deliberately: the
gradient of sum is ``g`` broadcast over the reduced axes, of mean
``g / count``, which XLA fuses into whatever consumes it (a kernel would
force the broadcast into memory). max's gradient is ``jnp.max``'s exactly:
``g`` split equally among the entries equal to the maximum, ``where(x == y,
g / count, 0)`` with ``count`` the number of ties, from the residuals x and
the forward result y (the maximum is an element of x, so equality is exact
in x's dtype); XLA fuses the count and the select, reading x twice, as a
two-pass kernel would.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

import pallas_core as pl
from ops import _op
from ops._checks import check_where
from ops._partitioning import (ROW, STAT, explicit_sharding, reduced_axes, reshape, run,
                               with_sharding)
from ops.reduction._rows import (RowLayout, check_axis_op, for_each_chunk, load_chunk,
                                 register_row_op, row_compiler_params, row_example, rows_over_axes,
                                 select_row_layout)

KINDS = ("sum", "mean", "max")
# The pallas_core backends these kernels are written and tested for. pallas_core's
# own "triton" lowering needs power-of-two blocks, which row_layout does not
# pad to for it yet; JAX's Mosaic GPU lowering does not take these kernels
# (array-per-warpgroup programming model).


def sum(x, axis=None, dtype=None, out=None, keepdims=False, initial=None,  # noqa: A001
        where=None, *, implementation: str | None = None,
        max_chunk: int | None = None) -> jax.Array:
    """The sum of x's elements over ``axis``, as ``jnp.sum``, accumulated in float32.

    Args:
      x: float32 / bfloat16 / float16 array.
      axis: None (every axis), an int, or a tuple of ints; negative counts
        from the end. The reduced axes are moved last (a transpose, one copy
        of x, unless they already are the trailing axes).
      dtype: the result's dtype (float32, bfloat16 or float16); None: x's. The
        sum is accumulated in float32 whatever it is and rounded once.
      out: must be None (JAX arrays are immutable), as in ``jnp.sum``.
      keepdims: keep the reduced axes with size 1.
      initial: a scalar added to every sum (``jnp.sum``'s ``initial``).
      where: optional boolean array broadcastable to x's shape: only the elements
        where it is True are summed (x is masked in one elementwise pass before
        the kernel).
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton" (ours),
        "pallas_triton", "mosaic_tpu".
        "mosaic_gpu" raises NotImplementedError (no kernel for it yet). Or a
        sequence of these tried in order (:mod:`ops._implementation`).
      max_chunk: keyword-only tuning/test hook: caps the columns one in-kernel
        loop step covers (a power of two >= 128, passed to
        :func:`~ops.reduction._rows.row_layout`). None: the dtype's default.

    Returns:
      ``dtype`` (default x's), x's shape without ``axis`` (with it as 1s if ``keepdims``).

    Raises:
      TypeError: a non-array, an integer (or other non-float) x or dtype, a
        non-int axis, a non-boolean where.
      ValueError: an axis out of range or repeated (the message names
        ``axis``), ``out`` given, a where that does not broadcast, an unknown
        implementation, a bad max_chunk.

    Differentiable (``jax.custom_vjp``); jit- and vmap-compatible.
    """
    return _reduce(x, axis, "sum", implementation, max_chunk, dtype=dtype, out=out,
                   keepdims=keepdims, initial=initial, where=where)


def mean(x, axis=None, dtype=None, out=None, keepdims=False, *, where=None,
         implementation: str | None = None, max_chunk: int | None = None) -> jax.Array:
    """The mean over ``axis``, as ``jnp.mean``: the float32 sum divided by the
    number of reduced elements (with ``where``, of the selected ones). Arguments,
    result and errors as :func:`sum`; an empty reduction gives NaN, as jnp's."""
    return _reduce(x, axis, "mean", implementation, max_chunk, dtype=dtype, out=out,
                   keepdims=keepdims, where=where)


def max(x, axis=None, out=None, keepdims=False, initial=None, where=None,  # noqa: A001
        *, implementation: str | None = None, max_chunk: int | None = None) -> jax.Array:
    """The maximum over ``axis``, as ``jnp.max``. Arguments, result and errors
    as :func:`sum` (no ``dtype``, as ``jnp.max``); ``initial`` is a lower bound
    on every maximum. The gradient is ``jnp.max``'s: split equally among tied
    maxima (none reaches x where ``initial`` wins).

    Raises:
      ValueError: as :func:`sum`; also a reduction over zero elements without
        ``initial`` (naming ``x`` and ``axis``), and ``where`` without
        ``initial``, as ``jnp.max``.
    """
    return _reduce(x, axis, "max", implementation, max_chunk, out=out, keepdims=keepdims,
                   initial=initial, where=where)


def _reduce(x, axis, kind, implementation, max_chunk, *, dtype=None, out=None,
            keepdims=False, initial=None, where=None):
    axes, impl = check_axis_op(x, axis, kind, implementation, max_chunk)
    out_dtype = _check_extras(x, axes, axis, kind, dtype, out, keepdims, initial, where)
    if where is not None:
        where = jnp.broadcast_to(jnp.asarray(where), x.shape)
        fill = -np.inf if kind == "max" else 0.0
        x = jnp.where(where, x, jnp.asarray(fill, x.dtype))
    core = "sum" if kind == "mean" and where is not None else kind
    # The reduction itself, in float32 when more arithmetic follows, else in out_dtype.
    exact = kind == "mean" and where is not None or initial is not None
    result = _reduce_core(x, axes, core, impl, max_chunk,
                          jnp.dtype(jnp.float32) if exact else out_dtype)
    if core != kind:  # mean over the selected elements only
        count = jnp.sum(where, axis=axes, dtype=jnp.float32)
        result = result / count
    if initial is not None:
        init = jnp.asarray(initial, jnp.float32)
        result = jnp.maximum(result, init) if kind == "max" else result + init
    result = result.astype(out_dtype)
    return jnp.expand_dims(result, axes) if keepdims else result


def _check_extras(x, axes, axis, kind, dtype, out, keepdims, initial, where):
    """The jnp arguments beyond ``axis``; returns the result dtype."""
    if out is not None:
        raise ValueError(f"{kind}: out must be None (JAX arrays are immutable), got "
                         f"{type(out).__name__}.")
    if not isinstance(keepdims, (bool, np.bool_)):
        raise TypeError(f"{kind}: keepdims must be a bool, got {type(keepdims).__name__}.")
    out_dtype = np.dtype(x.dtype) if dtype is None else _float_dtype(dtype, kind)
    if initial is not None and np.ndim(initial) != 0:
        raise ValueError(f"{kind}: initial must be a scalar, got shape {np.shape(initial)}.")
    if where is not None:
        check_where(where, x, kind)
        if kind == "max" and initial is None:
            raise ValueError("max: where needs initial (a lower bound for rows where nothing "
                             "is selected), as jnp.max.")
    if kind == "max" and initial is None and _count(tuple(x.shape), axes) == 0:
        raise ValueError(f"max: x of shape {tuple(x.shape)} has no elements along axis={axis!r}; "
                         "the maximum of zero elements is undefined: pass initial=, as jnp.max "
                         "needs.")
    return out_dtype


def _float_dtype(dtype, kind):
    try:
        d = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"{kind}: dtype must be a float dtype, got {dtype!r}.") from None
    if d not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        raise TypeError(f"{kind}: dtype must be float32, bfloat16 or float16 (the sum is "
                        f"accumulated in float32), got {d.name}; use jnp.{kind} for others.")
    return d


def _reduce_core(x, axes, kind, implementation, max_chunk, out_dtype):
    """sum / mean / max over ``axes`` accumulated in float32, rounded to ``out_dtype``."""
    return _op.get(kind).run(implementation, x=x, axes=axes, kind=kind, max_chunk=max_chunk,
                             out_dtype=out_dtype)


def _reduce_on(impl, x, axes, kind, max_chunk, out_dtype):
    if impl == "xla" or x.size == 0:
        # Empty arrays: nothing to compute; XLA gives jnp's answer.
        return _reference_f32(x, axes, kind).astype(out_dtype)
    config = _Config(kind=kind, axes=axes, shape=tuple(x.shape), backend=impl,
                     max_chunk=max_chunk, x_sharding=explicit_sharding(x),
                     out_dtype=np.dtype(out_dtype), x_dtype=np.dtype(x.dtype))
    return _reduce_vjp(jnp.asarray(x), config)


# --------------------------------------------------------------------------
# XLA reference (also the "xla" implementation)
# --------------------------------------------------------------------------

def reference(x, axis=None, kind: str = "sum"):
    """``jnp.sum`` / ``jnp.mean`` / ``jnp.max`` over ``axis`` in float32, x's dtype out."""
    return _reference_f32(x, axis, kind).astype(x.dtype)


def _reference_f32(x, axis, kind):
    x32 = jnp.asarray(x).astype(jnp.float32)
    if kind == "max":  # empty reductions are rejected (or given initial) before this
        return jnp.max(x32, axis=axis, initial=-jnp.inf)
    return {"sum": jnp.sum, "mean": jnp.mean}[kind](x32, axis=axis)


# --------------------------------------------------------------------------
# Forward kernel: per-row float32 partials
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    kind: str
    axes: tuple[int, ...]
    shape: tuple[int, ...]
    backend: str
    max_chunk: int | None = None
    # x's explicit sharding, if any: the XLA backward's dx must have x's type.
    x_sharding: NamedSharding | None = None
    out_dtype: np.dtype | None = None  # None: x's dtype
    x_dtype: np.dtype | None = None  # dx's dtype (None: the result's)

    @property
    def combine(self) -> str:
        return "max" if self.kind == "max" else "sum"


def _identity(combine: str) -> float:
    return -np.inf if combine == "max" else 0.0


def _reduce_kernel(x_ref, out_ref, *, layout: RowLayout, combine: str):
    fill = _identity(combine)
    op = jnp.maximum if combine == "max" else jnp.add

    def step(c, acc):
        return op(acc, load_chunk(x_ref, layout, c, fill=fill))

    acc = for_each_chunk(layout, step,
                         jnp.full((layout.block_rows, layout.chunk), fill, jnp.float32))
    if combine == "max":
        out_ref[...] = jnp.max(acc, axis=1, keepdims=True)
    else:
        out_ref[...] = jnp.sum(acc, axis=1, keepdims=True)


def _row_partials(x2, config: _Config):
    """``[rows, features]`` -> float32 ``[rows, 1]``: each row's sum or max.

    Multi-device (:mod:`ops._partitioning`): rows stay where they live; a
    sharded feature dim is reduced locally and the per-device results are
    combined by the matching collective (``psum`` / ``pmax``), never gathered.
    """
    def local(x2, *, reduced):
        partial = _local_row_partials(x2, config)
        axes = reduced_axes(reduced, "f")
        if axes:
            partial = lax.pmax(partial, axes) if config.combine == "max" else lax.psum(partial, axes)
        return (partial,)

    return run(config.kind, local, (x2,), (ROW,), (STAT,), reduce=("f",))[0]


def _local_row_partials(x2, config: _Config):
    rows, features = x2.shape
    layout = _layout(rows, features, x2.dtype, config)
    return pl.pallas_call(
        functools.partial(_reduce_kernel, layout=layout, combine=config.combine),
        out_shape=jax.ShapeDtypeStruct((rows, 1), jnp.float32), grid=layout.grid,
        in_specs=[layout.row_spec()], out_specs=layout.stat_spec(),
        compiler_params=row_compiler_params(layout, config.backend),
        backend=config.backend, name=f"reduce_{config.combine}",
        cost_estimate=dict(flops=rows * features, transcendentals=0,
                           bytes_accessed=rows * features * x2.dtype.itemsize + rows * 4))(x2)


def _forward(x, config: _Config):
    view = rows_over_axes(x, config.axes)
    x2 = view.x2
    rows, features = x2.shape
    segments, width, pad = _feature_split(rows, features)
    if pad:
        x2 = jnp.pad(x2, ((0, 0), (0, pad)), constant_values=_identity(config.combine))
    partials = reshape(_row_partials(reshape(x2, (rows * segments, width)), config), (rows, segments))
    if segments == 1:
        total = partials[:, 0]
    elif config.combine == "max":
        total = jnp.max(partials, axis=1)
    else:
        total = jnp.sum(partials, axis=1)
    if config.kind == "mean":
        total = total / np.float32(features)
    return reshape(total.astype(config.out_dtype or x.dtype), view.kept_shape)


# --------------------------------------------------------------------------
# Backward (elementwise XLA, see the module docstring) and custom_vjp wiring
# --------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce_vjp(x, config: _Config):
    return _forward(x, config)


def _reduce_fwd(x, config):
    y = _forward(x, config)
    return y, ((x, y) if config.kind == "max" else None)


def _reduce_bwd(config, residuals, g):
    shape, axes = config.shape, config.axes
    g32 = jnp.expand_dims(g.astype(jnp.float32), axes)
    if config.kind == "max":
        x, y = residuals
        ties = x == jnp.expand_dims(y, axes)
        count = jnp.sum(ties, axis=axes, keepdims=True, dtype=jnp.float32)
        dx = jnp.where(ties, g32 / count, 0.0).astype(x.dtype)
    else:
        if config.kind == "mean":
            g32 = g32 / np.float32(_count(shape, axes))
        dx = jnp.broadcast_to(g32, shape).astype(config.x_dtype or g.dtype)
    return (with_sharding(dx, config.x_sharding),)


_reduce_vjp.defvjp(_reduce_fwd, _reduce_bwd)


def _count(shape, axes) -> int:
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


# --------------------------------------------------------------------------
# Block-size and split heuristics
# --------------------------------------------------------------------------

SPLIT_WIDTH = 8192
SPLIT_BELOW_ROWS = 1024


def _feature_split(rows: int, features: int) -> tuple[int, int, int]:
    """``(segments, width, pad)``: each row is cut into ``segments`` of ``width``
    columns, after padding it by ``pad`` columns.

    No split for many rows (``>= SPLIT_BELOW_ROWS``: already enough programs)
    or short rows (``<= 2 * SPLIT_WIDTH``). Otherwise the widest divisor of
    ``features`` in ``[SPLIT_WIDTH / 8, SPLIT_WIDTH]``, multiples of 128 (the
    TPU lane count, no masked chunk) first; failing both, pad to a multiple
    of ``SPLIT_WIDTH``.
    """
    if rows >= SPLIT_BELOW_ROWS or features <= 2 * SPLIT_WIDTH:
        return 1, features, 0
    low = SPLIT_WIDTH // 8
    for candidates in (range(SPLIT_WIDTH, low - 1, -128), range(SPLIT_WIDTH, low - 1, -1)):
        for width in candidates:
            if features % width == 0:
                return features // width, width, 0
    segments = -(-features // SPLIT_WIDTH)
    return segments, SPLIT_WIDTH, segments * SPLIT_WIDTH - features


def _layout(rows: int, features: int, dtype, config: _Config) -> RowLayout:
    """The shared row layout (:func:`~ops.reduction._rows.select_row_layout`): 8 rows
    per program on TPU, 4 elsewhere; 4096-column chunks for 16-bit dtypes,
    2048 for float32, unless ``max_chunk`` caps them."""
    return select_row_layout(config.kind, rows, features, dtype, config.backend,
                             max_chunk=config.max_chunk)


for _kind, _fn in (("sum", sum), ("mean", mean), ("max", max)):
    register_row_op(_kind, functools.partial(reference, kind=_kind), row_example(_fn),
                    check=check_axis_op, entry=_reduce_on, function=_fn)
