"""Edge-block masking for JAX's Pallas Triton lowering.

Our semantics (docs/design.md §4): a block may hang over the array's end;
what it reads there is unspecified and what it writes there is discarded.
JAX's Pallas Triton lowering turns ``ref[idx]`` into a plain load or store
with no bounds check, so an overhanging block would read, and worse write,
past the array. For every operand whose blocks can overhang, the kernel is
handed a :class:`MaskedRef` instead: indexing composes views exactly as a
Ref does, and reads and writes become ``pallas.triton.load`` / ``store`` with
a mask of the elements inside the array. Operands whose blocks divide the
array get the plain Ref, at no cost.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_core.specs import BlockMapping


def needs_masks(m: BlockMapping) -> bool:
    return any(not sq and d % b for d, b, sq in zip(m.array_shape, m.block_shape, m.squeezed))


class MaskedRef:
    """A block Ref whose loads and stores are masked to the array's bounds.

    ``dims`` describes the current view, one entry per dim of the block Ref:
    ``("range", start, size, stride)`` (kept) or ``("fixed", index)``; starts
    are relative to the block. ``origins`` / ``bounds`` / ``masked`` are per
    block-Ref dim: the block's first element in the array, the array's size,
    and whether the block can overhang there.
    """

    def __init__(self, ref, origins, bounds, masked, dims=None):
        self._ref = ref
        self._origins, self._bounds, self._masked = origins, bounds, masked
        self._dims = dims if dims is not None else tuple(("range", 0, n, 1) for n in ref.shape)

    # -- what kernels read off a Ref ---------------------------------------------
    @property
    def shape(self):
        return tuple(d[2] for d in self._dims if d[0] == "range")

    @property
    def dtype(self):
        return self._ref.dtype

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def at(self):
        return _At(self)

    def __getitem__(self, idx):
        view = self._index(idx)
        from jax.experimental.pallas import triton as pltriton
        return pltriton.load(view._jax_view(), mask=view._mask(), other=0)

    def __setitem__(self, idx, value):
        view = self._index(idx)
        from jax.experimental.pallas import triton as pltriton
        value = jnp.broadcast_to(jnp.asarray(value, self.dtype), view.shape)
        pltriton.store(view._jax_view(), value, mask=view._mask())

    # -- views ----------------------------------------------------------------------
    def _index(self, idx) -> "MaskedRef":
        from jax.experimental.pallas import Slice
        if not isinstance(idx, tuple):
            idx = (idx,)
        kept = [i for i, d in enumerate(self._dims) if d[0] == "range"]
        if any(i is Ellipsis for i in idx):
            e = idx.index(Ellipsis)
            idx = idx[:e] + (slice(None),) * (len(kept) - len(idx) + 1) + idx[e + 1:]
        idx = idx + (slice(None),) * (len(kept) - len(idx))
        if len(idx) != len(kept):
            raise IndexError(f"too many indices ({len(idx)}) for a Ref view of rank {len(kept)}")
        dims = list(self._dims)
        for axis, i in zip(kept, idx):
            _, start, size, stride = dims[axis]
            if isinstance(i, slice):
                lo, hi, step = i.indices(size)
                n = max(0, -(-(hi - lo) // step))
                dims[axis] = ("range", start + lo * stride, n, stride * step)
            elif isinstance(i, Slice):
                dims[axis] = ("range", start + i.start * stride, i.size, stride * i.stride)
            elif hasattr(i, "shape") and getattr(i, "shape", ()) != ():
                raise NotImplementedError("array indexing of an edge-masked Ref is not supported "
                                          "on pallas_triton; use slices or pl.ds.")
            else:
                dims[axis] = ("fixed", start + i * stride)
        return MaskedRef(self._ref, self._origins, self._bounds, self._masked, tuple(dims))

    def _jax_view(self):
        from jax.experimental.pallas import Slice
        idx = tuple(Slice(d[1], d[2], d[3]) if d[0] == "range" else d[1] for d in self._dims)
        return self._ref.at[idx]

    def _mask(self):
        shape = self.shape
        mask = jnp.ones(shape, jnp.bool_)
        axis = 0
        for d, dim in enumerate(self._dims):
            if dim[0] == "range":
                if self._masked[d]:
                    lanes = self._origins[d] + dim[1] + dim[3] * lax.broadcasted_iota(jnp.int32, shape, axis)
                    mask = mask & (lanes < self._bounds[d])
                axis += 1
            elif self._masked[d]:
                mask = mask & (self._origins[d] + dim[1] < self._bounds[d])
        return mask


class _At:
    def __init__(self, ref):
        self._ref = ref

    def __getitem__(self, idx):
        return self._ref._index(idx)


def wrap(refs, mappings, grid_rank: int, program_id=None):
    """The kernel's Refs, edge-masked where a mapping's blocks can overhang.

    Block origins come from each index_map evaluated at the program ids
    (JAX's ``program_id`` by default; tests pass pallas_core's to run the
    masks on the interpreter).
    """
    if program_id is None:
        from jax.experimental.pallas import program_id
    out = []
    for ref, m in zip(refs, mappings):
        if not needs_masks(m):
            out.append(ref)
            continue
        block_idx = m.index_map(*[program_id(a) for a in range(grid_rank)])
        keep = [d for d, sq in enumerate(m.squeezed) if not sq]
        origins = [jnp.asarray(block_idx[d], jnp.int32) * m.block_shape[d] for d in keep]
        bounds = [m.array_shape[d] for d in keep]
        masked = [m.array_shape[d] % m.block_shape[d] != 0 for d in keep]
        out.append(MaskedRef(ref, origins, bounds, masked))
    return out
