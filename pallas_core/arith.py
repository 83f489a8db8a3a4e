"""``pl.reciprocal`` and ``pl.align_to`` (JAX 0.10.2's names).

* ``reciprocal(x, *, approx=False, full_range=True)``: ``1 / x``. ``approx`` and
  ``full_range=False`` let a TPU use its fast reciprocal (JAX's own lowering on
  mosaic_tpu / mosaic_gpu / pallas_triton); the interpreter and our Triton
  lowering compute the exact quotient, which is within any approximation's
  error.
* ``align_to(a, alignment)``: ``a`` rounded up to a multiple of ``alignment``,
  for ints (static) or integer arrays (traced).
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_core.primitives import _backend, cdiv


def reciprocal(x, *, approx: bool = False, full_range: bool = True):
    """``1 / x`` of a floating-point array; see the module docstring.

    Raises:
      TypeError: ``x`` that is not floating point, or flags that are not bools.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"reciprocal: x must be a floating-point array, got {x.dtype}.")
    if not isinstance(approx, bool) or not isinstance(full_range, bool):
        raise TypeError(f"reciprocal: approx and full_range must be bools, got {approx!r}, "
                        f"{full_range!r}.")
    if _backend() in ("mosaic_tpu", "mosaic_gpu", "pallas_triton"):
        from jax.experimental import pallas as jpl
        return jpl.reciprocal(x, approx=approx, full_range=full_range)
    return 1 / x


def align_to(a, alignment):
    """``a`` rounded up to the nearest multiple of ``alignment`` (a positive int or array).

    Raises:
      ValueError: a static ``alignment`` that is not positive.
    """
    if isinstance(alignment, int) and alignment <= 0:
        raise ValueError(f"align_to: alignment must be positive, got {alignment}.")
    return cdiv(a, alignment) * alignment
