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

from layers.dense import _check_implementation
from layers.norms import (_call_with_residual, _check_scale_offset, _compute_dtype, _kernel_supports,
                          _refuse_offset_fallback, _run)
from ops.reduction.norms import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]

_COMMON_DOC = """
    Kernel path and fallback: the kernel normalizes over the last axis only.
    It runs when ``reduction_axes`` and ``feature_axes`` both name the last
    axis (the default ``-1``), ``axis_name`` and ``axis_index_groups`` are
    None, ``force_float32_reductions`` is True (the default), no ``mask`` is
    given, ``epsilon`` is a non-negative number, and x, the params (their
    ``param_dtype``, or the dtype of the variables applied) and the wider of
    x's and the output dtype are float32, bfloat16 or float16. Any other
    configuration runs the Flax parent's own ``__call__`` unchanged (so a
    ``mask`` gives Flax's result bit for bit).

    Dtypes: exactly Flax's. Linen does not promote: x and the params enter
    as they are (their dtypes may differ; the kernel reads all of them as
    float32, as Flax computes them in float32), and the output dtype is
    Flax's ``canonicalize_dtype(x, scale, bias, dtype=self.dtype)``
    (``dtype`` if given, else the promoted type of x and the params). The
    kernel writes the wider of x's and the output dtype, cast to the output
    dtype if that is narrower, so the result is rounded once, as Flax's.

    Variance: ``use_fast_variance`` is honoured as in :class:`layers.LayerNorm`
    (True, the Flax default: ``max(0, E[x**2] - E[x]**2)``; False: two-pass).
    Bit equality with Flax: as :class:`layers.LayerNorm` states (identical
    with ``implementation="xla"``; the Pallas kernels identical under ``jit``
    where the float32 sums are exact, else within 6 float32 ulps of the
    row's largest ``|y|`` or ``|y - bias|``, or one 16-bit ulp, on rows with
    ``|mean| <= std``).

    implementation: None (best for the platform, resolved at call time) or a
    name from ``ops.IMPLEMENTATIONS``; validated at construction.

    scale_offset and the fused residual (``__call__(x, residual=r)`` returns
    ``(self(x + r), x + r)``): as in :class:`layers.RMSNorm` (Gemma's norms:
    ``scale_offset=1.0, scale_init=nn.initializers.zeros``).
"""


class LayerNorm(nn.LayerNorm):
    """Layer normalization over the last axis, by ``ops.reduction.norms.layer_norm``.

    A drop-in for :class:`flax.linen.LayerNorm`: the same fields and defaults
    (``epsilon=1e-6``, ``use_bias``, ``use_scale``, ``param_dtype``,
    initializers, ``reduction_axes``, ``feature_axes``, ...), the same
    variables ``{'params': {'scale', 'bias'}}``. ``__call__(x, *, mask=None)``.
    """

    implementation: str | None = None
    scale_offset: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "implementation",  # a sequence as a tuple: hashable
                           _check_implementation(self.implementation, "layers.linen.LayerNorm"))
        object.__setattr__(self, "scale_offset", _check_scale_offset(
            self.scale_offset, self.use_scale, "layers.linen.LayerNorm"))
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, mask=None, residual=None):
        """Normalizes ``x [..., features]``; same shape, Flax's output dtype. With
        ``residual``: ``(self(x + residual), x + residual)``."""
        if residual is not None:
            return _linen_residual(self, x, residual, mask, (self.use_scale, self.use_bias),
                                   lambda h: self._normalize(h, mask))
        return self._normalize(x, mask)

    def _normalize(self, x, mask):
        plan = _linen_plan(self, x, mask, self.use_scale, self.use_bias)
        if plan is None:
            _refuse_offset_fallback(self, "layers.linen.LayerNorm")
            return super().__call__(x, mask=mask)
        scale, bias = _declare_params(self, x, self.use_scale, self.use_bias)
        return _run(layer_norm, x, (scale, bias), *plan, **self._kernel_kwargs())

    def _kernel_kwargs(self):
        return dict(epsilon=float(self.epsilon), use_fast_variance=bool(self.use_fast_variance),
                    scale_offset=self.scale_offset, implementation=self.implementation)


