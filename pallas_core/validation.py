"""Checks run before anything is lowered; each error names the spec and the rule."""
from __future__ import annotations

import warnings

import numpy as np

from pallas_core import grid_analysis, registry
from pallas_core.params import ARBITRARY, PARALLEL
from pallas_core.signatures import arity_error, function_source
from pallas_core.specs import BlockMapping

# Which backend needs which check is what it declared when it registered
# (pallas_core.traits.BackendTraits: tile, power_of_two_blocks, sequential_grid).


def check_kernel_arity(kernel, n_in: int, n_out: int, n_scratch: int) -> None:
    """The kernel takes one Ref per input, output and scratch buffer, in that order."""
    expected = n_in + n_out + n_scratch
    why = arity_error(kernel, expected)
    if why is not None:
        raise TypeError(f"The kernel function {function_source(kernel)} is called with one Ref per "
                        f"input ({n_in}), output ({n_out}) and scratch buffer ({n_scratch}): {why}.")


def check_kernel_result(kernel, result) -> None:
    """Kernels write their outputs to Refs; a returned value is a mistake."""
    if result is not None:
        raise ValueError(f"The kernel function of pallas_call {function_source(kernel)} should "
                         f"return None (it "
                         f"writes its outputs to the output Refs), but it returned {result!r}.")


def check_tpu_tiling(m: BlockMapping, tile: tuple[int, int] = (8, 128)) -> None:
    """Mosaic TPU (a backend whose traits declare a ``tile``, (8, 128) there): the
    last two block dims divisible by ``tile`` or equal to the array's; rank-1
    blocks divisible by ``tile[1] * (32 / bitwidth)`` or whole."""
    rank = len(m.block_shape)
    if rank == 0:
        return
    bits = np.dtype(m.dtype).itemsize * 8
    if rank == 1:
        unit = tile[1] * max(1, 32 // bits)
        b, d = m.block_shape[0], m.array_shape[0]
        if not (m.squeezed[0] or b == d or b % unit == 0):
            raise ValueError(
                f"{m.origin}: block_shape {m.block_shape} for an array of shape "
                f"{m.array_shape} ({np.dtype(m.dtype).name}) breaks the TPU tiling rule: a "
                f"rank-1 block must equal the array dim or be divisible by {unit}.")
        return
    for axis, unit in ((rank - 2, tile[0]), (rank - 1, tile[1])):
        b, d, sq = m.block_shape[axis], m.array_shape[axis], m.squeezed[axis]
        if sq or b == d or b % unit == 0:
            continue
        raise ValueError(
            f"{m.origin}: block_shape {m.block_shape} for an array of shape "
            f"{m.array_shape} breaks the TPU tiling rule: the last two block dims must "
            f"be divisible by {tile[0]} and {tile[1]} respectively or equal the array's "
            f"(dim {axis} is {b}).")


def check_pow2(m: BlockMapping, backend: str) -> None:
    """Triton operates on power-of-two tiles.

    A block dim equal to the whole array dim is exempt: kernels walk such a
    dim in power-of-two ``pl.ds`` slices (the usual GPU pattern for a
    contraction or a sequence), never loading it whole.
    """
    for axis, (b, sq) in enumerate(zip(m.block_shape, m.squeezed)):
        if not sq and b & (b - 1) and b != m.array_shape[axis]:
            raise ValueError(
                f"{m.origin}: block_shape {m.block_shape} has dim {axis} = {b}, which is "
                f"not a power of two; the {backend} backend needs power-of-two blocks "
                "(pick another block size, or use backend='triton', which pads blocks "
                "to powers of two and masks).")


def resolve_semantics(given, out_tables, grid, backend, uses_atomics=lambda: False) -> tuple[str, ...]:
    """Checks given dimension_semantics against the output index maps, or infers them.

    A ``"parallel"`` axis along which an output block is revisited is accepted,
    as JAX accepts it; :func:`outputs_kept_along_parallel_axes` warns about it.

    Raises:
      ValueError: wrong length; an output block revisited after being left;
        on backends without sequential axes (``sequential_grid`` False in
        their traits), any revisited output block.
    """
    rank = len(grid)
    if given is not None and len(given) != rank:
        raise ValueError(
            f"dimension_semantics {given} has {len(given)} entries but the grid {grid} "
            f"has rank {rank}; give one of {(PARALLEL, ARBITRARY)} per grid axis.")
    revisits: set[int] = set()
    for origin, table in out_tables:
        if table is None:
            continue
        axes = grid_analysis.revisited_axes(table, grid)
        revisits |= axes
        again = grid_analysis.revisited_after_leaving(table)
        if again is not None:
            first, later = again
            raise ValueError(
                f"{origin}: output block {table.block_at(later)} is "
                f"written at grid point {first}, left, and revisited at {later}; an output "
                "block may only be revisited on consecutive grid points, so reductions "
                "must run over the minor-most (last) grid axes (docs/pallas_core.md section 5).")
    if not registry.traits(backend).sequential_grid and revisits:
        raise ValueError(
            f"backend {backend!r} runs every grid point concurrently, but an output block "
            f"is revisited along grid axes {sorted(revisits)}; move the reduction inside "
            "the kernel (a loop over pl.ds slices) or use a backend with sequential axes.")
    if given is not None:
        return tuple(given)
    return grid_analysis.infer_semantics(revisits, rank)


def outputs_kept_along_parallel_axes(out_tables, grid, semantics, uses_atomics=lambda: False
                                     ) -> tuple[int, ...]:
    """The outputs whose block index stays the same along a ``"parallel"`` axis.

    JAX accepts them: on a megacore TPU each core keeps its own copy of such a
    block in VMEM and writes it back when it leaves it, so the copy written
    last wins (splash attention keeps per-head running statistics this way,
    reinitialised by each program that uses them). It is a write race if the
    kernel means to accumulate into the block across that axis, so each one is
    reported with a :class:`UserWarning` naming the spec and the axis, unless
    the kernel updates memory through ``pallas_core.triton`` atomics
    (``uses_atomics()``). Returns their positions among the outputs.
    """
    kept = []
    for o, (origin, table) in enumerate(out_tables):
        if table is None:
            continue
        parallel = sorted(a for a in grid_analysis.revisited_axes(table, grid)
                          if semantics[a] == PARALLEL)
        if parallel and not uses_atomics():
            kept.append(o)
            warnings.warn(
                f"{origin}: the output block stays the same along grid axis {parallel[0]}, "
                "which is marked 'parallel': each core keeps its own copy of the block and "
                "the copies are written back in order, the last one winning (a write race "
                "if the kernel accumulates into it across that axis: mark the axis "
                "'arbitrary' for that).", UserWarning, stacklevel=4)
    return tuple(kept)
