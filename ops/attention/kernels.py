"""Flash-attention kernels: forward, dQ and dK/dV (FlashAttention-2, Dao 2023).

One set of per-tile math serves three kernels and two ways of walking the
sequence, chosen by backend (as fused_matmul's contraction walk):

* ``"grid"`` (interpret, mosaic_tpu): the walked blocks are the last grid
  axis, marked ``"arbitrary"``; running statistics and accumulators live in
  scratch, initialised under ``pl.when(step == 0)`` and finished under
  ``pl.when(step == last)`` (docs/pallas_core.md section 5); blocks outside the visible range are
  skipped with ``pl.when``.
* ``"loop"`` (triton, pallas_triton): each program walks only its visible
  range with ``lax.fori_loop(lo, hi)`` over ``pl.ds`` slices of whole-length
  blocks, the carries in registers. Our Triton lowering emits that loop as
  ``for j in range(lo, hi)``, which Triton software-pipelines (cp.async /
  TMA stages), and JAX's Pallas Triton lowering runs programs concurrently,
  so it cannot walk a grid axis. Where a mask can hide pairs, the range is
  walked as three loops: the fully visible blocks in the middle skip the
  mask (:func:`_walk_blocks`).

Forward (Algorithm 1): programs over (batch, query head, query block); for
each visible key/value block, ``s = q k^T`` scaled into log2 units (the scale
and ``log2(e)`` folded into one multiply so the softmax runs on ``exp2``),
soft cap, bias and masks, then the online softmax update of the running max
``m``, sum ``l`` and output accumulator, all float32. Writes ``out`` and the
logsumexp ``lse`` (float32, natural log).

Backward (Algorithm 2, split into two kernels so nothing is accumulated with
atomics and gradients are bit-for-bit deterministic): with ``delta =
rowsum(dO * O)`` and ``p = exp(s - lse)`` recomputed per tile,

* dQ kernel, programs over (batch, query head, query block), walking
  key/value blocks: ``ds = p * (dp - delta)`` with ``dp = dO v^T``, then
  ``dq += ds k``; it also writes ``ds`` for the bias gradient when asked;
* dK/dV kernel, programs over (batch, key/value head, key/value block),
  walking every (query head of the group, query block): ``dv += p^T dO``,
  ``dk += ds^T q``. For grouped-query attention one program owns a
  key/value head and sums over its group of query heads, so no
  ``[B, S, N, H]`` intermediate exists.

Dropout multiplies ``p`` by ``keep / (1 - rate)`` after the normalisation
statistics (which stay undropped), with keep bits regenerated per tile from
the counter hash of :mod:`ops.attention.dropout`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention.config import Config
from ops.attention.masking import masked_sides
from ops.attention.range_table import BlockRange, RangeTable
from ops.attention.tile_math import (Tile, backward_tile, div, dot, forward_finish, forward_update,
                                     rem, zero_rows_past)


# --------------------------------------------------------------------------
# Operand layout: BlockSpecs over [B, L, N, H] (or [B, N, L, H]) operands
# --------------------------------------------------------------------------

def padded_length(length: int, block: int, backend: str) -> int:
    """The whole-length block the loop strategy reads ``pl.ds`` slices of."""
    n = pl.cdiv(length, block) * block
    return pl.next_power_of_2(n) if backend == "pallas_triton" else n


def _heads_block(cfg: Config, n: int) -> int:
    return pl.next_power_of_2(n) if cfg.backend == "pallas_triton" else n


def _seq_spec(cfg: Config, block_l: int, pick, *, all_heads: bool = False):
    """Block ``(block_l, H)`` (or ``(block_l, heads, H)``) of a ``[B, L, heads, H]`` operand.

    ``pick(*ids) -> (b, l, n)``: the batch, sequence-block and head indices
    (n ignored with ``all_heads``). BNTH operands are ``[B, heads, L, H]``.
    """
    h = cfg.head_dim

    def index_map(*ids):
        b, l, n = pick(*ids)
        n = 0 if all_heads else n
        return (b, l, n, 0) if cfg.layout == "BTNH" else (b, n, l, 0)

    heads = None
    if all_heads:
        heads = _heads_block(cfg, cfg.heads)
    shape = (None, block_l, heads, h) if cfg.layout == "BTNH" else (None, heads, block_l, h)
    return pl.BlockSpec(shape, index_map)


def _stat_spec(cfg: Config, block_l: int, pick, *, all_heads: bool = False):
    """Block of a float32 ``[B, N, T, 1]`` per-row statistic (lse, delta)."""
    def index_map(*ids):
        b, l, n = pick(*ids)
        return (b, 0 if all_heads else n, l, 0)
    heads = _heads_block(cfg, cfg.heads) if all_heads else None
    return pl.BlockSpec((None, heads, block_l, 1), index_map)


def _pair_spec(full, block_q: int, block_k: int, pick, *, all_heads=False, heads=None):
    """Block of a 4-D bias / mask ``[B', N', T', S']`` whose dims may be broadcast (size 1).

    ``pick(*ids) -> (b, i, j, n)``; a broadcast dim has block 1 at index 0.
    With ``all_heads`` the head dim is kept whole (``heads`` wide, or 1 when
    broadcast), otherwise it is squeezed.
    """
    fb, fn, ft, fs = full

    def index_map(*ids):
        b, i, j, n = pick(*ids)
        return (b if fb else 0, 0 if (all_heads or not fn) else n, i if ft else 0, j if fs else 0)

    head_block = (heads if fn else 1) if all_heads else None
    return pl.BlockSpec((None, head_block, block_q if ft else 1, block_k if fs else 1), index_map)


def _table_spec(cfg: Config):
    """The flat int32 scalar table (seed, block ranges): one whole-array block."""
    space = pl.tpu.SMEM if cfg.backend == "mosaic_tpu" else None
    return pl.BlockSpec(memory_space=space) if space is not None else pl.BlockSpec()


def _params(cfg: Config, semantics, accumulator_rows: int, threshold: int = 128 * 128):
    """Compiler params; Triton gets 8 warps once the float32 accumulator tiles
    (``accumulator_rows x H``, H padded to a power of two) reach ``threshold``
    elements, 4 below: the split that compiles for sm_90 without spills."""
    if cfg.backend in pl.TRITON_BACKENDS:
        tile = accumulator_rows * pl.next_power_of_2(cfg.head_dim)
        warps = cfg.num_warps or (8 if tile >= threshold else 4)
        stages = cfg.num_stages or 2
        if cfg.backend == "pallas_triton":
            return pl.triton.CompilerParams(num_warps=warps, num_stages=stages)
        return pl.triton.CompilerParams(num_warps=warps, num_stages=stages,
                                        dimension_semantics=semantics)
    return pl.CompilerParams(dimension_semantics=semantics)


# --------------------------------------------------------------------------
# Reading one walked block: a grid step's block, or a pl.ds slice of a whole-length block
# --------------------------------------------------------------------------

def _slice_rows(ref, start, size, axis=0):
    idx = [slice(None)] * len(ref.shape)
    idx[axis] = pl.ds(start, size)
    return ref[tuple(idx)]


def _pair_block(ref, full, walked_q: bool, index, block, grid: bool):
    """The (bq|1, bk|1) tile of a bias/mask ref at the walked block ``index``."""
    if ref is None:
        return None
    if grid:
        return ref[...]
    axis, is_full = (0, full[2]) if walked_q else (1, full[3])
    return _slice_rows(ref, index * block, block, axis) if is_full else ref[...]


# --------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------

def _split(refs, *flags):
    refs = list(refs)
    return [refs.pop(0) if f else None for f in flags], refs


@dataclasses.dataclass
class _QueryProgram:
    """What a program owning query block ``i`` of head ``n``, batch ``b`` reads once."""

    i: jax.Array
    head: jax.Array  # b * N + n
    seed: jax.Array
    ranges: BlockRange  # the key/value blocks it walks
    q_seg: jax.Array | None


def _query_program(cfg: Config, table_ref, qs_ref) -> _QueryProgram:
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    table = RangeTable(table_ref, pl.cdiv(cfg.spec.T, cfg.block_q))
    row = table.row(b, i)
    return _QueryProgram(i=i, head=b * cfg.heads + n, seed=table.seed, ranges=row.read(),
                         q_seg=None if qs_ref is None else qs_ref[...])


def _walk_blocks(ranges, loop, init, sides: tuple[bool, bool]):
    """Loop strategy: ``loop(first, last, carry, masked)`` over the visible blocks ``[lo, hi)``.

    ``sides`` (:func:`ops.attention.masking.masked_sides`, the same the table
    was built with) says where masked blocks may lie. Up to three loops in
    block order: ``[lo, full_lo)`` masked, the fully visible ``[full_lo,
    full_hi)`` without evaluating the conditions, ``[full_hi, hi)`` masked. For
    causal attention that is FlashAttention-2's split of the loop into
    off-diagonal and diagonal blocks (Dao, 2023, section 3.1.1); windows,
    segments and ragged edges get the same: only the blocks a boundary crosses
    pay for the mask. Without sides, one loop with the conditions evaluated
    (they are then None: nothing is masked).
    """
    lo, hi, full_lo, full_hi = ranges
    leading, trailing = sides
    if not (leading or trailing):
        return loop(lo, hi, init, True)
    carry = loop(lo, full_lo, init, True) if leading else init
    carry = loop(full_lo, full_hi, carry, False)
    return loop(full_hi, hi, carry, True) if trailing else carry


def _each_block(step):
    """``loop`` for :func:`_walk_blocks`: ``carry = step(j, carry, masked)`` for j in ``[first, last)``."""
    return lambda first, last, carry, masked: lax.fori_loop(
        first, last, lambda j, c: step(j, c, masked), carry)


def _kv_tile(cfg: Config, prog: _QueryProgram, q, j, k_ref, v_ref, ks_ref, bias_ref, mask_ref):
    """``(tile, v)`` for key/value block ``j``: the grid step's block, or a slice of the whole."""
    bk, grid_walk = cfg.block_k, cfg.strategy == "grid"
    k = k_ref[...] if grid_walk else _slice_rows(k_ref, j * bk, bk)
    v = v_ref[...] if grid_walk else _slice_rows(v_ref, j * bk, bk)
    k_seg = None
    if ks_ref is not None:
        k_seg = ks_ref[...] if grid_walk else _slice_rows(ks_ref, j * bk, bk, axis=1)
    tile = Tile(q=q, k=zero_rows_past(k, j, bk, cfg.spec.S), i=prog.i, j=j, head=prog.head,
                q_seg=prog.q_seg, k_seg=k_seg,
                bias=_pair_block(bias_ref, cfg.bias_full, False, j, bk, grid_walk),
                mask=_pair_block(mask_ref, cfg.mask_full, False, j, bk, grid_walk))
    return tile, zero_rows_past(v, j, bk, cfg.spec.S)


