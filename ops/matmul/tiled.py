"""The tiled-matmul core: one tile loop for every matmul-shaped kernel.

``fused_matmul`` (forward, ``dx``, ``dw``), ``linear_cross_entropy`` (the
logits tiles of its forward and of its backward's ``dz`` kernel, the ``dx`` /
``dw`` products), the gated linear unit and the grouped matmul of ``ragged_dot``
all compute an
output tile ``A @ B`` of ``block_m x block_n`` in a float32 accumulator,
walking the contraction in ``block_k`` steps, then hand the accumulator to an
epilogue that does the op's own work (bias and activation, a softmax
gradient, a masked store) before the single store. This module is that
walk; the ops keep only their epilogues and their tile choices.

The algorithm is the classic tiled matmul (Triton's tutorial "Matrix
Multiplication"; the templated matmul of the Pallas design notes). The
contraction is walked one of two ways (:func:`strategy`):

* ``"grid"`` (interpret, mosaic_tpu, triton): K is the last grid axis,
  marked ``"arbitrary"``; the accumulator is a scratch buffer initialised
  under ``pl.when(k == 0)`` and handed to the epilogue under
  ``pl.when(k == last)`` (docs/pallas_core.md section 5). Our Triton
  lowering runs that axis as a loop inside each program with the
  accumulator in registers (docs/pallas_core.md section 11, loop peeling),
  which Triton pipelines like its own tutorial matmul.
* ``"loop"`` (pallas_triton, whose programs all run concurrently, and
  kernels whose trip count depends on data): each program loads ``pl.ds``
  slices of full-K blocks in a ``fori_loop``.

A contraction that ``block_k`` does not divide is handled one of two ways
(``k_edge``): ``"pad"`` zero-pads both operands to whole blocks (a copy,
made only when K does not divide), ``"mask"`` zeroes the elements past K
inside the tile (no copy; the loop walk then reads full blocks ``K`` wide,
or the next power of two when ``block_k`` does not divide K).

Several products per tile (:func:`products_call`, on
:func:`grid_accumulate_products` / :func:`loop_accumulate_products`, of which the
one-product walks are the special case): operands listed once, products naming
which left and right operand add into which accumulator, a left tile shared by
several products read once per step: the gated linear unit's forward (two
accumulators on one x tile) and its paired backward's ``dx`` (two products into
one accumulator) and ``dw`` (two accumulators on one ``x^T`` tile).

Row tiles through a table (:class:`RowTable`): instead of the identity,
the first grid axis can walk a table of visits held in scalar memory
(``PrefetchScalarGridSpec``): visit ``v`` reads the row block
``row_block(v)`` of A and of the outputs and the slice ``b_index(v)`` of a
batched ``B [G, ...]``, and may be skipped (``active(v)`` false: no
product, the epilogue sees zeros). The grouped matmul builds that table on
the device from the group sizes.

Epilogue subtiles (``epilogue_subtile``, :func:`subtiled`): the float32
accumulator split along N into 2 or 4 pieces, each run through the epilogue
and stored before the next (the ``EPILOGUE_SUBTILE`` option of Triton's
persistent TMA matmul tutorial); with TMA each piece is one descriptor store.
Off by default; what it buys (bf16, bias + gelu, 8 warps, 3 stages, sm_90;
registers / spilled bytes / shared memory from ``pl.triton.compile``;
"training": the forward that also stores the pre-activation)::

    tile                 inference       training          TMA             TMA, persistent(132)
    128x128              104 / 0 / 96K   118 / 0 / 96K     94 / 0 / 96K    108 / 0 / 128K
    128x256 whole        181 / 0 / 144K  255 / 272 / 144K  255 / 0 / 144K  255 / 160 / 208K
    128x256 in halves    175 / 0 / 144K  224 / 0 / 144K    172 / 0 / 144K  172 / 0 / 176K
    128x256 in quarters  184 / 0 / 144K  196 / 0 / 144K    172 / 0 / 144K  169 / 0 / 160K

(Measured before gelu's tanh moved to a reciprocal form, which took the training
forward in halves from 216 to 224 registers; the static gate holds the current figure.)

The K loop takes 83 SASS instructions per 128 x 128 x 64 step and 97-99 per
128 x 256 x 64 step (0.6x per FLOP); pieces cost 1-3% more epilogue
instructions (inference: 4888 in halves against 4744 whole). So the tuner's
128 x 256 candidates run in halves or quarters
(:class:`ops.matmul.config.MatmulConfig`), and the heuristic keeps whole
128 x 128 tiles: the wider tile holds about twice the registers per thread
(one block per SM instead of two), a trade only a GPU's timing can settle.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from pallas_core.triton import backend as triton_backend
from ops._tiles import dot, mosaic_tpu_matmul_blocks

GRID = "grid"
LOOP = "loop"

# How an epilogue operand's blocks follow the output tile (i, j).
ROWS = "rows"  # an [M, w] array: block (block_m, w) at (i, 0)
COLS = "cols"  # an [h, N] array: block (h, block_n) at (0, j)

# How many pieces an output tile's epilogue may be split into along N (matmul_call).
SUBTILES = (1, 2, 4)


def strategy(backend: str) -> str:
    """How the contraction is walked on ``backend``: ``"loop"`` where grid points run
    concurrently (pallas_triton, JAX's lowering:
    ``pl.backend_traits(backend).sequential_grid`` false), else ``"grid"`` (our
    Triton lowering runs the contraction axis as a loop itself)."""
    return GRID if pl.backend_traits(backend).sequential_grid else LOOP


def default_num_warps(block_m: int, block_n: int) -> int:
    """8 warps once a float32 accumulator tile reaches 128x128 (64 KiB of registers), else 4."""
    return 8 if block_m * block_n >= 128 * 128 else 4


def pad_axis(x, axis: int, size: int):
    """``x`` zero-padded along ``axis`` to ``size`` (``x`` itself when it has that size)."""
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads)


# --------------------------------------------------------------------------
# The product of one K step, and the two walks
# --------------------------------------------------------------------------

def product(a, b, ca: int, cb: int, k0=None, k_size=None, k_lo=None):
    """``A @ B`` of one K step in float32 (:func:`ops._tiles.dot`). With
    ``k_size`` (an int, or traced), the elements of a (along ``ca``) and b
    (along ``cb``) at contraction positions ``k0 + index >= k_size`` (block
    padding, whose values are unspecified, or rows past a group's end) are
    zeroed first; with ``k_lo`` too, those below ``k_lo``."""
    if k_size is not None:
        a = _zero_outside(a, ca, k0, k_lo, k_size)
        b = _zero_outside(b, cb, k0, k_lo, k_size)
    return dot(a, b, ca, cb)


def _zero_outside(x, axis, start, lo, hi):
    pos = start + lax.broadcasted_iota(jnp.int32, x.shape, axis)
    keep = pos < hi
    if lo is not None:
        keep = keep & (pos >= lo)
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _k_slice(ref, contract_dim: int, k, block_k: int, other=None, keep=None, lead=()):
    """One ``block_k`` step of a two-dimensional Ref (after the ``lead`` indices of a
    batched one) along ``contract_dim``; the other dim whole, or ``other`` (a
    ``pl.ds``). ``keep(shape, axis)``: a masked load (zeros elsewhere)."""
    idx = [slice(None), slice(None)]
    idx[contract_dim] = pl.ds(k * block_k, block_k)
    if other is not None:
        idx[1 - contract_dim] = other
    if keep is None:
        return ref[(*lead, *idx)]
    shape = list(ref.shape[len(lead):])
    shape[contract_dim] = block_k
    if other is not None:
        shape[1 - contract_dim] = other.size
    return pl.load(ref, (*lead, *idx), mask=keep(tuple(shape), contract_dim), other=0)


def loop_accumulate(a_ref, b_ref, *, ca: int, cb: int, block_k: int, num_k, out_shape,
                    k_size=None, b_cols=None, first_k=0, k_lo=None, masked_loads: bool = False,
                    b_lead=()):
    """The loop walk: ``sum_k A[k] @ B[k]`` over ``num_k`` steps of ``block_k``
    (a static int, or a traced trip count) from full-K Refs, float32
    ``out_shape``. ``k_size`` / ``k_lo``: mask the contraction outside
    ``[k_lo, k_size)`` (:func:`product`; with ``masked_loads`` by the loads'
    masks instead, which costs no instructions beside the load on a GPU);
    ``b_cols``: a ``pl.ds`` of b's free dim (a tile of a wider block);
    ``b_lead``: leading indices of a batched b Ref (its matrix picked in the
    kernel); ``first_k``: the first step (traced or not: a group's first row
    tile). One static step runs without a loop. The one-product case of
    :func:`loop_accumulate_products`."""
    (acc,) = loop_accumulate_products(
        [(a_ref, b_ref, 0)], num_accs=1, ca=ca, cb=cb, block_k=block_k, num_k=num_k,
        out_shape=out_shape, k_size=k_size, b_cols=b_cols, first_k=first_k, k_lo=k_lo,
        masked_loads=masked_loads, b_lead=b_lead)
    return acc


def loop_accumulate_products(products, *, num_accs: int, ca: int, cb: int, block_k: int, num_k,
                             out_shape, k_size=None, b_cols=None, first_k=0, k_lo=None,
                             masked_loads: bool = False, b_lead=()) -> tuple:
    """The loop walk of several products: ``products`` is a sequence of ``(a_ref, b_ref,
    j)``, each adding ``A[k] @ B[k]`` to float32 accumulator ``j`` of ``num_accs`` at every
    step (a left-operand Ref shared by several products is sliced once per step, as the
    gated linear unit's x tile feeding its gate and up accumulators); returns the
    accumulators. The other arguments as :func:`loop_accumulate`'s."""
    def step(k, accs):
        k = k + first_k if not (isinstance(first_k, int) and first_k == 0) else k
        keep = None
        if masked_loads and k_size is not None:
            def keep(shape, axis):
                pos = k * block_k + lax.broadcasted_iota(jnp.int32, shape, axis)
                inside = pos < k_size
                return inside if k_lo is None else inside & (pos >= k_lo)
        accs, a_tiles = list(accs), {}

        def a_tile(ref):
            if id(ref) not in a_tiles:
                a_tiles[id(ref)] = _k_slice(ref, ca, k, block_k, keep=keep)
            return a_tiles[id(ref)]

        if len(products) > 1:  # the left tiles first, then each product's right tile
            for a_ref, _, _ in products:
                a_tile(a_ref)
        for a_ref, b_ref, j in products:
            a = a_tile(a_ref)
            b = _k_slice(b_ref, cb, k, block_k, b_cols, keep=keep, lead=b_lead)
            if keep is not None:
                accs[j] = accs[j] + product(a, b, ca, cb)
                continue
            k0 = k * block_k if k_size is not None else None
            accs[j] = accs[j] + product(a, b, ca, cb, k0, k_size, k_lo)
        return tuple(accs)

    init = (jnp.zeros(out_shape, jnp.float32),) * num_accs
    if isinstance(num_k, int) and num_k == 1:
        return step(0, init)
    return lax.fori_loop(0, num_k, step, init)


def grid_accumulate(a_ref, b_ref, acc_ref, finish: Callable[[Any], None], *, ca: int, cb: int,
                    k_axis: int, block_k: int, k_size=None, active=None, first=None, last=None,
                    k0=None, k_lo=None):
    """The grid walk, one step of it: grid axis ``k_axis`` is the contraction.
    Zeroes ``acc_ref`` on the first step, adds this step's product, and calls
    ``finish(acc)`` with the float32 accumulator on the last. ``active``: a
    traced predicate; where false the product is skipped (``finish`` sees
    zeros). ``first`` / ``last``: traced predicates replacing "the axis's
    first / last step" (a reduction that restarts along the axis, as over
    groups); ``k0``: the contraction offset of this step's block (default
    ``k * block_k``) and ``k_lo``, for masking (:func:`product`)."""
    grid_accumulate_products([(a_ref, b_ref, acc_ref)], lambda accs: finish(accs[0]), ca=ca, cb=cb,
                             k_axis=k_axis, block_k=block_k, k_size=k_size, active=active,
                             first=first, last=last, k0=k0, k_lo=k_lo)


def grid_accumulate_products(products, finish: Callable[[list], None], *, ca: int, cb: int,
                             k_axis: int, block_k: int, k_size=None, active=None, first=None,
                             last=None, k0=None, k_lo=None):
    """The grid walk of several products: ``products`` is a sequence of ``(a_ref, b_ref,
    acc_ref)``, each adding this step's ``A @ B`` to its scratch accumulator (a left-operand
    Ref shared by several products is loaded once per step); ``finish`` gets the
    accumulators' values, each once, in the order the products name them. The other
    arguments as :func:`grid_accumulate`'s."""
    k = pl.program_id(k_axis)
    accs = list({id(acc): acc for _, _, acc in products}.values())

    @pl.when(k == 0 if first is None else first)
    def _init():
        for acc in accs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    def accumulate():
        start = k0 if k0 is not None else (k * block_k if k_size is not None else None)
        a_tiles = {}

        def a_tile(ref):
            if id(ref) not in a_tiles:
                a_tiles[id(ref)] = ref[...]
            return a_tiles[id(ref)]

        if len(products) > 1:  # the left tiles first, then each product's right tile
            for a_ref, _, _ in products:
                a_tile(a_ref)
        for a_ref, b_ref, acc_ref in products:
            acc_ref[...] += product(a_tile(a_ref), b_ref[...], ca, cb, start, k_size, k_lo)

    if active is None:
        accumulate()
    else:
        pl.when(active)(accumulate)

    @pl.when(k == pl.num_programs(k_axis) - 1 if last is None else last)
    def _finish():
        finish([acc[...] for acc in accs])


# --------------------------------------------------------------------------
# Epilogue subtiles: the accumulator's columns in pieces
# --------------------------------------------------------------------------

def subtile_parts(parts: int | None, block_n: int, backend: str) -> int:
    """How many column pieces the epilogue of a ``block_n``-wide tile runs in on
    ``backend`` when ``parts`` (None or one of :data:`SUBTILES`) are asked for: the
    whole tile (1) unless ``parts`` divides ``block_n`` into pieces the backend
    slices without copies: powers of two on the Triton backends (``tl.split``
    halves), multiples of the lane tiling on mosaic_tpu (128;
    ``pl.backend_traits(backend).tile``)."""
    parts = parts or 1
    if parts == 1 or block_n % parts:
        return 1
    traits = pl.backend_traits(backend)
    if traits.triton and pl.next_power_of_2(block_n) != block_n:
        return 1
    if (block_n // parts) % traits.tile[1]:
        return 1
    return parts


def subtiled(epilogue: Callable[[Any, TileRefs], None], parts: int, roles: Sequence[str]):
    """``epilogue`` run on ``parts`` column pieces of the tile in turn: the float32
    accumulator split along N (``jnp.split``: register pieces on Triton, as the
    ``EPILOGUE_SUBTILE`` option of Triton's persistent matmul tutorial), the
    outputs and the :data:`COLS` operands (``roles``: each extra's) narrowed to the
    piece's columns (``Ref.at``), :attr:`TileRefs.col_offset` set. Each piece is
    stored before the next is computed, so fewer values are live and the store's
    layout conversion needs a piece's shared memory, not the tile's."""
    if parts == 1:
        return epilogue

    def run(acc, refs: TileRefs):
        width = acc.shape[1] // parts
        for p, piece in enumerate(jnp.split(acc, parts, axis=1)):
            cols = pl.ds(p * width, width)
            extras = tuple(r.at[:, cols] if role == COLS else r for r, role in zip(refs.extras, roles))
            outs = tuple(r.at[:, cols] for r in refs.outs)
            epilogue(piece, dataclasses.replace(refs, extras=extras, outs=outs,
                                                col_offset=refs.col_offset + p * width))
    return run


# --------------------------------------------------------------------------
# The pallas_call: A @ B tiled over (rows, columns[, K]) with an epilogue
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RowTable:
    """Row tiles walked through tables in scalar memory (scalar prefetch).

    Attributes:
      tables: int32 arrays passed as scalar-prefetch operands; every index
        map and the kernel receive their Refs after the program ids.
      num_visits: the extent of the first grid axis (a static bound; visits
        past the table's real length should be inactive).
      row_block: ``row_block(v, *tables) -> int``: the row block of A and of
        the outputs that visit ``v`` works on.
      b_index: ``b_index(v, *tables) -> int`` or None: the leading index of a
        batched ``B [G, ...]`` (its block squeezed), None for a plain B.
      active: ``active(v, *tables) -> bool`` or None: visits where it is
        false skip the product (the epilogue sees a zero accumulator).
    """

    tables: tuple
    num_visits: int
    row_block: Callable
    b_index: Callable | None = None
    active: Callable | None = None


@dataclasses.dataclass(frozen=True)
class TileRefs:
    """What an epilogue sees besides the accumulator: the scalar-prefetch
    Refs (a :class:`RowTable`'s tables), the epilogue operands' Refs (in the
    order given) and the output Refs.

    With an epilogue subtile (:func:`matmul_call`'s ``epilogue_subtile``) the
    epilogue runs once per piece of the tile's columns: the output Refs and the
    :data:`COLS` operands' Refs are then views of that piece's columns, and
    ``col_offset`` is the piece's first column within the tile (0 for a whole
    tile): an epilogue that computes column indices adds it."""

    scalars: tuple
    extras: tuple
    outs: tuple
    row_axis: int = 0  # the grid axis of the row tiles (visits): pl.program_id(row_axis)
    col_offset: int = 0


def _grid_kernel(*refs, ca, cb, block_k, k_size, num_scalars, num_extras, num_outs, epilogue,
                 active, row_axis):
    scalars = refs[:num_scalars]
    a_ref, b_ref = refs[num_scalars:num_scalars + 2]
    rest = refs[num_scalars + 2:]
    extras, outs, (acc_ref,) = (rest[:num_extras], rest[num_extras:num_extras + num_outs],
                                rest[num_extras + num_outs:])
    tile = TileRefs(tuple(scalars), tuple(extras), tuple(outs), row_axis)
    is_active = None if active is None else active(pl.program_id(row_axis), *scalars)
    grid_accumulate(a_ref, b_ref, acc_ref, lambda acc: epilogue(acc, tile), ca=ca, cb=cb,
                    k_axis=2, block_k=block_k, k_size=k_size, active=is_active)


def _loop_kernel(*refs, ca, cb, block_k, num_k, k_size, num_scalars, num_extras, num_outs,
                 epilogue, active, tile_shape, row_axis):
    scalars = refs[:num_scalars]
    a_ref, b_ref = refs[num_scalars:num_scalars + 2]
    rest = refs[num_scalars + 2:]
    extras, outs = rest[:num_extras], rest[num_extras:num_extras + num_outs]
    trips = num_k
    if active is not None:
        trips = jnp.where(active(pl.program_id(row_axis), *scalars), num_k, 0)
    acc = loop_accumulate(a_ref, b_ref, ca=ca, cb=cb, block_k=block_k, num_k=trips,
                          out_shape=tile_shape, k_size=k_size)
    epilogue(acc, TileRefs(tuple(scalars), tuple(extras), tuple(outs), row_axis))


def launch_params(walk: str, backend: str, blocks: tuple[int, int, int], *,
                  num_warps: int | None = None, num_stages: int | None = None,
                  group_size: int | None = None):
    """Compiler params of a :func:`matmul_call`: on our Triton lowering (``triton``,
    grid walk) the launch parameters with the grid's semantics, on the loop walk Triton's
    warps and stages (pallas_triton reads them, the others ignore them), else
    the grid's semantics only. None takes the heuristic's: warps by tile
    (:func:`default_num_warps`), 3 stages, grouped program order in bands of
    8 row blocks (L2 reuse, Triton's tutorial)."""
    num_warps = num_warps or default_num_warps(blocks[0], blocks[1])
    num_stages = num_stages or 3
    semantics = (pl.PARALLEL, pl.PARALLEL, pl.ARBITRARY)
    if walk == GRID:
        traits = pl.backend_traits(backend)
        if traits.triton and not traits.through_jax:
            return pl.triton.CompilerParams(num_warps=num_warps, num_stages=num_stages,
                                            group_size=group_size or 8,
                                            dimension_semantics=semantics)
        return pl.CompilerParams(semantics)
    return pl.triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def loop_k_width(k: int, block_k: int, k_edge: str) -> int:
    """The width of the loop walk's full-K blocks: whole blocks when padded;
    masked, K itself when ``block_k`` divides it, else its next power of two
    (every step stays inside the block)."""
    if k_edge == "pad" or k % block_k == 0:
        return max(1, pl.cdiv(k, block_k)) * block_k
    return pl.next_power_of_2(k)


def matmul_call(a, b, *, ca: int, cb: int, blocks: tuple[int, int, int], backend: str,
                out_shape: Sequence[jax.ShapeDtypeStruct],
                epilogue: Callable[[Any, TileRefs], None],
                extras: Sequence[tuple[Any, str]] = (), walk: str | None = None,
                k_edge: str = "pad", compiler_params=None, rows: RowTable | None = None,
                cols_outer: bool = False, epilogue_subtile: int | None = None,
                name: str = "matmul"):
    """``A @ B`` tiled into ``block_m x block_n`` outputs, each handed to ``epilogue``.

    Args:
      a: a two-dimensional array; A is a contracting its dim ``ca``
        (``A [M, K]``).
      b: a two-dimensional array contracting its dim ``cb`` (``B [K, N]``),
        or with ``rows.b_index`` a batched ``[G, ...]`` whose trailing two
        dims are that.
      blocks: ``(block_m, block_n, block_k)``.
      backend: a pallas_core backend.
      out_shape: the outputs, each ``[M, N]``, tiled like the accumulator.
      epilogue: ``epilogue(acc, refs)`` with the float32 ``[block_m,
        block_n]`` accumulator and a :class:`TileRefs`; it writes the outputs.
        Rows and columns of an edge tile past M / N hold unspecified values,
        and their stores are discarded.
      extras: epilogue operands ``(array, ROWS | COLS)`` (:data:`ROWS`:
        ``[M, w]`` read as ``[block_m, w]`` row blocks; :data:`COLS`:
        ``[h, N]`` read as ``[h, block_n]`` column blocks).
      walk: ``"grid"`` or ``"loop"``; None: :func:`strategy` of the backend.
      k_edge: ``"pad"`` or ``"mask"``: see the module docstring.
      compiler_params: None for :func:`launch_params` of the walk with the
        heuristic's warps and stages.
      rows: a :class:`RowTable`, or None for row blocks ``0 .. cdiv(M,
        block_m) - 1``.
      cols_outer: the grid is (column tiles, row tiles[, K]) instead of (row
        tiles, column tiles[, K]): consecutive row visits of one column then
        revisit an output block back to back (a sequential grid keeps it,
        so visits of one tile can each store their own rows into it).
      epilogue_subtile: None or 1 (the epilogue sees the whole tile), 2 or 4:
        the epilogue runs on that many column pieces of the tile in turn
        (:func:`subtiled`), where the backend can split ``block_n`` so
        (:func:`subtile_parts`; else the whole tile). Results do not depend on it.
      name: the kernel's name.

    Returns:
      The list of outputs. An empty contraction still runs one (zero) step,
      so the epilogue sees a zero accumulator.
    """
    walk = walk or strategy(backend)
    bm, bn, bk = blocks
    b_batched = rows is not None and rows.b_index is not None
    b2 = b.shape[1:] if b_batched else b.shape
    m, n, k = a.shape[1 - ca], b2[1 - cb], a.shape[ca]
    # At least one step: an empty contraction (K == 0, or M == 0 in dw) still
    # owes the epilogue its zero accumulator.
    num_k = max(1, pl.cdiv(k, bk))
    k_size = None
    if k_edge == "pad":
        kp = num_k * bk
        a = pad_axis(a, ca, kp)
        b = pad_axis(b, cb + (1 if b_batched else 0), kp)
    elif k % bk:
        k_size = k
    num_rows = rows.num_visits if rows is not None else pl.cdiv(m, bm)
    grid_mn = (pl.cdiv(n, bn), num_rows) if cols_outer else (num_rows, pl.cdiv(n, bn))
    row_axis = 1 if cols_outer else 0
    scalars = tuple(rows.tables) if rows is not None else ()
    row_of = rows.row_block if rows is not None else (lambda i, *s: i)

    def indexed(fn):
        """An index map over (i, j, [k], *scalar Refs) in the grid's order."""
        def index_map(*args):
            (i, j) = (args[1], args[0]) if cols_outer else (args[0], args[1])
            rest = args[2:]
            ks, ss = rest[:len(rest) - len(scalars)], rest[len(rest) - len(scalars):]
            return fn(i, j, ks, ss)
        return index_map

    def operand_block(free, contract_dim, free_idx, k_idx, k_block):
        shape, index = [0, 0], [0, 0]
        shape[1 - contract_dim], shape[contract_dim] = free, k_block
        index[1 - contract_dim], index[contract_dim] = free_idx, k_idx
        return tuple(shape), tuple(index)

    def a_spec(k_block, k_index):
        return pl.BlockSpec(operand_block(bm, ca, 0, 0, k_block)[0], indexed(
            lambda i, j, ks, ss: operand_block(bm, ca, row_of(i, *ss), k_index(ks), k_block)[1]))

    def b_spec(k_block, k_index):
        shape = operand_block(bn, cb, 0, 0, k_block)[0]

        def index_map(i, j, ks, ss):
            index = operand_block(bn, cb, j, k_index(ks), k_block)[1]
            return (rows.b_index(i, *ss), *index) if b_batched else index
        return pl.BlockSpec((None, *shape) if b_batched else shape, indexed(index_map))

    def extra_spec(array, role):
        if role == ROWS:
            return pl.BlockSpec((bm, array.shape[1]),
                                indexed(lambda i, j, ks, ss: (row_of(i, *ss), 0)))
        if role == COLS:
            return pl.BlockSpec((array.shape[0], bn), indexed(lambda i, j, ks, ss: (0, j)))
        raise ValueError(f"extras: role must be {ROWS!r} or {COLS!r}, got {role!r}.")

    out_spec = pl.BlockSpec((bm, bn), indexed(lambda i, j, ks, ss: (row_of(i, *ss), j)))
    epilogue = subtiled(epilogue, subtile_parts(epilogue_subtile, bn, backend),
                        [role for _, role in extras])
    kw = dict(ca=ca, cb=cb, block_k=bk, k_size=k_size, num_scalars=len(scalars),
              num_extras=len(extras), num_outs=len(out_shape), epilogue=epilogue,
              active=rows.active if rows is not None else None, row_axis=row_axis)
    if walk == GRID:
        kernel = functools.partial(_grid_kernel, **kw)
        grid = (*grid_mn, num_k)
        in_specs = [a_spec(bk, lambda ks: ks[0]), b_spec(bk, lambda ks: ks[0])]
        scratch = [pl.tpu.VMEM((bm, bn), jnp.float32)]
    else:
        width = loop_k_width(a.shape[ca], bk, k_edge)
        kernel = functools.partial(_loop_kernel, num_k=num_k, tile_shape=(bm, bn), **kw)
        grid = grid_mn
        in_specs = [a_spec(width, lambda ks: 0), b_spec(width, lambda ks: 0)]
        scratch = []
    in_specs += [extra_spec(array, role) for array, role in extras]
    if compiler_params is None:
        compiler_params = launch_params(walk, backend, blocks)
    operands = (a, b, *(array for array, _ in extras))
    if rows is not None:
        grid_spec = pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=grid, in_specs=in_specs,
            out_specs=[out_spec] * len(out_shape), scratch_shapes=scratch)
        call = pl.pallas_call(kernel, out_shape=list(out_shape), grid_spec=grid_spec,
                              compiler_params=compiler_params, backend=backend, name=name)
        return call(*scalars, *operands)
    call = pl.pallas_call(kernel, out_shape=list(out_shape), grid=grid, in_specs=in_specs,
                          out_specs=[out_spec] * len(out_shape), scratch_shapes=scratch,
                          compiler_params=compiler_params, backend=backend, name=name)
    return call(*operands)


# --------------------------------------------------------------------------
# Several operands and products per tile: products_call
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of :func:`products_call`.

    Attributes:
      array: two-dimensional, or ``[., 2, .]`` with ``half`` picking its middle index
        (squeezed from the block: the stacked gate / up weights of a gated linear unit).
      rows: the free dim follows the output tile's rows (a left operand), else its
        columns (a right operand).
      contract: the contracted matrix dim, 0 or 1.
      half: the middle index of a ``[., 2, .]`` array, or None.
      offset: column blocks start this many blocks in (the up half of a ``[K, 2N]`` view).
    """

    array: Any
    rows: bool
    contract: int
    half: int | None = None
    offset: int = 0


def _operand_spec(op: Operand, tile: tuple[int, int], block_c: int):
    """The operand's BlockSpec: the free dim in tiles of the output's rows or columns,
    the contraction in ``block_c`` steps (grid walk: grid axis 2) or whole (loop walk)."""
    shape = [0, 0]
    shape[op.contract], shape[1 - op.contract] = block_c, tile[0 if op.rows else 1]

    def index_map(i, j, kk=0):
        index = [0, 0]
        index[op.contract] = kk
        # (no "+ 0": the index map's trace, so the generated code, stays the plain one)
        index[1 - op.contract] = i if op.rows else (j + op.offset if op.offset else j)
        return tuple(index) if op.half is None else (index[0], op.half, index[1])

    if op.half is not None:
        return pl.BlockSpec((shape[0], None, shape[1]), index_map)
    return pl.BlockSpec(tuple(shape), index_map)


def products_out_spec(stacked: bool, tile: tuple[int, int]):
    """The BlockSpec of a :func:`products_call` output tile: ``[M, N]``, or with ``stacked``
    an ``[M, 2, N]`` array whose block holds both halves of a column tile."""
    if stacked:  # an [M, 2, N] array, both halves of a column tile in one block
        return pl.BlockSpec((tile[0], 2, tile[1]), lambda i, j, kk=0: (i, 0, j))
    return pl.BlockSpec(tile, lambda i, j, kk=0: (i, j))


def _product_pairs(ins, products, num_accs, accs):
    """``(a_ref, b_ref, accumulator)`` per product, product ``p`` adding to accumulator
    ``min(p, num_accs - 1)``."""
    return [(ins[a], ins[b], accs[min(p, num_accs - 1)]) for p, (a, b) in enumerate(products)]


def _products_grid_kernel(*refs, num_in, products, num_accs, ca, cb, block_k, k_size, finish):
    ins, outs, accs = refs[:num_in], refs[num_in:len(refs) - num_accs], refs[len(refs) - num_accs:]
    grid_accumulate_products(_product_pairs(ins, products, num_accs, accs),
                             lambda values: finish(values, outs), ca=ca, cb=cb, k_axis=2,
                             block_k=block_k, k_size=k_size)


def _products_loop_kernel(*refs, num_in, products, num_accs, ca, cb, block_k, k_size, finish,
                          num_k, tile):
    ins, outs = refs[:num_in], refs[num_in:]
    accs = loop_accumulate_products(_product_pairs(ins, products, num_accs, range(num_accs)),
                                    num_accs=num_accs, ca=ca, cb=cb, block_k=block_k, num_k=num_k,
                                    out_shape=tile, k_size=k_size)
    finish(list(accs), outs)


def products_call(operands: Sequence[Operand], products, *, num_accs: int, tile, block_k: int,
                  k: int, backend: str, walk: str, out_shapes, stacked_outs, finish,
                  compiler_params, name: str, k_edge: str):
    """One pallas_call over output tiles ``tile`` of ``out_shapes``: the sum over the
    contraction ``k`` (steps of ``block_k``, on the core's walks:
    :func:`grid_accumulate_products` / :func:`loop_accumulate_products`) of ``A @ B`` for
    each ``(a, b)`` of ``products`` (indices into ``operands``; product ``p`` adds to
    accumulator ``min(p, num_accs - 1)``), then ``finish(accs, out_refs)``.

    What :func:`matmul_call` is for one product, this is for several sharing a tile
    loop: the gated linear unit's forward (``x @ gate`` and ``x @ up`` into two
    accumulators on one x tile), its paired backward's ``dx`` (two products into one
    accumulator) and ``dw`` (two accumulators on one ``x^T`` tile).

    Args:
      operands: the :class:`Operand`\\ s; every left operand contracts the same dim, and
        every right operand another.
      stacked_outs: per output, whether it is an ``[M, 2, N]`` array (both halves of a
        column tile in one block) rather than ``[M, N]``.
      k_edge: a contraction ``block_k`` does not divide is ``"pad"``-ded by the caller or
        ``"mask"``-ed in the kernel (no copy of the operands).
      walk, backend, compiler_params, name: as :func:`matmul_call`'s.
    """
    a_ops = {a for a, _ in products}
    ca = operands[min(a_ops)].contract
    cb = operands[products[0][1]].contract
    num_k = max(1, pl.cdiv(k, block_k))
    k_size = k if k_edge == "mask" and k % block_k else None
    kw = dict(num_in=len(operands), products=tuple(products), num_accs=num_accs, ca=ca, cb=cb,
              block_k=block_k, k_size=k_size, finish=finish)
    grid_mn = (pl.cdiv(out_shapes[0].shape[0], tile[0]), pl.cdiv(out_shapes[0].shape[-1], tile[1]))
    if walk == GRID:
        body = functools.partial(_products_grid_kernel, **kw)
        grid, block_c = (*grid_mn, num_k), block_k
        scratch = [pl.tpu.VMEM(tile, jnp.float32)] * num_accs
    else:
        body = functools.partial(_products_loop_kernel, num_k=num_k, tile=tile, **kw)
        grid, block_c = grid_mn, loop_k_width(k, block_k, k_edge)
        scratch = []
    in_specs = [_operand_spec(op, tile, block_c) for op in operands]
    return pl.pallas_call(
        body, out_shape=list(out_shapes), grid=grid, in_specs=in_specs,
        out_specs=[products_out_spec(stacked, tile) for stacked in stacked_outs],
        scratch_shapes=scratch, compiler_params=compiler_params, backend=backend, name=name,
    )(*(op.array for op in operands))


def store(acc, refs: TileRefs) -> None:
    """The plain epilogue: the accumulator stored in the (one) output's dtype."""
    out_ref = refs.outs[0]
    out_ref[...] = acc.astype(out_ref.dtype)


