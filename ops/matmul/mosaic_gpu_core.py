"""The warp-specialized Mosaic GPU matmul core: one kernel for every matmul-shaped op on sm_90.

Where :mod:`ops.matmul.tiled` is the tile loop of the Triton, interpret and
Mosaic TPU kernels, this is its Hopper counterpart on ``pallas_core.gpu``
(docs/pallas_core.md section 16): ``fused_matmul`` (forward, ``dx``, ``dw``),
``gated_linear_unit`` (two accumulators), ``linear_cross_entropy``'s logits
tiles and ``ragged_dot`` all run :func:`matmul` and keep only their
epilogues. The design follows the published steps of JAX's warp-specialized
Hopper matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``: a tiled
TMA epilogue, a planar-snake tile order, a deeper TMA pipeline, a persistent
grid, two consumer warpgroups sharing an operand); the code is ours.

One kernel launch, ``grid = (programs,)`` (the SM count on a GPU), each block
three warpgroups:

* warpgroup 2, the producer, issues the TMA loads of the operand tiles of
  ``num_stages`` contraction steps ahead into a ring of shared-memory slots,
  with 40 registers per thread (``setmaxnreg``); consumed-slot barriers tell
  it when a slot may be refilled (``emit_pipeline_warp_specialized``);
* warpgroups 0 and 1, the consumers, take the rest of the register file; per
  step each issues its ``wgmma``\\ s (``m64nNk16``, float32 accumulators in
  registers) on its half of the block's tile: the two stack along M and read
  the same right-operand tile, or sit side by side along N and read the same
  left-operand tile (``warpgroups_m``);
* the block walks output tiles persistently (``plgpu.nd_loop`` over every
  tile, interleaved over the programs), in JAX's planar-snake order (bands of
  row or column tiles, alternating direction: consecutive programs share
  operand tiles in L2); the pipeline's slots and barriers are allocated once
  and reused from tile to tile, so the producer runs into the next tile's
  loads while the consumers finish the last one's epilogue;
* the epilogue runs on each consumer's float32 accumulator in registers, in
  epilogue tiles (``epilogue_m x epilogue_n``): a caller's function of the
  tile's accumulator values (and of column and row vectors loaded by TMA for
  the tile: a bias, labels, row statistics) returns the output tiles, each
  written to one of two shared-memory slots and stored by a TMA store while
  the next is computed. A caller's row epilogue instead reduces the whole
  warpgroup tile to per-row values stored as ``[column blocks, M]`` arrays
  (linear cross-entropy's running statistics).

Operands: a left operand is ``[M, K]`` or, ``transposed``, ``[K, M]``; a right
operand ``[K, N]`` or ``[N, K]``. A transposed operand is read in place: its
tile is loaded as stored and handed to ``wgmma`` through
``plgpu.transpose_ref`` (the instruction's transpose bit for 16-bit
operands), so ``dx = dy @ w^T`` and ``dw = x^T @ dy`` make no transposed copy
in memory. An operand may start at a column (or row) ``offset`` of its
array: the gate and up halves of a ``[K, 2N]`` view.

Shapes that do not divide the tiles: a TMA load past an array reads zeros
and a TMA store past it is dropped, so edge tiles need no masks (a zero
contributes nothing to a sum). But TMA tiles the *whole* array under the
operand tiles' layout (docs/pallas_core.md section 16 item 5): rows a
multiple of 8 and the minor dim a multiple of the 128-byte swizzle's width (64
16-bit elements). An array that is not is zero-padded in XLA to the next such
shape (a copy, made only then), and an output of such a shape is made padded
and sliced (a copy). Language-model shapes (multiples of 64) make none.

Dtypes: bfloat16 and float16 operands (``wgmma`` with float32 accumulation).
float32 operands would run as TF32 (10-bit mantissas), below float32's
accuracy, and ``wgmma`` cannot transpose 32-bit operands: not taken
(:func:`unsupported_dtype`).

Not built: clusters with TMA multicast of the shared operand (JAX's
``cluster_dimension``; the GPU interpret mode cannot run multicast, so nothing
here could check it), ``wgmma`` kept in flight across steps (each step waits
for its own), and ``dz`` fused into ``dx``'s left operand in registers.

Static view (``plgpu.mosaic_modules``, bfloat16 at the benchmark sizes, the
default blocks; per kernel: ``wgmma`` per contraction step and consumer, TMA
loads / stores in the module, ``mbarrier`` waits, ``setmaxregister``):

=======================================  ==========================  ===========  ==========
kernel                                   wgmma per step (consumer)   TMA ld / st  setmaxreg
=======================================  ==========================  ===========  ==========
fused_matmul fwd 8192^3 (128x256x64)     8 m64n128k16                11 / 4       2
  with the pre-activation (training)     8 m64n128k16                11 / 8       2
  dx, dw (transposed w, x)               8 m64n128k16 each           10 / 4       2
gated_linear_unit fwd, pair (128x128)    16 m64n64k16 (2 accs)       15 / 6       2
  dx (two products, one acc)             16 m64n128k16               12 / 4       2
  dgate, dup (two accs on x^T)           16 m64n64k16                15 / 4       2
linear_cross_entropy stats / dz          8 m64n64k16                 11-14 / 0-2  2
ragged_dot gmm, dlhs (row ladders)       8 m64n128k16                10 / 48      2
ragged_dot drhs (per-group trips)        8 m64n128k16                4 / 8        2
=======================================  ==========================  ===========  ==========

(A TMA load count includes the vectors' and the prologue's copies; the grouped
stores are the power-of-two row ladder, each behind its predicate.) Every
kernel is 3 warpgroups x ``programs`` blocks, the producer at 40 registers.

In the GPU interpret mode on a 2-core host (tests/test_matmul_mosaic_gpu.py):
about 2.5-5 s per kernel on its first call (tracing, the ``cuda`` lowering check
and the interpreter's compile), so a forward + backward of three kernels takes
8-12 s and linear cross-entropy's four 15-20 s.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from pallas_core import gpu as plgpu
from pallas_core._jax_internals import JAXPR_CALLS, as_closed, find_eqn
from ops.matmul.mosaic_gpu_config import (MAX_STAGES, MIN_STAGES, SMEM_BYTES, SWIZZLE_ELEMS,
                                          MosaicMatmulConfig)

NUM_CONSUMERS = 2
PRODUCER_REGISTERS = 40
ROW_ALIGN = 8  # TMA tiles rows in eights
DTYPES = ("bfloat16", "float16")
# Programs on a host without a GPU (the interpret mode, and the cuda lowering made there):
# two, so each walks several tiles and the persistent loop is exercised.
_HOST_PROGRAMS = 2


def unsupported_dtype(dtype) -> str | None:
    """None when the core multiplies ``dtype`` operands, else why not."""
    name = np.dtype(dtype).name
    if name in DTYPES:
        return None
    return (f"dtype {name}: the Mosaic GPU matmul takes bfloat16 or float16 operands (wgmma "
            "would run float32 as TF32, below float32's accuracy)")


def num_programs(tiles: int) -> int:
    """Persistent programs for ``tiles`` output tiles: the GPU's SM count (one block per
    SM), or :data:`_HOST_PROGRAMS` on a host without a GPU; never more than the tiles."""
    device = jax.devices()[0]
    sms = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return max(1, min(tiles, int(sms) if sms else _HOST_PROGRAMS))


# --------------------------------------------------------------------------
# What a call multiplies
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand array of the products.

    Attributes:
      array: two-dimensional. A left operand is ``[M, K]`` (``transposed``:
        ``[K, M]``), a right operand ``[K, N]`` (``transposed``: ``[N, K]``).
      transposed: read in place and transposed in ``wgmma`` (see the module docstring).
      offset: the first row (left) or column (right) of the array the product's
        free dim starts at (a static int; the up half of a ``[K, 2N]`` view is N).
    """

    array: Any
    transposed: bool = False
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class Product:
    """``accs[acc] += lhs[lhs] @ rhs[rhs]`` at every contraction step."""

    lhs: int
    rhs: int
    acc: int = 0


