"""``layers.Dense``: a drop-in for ``flax.nnx.Linear`` that runs ``ops.fused_matmul``.

The layer is a subclass of :class:`flax.nnx.Linear` that only changes
``__call__``: parameters are created by ``nnx.Linear.__init__`` itself, so
their names, shapes, dtypes, initial values (for the same ``rngs``) and
metadata are exactly nnx.Linear's, and state saved from one loads into the
other unchanged. The forward pass computes ``activation(x @ kernel + bias)``
in one fused kernel (float32 accumulation; bias and activation applied to the
accumulator before the single store).

The helpers at the bottom of this module are shared with :mod:`layers.linen`.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jax import lax

from ops._implementation import IMPLEMENTATIONS, check_implementation
from ops.activations import resolve_activation
from ops.matmul import fused_matmul

__all__ = ["Dense"]


class Dense(nnx.Linear):
    """``activation(inputs @ kernel + bias)`` over the last axis, by ``ops.fused_matmul``.

    A drop-in replacement for :class:`flax.nnx.Linear`: every constructor
    argument, default, parameter (``kernel`` ``[in_features, out_features]``,
    ``bias`` ``[out_features]`` or None), initializer and metadata is
    nnx.Linear's own (the constructor forwards them unchanged), so
    ``Dense(i, o, rngs=nnx.Rngs(s))`` holds the same state as
    ``nnx.Linear(i, o, rngs=nnx.Rngs(s))``, and ``nnx.update(dense,
    nnx.state(linear))`` or a checkpoint of an nnx.Linear loads as is. With
    ``activation=None`` the output equals nnx.Linear's (up to float rounding).

    Args:
      in_features, out_features, use_bias, dtype, param_dtype, precision,
      kernel_init, bias_init, dot_general, promote_dtype,
      preferred_element_type, rngs, kernel_metadata, bias_metadata:
        exactly as :class:`flax.nnx.Linear`.
      activation: keyword-only. None, a name from ``ops.ACTIVATIONS``
        ("relu", "gelu" = ``jax.nn.gelu`` tanh form, "gelu_exact", "silu",
        "sigmoid", "tanh", ...) or an elementwise JAX callable. It is applied
        to the float32 pre-activation inside the kernel's epilogue.
      implementation: keyword-only. None (best for the platform: "xla" on
        CPU, "pallas_triton" on GPU, "mosaic_tpu" on TPU, resolved at call
        time) or one of ``ops.IMPLEMENTATIONS``; passed to
        ``ops.fused_matmul``.

    Shapes and dtypes:
      ``inputs`` is ``[..., in_features]``; the output is
      ``[..., out_features]``. ``inputs``, ``kernel`` and ``bias`` are first
      promoted exactly as nnx.Linear does (``self.promote_dtype(...,
      dtype=self.dtype)``: the given ``dtype``, else the promoted type of
      inputs and params); the output has that dtype, which is nnx.Linear's
      (it does not cast to ``dtype`` afterwards either). The product is
      accumulated in float32; float32 operands are multiplied at full
      precision (``Precision.HIGHEST``), which on GPU/TPU is more accurate
      than nnx.Linear's default precision.

    Fallback to nnx.Linear's computation: the fused kernel cannot honour a
    custom ``dot_general`` (anything but ``lax.dot_general``), a
    ``precision`` other than None/HIGHEST, a ``preferred_element_type``, an
    ``out_sharding``, a promoted dtype other than float32, bfloat16 and
    float16 (e.g. float64 under x64, complex), or promoted operands of mixed
    dtypes (a custom ``promote_dtype`` that leaves them as they are, such as
    ``lambda args, **kw: args``; ``lax.dot_general`` then picks the output
    dtype). In those cases the layer runs
    ``nnx.Linear.__call__`` unchanged and then applies ``activation``
    (evaluated in at least float32, cast back to the output dtype).

    Raises:
      ValueError: at construction, an unknown ``activation`` name or an
        ``implementation`` not in ``ops.IMPLEMENTATIONS`` (the message names
        the argument).
      TypeError: at construction, an ``activation`` that is neither None, a
        string nor a callable.
      NotImplementedError: at call time, ``implementation="mosaic_gpu"`` (no
        kernel for it yet), from ``ops.fused_matmul``.
      ValueError: at call time, an ``inputs`` last dim other than
        ``in_features`` (from ``ops.fused_matmul``).

    Example::

      >>> layer = Dense(24, 40, activation="gelu", rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 5, 24))).shape
      (2, 5, 40)
    """

    def __init__(self, in_features, out_features, *, activation=None,
                 implementation: str | None = None, **kwargs):
        _check_activation(activation, "layers.Dense")
        implementation = _check_implementation(implementation, "layers.Dense")
        super().__init__(in_features, out_features, **kwargs)
        self.activation = activation
        self.implementation = implementation

    def _fusable(self, out_sharding) -> bool:
        return (out_sharding is None
                and self.dot_general is lax.dot_general
                and self.preferred_element_type is None
                and _precision_is_fusable(self.precision))

    def __call__(self, inputs, out_sharding=None):
        """``activation(inputs @ kernel + bias)``: ``[..., in_features]`` -> ``[..., out_features]``."""
        act = resolve_activation(self.activation, "layers.Dense")
        if not self._fusable(out_sharding):
            return _apply_activation(act, super().__call__(inputs, out_sharding=out_sharding))
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        if not _one_fused_dtype(x, kernel, bias):
            return _apply_activation(act, super().__call__(inputs))
        return fused_matmul(x, kernel, bias, activation=act, implementation=self.implementation)


def _dense_signature():
    """nnx.Linear's signature plus the two keyword-only arguments, for help() and IDEs."""
    base = inspect.signature(nnx.Linear.__init__)
    params = list(base.parameters.values())
    extra = [inspect.Parameter("activation", inspect.Parameter.KEYWORD_ONLY, default=None),
             inspect.Parameter("implementation", inspect.Parameter.KEYWORD_ONLY, default=None)]
    first_kw = next((i for i, p in enumerate(params) if p.kind == p.KEYWORD_ONLY), len(params))
    return base.replace(parameters=params[:first_kw] + extra + params[first_kw:])


