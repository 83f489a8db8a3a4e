"""Per-dtype tolerances and the comparison every op test uses.

Errors are measured relative to the reference's largest magnitude, so one
number per dtype works across shapes: float32 kernels differ from the XLA
float32 reference only by summation order; 16-bit outputs carry one rounding
of their 8 (bf16) or 11 (f16) mantissa bits, plus rounded intermediates in
the backward pass.
"""
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import max_relative_error  # one definition, shared with the benchmarks

FORWARD = {jnp.float32: 2e-6, jnp.bfloat16: 1.6e-2, jnp.float16: 2e-3}
BACKWARD = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2, jnp.float16: 6e-3}


def assert_close(actual, expected, tol, what=""):
    assert np.shape(actual) == np.shape(expected), (what, np.shape(actual), np.shape(expected))
    assert np.all(np.isfinite(np.asarray(actual, np.float64))), f"{what}: non-finite values"
    err = max_relative_error(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.3g} > {tol:.3g}"
