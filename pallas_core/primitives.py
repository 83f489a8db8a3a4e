"""Kernel-side primitives with the names of the Pallas API (seeds 001, 003).

Refs are JAX's own (``jax.Ref``): kernels read with ``ref[idx]``, write with
``ref[idx] = value`` and narrow with ``ref.at[idx]``. What is here adds grid
queries, masked ``load``/``store``, dynamic slices and control flow.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import Slice as _RefSlice  # the indexer jax.Ref understands

from pallas_core import context


def program_id(axis: int) -> jax.Array:
    """Index of the current program along grid ``axis`` (an int32 scalar)."""
    return context.current().program_id(_check_axis(axis))


def num_programs(axis: int) -> Any:
    """Grid size along ``axis``."""
    return context.current().num_programs(_check_axis(axis))


def _check_axis(axis):
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be a static int, got {axis!r}.")
    return axis


def cdiv(a, b):
    """Ceiling division for ints or integer arrays: ``cdiv(500, 128) == 4``."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + b - 1, b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): Triton tile sizes."""
    return 1 << max(0, int(n) - 1).bit_length()


def ds(start, size: int, stride: int = 1):
    """A dynamic slice ``[start, start + size * stride)`` for Ref indexing.

    ``start`` may be traced; ``size`` and ``stride`` are static ints.
    """
    if not isinstance(size, int) or size < 0:
        raise TypeError(f"ds: size must be a static non-negative int, got {size!r}.")
    return _RefSlice(start, size, stride)


dslice = ds


def when(condition):
    """Decorator: run the body only where ``condition`` holds (``lax.cond``).

    A Python bool is resolved at trace time.
    """
    def decorator(body):
        if isinstance(condition, bool):
            if condition:
                body()
            return None
        lax.cond(condition, lambda: (body(), None)[1], lambda: None)
        return None
    return decorator


def loop(lower, upper, *, step: int = 1):
    """Decorator: ``body(i)`` for ``i`` in ``range(lower, upper, step)``, as a loop op.

    Unlike a Python ``for``, the body is traced once (``lax.fori_loop``).
    """
    if not isinstance(step, int) or step == 0:
        raise ValueError(f"loop: step must be a non-zero static int, got {step!r}.")

    def decorator(body):
        trips = cdiv(upper - lower, step) if step > 0 else cdiv(lower - upper, -step)
        if isinstance(trips, int):
            trips = max(trips, 0)
        else:
            trips = jnp.maximum(trips, 0)

        def run(t, carry):
            body(lower + t * step)
            return carry

        lax.fori_loop(0, trips, run, None)
        return None
    return decorator


def load(ref, idx=(), *, mask=None, other=None):
    """Reads ``ref[idx]``; where ``mask`` is False the result is ``other`` (or 0).

    Masked-off elements are not read on backends that can skip them
    (Triton); elsewhere they are read and replaced.
    """
    value = ref[_as_index(idx)]
    if mask is None:
        return value
    fill = jnp.zeros((), value.dtype) if other is None else jnp.asarray(other, value.dtype)
    return jnp.where(mask, value, fill)


def store(ref, idx, value, *, mask=None):
    """Writes ``value`` to ``ref[idx]``; where ``mask`` is False memory is unchanged."""
    idx = _as_index(idx)
    if mask is not None:
        value = jnp.where(mask, value, ref[idx])
    ref[idx] = value


def _as_index(idx):
    if isinstance(idx, list):
        return tuple(idx)
    return idx


def run_scoped(body, *scratch_shapes):
    """Calls ``body(*refs)`` with fresh scratch Refs that live only inside it.

    Args:
      scratch_shapes: e.g. ``pallas_core.tpu.VMEM((8, 128), jnp.float32)``.
    Returns:
      Whatever ``body`` returns.
    """
    return context.current().run_scoped(body, scratch_shapes)
