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

import flax.linen as nn
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

    scale_offset: keyword-only, a real number (default 0.0, the stock
    module's behaviour): the multiplier is ``scale + scale_offset``. Gemma's
    norms are ``scale_offset=1.0`` with ``scale_init=nnx.initializers.zeros``
    (so a Gemma checkpoint's weights load unchanged). Needs ``use_scale=True``
    (ValueError at construction otherwise); a non-zero offset runs on the
    kernel path only (NotImplementedError naming the configuration otherwise).

    Fused residual: ``__call__(x, ..., residual=r)`` returns ``(self(x + r),
    x + r)``, the pre-norm decoder's "add the sublayer's output to the
    residual stream, then normalize it". The sum has the dtype
    ``result_type(x, r)``; when the kernel runs in that dtype (e.g. bfloat16
    activations with ``dtype=bfloat16``, or float32 throughout) the add is
    fused into the norm's kernel, forward and backward
    (``ops.rms_norm(..., residual=r)``); otherwise the add runs first and the
    module is called on the sum, with the same results.
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

    def __init__(self, num_features: int, *, implementation: str | None = None,
                 scale_offset: float = 0.0, **kwargs):
        implementation = _check_implementation(implementation, "layers.LayerNorm")
        super().__init__(num_features, **kwargs)
        self.implementation = implementation
        self.scale_offset = _check_scale_offset(scale_offset, self.use_scale, "layers.LayerNorm")

    def __call__(self, x, *, mask=None, residual=None):
        """Normalizes ``x [..., num_features]``; same shape, Flax's output dtype. With
        ``residual``: ``(self(x + residual), x + residual)``."""
        if residual is not None:
            return _call_with_residual(self, x, residual, mask,
                                       lambda h: self(h, mask=mask))
        plan = _nnx_plan(self, x, mask, (self.scale, self.bias))
        if plan is None:
            _refuse_offset_fallback(self, "layers.LayerNorm")
            return super().__call__(x, mask=mask)
        return _run(layer_norm, *plan, **self._kernel_kwargs())

    def _kernel_kwargs(self):
        return dict(epsilon=float(self.epsilon), use_fast_variance=bool(self.use_fast_variance),
                    scale_offset=self.scale_offset, implementation=self.implementation)


class RMSNorm(nnx.RMSNorm):
    """RMS normalization over the last axis, by ``ops.reduction.norms.rms_norm``.

    A drop-in for :class:`flax.nnx.RMSNorm`: every constructor argument and
    default (``epsilon=1e-6``, ``use_scale=True``, ``param_dtype=float32``,
    ``scale_init``, ``reduction_axes=-1``, ``feature_axes=-1``,
    ``use_fast_variance`` (irrelevant without centering), ``promote_dtype``,
    metadata, ...) is nnx.RMSNorm's own, so state and checkpoints load
    unchanged either way. ``__call__(x, mask=None)`` as nnx.RMSNorm.
    """

    def __init__(self, num_features: int, *, implementation: str | None = None,
                 scale_offset: float = 0.0, **kwargs):
        implementation = _check_implementation(implementation, "layers.RMSNorm")
        super().__init__(num_features, **kwargs)
        self.implementation = implementation
        self.scale_offset = _check_scale_offset(scale_offset, self.use_scale, "layers.RMSNorm")

    def __call__(self, x, mask=None, *, residual=None):
        """Normalizes ``x [..., num_features]``; same shape, Flax's output dtype. With
        ``residual``: ``(self(x + residual), x + residual)``."""
        if residual is not None:
            return _call_with_residual(self, x, residual, mask, lambda h: self(h, mask))
        plan = _nnx_plan(self, x, mask, (self.scale,))
        if plan is None:
            _refuse_offset_fallback(self, "layers.RMSNorm")
            return super().__call__(x, mask)
        return _run(rms_norm, *plan, **self._kernel_kwargs())

    def _kernel_kwargs(self):
        return dict(epsilon=float(self.epsilon), scale_offset=self.scale_offset,
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


def _run(op, x, params, compute, out_dtype, *, residual=None, **kwargs):
    """``op(x as compute, *params, **kwargs)`` cast to ``out_dtype`` (:func:`_compute_dtype`).

    With ``residual`` (only when ``compute`` is the sum's dtype, see
    :func:`_call_with_residual`): ``(y cast to out_dtype, x + residual)``.
    """
    if residual is None:
        y = op(jnp.asarray(x).astype(compute), *params, **kwargs)
        return y.astype(out_dtype)
    y, h = op(jnp.asarray(x).astype(compute), *params,
              residual=jnp.asarray(residual).astype(compute), **kwargs)
    return y.astype(out_dtype), h


def _nnx_plan(module, x, mask, variables):
    """``(promoted x, promoted params, compute dtype, output dtype)`` for the kernel
    path of an NNX norm, or None for Flax's own (:func:`_kernel_supports`,
    :func:`_compute_dtype`)."""
    if not _kernel_supports(module, x, mask):
        return None
    params = tuple(v[...] if v is not None else None for v in variables)
    xp, *params = module.promote_dtype((x, *params), dtype=module.dtype)
    out_dtype = nnx_dtypes.canonicalize_dtype(xp, *params, dtype=module.dtype)
    compute = _compute_dtype(xp, params, out_dtype)
    return None if compute is None else (xp, tuple(params), compute, out_dtype)


def _call_with_residual(module, x, residual, mask, call, plan=None):
    """``(module(x + residual), x + residual)``: one fused kernel when the norm's plan
    for the sum (``plan(h-typed x)``, NNX's by default) runs in the sum's own dtype,
    else the add then ``call(h)``."""
    h_dtype = jnp.result_type(x, residual)
    if jnp.shape(x) == jnp.shape(residual):
        xh = jnp.asarray(x).astype(h_dtype)
        plan = (plan or (lambda xh: _nnx_plan(module, xh, mask, _variables(module))))(xh)
        if plan is not None and plan[2] == h_dtype and jnp.result_type(plan[0]) == h_dtype:
            op = layer_norm if isinstance(module, (nnx.LayerNorm, nn.LayerNorm)) else rms_norm
            return _run(op, *plan, residual=jnp.asarray(residual).astype(h_dtype),
                        **module._kernel_kwargs())
    h = jnp.asarray(x) + jnp.asarray(residual)
    return call(h), h


def _variables(module):
    """The parameter variables an NNX norm promotes, in Flax's order."""
    if isinstance(module, nnx.LayerNorm):
        return (module.scale, module.bias)
    return (module.scale,)


def _check_scale_offset(scale_offset, use_scale: bool, where: str) -> float:
    """A real number, non-zero only with a scale (ValueError / TypeError naming it)."""
    if isinstance(scale_offset, bool) or not isinstance(scale_offset, numbers.Real):
        raise TypeError(f"{where}: scale_offset must be a real number, got "
                        f"{type(scale_offset).__name__} {scale_offset!r}.")
    scale_offset = float(scale_offset)
    if scale_offset != 0.0 and not use_scale:
        raise ValueError(f"{where}: scale_offset={scale_offset} needs use_scale=True (it is "
                         "added to the scale).")
    return scale_offset


def _refuse_offset_fallback(module, where: str) -> None:
    """Flax's own path has no offset: a non-zero one there is an error, not a silent 0."""
    if module.scale_offset != 0.0:
        raise NotImplementedError(
            f"{where}: scale_offset={module.scale_offset} runs on the kernel path only (the "
            "last axis as reduction and feature axis, no mask, axis_name and "
            "axis_index_groups None, float32 / bfloat16 / float16 dtypes); this call needs "
            "Flax's own path.")


def _add_keyword_only(cls, parent, name: str, default=None) -> None:
    """Shows ``parent.__init__``'s signature plus ``name=default`` (keyword-only) in help()
    (``cls``'s signature so far, when one was set already)."""
    try:
        base = getattr(cls.__init__, "__signature__", None) or inspect.signature(parent.__init__)
        params = list(base.parameters.values())
        extra = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        first_kw = next((i for i, p in enumerate(params) if p.kind == p.KEYWORD_ONLY), len(params))
        cls.__init__.__signature__ = base.replace(
            parameters=params[:first_kw] + [extra] + params[first_kw:])
    except (TypeError, ValueError):  # an unexpected Flax signature: keep the plain one
        pass


LayerNorm.__doc__ += _COMMON_DOC
RMSNorm.__doc__ += _COMMON_DOC
for _cls, _parent in ((LayerNorm, nnx.LayerNorm), (RMSNorm, nnx.RMSNorm)):
    _add_keyword_only(_cls, _parent, "scale_offset", default=0.0)
    _add_keyword_only(_cls, _parent, "implementation")