class RMSNorm(nn.RMSNorm):
    """RMS normalization over the last axis, by ``ops.reduction.norms.rms_norm``.

    A drop-in for :class:`flax.linen.RMSNorm`: the same fields and defaults
    (``epsilon=1e-6``, ``use_scale``, ``param_dtype``, ``scale_init``,
    ``reduction_axes``, ``feature_axes``, ...), the same variables
    ``{'params': {'scale'}}``. ``__call__(x, *, mask=None)``.
    """

    implementation: str | None = None
    scale_offset: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "implementation",  # a sequence as a tuple: hashable
                           _check_implementation(self.implementation, "layers.linen.RMSNorm"))
        object.__setattr__(self, "scale_offset", _check_scale_offset(
            self.scale_offset, self.use_scale, "layers.linen.RMSNorm"))
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, mask=None, residual=None):
        """Normalizes ``x [..., features]``; same shape, Flax's output dtype. With
        ``residual``: ``(self(x + residual), x + residual)``."""
        if residual is not None:
            return _linen_residual(self, x, residual, mask, (self.use_scale, False),
                                   lambda h: self._normalize(h, mask))
        return self._normalize(x, mask)

    def _normalize(self, x, mask):
        plan = _linen_plan(self, x, mask, self.use_scale, False)
        if plan is None:
            _refuse_offset_fallback(self, "layers.linen.RMSNorm")
            return super().__call__(x, mask=mask)
        scale, _ = _declare_params(self, x, self.use_scale, False)
        return _run(rms_norm, x, (scale,), *plan, **self._kernel_kwargs())

    def _kernel_kwargs(self):
        return dict(epsilon=float(self.epsilon), scale_offset=self.scale_offset,
                    implementation=self.implementation)


LayerNorm.__doc__ += _COMMON_DOC
RMSNorm.__doc__ += _COMMON_DOC


def _param_dtype(module, name: str):
    """The dtype ``name`` will have once declared: that of the variable applied, if any."""
    if module.has_variable("params", name):
        return jnp.result_type(module.get_variable("params", name))
    return jnp.dtype(module.param_dtype)


def _linen_plan(module, x, mask, use_scale, use_bias):
    """``(compute dtype, output dtype)`` for the kernel path, or None for Flax's own.

    Decided before any param is declared (Flax's path declares them itself),
    from the dtypes the params will have.
    """
    if not module.force_float32_reductions or not _kernel_supports(module, x, mask):
        return None
    names = [n for n, used in (("scale", use_scale), ("bias", use_bias)) if used]
    params = [jnp.zeros((), _param_dtype(module, n)) for n in names]
    out_dtype = linen_dtypes.canonicalize_dtype(x, *params, dtype=module.dtype)
    compute = _compute_dtype(x, params, out_dtype)
    return None if compute is None else (compute, out_dtype)


def _linen_residual(module, x, residual, mask, uses, call):
    """:func:`layers.norms._call_with_residual` with the Linen plan: params are
    declared only on the path taken (the fused one declares them here)."""
    def plan(xh):
        p = _linen_plan(module, xh, mask, *uses)
        if p is None or p[0] != xh.dtype:  # not fusable: declare nothing here
            return None
        params = _declare_params(module, xh, *uses)
        return (xh, params[:1] if not uses[1] else params, *p)
    return _call_with_residual(module, x, residual, mask, call, plan=plan)


def _declare_params(module, x, use_scale, use_bias):
    """``scale`` then ``bias``, declared exactly as flax.linen's ``_normalize`` does."""
    feature_shape = [jnp.shape(x)[-1]]
    scale = (module.param("scale", module.scale_init, feature_shape, module.param_dtype)
             if use_scale else None)
    bias = (module.param("bias", module.bias_init, feature_shape, module.param_dtype)
            if use_bias else None)
    return scale, bias