@dataclasses.dataclass(frozen=True)
class Tile:
    """What an epilogue sees: one piece of a consumer warpgroup's output tile.

    Attributes:
      accs: the float32 accumulator values of the piece, one per accumulator, in
        ``wgmma``'s register layout.
      row0, col0: the piece's first row and column in the output (traced int32).
      rows, cols: the row vectors (``[rows]`` values) and column vectors
        (``[cols]``) of the piece, in the order the call gave them.
      col_block: the warpgroup tile's column index (``[column blocks, M]`` row outputs).
    """

    accs: tuple
    row0: Any
    col0: Any
    rows: tuple
    cols: tuple
    col_block: Any = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.accs[0].shape)

    def row(self, i: int):
        """Row vector ``i`` broadcast over the piece's columns."""
        return lax.broadcast_in_dim(self.rows[i], self.shape, [0])

    def col(self, i: int):
        """Column vector ``i`` broadcast over the piece's rows."""
        return lax.broadcast_in_dim(self.cols[i], self.shape, [1])

    def row_ids(self):
        """The output row of each element (int32, the accumulator's layout)."""
        return self.row0 + plgpu.broadcasted_iota(jnp.int32, self.shape, 0,
                                                  layout=plgpu.Layout.WGMMA)

    def col_ids(self):
        """The output column of each element (int32, the accumulator's layout)."""
        return self.col0 + plgpu.broadcasted_iota(jnp.int32, self.shape, 1,
                                                  layout=plgpu.Layout.WGMMA)


def store_accumulator(tile: Tile) -> tuple:
    """The plain epilogue: the (one) accumulator as it is."""
    return (tile.accs[0],)


# --------------------------------------------------------------------------
# Elementwise functions in an epilogue: what Mosaic GPU's lowering takes
# --------------------------------------------------------------------------

# Calls whose body is what they compute (custom derivatives are not needed in a kernel:
# the op's custom_vjp differentiates outside it). JAX's Mosaic GPU lowering has no rule
# for custom_jvp_call / custom_vjp_call, so their bodies are inlined.
# (``remat2``: jax.checkpoint / jax.remat.)
_INLINED = JAXPR_CALLS | frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                                    "remat2"})


