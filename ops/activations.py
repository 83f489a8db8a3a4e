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
gelu_exact     relu(x) - 2^-m c e^(-r/2) a M(a) (2)    3.6 (2.02)   1.9 .. 40
gelu           x sigmoid(2y), 2y as two floats (3)     1.34         2.7 .. (4)
softplus       relu(x) + 2 atanh(e / (2 + e)) (3)      1.03         2.8
=============  ======================================  ===========  =======

(1) 1.0 with a correctly rounded exp2; Triton's interpreter's float32 exp2 is up
to an ulp off (2.9). The helpers live in :mod:`pallas_core.triton.jit_helpers`:
tanh and exp there; sigmoid (lax.logistic, hence silu) carries exp(-|x|) as a sum
of two floats from a polynomial (no exp2) and corrects the rounding of 1 + e
(Fast2Sum) and of the quotient (its residual by one fused multiply-add): error-free
transformations after Muller et al., "Handbook of Floating-Point Arithmetic", 2nd
ed. (2018), sections 4.3-4.4, so the GPU's approximate division (div.full.f32, 2
ulps) drops out: 0.77 ulps with the quotient 2 ulps off either way.

(2) :func:`gelu_exact` is pure jnp (every backend lowers it): 3.6 ulps in Triton's
interpreter, which rounds every product, 2.02 where products and sums contract into
fused multiply-adds (a GPU, XLA on a CPU); XLA's erfc form (jax.nn.gelu) reaches 40
ulps at [-5.7, -4] and gives 0 below -8.

(3) :func:`gelu` (jax.nn.gelu's tanh form) and :func:`softplus` are the jit helpers
``gelu_tanh`` and ``softplus`` on our Triton lowering (through
:func:`pallas_core.triton.markers.math_helper`), with no exp2 and one rcp.approx; within
1.34 and 1.09 ulps with the GPU's rcp.approx 1 ulp off either way. Elsewhere they are
portable formulas: ``x * sigmoid(2y)`` in float32 (2.1 ulps for x >= 0 on XLA's CPU,
about 2 |2y| more below 0: 27 at [-5, -3]) and jax.nn.softplus's own.

(4) jax.nn.gelu on XLA's CPU: 2.7 ulps for x >= 0, 5.6 at [-1, 0), 41 at [-2, -1),
1050 at [-3, -2) and no correct digit below -3 (``1 + tanh(y)`` cancels).

Not within 2 ulps, and why:

* ``gelu_exact``: 2.02 ulps at worst (3.6 unfused), see :func:`gelu_exact`: the
  denominator ``den`` of its rational is rounded twice at full size; carrying that error
  (Fast2Sum, one more residual term) costs about 6 more instructions per element, past
  the bias+gelu_exact kernel's budget of 3270 SASS instructions (benchmarks/static.py;
  it takes 3256).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ops._checks import check_elementwise
from pallas_core import context, registry

_TWO_OVER_SQRT_PI = 1.1283791670955126
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
# gelu_exact = relu(x) - a Phi(-a), a = |x| (its constants: see _gelu_exact_parts).
# c e^{-r/2} = c_hi + (r W(r) + c_lo), c = 1/sqrt(2 pi) as c_hi + c_lo, for -0.7 <= r <= 0.8
# (W of degree 5; 2**-27.9 of c e^{-r/2}).
_INV_SQRT_2PI_HI, _INV_SQRT_2PI_LO = 0.3989422917366028, -1.1335170135851058e-08
_GAUSS_W = (-0.1994711458683014, 0.04986776039004326, -0.008311179466545582,
            0.0010390832321718335, -0.0001044080636347644, 8.416389391641133e-06)
# 1 / M(a) - a = P(a) / Q(a) for 0 <= a <= 13.2 (M: Mills' ratio), P and Q of degree 4,
# P = k Q + R with k = sqrt(2 / pi) in float32, fitted so that a M(a) = a Q / (a Q + k Q + R)
# is within 2**-25.8 (relative); P(0) / Q(0) is sqrt(2 / pi) within 2**-47 (a float32 pair,
# P(0) = k Q(0) + R(0) exactly), so a M(a) is exact to first order at 0. Among such fits, the
# one with the smallest float32 error as evaluated (tests/test_triton_backend.py's GPU model).
_MILLS_K = 0.7978845834732056
_MILLS_R = (-2.6297612976122764e-08, -0.4215617775917053, -0.25655195116996765,
            -0.07178712636232376, -0.008730298839509487)
