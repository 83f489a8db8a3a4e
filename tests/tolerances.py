"""Per-dtype tolerances and the comparisons every op test uses.

Errors are measured relative to the reference's largest magnitude, so one
number per dtype works across shapes: float32 kernels differ from the XLA
float32 reference only by summation order; 16-bit outputs carry one rounding
of their 8 (bf16) or 11 (f16) mantissa bits, plus rounded intermediates in
the backward pass.

Against stock Flax the norm layers are held to a count of ulps instead
(``FLAX_NORM_ULPS``, :func:`assert_row_ulps`): the operations are Flax's, so
only the order of the float32 row sums differs (see ops.reduction.norms).
"""
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import max_relative_error  # one definition, shared with the benchmarks

FORWARD = {jnp.float32: 2e-6, jnp.bfloat16: 1.6e-2, jnp.float16: 2e-3}
BACKWARD = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2, jnp.float16: 6e-3}

# The Pallas norm kernels against Flax on rows with |mean| <= std, in ulps of
# each row's largest |output| or |output - bias| (ops.reduction.norms states it):
# float32 6 with the fast variance, 4 with the two-pass one and for RMSNorm.
FLAX_NORM_ULPS = {jnp.float32: 6, jnp.bfloat16: 1, jnp.float16: 1}
FLAX_NORM_ULPS_TWO_PASS_F32 = 4
_MANTISSA_BITS = {jnp.float32: 23, jnp.bfloat16: 7, jnp.float16: 10}


def for_dtype(table, dtype):
    """``table``'s entry for ``dtype`` (keys are jnp scalar types; any spelling of the dtype)."""
    return next(v for d, v in table.items() if jnp.dtype(d) == jnp.dtype(dtype))


def assert_close(actual, expected, tol, what=""):
    assert np.shape(actual) == np.shape(expected), (what, np.shape(actual), np.shape(expected))
    assert np.all(np.isfinite(np.asarray(actual, np.float64))), f"{what}: non-finite values"
    err = max_relative_error(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.3g} > {tol:.3g}"


def row_ulps(actual, expected, bias=None) -> float:
    """The worst row's ``max |actual - expected|`` in ulps (of expected's dtype: float32,
    bfloat16 or float16) of the row's largest ``|expected|`` or ``|expected - bias|``.

    Measuring against the row's largest magnitude rather than each element's
    own ulp keeps an output near zero (``x - mean`` or ``+ bias`` cancelling)
    from counting its tiny ulp; including ``expected - bias`` keeps the unit
    that of the normalized values when the bias dominates a row.
    """
    dtype = next(d for d in _MANTISSA_BITS if jnp.dtype(d) == jnp.dtype(expected.dtype))
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    top = np.abs(e)
    if bias is not None:
        top = np.maximum(top, np.abs(e - np.asarray(bias, np.float64)))
    top = np.max(top, axis=-1, keepdims=True)
    # ulp(t) = 2**(exponent(t) - mantissa bits); frexp's exponent is one more than IEEE's.
    ulp = np.ldexp(1.0, np.frexp(np.maximum(top, np.finfo(np.float32).tiny))[1] - 1
                   - _MANTISSA_BITS[dtype])
    return float(np.max(np.abs(a - e) / ulp)) if a.size else 0.0


def assert_row_ulps(actual, expected, bias=None, what="", *, two_pass=False):
    """Same dtype and shape, and within ``FLAX_NORM_ULPS`` of expected's dtype (row_ulps);
    ``two_pass``: the tighter float32 bound of the two-pass variance and RMSNorm."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bound = next(v for d, v in FLAX_NORM_ULPS.items() if jnp.dtype(d) == jnp.dtype(expected.dtype))
    if two_pass and jnp.dtype(expected.dtype) == jnp.dtype(jnp.float32):
        bound = FLAX_NORM_ULPS_TWO_PASS_F32
    ulps = row_ulps(actual, expected, bias)
    assert ulps <= bound, f"{what}: {ulps:g} ulps of the row maximum > {bound}"
