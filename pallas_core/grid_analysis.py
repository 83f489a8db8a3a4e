"""Static analysis of index maps over the grid, at a cost independent of its size.

Index maps are functions of the program ids only, so before anything is
lowered we can answer: is every block at least partly in bounds, along which
grid axes is an output block revisited (so the axis must run in order), and
is an output block ever revisited after being left (a reduction that is not
over the minor-most axes)? Each index map is analysed one of three ways:

* exhaustively, for grids of at most :data:`MAX_ANALYSED_POINTS` points: one
  vectorised evaluation at every point; exact.
* symbolically, for larger grids whose index map is affine in the program ids
  (``c + A @ ids``: sums, differences and products with constants, which is
  what almost every kernel writes): bounds from the grid's corners, revisits
  from the zero columns of ``A``; exact (the revisit-after-leaving check when
  ``A`` is provably injective on the grid, otherwise sampled as below).
* by sampling otherwise: the map is evaluated on the first and last
  :data:`SAMPLE_PER_AXIS` indices of every axis. Whatever it reports is true of
  the full grid (no false errors), but a problem elsewhere may go unseen.

Index maps that read values only known when the kernel runs (scalar prefetch)
and grids with a dimension that is not a Python int are not analysed.

:func:`execution_order` gives the interpreter's order of grid points as
arithmetic on the loop counters, never as a table of points.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np
import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from pallas_core._jax_internals import JAXPR_CALLS
from pallas_core.params import ARBITRARY, PARALLEL
from pallas_core.specs import BlockMapping

# Grids of at most this many points are analysed exhaustively.
MAX_ANALYSED_POINTS = 1 << 18
# Non-affine index maps on larger grids: indices sampled at each end of every axis.
SAMPLE_PER_AXIS = 4
# Shuffled execution orders use an explicit permutation of up to this many groups
# per core, a seeded affine permutation beyond.
MAX_SHUFFLE_TABLE = 1 << 16

_NO_MESH = jax.sharding.AbstractMesh((), ())
_TRACE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                 jax.errors.TracerIntegerConversionError, jax.errors.UnexpectedTracerError)


def is_static(grid) -> bool:
    """Whether every grid dimension is a Python (or NumPy) int, known before tracing."""
    return all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in grid)


def num_points(grid) -> int:
    """The number of grid points of a static grid (1 for the empty grid)."""
    return math.prod(int(n) for n in grid)


def point_at(grid, position: int) -> tuple[int, ...]:
    """The grid point at ``position`` in row-major (sequential) order."""
    return tuple(int(i) for i in np.unravel_index(position, tuple(grid))) if grid else ()


def grid_points(grid: tuple[int, ...]) -> np.ndarray:
    """All grid points in row-major order, shape ``[P, len(grid)]`` (small grids only)."""
    if not grid:
        return np.zeros((1, 0), np.int32)
    if num_points(grid) > MAX_ANALYSED_POINTS:
        raise ValueError(f"grid_points: the grid {tuple(grid)} has more than "
                         f"{MAX_ANALYSED_POINTS} points; analyse it with block_index_table.")
    return np.indices(grid, dtype=np.int32).reshape(len(grid), -1).T.copy()


# --------------------------------------------------------------------------
# Index tables: an index map's blocks over the grid, exact, affine or sampled
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IndexTable:
    """An index map's block indices over a grid.

    Either ``blocks`` ``[P, rank]`` at the grid points formed by ``axis_indices``
    (row-major over their product: every index of every axis when exhaustive,
    samples otherwise), or the affine form ``offset + coeffs @ ids``
    (``offset [rank]``, ``coeffs [rank, len(grid)]``).
    """

    grid: tuple[int, ...]
    axis_indices: tuple[np.ndarray, ...] | None = None
    blocks: np.ndarray | None = None
    offset: np.ndarray | None = None
    coeffs: np.ndarray | None = None

    @property
    def affine(self) -> bool:
        return self.coeffs is not None

    @property
    def exhaustive(self) -> bool:
        return self.affine or all(len(ix) == n for ix, n in zip(self.axis_indices, self.grid))

    def block_at(self, point) -> tuple[int, ...]:
        """The block index at a grid point."""
        if self.affine:
            return tuple(int(v) for v in self.offset + self.coeffs @ np.asarray(point, np.int64))
        pos = np.ravel_multi_index(
            tuple(int(np.searchsorted(ix, p)) for ix, p in zip(self.axis_indices, point)),
            tuple(len(ix) for ix in self.axis_indices)) if self.grid else 0
        return tuple(int(v) for v in self.blocks[pos])

    def sample_points(self) -> np.ndarray:
        """The grid points of ``blocks``' rows, ``[P, len(grid)]``."""
        if not self.grid:
            return np.zeros((1, 0), np.int64)
        mesh = np.meshgrid(*self.axis_indices, indexing="ij")
        return np.stack([m.reshape(-1) for m in mesh], axis=1)