def matmul(a, b, *, ca: int, cb: int, blocks: tuple[int, int, int], backend: str, out_dtype,
           name: str = "matmul"):
    """``A @ B`` (a contracting dim ``ca``, b dim ``cb``) in ``out_dtype`` with
    float32 accumulation: :func:`matmul_call` with the plain epilogue and the
    heuristic's launch parameters."""
    m, n = a.shape[1 - ca], b.shape[1 - cb]
    return matmul_call(a, b, ca=ca, cb=cb, blocks=blocks, backend=backend,
                       out_shape=[jax.ShapeDtypeStruct((m, n), out_dtype)], epilogue=store,
                       name=name)[0]


# --------------------------------------------------------------------------
# Heuristics
# --------------------------------------------------------------------------

def default_block_sizes(m: int, n: int, k: int, dtype, backend: str) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)`` for an ``[m, k] @ [k, n]`` product.

    * mosaic_tpu: whole dims when small, else 256 / 512 / 512 (multiples of the
      8 x 128 tiling, within the default scoped VMEM with double buffering);
      block_k prefers a size that divides K so no padded copy is made.
    * pallas_triton / triton: powers of two, 128 x 128 x 64 for 16-bit
      dtypes (32 for float32), the shapes tensor cores run well.
    * interpret: powers of two capped at 128, so edge blocks are exercised.

    Every choice is valid in a backward pass too, where the same sizes are
    reused by role (dx tiles (block_m, block_k), dw tiles (block_k, block_n)).
    """
    traits = pl.backend_traits(backend)
    if traits.hardware == "tpu":
        return mosaic_tpu_matmul_blocks(m, n, k, max_m=256, max_n=512)
    small = 16
    if traits.triton:
        cap_k = 32 if np.dtype(dtype) == np.float32 else 64
        return (min(128, max(small, pl.next_power_of_2(m))), min(128, max(small, pl.next_power_of_2(n))),
                min(cap_k, max(small, pl.next_power_of_2(k))))
    return (min(128, max(8, pl.next_power_of_2(m))), min(128, max(8, pl.next_power_of_2(n))),
            min(128, max(8, pl.next_power_of_2(k))))


def interpreter_block_sizes(m: int, n: int, k: int) -> tuple[int, int, int]:
    """Tiles for Triton's CPU interpreter: each dim whole (rounded up to a power of
    two) up to 512, so a model-sized product is a handful of programs with a
    short (usually one-step) contraction loop: the interpreter's cost is per
    tl operation, not per element (the default cap of
    :func:`pallas_core.triton.backend.interpreter_tiles`: a 512 x 512 tile)."""
    return triton_backend.interpreter_tiles((m, n, k))
