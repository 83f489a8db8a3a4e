"""Memory spaces and scratch shapes shared by the backend modules."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class MemorySpace:
    """A named memory space of one backend (``tpu.VMEM``, ``gpu.SMEM``...).

    Calling it with a shape and dtype gives a :class:`ScratchShape`, as in
    ``pallas_core.tpu.VMEM((128, 64), jnp.float32)``.
    """

    backend: str
    name: str

    def __call__(self, shape, dtype) -> "ScratchShape":
        return ScratchShape(tuple(int(d) for d in shape), np.dtype(dtype), self)

    def __repr__(self):
        return f"{self.backend}.{self.name}"


# The TPU scalar memory: pallas_core.tpu.SMEM, and where scalar-prefetch operands live.
TPU_SMEM = MemorySpace("tpu", "SMEM")


# Backend-neutral spaces, JAX's ``pl.ANY`` (also ``pl.MemorySpace.ANY``): an
# operand in ANY is not blocked; the kernel gets a Ref to the whole array where
# it lies (HBM on a TPU), to copy from with manual DMA (pallas_core.tpu).
ANY = MemorySpace("any", "ANY")
MemorySpace.ANY = ANY


@dataclasses.dataclass(frozen=True)
class ScratchShape:
    """A kernel-private buffer: passed to the kernel after the output Refs."""

    shape: tuple[int, ...]
    dtype: Any
    memory_space: MemorySpace


def as_scratch_shape(s):
    """A ``scratch_shapes`` / ``run_scoped`` entry as a :class:`ScratchShape`.

    Besides ScratchShapes, JAX takes a bare ``pltpu.SemaphoreType.DMA`` (one
    scalar semaphore); anything else is returned as is, for the caller's check.
    """
    to_shape = getattr(s, "scratch_shape", None)
    return to_shape() if callable(to_shape) and not isinstance(s, ScratchShape) else s


def empty(shape, dtype):
    """An array whose contents are unspecified (JAX's ``pl.empty``): NaN for floats,
    the integer minimum for ints, so reading it before writing shows up."""
    return jnp.full(tuple(shape), garbage_fill_value(dtype), dtype)


def empty_like(x):
    """:func:`empty` for every leaf of the pytree ``x`` (objects with ``.shape`` / ``.dtype``)."""
    return jax.tree.map(lambda leaf: empty(leaf.shape, leaf.dtype), x)


def garbage_fill_value(dtype):
    """What the interpreter puts where contents are unspecified.

    NaN for floats (so reading padding or uninitialised memory shows up), the
    minimum for ints, False for bools.
    """
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):  # bfloat16 too, unlike np.issubdtype
        return np.nan
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).min
    return False