def _body_of(eqn):
    if eqn.primitive.name not in _INLINED:
        return None
    for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return as_closed(sub)
    return None


def _log1p(x):
    # Kahan's log1p from log: exact to a few ulps where 1 + x rounds (Goldberg 1991,
    # "What every computer scientist should know about floating-point arithmetic", thm. 4).
    u = 1.0 + x
    return jnp.where(u == 1.0, x, jnp.log(u) * (x / (u - 1.0)))


def _expm1(x):
    # Kahan's expm1 from exp, the same idea: (u - 1) x / log(u) with u = exp(x).
    u = jnp.exp(x)
    return jnp.where(u == 1.0, x, jnp.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * (x / jnp.log(u))))


# Primitives JAX's Mosaic GPU lowering has no rule for, written in ones it has.
_REWRITES = {"log1p": _log1p, "expm1": _expm1}


def _eval_inlined(jaxpr, consts, *args):
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = _body_of(eqn)
        if body is not None:
            outs = _eval_inlined(body.jaxpr, body.consts, *ins)
        elif eqn.primitive.name in _REWRITES:
            outs = [_REWRITES[eqn.primitive.name](*ins)]
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def inlined(fn: Callable) -> Callable:
    """``fn`` (an elementwise function of one array) with every call in it inlined and
    ``log1p`` / ``expm1`` written with ``log`` / ``exp`` (Kahan's forms): what a kernel
    traces, so that Mosaic GPU's lowering sees only primitives it has rules for."""
    def run(x):
        closed = jax.make_jaxpr(fn)(x)
        (out,) = _eval_inlined(closed.jaxpr, closed.consts, x)
        return out
    return run


def _lowering_rules() -> frozenset:
    from jax._src.pallas.mosaic_gpu import core as gpu_core, lowering
    return frozenset(p.name for p in lowering.mosaic_lowering_rules[gpu_core.LANExWG_SEMANTICS])


def unlowerable(fn: Callable | None, what: str) -> str | None:
    """None when Mosaic GPU's lowering takes ``fn`` on a float32 tile (with its calls
    :func:`inlined`), else why not (the first primitive it has no rule for). Read by
    the ops' ``supported`` before anything is traced, on every call that may run on
    Mosaic GPU: the verdict is traced once per function."""
    if fn is None:
        return None
    try:
        verdict = _unlowerable_verdict(fn)
    except TypeError:  # an unhashable callable: no caching
        verdict = _unlowerable_verdict.__wrapped__(fn)
    return None if verdict is None else f"{what} {verdict}"


@functools.lru_cache(maxsize=64)
def _unlowerable_verdict(fn: Callable) -> str | None:
    try:
        closed = jax.make_jaxpr(inlined(fn))(jax.ShapeDtypeStruct((64, 64), jnp.float32))
    except Exception as e:  # noqa: BLE001 - a function that does not trace is reported
        return f"does not trace on a float32 tile ({type(e).__name__}: {e})"
    rules = _lowering_rules()
    bad = find_eqn(closed.jaxpr, lambda eqn: eqn.primitive.name not in rules
                   and not list(jax.extend.core.jaxprs_in_params(eqn.params)))
    if bad is None:
        return None
    return f"uses {bad.primitive.name!r}, which JAX's Mosaic GPU lowering has no rule for"


# --------------------------------------------------------------------------
# The TMA contract: whole arrays in tiles of (8, 64 16-bit elements)
# --------------------------------------------------------------------------

def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def minor_elems(dtype) -> int:
    """Elements of one 128-byte swizzle row of ``dtype`` (the minor-dim granule)."""
    return 128 // np.dtype(dtype).itemsize


def tma_shape(shape: Sequence[int], dtype) -> tuple[int, int]:
    """``shape`` (two-dimensional) grown to TMA's tiling: rows to a multiple of 8, the
    minor dim to one of the 128-byte swizzle's width."""
    rows, cols = shape
    return _round_up(max(rows, 1), ROW_ALIGN), _round_up(max(cols, 1), minor_elems(dtype))