def _forward_kernel(*refs, cfg: Config):
    grid_walk = cfg.strategy == "grid"
    bq, bk = cfg.block_q, cfg.block_k
    has_bias, has_mask = cfg.bias_full is not None, cfg.mask_full is not None
    q_ref, k_ref, v_ref, *rest = refs
    (bias_ref, mask_ref, qs_ref, ks_ref), rest = _split(rest, has_bias, has_mask,
                                                      cfg.spec.segments, cfg.spec.segments)
    table_ref, out_ref, lse_ref, *scratch = rest
    prog = _query_program(cfg, table_ref, qs_ref)
    q, seed, lo, hi = q_ref[...], prog.seed, prog.ranges.lo, prog.ranges.hi
    kv_refs = (k_ref, v_ref, ks_ref, bias_ref, mask_ref)

    def step(j, carry, masked=True):
        tile, v = _kv_tile(cfg, prog, q, j, *kv_refs)
        return forward_update(cfg, carry, tile, v, seed, bq, bk, masked)

    def finish(m, l, acc):
        out, lse = forward_finish(m, l, acc)
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse.reshape(lse_ref.shape)

    stats = (bq, 1) if grid_walk else (bq,)  # see forward_update
    init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((bq, cfg.head_dim), jnp.float32))
    if not grid_walk:
        finish(*_walk_blocks(prog.ranges, _each_block(step), init, masked_sides(cfg.spec, bq, bk)))
        return
    m_ref, l_ref, acc_ref = scratch
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...], l_ref[...], acc_ref[...] = init

    @pl.when((j >= lo) & (j < hi))
    def _step():
        m_ref[...], l_ref[...], acc_ref[...] = step(j, (m_ref[...], l_ref[...], acc_ref[...]))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        finish(m_ref[...], l_ref[...], acc_ref[...])


