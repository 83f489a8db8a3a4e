"""Manual DMA and semaphores: ``pltpu.make_async_copy`` / ``async_copy`` / ``sync_copy``,
``pltpu.SemaphoreType`` and ``pl.semaphore_signal`` / ``semaphore_wait`` / ``semaphore_read``.

With an operand in ``pl.ANY`` (left in HBM, not blocked) a TPU kernel copies
what it needs itself: ``make_async_copy(src_ref, dst_ref, sem)`` describes a
copy between two Refs (or views of them, ``x_ref.at[pl.ds(i, 8)]``) of one
shape and dtype; ``.start()`` issues it and ``.wait()`` blocks until it has
landed, counted on the DMA semaphore ``sem``. Semaphores are scratch
(``pltpu.SemaphoreType.DMA((2,))`` in ``scratch_shapes`` or ``run_scoped``);
regular ones are signalled and waited on by the kernel.

Semantics on the interpreter: a copy happens when it is started (so every
later read of ``dst`` sees it, as after a wait on hardware) and adds 1 to its
semaphore; a wait takes 1 away. Semaphores start at 0. A semaphore's value
is a plain int32 there, readable with ``semaphore_read``; waiting on a
semaphore nobody signalled deadlocks on hardware and leaves a negative count
on the interpreter. On ``mosaic_tpu`` every name is JAX's own; other backends
have no DMA engine and raise NotImplementedError.
"""
from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.memory import MemorySpace, ScratchShape
from pallas_core.primitives import _backend
from pallas_core.tpu_ops import jax_tpu_or_none as _native


class SemaphoreType(enum.Enum):
    """Kinds of semaphore; ``SemaphoreType.DMA(shape)`` is a scratch shape of them."""

    REGULAR = "SEMAPHORE"
    DMA = "DMA_SEMAPHORE"
    BARRIER = "BARRIER_SEMAPHORE"

    def __call__(self, shape=()) -> ScratchShape:
        return ScratchShape(tuple(int(d) for d in shape), np.dtype(np.int32),
                            MemorySpace("tpu", self.value))

    def scratch_shape(self) -> ScratchShape:
        """A bare member in ``scratch_shapes`` / ``run_scoped``: one scalar semaphore."""
        return self(())


def is_semaphore(space) -> bool:
    """Whether a scratch memory space holds semaphores (they start at 0)."""
    return isinstance(space, MemorySpace) and space.name.endswith("SEMAPHORE")


def _check_semaphore(sem, what):
    if not hasattr(sem, "shape") or np.dtype(sem.dtype) != np.int32 or sem.shape != ():
        raise TypeError(f"{what}: expected one semaphore (a scalar view such as sems.at[0] of "
                        f"pltpu.SemaphoreType scratch), got {sem!r}.")


class AsyncCopyDescriptor:
    """A copy from ``src_ref`` to ``dst_ref`` counted on ``sem``; see :func:`make_async_copy`."""

    def __init__(self, src_ref, dst_ref, sem):
        self.src_ref, self.dst_ref, self.sem = src_ref, dst_ref, sem

    def start(self, priority: int = 0, *, add: bool = False):
        """Issues the copy (``add=True`` adds ``src`` into ``dst`` instead)."""
        native = _native("AsyncCopyDescriptor.start")
        if native is not None:
            native.make_async_copy(self.src_ref, self.dst_ref, self.sem).start(
                priority=priority, add=add)
            return
        value = self.src_ref[...]
        self.dst_ref[...] = self.dst_ref[...] + value if add else value
        self.sem[...] = self.sem[...] + 1

    def wait(self):
        """Blocks until the copy has landed in ``dst``."""
        native = _native("AsyncCopyDescriptor.wait")
        if native is not None:
            native.make_async_copy(self.src_ref, self.dst_ref, self.sem).wait()
            return
        self.sem[...] = self.sem[...] - 1