def block_index_table(mapping: BlockMapping, grid) -> IndexTable | None:
    """``mapping.index_map`` over the grid; None when it cannot be known before the call.

    Raises:
      TypeError: an index map that returns non-integers.
    """
    if not is_static(grid):
        return None
    grid = tuple(int(n) for n in grid)
    if num_points(grid) == 0:
        return None
    if num_points(grid) > MAX_ANALYSED_POINTS:
        affine = _affine_form(mapping, grid)
        if affine is not None:
            return affine
        indices = _sample_indices(grid)
    else:
        indices = tuple(np.arange(n) for n in grid)
    table = IndexTable(grid, axis_indices=indices, blocks=np.zeros((0, 0), np.int64))
    blocks = _evaluate(mapping, table.sample_points())
    return None if blocks is None else dataclasses.replace(table, blocks=blocks)


def _sample_indices(grid) -> tuple[np.ndarray, ...]:
    """Per axis, its first and last :data:`SAMPLE_PER_AXIS` indices."""
    return tuple(np.unique(np.concatenate([np.arange(min(n, SAMPLE_PER_AXIS)),
                                           np.arange(max(0, n - SAMPLE_PER_AXIS), n)]))
                 for n in grid)


def _evaluate(mapping: BlockMapping, points: np.ndarray) -> np.ndarray | None:
    """``index_map`` at each of ``points`` ``[P, len(grid)]``: ``[P, rank]`` int64."""
    rank = len(mapping.array_shape)
    count, grid_rank = points.shape
    try:
        # Outside any mesh: inside shard_map the context mesh has manual axes, under which
        # JAX cannot make the concrete arrays this evaluation needs.
        with jax.ensure_compile_time_eval(), jax.sharding.use_abstract_mesh(_NO_MESH):
            columns = [jnp.asarray(points[:, a].astype(np.int32)) for a in range(grid_rank)]
            if grid_rank:
                out = jax.vmap(lambda *ids: tuple(jnp.asarray(v) for v in mapping.index_map(*ids)))(
                    *columns)
            else:
                out = tuple(jnp.asarray(v)[None] for v in mapping.index_map())
            table = np.stack([np.broadcast_to(np.asarray(v), (count,)) for v in out], axis=1) \
                if rank else np.zeros((count, 0), np.int64)
    except _TRACE_ERRORS:
        return None
    except ValueError as e:  # a value traced under shard_map's mesh: known only at run time
        if "mesh" in str(e).lower():
            return None
        raise
    if not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"{mapping.origin}: index_map must return integers, got "
                        f"dtype {table.dtype}.")
    return table.astype(np.int64)