try:
    Dense.__init__.__signature__ = _dense_signature()
except (TypeError, ValueError):  # an unexpected Flax signature: keep the plain one
    pass


# --------------------------------------------------------------------------
# Shared with layers.linen
# --------------------------------------------------------------------------

# Dtypes ops.fused_matmul accepts; anything else takes the Flax computation.
_FUSED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _one_fused_dtype(x, *params) -> bool:
    """x and the params (None skipped) share one dtype ``ops.fused_matmul`` accepts."""
    dtype = jnp.dtype(jnp.result_type(x))
    return dtype in _FUSED_DTYPES and all(p is None or jnp.dtype(jnp.result_type(p)) == dtype
                                          for p in params)


def _check_activation(activation, owner: str) -> Callable | None:
    """Resolves ``activation`` so that a bad value fails at construction."""
    try:
        return resolve_activation(activation, owner)
    except ValueError as e:
        raise ValueError(f"{owner}: invalid argument activation={activation!r}: {e}") from None
    except TypeError as e:
        raise TypeError(f"{owner}: invalid argument activation={activation!r}: {e}") from None


def _check_implementation(implementation, owner: str):
    """None, a name in ``ops.IMPLEMENTATIONS`` or a sequence of them (tried in order);
    returns it with a sequence as a tuple (hashable for Flax). None is resolved per call."""
    try:
        return check_implementation(implementation, owner)
    except ValueError:
        raise ValueError(f"{owner}: invalid argument implementation={implementation!r}; expected "
                         f"None, one of {IMPLEMENTATIONS} or a non-empty sequence of them."
                         ) from None


def _as_precision(p):
    try:
        return lax.Precision(p)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _precision_is_fusable(precision) -> bool:
    """None or HIGHEST (alone or as a pair): what the kernel computes anyway.

    The kernel multiplies float32 operands at HIGHEST and 16-bit operands
    exactly, accumulating in float32; an explicitly lower precision or a dot
    algorithm is something it cannot reproduce.
    """
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return len(precision) == 2 and all(
            p is not None and _as_precision(p) == lax.Precision.HIGHEST for p in precision)
    return _as_precision(precision) == lax.Precision.HIGHEST


def _apply_activation(act: Callable | None, y):
    """The activation after Flax's own computation, evaluated in at least float32."""
    if act is None:
        return y
    compute = jnp.promote_types(y.dtype, jnp.float32)
    return act(y.astype(compute)).astype(y.dtype)
