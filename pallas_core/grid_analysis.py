"""Static analysis of index maps over the whole grid.

Index maps are functions of the program ids only, so for grids of reasonable
size we can evaluate them at every grid point before anything is lowered.
That gives exact answers to: is every block at least partly in bounds, along
which grid axes is an output block revisited (so the axis must run in order,
seed 002), and is an output block ever revisited after being left (a
reduction that is not over the minor-most axes)?
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from pallas_core.params import ARBITRARY, PARALLEL
from pallas_core.specs import BlockMapping

# Beyond this many grid points the exhaustive checks are skipped (they stay
# cheap: one vectorised evaluation of each index map).
MAX_ANALYSED_POINTS = 1 << 21


def grid_points(grid: tuple[int, ...]) -> np.ndarray:
    """All grid points in row-major (sequential) order, shape ``[P, len(grid)]``."""
    if not grid:
        return np.zeros((1, 0), np.int32)
    return np.indices(grid, dtype=np.int32).reshape(len(grid), -1).T.copy()


def block_index_table(mapping: BlockMapping, grid: tuple[int, ...]) -> np.ndarray | None:
    """``index_map`` at every grid point, ``[P, rank]`` int64; None if not static."""
    points = grid_points(grid)
    if points.shape[0] == 0 or points.shape[0] > MAX_ANALYSED_POINTS:
        return None
    rank = len(mapping.array_shape)
    try:
        with jax.ensure_compile_time_eval():
            columns = [jnp.asarray(points[:, a]) for a in range(len(grid))]
            if grid:
                out = jax.vmap(lambda *ids: tuple(jnp.asarray(v) for v in mapping.index_map(*ids)))(*columns)
            else:
                out = tuple(jnp.asarray(v)[None] for v in mapping.index_map())
            table = np.stack([np.broadcast_to(np.asarray(v), (points.shape[0],)) for v in out], axis=1) \
                if rank else np.zeros((points.shape[0], 0), np.int64)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerIntegerConversionError, jax.errors.UnexpectedTracerError):
        return None
    if not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"{mapping.origin}: index_map must return integers, got "
                        f"dtype {table.dtype}.")
    return table.astype(np.int64)


def check_in_bounds(mapping: BlockMapping, table: np.ndarray, grid) -> None:
    """Every block must have at least one in-bounds element (seed 000)."""
    scale = [1 if e else b for b, e in zip(mapping.block_shape, mapping.element)]
    starts = table * np.asarray(scale, np.int64).reshape(1, -1)
    limits = np.asarray([lo + d + hi for d, (lo, hi) in zip(mapping.array_shape, mapping.padding)],
                        np.int64)
    bad = (starts < 0) | (starts >= limits)
    if bad.any():
        p, dim = np.argwhere(bad)[0]
        point = tuple(int(v) for v in grid_points(grid)[p])
        raise ValueError(
            f"{mapping.origin}: at grid point {point} the index_map gives index "
            f"{tuple(int(v) for v in table[p])}, whose block starts at element "
            f"{int(starts[p, dim])} of dim {dim} (size {int(limits[dim])}); every block "
            "must have at least one in-bounds element.")


def revisited_axes(table: np.ndarray, grid: tuple[int, ...]) -> set[int]:
    """Grid axes along which two neighbouring points write the same block."""
    axes = set()
    blocks = table.reshape(*grid, table.shape[-1])
    for a, n in enumerate(grid):
        if n < 2:
            continue
        same = np.all(np.diff(blocks, axis=a) == 0, axis=-1)
        if same.any():
            axes.add(a)
    return axes


def revisited_after_leaving(table: np.ndarray) -> tuple[int, int] | None:
    """``(first_visit, revisit)`` grid-point positions if a block comes back later."""
    if table.shape[0] < 3:
        return None
    _, ids = np.unique(table, axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    run_start = np.concatenate([[True], ids[1:] != ids[:-1]])
    run_ids = ids[run_start]
    if np.unique(run_ids).size == run_ids.size:
        return None
    seen = {}
    run_positions = np.flatnonzero(run_start)
    for pos, block in zip(run_positions, run_ids):
        if block in seen:
            return int(seen[block]), int(pos)
        seen[block] = pos
    return None


def infer_semantics(revisits: set[int], grid_rank: int) -> tuple[str, ...]:
    """Arbitrary where an output block is revisited, parallel elsewhere."""
    return tuple(ARBITRARY if a in revisits else PARALLEL for a in range(grid_rank))


def execution_order(grid: tuple[int, ...], semantics: tuple[str, ...], num_cores: int,
                    shuffle_seed: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The order the interpreter runs grid points in, simulating megacore.

    Points are grouped by their indices along the parallel axes; within a
    group, arbitrary axes keep their sequential order. The outermost parallel
    axis is split into ``num_cores`` contiguous ranges, one per simulated core
    (as Mosaic splits it across TensorCores); each core runs its groups in
    row-major order, or in a seeded random order when ``shuffle_seed`` is set.

    Returns:
      ``(points [P, len(grid)], core_starts [P] bool)``: the points in
      execution order, and where each simulated core begins (its scratch
      starts as garbage there).
    """
    points = grid_points(grid)
    starts = np.zeros(points.shape[0], bool)
    parallel = [a for a, s in enumerate(semantics) if s == PARALLEL]
    if points.shape[0] == 0 or not parallel:
        starts[:1] = True
        return points, starts
    _, group = np.unique(points[:, parallel], axis=0, return_inverse=True)
    group = group.reshape(-1)
    extent = grid[parallel[0]]
    per_core = -(-extent // max(1, min(num_cores, extent)))
    core = points[:, parallel[0]] // per_core
    rank = np.arange(group.max() + 1)
    if shuffle_seed is not None:
        rank = np.random.default_rng(shuffle_seed).permutation(rank)
    # A stable sort keeps row-major (sequential) order inside each group.
    order = np.argsort(core * (group.max() + 1) + rank[group], kind="stable")
    ordered_core = core[order]
    starts[0] = True
    starts[1:] = ordered_core[1:] != ordered_core[:-1]
    return points[order], starts