_MILLS_Q = (1.1601135730743408, 1.054006576538086, 0.45274385809898376,
            0.10361546277999878, 0.01094345934689045)
# |x| is clamped here: x Phi(x) < 2**-126 (subnormal) beyond, and 2**-m stays a normal float.
_GELU_A_MAX = 13.2
_HALF_LOG2E = 0.7213475108146667  # log2(e) / 2
_SHIFT = 12582912.0  # 1.5 * 2**23
_SHIFT_BITS = 0x4B400000  # its bits
# 2 ln 2 = hi + lo, hi with 17 significant bits: m * hi is exact for m < 128.
_TWO_LN2_HI, _TWO_LN2_LO = 1.38629150390625, 2.857213530660374e-06


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


def _bits(v):
    return jax.lax.bitcast_convert_type(v, jnp.int32)


def _float(v):
    return jax.lax.bitcast_convert_type(v, jnp.float32)


def _gelu_exact_parts(x):
    """``(a, d, phi, inv, q)`` for float32 ``x``: ``a = min(|x|, 13.2)``, ``d = a Phi(-a)``,
    ``phi`` the normal density at a and ``q * inv`` Mills' ratio M(a) = Phi(-a) / phi(a)
    (about 2**-21 relative; the derivative's).

    d = 2**-m c e^{-r/2} y, c = 1/sqrt(2 pi), with the exponent carried beyond float32: ah,
    the 12 leading bits of a (a bit mask), makes ah^2 exact and a^2 = ah^2 + (a - ah)(a + ah);
    m = round(ah^2 log2(e) / 2) and r = a^2 - 2 m ln 2 with ah^2 - m (2 ln 2)_hi exact (Cody &
    Waite), |r| < 0.8; 2**-m from exponent bits (the integer m in the low mantissa bits of
    ah^2 log2(e) / 2 + 1.5 * 2**23, rounded by that sum, read back as an integer). c e^{-r/2}
    = c_hi + (r W(r) + c_lo) and y = a M(a) = a Q / den, den = a Q + (k Q + R) (P = k Q + R,
    k = sqrt(2 / pi): Q's rounding cancels in the quotient at every a), the quotient from
    ``rsqrt(den)^2`` (one MUFU on a GPU, no division's range fix-ups) plus its residual
    times the same reciprocal. The products are ordered so that
    contraction into fused multiply-adds only helps: where it fuses (LLVM on a GPU, XLA on a
    CPU), the residuals ``aq - den y0`` and ``a q - aq`` are exact and d is rounded once, in
    its last FMA; unfused, the residuals carry a rounded product (3.6 ulps instead of 2.02).
    """
    a = jnp.minimum(jnp.abs(x), _GELU_A_MAX)
    ah = _float(_bits(a) & jnp.int32(-4096))
    qh = ah * ah
    # m = round(ah^2 log2(e) / 2) in the low mantissa bits of the sum with 1.5 * 2**23 (the
    # rounding of that sum; m read back from the bits as an integer: XLA's simplifier folds
    # (v + c) - c into v), 2**-m from the same bits.
    shifted = qh * _HALF_LOG2E + _SHIFT
    m = (_bits(shifted) - jnp.int32(_SHIFT_BITS)).astype(jnp.float32)
    r = (a - ah) * (a + ah) + ((qh - m * _TWO_LN2_HI) - m * _TWO_LN2_LO)
    scale = _float(jnp.int32(0x3F800000) - (_bits(shifted) << 23))
    cw = r * _horner(_GAUSS_W, r) + _INV_SQRT_2PI_LO  # c e^{-r/2} - c_hi
    q = _horner(_MILLS_Q, a)
    # den = a Q + P = a Q + (k Q + R): Q's rounding cancels in a Q / den at every a (not
    # only where a Q dominates P), and P's rounding is gone.
    t = _MILLS_K * q + _horner(_MILLS_R, a)
    aq = a * q
    den = a * q + t
    rs = jax.lax.rsqrt(den)
    inv = rs * rs
    y0 = aq * inv
    y_lo = ((aq - den * y0) + (a * q - aq)) * inv
    d = (y0 * _INV_SQRT_2PI_HI + (y0 * cw + y_lo * (_INV_SQRT_2PI_HI + cw))) * scale
    phi = (_INV_SQRT_2PI_HI + cw) * scale
    return a, d, phi, inv, q