def _affine_form(mapping: BlockMapping, grid: tuple[int, ...]) -> IndexTable | None:
    """The index map as ``offset + coeffs @ ids`` if its jaxpr is affine in the ids, else None."""
    ids = [jax.ShapeDtypeStruct((), jnp.int32)] * len(grid)
    try:
        closed = jax.make_jaxpr(lambda *i: tuple(jnp.asarray(v) for v in mapping.index_map(*i)))(*ids)
    except _TRACE_ERRORS:
        return None
    for v in closed.jaxpr.outvars:
        if not np.issubdtype(np.dtype(v.aval.dtype), np.integer):
            raise TypeError(f"{mapping.origin}: index_map must return integers, got "
                            f"dtype {np.dtype(v.aval.dtype)}.")
    rank = len(grid)
    inputs = [(0, np.eye(rank, dtype=np.int64)[a]) for a in range(rank)]
    forms = _affine_eval(closed.jaxpr, closed.consts, inputs, rank)
    if forms is None or any(f is None for f in forms):
        return None
    if not forms:
        return IndexTable(grid, offset=np.zeros(0, np.int64), coeffs=np.zeros((0, rank), np.int64))
    return IndexTable(grid, offset=np.asarray([c for c, _ in forms], np.int64),
                      coeffs=np.stack([a for _, a in forms]).astype(np.int64))


_PASS_THROUGH = {"copy", "copy_p", "squeeze", "reshape", "broadcast_in_dim"}


