"""Softmax cross-entropy with integer labels: ``logsumexp(logits) - logits[label]``.

Same meaning, argument order and output dtype as
``optax.softmax_cross_entropy_with_integer_labels(logits, labels)`` (the class
axis is the last one), computed in float32 inside the kernels.

Forward kernel: the shared row layout (:mod:`ops.reduction._rows`): each
program owns ``block_rows`` full rows of logits and walks them in column
chunks, folding every chunk into an online logsumexp
(:func:`~ops.reduction._rows.online_logsumexp_update`) and picking the label's
logit in the same pass (labels come in as a ``[rows, 1]`` int32 block). Only
one chunk is ever held in float32, never a whole row of the softmax. It writes
the loss and the row's logsumexp as two ``[rows, 1]`` float32 parts, the
maximum ``m`` and ``log(sum(exp(x - m)))``: the residuals the backward pass
needs besides the inputs. Kept apart, they keep large logits accurate: with
logits near 1e4, ``lse`` itself is only known to float32's 1e-3 there, but
``(x - m) - log_s`` and the loss ``(m - x[label]) + log_s`` are exact to
float32 rounding of O(1) numbers.

Backward kernel: ``dlogits = g * (softmax - onehot(label))``, chunk by chunk,
with ``softmax = exp((logits - m) - log_s)`` recomputed from the saved
statistics (one
``exp`` per element, cheaper than storing and re-reading a float32 softmax),
written in logits' dtype.

Labels outside ``[0, V)``: the loss is NaN (optax gives NaN for labels >= V
and silently wraps negative ones, Python-style; we treat every out-of-range
label alike, so a ``-1`` or ``-100`` padding label can never quietly train
towards a real class). The gradient of such a row is ``g * softmax`` (no
label term), what ``jax.grad`` of optax gives for labels >= V. To ignore
padding, pass ``ignore_index`` (e.g. -100, transformers' convention): those
rows give loss 0 and a zero gradient. (By hand, select rather than multiply:
``jnp.where(mask, loss, 0)`` zeroes loss and gradient, ``loss * mask`` keeps
the NaN.) Under ``jax.experimental.checkify.checkify`` an out-of-range label
that is not ``ignore_index`` is a reported error.

LM-loss options (:mod:`ops.reduction.lm_loss` gives their exact meaning):
``logits_soft_cap`` caps every chunk as it is loaded (``cap * tanh(x /
cap)``, forward and backward, the backward multiplying by ``1 - tanh**2``);
``label_smoothing`` makes the forward kernel also sum each row's logits and
the backward subtract ``a / V`` from every class's target; the z-loss needs
only ``lse = m + log_s``, which the forward kernel writes anyway: it is added
outside the kernels, and its cotangent comes back to the backward kernel as a
second per-row input (``dlogits += g_lse * softmax``). Ignoring rows and the
reduction act on the ``[rows]`` losses outside the kernels. With every option
at its default the kernels are the plain ones above.
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
from ops._checks import check_array, check_float_dtype
from ops._implementation import check_implementation
from ops._partitioning import ROW, STAT, reshape, rowwise
from ops.reduction import _rows, lm_loss

_OP = "cross_entropy"

# Backends these kernels are written and tested for. pallas_core's own Triton
# lowering ("triton") is not validated on them yet.


def cross_entropy(logits, labels, *, ignore_index: int | None = None,
                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                  logits_soft_cap: float | None = None, reduction: str = "none",
                  return_z_loss: bool = False, implementation: str | None = None,
                  max_chunk: int | None = None):
    """Per-example softmax cross-entropy: ``logsumexp(logits) - logits[label]``.

    With the defaults, ``optax.softmax_cross_entropy_with_integer_labels``;
    the keyword options make it a language model's loss (their meaning in
    full: :mod:`ops.reduction.lm_loss`).

    Args:
      logits: ``[..., V]`` float32 / bfloat16 / float16 unnormalised log
        probabilities; any number of leading dims.
      labels: integer array of shape ``logits.shape[:-1]``, the class of each
        example in ``[0, V)``. Labels outside that range that are not
        ``ignore_index`` give a NaN loss (see the module docstring).
      ignore_index: None (the default: no label is ignored, as optax), or a
        label value whose rows give loss 0 and zero gradient (-100 in
        transformers and PyTorch); excluded from ``"mean"``'s count.
      label_smoothing: ``a`` in [0, 1]: targets ``(1 - a) * onehot + a / V``
        (``optax.smooth_labels``).
      z_loss: weight ``w >= 0`` of PaLM's auxiliary ``w * logsumexp**2``,
        added to each row's loss.
      logits_soft_cap: None or ``cap > 0``: the loss of ``cap * tanh(logits /
        cap)`` (Gemma 2's final logit cap).
      reduction: ``"none"`` (per-row losses in logits' dtype), ``"sum"`` or
        ``"mean"`` (float32 scalars; the mean over rows not ignored).
      return_z_loss: also return the z-loss term alone (reduced the same way).
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton" (ours),
        "pallas_triton", "mosaic_tpu";
        or a sequence of these tried in order (:mod:`ops._implementation`).
      max_chunk: cap on the column chunk the kernels walk a row in (a power of
        two >= 128); None picks it by dtype. A tuning / test hook.

    Returns:
      ``[...]`` losses in logits' dtype (as optax), computed in float32 and
      rounded once at the end; a float32 scalar for ``"sum"`` / ``"mean"``;
      ``(loss, z_loss)`` with ``return_z_loss``.

    Raises:
      TypeError: non-array inputs, logits not floating point, labels not
        integer, a bad type of option (:func:`ops.reduction.lm_loss.check_options`).
      ValueError: logits a scalar or with an empty class axis, labels' shape
        not ``logits.shape[:-1]``, an option out of range, an unknown
        implementation, a bad max_chunk.

    Differentiable in logits (``jax.custom_vjp`` with a Pallas backward
    kernel); jit- and vmap-compatible. Large logits (``|x|`` up to 1e4 and
    beyond) stay finite: every exponent is taken relative to the row maximum.
    """
    check_array(logits, "logits", _OP)
    check_array(labels, "labels", _OP)
    check_float_dtype(logits, "logits", _OP)
    check_labels(logits.shape[:-1] if logits.ndim else None, labels, "logits", _OP)
    if logits.shape[-1] == 0:
        raise ValueError(f"{_OP}: logits' last dim (the classes) is empty; shape "
                         f"{tuple(logits.shape)}.")
    options = lm_loss.check_options(
        _OP, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        logits_soft_cap=logits_soft_cap, reduction=reduction, return_z_loss=return_z_loss)
    check_implementation(implementation, _OP)
    _rows.check_max_chunk(max_chunk, _OP)
    return _op.get(_OP).run(implementation, logits=logits, labels=labels, max_chunk=max_chunk,
                            options=options)


def _cross_entropy_on(impl, logits, labels, max_chunk, options=lm_loss.LossOptions()):
    """The checked call on one implementation (see :func:`cross_entropy`)."""
    if impl == "xla":
        return lm_loss.reference(logits, labels, options)
    x2, lead = _rows.as_rows(logits)
    labels2 = reshape(labels, (-1, 1)).astype(jnp.int32)
    config = _Config(impl, max_chunk, smoothing=options.label_smoothing,
                     soft_cap=options.logits_soft_cap, lse_grad=options.needs_lse_grad)
    out = _cross_entropy(x2, labels2, config)
    loss, lse = out if config.lse_grad else (out, None)
    loss = reshape(loss, lead)
    lse = reshape(lse, lead) if lse is not None else None
    return lm_loss.finish(loss, lse, labels, logits.shape[-1], options, logits.dtype)


def check_labels(expected_shape, labels, ref_name: str, op: str) -> None:
    """Labels must be integers shaped like ``ref_name``'s leading dims (``expected_shape``)."""
    if expected_shape is None:
        raise ValueError(f"{op}: {ref_name} must have rank >= 1 [..., V], got a scalar.")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{op}: labels has dtype {np.dtype(labels.dtype).name}; expected an "
                        "integer dtype (class indices).")
    if tuple(labels.shape) != tuple(expected_shape):
        raise ValueError(f"{op}: labels must have shape {ref_name}.shape[:-1] = "
                         f"{tuple(expected_shape)}, got {tuple(labels.shape)}.")


# --------------------------------------------------------------------------
# XLA reference (also the "xla" implementation)
# --------------------------------------------------------------------------

def reference(logits, labels, **options):
    """Cross-entropy with XLA in float32; NaN for labels outside ``[0, V)``; logits' dtype.

    Computed as ``(m - x[label]) + log(sum(exp(x - m)))`` with ``m`` the row
    maximum (held constant for autodiff: the value does not depend on it), as
    the kernels do, so large logits lose no accuracy to a rounded logsumexp.
    ``options``: :func:`cross_entropy`'s keyword options (ignore_index,
    label_smoothing, z_loss, logits_soft_cap, reduction, return_z_loss), the
    arithmetic of :func:`ops.reduction.lm_loss.row_losses` and ``finish``.
    """
    return lm_loss.reference(logits, labels, lm_loss.check_options(_OP, **options))


# --------------------------------------------------------------------------
# Forward kernel: online logsumexp + label pick, one pass over the row
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    backend: str
    max_chunk: int | None = None
    smoothing: float = 0.0          # label smoothing a: targets (1 - a) onehot + a / V
    soft_cap: float | None = None   # logits -> cap * tanh(logits / cap)
    lse_grad: bool = False          # lse is an output whose cotangent the backward takes


def _columns(layout: _rows.RowLayout, c, shape):
    """Global column index of every element of chunk ``c``."""
    return c * layout.chunk + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def _valid_labels(labels, features: int):
    return (labels >= 0) & (labels < features)


def _load_logits(logits_ref, layout: _rows.RowLayout, c, config: _Config, *, fill):
    """Chunk ``c`` of the logits as float32, soft-capped when ``config.soft_cap``; padding
    columns ``fill``. Returns ``(z, t)``: ``t = tanh(x / cap)`` for the cap's derivative
    (None without a cap)."""
    if config.soft_cap is None:
        return _rows.load_chunk(logits_ref, layout, c, fill=fill), None
    x = _rows.load_chunk(logits_ref, layout, c, fill=0.0)
    t = jnp.tanh(x / config.soft_cap)
    z = config.soft_cap * t
    mask = _rows.column_mask(layout, c, z.shape)
    return (z if mask is None else jnp.where(mask, z, fill)), t


def _forward_kernel(logits_ref, labels_ref, loss_ref, m_ref, log_s_ref, *,
                    layout: _rows.RowLayout, config: _Config):
    labels = labels_ref[...]                       # [block_rows, 1] int32
    shape = (labels.shape[0], 1)
    smoothing = config.smoothing

    def body(c, carry):
        m, s, picked, *total = carry
        x, _ = _load_logits(logits_ref, layout, c, config, fill=-jnp.inf)
        m, s = _rows.online_logsumexp_update(m, s, x)
        cols = _columns(layout, c, x.shape)
        hit = cols == labels
        picked = picked + jnp.sum(jnp.where(hit, x, 0.0), axis=1, keepdims=True)
        if smoothing:  # the row's sum of logits, for the uniform part of the target
            real = x if not layout.needs_column_mask else jnp.where(cols < layout.features, x, 0.0)
            total = [total[0] + jnp.sum(real, axis=1, keepdims=True)]
        return (m, s, picked, *total)

    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32))
    if smoothing:
        init += (jnp.zeros(shape, jnp.float32),)
    m, s, picked, *total = _rows.for_each_chunk(layout, body, init)
    log_s = jnp.log(s)
    valid = _valid_labels(labels, layout.features)
    if smoothing:  # (1 - a) (m - x[label]) + a (m - mean(x)) + log_s
        loss = ((1.0 - smoothing) * (m - picked) + smoothing * (m - total[0] / layout.features)
                + log_s)
    else:
        loss = (m - picked) + log_s
    loss_ref[...] = jnp.where(valid, loss, jnp.nan)
    m_ref[...] = m
    log_s_ref[...] = log_s