def tma_ready(array):
    """``array`` with its last two dims zero-padded to :func:`tma_shape` (itself when they
    have it); one-dimensional arrays to a multiple of 16 bytes."""
    if array.ndim == 1:
        size = _round_up(max(array.shape[0], 1), 16 // np.dtype(array.dtype).itemsize)
        return array if size == array.shape[0] else jnp.pad(array, (0, size - array.shape[0]))
    lead = tuple(array.shape[:-2])
    target = lead + tma_shape(array.shape[-2:], array.dtype)
    if tuple(array.shape) == target:
        return array
    return jnp.pad(array, [(0, t - s) for s, t in zip(array.shape, target)])


# --------------------------------------------------------------------------
# Shared memory
# --------------------------------------------------------------------------

def _swizzled(minor: int, dtype):
    """Tiling and swizzle transforms of an SMEM tile whose minor dim is ``minor`` elements."""
    bits = np.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def smem_bytes(config: MosaicMatmulConfig, *, num_lhs: int, num_rhs: int, itemsize: int,
               out_itemsize: int, num_tile_outputs: int, vector_bytes: int = 0,
               stages: int | None = None) -> int:
    """Shared memory a block of :func:`matmul` uses: ``stages`` slots of every operand
    tile, the epilogue's two store slots per consumer, the vectors' and row outputs'
    per-consumer slots."""
    stages = stages or config.num_stages or MAX_STAGES
    bm, bn, bk = config.blocks
    operands = (num_lhs * bm + num_rhs * bn) * bk * itemsize * stages
    em, en = config.epilogue_tile
    outs = NUM_CONSUMERS * 2 * em * en * out_itemsize if num_tile_outputs else 0
    return operands + outs + NUM_CONSUMERS * vector_bytes


def fit_stages(config: MosaicMatmulConfig, what: str, **sizes) -> int:
    """The pipeline's depth: ``config.num_stages``, or the most up to 4 whose tiles fit
    shared memory (:func:`smem_bytes`).

    Raises:
      ValueError: an explicit ``num_stages``, or even 2 stages, over sm_90's shared memory.
    """
    if config.num_stages is not None:
        need = smem_bytes(config, stages=config.num_stages, **sizes)
        if need > SMEM_BYTES:
            raise ValueError(f"{what}: block_sizes {config} needs {need} bytes of shared memory "
                             f"at {config.num_stages} stages, over sm_90's {SMEM_BYTES}.")
        return config.num_stages
    for stages in range(MAX_STAGES, MIN_STAGES - 1, -1):
        if smem_bytes(config, stages=stages, **sizes) <= SMEM_BYTES:
            return stages
    raise ValueError(f"{what}: block_sizes {config} needs "
                     f"{smem_bytes(config, stages=MIN_STAGES, **sizes)} bytes of shared memory "
                     f"at {MIN_STAGES} stages, over sm_90's {SMEM_BYTES}.")


# --------------------------------------------------------------------------
# Walks: which output tile a step of the persistent loop computes
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Dense:
    """Every ``block_m x block_n`` output tile once (a plain product)."""


@dataclasses.dataclass(frozen=True)
class Visits:
    """Row tiles walked through a visit table (the grouped matmul's forward and ``dlhs``,
    :func:`ops.moe.group_table.row_visits`): visit ``v`` computes rows ``[lo[v], hi[v])``
    of row tile ``tile[v]`` with right operand ``group[v]`` (every right operand is
    ``[G, K, N]``, or transposed ``[G, N, K]``); where ``active[v]`` is 0 it stores
    zeros. A tile a group boundary cuts is visited once per group, each visit storing
    only its rows (TMA stores of power-of-two row counts: the row range is known only on
    the device). The tables are the kernel's first operands, int32 ``[num_visits]`` in the
    order tile, group, lo, hi, active.
    """

    num_visits: int


@dataclasses.dataclass(frozen=True)
class Groups:
    """One output ``[m, n]`` per group, each a contraction over the group's rows (the
    grouped matmul's ``drhs``): group ``g`` sums rows ``[begin[g], end[g])`` of the
    operands' contraction dim (``k`` is the rows' extent), walking only the row tiles
    that hold them (a dynamic trip count); the right-operand rows outside the group are
    zeroed in shared memory on the first and last step (each consumer its own columns,
    so the consumers must split N). Outputs are ``[num_groups, m, n]``; an empty group's
    is zeros. Tables: int32 ``[num_groups]`` begin, end.
    """

    num_groups: int


# --------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one :func:`matmul` kernel."""

    config: MosaicMatmulConfig
    stages: int
    dtype: Any  # the operands'
    m: int
    n: int
    k: int
    lhs: tuple  # (transposed, offset) per left operand
    rhs: tuple
    products: tuple
    num_accs: int
    num_rows: int  # row vectors
    num_cols: int  # column vectors
    tile_out_dtype: Any
    num_tile_outputs: int  # epilogue values per piece
    num_out_arrays: int
    stores: tuple  # per epilogue value: (output array, column offset, guarded)
    num_row_outputs: int
    epilogue: Callable | None
    row_epilogue: Callable | None
    walk: Any = Dense()

    @property
    def num_tables(self) -> int:
        return {Dense: 0, Visits: 5, Groups: 2}[type(self.walk)]

    @property
    def grid_rows(self) -> int:
        """Row positions of the persistent loop's (rows, column tiles) space."""
        m_tiles = pl.cdiv(self.m, self.config.block_m)
        if isinstance(self.walk, Visits):
            return self.walk.num_visits
        if isinstance(self.walk, Groups):
            return self.walk.num_groups * m_tiles
        return m_tiles

    @property
    def n_tiles(self) -> int:
        return pl.cdiv(self.n, self.config.block_n)


@dataclasses.dataclass
class _At:
    """Where one step of the persistent loop is (all traced scalars where dynamic)."""

    m0: Any  # the tile's first row
    batch: Any = None  # the right operands' group (Visits) / the outputs' group (Groups)
    k_first: Any = 0  # the first contraction step (Groups: the group's first row tile)
    k_steps: Any = None  # the contraction steps (None: all)
    run: Any = None  # False: no product (zeros stored)
    lo: Any = None  # Visits: the rows stored / Groups: the contraction rows summed
    hi: Any = None


def _locate(plan: _Plan, mi, tables) -> _At:
    bm, bk = plan.config.block_m, plan.config.block_k
    if isinstance(plan.walk, Visits):
        tile, group, lo, hi, active = (t[mi] for t in tables)
        return _At(tile * bm, batch=group, run=active != 0, lo=lo, hi=hi)
    if isinstance(plan.walk, Groups):
        m_tiles = pl.cdiv(plan.m, bm)
        g, ti = mi // m_tiles, lax.rem(mi, m_tiles)
        begin, end = tables[0][g], tables[1][g]
        first = begin // bk
        steps = jnp.where(end > begin, (jnp.maximum(end, 1) - 1) // bk - first + 1, 0)
        return _At(ti * bm, batch=g, k_first=first, k_steps=steps, run=steps > 0, lo=begin,
                   hi=end)
    return _At(mi * bm)


def _lhs_view(gmem, transposed, offset, m0, block_m):
    rows = pl.ds(offset + m0, block_m)
    return gmem.at[:, rows] if transposed else gmem.at[rows, :]


def _rhs_view(gmem, transposed, offset, n0, block_n, batch=None):
    if batch is not None:  # one group's matrix of a [G, ...] operand
        gmem = gmem.at[batch]
    cols = pl.ds(offset + n0, block_n)
    return gmem.at[cols, :] if transposed else gmem.at[:, cols]


def _specs(plan: _Plan, k_first=0):
    """The operands' BlockSpecs, the contraction walked from step ``k_first`` on."""
    bm, bn, bk = plan.config.blocks

    def spec(shape, index_map, minor):
        return plgpu.BlockSpec(shape, index_map, transforms=_swizzled(minor, plan.dtype))

    specs = []
    for transposed, _ in plan.lhs:
        specs.append(spec((bk, bm), lambda kk: (kk + k_first, 0), bm) if transposed
                     else spec((bm, bk), lambda kk: (0, kk + k_first), bk))
    for transposed, _ in plan.rhs:
        specs.append(spec((bn, bk), lambda kk: (0, kk + k_first), bk) if transposed
                     else spec((bk, bn), lambda kk: (kk + k_first, 0), bn))
    return specs


def _wg_lhs(smem, transposed, wg_m, rows):
    """The consumer's left-operand view of a stage's tile (its rows, or all)."""
    if transposed:
        view = smem.at[:, pl.ds(wg_m * rows, rows)] if wg_m is not None else smem
        return plgpu.transpose_ref(view, (1, 0))
    return smem.at[pl.ds(wg_m * rows, rows)] if wg_m is not None else smem


def _wg_rhs(smem, transposed, wg_n, cols):
    """The consumer's right-operand view of a stage's tile (its columns, or all)."""
    if transposed:
        view = smem.at[pl.ds(wg_n * cols, cols), :] if wg_n is not None else smem
        return plgpu.transpose_ref(view, (1, 0))
    return smem.at[:, pl.ds(wg_n * cols, cols)] if wg_n is not None else smem


def _mask_rows(view, row0, lo, hi):
    """Zeroes the rows of ``view`` (an SMEM tile whose first row is contraction row
    ``row0``) outside ``[lo, hi)``, then fences them for ``wgmma``."""
    rows = row0 + plgpu.broadcasted_iota(jnp.int32, view.shape, 0, layout=plgpu.Layout.WGMMA)
    values = view[...]
    view[...] = jnp.where((rows >= lo) & (rows < hi), values, jnp.zeros((), values.dtype))
    plgpu.commit_smem()


def _store_rows(src, dst, start, count, most: int):
    """TMA stores of rows ``[start, start + count)`` of ``src`` into the same rows of
    ``dst`` (``count`` known on the device, at most ``most``): one store per set bit of
    ``count``, each a static power of two of rows (a TMA box has a static shape)."""
    size = 1 << (most.bit_length() - 1)
    while size >= 1:
        def store(size=size, start=start):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(start, size)], dst.at[pl.ds(start, size)])
        pl.when((count & size) != 0)(store)
        start = start + (count & size)
        size //= 2


