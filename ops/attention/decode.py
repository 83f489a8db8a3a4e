"""Split-KV decode (flash-decoding): the forward pass when there are few queries and many keys.

Decoding asks one new query (or a few) per sequence against a long key/value
cache. The flash kernel gives each (batch, query head, query block) one
program that walks the whole cache alone: at batch 1 a GPU runs a handful of
programs, and each query head of a GQA group reads the same key/value heads
again. Here (Dao, Haziza, Massa and Sizov, "Flash-Decoding for long-context
inference", PyTorch blog, 2023; the GQA group as the rows of one query tile
as FlashAttention-3's decoding kernels pack it):

* one program per (batch, key/value head, split): all ``T * G`` queries of
  the key/value head's group (``G = N // K`` query heads, ``T`` queries) are
  the rows of one query tile, so each key/value tile is loaded once for the
  whole group;
* the key/value blocks a query can see, ``[lo, hi)`` per batch entry (lengths,
  windows, segments and causality cut it, :mod:`ops.attention.masking`), are
  split into ``k_splits`` equal shares, one per program; each writes the
  share's normalized output and logsumexp (float32);
* a second small kernel, one program per (batch, key/value head), merges the
  shares: ``lse = log(sum_s exp(lse_s) [+ exp(sink)])`` and ``out = sum_s
  exp(lse_s - lse) out_s``, the same float32 math as the unsplit kernel's
  online softmax, in another order (equal within float32 rounding). Attention
  sinks join here, once per row.

The backward pass is the flash kernels' (it needs only the merged logsumexp).
Supported: causal (top-left aligned, as everywhere in the op), local windows,
soft cap, sinks, segment ids and sequence lengths, a value head dim of its own;
a bias, a mask array or dropout keep the unsplit kernels (an explicit
``k_splits > 1`` with them is a ValueError). On the loop strategy (Triton)
the shares split the visible range at run time; on the grid strategy
(interpret, Mosaic TPU), whose blocks are fixed by the BlockSpecs, each split
owns a static slice of the cache and skips what is not visible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention import calls, grid_walk, loop_walk, range_table
from ops.attention.block_sizes import MAX_ROWS, MAX_SPLITS, split_kv_applies
from ops.attention.config import Config
from ops.attention.masking import QUERY_PAD, block_ranges, block_visibility
from ops.attention.tile_math import LN2, LOG2E
from ops.reduction._rows import logsumexp_shift

GPU_PROGRAMS = 264  # programs that fill an H100's 132 SMs twice
MIN_BLOCKS_PER_SPLIT = 4  # key/value blocks a split walks at least (else the merge dominates)


def default_k_splits(batch: int, kv_heads: int, T: int, S: int, group: int, block_k: int,
                     backend: str) -> int:
    """The heuristic: how many programs share one (batch, key/value head)'s keys.

    1 (the unsplit kernels) unless the call has at most ``MAX_ROWS`` query rows
    per key/value head. On GPUs (and the interpreters, which then run the same
    kernels) as FlashAttention's split heuristic: enough programs to fill an
    H100 twice (``GPU_PROGRAMS``), each split walking at least
    ``MIN_BLOCKS_PER_SPLIT`` key blocks, a power of two up to ``MAX_SPLITS``.
    On Mosaic TPU, whose grid runs in order on one core (or two, megacore), 2
    only when the batch and key/value heads alone leave a megacore core idle.
    """
    if T * group > MAX_ROWS:
        return 1
    programs = max(1, batch * kv_heads)
    blocks = pl.cdiv(S, block_k)
    if pl.backend_traits(backend).hardware == "tpu":
        return 2 if programs == 1 and blocks >= 2 * MIN_BLOCKS_PER_SPLIT else 1
    want = min(pl.cdiv(GPU_PROGRAMS, programs), blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    if want < 2:
        return 1
    return 1 << (want.bit_length() - 1)  # a power of two (pallas_triton's blocks)


def rows_block(cfg: Config) -> int:
    """Rows of the decode query tile: ``T * G`` padded. On the Triton backends always
    ``MAX_ROWS`` = 64, ``wgmma``'s M per warp group on sm_90: with 16 rows (``tl.dot``'s
    minimum) the products fall back to ``mma.sync``; the padding rows cost tensor-core
    time, which a loop bound by reading K/V has to spare (sm_90 at h128, 64-key tiles:
    140 registers, 80 KiB shared memory, no spills). A multiple of 8 elsewhere."""
    rows = cfg.problem.spec.T * cfg.problem.group
    if cfg.backend.traits.triton:
        return MAX_ROWS
    return max(8, pl.cdiv(rows, 8) * 8)


def _query_rows(cfg: Config, x, rows: int, fill=0):
    """``[B, T, N, ...]`` -> ``[B, K, rows, ...]``, row ``t * G + g`` holding head ``kh * G + g``."""
    b, t = x.shape[:2]
    rest = x.shape[3:]
    kv_heads, g = cfg.problem.kv_heads, cfg.problem.group
    x = x.reshape(b, t, kv_heads, g, *rest)
    x = jnp.moveaxis(x, 2, 1).reshape(b, kv_heads, t * g, *rest)
    pad = [(0, 0), (0, 0), (0, rows - t * g)] + [(0, 0)] * len(rest)
    return jnp.pad(x, pad, constant_values=fill)


def _from_rows(cfg: Config, x):
    """``[B, K, rows, ...]`` -> ``[B, T, N, ...]`` (the inverse of :func:`_query_rows`)."""
    b, t = x.shape[0], cfg.problem.spec.T
    rest = x.shape[3:]
    g = cfg.problem.group
    x = x[:, :, :t * g].reshape(b, cfg.problem.kv_heads, t, g, *rest)
    return jnp.moveaxis(x, 1, 2).reshape(b, t, cfg.problem.heads, *rest)


def forward(cfg: Config, q, k, v, q_seg, kv_seg, sinks):
    """``(out [B, T, N, Hv] in q's dtype, lse float32 [B, N, T, 1])``, as
    :func:`ops.attention.calls.forward_call` returns them."""
    rows, splits, bk = rows_block(cfg), cfg.blocks.k_splits, cfg.blocks.block_k
    loop = cfg.backend.strategy == "loop"
    B, K, S = cfg.problem.batch, cfg.problem.kv_heads, cfg.problem.spec.S
    vis = block_visibility(cfg.problem.spec, max(cfg.problem.spec.T, 1), bk, q_seg, kv_seg)
    table = range_table.pack(None, block_ranges(vis, B))
    operands = [_query_rows(cfg, q, rows), calls._to_layout(cfg, k), calls._to_layout(cfg, v)]
    q_spec = pl.BlockSpec((None, None, rows, cfg.problem.head_dim),
                          lambda b, kh, s, *_: (b, kh, 0, 0))
    nk = pl.cdiv(S, bk)
    if loop:
        grid, kv_block = (B, K, splits), calls.padded_length(S, bk, cfg.backend.name)
        kv_pick = lambda b, kh, s: (b, 0, kh)
        seg_k = pl.BlockSpec((None, 1, kv_block), lambda b, kh, s: (b, 0, 0))
        kernel = functools.partial(loop_walk.decode_kernel, cfg=cfg)
        semantics = ("parallel",) * 3
    else:
        per = pl.cdiv(nk, splits)
        grid, kv_block = (B, K, splits, per), bk
        block = lambda s, t: jnp.minimum(s * per + t, nk - 1)
        kv_pick = lambda b, kh, s, t: (b, block(s, t), kh)
        seg_k = pl.BlockSpec((None, 1, bk), lambda b, kh, s, t: (b, 0, block(s, t)))
        kernel = functools.partial(grid_walk.decode_kernel, cfg=cfg, per_split=per)
        semantics = ("parallel",) * 3 + ("arbitrary",)
    in_specs = [q_spec, calls._seq_spec(cfg, kv_block, kv_pick),
                calls._seq_spec(cfg, kv_block, kv_pick, value=True)]
    if cfg.problem.spec.segments:
        q_ids = _query_rows(cfg, jnp.repeat(q_seg[:, :, None], cfg.problem.heads, axis=2), rows,
                            fill=QUERY_PAD)
        operands += [q_ids[..., None], kv_seg[:, None, :]]
        in_specs += [pl.BlockSpec((None, None, rows, 1), lambda b, kh, s, *_: (b, kh, 0, 0)), seg_k]
    operands.append(table)
    in_specs.append(calls._table_spec(cfg))
    part = lambda b, kh, s, *_: (b, kh, s, 0)
    out_shape = [jax.ShapeDtypeStruct((B, K, splits * rows, cfg.problem.v_dim), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, splits * rows, 1), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, rows, cfg.problem.v_dim), part),
                 pl.BlockSpec((None, None, rows, 1), part)]
    scratch = [] if loop else [pl.tpu.VMEM((rows, 1), jnp.float32),
                               pl.tpu.VMEM((rows, 1), jnp.float32),
                               pl.tpu.VMEM((rows, cfg.problem.v_dim), jnp.float32)]
    out_part, lse_part = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch, compiler_params=calls._params(cfg, semantics, rows),
        backend=cfg.backend.name, name="flash_decoding_split")(*operands)
    out, lse = merge_call(cfg, out_part, lse_part, sinks, rows, q.dtype)
    lse = jnp.transpose(_from_rows(cfg, lse[..., 0]), (0, 2, 1))[..., None]
    return _from_rows(cfg, out), lse


def merge_call(cfg: Config, out_part, lse_part, sinks, rows: int, dtype):
    """The merge kernel: ``(out [B, K, rows, Hv] in dtype, lse float32 [B, K, rows, 1])``
    from the splits' ``[B, K, splits * rows, ...]`` partial outputs and logsumexps."""
    B, K, splits = cfg.problem.batch, cfg.problem.kv_heads, cfg.blocks.k_splits
    whole = lambda width: pl.BlockSpec((None, None, splits * rows, width),
                                       lambda b, kh: (b, kh, 0, 0))
    own = lambda width: pl.BlockSpec((None, None, rows, width), lambda b, kh: (b, kh, 0, 0))
    operands, in_specs = [out_part, lse_part], [whole(cfg.problem.v_dim), whole(1)]
    if sinks is not None:  # each row's head's sink, [K, rows, 1]
        per_row = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :],
                                   (1, cfg.problem.spec.T, cfg.problem.heads))
        operands.append(_query_rows(cfg, per_row, rows)[0][..., None])
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda b, kh: (kh, 0, 0)))
    kernel = functools.partial(_merge_kernel, splits=splits, rows=rows, sinks=sinks is not None)
    return pl.pallas_call(
        kernel, grid=(B, K), in_specs=in_specs, out_specs=[own(cfg.problem.v_dim), own(1)],
        out_shape=[jax.ShapeDtypeStruct((B, K, rows, cfg.problem.v_dim), dtype),
                   jax.ShapeDtypeStruct((B, K, rows, 1), jnp.float32)],
        compiler_params=calls._params(cfg, ("parallel", "parallel"), rows),
        backend=cfg.backend.name, name="flash_decoding_merge")(*operands)


