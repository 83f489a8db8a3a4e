"""The flash-attention pallas_calls: forward, dQ and dK/dV (FlashAttention-2, Dao 2023).

This module lays the operands out (BlockSpecs over ``[B, L, N, H]`` or
``[B, N, L, H]``, the grid, compiler parameters) and calls the kernels of
the call's strategy (:attr:`ops.attention.config.Backend.strategy`, chosen by
backend as fused_matmul's contraction walk):

* ``"grid"`` (interpret, mosaic_tpu), :mod:`ops.attention.grid_walk`: the
  walked blocks are the last grid axis, carries in scratch;
* ``"loop"`` (triton, pallas_triton), :mod:`ops.attention.loop_walk`: each
  program walks its visible range in an in-kernel loop over ``pl.ds`` slices
  of whole-length blocks, carries in registers.

Both drive the same programs (:mod:`ops.attention.programs`) and per-tile
math (:mod:`ops.attention.tile_math`); each program's visible range comes
from the scalar table of :mod:`ops.attention.range_table`.

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

import pallas_core as pl
from ops.attention import grid_walk, loop_walk
from ops.attention.config import Config
from ops.attention.tile_math import div, rem


# --------------------------------------------------------------------------
# Operand layout: BlockSpecs over [B, L, N, H] (or [B, N, L, H]) operands
# --------------------------------------------------------------------------

def padded_length(length: int, block: int, backend: str) -> int:
    """The whole-length block the loop strategy reads ``pl.ds`` slices of."""
    n = pl.cdiv(length, block) * block
    return pl.next_power_of_2(n) if pl.backend_traits(backend).power_of_two_blocks else n


def _heads_block(cfg: Config, n: int) -> int:
    return pl.next_power_of_2(n) if cfg.backend.traits.power_of_two_blocks else n


def _seq_spec(cfg: Config, block_l: int, pick, *, all_heads: bool = False, value: bool = False):
    """Block ``(block_l, H)`` (or ``(block_l, heads, H)``) of a ``[B, L, heads, H]`` operand.

    ``pick(*ids) -> (b, l, n)``: the batch, sequence-block and head indices
    (n ignored with ``all_heads``). BNTH operands are ``[B, heads, L, H]``.
    ``value``: an operand of the value head dim (v, out, dO, dV).
    """
    h = cfg.problem.v_dim if value else cfg.problem.head_dim

    def index_map(*ids):
        b, l, n = pick(*ids)
        n = 0 if all_heads else n
        return (b, l, n, 0) if cfg.backend.layout == "BTNH" else (b, n, l, 0)

    heads = None
    if all_heads:
        heads = _heads_block(cfg, cfg.problem.heads)
    shape = (None, block_l, heads, h) if cfg.backend.layout == "BTNH" else (None, heads, block_l, h)
    return pl.BlockSpec(shape, index_map)


def _stat_spec(cfg: Config, block_l: int, pick, *, all_heads: bool = False):
    """Block of a float32 ``[B, N, T, 1]`` per-row statistic (lse, delta)."""
    def index_map(*ids):
        b, l, n = pick(*ids)
        return (b, 0 if all_heads else n, l, 0)
    heads = _heads_block(cfg, cfg.problem.heads) if all_heads else None
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
    space = cfg.backend.traits.scalar_memory
    return pl.BlockSpec(memory_space=space) if space is not None else pl.BlockSpec()


def sinks_operand(sinks):
    """The float32 ``[N]`` sink logits zero-padded to a power-of-two length, a whole
    block of scalars read at the program's head (:func:`_table_spec`'s placement)."""
    sinks = sinks.astype(jnp.float32)
    size = pl.next_power_of_2(max(sinks.shape[0], 2))
    return jnp.pad(sinks, (0, size - sinks.shape[0]))


def _params(cfg: Config, semantics, accumulator_rows: int, threshold: int = 128 * 128):
    """Compiler params; Triton gets 8 warps once the float32 accumulator tiles
    (``accumulator_rows x H``, H padded to a power of two) reach ``threshold``
    elements, 4 below: the split that compiles for sm_90 without spills."""
    traits = cfg.backend.traits
    if traits.triton:
        tile = accumulator_rows * pl.next_power_of_2(max(cfg.problem.head_dim, cfg.problem.v_dim))
        warps = cfg.blocks.num_warps or (8 if tile >= threshold else 4)
        stages = cfg.blocks.num_stages or 2
        if traits.through_jax:  # JAX's Triton lowering: no dimension semantics
            return pl.triton.CompilerParams(num_warps=warps, num_stages=stages)
        return pl.triton.CompilerParams(num_warps=warps, num_stages=stages,
                                        dimension_semantics=semantics)
    return pl.CompilerParams(dimension_semantics=semantics)


def _walk(cfg: Config):
    """The module of the kernels for ``cfg``'s strategy."""
    return loop_walk if cfg.backend.strategy == "loop" else grid_walk