def _kernel(*refs, plan: _Plan):
    cfg = plan.config
    nl, nr = len(plan.lhs), len(plan.rhs)
    refs = list(refs)
    tables, refs = refs[:plan.num_tables], refs[plan.num_tables:]
    lhs_g, refs = refs[:nl], refs[nl:]
    rhs_g, refs = refs[:nr], refs[nr:]
    row_g, refs = refs[:plan.num_rows], refs[plan.num_rows:]
    col_g, refs = refs[:plan.num_cols], refs[plan.num_cols:]
    out_g, refs = refs[:plan.num_out_arrays], refs[plan.num_out_arrays:]
    rowout_g = refs[:plan.num_row_outputs]

    bm, bn, bk = cfg.blocks
    wg_rows, wg_cols = cfg.wg_tile
    em, en = cfg.epilogue_tile
    num_k = max(1, pl.cdiv(plan.k, bk))
    split_m = cfg.warpgroups_m == 2
    wg = lax.axis_index("wg")
    wg_m = wg if split_m else None
    wg_n = None if split_m else wg
    visits = isinstance(plan.walk, Visits)
    groups = isinstance(plan.walk, Groups)

    def make_pipeline(step, context, k_first=0, k_steps=num_k):
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=PRODUCER_REGISTERS,
            in_specs=_specs(plan, k_first), wg_axis="wg", num_compute_wgs=NUM_CONSUMERS,
            max_concurrent_steps=plan.stages, compute_context=context)

    ignore = lambda *_, **__: None  # noqa: E731 - the functions do not shape the allocations
    allocs_of = [_rhs_view(g, t, 0, 0, bn, 0 if visits else None)
                 for g, (t, _) in zip(rhs_g, plan.rhs)]
    scratch = dict(pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(*lhs_g,
                                                                                 *allocs_of))
    if plan.num_tile_outputs:
        # Visits store rows at any offset: an untiled buffer, sliced by rows.
        out_transforms = () if visits else _swizzled(en, plan.tile_out_dtype)
        scratch["out_smem"] = plgpu.SMEM((NUM_CONSUMERS, 2, em, en), plan.tile_out_dtype,
                                         transforms=out_transforms)
    num_vectors = plan.num_rows + plan.num_cols
    if num_vectors:
        scratch["row_smem"] = [plgpu.SMEM((NUM_CONSUMERS, wg_rows), g.dtype) for g in row_g]
        scratch["col_smem"] = [plgpu.SMEM((NUM_CONSUMERS, wg_cols), g.dtype) for g in col_g]
        scratch["vector_barrier"] = plgpu.Barrier(num_arrivals=num_vectors,
                                                  num_barriers=NUM_CONSUMERS)
    if plan.num_row_outputs:
        scratch["rowout_smem"] = [plgpu.SMEM((NUM_CONSUMERS, wg_rows), jnp.float32)
                                  for _ in rowout_g]

    def scope(pipeline_allocs, out_smem=None, row_smem=(), col_smem=(), vector_barrier=None,
              rowout_smem=()):
        @plgpu.nd_loop((plan.grid_rows * plan.n_tiles,), collective_axes="sm")
        def _tile(info):
            (lin,) = info.index
            minor, width = cfg.band
            mi, ni = plgpu.planar_snake(lin, (plan.grid_rows, plan.n_tiles), minor, width)
            at = _locate(plan, mi, tables)
            n0 = ni * bn
            row0 = at.m0 + (wg * wg_rows if split_m else 0)
            col0 = n0 + (0 if split_m else wg * wg_cols)
            col_block = col0 // wg_cols

            def load_vectors():
                for g, s in zip(row_g, row_smem):
                    plgpu.copy_gmem_to_smem(g.at[pl.ds(row0, wg_rows)], s.at[wg],
                                            vector_barrier.at[wg])
                for g, s in zip(col_g, col_smem):
                    plgpu.copy_gmem_to_smem(g.at[pl.ds(col0, wg_cols)], s.at[wg],
                                            vector_barrier.at[wg])

            def out_view(j, r, c, rows):
                dst = out_g[j].at[at.batch] if groups else out_g[j]
                return dst.at[pl.ds(r, rows), pl.ds(c, en)]

            def store_piece(value, j, offset, slot, r, c):
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's last store read it
                out_smem[wg, slot] = value.astype(plan.tile_out_dtype)
                plgpu.commit_smem()
                if not visits:
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_view(j, r, offset + c, em))
                    return
                # Only the visit's rows [lo, hi) of this piece: the tile's others are
                # another visit's (another group's).
                first = jnp.clip(at.lo - r, 0, em)
                count = jnp.clip(at.hi - r, 0, em) - first
                _store_rows(out_smem.at[wg, slot], out_g[j].at[pl.ds(r, em), pl.ds(offset + c, en)],
                            first, count, em)

            def epilogue(values):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last tile's stores read
                if num_vectors:
                    plgpu.barrier_wait(vector_barrier.at[wg])
                if plan.row_epilogue is not None:
                    whole = Tile(tuple(values), row0, col0,
                                 tuple(plgpu.load(s.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
                                       for s in row_smem),
                                 tuple(plgpu.load(s.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(0))
                                       for s in col_smem), col_block)
                    for value, s, g in zip(plan.row_epilogue(whole), rowout_smem, rowout_g):
                        s.at[wg][...] = value.astype(jnp.float32)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(s.at[wg], g.at[col_block, pl.ds(row0, wg_rows)])
                if plan.epilogue is None:
                    return
                count = 0
                for pi in range(wg_rows // em):
                    for pj in range(wg_cols // en):
                        rs, cs = slice(pi * em, (pi + 1) * em), slice(pj * en, (pj + 1) * en)
                        r, c = row0 + pi * em, col0 + pj * en
                        piece = Tile(
                            tuple(v[rs, cs] for v in values), r, c,
                            tuple(plgpu.load(s.at[wg], pl.ds(pi * em, em),
                                             layout=plgpu.Layout.WGMMA.reduce(1)) for s in row_smem),
                            tuple(plgpu.load(s.at[wg], pl.ds(pj * en, en),
                                             layout=plgpu.Layout.WGMMA.reduce(0)) for s in col_smem),
                            col_block)
                        outs = plan.epilogue(piece)
                        if len(outs) != plan.num_tile_outputs:
                            raise ValueError(f"the epilogue returned {len(outs)} tiles for "
                                             f"{plan.num_tile_outputs} outputs.")
                        for value, (j, offset, guarded) in zip(outs, plan.stores):
                            slot = count % 2
                            count += 1
                            store = functools.partial(store_piece, value, j, offset, slot, r, c)
                            if guarded:  # the array goes on past n: pieces past it are not stored
                                pl.when(c < plan.n)(store)
                            else:
                                store()

            def compute_context(run):
                if num_vectors:
                    load_vectors()

                def with_accs(*accs):
                    run(tuple(accs))
                    epilogue([acc[...] for acc in accs])

                pl.run_scoped(with_accs, *[plgpu.ACC((wg_rows, wg_cols), jnp.float32)
                                           for _ in range(plan.num_accs)])

            def step(indices, *smem_and_accs):
                *smem, accs = smem_and_accs
                lhs_s, rhs_s = smem[:nl], smem[nl:]
                if groups:  # zero the right operands' rows outside the group (first, last step)
                    (kk,) = indices
                    row = (at.k_first + kk) * bk

                    @pl.when((kk == 0) | (kk == at.k_steps - 1))
                    def _():
                        for b_s in rhs_s:
                            _mask_rows(b_s.at[:, pl.ds(wg * wg_cols, wg_cols)], row, at.lo, at.hi)
                for p in plan.products:
                    a = _wg_lhs(lhs_s[p.lhs], plan.lhs[p.lhs][0], wg_m, wg_rows)
                    b = _wg_rhs(rhs_s[p.rhs], plan.rhs[p.rhs][0], wg_n, wg_cols)
                    plgpu.wgmma(accs[p.acc], a, b)
                plgpu.wgmma_wait(0)
                return accs

            views = [_lhs_view(g, t, off, at.m0, bm) for g, (t, off) in zip(lhs_g, plan.lhs)]
            views += [_rhs_view(g, t, off, n0, bn, at.batch if visits else None)
                      for g, (t, off) in zip(rhs_g, plan.rhs)]
            pipeline = make_pipeline(step, compute_context, at.k_first,
                                     num_k if at.k_steps is None else at.k_steps)
            if at.run is None:
                pipeline(*views, allocations=pipeline_allocs)
                return

            @pl.when(at.run)
            def _():
                pipeline(*views, allocations=pipeline_allocs)

            @pl.when(jnp.logical_not(at.run) & (wg < NUM_CONSUMERS))
            def _():  # no product: the consumers store zeros (an empty group, a zero segment)
                if num_vectors:
                    load_vectors()
                zeros = plgpu.layout_cast(jnp.zeros((wg_rows, wg_cols), jnp.float32),
                                          plgpu.Layout.WGMMA)
                epilogue([zeros] * plan.num_accs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store has read its slot

    pl.run_scoped(scope, collective_axes="wg", **scratch)


def matmul(lhs: Sequence[Operand], rhs: Sequence[Operand], *, m: int, n: int, k: int,
           config: MosaicMatmulConfig, products: Sequence[Product] = (Product(0, 0),),
           num_accs: int = 1, out_dtype=None, num_tile_outputs: int = 1,
           epilogue: Callable[[Tile], tuple] | None = store_accumulator,
           out_shapes: Sequence[tuple[int, int]] | None = None,
           stores: Sequence[tuple[int, int]] | None = None,
           rows: Sequence = (), cols: Sequence = (), num_row_outputs: int = 0,
           row_epilogue: Callable[[Tile], tuple] | None = None, walk=Dense(), tables=(),
           name: str = "matmul", interpret=None):
    """The sum over the contraction of each :class:`Product`, handed to the epilogues.

    Args:
      lhs, rhs: the left and right :class:`Operand`\\ s, bfloat16 or float16, one dtype.
      m, n, k: the product's dims (each operand holds at least its part of them).
      config: the block (:class:`~ops.matmul.mosaic_gpu_config.MosaicMatmulConfig`).
      products: which operands multiply into which accumulator per step.
      num_accs: float32 accumulators per consumer warpgroup.
      out_dtype, num_tile_outputs: the dtype of the outputs and the number of tiles the
        epilogue returns for each piece.
      epilogue: ``epilogue(tile) -> tuple`` of ``num_tile_outputs`` values of the
        piece's shape (:class:`Tile`), run on every epilogue tile; None: no tile outputs.
      out_shapes: the output arrays' shapes (default: ``[m, n]`` for each value).
      stores: per epilogue value, ``(output array, column offset)`` it is stored in
        (default: value ``i`` into array ``i`` at offset 0). Where an array is wider
        than ``n`` (two values side by side in one array), pieces past ``n`` are
        skipped and ``n`` must be a multiple of the epilogue tile's columns, so no
        piece crosses into its neighbour's columns.
      rows, cols: one-dimensional arrays (``[m]`` / ``[n]``) the epilogues read, by
        row or by column (loaded by TMA per warpgroup tile).
      num_row_outputs, row_epilogue: ``row_epilogue(tile) -> tuple`` of
        ``num_row_outputs`` ``[rows]`` values, run once per warpgroup tile on its
        whole accumulators; output ``r`` is float32 ``[column blocks, m]``, the
        column block being the warpgroup tile's (``n / config.wg_tile[1]`` of them).
      walk, tables: :class:`Dense` (every tile once), :class:`Visits` or :class:`Groups`
        (the grouped matmul's walks) with their int32 tables.
      name: the kernel's name.
      interpret: as ``pallas_core.gpu.kernel``'s (None: by the device).

    Returns:
      ``(tile outputs, row outputs)``: two lists.

    Raises:
      NotImplementedError: operands of another dtype; a GPU older than sm_90.
      ValueError: a config whose tiles do not fit shared memory.
    """
    dtypes = {np.dtype(op.array.dtype) for op in (*lhs, *rhs)}
    if len(dtypes) != 1 or unsupported_dtype(next(iter(dtypes))) is not None:
        raise NotImplementedError(f"{name}: " + (unsupported_dtype(next(iter(dtypes))) or
                                                 f"operands of one dtype, got {dtypes}"))
    dtype = next(iter(dtypes))
    out_dtype = np.dtype(out_dtype or dtype)
    if epilogue is None:
        num_tile_outputs = 0
    config.check(name)
    if isinstance(walk, Groups) and config.warpgroups_m != 1:
        raise ValueError(f"{name}: a per-group contraction needs the consumers side by side "
                         "(warpgroups_m=1): each zeroes its own columns of the shared tile.")
    out_shapes = [tuple(s) for s in out_shapes] if out_shapes is not None else (
        [(m, n)] * num_tile_outputs)
    stores = list(stores) if stores is not None else [(i, 0) for i in range(num_tile_outputs)]
    if len(stores) != num_tile_outputs:
        raise ValueError(f"{name}: {len(stores)} stores for {num_tile_outputs} epilogue values.")
    guarded = [out_shapes[j][1] > n or off > 0 for j, off in stores]
    if any(guarded) and n % config.epilogue_tile[1]:
        raise ValueError(f"{name}: outputs wider than n = {n} need n to be a multiple of the "
                         f"epilogue tile's {config.epilogue_tile[1]} columns.")
    vector_bytes = (sum(np.dtype(r.dtype).itemsize for r in rows) * config.wg_tile[0]
                    + sum(np.dtype(c.dtype).itemsize for c in cols) * config.wg_tile[1]
                    + 4 * num_row_outputs * config.wg_tile[0])
    stages = fit_stages(config, name, num_lhs=len(lhs), num_rhs=len(rhs), itemsize=dtype.itemsize,
                        out_itemsize=out_dtype.itemsize, num_tile_outputs=num_tile_outputs,
                        vector_bytes=vector_bytes)
    plan = _Plan(config, stages, dtype, m, n, k, tuple((op.transposed, op.offset) for op in lhs),
                 tuple((op.transposed, op.offset) for op in rhs), tuple(products), num_accs,
                 len(rows), len(cols), out_dtype, num_tile_outputs, len(out_shapes),
                 tuple((j, off, g) for (j, off), g in zip(stores, guarded)), num_row_outputs,
                 epilogue, row_epilogue, walk)
    if len(tables) != plan.num_tables:
        raise ValueError(f"{name}: {type(walk).__name__} takes {plan.num_tables} tables, got "
                         f"{len(tables)}.")
    batch = (walk.num_groups,) if isinstance(walk, Groups) else ()
    col_blocks = pl.cdiv(n, config.wg_tile[1])
    out_type = ([jax.ShapeDtypeStruct((*batch, *tma_shape(s, out_dtype)), out_dtype)
                 for s in out_shapes]
                + [jax.ShapeDtypeStruct((col_blocks, _round_up(m, ROW_ALIGN)), jnp.float32)]
                * num_row_outputs)
    call = plgpu.kernel(functools.partial(_kernel, plan=plan), out_shape=out_type,
                        grid=(num_programs(plan.grid_rows * plan.n_tiles),), grid_names=("sm",),
                        num_threads=NUM_CONSUMERS + 1, thread_name="wg", interpret=interpret,
                        kernel_name=name)
    operands = ([t.astype(jnp.int32) for t in tables] + [tma_ready(op.array) for op in (*lhs, *rhs)]
                + [tma_ready(v) for v in (*rows, *cols)])
    outs = call(*operands)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    tile_outs = [o if o.shape[-2:] == s else o[..., :s[0], :s[1]] for o, s in zip(outs, out_shapes)]
    row_outs = [o if o.shape[1] == m else o[:, :m] for o in outs[len(out_shapes):]]
    return tile_outs, row_outs