@jax.custom_jvp
def gelu_exact(x):
    """GELU in its exact form, ``x * Phi(x)`` (Hendrycks & Gimpel, 2016): ``jax.nn.gelu(x,
    approximate=False)``, which computes it as ``x * erfc(-x / sqrt(2)) / 2``.

    Computed as ``relu(x) - a Phi(-a)``, a = |x| (since x Phi(x) - (-x) Phi(-x) = x), so that
    both signs share one evaluation and neither cancels: ``a Phi(-a) = c e^{-a^2/2} a M(a)``,
    c = 1/sqrt(2 pi), with the exponent carried beyond float32 (a split exactly by a bit
    mask, Cody-Waite reduction, 2**-m from exponent bits, ``e^{-r/2}`` a polynomial: no exp2),
    and ``a M(a) = a Q(a) / (a Q(a) + P(a))``: Mills' ratio M in the form of its continued
    fraction, ``1 / M(a) = a + P / Q`` (P, Q of degree 4, fitted on [0, 13.2], P evaluated as
    ``sqrt(2/pi) Q + R`` so that Q's rounding cancels in the quotient; the erfc
    rationals of W. J. Cody, "Rational Chebyshev approximations for the error function",
    Math. Comp. 23 (1969), are of the same kind), the quotient ``rsqrt(den)^2`` corrected
    by its residual. Arithmetic, a bit mask, integer adds and shifts, one rsqrt and a max:
    every kernel backend lowers it. |x| is clamped at 13.2, where x Phi(x) < 2**-126.

    Accuracy against float64 ``x * ndtr(x)`` over float32 values with normal results
    (others within 2**-126 absolute; tests/test_triton_backend.py), in ulps at [-13.2,
    -5.7], [-5.7, -4], [-4, -2], [-2, -1], [-1, -0.45], [-0.45, 0], [0, 1.25], above:
    where products and sums contract into fused multiply-adds (LLVM on a GPU, modelled in
    float32 numpy with rsqrt 2**-22.9 off either way): 1.95, 1.8, 2.01, 1.97, 1.8, 2.02,
    1.81, 0.64 (two samples of 786k values each); through XLA on a CPU, which contracts
    too: 2.5; unfused (Triton's interpreter, whose numpy rounds every product, so the
    residual corrections carry a rounded product): 3.3, 2.8, 3.2, 3.1, 2.6, 3.6, 2.8, 0.6.
    XLA's erfc form (jax.nn.gelu on a CPU): 1.9 at x >= -1, 12 at [-2, -1], 40 at [-5.7,
    -4], 0 below -8. The error left is mostly the two roundings of the denominator (of
    ``k Q + R`` and of ``a Q + (k Q + R)``); carrying them (Fast2Sum, one more residual
    term) would cost about 6 instructions per element, past the kernel's budget; the
    coefficients are, among fits of equal real-number error (2**-25.8), those with the
    smallest evaluated float32 error, which varies by 0.3 ulps between such fits. On sm_90
    the bias+gelu_exact matmul (128 x 128 tile, 64 elements per thread) takes 3256 SASS
    instructions, within 1.25x the same kernel with libdevice's ``erff``
    (2616; libdevice's ``erfcf``, jax.nn.gelu's form: 3968); benchmarks/static.py.

    Computed in float32, returned in x's dtype. NaN stays NaN, +-0 give +0 (jax.nn.gelu keeps
    -0: the relu's max(x, -0.0) would keep it on XLA, but Triton reads the literal -0.0 as
    0 - 0.0), +inf gives inf and -inf 0 (jax.nn.gelu: NaN). Derivative: ``Phi(x) + x phi(x)``,
    phi(x) = e^{-x^2/2} / sqrt(2 pi) and Phi(-a) = phi(a) M(a) from the same carried exponent
    (accurate into the tails), 0 at -inf and 1 at +inf.
    """
    x = jnp.asarray(x)
    xf = x.astype(jnp.float32)
    _, d, _, _, _ = _gelu_exact_parts(xf)
    return (jnp.maximum(xf, 0.0) - d).astype(x.dtype)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x, dx = jnp.asarray(x), jnp.asarray(dx)
    xf = x.astype(jnp.float32)
    a, d, phi, inv, q = _gelu_exact_parts(xf)
    lower = phi * (q * inv)  # Phi(-a)
    out = jnp.maximum(xf, 0.0) - d
    # Phi(x) + x phi(x), with the clamped a (x phi(x) -> 0 at +-inf, no inf * 0).
    slope = jnp.where(xf < 0, lower - a * phi, (1.0 - lower) + a * phi)
    return out.astype(x.dtype), (slope * dx.astype(jnp.float32)).astype(x.dtype)


