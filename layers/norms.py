"""``layers.LayerNorm`` / ``layers.RMSNorm``: drop-ins for ``flax.nnx.LayerNorm`` / ``RMSNorm``.

Each is a subclass of its Flax parent that only changes ``__call__``:
parameters are created by the parent's ``__init__`` itself, so their names
(``scale``, ``bias``), shapes (``[num_features]``), dtypes, initial values
(for the same ``rngs``) and metadata are exactly Flax's, and state saved from
one loads into the other unchanged. The forward pass runs
``ops.reduction.norms.layer_norm`` / ``rms_norm``: one fused kernel with
float32 statistics, and Pallas backward kernels.

The helpers at the bottom (which configurations the kernels support, and the
signature shown by ``help()``) are shared with :mod:`layers.linen_norms`.
"""
from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable

import jax.numpy as jnp
from flax import nnx

from layers.dense import _FUSED_DTYPES, _check_implementation
from ops.reduction.norms import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]

_COMMON_DOC = """
    Kernel path and fallback: the kernel normalizes over the last axis only.
    It runs when ``reduction_axes`` and ``feature_axes`` both name the last
    axis (the default ``-1``), ``axis_name`` and ``axis_index_groups`` are
    None, no ``mask`` is given, ``epsilon`` is a non-negative number, and the
    promoted dtype (below) is float32, bfloat16 or float16. Any other
    configuration runs the Flax parent's own ``__call__`` unchanged.

    Dtypes: ``x`` and the parameters are promoted exactly as the Flax module
    does (``self.promote_dtype((x, scale, bias), dtype=self.dtype)``: the given
    ``dtype``, else the promoted type of x and the params); the kernel computes
    statistics and the affine transform in float32 and returns the promoted
    dtype, as Flax does.

    Variance: the kernel computes the exact (two-pass-equivalent) biased
    variance whatever ``use_fast_variance`` says. Flax's default fast form
    ``E[x**2] - E[x]**2`` agrees up to float rounding on ordinary activations
    and loses all precision on rows whose mean is large against their spread;
    the kernel's answer is the accurate one in both cases.

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
        _check_implementation(implementation, "layers.LayerNorm")
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, *, mask=None):
        """Normalizes ``x [..., num_features]``; same shape, the promoted dtype."""
        if not _kernel_supports(self, x, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        xp, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        if not _same_fusable_dtype(xp, scale, bias):
            return super().__call__(x, mask=mask)
        return layer_norm(xp, scale, bias, epsilon=float(self.epsilon),
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
        _check_implementation(implementation, "layers.RMSNorm")
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, mask=None):
        """Normalizes ``x [..., num_features]``; same shape, the promoted dtype."""
        if not _kernel_supports(self, x, mask):
            return super().__call__(x, mask)
        scale = self.scale[...] if self.scale is not None else None
        xp, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        if not _same_fusable_dtype(xp, scale):
            return super().__call__(x, mask)
        return rms_norm(xp, scale, epsilon=float(self.epsilon), implementation=self.implementation)


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


def _same_fusable_dtype(x, *params) -> bool:
    """x and the params (None skipped) share one dtype the kernels accept."""
    dtype = jnp.dtype(x.dtype)
    return dtype in _FUSED_DTYPES and all(p is None or jnp.dtype(p.dtype) == dtype for p in params)


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
