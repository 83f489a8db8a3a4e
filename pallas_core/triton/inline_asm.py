"""``pltriton.elementwise_inline_asm``: element-wise GPU assembly (JAX 0.10.2's meaning).

``elementwise_inline_asm(asm, *, args, constraints, pack, result_shape_dtypes)``
runs the PTX snippet ``asm`` on every element of ``args`` (``pack`` elements
per instance), with LLVM inline-assembly ``constraints`` (``"=r,r"``: one
32-bit register out, one in), and returns one array per entry of
``result_shape_dtypes``. It is Triton's ``tl.inline_asm_elementwise``.

Our Triton lowering emits exactly that call: the call travels through the
kernel's jaxpr as a jitted function named ``pallas_core_inline_asm__<k>``,
``k`` indexing :data:`_SNIPPETS`, whose body only gives the results' shapes.
Assembly needs a GPU: Triton's CPU interpreter and the interpret backend
cannot run it, so there the call raises NotImplementedError before anything
launches (``pallas_core.triton.source`` / ``compile`` still show and compile
it for an ``sm_XY`` target from any host). ``pallas_triton`` gets JAX's own.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import context, registry

PREFIX = "pallas_core_inline_asm__"

# (asm, constraints, pack, ((shape, dtype), ...)) of every snippet seen, by marker number.
_SNIPPETS: list[tuple] = []


@functools.lru_cache(maxsize=None)
def _marker(snippet: tuple):
    _SNIPPETS.append(snippet)
    results = snippet[3]

    def body(*args):
        del args  # only the shapes matter: the code writer emits the assembly
        return tuple(jnp.zeros(shape, dtype) for shape, dtype in results)

    body.__name__ = body.__qualname__ = f"{PREFIX}{len(_SNIPPETS) - 1}"
    return jax.jit(body)


def marked(snippet: tuple, args, *, emit: bool) -> list:
    """The rule of ``elementwise_inline_asm`` on our triton backend: a marker call the code
    writer turns into ``tl.inline_asm_elementwise`` (``args`` already broadcast) when the
    kernel is emitted for a GPU (``emit``), else NotImplementedError (Triton's CPU
    interpreter cannot run assembly)."""
    if emit:
        return list(_marker(snippet)(*args))
    raise NotImplementedError(
        "elementwise_inline_asm: Triton's CPU interpreter cannot run GPU assembly; the "
        "kernel runs on a GPU (pallas_core.triton.source / compile show its code here).")


def snippet(name: str) -> tuple:
    """``(asm, constraints, pack, ((shape, dtype), ...))`` of a marker name."""
    return _SNIPPETS[int(name[len(PREFIX):])]


def elementwise_inline_asm(asm: str, *, args, constraints: str, pack: int,
                           result_shape_dtypes) -> list:
    """Element-wise inline assembly; see the module docstring.

    Args:
      asm: the PTX text (``$0`` .. the results, then the arguments).
      args: arrays (or scalars) broadcast to one shape.
      constraints: LLVM constraints, outputs first (``"=r,r,r"``).
      pack: elements of each argument per assembly instance (a positive int).
      result_shape_dtypes: objects with ``.shape`` (the broadcast shape of
        ``args``) and ``.dtype``, one per result.

    Returns:
      A list of arrays, one per result.

    Raises:
      TypeError: non-string ``asm`` / ``constraints``, a bad ``pack``.
      ValueError: no result, or a result shape other than the arguments'.
      NotImplementedError: on the interpret backend or in Triton's CPU
        interpreter (no GPU to run assembly), and outside a kernel.
    """
    if not isinstance(asm, str) or not isinstance(constraints, str):
        raise TypeError("elementwise_inline_asm: asm and constraints must be str.")
    if isinstance(pack, bool) or not isinstance(pack, (int, np.integer)) or pack < 1:
        raise TypeError(f"elementwise_inline_asm: pack must be a positive int, got {pack!r}.")
    args = [jnp.asarray(a) for a in args]
    shape = jnp.broadcast_shapes(*(a.shape for a in args)) if args else ()
    results = tuple((tuple(r.shape), np.dtype(r.dtype)) for r in result_shape_dtypes)
    if not results:
        raise ValueError("elementwise_inline_asm: result_shape_dtypes is empty.")
    for s, _ in results:
        if s != tuple(shape):
            raise ValueError(f"elementwise_inline_asm: result shape {s} differs from the "
                             f"arguments' broadcast shape {tuple(shape)}.")
    backend = context.backend()
    if backend == "pallas_triton":
        from jax.experimental.pallas import triton as pltriton
        return list(pltriton.elementwise_inline_asm(
            asm, args=args, constraints=constraints, pack=int(pack),
            result_shape_dtypes=[jax.ShapeDtypeStruct(s, d) for s, d in results]))
    rule = registry.rule("elementwise_inline_asm", backend)
    if rule is not None:  # our triton backend: pallas_core.triton.backend registers it
        return rule((asm, constraints, int(pack), results), [jnp.broadcast_to(a, shape) for a in args])
    where = f"the {backend!r} backend" if backend else "outside a kernel"
    raise NotImplementedError(f"elementwise_inline_asm: GPU assembly runs on the triton and "
                              f"pallas_triton backends on a GPU, not on {where}.")