# gelu's tanh form: 2 sqrt(2/pi) (x + 0.044715 x^3) = x (K1 + K3 x^2).
_GELU_K1 = 2.0 * math.sqrt(2.0 / math.pi)
_GELU_K3 = _GELU_K1 * 0.044715
# Past these |x| the derivative's second term, x y'(x) (1 - tanh(y)^2) / 2, is below 1e-38:
# x is clamped there so that it never meets 0 * inf.
_GELU_SLOPE_CLAMP = 11.0


def _floating(x, name: str):
    """``x`` as an array of a floating dtype (integers and bools promoted as jax.nn does).

    Raises:
      TypeError: a complex ``x``.
    """
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"{name}: x must be a real array, got {x.dtype}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(x, 1.0))
    return x


def _gelu_formula(x):
    """``x sigmoid(u)``, ``u = 2 sqrt(2/pi) (x + 0.044715 x^3)``, in x's floating dtype: the
    tanh form without the cancellation of ``1 + tanh(u / 2)`` below x = -1. Below x = -40
    sigmoid(u) is 0 even in float64, and x is clamped there so that -inf gives -0, the limit,
    not NaN."""
    return jnp.maximum(x, -40.0) * jax.nn.sigmoid(x * (_GELU_K1 + _GELU_K3 * (x * x)))


def gelu(x, approximate: bool = True):
    """GELU (Hendrycks & Gimpel, "Gaussian Error Linear Units", 2016, section 2):
    ``jax.nn.gelu`` with its arguments, defaults and meaning.

    ``approximate=True`` (the default) is the paper's tanh approximation,
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; ``approximate=False`` is the exact
    ``x Phi(x)`` (:func:`gelu_exact`). The tanh form is computed as the equal
    ``x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``, which does not cancel for x < -1 as
    ``1 + tanh`` does (jax.nn.gelu there: 15 ulps at [-2, -1], no correct digit below -3).

    Accuracy in float32, against float64 of the formula with its constants in float64
    (tests/test_triton_backend.py): on our Triton lowering, :mod:`pallas_core.triton.jit_helpers`'
    ``gelu_tanh`` (the argument carried as a sum of two floats, ``exp`` from a polynomial,
    the quotient corrected; 42 SASS instructions per element on sm_90, one ``rcp.approx``),
    within 1.4 ulps for every x with a normal result (results below 2**-126 within 2**-126),
    in Triton's interpreter and at the GPU's worst ``rcp.approx``. Elsewhere (interpret,
    pallas_triton, mosaic_tpu, XLA outside kernels) the same quotient is ``x * sigmoid(u)``
    in float32 with u rounded: 2.1 ulps for x >= 0 on XLA's CPU, about ``2 |u|`` more below
    0 (27 at [-5, -3]), against jax.nn.gelu's 41 at [-2, -1) and no correct digit below -3.

    Args:
      x: an array; 16-bit floats are computed in float32 (jax.nn.gelu computes in x's
        dtype), float64 in float64, integers promoted to a float as jax.nn.gelu does.
      approximate: the tanh form (True) or the exact erf form (False).

    Returns:
      gelu(x) in x's (floating) dtype and shape. NaN stays NaN, +inf gives inf, signed zeros
      keep their sign; -inf gives -0 (the limit) on the portable path and about -1e-38 (the
      limit within a subnormal) on our Triton lowering, where jax.nn.gelu gives NaN.
      The derivative (a custom JVP) is jax.grad(jax.nn.gelu)'s formula (the tanh form's),
      finite everywhere (1 at +inf, 0 at -inf; jax.nn.gelu's is NaN at +-inf).

    Raises:
      TypeError: a complex x.
    """
    x = _floating(x, "gelu")
    return _gelu_tanh(x) if approximate else gelu_exact(x)


def _by_helper(helper: str, formula, x):
    """``formula(x)`` computed in float32 (float64 in float64) and returned in x's dtype;
    on our Triton lowering, the jit helper ``_<helper>`` of
    :mod:`pallas_core.triton.jit_helpers` instead (through
    :func:`pallas_core.triton.markers.math_helper`)."""
    z = _wide(x)
    # A lowering with jit helpers (they take float32) registers this rule.
    rule = registry.rule("math_helper", context.backend()) if z.dtype == jnp.float32 else None
    return (formula(z) if rule is None else rule(helper, formula, z)).astype(x.dtype)