def _aux_inputs(cfg: Config, bias, mask, q_seg, kv_seg):
    """The optional operands in kernel order, as arrays (seg ids reshaped for their blocks)."""
    ops_ = []
    if bias is not None:
        ops_.append(bias)
    if mask is not None:
        ops_.append(mask)
    if cfg.problem.spec.segments:
        ops_ += [q_seg[:, :, None], kv_seg[:, None, :]]
    return ops_


def _to_layout(cfg: Config, x):
    return x if cfg.backend.layout == "BTNH" else jnp.swapaxes(x, 1, 2)


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
        bq, specs = cfg.blocks.block_q, []
        if has_bias:
            specs.append(_pair_spec(cfg.problem.bias_full, bq, self.kv_block, self.pair))
        if has_mask:
            specs.append(_pair_spec(cfg.problem.mask_full, bq, self.kv_block, self.pair))
        if cfg.problem.spec.segments:
            specs += [pl.BlockSpec((None, bq, 1), lambda b, n, i, *_: (b, i, 0)), self.seg_k]
        return specs


def _query_block_layout(cfg: Config) -> _QueryBlockLayout:
    bq, bk, g = cfg.blocks.block_q, cfg.blocks.block_k, cfg.problem.group
    nq, nk = pl.cdiv(cfg.problem.spec.T, bq), pl.cdiv(cfg.problem.spec.S, bk)
    q_pick = lambda b, n, i, *_: (b, i, n)
    if cfg.backend.strategy == "grid":
        return _QueryBlockLayout(
            grid=(cfg.problem.batch, cfg.problem.heads, nq, nk),
            semantics=("parallel",) * 3 + ("arbitrary",),
            kv_block=bk, q_pick=q_pick, kv_pick=lambda b, n, i, j: (b, j, div(n, g)),
            pair=lambda b, n, i, j: (b, i, j, n),
            seg_k=pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, j)))
    kv_block = padded_length(cfg.problem.spec.S, bk, cfg.backend.name)
    return _QueryBlockLayout(
        grid=(cfg.problem.batch, cfg.problem.heads, nq), semantics=("parallel",) * 3,
        kv_block=kv_block,
        q_pick=q_pick, kv_pick=lambda b, n, i: (b, 0, div(n, g)), pair=lambda b, n, i: (b, i, 0, n),
        seg_k=pl.BlockSpec((None, 1, kv_block), lambda b, n, i: (b, 0, 0)))


def _out_shape(cfg: Config, q):
    """The output's ``ShapeDtypeStruct`` in the call's layout: q's, with the value head dim."""
    return jax.ShapeDtypeStruct(_to_layout(cfg, q).shape[:-1] + (cfg.problem.v_dim,), q.dtype)