def make_async_copy(src_ref, dst_ref, sem) -> AsyncCopyDescriptor:
    """Describes a DMA from ``src_ref`` to ``dst_ref`` counted on the DMA semaphore ``sem``.

    Args:
      src_ref / dst_ref: Refs or views of one shape and dtype.
      sem: one DMA semaphore (``sems.at[k]`` of ``SemaphoreType.DMA((n,))`` scratch,
        or a ``SemaphoreType.DMA(())`` one).

    Raises:
      ValueError: shapes or dtypes that differ.
      TypeError: ``sem`` that is not one semaphore.
      NotImplementedError: on a backend without DMA (triton, mosaic_gpu, pallas_triton).
    """
    _native("make_async_copy")
    if tuple(src_ref.shape) != tuple(dst_ref.shape) or src_ref.dtype != dst_ref.dtype:
        raise ValueError(f"make_async_copy: src_ref ({src_ref.dtype}{list(src_ref.shape)}) and "
                         f"dst_ref ({dst_ref.dtype}{list(dst_ref.shape)}) must have the same "
                         "shape and dtype.")
    if _backend() == "interpret":
        _check_semaphore(sem, "make_async_copy")
    return AsyncCopyDescriptor(src_ref, dst_ref, sem)


def async_copy(src_ref, dst_ref, sem, *, priority: int = 0, add: bool = False):
    """:func:`make_async_copy` and ``start()``; returns the descriptor to ``wait()`` on."""
    copy = make_async_copy(src_ref, dst_ref, sem)
    copy.start(priority=priority, add=add)
    return copy


def sync_copy(src_ref, dst_ref, *, add: bool = False) -> None:
    """Copies (or with ``add``, adds) a pytree of Refs into another, finished on return.

    Raises:
      ValueError: pytrees, shapes or dtypes that differ.
      NotImplementedError: on a backend without DMA.
    """
    native = _native("sync_copy")
    if native is not None:
        native.sync_copy(src_ref, dst_ref, add=add)
        return
    srcs, dsts = jax.tree.leaves(src_ref), jax.tree.leaves(dst_ref)
    if len(srcs) != len(dsts):
        raise ValueError(f"sync_copy: {len(srcs)} source Ref(s) for {len(dsts)} destination(s).")
    for src, dst in zip(srcs, dsts):
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(f"sync_copy: src ({src.dtype}{list(src.shape)}) and dst "
                             f"({dst.dtype}{list(dst.shape)}) must have the same shape and dtype.")
        dst[...] = dst[...] + src[...] if add else src[...]


def semaphore_signal(sem, inc=1, *, device_id=None, device_id_type=None, core_index=None) -> None:
    """Adds ``inc`` to a semaphore (another device's with ``device_id``: mosaic_tpu only).

    Raises:
      NotImplementedError: ``device_id`` / ``core_index`` on the interpreter, which
        runs one device and one core at a time; a backend without semaphores.
    """
    native = _native("semaphore_signal")
    if native is not None:
        from jax.experimental import pallas as jpl
        kw = {} if device_id_type is None else {"device_id_type": device_id_type}
        jpl.semaphore_signal(sem, inc, device_id=device_id, core_index=core_index, **kw)
        return
    if device_id is not None or core_index is not None:
        raise NotImplementedError("semaphore_signal: device_id / core_index (signalling another "
                                  "device or core) is not simulated by the interpret backend.")
    _check_semaphore(sem, "semaphore_signal")
    sem[...] = sem[...] + jnp.asarray(inc, jnp.int32)


def semaphore_wait(sem, value=1, *, decrement: bool = True) -> None:
    """Waits until a semaphore reaches ``value``, then (by default) takes it away."""
    native = _native("semaphore_wait")
    if native is not None:
        from jax.experimental import pallas as jpl
        jpl.semaphore_wait(sem, value, decrement=decrement)
        return
    _check_semaphore(sem, "semaphore_wait")
    if decrement:
        sem[...] = sem[...] - jnp.asarray(value, jnp.int32)


def semaphore_read(sem) -> jax.Array:
    """A semaphore's current value (an int32 scalar)."""
    native = _native("semaphore_read")
    if native is not None:
        from jax.experimental import pallas as jpl
        return jpl.semaphore_read(sem)
    _check_semaphore(sem, "semaphore_read")
    return sem[...]
