"""A roll along one axis in ``jax.numpy``: what ``pallas_core.tpu.roll`` computes on the
interpreter, and the body of its marker under our Triton lowering
(:mod:`pallas_core.triton.markers`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def rolled(x, shift, axis, stride, stride_axis):
    """``x`` rolled by ``shift`` along ``axis`` (as ``jnp.roll``); with ``stride``, slice
    ``k`` along ``stride_axis`` rolled by ``shift + k * stride``. Arguments already
    checked by :func:`pallas_core.tpu.roll`."""
    amount = jnp.asarray(shift, jnp.int32)
    if stride is not None:
        amount = amount + stride * lax.broadcasted_iota(jnp.int32, x.shape, stride_axis)
    n = x.shape[axis]
    source = jnp.remainder(lax.broadcasted_iota(jnp.int32, x.shape, axis) - amount, n)
    return jnp.take_along_axis(x, source, axis)