def forward_call(cfg: Config, q, k, v, bias, mask, q_seg, kv_seg, table, sinks=None):
    """``(out [B, T, N, Hv] in q's dtype, lse float32 [B, N, T, 1])``."""
    T, bq = cfg.problem.spec.T, cfg.blocks.block_q
    lay = _query_block_layout(cfg)
    grid_walk, q_pick = cfg.backend.strategy == "grid", lay.q_pick
    in_specs = [_seq_spec(cfg, bq, q_pick), _seq_spec(cfg, lay.kv_block, lay.kv_pick),
                _seq_spec(cfg, lay.kv_block, lay.kv_pick, value=True)]
    in_specs += lay.aux_specs(cfg, bias is not None, mask is not None)
    aux = _aux_inputs(cfg, bias, mask, q_seg, kv_seg)
    if cfg.score.sinks:
        in_specs.append(_table_spec(cfg))
        aux.append(sinks_operand(sinks))
    in_specs.append(_table_spec(cfg))
    out_shape = [_out_shape(cfg, q),
                 jax.ShapeDtypeStruct((cfg.problem.batch, cfg.problem.heads, T, 1), jnp.float32)]
    out_specs = [_seq_spec(cfg, bq, q_pick, value=True), _stat_spec(cfg, bq, q_pick)]
    scratch = []
    if grid_walk:
        scratch = [pl.tpu.VMEM((bq, 1), jnp.float32), pl.tpu.VMEM((bq, 1), jnp.float32),
                   pl.tpu.VMEM((bq, cfg.problem.v_dim), jnp.float32)]
    out, lse = pl.pallas_call(
        functools.partial(_walk(cfg).forward_kernel, cfg=cfg), out_shape=out_shape, grid=lay.grid,
        in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch,
        compiler_params=_params(cfg, lay.semantics, bq), backend=cfg.backend.name,
        name="flash_attention_fwd")(
            _to_layout(cfg, q), _to_layout(cfg, k), _to_layout(cfg, v), *aux, table)
    return _from_layout(cfg, out), lse


# --------------------------------------------------------------------------
# dQ (also the bias gradient)
# --------------------------------------------------------------------------

def dq_call(cfg: Config, q, k, v, do, lse, delta, bias, mask, q_seg, kv_seg, table, want_dbias):
    """``dq [B, T, N, H]`` (q's dtype) and, with ``want_dbias``, float32 ``[B, N, T, S]``."""
    T, S, bq = cfg.problem.spec.T, cfg.problem.spec.S, cfg.blocks.block_q
    lay = _query_block_layout(cfg)
    grid_walk = cfg.backend.strategy == "grid"
    q_pick, kv_block, pair = lay.q_pick, lay.kv_block, lay.pair
    in_specs = [_seq_spec(cfg, bq, q_pick), _seq_spec(cfg, kv_block, lay.kv_pick),
                _seq_spec(cfg, kv_block, lay.kv_pick, value=True),
                _seq_spec(cfg, bq, q_pick, value=True),
                _stat_spec(cfg, bq, q_pick), _stat_spec(cfg, bq, q_pick)]
    in_specs += lay.aux_specs(cfg, bias is not None, mask is not None)
    in_specs.append(_table_spec(cfg))
    out_shape = [jax.ShapeDtypeStruct(_to_layout(cfg, q).shape, q.dtype)]
    out_specs = [_seq_spec(cfg, bq, q_pick)]
    operands = [_to_layout(cfg, q), _to_layout(cfg, k), _to_layout(cfg, v), _to_layout(cfg, do),
                lse, delta, *_aux_inputs(cfg, bias, mask, q_seg, kv_seg), table]
    aliases = {}
    if want_dbias:
        out_shape.append(jax.ShapeDtypeStruct((cfg.problem.batch, cfg.problem.heads, T, S),
                                              jnp.float32))
        out_specs.append(_pair_spec((True,) * 4, bq, kv_block, pair))
        if not grid_walk:  # only visible blocks are written: start from zeros
            in_specs.append(out_specs[-1])
            operands.append(jnp.zeros((cfg.problem.batch, cfg.problem.heads, T, S), jnp.float32))
            aliases = {len(operands) - 1: 1}
    scratch = [pl.tpu.VMEM((bq, cfg.problem.head_dim), jnp.float32)] if grid_walk else []
    kernel = functools.partial(_walk(cfg).dq_kernel, cfg=cfg, want_dbias=want_dbias)
    if aliases:
        kernel = _ignore_input(kernel, position=len(operands) - 1)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=lay.grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch, input_output_aliases=aliases,
        compiler_params=_params(cfg, lay.semantics, bq), backend=cfg.backend.name,
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
# dK/dV
# --------------------------------------------------------------------------