def _forward_call(x2, labels2, config: _Config):
    """Returns float32 ``[rows, 1]`` loss, row max and log-sum-exp-minus-max."""
    layout = _layout(x2, config)
    rows = x2.shape[0]
    stat = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_kernel, layout=layout, config=config),
        out_shape=[stat] * 3, grid=layout.grid,
        in_specs=[layout.row_spec(), layout.stat_spec()],
        out_specs=[layout.stat_spec()] * 3,
        compiler_params=_compiler_params(layout, config.backend, x2.dtype, row_blocks=1),
        backend=config.backend, name="cross_entropy_fwd")(x2, labels2)


# --------------------------------------------------------------------------
# Backward kernel: g * (softmax - onehot), softmax recomputed from the saved stats
# --------------------------------------------------------------------------

def _backward_kernel(logits_ref, labels_ref, m_ref, log_s_ref, g_ref, *refs,
                     layout: _rows.RowLayout, config: _Config):
    g_lse_ref, dlogits_ref = refs if config.lse_grad else (None, *refs)
    labels = labels_ref[...]
    m, log_s = m_ref[...], log_s_ref[...]
    g = g_ref[...]
    smoothing = config.smoothing

    def body(c, carry):
        # Padding columns: fill 0 keeps exp finite; their stores are discarded.
        x, t = _load_logits(logits_ref, layout, c, config, fill=0.0)
        onehot = (_columns(layout, c, x.shape) == labels).astype(jnp.float32)
        if smoothing:
            onehot = (1.0 - smoothing) * onehot + smoothing / layout.features
        p = jnp.exp((x - m) - log_s)
        d = g * (p - onehot)
        if g_lse_ref is not None:  # d lse / d logits = softmax
            d = d + g_lse_ref[...] * p
        if t is not None:          # the soft cap's derivative
            d = d * (1.0 - t * t)
        dlogits_ref[:, _rows.chunk_slice(layout, c)] = d.astype(dlogits_ref.dtype)
        return carry

    _rows.for_each_chunk(layout, body, 0)