def _aux_inputs(cfg: Config, bias, mask, q_seg, kv_seg):
    """The optional operands in kernel order, as arrays (seg ids reshaped for their blocks)."""
    ops_ = []
    if bias is not None:
        ops_.append(bias)
    if mask is not None:
        ops_.append(mask)
    if cfg.spec.segments:
        ops_ += [q_seg[:, :, None], kv_seg[:, None, :]]
    return ops_


def _to_layout(cfg: Config, x):
    return x if cfg.layout == "BTNH" else jnp.swapaxes(x, 1, 2)


def _from_layout(cfg: Config, x):
    return _to_layout(cfg, x)


@dataclasses.dataclass(frozen=True)
class _QueryBlockLayout:
    """Grid and BlockSpecs of the kernels whose programs own a query block (forward, dQ).

    Attributes:
      grid: ``(B, N, nq)``, plus the key/value blocks ``nk`` on the grid strategy.
      semantics: the grid's dimension semantics.
      kv_block: rows of a key/value block (the whole padded length on the loop strategy).
      q_pick, kv_pick, pair: index functions for :func:`_seq_spec` / :func:`_pair_spec`.
    """

    grid: tuple[int, ...]
    semantics: tuple[str, ...]
    kv_block: int
    q_pick: object
    kv_pick: object
    pair: object
    seg_k: pl.BlockSpec

    def aux_specs(self, cfg: Config, has_bias: bool, has_mask: bool) -> list[pl.BlockSpec]:
        """Specs of the optional operands (bias, mask, segment ids), in kernel order."""
        bq, specs = cfg.block_q, []
        if has_bias:
            specs.append(_pair_spec(cfg.bias_full, bq, self.kv_block, self.pair))
        if has_mask:
            specs.append(_pair_spec(cfg.mask_full, bq, self.kv_block, self.pair))
        if cfg.spec.segments:
            specs += [pl.BlockSpec((None, bq, 1), lambda b, n, i, *_: (b, i, 0)), self.seg_k]
        return specs


