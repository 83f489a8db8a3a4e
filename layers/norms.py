"""``layers.LayerNorm`` / ``layers.RMSNorm``: drop-ins for ``flax.nnx.LayerNorm`` / ``RMSNorm``.

Each is a subclass of its Flax parent that only changes ``__call__``:
parameters are created by the parent's ``__init__`` itself, so their names
(``scale``, ``bias``), shapes (``[num_features]``), dtypes, initial values
(for the same ``rngs``) and metadata are exactly Flax's, and state saved from
one loads into the other unchanged. The forward pass runs
``ops.reduction.norms.layer_norm`` / ``rms_norm``: one fused kernel with
float32 statistics, and Pallas backward kernels.

The helpers at the bottom (which configurations the kernels support, the
dtype plan, and the signature shown by ``help()``) are shared with
:mod:`layers.linen_norms`.
"""
from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from layers.dense import _FUSED_DTYPES, _check_implementation
from ops.reduction.norms import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]

_COMMON_DOC = """
    Kernel path and fallback: the kernel normalizes over the last axis only.
    It runs when ``reduction_axes`` and ``feature_axes`` both name the last
    axis (the default ``-1``), ``axis_name`` and ``axis_index_groups`` are
    None, no ``mask`` is given, ``epsilon`` is a non-negative number, and x
    and the params, once promoted (below), are float32, bfloat16 or float16,
    as is the wider of x's and the output dtype. Any other configuration runs
    the Flax parent's own ``__call__`` unchanged (so a ``mask`` gives Flax's
    result bit for bit).

    Dtypes: exactly the Flax module's. ``x`` and the parameters go through
    ``self.promote_dtype((x, scale, bias), dtype=self.dtype)`` (a custom
    ``promote_dtype`` included, which may leave their dtypes mixed); the
    output dtype is Flax's ``canonicalize_dtype(x, scale, bias,
    dtype=self.dtype)`` of the promoted values (``dtype`` if given, else
    their promoted type). The kernel reads everything as float32, computes the
    statistics and the affine transform in float32 as Flax does, and writes
    the wider of x's and the output dtype, cast to the output dtype if that
    is narrower: the result is rounded once, as Flax's.

    Variance: ``use_fast_variance`` is honoured as Flax honours it: True (the
    Flax default) computes ``max(0, E[x**2] - E[x]**2)``, False the two-pass
    ``E[(x - E[x])**2]`` (RMSNorm has no mean: ``E[x**2]`` either way).

    Bit equality with the Flax module: with ``implementation="xla"`` (what
    None picks on CPU) the computation is Flax's operation for operation and
    the outputs are bit-identical to the Flax module's (both eager or both
    under ``jit``). The Pallas kernels (``"interpret"`` on CPU) perform the
    same operations in the same order, but add each row's sums in another
    order than XLA does: they are bit-identical to Flax under ``jit`` where
    the float32 sums are exact, and otherwise, on rows whose ``|mean|`` is at
    most their standard deviation, within 6 float32 ulps (4 with the two-pass
    variance and for RMSNorm) of the row's largest ``|y|`` or ``|y - bias|``,
    and within one ulp for 16-bit outputs; :mod:`ops.reduction.norms` gives
    the measurement and the exceptions. With ``use_fast_variance=True``,
    rows whose variance is below the rounding error of ``E[x]**2`` (constant
    rows, for one) get a variance that is rounding noise in Flax and here
    alike, and the two noises need not agree.

    implementation: keyword-only. None (best for the platform: "xla" on CPU,
    "pallas_triton" on GPU, "mosaic_tpu" on TPU, resolved at call time) or a
    name from ``ops.IMPLEMENTATIONS``; validated at construction (ValueError
    naming the argument).
"""