def dkdv_call(cfg: Config, q, k, v, do, lse, delta, bias, mask, q_seg, kv_seg, table):
    """``(dk, dv)``, ``[B, S, K, H]`` in k's dtype."""
    T, S = cfg.problem.spec.T, cfg.problem.spec.S
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    nq, nk = pl.cdiv(T, bq), pl.cdiv(S, bk)
    g = cfg.problem.group
    grid_walk = cfg.backend.strategy == "grid"
    kv_pick = lambda b, kh, j, *_: (b, j, kh)
    if grid_walk:
        grid = (cfg.problem.batch, cfg.problem.kv_heads, nk, g * nq)
        q_block, all_heads = bq, False
        q_pick = lambda b, kh, j, t: (b, rem(t, nq), kh * g + div(t, nq))
        pair = lambda b, kh, j, t: (b, rem(t, nq), j, kh * g + div(t, nq))
        seg_q = pl.BlockSpec((None, bq, 1), lambda b, kh, j, t: (b, rem(t, nq), 0))
    else:
        grid = (cfg.problem.batch, cfg.problem.kv_heads, nk)
        q_block, all_heads = padded_length(T, bq, cfg.backend.name), True
        q_pick = lambda b, kh, j: (b, 0, 0)
        pair = lambda b, kh, j: (b, 0, j, 0)
        seg_q = pl.BlockSpec((None, q_block, 1), lambda b, kh, j: (b, 0, 0))
    in_specs = [_seq_spec(cfg, q_block, q_pick, all_heads=all_heads),
                _seq_spec(cfg, bk, kv_pick), _seq_spec(cfg, bk, kv_pick, value=True),
                _seq_spec(cfg, q_block, q_pick, all_heads=all_heads, value=True),
                _stat_spec(cfg, q_block, q_pick, all_heads=all_heads),
                _stat_spec(cfg, q_block, q_pick, all_heads=all_heads)]
    heads_block = _heads_block(cfg, cfg.problem.heads)
    if bias is not None:
        in_specs.append(_pair_spec(cfg.problem.bias_full, q_block, bk, pair, all_heads=all_heads,
                                   heads=heads_block))
    if mask is not None:
        in_specs.append(_pair_spec(cfg.problem.mask_full, q_block, bk, pair, all_heads=all_heads,
                                   heads=heads_block))
    if cfg.problem.spec.segments:
        in_specs += [seg_q, pl.BlockSpec((None, 1, bk), lambda b, kh, j, *_: (b, 0, j))]
    in_specs.append(_table_spec(cfg))
    out_shape = [jax.ShapeDtypeStruct(_to_layout(cfg, k).shape, k.dtype),
                 jax.ShapeDtypeStruct(_to_layout(cfg, v).shape, v.dtype)]
    out_specs = [_seq_spec(cfg, bk, kv_pick), _seq_spec(cfg, bk, kv_pick, value=True)]
    scratch, semantics = [], ("parallel",) * 3
    if grid_walk:
        scratch = [pl.tpu.VMEM((bk, cfg.problem.head_dim), jnp.float32),
                   pl.tpu.VMEM((bk, cfg.problem.v_dim), jnp.float32)]
        semantics += ("arbitrary",)
    dk, dv = pl.pallas_call(
        functools.partial(_walk(cfg).dkdv_kernel, cfg=cfg), out_shape=out_shape, grid=grid,
        in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch,
        compiler_params=_params(cfg, semantics, bk, threshold=64 * 128), backend=cfg.backend.name,
        name="flash_attention_dkdv")(
            _to_layout(cfg, q), _to_layout(cfg, k), _to_layout(cfg, v), _to_layout(cfg, do),
            lse, delta, *_aux_inputs(cfg, bias, mask, q_seg, kv_seg), table)
    return _from_layout(cfg, dk), _from_layout(cfg, dv)