def _query_block_layout(cfg: Config) -> _QueryBlockLayout:
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.group
    nq, nk = pl.cdiv(cfg.spec.T, bq), pl.cdiv(cfg.spec.S, bk)
    q_pick = lambda b, n, i, *_: (b, i, n)
    if cfg.strategy == "grid":
        return _QueryBlockLayout(
            grid=(cfg.batch, cfg.heads, nq, nk), semantics=("parallel",) * 3 + ("arbitrary",),
            kv_block=bk, q_pick=q_pick, kv_pick=lambda b, n, i, j: (b, j, div(n, g)),
            pair=lambda b, n, i, j: (b, i, j, n),
            seg_k=pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, j)))
    kv_block = padded_length(cfg.spec.S, bk, cfg.backend)
    return _QueryBlockLayout(
        grid=(cfg.batch, cfg.heads, nq), semantics=("parallel",) * 3, kv_block=kv_block,
        q_pick=q_pick, kv_pick=lambda b, n, i: (b, 0, div(n, g)), pair=lambda b, n, i: (b, i, 0, n),
        seg_k=pl.BlockSpec((None, 1, kv_block), lambda b, n, i: (b, 0, 0)))


def forward_call(cfg: Config, q, k, v, bias, mask, q_seg, kv_seg, table):
    """``(out [B, T, N, H] in q's dtype, lse float32 [B, N, T, 1])``."""
    T, bq = cfg.spec.T, cfg.block_q
    lay = _query_block_layout(cfg)
    grid_walk, q_pick = cfg.strategy == "grid", lay.q_pick
    in_specs = [_seq_spec(cfg, bq, q_pick), _seq_spec(cfg, lay.kv_block, lay.kv_pick),
                _seq_spec(cfg, lay.kv_block, lay.kv_pick)]
    in_specs += lay.aux_specs(cfg, bias is not None, mask is not None)
    in_specs.append(_table_spec(cfg))
    out_shape = [jax.ShapeDtypeStruct(_to_layout(cfg, q).shape, q.dtype),
                 jax.ShapeDtypeStruct((cfg.batch, cfg.heads, T, 1), jnp.float32)]
    out_specs = [_seq_spec(cfg, bq, q_pick), _stat_spec(cfg, bq, q_pick)]
    scratch = []
    if grid_walk:
        scratch = [pl.tpu.VMEM((bq, 1), jnp.float32), pl.tpu.VMEM((bq, 1), jnp.float32),
                   pl.tpu.VMEM((bq, cfg.head_dim), jnp.float32)]
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg), out_shape=out_shape, grid=lay.grid,
        in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch,
        compiler_params=_params(cfg, lay.semantics, bq), backend=cfg.backend,
        name="flash_attention_fwd")(
            _to_layout(cfg, q), _to_layout(cfg, k), _to_layout(cfg, v),
            *_aux_inputs(cfg, bias, mask, q_seg, kv_seg), table)
    return _from_layout(cfg, out), lse


