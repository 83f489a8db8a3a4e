"""How one Mosaic GPU call runs once :func:`pallas_core.gpu.target.choose` has chosen.

Shared by ``pallas_core.gpu.kernel`` and the grid-form ``pallas_call(backend=
"mosaic_gpu")`` (:mod:`pallas_core.backends.jax_pallas`).

A kernel run in the interpret mode is also lowered for ``cuda`` (JAX's Mosaic
GPU lowering, once per kernel and operand shapes) before it runs: JAX's
interpreter does not check what only the lowering checks (TMA boxes against
the array's tiling and swizzle, register layouts, SMEM budget), so a kernel
that runs here but could not compile for the GPU fails here too.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import lax

from pallas_core.gpu import interpret as interpret_mode
from pallas_core.gpu import target


def run(choice: target.Choice, make: Callable, operands: Sequence, owner=None, what: str = "kernel"):
    """Runs ``make(interpret_params)(*operands)`` as ``choice`` says: JAX's lowering
    (``make(None)``), the interpret mode, or (:data:`pallas_core.gpu.target.BOTH`)
    the interpret mode with a ``cuda`` branch lowered as JAX's Mosaic GPU kernel.

    ``owner`` (the kernel's spec, or the resolved call) keys the once-per-shapes
    ``cuda`` lowering check of interpreted runs; ``what`` names the kernel in its error.

    Raises:
      ValueError / TypeError / NotImplementedError: an interpreted kernel that JAX's
        Mosaic GPU lowering refuses (its message, after ``what``).
    """
    if choice.kind == target.MOSAIC:
        return make(None)(*operands)
    interpret_mode.prepare()
    lowered = make(None)
    if owner is not None:
        check_lowers(owner, what, lowered, operands)
    interpreted = make(choice.interpret_params)
    if choice.kind == target.INTERPRET:
        return interpret_mode.run_checked(interpreted, *operands)

    def on_cuda(*ops):
        return _ordered_passthrough(lowered(*ops))

    return interpret_mode.run_checked(
        lambda *ops: lax.platform_dependent(*ops, cuda=on_cuda, default=interpreted), *operands)


_LOWERED: dict[int, tuple] = {}  # id(owner) -> (weakref to owner, operand signatures lowered)


def check_lowers(owner, what: str, lowered: Callable, operands: Sequence) -> None:
    """Lowers ``lowered(*operands)`` for ``cuda`` once per ``owner`` and operand types."""
    leaves, tree = jax.tree.flatten(operands)
    structs = [jax.ShapeDtypeStruct(np.shape(x), jax.typeof(x).dtype) for x in leaves]
    signature = (tree, tuple((s.shape, s.dtype) for s in structs))
    entry = _LOWERED.get(id(owner))
    if entry is None or entry[0]() is not owner:
        key = id(owner)
        entry = _LOWERED[key] = (weakref.ref(owner, lambda _: _LOWERED.pop(key, None)), set())
    if signature in entry[1]:
        return
    try:
        jax.jit(lambda *ops: lowered(*ops)).trace(*jax.tree.unflatten(tree, structs)).lower(
            lowering_platforms=("cuda",))
    except (ValueError, TypeError, NotImplementedError) as e:
        raise type(e)(f"{what} runs in the GPU interpret mode but does not lower for cuda "
                      f"(JAX's Mosaic GPU lowering): {e}") from e
    entry[1].add(signature)


def _ordered_passthrough(outs):
    """``outs`` unchanged, declaring the interpret branch's ordered effect, so that
    ``lax.platform_dependent`` can pair the two branches (only the ``cuda`` branch of
    a call on a host without a GPU gets this; on a GPU there is one branch)."""
    leaves, tree = jax.tree.flatten(outs)
    return jax.tree.unflatten(tree, _passthrough_p().bind(*leaves))


@functools.cache
def _passthrough_p():
    from jax._src import callback, core as jax_core
    from jax._src.interpreters import batching, mlir
    p = jax_core.Primitive("pallas_core_gpu_ordered_passthrough")
    p.multiple_results = True
    p.def_effectful_abstract_eval(lambda *avals: (list(avals), {callback._OrderedIOEffect}))
    p.def_impl(lambda *xs: list(xs))

    def lowering(ctx, *args):
        ctx.set_tokens_out(ctx.tokens_in)
        return list(args)

    mlir.register_lowering(p, lowering)
    batching.primitive_batchers[p] = lambda args, dims: (p.bind(*args), list(dims))
    return p


