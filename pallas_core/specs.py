"""BlockSpec, indexing modes and GridSpec: how a grid point picks its blocks.

Semantics follow Pallas's grids and BlockSpecs (docs/pallas_core.md sections 2-4 and 9):

* ``Blocked()`` (the default): ``index_map(*program_ids)`` returns one *block*
  index per array dim; element start = block index * block size.
* ``Unblocked(padding)``: ``index_map`` returns *element* indices into the array
  virtually padded by ``padding`` (one ``(low, high)`` pair per dim).
* A ``None`` block dim behaves as size 1 and is squeezed out of the kernel's Ref.
* JAX 0.10.2's per-dim block dims (:mod:`pallas_core.block_dims`): ``Blocked(b)``,
  ``Squeezed()``, ``Element(b, padding)`` (element offsets along that dim only),
  ``BoundedSlice(b)`` (the index map returns ``pl.ds(start, size)``).
* ``block_shape=None`` means the whole array; ``index_map=None`` means a map
  returning all zeros.

User-facing objects are normalised once, by :func:`resolve_block_mapping`, into
a :class:`BlockMapping` that every backend consumes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.signatures import arity_error, function_source
from pallas_core.block_dims import BoundedSlice, Buffered, Element, Squeezed


@dataclasses.dataclass(frozen=True)
class Blocked:
    """Index maps return block indices (scaled by the block shape).

    ``Blocked()`` is an ``indexing_mode`` (every dim); ``Blocked(b)`` is JAX's
    block dim, the same as the int ``b`` in a ``block_shape``.
    """

    block_size: int | None = None


@dataclasses.dataclass(frozen=True)
class Unblocked:
    """Index maps return element indices; optional virtual ``padding``.

    Args:
      padding: ``None`` or one ``(low, high)`` pair of non-negative ints per
        array dim. The array behaves as if padded on input; padding values are
        unspecified (the interpreter fills NaN / the integer minimum).
    """

    padding: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        if self.padding is not None:
            pads = tuple(tuple(int(v) for v in p) for p in self.padding)
            if any(len(p) != 2 or p[0] < 0 or p[1] < 0 for p in pads):
                raise ValueError(
                    f"Unblocked(padding={self.padding!r}): padding must be one "
                    "(low, high) pair of non-negative ints per array dim.")
            object.__setattr__(self, "padding", pads)


# What one ``block_shape`` entry may be (JAX's ``pl.BlockDim``).
BlockDim = int | None | Blocked | Squeezed | Element | BoundedSlice


class BlockSpec:
    """How each grid point maps to a block of one operand.

    ``BlockSpec(block_shape=None, index_map=None, *, indexing_mode=Blocked(),
    memory_space=None, pipeline_mode=None)``. The legacy order ``BlockSpec(index_map, block_shape)``
    (older Pallas code's) is recognised by its callable first argument.

    Args:
      block_shape: one entry per array dim: a positive int, ``None`` or
        ``squeezed`` (size 1, dropped from the kernel's Ref), ``Blocked(b)``,
        ``Element(b, padding)`` or ``BoundedSlice(b)``
        (:mod:`pallas_core.block_dims`); or ``None`` for the whole array.
      index_map: ``f(*program_ids) -> tuple`` with one index per array dim (a
        scalar is accepted for rank-1 blocks), or ``None`` for all zeros.
      indexing_mode: :class:`Blocked` or :class:`Unblocked`.
      memory_space: a backend memory space such as ``pallas_core.tpu.SMEM``,
        ``pallas_core.ANY`` (the whole array, left where it is: with manual
        DMA), or ``None`` for the backend's default.
      pipeline_mode: ``pallas_core.Buffered(n)`` or None: buffering depth for
        pipelining backends (forwarded to Mosaic TPU; no effect elsewhere).
    """

    def __init__(self, block_shape=None, index_map=None, *,
                 indexing_mode: Blocked | Unblocked | None = None,
                 memory_space: Any = None, pipeline_mode: Buffered | None = None):
        if callable(block_shape) and not callable(index_map):
            block_shape, index_map = index_map, block_shape  # the legacy order
        if block_shape is not None:
            if isinstance(block_shape, (int, np.integer)):
                block_shape = (block_shape,)
            block_shape = tuple(_block_dim(d) for d in block_shape)
        if index_map is not None and not callable(index_map):
            raise TypeError(f"BlockSpec: index_map must be callable or None, got "
                            f"{type(index_map).__name__}.")
        indexing_mode = Blocked() if indexing_mode is None else indexing_mode
        if not isinstance(indexing_mode, (Blocked, Unblocked)) or getattr(
                indexing_mode, "block_size", None) is not None:
            raise TypeError("BlockSpec: indexing_mode must be pallas_core.Blocked() "
                            f"or pallas_core.Unblocked(...), got {indexing_mode!r}.")
        if isinstance(indexing_mode, Unblocked) and any(
                isinstance(d, (Element, BoundedSlice)) for d in block_shape or ()):
            raise ValueError("BlockSpec: Element / BoundedSlice block dims cannot be combined "
                             "with indexing_mode=Unblocked(); give Element dims only.")
        if pipeline_mode is not None and not isinstance(pipeline_mode, Buffered):
            raise TypeError(f"BlockSpec: pipeline_mode must be pallas_core.Buffered(n) or None, "
                            f"got {pipeline_mode!r}.")
        self.block_shape = block_shape
        self.index_map = index_map
        self.indexing_mode = indexing_mode
        self.memory_space = memory_space
        self.pipeline_mode = pipeline_mode

    def __repr__(self):
        return (f"BlockSpec(block_shape={self.block_shape}, index_map="
                f"{getattr(self.index_map, '__name__', self.index_map)}, "
                f"indexing_mode={self.indexing_mode})")


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """Grid, in/out BlockSpecs and scratch shapes bundled together."""

    grid: Any = ()
    in_specs: Any = None
    out_specs: Any = None
    scratch_shapes: Sequence[Any] = ()


def _block_dim(d):
    """One ``block_shape`` entry: an int, None (squeezed), Element or BoundedSlice."""
    if d is None or isinstance(d, Squeezed):
        return None
    if isinstance(d, (Element, BoundedSlice)):
        return d
    if isinstance(d, Blocked):
        if d.block_size is None:
            raise TypeError("block_shape: Blocked() needs a block size here, as in Blocked(128).")
        d = d.block_size
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
        raise TypeError(f"block_shape: expected an int, None, pallas_core.squeezed, Blocked(b), "
                        f"Element(b) or BoundedSlice(b) per dim, got {d!r}.")
    return int(d)


def _is_named_dim(d) -> bool:
    return isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str)


def grid_axis_names(grid) -> tuple[str, ...] | None:
    """The names of a named grid ``(("i", 4), ("j", 2))``, or None for a grid of ints.

    Inside the kernel a named axis is a JAX axis name: ``lax.axis_size(name)``
    and ``lax.psum(1, name)`` give its size, ``lax.axis_index(name)`` the program id.

    Raises:
      ValueError: some dims named and others not, or a name used twice.
    """
    if grid is None or isinstance(grid, (int, np.integer)):
        return None
    try:
        dims = tuple(grid)
    except TypeError:
        return None
    named = [_is_named_dim(d) for d in dims]
    if not any(named):
        return None
    if not all(named):
        raise ValueError(f"grid: name every axis, as (name, size) pairs, or none, got {grid!r}.")
    names = tuple(d[0] for d in dims)
    if len(set(names)) != len(names):
        raise ValueError(f"grid: axis names must be distinct, got {names}.")
    return names


def is_dynamic_dim(d) -> bool:
    """Whether a grid dim is a traced integer scalar (its size known only when the call runs)."""
    return isinstance(d, jax.core.Tracer)


def dynamic_axes(grid) -> tuple[int, ...]:
    """The grid axes whose sizes are traced (see :func:`normalize_grid`)."""
    return tuple(a for a, d in enumerate(grid) if is_dynamic_dim(d))


def normalize_grid(grid) -> tuple:
    """An int grid becomes a 1-tuple; ``()``/``None`` means one program; a named
    grid ``(("i", 4), ...)`` gives its sizes (see :func:`grid_axis_names`).

    As in JAX, a dim may be an integer scalar computed under ``jit`` (a grouped
    matmul's tile count, known only from its group sizes): such a dim stays a
    traced int32 scalar in the returned tuple (:func:`dynamic_axes` lists them);
    a concrete array scalar becomes an int.

    Raises:
      TypeError: a dim that is neither an int nor an integer scalar.
      ValueError: a negative static dim.
    """
    if grid is None:
        return ()
    if isinstance(grid, (int, np.integer)) or is_dynamic_dim(grid):
        grid = (grid,)
    try:
        dims = tuple(grid)
    except TypeError:
        raise TypeError(f"grid: expected an int or a tuple of ints, got {grid!r}.") from None
    if grid_axis_names(dims) is not None:
        dims = tuple(size for _, size in dims)
    out = []
    for d in dims:
        scalar = hasattr(d, "dtype") and np.shape(d) == () and jnp.issubdtype(d.dtype, jnp.integer)
        if is_dynamic_dim(d) and scalar:
            out.append(jnp.asarray(d, jnp.int32))
            continue
        if scalar and not isinstance(d, np.integer):
            d = int(d)  # a concrete array scalar
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"grid: every dim must be an int or an integer scalar (traced under "
                            f"jit), got {grid!r}.")
        if d < 0:
            raise ValueError(f"grid: dims must be >= 0, got {grid!r}.")
        out.append(int(d))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class BlockMapping:
    """A BlockSpec resolved against one operand's shape: what backends consume.

    Attributes:
      origin: where the spec came from, for messages (``"in_specs[1]"``).
      array_shape / dtype: the operand.
      block_shape: ints, squeezed dims as 1.
      squeezed: per dim, whether the kernel's Ref drops it.
      index_map: returns a tuple of ``len(array_shape)`` indices (the start
        of a BoundedSlice dim).
      element: per dim, whether the index is an element offset (Unblocked,
        Element, BoundedSlice) rather than a block index.
      padding: ``(low, high)`` per dim (all zero but on element dims).
      memory_space: as given on the BlockSpec.
      bounded: per dim, whether it is a BoundedSlice.
      size_map: for BoundedSlice dims, ``f(*program_ids)`` -> the (maybe traced)
        number of valid elements per dim (the block size elsewhere); None when
        there is no BoundedSlice dim.
      pipeline_mode: the BlockSpec's ``Buffered`` or None.
    """

    origin: str
    array_shape: tuple[int, ...]
    dtype: Any
    block_shape: tuple[int, ...]
    squeezed: tuple[bool, ...]
    index_map: Callable[..., tuple]
    element: tuple[bool, ...]
    padding: tuple[tuple[int, int], ...]
    memory_space: Any
    bounded: tuple[bool, ...] = ()
    size_map: Callable[..., tuple] | None = None
    pipeline_mode: Any = None

    @property
    def unblocked(self) -> bool:
        """Whether any dim takes element offsets (needs a backend that can express them)."""
        return any(self.element)

    @property
    def ref_shape(self) -> tuple[int, ...]:
        """The shape of the Ref the kernel sees (squeezed dims removed)."""
        return tuple(b for b, s in zip(self.block_shape, self.squeezed) if not s)

    def element_starts(self, indices: Sequence[Any]) -> tuple[Any, ...]:
        """Start of the block along each dim, in (padded) element coordinates."""
        return tuple(i if e else i * b for i, b, e in zip(indices, self.block_shape, self.element))


def is_no_block_spec(spec) -> bool:
    """None, or JAX's ``pl.no_block_spec`` (a ``NoBlockSpec``): both mean the whole array."""
    return spec is None or (type(spec).__name__ == "NoBlockSpec"
                            and type(spec).__module__.startswith("jax."))


def resolve_block_mapping(spec, origin: str, array_shape, dtype, grid_rank: int,
                          path: str | None = None) -> BlockMapping:
    """Checks a user BlockSpec against its operand and normalises it.

    ``path`` names the operand as JAX's messages do (``args[0]['one']``,
    ``outputs[1]``); ``origin`` names the spec (``in_specs[0]``).

    Raises:
      ValueError: rank mismatch, non-positive block dims, bad padding rank; an
        index_map that (when evaluated) returns the wrong number of indices or
        anything but integer scalars.
      TypeError: a spec that is not a BlockSpec or None; index_map arity that
        does not match the grid.
    """
    path = path or origin
    if is_no_block_spec(spec):
        spec = BlockSpec()
    if not isinstance(spec, BlockSpec):
        raise TypeError(f"{origin}: expected a pallas_core.BlockSpec or None, got "
                        f"{type(spec).__name__}.")
    array_shape = tuple(int(d) for d in array_shape)
    rank = len(array_shape)
    block = spec.block_shape if spec.block_shape is not None else array_shape
    if len(block) != rank:
        # Worded as JAX words it, so code that matches JAX's message keeps working.
        raise ValueError(
            f"Block shape for {path} ({origin}: block_shape {tuple(block)}, rank {len(block)}) "
            f"must have the same number of dimensions as the array shape {array_shape} "
            f"(rank {rank}); a BlockSpec needs one block dim per array dim (None squeezes "
            "a dim).")
    squeezed = tuple(d is None for d in block)
    bounded = tuple(isinstance(d, BoundedSlice) for d in block)
    element = tuple(isinstance(d, (Element, BoundedSlice)) for d in block)
    padding = tuple(d.padding if isinstance(d, Element) else (0, 0) for d in block)
    block_ints = tuple(1 if d is None else getattr(d, "block_size", d) for d in block)
    for d in block_ints:
        if d <= 0:
            raise ValueError(f"{origin}: block_shape {tuple(block)} has a dim <= 0; "
                             "block dims must be positive ints or None.")
    mode = spec.indexing_mode
    if isinstance(mode, Unblocked):
        element = (True,) * rank
        if mode.padding is not None:
            if len(mode.padding) != rank:
                raise ValueError(f"{origin}: Unblocked padding {mode.padding} has "
                                 f"{len(mode.padding)} pairs for an array of rank {rank}.")
            padding = mode.padding
    index_map = _normalize_index_map(spec.index_map, origin, rank, grid_rank, bounded,
                                     f"{function_source(spec.index_map)} for {path}")
    size_map = _bounded_size_map(spec.index_map, block_ints, bounded) if any(bounded) else None
    return BlockMapping(origin=origin, array_shape=array_shape, dtype=dtype,
                        block_shape=block_ints, squeezed=squeezed,
                        index_map=index_map, element=element,
                        padding=padding, memory_space=spec.memory_space, bounded=bounded,
                        size_map=size_map, pipeline_mode=spec.pipeline_mode)


def _is_ds(index) -> bool:
    return all(hasattr(index, a) for a in ("start", "size"))


def _check_index(index, d, origin, what):
    """An index_map result for one array dim must be an integer scalar."""
    aval = jax.typeof(index)
    if aval.shape != () or not np.issubdtype(aval.dtype, np.integer):
        raise ValueError(f"{origin}: Index map function {what} must return integer scalars. Output[{d}] "
                         f"has type {aval!r}; return one integer block index per array dim.")


def _normalize_index_map(index_map, origin, rank, grid_rank, bounded, what):
    if index_map is None:
        if any(bounded):
            raise ValueError(f"{origin}: a BoundedSlice block dim needs an index_map returning "
                             "pl.ds(start, size) for that dim.")
        return lambda *ids: (0,) * rank
    _check_arity(index_map, origin, grid_rank)

    def wrapped(*ids):
        out = index_map(*ids)
        if not isinstance(out, (tuple, list)):
            out = (out,)  # a scalar for a rank-1 block, as Pallas allows
        if len(out) != rank:
            raise ValueError(
                f"{origin}: Index map function {what} must return {rank} values to match the rank of "
                f"the array (one index per array dim). Currently returning {len(out)} values.")
        starts = []
        for d, (index, is_bounded) in enumerate(zip(out, bounded)):
            if is_bounded != _is_ds(index):
                raise TypeError(
                    f"{origin}: index_map returned {index!r} for dim {d}; a BoundedSlice dim "
                    "takes pl.ds(start, size) and every other dim an integer index.")
            if not is_bounded:
                _check_index(index, d, origin, what)
            starts.append(index.start if is_bounded else index)
        return tuple(starts)

    wrapped.__name__ = getattr(index_map, "__name__", "index_map")
    return wrapped


def _bounded_size_map(index_map, block_ints, bounded):
    """``f(*ids)``: per dim, the size a BoundedSlice dim's ``pl.ds`` gives, else the block size."""
    def sizes(*ids):
        out = index_map(*ids)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return tuple(i.size if b else n for i, n, b in zip(out, block_ints, bounded))

    return sizes


def _check_arity(fn, origin, grid_rank):
    why = arity_error(fn, grid_rank)
    if why is not None:
        raise TypeError(f"{origin}: the index_map {function_source(fn)} is called with one program "
                        f"id per grid axis, and the grid has rank {grid_rank}: {why}.")