# --------------------------------------------------------------------------
# dQ kernel (also the bias gradient)
# --------------------------------------------------------------------------

def _dq_kernel(*refs, cfg: Config, want_dbias: bool):
    grid_walk = cfg.strategy == "grid"
    bq, bk = cfg.block_q, cfg.block_k
    has_bias, has_mask = cfg.bias_full is not None, cfg.mask_full is not None
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest = refs
    (bias_ref, mask_ref, qs_ref, ks_ref), rest = _split(rest, has_bias, has_mask,
                                                      cfg.spec.segments, cfg.spec.segments)
    table_ref, dq_ref, *rest = rest
    dbias_ref = rest.pop(0) if want_dbias else None
    prog = _query_program(cfg, table_ref, qs_ref)
    seed, lo, hi = prog.seed, prog.ranges.lo, prog.ranges.hi
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    kv_refs = (k_ref, v_ref, ks_ref, bias_ref, mask_ref)

    def step(j, dq, masked=True):
        tile, v = _kv_tile(cfg, prog, q, j, *kv_refs)
        _, dscores, dbias = backward_tile(cfg, tile, v, do, lse, delta, seed, bq, bk, masked)
        if dbias_ref is not None:
            if grid_walk:
                dbias_ref[...] = dbias
            else:
                dbias_ref[:, pl.ds(j * bk, bk)] = dbias
        return dq + dot(dscores.astype(tile.k.dtype), tile.k, 1, 0)

    zeros = jnp.zeros((bq, cfg.head_dim), jnp.float32)
    if not grid_walk:
        sides = masked_sides(cfg.spec, bq, bk, bound_q=True)
        dq = _walk_blocks(prog.ranges, _each_block(step), zeros, sides)
        dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
        return
    (acc_ref,) = rest
    j = pl.program_id(3)
    run = (j >= lo) & (j < hi)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = zeros

    @pl.when(run)
    def _step():
        acc_ref[...] = step(j, acc_ref[...])

    if dbias_ref is not None:
        @pl.when(jnp.logical_not(run))
        def _skipped():  # the block is written back whatever happens: make it zeros
            dbias_ref[...] = jnp.zeros(dbias_ref.shape, jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * cfg.scale).astype(dq_ref.dtype)


def dq_call(cfg: Config, q, k, v, do, lse, delta, bias, mask, q_seg, kv_seg, table, want_dbias):
    """``dq [B, T, N, H]`` (q's dtype) and, with ``want_dbias``, float32 ``[B, N, T, S]``."""
    T, S, bq = cfg.spec.T, cfg.spec.S, cfg.block_q
    lay = _query_block_layout(cfg)
    grid_walk, q_pick, kv_block, pair = cfg.strategy == "grid", lay.q_pick, lay.kv_block, lay.pair
    in_specs = [_seq_spec(cfg, bq, q_pick), _seq_spec(cfg, kv_block, lay.kv_pick),
                _seq_spec(cfg, kv_block, lay.kv_pick), _seq_spec(cfg, bq, q_pick),
                _stat_spec(cfg, bq, q_pick), _stat_spec(cfg, bq, q_pick)]
    in_specs += lay.aux_specs(cfg, bias is not None, mask is not None)
    in_specs.append(_table_spec(cfg))
    out_shape = [jax.ShapeDtypeStruct(_to_layout(cfg, q).shape, q.dtype)]
    out_specs = [_seq_spec(cfg, bq, q_pick)]
    operands = [_to_layout(cfg, q), _to_layout(cfg, k), _to_layout(cfg, v), _to_layout(cfg, do),
                lse, delta, *_aux_inputs(cfg, bias, mask, q_seg, kv_seg), table]
    aliases = {}
    if want_dbias:
        out_shape.append(jax.ShapeDtypeStruct((cfg.batch, cfg.heads, T, S), jnp.float32))
        out_specs.append(_pair_spec((True,) * 4, bq, kv_block, pair))
        if not grid_walk:  # only visible blocks are written: start from zeros
            in_specs.append(out_specs[-1])
            operands.append(jnp.zeros((cfg.batch, cfg.heads, T, S), jnp.float32))
            aliases = {len(operands) - 1: 1}
    scratch = [pl.tpu.VMEM((bq, cfg.head_dim), jnp.float32)] if grid_walk else []
    kernel = functools.partial(_dq_kernel, cfg=cfg, want_dbias=want_dbias)
    if aliases:
        kernel = _ignore_input(kernel, position=len(operands) - 1)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=lay.grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch, input_output_aliases=aliases,
        compiler_params=_params(cfg, lay.semantics, bq), backend=cfg.backend,
        name="flash_attention_dq")(*operands)
    dq = _from_layout(cfg, outs[0])
    return dq, (outs[1] if want_dbias else None)


