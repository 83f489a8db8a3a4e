"""vmap of a pallas_call as one more grid axis (docs/design.md §4).

Batching adds a leading ``"parallel"`` grid axis of the batch size and a
leading squeezed block dim to every batched operand's spec, whose index map
picks the batch element from the new program id; unbatched operands keep
their spec (their index map ignores the batch id). The kernel itself is
unchanged: it still sees unbatched blocks.

JAX's Pallas backends batch their own calls this way; our Triton backend
uses :func:`batched_run` so a vmapped kernel is one launch, on a GPU too.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_core.params import PARALLEL
from pallas_core.specs import BlockMapping


def _batched_mapping(m: BlockMapping, size: int, batched: bool) -> BlockMapping:
    index_map, size_map = m.index_map, m.size_map
    if not batched:
        return dataclasses.replace(
            m, index_map=lambda b, *ids: index_map(*ids),
            size_map=None if size_map is None else lambda b, *ids: size_map(*ids))
    return dataclasses.replace(
        m, array_shape=(size, *m.array_shape), block_shape=(1, *m.block_shape),
        squeezed=(True, *m.squeezed), padding=((0, 0), *m.padding),
        element=(False, *m.element), bounded=(False, *m.bounded) if m.bounded else (),
        index_map=lambda b, *ids: (b, *index_map(*ids)),
        size_map=None if size_map is None else lambda b, *ids: (1, *size_map(*ids)))


def add_batch_axis(call, size: int, in_batched) -> tuple:
    """The call with a leading batch grid axis; also which inputs must be broadcast."""
    aliased = set(call.input_output_aliases)
    # An aliased input starts its (batched) output, so it must be batched too.
    batched = [b or i in aliased for i, b in enumerate(in_batched)]
    ins = tuple(_batched_mapping(m, size, b) for m, b in zip(call.in_mappings, batched))
    outs = tuple(_batched_mapping(m, size, True) for m in call.out_mappings)
    new = dataclasses.replace(call, grid=(size, *call.grid), in_mappings=ins, out_mappings=outs,
                              semantics=(PARALLEL, *call.semantics),
                              num_batch_axes=call.num_batch_axes + 1)
    return new, batched


def batched_run(call, args, run):
    """``run(call, args)``, batched by :func:`add_batch_axis` under vmap (nesting too)."""

    @jax.custom_batching.custom_vmap
    def apply(*operands):
        return tuple(run(call, list(operands)))

    @apply.def_vmap
    def _rule(axis_size, in_batched, *operands):
        new, batched = add_batch_axis(call, axis_size, in_batched)
        operands = [jnp.broadcast_to(x, (axis_size, *x.shape)) if want and not was else x
                    for x, want, was in zip(operands, batched, in_batched)]
        outs = tuple(batched_run(new, operands, run))
        return outs, (True,) * len(outs)

    return list(apply(*args))
