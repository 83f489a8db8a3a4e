"""Ref views, and masked reads and writes that may run past a Ref's edge.

A kernel's ``ref.at[...]`` views and the index of a read or write are JAX
``NDIndexer`` transforms: per dim of the view they index, a slice
(``start, size, stride``), an integer, or an integer array (a gather). This
module reads them back as one *access*: per dim of the underlying Ref, the
coordinate each element of the result comes from. That is what our Triton
lowering turns into pointer arithmetic, and what lets the interpreter do a
masked access whose masked-off lanes run past the Ref's edge (the GPU idiom
``pl.load(x_ref.at[pl.ds(0, 128)], mask=col < n)`` on a 125-wide block), which
JAX's plain Ref indexing refuses or silently clamps.

Semantics, as on a GPU: lanes the mask keeps must be inside the underlying
Ref; masked-off lanes may point anywhere and are never read or written. A
masked load gives ``other`` (0 when not given) there. An access with no mask
that is known, from static indices, to run past the edge raises IndexError.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def is_slice(index) -> bool:
    """A ``pl.ds`` / ``Slice`` (an NDIndexer turns every ``slice`` into one)."""
    return all(hasattr(index, a) for a in ("start", "size", "stride"))


def _ndim(index) -> int:
    """Rank of an index: a value, a tracer, or a jaxpr variable (the Triton writer's)."""
    aval = getattr(index, "aval", None)
    return len(aval.shape) if aval is not None else np.ndim(index)


def _is_indexer(t) -> bool:
    return all(hasattr(t, a) for a in ("indices", "shape", "int_indexer_shape"))


def indexer_layout(indexer) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """``(result shape, axes)`` of an NDIndexer: for each of its indices, the result
    axes it spans (one for a slice, none for a scalar, those of the broadcast
    integer-index shape for an array), with NumPy's rule: integer indices next to
    each other put their axes where they stand, otherwise first."""
    indices = indexer.indices
    int_shape = tuple(int(d) for d in indexer.int_indexer_shape)
    ints = [k for k, i in enumerate(indices) if not is_slice(i)]
    contiguous = not ints or ints == list(range(ints[0], ints[-1] + 1))
    shape: list[int] = []
    axes: list[tuple[int, ...]] = []
    int_axes: tuple[int, ...] | None = None
    if ints and not contiguous:
        int_axes = tuple(range(len(int_shape)))
        shape.extend(int_shape)
    for i in indices:
        if is_slice(i):
            axes.append((len(shape),))
            shape.append(int(i.size))
            continue
        if int_axes is None:
            int_axes = tuple(range(len(shape), len(shape) + len(int_shape)))
            shape.extend(int_shape)
        axes.append(int_axes if _ndim(i) else ())
    return tuple(shape), axes


@dataclasses.dataclass(frozen=True)
class Access:
    """A read or write seen from the underlying Ref.

    ``coords`` has one entry per dim of ``base``: ``("range", start, size,
    stride, axis)`` (result axis ``axis`` walks the dim), ``("fixed", index)``,
    or ``("gather", start, stride, index_array, axes)`` (element ``start +
    stride * index_array`` along the result ``axes``). Starts and indices may
    be traced.
    """

    base: Any
    shape: tuple[int, ...]
    coords: tuple[tuple, ...]


def view(ref, idx):
    """``(underlying Ref, transforms)`` of ``ref.at[idx]``."""
    v = ref.at[idx]
    return v.ref, tuple(v.transforms)


def access(ref, idx) -> Access | None:
    """``ref[idx]`` as an :class:`Access`, or None for views other than slicing and
    indexing (bitcasts, reshapes) or a gather that is not the last view."""
    base, transforms = view(ref, idx)
    if not all(_is_indexer(t) for t in transforms):
        return None
    dims: list[tuple] = [("range", 0, int(n), 1, a) for a, n in enumerate(base.shape)]
    shape: tuple[int, ...] = tuple(int(n) for n in base.shape)
    for t in transforms:
        if any(d[0] == "gather" for d in dims):
            if is_trivial(t):  # ``view[...]`` of a gathered view
                continue
            return None
        kept = sorted((d for d in range(len(dims)) if dims[d][0] == "range"), key=lambda d: dims[d][4])
        shape, axes = indexer_layout(t)
        for d, index, ax in zip(kept, t.indices, axes):
            _, start, _, stride, _ = dims[d]
            if is_slice(index):
                dims[d] = ("range", start + index.start * stride, int(index.size),
                           stride * int(index.stride), ax[0])
            elif ax:
                dims[d] = ("gather", start, stride, index, ax)
            else:
                dims[d] = ("fixed", start + index * stride)
    return Access(base=base, shape=tuple(shape), coords=tuple(dims))


def is_trivial(indexer) -> bool:
    """Whether an NDIndexer selects its whole view, in order (``view[...]``)."""
    return all(is_slice(i) and _concrete(i.start) == 0 and int(i.stride) == 1 and int(i.size) == n
               for i, n in zip(indexer.indices, indexer.shape))


def _concrete(x) -> int | None:
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    try:
        return int(x)  # a concrete (non-traced) array scalar
    except Exception:  # noqa: BLE001 - a tracer
        return None


def static_overhang(ref, idx) -> str | None:
    """A description of how ``ref[idx]`` runs past the edge of some view, if static
    indices show it does; None when in bounds or not known."""
    _, transforms = view(ref, idx)
    for t in transforms:
        if not _is_indexer(t):
            return None
        for dim, (index, n) in enumerate(zip(t.indices, t.shape)):
            if is_slice(index):
                start = _concrete(index.start)
                if start is None or index.size == 0:
                    continue
                last = start + (int(index.size) - 1) * int(index.stride)
                if start < 0 or last >= n:
                    return (f"elements {start}..{last} of dim {dim}, which has {n} (a view of "
                            f"shape {tuple(t.shape)})")
            elif not _ndim(index):
                i = _concrete(index)
                if i is not None and not 0 <= i < n:
                    return f"index {i} of dim {dim}, which has {n} (a view of shape {tuple(t.shape)})"
    return None


def statically_in_bounds(ref, idx) -> bool:
    """Whether static indices show every view of ``ref[idx]`` in bounds (no traced
    starts or integer indices, no index arrays)."""
    _, transforms = view(ref, idx)
    for t in transforms:
        if not _is_indexer(t):
            return False
        for index in t.indices:
            if is_slice(index):
                if _concrete(index.start) is None:
                    return False
            elif _ndim(index) or _concrete(index) is None:
                return False
    return static_overhang(ref, idx) is None


def check_no_overhang(ref, idx, what: str) -> None:
    """IndexError when static indices show an unmasked access past the edge."""
    where = static_overhang(ref, idx)
    if where is not None:
        raise IndexError(
            f"{what}: the index reaches {where}, past the Ref's edge, and no mask is given; "
            f"pass mask= to guard the lanes outside (masked-off lanes are never read or written).")


def _coordinates(a: Access):
    """Per dim of the underlying Ref, the int32 coordinate of every result element
    (broadcastable to ``a.shape``), and where all of them are inside the Ref."""
    rank = len(a.shape)
    coords, valid = [], jnp.ones((), jnp.bool_)
    for dim, n in zip(a.coords, a.base.shape):
        if dim[0] == "range":
            _, start, _, stride, axis = dim
            c = jnp.asarray(start, jnp.int32) + stride * lax.broadcasted_iota(jnp.int32, a.shape, axis)
        elif dim[0] == "fixed":
            c = jnp.asarray(dim[1], jnp.int32)
        else:
            _, start, stride, index, axes = dim
            placed = jnp.reshape(jnp.asarray(index).astype(jnp.int32),
                                 [a.shape[k] if k in axes else 1 for k in range(rank)])
            c = jnp.asarray(start, jnp.int32) + stride * placed
        coords.append(c)
        valid = valid & (c >= 0) & (c < n)
    return coords, jnp.broadcast_to(valid, a.shape)


def broadcast_mask(mask, shape, what):
    """``mask`` broadcast to ``shape``; errors name the operation."""
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{what}: mask must be a boolean array, got {mask.dtype}.")
    try:
        return jnp.broadcast_to(mask, shape)
    except ValueError:
        raise ValueError(f"{what}: mask of shape {mask.shape} does not broadcast to the "
                         f"accessed shape {tuple(shape)}.") from None


def masked_read(a: Access, mask, other, what: str = "load"):
    """The elements of ``a`` where ``mask`` holds, ``other`` elsewhere (the interpreter)."""
    keep = broadcast_mask(mask, a.shape, what)
    coords, valid = _coordinates(a)
    whole = a.base[...]
    clipped = tuple(jnp.broadcast_to(jnp.clip(c, 0, max(n - 1, 0)), a.shape)
                    for c, n in zip(coords, a.base.shape))
    got = whole[clipped] if clipped else jnp.broadcast_to(whole, a.shape)
    fill = jnp.zeros((), whole.dtype) if other is None else jnp.asarray(other, whole.dtype)
    return jnp.where(keep & valid, got, fill)


def masked_write(a: Access, value, mask, what: str = "store") -> None:
    """Writes ``value`` to the elements of ``a`` where ``mask`` holds (the interpreter).

    Masked-off lanes are sent past the Ref's end and dropped, so they never
    write, not even where an index array repeats an element.
    """
    write = broadcast_mask(mask, a.shape, what)
    coords, valid = _coordinates(a)
    write = write & valid
    whole = a.base[...]
    if not coords:  # a rank-0 Ref
        a.base[...] = jnp.where(write, value, whole)
        return
    dropped = tuple(jnp.broadcast_to(jnp.where(write, c, n), a.shape)
                    for c, n in zip(coords, a.base.shape))
    a.base[...] = whole.at[dropped].set(jnp.broadcast_to(value, a.shape), mode="drop")


def value_for(value, shape, dtype, what: str = "store"):
    """``value`` broadcast to ``shape`` as ``dtype``: Python scalars and weakly typed
    values convert; an array of another dtype is refused, as ``ref[...] = value`` does."""
    value_dtype = getattr(value, "dtype", None)
    weak = value_dtype is None or getattr(jax.typeof(value), "weak_type", False)
    value = jnp.asarray(value)
    if value.dtype != np.dtype(dtype):
        if not weak:
            raise TypeError(f"{what}: value has dtype {value.dtype} but the Ref holds "
                            f"{np.dtype(dtype)}; convert it with .astype first.")
        value = value.astype(dtype)
    try:
        return jnp.broadcast_to(value, shape)
    except ValueError:
        raise ValueError(f"{what}: value of shape {value.shape} does not broadcast to the "
                         f"written shape {tuple(shape)}.") from None