def _ignore_input(kernel, position: int):
    """The kernel without the Ref at ``position`` (an aliased buffer it only writes through its output)."""
    def wrapped(*refs):
        refs = list(refs)
        del refs[position]
        return kernel(*refs)
    return wrapped


# --------------------------------------------------------------------------
# dK/dV kernel
# --------------------------------------------------------------------------

def _dkdv_kernel(*refs, cfg: Config):
    grid_walk = cfg.strategy == "grid"
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    g = cfg.group
    has_bias, has_mask = cfg.bias_full is not None, cfg.mask_full is not None
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest = refs
    (bias_ref, mask_ref, qs_ref, ks_ref), rest = _split(rest, has_bias, has_mask,
                                                      cfg.spec.segments, cfg.spec.segments)
    table_ref, dk_ref, dv_ref, *scratch = rest
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nk = pl.cdiv(cfg.spec.S, bk)
    nq = pl.cdiv(cfg.spec.T, bq)
    table = RangeTable(table_ref, nk)
    seed = table.seed
    row = table.row(b, j)
    lo, hi = row.lo, row.hi
    k, v = k_ref[...], v_ref[...]
    k_seg = None if ks_ref is None else ks_ref[...]
    if not grid_walk:  # transposed tiles (backward_tile): per-key ids are a column
        k_seg = None if k_seg is None else k_seg.reshape(bk, 1)

    def step(gi, i, carry, masked=True):
        """Query head ``kh * G + gi``, query block ``i``."""
        dk, dv = carry
        n = kh * g + gi
        if grid_walk:
            q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
            q_seg = None if qs_ref is None else qs_ref[...]
            bias, mask = (None if r is None else r[...] for r in (bias_ref, mask_ref))
        else:
            rows = pl.ds(i * bq, bq)
            if cfg.layout == "BTNH":
                q, do = q_ref[rows, n, :], do_ref[rows, n, :]
            else:
                q, do = q_ref[n, rows, :], do_ref[n, rows, :]
            # Transposed tiles: per-query statistics and ids are [1, bq] rows.
            lse = lse_ref[n, rows, :].reshape(1, bq)
            delta = delta_ref[n, rows, :].reshape(1, bq)
            q_seg = None if qs_ref is None else qs_ref[rows, :].reshape(1, bq)
            bias, mask = (_pair_rows(r, full, n, rows) for r, full in
                          ((bias_ref, cfg.bias_full), (mask_ref, cfg.mask_full)))
        q = zero_rows_past(q, i, bq, cfg.spec.T)
        do = zero_rows_past(do, i, bq, cfg.spec.T)
        delta = zero_rows_past(delta, i, bq, cfg.spec.T, axis=0 if grid_walk else 1)
        tile = Tile(q=q, k=k, i=i, j=j, head=b * cfg.heads + n, q_seg=q_seg, k_seg=k_seg,
                    bias=bias, mask=mask, transposed=not grid_walk)
        p, dscores, _ = backward_tile(cfg, tile, v, do, lse, delta, seed, bq, bk, masked)
        contract = 0 if grid_walk else 1  # the query axis of p / dscores
        dv = dv + dot(p.astype(do.dtype), do, contract, 0)
        dk = dk + dot(dscores.astype(q.dtype), q, contract, 0)
        return dk, dv

    def finish(dk, dv):
        dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)

    zeros = jnp.zeros((bk, cfg.head_dim), jnp.float32)
    if not grid_walk:
        def blocks(first, last, carry, masked):  # every query head of the group, blocks [first, last)
            count = last - first

            def flat_step(t, carry):  # t walks (query head of the group, query block)
                return step(div(t, count), first + rem(t, count), carry, masked)

            return lax.fori_loop(0, g * count, flat_step, carry)

        ranges = BlockRange(lo, hi, row.full_lo, row.full_hi)
        sides = masked_sides(cfg.spec, bq, bk, transpose=True, bound_q=True)
        finish(*_walk_blocks(ranges, blocks, (zeros, zeros), sides))
        return
    dk_acc, dv_acc = scratch
    t = pl.program_id(3)
    gi, i = div(t, nq), rem(t, nq)

    @pl.when(t == 0)
    def _init():
        dk_acc[...], dv_acc[...] = zeros, zeros

    @pl.when((i >= lo) & (i < hi))
    def _step():
        dk_acc[...], dv_acc[...] = step(gi, i, (dk_acc[...], dv_acc[...]))

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        finish(dk_acc[...], dv_acc[...])


