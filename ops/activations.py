"""Epilogue activations by name, with JAX's meaning of each name.

Accuracy in float32, against float64 references (max ulps of the float64 value,
over results that are normal floats; results below 2**-126 are checked in absolute
terms, at most 2**-126, since a GPU flushes them), measured in Triton's interpreter
on our Triton lowering over random float32 bit patterns plus dense uniform samples
where the errors peak (tests/test_triton_backend.py), beside XLA's CPU functions:

=============  ======================================  ===========  =======
name           how our Triton lowering computes it     ours (ulps)  XLA CPU
=============  ======================================  ===========  =======
tanh           polynomial below 1.2, 1 - 2/(e^2x + 1)  1.5          4.6
exp            Cody-Waite reduction, then exp2 (1)     1.0 (2.9)    5.0
sigmoid        carried exp, corrected sum/quotient     0.65         2.2
silu           x * sigmoid(x)                          1.5          2.6
erf            polynomial, 1 - exp2(polynomial)        1.3          4.9
gelu_exact     x Phi(x), x >= 0                        1.7          1.5
gelu_exact     x < 0: see :func:`gelu_exact`           1.7 .. 42    1.8 .. 75
gelu           jax.nn.gelu: 0.5 x (1 + tanh(y))        1.9 at x>=0  2.5
softplus       jax.nn.softplus: log1p(exp(-|x|)) + ..  4.2          2.8
=============  ======================================  ===========  =======

(1) 1.0 with a correctly rounded exp2; Triton's interpreter's float32 exp2 is up
to an ulp off (2.9). The helpers live in :mod:`pallas_core.triton.jit_helpers`:
tanh and exp there; sigmoid (lax.logistic, hence silu) carries exp(-|x|) as a sum
of two floats from a polynomial (no exp2) and corrects the rounding of 1 + e
(Fast2Sum) and of the quotient (its residual by one fused multiply-add): error-free
transformations after Muller et al., "Handbook of Floating-Point Arithmetic", 2nd
ed. (2018), sections 4.3-4.4, so the GPU's approximate division (div.full.f32, 2
ulps) drops out: 0.77 ulps with the quotient 2 ulps off either way.

Not within 2 ulps, and why:

* ``gelu`` (jax.nn.gelu's tanh form) for x < -1: ``1 + tanh(y)`` cancels (ours
  15 ulps at [-2, -1], 200 at [-3, -2], no correct digit below -3; XLA alike). The
  equal ``x * sigmoid(2 y)`` avoids the cancellation, but the float32 rounding of
  ``y ~ 0.8 x (1 + 0.045 x^2)`` alone costs |2y| * 2**-23 relative (13 ulps at
  x = -3): 2 ulps need y as a double-float.
* ``gelu_exact`` for x < -0.45 (:func:`gelu_exact`), where the exponent -x^2/2
  must be carried beyond float32, and the remaining factor ``x Phi(x) e^{x^2/2}``,
  which varies over [0.16, 0.4] on [-13.2, -0.45] with a ``1/x^2`` asymptote
  (rational of degree 5/5, or polynomials in ``1/x^2`` on three pieces), evaluated
  to 2**-25 relative: float32 Horner alone leaves 2**-22 there.
* ``softplus``: composed of the exp and log1p helpers (other kernels use them too).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ops._checks import check_elementwise

_TWO_OVER_SQRT_PI = 1.1283791670955126
_INV_SQRT_2PI = 0.3989422804014327
# Polynomial coefficients, lowest degree first: least-squares fits (reweighted
# towards minimax) of float64 references, each coefficient rounded to float32 in
# turn with the rest refitted, in the usual two-range structure (Hart et al., "Computer
# Approximations", 1968): an odd polynomial near 0, exp2 of a polynomial in the tail
# (exp2: one ex2.approx on a GPU, no argument reduction, the fitted argument being bounded).
# erf(x) = x + x * R(x^2) for |x| < 0.88 (relative fit).
_ERF_SMALL = (0.12837915122509003, -0.3761250972747803, 0.11282000690698624,
              -0.02677370421588421, 0.005004049278795719, -0.0006048360373824835)
# erfc(t) = exp2(Q(t)) for 0.88 <= t <= 4 (absolute fit of log2 erfc); erf(t) rounds to 1 above 3.92.
_LOG_ERFC = (0.00042461566044948995, -1.6304353475570679, -0.9117761254310608,
             -0.15858890116214752, 0.0379943810403347, -0.006824439391493797,
             0.0008522412390448153, -6.543526251334697e-05, 2.3120348942029523e-06)
# Phi(x) = 1/2 + x * G(x^2) for -0.45 < x < 1.25 (relative fit of Phi - 1/2).
_PHI_SMALL = (0.3989422917366028, -0.06649082899093628, 0.009976522997021675,
              -0.001194541691802442, 0.0001233417569892481, -1.3357615898712538e-05,
              1.3124691804478061e-06)
# Phi(-a) = exp2(H(a)) for 0.45 <= a <= 5.7 (absolute fit of log2 Phi(-a)); below
# x = -5.7, Phi(x) < 6e-9 is taken as 0.
_LOG_PHI_TAIL = (-0.9999366998672485, -1.1515239477157593, -0.45808082818984985,
                 -0.054117750376462936, 0.008433880284428596, -0.0008363584638573229,
                 2.4319551812368445e-05, 5.513349606189877e-06, -7.297581419152266e-07,
                 2.9123075506731766e-08)
_PHI_TAIL_END = 5.7


def _horner(coefs, x):
    p = jnp.full_like(x, coefs[-1])
    for c in coefs[-2::-1]:
        p = p * x + c
    return p


@jax.custom_jvp
def erf(x):
    """The error function from ``exp2``, arithmetic and selects; float32 result within 2 ulps.

    ``|x| < 0.88``: ``x + x R(x^2)`` (R of degree 5); above: ``1 - exp2(Q(|x|))``
    with Q of degree 8 fitted to ``log2 erfc`` on [0.88, 4] (the argument is clamped
    at 4, where erf rounds to 1). Against float64 over the whole float32 range
    (sampled): 1.2 ulps with a correctly rounded exp2, 1.7 with exp2 2 ulps off either
    way (the GPU's ``exp2f`` bound), 1.3 in Triton's interpreter and on XLA's CPU
    (tests/test_triton_backend.py). One exp2, no division: libdevice's ``erff`` cost.
    Kernels use it because JAX's Pallas Triton lowering implements neither ``erf``
    nor ``erfc`` (and Mosaic TPU lacks ``erfc``). Its derivative is the exact
    ``2/sqrt(pi) * exp(-x^2)``, not the polynomials'. Computed in float32, returned
    in x's dtype; NaN stays NaN, ``erf(+-inf) = +-1``, signed zeros keep their sign.
    """
    x = jnp.asarray(x)
    z = x.astype(jnp.float32)
    t = jnp.abs(z)
    small = z + z * _horner(_ERF_SMALL, z * z)
    big = 1.0 - jnp.exp2(_horner(_LOG_ERFC, jnp.minimum(t, 4.0)))
    y = jnp.where(t < 0.88, small, jnp.where(z < 0, -big, big))
    return y.astype(x.dtype)


@erf.defjvp
def _erf_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x, dx = jnp.asarray(x), jnp.asarray(dx)
    slope = _TWO_OVER_SQRT_PI * jnp.exp(-jnp.square(x.astype(jnp.float32)))
    return erf(x), (slope * dx.astype(jnp.float32)).astype(x.dtype)


def _normal_cdf(x):
    """Phi(x) of float32 ``x``, evaluated in x itself (no rounded ``x / sqrt(2)``, whose
    relative error would grow to ``x^2 * 2**-24`` of the tail's)."""
    a = jnp.abs(x)
    small = 0.5 + x * _horner(_PHI_SMALL, x * x)
    tail = jnp.exp2(_horner(_LOG_PHI_TAIL, jnp.minimum(a, _PHI_TAIL_END)))  # Phi(-|x|)
    lower = jnp.where(x < -_PHI_TAIL_END, 0.0, tail)
    return jnp.where(x <= -0.45, lower, jnp.where(x >= 1.25, 1.0 - tail, small))


@jax.custom_jvp
def gelu_exact(x):
    """GELU in its exact form, ``x * Phi(x)`` (Hendrycks & Gimpel, 2016): ``jax.nn.gelu(x,
    approximate=False)``, which computes it as ``x * erfc(-x / sqrt(2)) / 2``.

    Phi from exp2, arithmetic and selects, so that every kernel backend lowers it
    (one exp2, no division): ``1/2 + x G(x^2)`` for -0.45 < x < 1.25, ``exp2(H(|x|))``
    below (the lower tail without cancellation), ``1 - exp2(H(x))`` above, 0 below
    x = -5.7 (absolute error < 4e-8 there). Against float64 over sampled float32
    values, with a correctly rounded exp2 (and with exp2 2 ulps off either way):
    within 1.8 ulps for x >= 0; for x < 0 the error grows with ``|log Phi(x)|`` (the
    float32 rounding of H): 3.3 (5.2) ulps at x >= -0.5, 10 (12) at x >= -2, 46 (49)
    near -5.6, where XLA's erfc form (jax.nn.gelu on a CPU) measures 1.9, 12 and 41.
    In Triton's interpreter, ours / XLA's: 1.7 / 1.8 ulps on [-0.45, 0), 4.9 / 3.8 on
    [-1, -0.45), 9.7 / 12 on [-2, -1), 21 / 19 on [-4, -2), 42 / 39 on [-5.7, -4);
    below -5.7 ours is 0 (XLA's: 75 ulps to -8, then 0), though results stay normal
    floats down to x = -13.15. Two ulps there need the exponent carried in two parts
    (x split exactly, Cody-Waite reduction, 2**-k from exponent bits) and the factor
    ``x Phi(x) e^{x^2/2}`` to 2**-25 relative (module docstring): about 18 more
    instructions per element than this form, past the bias+gelu_exact kernel's budget
    (1.25x the same kernel with libdevice's erff; benchmarks/static.py).
    Computed in float32, returned in x's dtype. Derivative: ``Phi(x) + x phi(x)`` with
    ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)``.
    """
    x = jnp.asarray(x)
    xf = x.astype(jnp.float32)
    return (xf * _normal_cdf(xf)).astype(x.dtype)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x, dx = jnp.asarray(x), jnp.asarray(dx)
    xf = x.astype(jnp.float32)
    cdf = _normal_cdf(xf)
    slope = cdf + xf * (_INV_SQRT_2PI * jnp.exp(-0.5 * xf * xf))
    return (xf * cdf).astype(x.dtype), (slope * dx.astype(jnp.float32)).astype(x.dtype)


ACTIVATIONS: dict[str, Callable] = {
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "gelu": jax.nn.gelu,  # tanh approximation, JAX's default
    "gelu_exact": gelu_exact,  # erf (Phi) form, = jax.nn.gelu(approximate=False)
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