class LayerNorm(nnx.LayerNorm):
    """Layer normalization over the last axis, by ``ops.reduction.norms.layer_norm``.

    A drop-in for :class:`flax.nnx.LayerNorm`: every constructor argument and
    default (``epsilon=1e-6``, ``use_bias=True``, ``use_scale=True``,
    ``param_dtype=float32``, initializers, ``reduction_axes=-1``,
    ``feature_axes=-1``, ``use_fast_variance``, ``promote_dtype``, metadata,
    ...) is nnx.LayerNorm's own, so ``LayerNorm(n, rngs=nnx.Rngs(s))`` holds the
    same state as ``nnx.LayerNorm(n, rngs=nnx.Rngs(s))`` and either's state
    loads into the other. ``__call__(x, *, mask=None)`` as nnx.LayerNorm.
    """

    def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
        implementation = _check_implementation(implementation, "layers.LayerNorm")
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, *, mask=None):
        """Normalizes ``x [..., num_features]``; same shape, Flax's output dtype."""
        if not _kernel_supports(self, x, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        xp, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        out_dtype = nnx_dtypes.canonicalize_dtype(xp, scale, bias, dtype=self.dtype)
        compute = _compute_dtype(xp, (scale, bias), out_dtype)
        if compute is None:
            return super().__call__(x, mask=mask)
        return _run(layer_norm, xp, (scale, bias), compute, out_dtype,
                    epsilon=float(self.epsilon), use_fast_variance=bool(self.use_fast_variance),
                    implementation=self.implementation)


class RMSNorm(nnx.RMSNorm):
    """RMS normalization over the last axis, by ``ops.reduction.norms.rms_norm``.

    A drop-in for :class:`flax.nnx.RMSNorm`: every constructor argument and
    default (``epsilon=1e-6``, ``use_scale=True``, ``param_dtype=float32``,
    ``scale_init``, ``reduction_axes=-1``, ``feature_axes=-1``,
    ``use_fast_variance`` (irrelevant without centering), ``promote_dtype``,
    metadata, ...) is nnx.RMSNorm's own, so state and checkpoints load
    unchanged either way. ``__call__(x, mask=None)`` as nnx.RMSNorm.
    """

    def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
        implementation = _check_implementation(implementation, "layers.RMSNorm")
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, mask=None):
        """Normalizes ``x [..., num_features]``; same shape, Flax's output dtype."""
        if not _kernel_supports(self, x, mask):
            return super().__call__(x, mask)
        scale = self.scale[...] if self.scale is not None else None
        xp, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        out_dtype = nnx_dtypes.canonicalize_dtype(xp, scale, dtype=self.dtype)
        compute = _compute_dtype(xp, (scale,), out_dtype)
        if compute is None:
            return super().__call__(x, mask)
        return _run(rms_norm, xp, (scale,), compute, out_dtype, epsilon=float(self.epsilon),
                    implementation=self.implementation)


# --------------------------------------------------------------------------
# Shared with layers.linen_norms
# --------------------------------------------------------------------------

def _last_axis_only(axes, ndim: int) -> bool:
    """Whether ``axes`` (an int or ints, possibly negative) is exactly ``{ndim - 1}``."""
    if not isinstance(axes, Iterable):
        axes = (axes,)
    try:
        canonical = {int(a) + ndim if int(a) < 0 else int(a) for a in axes}
    except (TypeError, ValueError):
        return False
    return canonical == {ndim - 1}


def _static_epsilon_ok(epsilon) -> bool:
    return (isinstance(epsilon, numbers.Real) and not isinstance(epsilon, bool)
            and float(epsilon) >= 0.0)


def _kernel_supports(module, x, mask) -> bool:
    """The configuration checks that do not depend on dtypes (see the class docstrings)."""
    ndim = jnp.ndim(x)
    return (mask is None and ndim >= 1
            and module.axis_name is None and module.axis_index_groups is None
            and _last_axis_only(module.reduction_axes, ndim)
            and _last_axis_only(module.feature_axes, ndim)
            and _static_epsilon_ok(module.epsilon))


def _compute_dtype(x, params, out_dtype):
    """The dtype the kernel runs in (x is cast to it), or None when the kernel cannot run.

    ``x`` and ``params`` (None skipped) are arrays or dtypes. The kernel takes
    x and params of any dtype in ``_FUSED_DTYPES`` (params need not match x:
    all are read as float32) and writes x's dtype; running it in the wider of
    x's and the output dtype keeps the one rounding to the output dtype that
    Flax makes (a float32 result then cast, or the 16-bit result directly).
    """
    dtype = lambda a: jnp.dtype(jnp.result_type(a))  # JAX's view: float64 is float32 without x64
    compute = jnp.dtype(jnp.promote_types(dtype(x), out_dtype))
    fusable = [compute, dtype(x), *(dtype(p) for p in params if p is not None)]
    return compute if all(d in _FUSED_DTYPES for d in fusable) else None


def _run(op, x, params, compute, out_dtype, **kwargs):
    """``op(x as compute, *params, **kwargs)`` cast to ``out_dtype`` (:func:`_compute_dtype`)."""
    y = op(jnp.asarray(x).astype(compute), *params, **kwargs)
    return y.astype(out_dtype)


def _add_keyword_only(cls, parent, name: str) -> None:
    """Shows ``parent.__init__``'s signature plus ``name=None`` (keyword-only) in help()."""
    try:
        base = inspect.signature(parent.__init__)
        params = list(base.parameters.values())
        extra = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        first_kw = next((i for i, p in enumerate(params) if p.kind == p.KEYWORD_ONLY), len(params))
        cls.__init__.__signature__ = base.replace(
            parameters=params[:first_kw] + [extra] + params[first_kw:])
    except (TypeError, ValueError):  # an unexpected Flax signature: keep the plain one
        pass


LayerNorm.__doc__ += _COMMON_DOC
RMSNorm.__doc__ += _COMMON_DOC
_add_keyword_only(LayerNorm, nnx.LayerNorm, "implementation")
_add_keyword_only(RMSNorm, nnx.RMSNorm, "implementation")