def _backward_call(x2, labels2, m, log_s, g, *g_lse, config: _Config):
    """``g_lse``: the cotangent of lse, ``[rows, 1]`` float32, with ``config.lse_grad``."""
    layout = _layout(x2, config)
    return pl.pallas_call(
        functools.partial(_backward_kernel, layout=layout, config=config),
        out_shape=jax.ShapeDtypeStruct(x2.shape, x2.dtype), grid=layout.grid,
        in_specs=[layout.row_spec()] + [layout.stat_spec()] * (4 + len(g_lse)),
        out_specs=layout.row_spec(),
        compiler_params=_compiler_params(layout, config.backend, x2.dtype, row_blocks=2),
        backend=config.backend, name="cross_entropy_bwd")(x2, labels2, m, log_s, g, *g_lse)


# --------------------------------------------------------------------------
# custom_vjp wiring
# --------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy(x2, labels2, config: _Config):
    """Float32 per-row losses ``[rows]``; with ``config.lse_grad``, ``(loss, lse)``."""
    return _cross_entropy_fwd(x2, labels2, config)[0]


def _cross_entropy_fwd(x2, labels2, config):
    loss, m, log_s = _partitioned_forward(x2, labels2, config)
    out = (loss[:, 0], (m + log_s)[:, 0]) if config.lse_grad else loss[:, 0]
    return out, (x2, labels2, m, log_s)