def _wide(x):
    """x in the dtype its activation is computed in: float64 stays, others go to float32."""
    return x if x.dtype == jnp.float64 else x.astype(jnp.float32)


@jax.custom_jvp
def _gelu_tanh(x):
    return _by_helper("gelu_tanh", _gelu_formula, x)


@_gelu_tanh.defjvp
def _gelu_tanh_jvp(primals, tangents):
    """jax.grad(jax.nn.gelu)'s formula, ``(1 + t) / 2 + x y'(x) (1 - t)(1 + t) / 2`` with
    ``t = tanh(y)``, ``y = sqrt(2/pi) (x + 0.044715 x^3)`` (a tanh is half a sigmoid's cost
    on our Triton lowering), x clamped in the second term so that it is 0, not NaN, where
    ``1 - t^2`` is 0. The tangent is scaled first, as JAX's autodiff of the formula does:
    in fused_matmul's gradient kernel on the 128 x 256 tile the other order spills."""
    (x,), (dx,) = primals, tangents
    x, dx = jnp.asarray(x), jnp.asarray(dx)
    z = _wide(x)
    t = jnp.tanh(z * (0.5 * _GELU_K1 + 0.5 * _GELU_K3 * (z * z)))
    c = jnp.clip(z, -_GELU_SLOPE_CLAMP, _GELU_SLOPE_CLAMP)
    half = 0.5 * dx.astype(z.dtype)
    dy = c * (0.5 * _GELU_K1 + 1.5 * _GELU_K3 * (c * c))
    tangent = half * (1.0 + t) + (half * dy) * ((1.0 - t) * (1.0 + t))
    return _gelu_tanh(x), tangent.astype(x.dtype)


def softplus(x):
    """Softplus, ``log(1 + e^x)`` (Dugas et al., "Incorporating Second-Order Functional
    Knowledge for Better Option Pricing", NIPS 2000): ``jax.nn.softplus`` (which computes
    ``jnp.logaddexp(x, 0)``) with its argument and meaning.

    Accuracy in float32 against float64 ``log1p(exp(x))`` (tests/test_triton_backend.py):
    on our Triton lowering, :mod:`pallas_core.triton.jit_helpers`' ``softplus``
    (``max(x, 0) + 2 atanh(e / (2 + e))``, ``e = exp(-|x|)`` carried as two floats from a
    polynomial as the sigmoid helper does, the quotient corrected; 45 SASS instructions per
    element on sm_90, one ``rcp.approx``), within 1.2 ulps for every x with a normal result
    (results below 2**-126 within 2**-126), in Triton's interpreter and at the GPU's worst
    ``rcp.approx``; jax.nn.softplus lowered there (the exp and log1p helpers) is 4.2 ulps
    off. Elsewhere (interpret, pallas_triton, mosaic_tpu, XLA outside kernels) it is
    jax.nn.softplus's formula (XLA's CPU: 2.8 ulps).

    Args:
      x: an array; 16-bit floats are computed in float32 (jax.nn.softplus computes in x's
        dtype), float64 in float64, integers promoted to a float as jax.nn.softplus does.

    Returns:
      softplus(x) in x's (floating) dtype and shape: ln 2 at +-0, 0 below x = -87.5 and at
      -inf, inf at +inf, NaN for NaN. The derivative (a custom JVP) is
      ``jax.nn.sigmoid(x)``, as jax.grad(jax.nn.softplus).

    Raises:
      TypeError: a complex x.
    """
    return _softplus(_floating(x, "softplus"))


def _softplus_formula(x):
    return jnp.logaddexp(x, 0.0)


@jax.custom_jvp
def _softplus(x):
    return _by_helper("softplus", _softplus_formula, x)


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x, dx = jnp.asarray(x), jnp.asarray(dx)
    z = _wide(x)
    return _softplus(x), (jax.nn.sigmoid(z) * dx.astype(z.dtype)).astype(x.dtype)


ACTIVATIONS: dict[str, Callable] = {
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "gelu": gelu,  # tanh approximation, JAX's default (= jax.nn.gelu(x))
    "gelu_exact": gelu_exact,  # erf (Phi) form, = jax.nn.gelu(approximate=False)
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jax.numpy.tanh,
    "softplus": softplus,  # = jax.nn.softplus
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
