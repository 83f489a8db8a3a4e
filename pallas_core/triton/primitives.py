"""The kernel-side names of ``jax.experimental.pallas.triton`` (JAX 0.10.2), ours.

``load`` / ``store`` take a Ref (narrowed with ``.at[...]``) and a mask;
``debug_barrier``, ``max_contiguous`` and ``approx_tanh`` are GPU hints and
instructions. On our ``triton`` backend each becomes its Triton spelling
(``tl.load(..., mask=, other=, cache_modifier=, eviction_policy=,
volatile=)``, ``tl.debug_barrier()``, ``tl.max_contiguous``, the PTX
``tanh.approx.f32`` instruction); on ``pallas_triton`` they are JAX's own;
elsewhere the hints do nothing, the barrier is a no-op (programs run one at a
time) and ``approx_tanh`` is the accurate ``jnp.tanh``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_core import primitives


def load(ref, *, mask=None, other=None, cache_modifier=None, eviction_policy=None, volatile=False):
    """Reads all of ``ref``; where ``mask`` is False the result is ``other`` (or 0).

    Masked-off lanes are never read and may run past the Ref's edge
    (``load(x_ref.at[pl.ds(0, 128)], mask=col < n)`` on an ``n``-wide block).
    ``cache_modifier`` (``".ca"``, ``".cg"``, ``".cv"``), ``eviction_policy``
    (``"evict_first"``, ``"evict_last"``, ``"evict_normal"``) and ``volatile``
    are hints for ``tl.load``: emitted by our triton backend, ignored elsewhere.
    """
    hints = primitives.load_hints(cache_modifier, eviction_policy, volatile)
    return primitives._read(ref, (), mask, other, hints, "load")


def store(ref, val, *, mask=None, eviction_policy=None):
    """Writes ``val`` to all of ``ref`` where ``mask`` holds (everywhere without one).

    Masked-off lanes are never written and may run past the Ref's edge.
    ``eviction_policy`` is a hint, as for :func:`load`.
    """
    hints = primitives.load_hints(None, eviction_policy, False, what="store")
    primitives._write(ref, (), val, mask, hints, "store")


def debug_barrier() -> None:
    """Synchronises the threads of a program (``tl.debug_barrier()``); a no-op where
    a program is not run by many threads (the interpreter)."""
    backend = primitives._backend()
    if backend == "triton":
        from pallas_core.triton import markers
        markers.debug_barrier()
    elif backend == "pallas_triton":
        from jax.experimental.pallas import triton as pltriton
        pltriton.debug_barrier()


def max_contiguous(x, values):
    """A compiler hint: ``x`` (an index array) holds runs of ``values`` consecutive
    integers, one count per dim of ``x`` (an int is used for every dim).

    Returns ``x``. Emitted as ``tl.max_contiguous`` by our triton backend,
    ignored elsewhere. A false hint is undefined behaviour on a GPU.
    """
    if np.ndim(x) == 0:
        raise ValueError("max_contiguous: x must be an array of rank >= 1, got a scalar.")
    values = primitives._hint_values(values, np.ndim(x), "max_contiguous", "x.ndim")
    backend = primitives._backend()
    if backend == "triton":
        from pallas_core.triton import markers
        return markers.hint("max_contiguous", x, values)
    if backend == "pallas_triton":
        from jax.experimental.pallas import triton as pltriton
        return pltriton.max_contiguous(x, values)
    return x


_TANH_DTYPES = ("float16", "bfloat16", "float32", "float64")


def approx_tanh(x):
    """Element-wise hyperbolic tangent, approximate where the hardware has it.

    On a GPU our triton backend uses PTX's ``tanh.approx.f32`` (16-bit floats
    go through float32; float64 gets the accurate tanh, PTX has no approximate
    one). Triton's CPU interpreter cannot run PTX, so there, and on the
    interpret backend, the result is the accurate ``tanh``: closer to the truth
    than a GPU's by up to about 2**-11 relative.

    Raises:
      TypeError: ``x`` is not a float16 / bfloat16 / float32 / float64 array.
    """
    x = jnp.asarray(x)
    if x.dtype.name not in _TANH_DTYPES:
        raise TypeError(f"approx_tanh: x must be a float16, bfloat16, float32 or float64 array, "
                        f"got {x.dtype}.")
    backend = primitives._backend()
    if backend == "triton":
        from pallas_core.triton import markers
        return markers.approx_tanh(x)
    if backend == "pallas_triton":
        from jax.experimental.pallas import triton as pltriton
        return pltriton.approx_tanh(x)
    return jnp.tanh(x)


dot = primitives.dot

__all__ = ["approx_tanh", "debug_barrier", "dot", "load", "max_contiguous", "store"]
