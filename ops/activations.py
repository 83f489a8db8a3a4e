"""Epilogue activations by name, with JAX's meaning of each name."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ops._checks import check_elementwise

_INV_SQRT2 = 0.7071067811865476
_TWO_OVER_SQRT_PI = 1.1283791670955126
# Abramowitz & Stegun, Handbook of Mathematical Functions, formula 7.1.26.
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@jax.custom_jvp
def erf(x):
    """The error function from ``exp`` and arithmetic only: |error| <= 5e-7 in float32.

    Abramowitz & Stegun 7.1.26. Kernels use it because JAX's Pallas Triton
    lowering implements neither ``erf`` nor ``erfc`` (and Mosaic TPU lacks
    ``erfc``). Its derivative is the exact ``2/sqrt(pi) * exp(-x^2)``, not the
    polynomial's. Computed in float32, returned in x's dtype.
    """
    xf = x.astype(jnp.float32)
    a = jnp.abs(xf)
    t = 1.0 / (1.0 + _AS_P * a)
    a1, a2, a3, a4, a5 = _AS_A
    poly = t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5))))
    y = 1.0 - poly * jnp.exp(-a * a)
    return jnp.where(xf < 0, -y, y).astype(x.dtype)


@erf.defjvp
def _erf_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    slope = _TWO_OVER_SQRT_PI * jnp.exp(-jnp.square(x.astype(jnp.float32)))
    return erf(x), (slope * dx.astype(jnp.float32)).astype(x.dtype)


def gelu_exact(x):
    """GELU in its exact (erf) form, ``x * Phi(x)``: ``jax.nn.gelu(x, approximate=False)``.

    Uses :func:`erf` so that every kernel backend lowers it; agrees with
    JAX's erfc form to within 1e-6 in float32.
    """
    return 0.5 * x * (1.0 + erf(x * jnp.asarray(_INV_SQRT2, x.dtype)))


ACTIVATIONS: dict[str, Callable] = {
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "gelu": jax.nn.gelu,  # tanh approximation, JAX's default
    "gelu_exact": gelu_exact,  # erf form, = jax.nn.gelu(approximate=False)
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jax.numpy.tanh,
    "softplus": jax.nn.softplus,
}


def resolve_activation(activation, op: str) -> Callable | None:
    """None, a name from :data:`ACTIVATIONS`, or an elementwise JAX callable.

    Raises:
      ValueError: an unknown name, or a callable that is not elementwise
        (:func:`ops._checks.check_elementwise`).
      TypeError: neither None, a string nor a callable.
    """
    if activation is None:
        return None
    if isinstance(activation, str):
        try:
            return ACTIVATIONS[activation]
        except KeyError:
            raise ValueError(f"{op}: unknown activation {activation!r}; expected None, a "
                             f"callable or one of {sorted(ACTIVATIONS)}.") from None
    if callable(activation):
        check_elementwise(activation, "activation", op)  # ValueError if it mixes elements
        return activation
    raise TypeError(f"{op}: activation must be None, a name or a callable, got "
                    f"{type(activation).__name__}.")
