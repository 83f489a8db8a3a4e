"""Scalar prefetch: ``pallas_core.tpu.PrefetchScalarGridSpec`` (JAX 0.10.2's meaning).

With ``num_scalar_prefetch = n`` the first ``n`` operands of the call are
small integer arrays (page tables, expert ids, sequence lengths) that every
grid point can read before its blocks are chosen:

* each index map is called as ``index_map(*program_ids, *scalar_refs)``, so a
  block can be picked by data (``lambda i, pages: (pages[i], 0)``);
* the kernel is called as ``kernel(*scalar_refs, *in_refs, *out_refs,
  *scratch_refs)``: the scalars are whole arrays (in SMEM on a TPU);
* ``in_specs`` describe the operands after the scalars only, and
  ``input_output_aliases`` count every operand, the scalars included;
* as in JAX, a scalar-prefetch operand may be None (the kernel and the index
  maps receive None in its place) or a pytree of arrays (they receive that
  pytree; megablox passes its group metadata as a tuple).

Paged attention and mixture-of-experts kernels are built on it. Every backend
but ``mosaic_tpu`` runs it as an ordinary ``pallas_call`` whose first ``n``
operands are whole-array SMEM blocks (:attr:`ResolvedCall.num_scalar_prefetch`
says how many) and whose index maps close over the scalar arrays:

* the interpreter evaluates index maps as traced values, so index maps that
  read data are checked for bounds like any other when the scalars are
  concrete;
* our Triton lowering passes the scalar arrays as pointer arguments and
  writes each index map into the kernel with the scalar arrays seen as Refs
  over those pointers (:func:`pallas_core.context.scalar_refs`), so ``pages[i]`` is a scalar
  ``tl.load``; the kernel's scalar Refs are the same pointers.

An output index map that reads the scalars cannot be analysed before the call
runs (under ``jit``), so the grid axes then default to ``"arbitrary"`` unless
``dimension_semantics`` says otherwise. On ``mosaic_tpu`` the resolved call
goes to JAX's own ``PrefetchScalarGridSpec``: the scalar operands are
prefetched and each index map is called with JAX's scalar Refs in their place
(:func:`pallas_core.context.scalar_refs`). The Mosaic GPU and pallas_triton lowerings refuse it
(NotImplementedError), as JAX's do.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import backends
from pallas_core.context import prefetched_scalar_refs
from pallas_core.memory import TPU_SMEM
from pallas_core.specs import BlockSpec, _check_arity, is_no_block_spec, normalize_grid


@dataclasses.dataclass(frozen=True)
class PrefetchScalarGridSpec:
    """A ``GridSpec`` whose first ``num_scalar_prefetch`` operands are prefetched scalars.

    Args:
      num_scalar_prefetch: how many leading operands are scalar-prefetch arrays
        (a non-negative int).
      grid, in_specs, out_specs, scratch_shapes: as for ``pallas_call``;
        ``in_specs`` cover the operands after the scalars, and every index map
        takes ``len(grid) + num_scalar_prefetch`` arguments.

    Raises:
      TypeError: ``num_scalar_prefetch`` that is not a non-negative int.
    """

    num_scalar_prefetch: int
    grid: Any = ()
    in_specs: Any = None
    out_specs: Any = None
    scratch_shapes: Sequence[Any] = ()

    def __post_init__(self):
        n = self.num_scalar_prefetch
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise TypeError("PrefetchScalarGridSpec: num_scalar_prefetch must be a non-negative "
                            f"int, got {n!r}.")
        object.__setattr__(self, "scratch_shapes", tuple(self.scratch_shapes or ()))


def _is_spec_leaf(x) -> bool:
    return is_no_block_spec(x) or isinstance(x, BlockSpec)


def _with_refs(scalars, refs):
    """``scalars`` (operands, each None or a pytree of arrays) with their arrays
    replaced, in order, by ``refs``."""
    leaves, tree = jax.tree.flatten(list(scalars), is_leaf=lambda x: x is None)
    refs = iter(refs)
    return jax.tree.unflatten(tree, [None if x is None else next(refs) for x in leaves])


def _bind_scalars(spec, origin, grid_rank, scalars):
    """``spec`` with an index map of the program ids only (the scalars closed over)."""
    if is_no_block_spec(spec) or spec.index_map is None:
        return None if is_no_block_spec(spec) else spec
    index_map = spec.index_map
    _check_arity(index_map, origin, grid_rank + len(scalars))

    def bound(*ids):
        override = prefetched_scalar_refs()
        return index_map(*ids, *(scalars if override is None else _with_refs(scalars, override)))

    bound.__name__ = getattr(index_map, "__name__", "index_map")
    return BlockSpec(spec.block_shape, bound, indexing_mode=spec.indexing_mode,
                     memory_space=spec.memory_space, pipeline_mode=spec.pipeline_mode)


def _bind_tree(specs, what, grid_rank, scalars):
    if isinstance(specs, BlockSpec):
        return _bind_scalars(specs, what, grid_rank, scalars)
    return jax.tree.map(lambda s: _bind_scalars(s, what, grid_rank, scalars), specs,
                        is_leaf=_is_spec_leaf)


def _whole(args, specs):
    """``specs`` as a sequence of one entry per operand in ``args`` (None: whole arrays)."""
    if is_no_block_spec(specs):
        return [jax.tree.map(lambda _: None, a, is_leaf=lambda x: x is None) for a in args]
    if isinstance(specs, BlockSpec):
        return [specs]
    if not isinstance(specs, (list, tuple)):
        raise TypeError("in_specs: expected a sequence of BlockSpecs, one per operand after the "
                        f"scalar-prefetch operands, got {type(specs).__name__}.")
    return list(specs)


def _scalars(args, n):
    """The first ``n`` operands, checked to be integer arrays (or None, or pytrees of
    integer arrays)."""
    if len(args) < n:
        raise ValueError(f"pallas_call: PrefetchScalarGridSpec(num_scalar_prefetch={n}) "
                         f"needs at least {n} operand(s), got {len(args)}.")
    scalars = [jax.tree.map(jnp.asarray, s) for s in args[:n]]
    for k, s in enumerate(scalars):
        for leaf in jax.tree.leaves(s):
            if not jnp.issubdtype(leaf.dtype, jnp.integer):
                raise TypeError(f"pallas_call: scalar-prefetch operand {k} must be an integer "
                                f"array, got {leaf.dtype}.")
    return scalars


def prefetching_call(build_call, kernel, out_shape, grid_spec: PrefetchScalarGridSpec, *,
                     grid, in_specs, out_specs, scratch_shapes, backend, interpret, **kwargs):
    """``pallas_call`` with a :class:`PrefetchScalarGridSpec`; see the module docstring.

    ``build_call`` is :func:`pallas_core.call.build_call`.

    Raises:
      ValueError: grid/in_specs/out_specs/scratch_shapes given besides the grid
        spec, or fewer operands than scalars.
      TypeError: a scalar-prefetch operand that is not an integer array.
      NotImplementedError: a backend other than interpret, triton and mosaic_tpu.
    """
    if grid not in ((), None) or in_specs is not None or out_specs is not None or scratch_shapes:
        raise ValueError("pallas_call: give either grid_spec or grid/in_specs/"
                         "out_specs/scratch_shapes, not both.")
    chosen = backends.choose(backend, interpret)
    if not backends.backend_traits(chosen).scalar_prefetch:
        takers = tuple(n for n in backends.BACKENDS if backends.backend_traits(n).scalar_prefetch)
        raise NotImplementedError(
            f"PrefetchScalarGridSpec: scalar prefetch is implemented on {takers}, "
            f"not on the {chosen!r} backend.")
    n = grid_spec.num_scalar_prefetch
    grid_rank = len(normalize_grid(grid_spec.grid))

    def call(*args):
        scalars = _scalars(args, n)
        rest = _whole(args[n:], grid_spec.in_specs)
        plain = dict(
            grid=grid_spec.grid,
            in_specs=[jax.tree.map(lambda _: BlockSpec(memory_space=TPU_SMEM), s) for s in scalars]
            + _bind_tree(rest, "in_specs", grid_rank, scalars),
            out_specs=_bind_tree(grid_spec.out_specs, "out_specs", grid_rank, scalars),
            scratch_shapes=grid_spec.scratch_shapes)
        present = len(jax.tree.leaves(scalars))  # one mapping per array; None leaves none
        return build_call(kernel, out_shape, backend=backend, interpret=interpret, **plain,
                          num_scalar_prefetch=present, **kwargs)(*scalars, *args[n:])

    return _one_batch_element_at_a_time(call)


def _one_batch_element_at_a_time(call):
    """``call`` whose vmap is a ``lax.map`` over the batch.

    The interpreter's index maps close over the scalar arrays, so the batch
    grid axis that vmap adds elsewhere (:mod:`pallas_core.batching`) would
    see them batched; running one batch element after another keeps every
    index map unbatched (the interpreter runs programs one at a time anyway).
    """
    @jax.custom_batching.custom_vmap
    def batched(*args):
        return call(*args)

    @batched.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size

        def one(values):
            values = iter(values)
            return batched(*[next(values) if b else a for a, b in zip(args, in_batched)])

        outs = jax.lax.map(one, [a for a, b in zip(args, in_batched) if b])
        return outs, jax.tree.map(lambda _: True, outs)

    return batched