def _pair_rows(ref, full, n, rows):
    """Loop strategy, dK/dV kernel: the bias/mask tile of query head n at query rows ``rows``."""
    if ref is None:
        return None
    idx = (n if full[1] else 0, rows if full[2] else slice(None), slice(None))
    return ref[idx]


def dkdv_call(cfg: Config, q, k, v, do, lse, delta, bias, mask, q_seg, kv_seg, table):
    """``(dk, dv)``, ``[B, S, K, H]`` in k's dtype."""
    T, S = cfg.spec.T, cfg.spec.S
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    nq, nk = pl.cdiv(T, bq), pl.cdiv(S, bk)
    g = cfg.group
    grid_walk = cfg.strategy == "grid"
    kv_pick = lambda b, kh, j, *_: (b, j, kh)
    if grid_walk:
        grid = (cfg.batch, cfg.kv_heads, nk, g * nq)
        q_block, all_heads = bq, False
        q_pick = lambda b, kh, j, t: (b, rem(t, nq), kh * g + div(t, nq))
        pair = lambda b, kh, j, t: (b, rem(t, nq), j, kh * g + div(t, nq))
        seg_q = pl.BlockSpec((None, bq, 1), lambda b, kh, j, t: (b, rem(t, nq), 0))
    else:
        grid = (cfg.batch, cfg.kv_heads, nk)
        q_block, all_heads = padded_length(T, bq, cfg.backend), True
        q_pick = lambda b, kh, j: (b, 0, 0)
        pair = lambda b, kh, j: (b, 0, j, 0)
        seg_q = pl.BlockSpec((None, q_block, 1), lambda b, kh, j: (b, 0, 0))
    in_specs = [_seq_spec(cfg, q_block, q_pick, all_heads=all_heads),
                _seq_spec(cfg, bk, kv_pick), _seq_spec(cfg, bk, kv_pick),
                _seq_spec(cfg, q_block, q_pick, all_heads=all_heads),
                _stat_spec(cfg, q_block, q_pick, all_heads=all_heads),
                _stat_spec(cfg, q_block, q_pick, all_heads=all_heads)]
    heads_block = _heads_block(cfg, cfg.heads)
    if bias is not None:
        in_specs.append(_pair_spec(cfg.bias_full, q_block, bk, pair, all_heads=all_heads,
                                   heads=heads_block))
    if mask is not None:
        in_specs.append(_pair_spec(cfg.mask_full, q_block, bk, pair, all_heads=all_heads,
                                   heads=heads_block))
    if cfg.spec.segments:
        in_specs += [seg_q, pl.BlockSpec((None, 1, bk), lambda b, kh, j, *_: (b, 0, j))]
    in_specs.append(_table_spec(cfg))
    kv_shape = _to_layout(cfg, k).shape
    out_shape = [jax.ShapeDtypeStruct(kv_shape, k.dtype), jax.ShapeDtypeStruct(kv_shape, v.dtype)]
    out_specs = [_seq_spec(cfg, bk, kv_pick), _seq_spec(cfg, bk, kv_pick)]
    scratch, semantics = [], ("parallel",) * 3
    if grid_walk:
        scratch = [pl.tpu.VMEM((bk, cfg.head_dim), jnp.float32)] * 2
        semantics += ("arbitrary",)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg), out_shape=out_shape, grid=grid,
        in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch,
        compiler_params=_params(cfg, semantics, bk, threshold=64 * 128), backend=cfg.backend,
        name="flash_attention_dkdv")(
            _to_layout(cfg, q), _to_layout(cfg, k), _to_layout(cfg, v), _to_layout(cfg, do),
            lse, delta, *_aux_inputs(cfg, bias, mask, q_seg, kv_seg), table)
    return _from_layout(cfg, dk), _from_layout(cfg, dv)