def _affine_eval(jaxpr, consts, inputs, rank):
    """Per outvar ``(offset, coeffs)`` or None (not affine); None if the jaxpr is not scalar."""
    def constant(value):
        arr = np.asarray(value)
        if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
            return None
        return int(arr), np.zeros(rank, np.int64)

    env = {}
    read = lambda v: constant(v.val) if isinstance(v, Literal) else env.get(v)
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = constant(value)
    for var, value in zip(jaxpr.invars, inputs):
        env[var] = value
    for eqn in jaxpr.eqns:
        if any(getattr(v.aval, "shape", None) != () for v in eqn.outvars):
            return None
        args = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        out = [None] * len(eqn.outvars)
        if sub is not None and name in JAXPR_CALLS:
            inner = getattr(sub, "jaxpr", sub)
            out = _affine_eval(inner, getattr(sub, "consts", ()), args, rank) or out
        elif any(a is None for a in args):
            pass
        elif name == "add":
            out = [(args[0][0] + args[1][0], args[0][1] + args[1][1])]
        elif name == "sub":
            out = [(args[0][0] - args[1][0], args[0][1] - args[1][1])]
        elif name == "neg":
            out = [(-args[0][0], -args[0][1])]
        elif name == "mul":
            (c0, a0), (c1, a1) = args
            if not a0.any():
                out = [(c0 * c1, c0 * a1)]
            elif not a1.any():
                out = [(c0 * c1, c1 * a0)]
        elif name == "convert_element_type" or name in _PASS_THROUGH:
            if np.issubdtype(np.dtype(eqn.outvars[0].aval.dtype), np.integer):
                out = [args[0]]
        for var, form in zip(eqn.outvars, out):
            env[var] = form
    return [read(v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------

def _scale(mapping: BlockMapping) -> np.ndarray:
    return np.asarray([1 if e else b for b, e in zip(mapping.block_shape, mapping.element)], np.int64)


def check_in_bounds(mapping: BlockMapping, table: IndexTable, grid) -> None:
    """Every block must have at least one in-bounds element."""
    scale = _scale(mapping)
    limits = np.asarray([lo + d + hi for d, (lo, hi) in zip(mapping.array_shape, mapping.padding)],
                        np.int64)
    if table.affine:
        last = np.asarray(table.grid, np.int64) - 1
        for dim in range(len(limits)):
            row = table.coeffs[dim]
            low = np.where(row < 0, last, 0)
            high = np.where(row > 0, last, 0)
            for point in (low, high):
                start = int(scale[dim] * (table.offset[dim] + row @ point))
                if start < 0 or start >= limits[dim]:
                    _out_of_bounds(mapping, tuple(int(p) for p in point), table.block_at(point),
                                   dim, start, limits[dim])
        return
    starts = table.blocks * scale.reshape(1, -1)
    bad = (starts < 0) | (starts >= limits)
    if bad.any():
        p, dim = np.argwhere(bad)[0]
        point = tuple(int(v) for v in table.sample_points()[p])
        _out_of_bounds(mapping, point, tuple(int(v) for v in table.blocks[p]), dim,
                       int(starts[p, dim]), limits[dim])


def _out_of_bounds(mapping, point, block, dim, start, limit):
    raise ValueError(
        f"{mapping.origin}: at grid point {point} the index_map gives index "
        f"{block}, whose block starts at element {start} of dim {dim} (size {int(limit)}); "
        "every block must have at least one in-bounds element.")


def revisited_axes(table: IndexTable, grid) -> set[int]:
    """Grid axes along which two neighbouring points write the same block."""
    if table.affine:
        return {a for a, n in enumerate(table.grid) if n >= 2 and not table.coeffs[:, a].any()}
    axes = set()
    blocks = table.blocks.reshape(*(len(ix) for ix in table.axis_indices), table.blocks.shape[-1])
    for a, ix in enumerate(table.axis_indices):
        neighbours = np.flatnonzero(np.diff(ix) == 1)
        if neighbours.size == 0:
            continue
        same = np.all(np.diff(blocks, axis=a) == 0, axis=-1)
        if np.take(same, neighbours, axis=a).any():
            axes.add(a)
    return axes


def revisited_after_leaving(table: IndexTable) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(first_visit, revisit)`` grid points if a block comes back after being left."""
    if table.affine:
        found = _affine_revisit(table)
        if found is not None or _injective(table):
            return found
        table = block_index_table_sampled(table)
    blocks = table.blocks
    if blocks.shape[0] < 3:
        return None
    _, ids = np.unique(blocks, axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    run_start = np.concatenate([[True], ids[1:] != ids[:-1]])
    run_ids = ids[run_start]
    if np.unique(run_ids).size == run_ids.size:
        return None
    seen = {}
    points = table.sample_points()
    for pos, block in zip(np.flatnonzero(run_start), run_ids):
        if block in seen:
            return (tuple(int(v) for v in points[seen[block]]), tuple(int(v) for v in points[pos]))
        seen[block] = pos
    return None


def _affine_revisit(table: IndexTable):
    """A revisit along a constant axis more major than an axis the block moves along."""
    grid = table.grid
    moving = [a for a, n in enumerate(grid) if n >= 2 and table.coeffs[:, a].any()]
    constant = [a for a, n in enumerate(grid) if n >= 2 and not table.coeffs[:, a].any()]
    for z in constant:
        later = [a for a in moving if a > z]
        if later:
            first = [0] * len(grid)
            back = list(first)
            back[z] = 1
            return tuple(first), tuple(back)
    return None


def _injective(table: IndexTable) -> bool:
    """Whether equal blocks imply equal ids on every axis the block moves along
    (each such axis alone moves some block dim)."""
    moving = [a for a, n in enumerate(table.grid) if n >= 2 and table.coeffs[:, a].any()]
    for a in moving:
        others = [b for b in moving if b != a]
        rows = table.coeffs[:, a] != 0
        if others:
            rows &= ~table.coeffs[:, others].any(axis=1)
        if not rows.any():
            return False
    return True


def block_index_table_sampled(table: IndexTable) -> IndexTable:
    """An affine table evaluated at the sample points of the non-affine analysis."""
    sampled = IndexTable(table.grid, axis_indices=_sample_indices(table.grid),
                         blocks=np.zeros((0, 0), np.int64))
    points = sampled.sample_points()
    blocks = table.offset[None, :] + points @ table.coeffs.T
    return dataclasses.replace(sampled, blocks=blocks.astype(np.int64))


def infer_semantics(revisits: set[int], grid_rank: int) -> tuple[str, ...]:
    """Arbitrary where an output block is revisited, parallel elsewhere."""
    return tuple(ARBITRARY if a in revisits else PARALLEL for a in range(grid_rank))


# --------------------------------------------------------------------------
# The interpreter's execution order, as arithmetic on loop counters
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExecutionOrder:
    """The order the interpreter runs grid points in, simulating megacore.

    Points are grouped by their indices along the parallel axes; within a
    group, arbitrary axes keep their sequential (row-major) order. The
    outermost parallel axis is split into ``num_cores`` contiguous ranges,
    one per simulated core (as Mosaic splits it across TensorCores); each
    core runs its groups in row-major order, or in a seeded random order when
    ``shuffle_seed`` is set.

    The interpreter runs ``num_groups`` groups of ``group_size`` points (two
    nested loops, so neither counter overflows int32 on grids of more than
    2**31 points); :meth:`ids` and :meth:`core_start` turn the loop counters
    into program ids, with cost independent of the grid's size. Grid dims may
    be traced values (then no shuffle).
    """

    grid: tuple
    parallel: tuple[int, ...]
    arbitrary: tuple[int, ...]
    groups_per_core: object  # int or traced
    permutation: object = None  # None, ("table", [cores, groups_per_core] array) or ("affine", a, b)

    @property
    def num_groups(self):
        return _prod(self.grid[a] for a in self.parallel)

    @property
    def group_size(self):
        return _prod(self.grid[a] for a in self.arbitrary)

    @property
    def size(self):
        return _prod(self.grid)

    def ids(self, group, within) -> list:
        """The program ids (int32 scalars) of point ``within`` of the ``group``-th group run."""
        group = self._group(group)
        ids = [None] * len(self.grid)
        for axes, flat in ((self.parallel, group), (self.arbitrary, within)):
            for a in reversed(axes):
                n = self.grid[a]
                ids[a] = flat % n
                flat = flat // n
        return [jnp.asarray(i, jnp.int32) for i in ids]

    def core_start(self, group, within):
        """Whether this point is the first a simulated core runs (its scratch is fresh)."""
        return (group % self.groups_per_core == 0) & (within == 0)

    def _group(self, group):
        if self.permutation is None:
            return group
        core, j = group // self.groups_per_core, group % self.groups_per_core
        if self.permutation[0] == "table":
            return core * self.groups_per_core + self.permutation[1][core, j]
        _, a, b, sizes = self.permutation
        size = sizes[core]
        return core * self.groups_per_core + (a[core] * j + b[core]) % size


def _prod(values):
    out = 1
    for v in values:
        out = out * v
    return out


def execution_order(grid, semantics: tuple[str, ...], num_cores: int,
                    shuffle_seed: int | None) -> ExecutionOrder:
    """The interpreter's :class:`ExecutionOrder` for ``grid`` under ``semantics``."""
    grid = tuple(grid)
    parallel = tuple(a for a, s in enumerate(semantics) if s == PARALLEL)
    arbitrary = tuple(a for a in range(len(grid)) if a not in parallel)
    if not parallel:
        return ExecutionOrder(grid, (), arbitrary, groups_per_core=1)
    extent = grid[parallel[0]]
    inner = _prod(grid[a] for a in parallel[1:])
    if isinstance(extent, numbers.Integral):
        cores = max(1, min(num_cores, int(extent)))
        per_core = -(-int(extent) // cores)
    else:
        cores = jnp.maximum(1, jnp.minimum(num_cores, extent))
        per_core = -(-extent // cores)
    order = ExecutionOrder(grid, parallel, arbitrary, groups_per_core=per_core * inner)
    if shuffle_seed is None or not is_static(grid) or num_points(grid) == 0:
        return order
    return dataclasses.replace(order, permutation=_shuffle(order, int(extent), per_core, shuffle_seed))


def _shuffle(order: ExecutionOrder, extent: int, per_core: int, seed: int):
    """A seeded permutation of each core's groups: a table, or affine for many groups."""
    rng = np.random.default_rng(seed)
    step, total = order.groups_per_core, order.num_groups
    cores = -(-extent // per_core)
    sizes = [min(step, total - c * step) for c in range(cores)]
    if step <= MAX_SHUFFLE_TABLE:
        table = np.zeros((cores, step), np.int32)
        for c, n in enumerate(sizes):
            table[c, :n] = rng.permutation(n)
        return ("table", jnp.asarray(table))
    # (a * j + b) mod n with a coprime to n is a permutation of range(n).
    a, b = [], []
    for n in sizes:
        high = max(2, min(n, (2 ** 31 - 1) // n))  # a * j stays within int32
        while True:
            cand = int(rng.integers(1, high))
            if math.gcd(cand, n) == 1:
                break
        a.append(cand)
        b.append(int(rng.integers(0, n)))
    return ("affine", jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32),
            jnp.asarray(sizes, jnp.int32))