def _cross_entropy_bwd(config, residuals, g):
    x2, labels2, m, log_s = residuals
    gs = g if config.lse_grad else (g,)
    gs = tuple(reshape(c.astype(jnp.float32), (-1, 1)) for c in gs)
    (dlogits,) = rowwise(_OP, lambda *a, reduced: (_backward_call(*a, config=config),),
                         (x2, labels2, m, log_s, *gs), (ROW,) + (STAT,) * (3 + len(gs)), (ROW,),
                         out_like=(0,))
    return dlogits, None  # labels are integers: no cotangent


def _partitioned_forward(x2, labels2, config: _Config):
    """:func:`_forward_call` on each device's rows; a sharded class dim is gathered."""
    return rowwise(_OP, lambda x2, labels2, *, reduced: tuple(_forward_call(x2, labels2, config)),
                   (x2, labels2), (ROW, STAT), (STAT,) * 3)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# --------------------------------------------------------------------------
# Block-size heuristic
# --------------------------------------------------------------------------

def _layout(x2, config: _Config) -> _rows.RowLayout:
    """The shared row layout (:func:`ops.reduction._rows.row_layout`): 4 rows per
    program (8 on TPU, the sublane count), chunks of up to 4096 columns for
    16-bit logits and 2048 for float32 (so a chunk of a few rows in float32 is
    a few hundred KiB at most), ``max_chunk`` overriding the cap."""
    rows, features = x2.shape
    return _rows.select_row_layout(_OP, rows, features, x2.dtype, config.backend,
                                   max_chunk=config.max_chunk)


_DEFAULT_SCOPED_VMEM = 16 << 20  # the smallest default (v5e); v6e and later have 32 MiB
_MAX_VMEM_LIMIT = 48 << 20       # below v7x's 64 MiB per core


def _compiler_params(layout: _rows.RowLayout, backend: str, dtype, *, row_blocks: int):
    """The shared row-kernel params, plus a raised scoped-VMEM limit on TPU when
    ``row_blocks`` double-buffered full-row blocks (the logits, and dlogits in
    the backward pass) would not fit the default: e.g. float32 rows of 128k
    classes take 4 MiB per buffer of 8 rows."""
    if pl.backend_traits(backend).hardware == "tpu":
        block = layout.block_rows * layout.padded_cols * np.dtype(dtype).itemsize
        chunk_temps = 8 * layout.block_rows * layout.chunk * 4  # float32 chunk values in flight
        need = 2 * row_blocks * block + chunk_temps + (2 << 20)
        if need > _DEFAULT_SCOPED_VMEM:
            return pl.tpu.CompilerParams(dimension_semantics=(pl.PARALLEL,),
                                         vmem_limit_bytes=min(need, _MAX_VMEM_LIMIT))
    return _rows.row_compiler_params(layout, backend)


# The tuner fills the cache for 4096 rows of a 128256-class vocabulary (Llama 3's).
_rows.register_row_op(_OP, reference, _rows.row_example(cross_entropy, labels=True),
                      shapes=[(4096, 128256)], order=40, entry=_cross_entropy_on,
                      problem_of=lambda logits, **_: _rows.row_problem_of(logits),
                      function=cross_entropy)