def _merge_kernel(*refs, splits: int, rows: int, sinks: bool):
    """Online logsumexp over the splits (log2 units), each split's output weighted by
    ``exp(lse_s - lse)``; a sink starts the sum as a share of output zero."""
    out_ref, lse_ref = refs[-2:]
    o_ref, l_ref = refs[0], refs[1]
    if sinks:
        m = refs[2][...] * LOG2E
        total = jnp.ones((rows, 1), jnp.float32)
    else:
        m = jnp.full((rows, 1), -jnp.inf, jnp.float32)
        total = jnp.zeros((rows, 1), jnp.float32)
    acc = jnp.zeros((rows, out_ref.shape[-1]), jnp.float32)

    def step(s, carry):
        m, total, acc = carry
        part = loop_walk.slice_rows(o_ref, s * rows, rows)
        lse2 = loop_walk.slice_rows(l_ref, s * rows, rows) * LOG2E
        m_new = jnp.maximum(m, lse2)
        shift = logsumexp_shift(m_new)
        alpha, w = jnp.exp2(m - shift), jnp.exp2(lse2 - shift)
        return m_new, total * alpha + w, acc * alpha + part * w

    m, total, acc = lax.fori_loop(0, splits, step, (m, total, acc))
    seen = total > 0
    out_ref[...] = (acc / jnp.where(seen, total, 1.0)).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, total, 1.0))) * LN2, -jnp.inf)
