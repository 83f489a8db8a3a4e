"""``layers.linen.LayerNorm`` / ``RMSNorm``: drop-ins for ``flax.linen.LayerNorm`` / ``RMSNorm``.

Subclasses of the Flax modules with one more dataclass field,
``implementation`` (default None). Parameters are declared under the same
names (``scale``, then ``bias``), shape ``[features]``, initializers and
``param_dtype`` as Flax declares them, so ``init`` with the same key gives
the same variables and Flax's variables apply to these layers unchanged.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes
from jax import lax

from layers.dense import _FUSED_DTYPES, _check_implementation
from layers.norms import _kernel_supports
from ops.reduction.norms import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]

_COMMON_DOC = """
    Kernel path and fallback: the kernel normalizes over the last axis only.
    It runs when ``reduction_axes`` and ``feature_axes`` both name the last
    axis (the default ``-1``), ``axis_name`` and ``axis_index_groups`` are
    None, ``force_float32_reductions`` is True (the default), no ``mask`` is
    given, ``epsilon`` is a non-negative number, and the compute dtype (below)
    is float32, bfloat16 or float16. Any other configuration runs the Flax
    parent's own ``__call__`` unchanged.

    Dtypes: the output dtype is Flax's (``dtype`` if given, else the promoted
    type of x and the params). The kernel runs in the wider of x's dtype and
    the output dtype (statistics and arithmetic in float32 either way), with
    the params cast to it: exact against Flax, except that float32 params
    with 16-bit x and a 16-bit ``dtype`` are rounded to that dtype first (as
    ``flax.nnx`` does for the same configuration), which keeps the fast
    16-bit path fast.

    Variance: the exact (two-pass-equivalent) biased variance, whatever
    ``use_fast_variance`` says (see :class:`layers.LayerNorm`).

    implementation: None (best for the platform, resolved at call time) or a
    name from ``ops.IMPLEMENTATIONS``; validated at construction.
"""


class LayerNorm(nn.LayerNorm):
    """Layer normalization over the last axis, by ``ops.reduction.norms.layer_norm``.

    A drop-in for :class:`flax.linen.LayerNorm`: the same fields and defaults
    (``epsilon=1e-6``, ``use_bias``, ``use_scale``, ``param_dtype``,
    initializers, ``reduction_axes``, ``feature_axes``, ...), the same
    variables ``{'params': {'scale', 'bias'}}``. ``__call__(x, *, mask=None)``.
    """

    implementation: str | None = None

    def __post_init__(self):
        _check_implementation(self.implementation, "layers.linen.LayerNorm")
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, mask=None):
        """Normalizes ``x [..., features]``; same shape, Flax's output dtype."""
        if not _linen_kernel_supports(self, x, mask, self.use_scale, self.use_bias):
            return super().__call__(x, mask=mask)
        scale, bias = _declare_params(self, x, self.use_scale, self.use_bias)
        return _run(layer_norm, self, jnp.asarray(x), scale, bias, center=True)


class RMSNorm(nn.RMSNorm):
    """RMS normalization over the last axis, by ``ops.reduction.norms.rms_norm``.

    A drop-in for :class:`flax.linen.RMSNorm`: the same fields and defaults
    (``epsilon=1e-6``, ``use_scale``, ``param_dtype``, ``scale_init``,
    ``reduction_axes``, ``feature_axes``, ...), the same variables
    ``{'params': {'scale'}}``. ``__call__(x, *, mask=None)``.
    """

    implementation: str | None = None

    def __post_init__(self):
        _check_implementation(self.implementation, "layers.linen.RMSNorm")
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, mask=None):
        """Normalizes ``x [..., features]``; same shape, Flax's output dtype."""
        if not _linen_kernel_supports(self, x, mask, self.use_scale, False):
            return super().__call__(x, mask=mask)
        scale, _ = _declare_params(self, x, self.use_scale, False)
        return _run(rms_norm, self, jnp.asarray(x), scale, None, center=False)


LayerNorm.__doc__ += _COMMON_DOC
RMSNorm.__doc__ += _COMMON_DOC


def _compute_dtype(x_dtype, out_dtype):
    return jnp.dtype(jnp.promote_types(x_dtype, out_dtype))


def _linen_kernel_supports(module, x, mask, use_scale, use_bias) -> bool:
    """Checked before any param is declared (Flax's path declares them itself)."""
    if not module.force_float32_reductions or not _kernel_supports(module, x, mask):
        return False
    x_dtype = jnp.result_type(x)
    params = [jnp.zeros((), module.param_dtype)] * (int(use_scale) + int(use_bias))
    out_dtype = linen_dtypes.canonicalize_dtype(jnp.zeros((), x_dtype), *params, dtype=module.dtype)
    return _compute_dtype(x_dtype, out_dtype) in _FUSED_DTYPES


def _declare_params(module, x, use_scale, use_bias):
    """``scale`` then ``bias``, declared exactly as flax.linen's ``_normalize`` does."""
    feature_shape = [jnp.shape(x)[-1]]
    scale = (module.param("scale", module.scale_init, feature_shape, module.param_dtype)
             if use_scale else None)
    bias = (module.param("bias", module.bias_init, feature_shape, module.param_dtype)
            if use_bias else None)
    return scale, bias


def _run(op, module, x, scale, bias, *, center):
    out_dtype = linen_dtypes.canonicalize_dtype(x, scale, bias, dtype=module.dtype)
    compute = _compute_dtype(x.dtype, out_dtype)
    if compute not in _FUSED_DTYPES:  # params loaded with an unexpected dtype
        return _xla_fallback(x, scale, bias, epsilon=module.epsilon, center=center,
                             out_dtype=out_dtype)
    args = [None if p is None else p.astype(compute) for p in
            ((scale, bias) if center else (scale,))]
    y = op(x.astype(compute), *args, epsilon=float(module.epsilon),
           implementation=module.implementation)
    return y.astype(out_dtype)


def _xla_fallback(x, scale, bias, *, epsilon, center, out_dtype):
    """Flax's arithmetic in at least float32, for dtypes the kernels do not take."""
    dtype = jnp.promote_types(jnp.result_type(*[a for a in (x, scale, bias) if a is not None]),
                              jnp.float32)
    xf = x.astype(dtype)
    if center:
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + epsilon)
    if scale is not None:
        y = y * scale.astype(dtype)
    if bias is not None:
        y = y + bias.astype(dtype)
    return y.astype(out_dtype)
