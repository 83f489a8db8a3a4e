"""The query-blocked kernel of ``ops.ragged_paged_attention``: chunked prefill that reads
each page once per query block, and decode (one token per item) over multi-page key tiles
for both paged ops (:func:`decode_config`).

The split-KV decode kernel (:mod:`ops.serving.kernels`) serves a ragged batch
token by token: a prefill chunk of ``q_len`` tokens reads its sequence's cache
``q_len`` times. Here a *work item* is one (sequence, query block) pair: up to
``block_q`` consecutive query tokens of one sequence. A program owns one item
and one key/value head; its query tile is the block's tokens times the ``G``
query heads of that key/value head, ``[block_q * G, H]`` (token-major rows, padded
to a power of two of at least 64 on the Triton backends, wgmma's rows), so every
key/value tile it loads serves ``block_q * G`` query rows. The items come from a table built outside
the kernel from ``cu_q_lens``, ``kv_lens`` and ``num_seqs``
(:func:`work_items`): at most ``min(T // block_q + min(S, T), T)`` of them (a
static bound: each sequence adds at most one partial block, and every item holds
a token), the unused ones with an empty key range, so they cost a program that
loads nothing. The blocking is that of JAX's TPU ``ragged_paged_attention``
(``num_queries_per_block``, all query heads of a key/value head together), here
on every backend.

Each item sees the keys ``[lo, hi)`` of its sequence: ``hi`` is one past its
last token's position (each sequence's queries are the last ``q_len`` tokens of
its ``kv_len``), ``lo`` that position's sliding-window start (0 without a
window). Within it, each query row is causal against its own position ``p``
(keys ``p - window < j <= p``), so the diagonal tiles are masked per row; the
logits are FlashAttention-2's online softmax (Dao 2023, Algorithm 1) over key
tiles of ``pages_per_block`` pages (:mod:`ops.attention.tile_math`), one
max and one rescale per tile whatever the page size. A sink logit starts each
row's running max and sum (a key of value 0 seen first). When items are few
(a verification batch, a short chunk over a long cache) ``k_splits`` programs
share each item's key tiles on the loop walk (flash-decoding's split), their
partials and logsumexps merged by the decode kernels' merge, which then adds the
sinks.

Two walks, by what the backend offers (:class:`pallas_core.BackendTraits`):

* ``"loop"`` (the Triton backends and the interpreter): one program per (item,
  key/value head, split) loops over the key tiles its range touches, no more; a key
  tile's rows are gathered straight from the cache seen as ``[pages * page_size,
  2K, H]`` (row ``page * page_size + offset``, the page looked up in the table
  with a vector index), so small pages make one tile without copying.
* ``"grid"`` (Mosaic TPU, which has no gathers): the key tiles are the last grid
  axis, each page a BlockSpec whose index map looks it up through scalar
  prefetch (the decode kernel's specs), the pages of a step concatenated into
  one tile; tiles outside the item's range are skipped and their index maps
  repeat a visible page (no copy).

On the loop walk the tiles every row of the item sees whole (all but the
causal diagonal, the window's start and the cache's end) run without a mask, in
a loop of their own.

Cost (sm_90, bf16, H 128, GQA 8:1, 16 tokens x 8 heads = 128 query rows, 8
warps, 16-token pages; SASS instructions per thread per key of a loop
iteration): one page per key tile, 12.8 for whole tiles and 15.8 masked; four
pages (64 keys), 5.7 and 8.3; eight pages (128 keys, the default), 4.5 and
7.0, with 223 registers and no spills (4 warps spill at 128 rows). Decode (one
token per item, 8 heads padded to 64 rows, 4 warps, eight pages per tile): 4.7
whole and 8.5 masked with 221 registers, against 15.4 in the per-page decode
kernel (:func:`ops.serving.block_sizes.multi_page_decode`). Cache bytes
read per call: every item reads the pages of ``[lo, hi)`` once, i.e. about
``kv_len / block_q`` page reads per query token instead of ``kv_len``.
Queries are gathered into item tiles and the outputs scattered back by XLA
outside the kernel (``O(T * N * H)``, small next to the cache).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops._op import Device
from ops.attention.tile_math import (LOG2E, ScoreMath, Tile, div, forward_finish, forward_update,
                                     rem)
from ops.serving import kernels
from ops.serving.block_sizes import MAX_SPLITS, TARGET_PROGRAMS, multi_page_decode

GRID, LOOP = "grid", "loop"


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Everything static about one query-blocked call.

    Attributes:
      items: work items (the grid's first axis); block_q: query tokens per item.
      kv_heads, group, head_dim: the query ``[T, kv_heads * group, head_dim]``.
      rows: the query tile's rows (``block_q * group``, padded to a power of two of
        at least 64 on the Triton backends: :func:`ops.serving.kernels.group_rows`).
      page_size, total_pages, pages_per_row, pages_per_block: the cache, the
        table's width and the pages of one key tile.
      window: the sliding window (None: none).
      walk: ``"loop"`` or ``"grid"`` (module docstring).
      heads_per_program: key/value heads one program owns (all of them on the
        grid walk: a TPU block of the combined cache holds every head of a page).
      k_splits: programs sharing each item's key tiles (loop walk only), their
        partial outputs merged by the decode kernels' merge (which then adds the sinks).
      layout: the cache's (:data:`ops.serving.kernels.COMBINED`, or
        :data:`ops.serving.kernels.HEADS_FIRST` separate key and value pages ``[K, P,
        page_size, H]``, loop walk only); per_token_scales: int8 pages with per-token
        scale pages ``[K, P, page_size]`` (HEADS_FIRST).
    """

    backend: str
    items: int
    block_q: int
    kv_heads: int
    group: int
    rows: int
    head_dim: int
    page_size: int
    total_pages: int
    pages_per_row: int
    pages_per_block: int
    scale: float
    soft_cap: float | None
    window: int | None
    k_scale: float | None
    v_scale: float | None
    sinks: bool
    dtype: str
    walk: str = LOOP
    heads_per_program: int = 1
    k_splits: int = 1
    num_warps: int | None = None
    num_stages: int | None = None
    layout: str = kernels.COMBINED
    per_token_scales: bool = False

    @property
    def block_keys(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def tile_bytes(self) -> int:
        """Bytes of one key tile and its value tile in the query's dtype (dequantized)."""
        return 2 * self.block_keys * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def blocks(self) -> int:
        return pl.cdiv(self.pages_per_row, self.pages_per_block)

    @property
    def merged(self) -> bool:
        return self.k_splits > 1

    @classmethod
    def build(cls, op: str, impl: str, bs, *, tokens: int, slots: int, block_q: int,
              kv_heads: int, group: int, head_dim: int, page_size: int, total_pages: int,
              pages_per_row: int, dtype, explicit_splits: bool = False,
              **fields) -> "PrefillConfig":
        """The config of one call on ``impl`` with block sizes ``bs`` (a
        :class:`ops.serving.block_sizes.PagedBlockSizes`: its ``pages_per_block``,
        raised until a key tile has the backend's smallest product's rows, and launch
        parameters, 8 warps by default for query tiles of 128 rows or more, which
        spill at 4 on sm_90; its ``k_splits`` when ``explicit_splits``, else
        :func:`prefill_splits`).

        Raises:
          NotImplementedError: a head dim or page size that is not a power of two on
            JAX's Triton lowering (it takes power-of-two tensors only).
        """
        traits = pl.backend_traits(impl)
        if traits.power_of_two_blocks:
            for name, n in (("head_dim", head_dim), ("page_size", page_size)):
                if n & (n - 1):
                    raise NotImplementedError(f"{op}: implementation={impl!r} needs a "
                                              f"power-of-two {name}; got {n}.")
        # Key tiles of 16 rows or more on both Triton lowerings: ours refuses a dot
        # operand dim under 16 (min_dot), and JAX's, which takes any, would run a smaller
        # one on mma.sync instead of wgmma (Triton pads small products; sm_90 compiles).
        min_dot = max(traits.min_dot, 16 if traits.triton else 1)
        per_block = max(bs.pages_per_block, pl.cdiv(min_dot, page_size))
        per_block = min(per_block, pl.next_power_of_2(pages_per_row))
        rows = kernels.group_rows(impl, block_q * group)  # >= 64 on Triton: wgmma's rows
        walk = walk_of(impl)
        items = min(tokens // block_q + min(slots, tokens), tokens)
        splits = (bs.k_splits if explicit_splits else
                  prefill_splits(impl, items * kv_heads, pl.cdiv(pages_per_row, per_block)))
        return cls(backend=impl, items=items, block_q=block_q,
                   kv_heads=kv_heads, group=group, rows=rows, head_dim=head_dim,
                   page_size=page_size, total_pages=total_pages, pages_per_row=pages_per_row,
                   pages_per_block=per_block, dtype=np.dtype(dtype).name, walk=walk,
                   heads_per_program=kv_heads if walk == GRID else 1,
                   k_splits=1 if walk == GRID else splits,
                   num_warps=bs.num_warps or (8 if traits.triton and rows >= 128 else None),
                   num_stages=bs.num_stages, **fields)

    def pages_view(self) -> kernels.DecodeConfig:
        """The decode kernel's config for the same pages (its BlockSpecs, page reads
        and score math): rows are items, the range of each is ``[lo, hi)``."""
        return kernels.DecodeConfig(
            backend=self.backend, layout=kernels.COMBINED, rows=self.items,
            kv_heads=self.kv_heads, group=self.rows, group_rows=self.rows,
            head_dim=self.head_dim, page_size=self.page_size, total_pages=self.total_pages,
            pages_per_row=self.pages_per_row, pages_per_block=self.pages_per_block, k_splits=1,
            scale=self.scale, soft_cap=self.soft_cap, dtype=self.dtype, k_scale=self.k_scale,
            v_scale=self.v_scale, indirect=True, heads_per_program=self.heads_per_program,
            num_warps=self.num_warps, num_stages=self.num_stages)


def decode_config(op, impl: str, explicit, *, rows: int, kv_heads: int, group: int,
                  head_dim: int, page_size: int, pages_per_row: int, dtype,
                  **fields) -> PrefillConfig | None:
    """The config of a decode call (one query token per row, ``rows`` rows and sequence
    slots) of ``op`` (an :class:`ops._op.Op`) on this kernel's multi-page key tiles, or
    None where the per-page decode kernel (:mod:`ops.serving.kernels`) serves it: off the
    loop walk, for non-power-of-two pages or head dims on JAX's Triton lowering, and
    where :func:`ops.serving.block_sizes.multi_page_decode` says so. ``fields``: the
    rest of :meth:`PrefillConfig.build`'s."""
    pow2 = not (page_size & (page_size - 1) or head_dim & (head_dim - 1))
    if walk_of(impl) != LOOP or (not pow2 and pl.backend_traits(impl).power_of_two_blocks):
        return None
    problem = op.problem((rows, kv_heads, group, head_dim, page_size, pages_per_row), dtype)
    cfg = PrefillConfig.build(
        op.name, impl, op.select(problem, impl, explicit), tokens=rows, slots=rows, block_q=1,
        kv_heads=kv_heads, group=group, head_dim=head_dim, page_size=page_size,
        pages_per_row=pages_per_row, dtype=dtype, explicit_splits=explicit is not None,
        **fields)
    device = Device.current(impl)
    float32_gpu = (np.dtype(dtype).itemsize > 2 and device.traits.hardware == "gpu"
                   and not device.interpreter)
    return cfg if multi_page_decode(explicit, True, cfg.tile_bytes, float32_gpu) else None


def walk_of(impl: str) -> str:
    """The kernel's walk on ``impl``: ``"grid"`` on Mosaic TPU (no vector gathers), else
    ``"loop"``."""
    # Mosaic's TPU lowering has no vector gather from a Ref, which the loop walk's
    # row-gathered key tiles need; its grid axes run in order, so pages come as blocks.
    traits = pl.backend_traits(impl)
    return GRID if traits.hardware == "tpu" and traits.sequential_grid else LOOP


def prefill_splits(impl: str, programs: int, tiles: int) -> int:
    """Splits of each item's key tiles: on a GPU (not Triton's CPU interpreter) as many as
    it takes to launch :data:`ops.serving.block_sizes.TARGET_PROGRAMS` programs over
    ``programs`` (items x key/value heads), at most one per key tile (``tiles``) and
    :data:`ops.serving.block_sizes.MAX_SPLITS`: few long sequences (a verification
    batch, a short chunk against a long cache) fill the GPU. 1 elsewhere."""
    device = Device.current(impl)
    if device.traits.hardware != "gpu" or device.interpreter:
        return 1
    return max(1, min(pl.cdiv(TARGET_PROGRAMS, max(programs, 1)), tiles, MAX_SPLITS))


# --------------------------------------------------------------------------
# Work items (XLA, outside the kernel)
# --------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("items", "block_q", "capacity", "window"))
def work_items(cu_q_lens, kv_lens, num_seqs, *, items: int, block_q: int, capacity: int,
               window: int | None):
    """The items of a ragged batch: ``(seq, lo, hi, full_lo, full_hi)`` int32 ``[items]``
    and each item's tokens ``token`` int32 ``[items, block_q]`` with their positions
    ``pos``.

    Item ``m`` is block ``b`` of sequence ``seq``: its tokens ``cu_q_lens[seq] + b *
    block_q + t`` for ``t < count`` (``token = -1`` past ``count``, and for every row
    of an unused item), at positions ``kv_len - q_len + b * block_q + t`` of the
    sequence; it sees keys ``[lo, hi)`` (empty for an unused item), and every one of
    its tokens sees ``[full_lo, full_hi)`` (empty when they share no key).
    """
    S = kv_lens.shape[0]
    n = jnp.clip(num_seqs[0], 0, S)
    live = jnp.arange(S) < n
    q_len = jnp.where(live, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
    per_seq = (q_len + block_q - 1) // block_q
    ends = jnp.cumsum(per_seq)
    m = jnp.arange(items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, m, side="right"), S - 1).astype(jnp.int32)
    block = m - (ends[seq] - per_seq[seq])
    count = jnp.where(m < ends[-1], jnp.minimum(block_q, q_len[seq] - block * block_q), 0)
    first = kv_lens[seq] - q_len[seq] + block * block_q  # the block's first position
    hi = jnp.where(count > 0, jnp.clip(first + count, 0, capacity), 0)
    if window is None:
        lo = jnp.zeros_like(hi)
    else:  # the first token's window start (its position clipped to the cache, as below)
        lo = jnp.clip(jnp.minimum(first, capacity - 1) + 1 - window, 0, hi)
    # Keys every row of the item sees: up to its first token, from its last one's window.
    full_hi = jnp.where(count > 0, jnp.clip(first + 1, 0, hi), 0)
    full_lo = lo if window is None else jnp.clip(hi - window, lo, hi)
    t = jnp.arange(block_q, dtype=jnp.int32)
    inside = t[None, :] < count[:, None]
    token = jnp.where(inside, (cu_q_lens[seq] + block * block_q)[:, None] + t, -1)
    # A position past the cache (kv_len beyond it: invalid metadata) sees the cache's end.
    pos = jnp.where(inside, jnp.minimum(first[:, None] + t, capacity - 1), -1)
    return seq, lo, hi, full_lo, full_hi, token, pos


def _query_tiles(cfg: PrefillConfig, q, token):
    """``[items, K, rows, H]``: each item's tokens x the group's heads, token-major; rows
    of no token are 0."""
    T, N, H = q.shape
    K, G, M, bq = cfg.kv_heads, cfg.group, cfg.items, cfg.block_q
    x = jnp.where((token >= 0)[..., None, None], q[jnp.clip(token, 0, T - 1)], 0)
    x = x.reshape(M, bq, K, G, H).transpose(0, 2, 1, 3, 4).reshape(M, K, bq * G, H)
    return jnp.pad(x, ((0, 0), (0, 0), (0, cfg.rows - bq * G), (0, 0)))


def _row_positions(cfg: PrefillConfig, pos):
    """int32 ``[items, rows, 1]``: each row's query position (-1: a row of no token)."""
    x = jnp.repeat(pos, cfg.group, axis=1)
    return jnp.pad(x, ((0, 0), (0, cfg.rows - x.shape[1])), constant_values=-1)[..., None]


def _sink_rows(cfg: PrefillConfig, sinks):
    """float32 ``[K, rows, 1]``: each row's sink logit (-inf for padding rows), or None."""
    if sinks is None:
        return None
    x = jnp.tile(sinks.astype(jnp.float32).reshape(cfg.kv_heads, 1, cfg.group),
                 (1, cfg.block_q, 1)).reshape(cfg.kv_heads, -1)
    x = jnp.pad(x, ((0, 0), (0, cfg.rows - x.shape[1])), constant_values=-jnp.inf)
    return x[..., None]


def _scatter_out(cfg: PrefillConfig, out, token, T: int):
    """The item tiles ``[items, K, rows, H]`` back to ``[T, N, H]`` (tokens of no item 0)."""
    K, G, M, bq = cfg.kv_heads, cfg.group, cfg.items, cfg.block_q
    H = out.shape[-1]
    x = out[:, :, :bq * G].reshape(M, K, bq, G, H).transpose(0, 2, 1, 3, 4)
    x = x.reshape(M * bq, K * G, H)
    at = jnp.where(token >= 0, token, T).reshape(-1)
    return jnp.zeros((T, K * G, H), out.dtype).at[at].set(x, mode="drop")


# --------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------

def _init_carry(cfg: PrefillConfig, sink):
    """The online softmax's start: nothing seen, or the sink as a first key of value 0
    (running max its logit in log2 units, sum 1). The running max and sum are ``[rows]``
    vectors on the loop walk (registers: each thread holds its rows' once) and
    ``[rows, 1]`` columns on the grid walk (TPU scratch)."""
    rows = (cfg.rows,) if cfg.walk == LOOP else (cfg.rows, 1)
    if sink is None:
        m, l = jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32)
    else:
        m = sink.reshape(rows) * LOG2E
        l = jnp.where(m > -jnp.inf, 1.0, 0.0).astype(jnp.float32)
    return m, l, jnp.zeros((cfg.rows, cfg.head_dim), jnp.float32)


def _dequantize(cfg: PrefillConfig, k, v, dtype, scales=None):
    """Keys and values in ``dtype``: times the static scales, or the per-token ``scales``
    (two ``[block_keys]`` vectors), when given."""
    out = []
    for n, (x, c) in enumerate(((k, cfg.k_scale), (v, cfg.v_scale))):
        if scales is not None:
            x = x.astype(jnp.float32) * scales[n].astype(jnp.float32)[:, None]
        elif c is not None:
            x = x.astype(jnp.float32) * c
        out.append(x.astype(dtype))
    return out


def _update(cfg: PrefillConfig, carry, q, q_pos, k, v, first, hi, masked: bool = True):
    """The carry after one key tile ``k, v`` ``[block_keys, H]`` of keys ``first ..``, each
    row causal against its position ``q_pos`` ``[rows, 1]`` and within the window (so
    inside the item's ``[lo, hi)``); values at or past ``hi`` zeroed (an unwritten slot
    may hold NaN).
    ``masked=False``: a tile every row sees whole (no mask evaluated)."""
    bk = cfg.block_keys
    score = ScoreMath(scale=cfg.scale, softcap=cfg.soft_cap)
    if not masked:
        tile = Tile(q=q, k=k, i=0, j=0, head=0)
        return forward_update(score, None, carry, tile, v, None, cfg.rows, bk, masked=False)
    # Row conditions imply the item's: q_pos < hi (positions clipped to the cache) and
    # q_pos - window >= lo - 1. Keys at or past hi may be unwritten: their values zeroed.
    k_col = first + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    v = jnp.where(k_col < hi, v, jnp.zeros_like(v))
    k_pos = first + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    seen = k_pos <= q_pos
    if cfg.window is not None:
        seen = seen & (k_pos > q_pos - cfg.window)
    tile = Tile(q=q, k=k, i=0, j=0, head=0, mask=seen)
    return forward_update(score, None, carry, tile, v, None, cfg.rows, bk, masked=False)


def _gathered_tile(cfg: PrefillConfig, page_refs, tables_ref, seq, j, h):
    """Key tile ``j`` of sequence ``seq`` for key/value head ``h``: its rows gathered from
    the cache seen as ``[pages * page_size, 2K, H]`` (or the key and value pages as ``[K,
    pages * page_size, H]``, their scales ``[K, pages * page_size]``), each page looked up
    in the table. Returns keys, values and the per-token scales (None without)."""
    ps, bk = cfg.page_size, cfg.block_keys
    r = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    column = jnp.minimum(j * cfg.pages_per_block + div(r, ps), cfg.pages_per_row - 1)
    page = jnp.clip(tables_ref[seq, column], 0, cfg.total_pages - 1)
    at = page * ps + rem(r, ps)
    if cfg.layout == kernels.COMBINED:
        (kv_ref,) = page_refs
        return kv_ref[at, 2 * h, :], kv_ref[at, 2 * h + 1, :], None
    k, v = page_refs[0][h, at, :], page_refs[1][h, at, :]
    scales = (page_refs[2][h, at], page_refs[3][h, at]) if cfg.per_token_scales else None
    return k, v, scales


def loop_kernel(seq_ref, lo_ref, hi_ref, full_lo_ref, full_hi_ref, tables_ref, q_ref, pos_ref,
                sink_ref, *refs, cfg: PrefillConfig):
    """The ``"loop"`` walk: one program per (item, key/value head, split) over its share
    of the key tiles that meet ``[lo, hi)``: the tiles every row sees whole without a
    mask, the edge tiles (window start, causal diagonal, end of the cache) before and
    after them with one. Split programs write their normalized partial output and
    logsumexp for the merge."""
    i, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, lo, hi = seq_ref[i], lo_ref[i], hi_ref[i]
    q, q_pos = q_ref[...], pos_ref[...]
    sink = None if sink_ref is None else sink_ref[...]
    n = 1 if cfg.layout == kernels.COMBINED else 4 if cfg.per_token_scales else 2
    page_refs, (o_ref, *lse_ref) = refs[:n], refs[n:]
    bk = cfg.block_keys

    def steps(masked):
        def step(j, carry):
            k, v, scales = _gathered_tile(cfg, page_refs, tables_ref, seq, j, h)
            k, v = _dequantize(cfg, k, v, q.dtype, scales)
            return _update(cfg, carry, q, q_pos, k, v, j * bk, hi, masked)
        return step

    first = div(lo, bk)
    last = jnp.maximum(first, div(hi + (bk - 1), bk))
    if cfg.merged:  # this split's share of [first, last)
        per = div(last - first + (cfg.k_splits - 1), cfg.k_splits)
        first = jnp.minimum(first + s * per, last)
        last = jnp.minimum(first + per, last)
    full_first = jnp.clip(div(full_lo_ref[i] + (bk - 1), bk), first, last)
    full_last = jnp.clip(div(full_hi_ref[i], bk), full_first, last)
    carry = _init_carry(cfg, sink)
    if cfg.window is not None:  # else full_lo = lo: no tile before the whole ones
        carry = lax.fori_loop(first, full_first, steps(True), carry)
    carry = lax.fori_loop(full_first, full_last, steps(False), carry)
    carry = lax.fori_loop(full_last, last, steps(True), carry)
    out, lse = forward_finish(*carry)
    o_ref[...] = out.astype(o_ref.dtype)
    if lse_ref:
        lse_ref[0][...] = lse.reshape(lse_ref[0].shape)


def grid_kernel(tables, seq_ref, lo_ref, hi_ref, q_ref, pos_ref, sink_ref, *refs,
                cfg: PrefillConfig):
    """The ``"grid"`` walk: grid ``(item, heads, 1, key tile)``, the pages of a step
    placed by the decode kernel's index maps, carries in scratch."""
    del tables, seq_ref  # read by the index maps
    view = cfg.pages_view()
    n = cfg.pages_per_block
    page_refs, (o_ref, m_ref, l_ref, acc_ref) = refs[:n], refs[n:]
    i, j = pl.program_id(0), pl.program_id(3)
    lo, hi = lo_ref[i], hi_ref[i]
    first = j * cfg.block_keys
    heads = range(cfg.heads_per_program)

    @pl.when(j == 0)
    def _init():
        for h in heads:
            sink = None if sink_ref is None else sink_ref[h]
            for ref, x in zip((m_ref, l_ref, acc_ref), _init_carry(cfg, sink)):
                ref[h] = x

    @pl.when((first < hi) & (first + cfg.block_keys > lo))
    def _step():
        q_pos = pos_ref[...]
        for h in heads:
            q = q_ref[h]
            pages = [kernels._read_page(view, page_refs, p, q.dtype, h) for p in range(n)]
            k = jnp.concatenate([kv[0] for kv in pages], axis=0)
            v = jnp.concatenate([kv[1] for kv in pages], axis=0)
            carry = _update(cfg, (m_ref[h], l_ref[h], acc_ref[h]), q, q_pos, k, v, first, hi)
            for ref, x in zip((m_ref, l_ref, acc_ref), carry):
                ref[h] = x

    @pl.when(j == cfg.blocks - 1)
    def _finish():
        for h in heads:
            o_ref[h] = forward_finish(m_ref[h], l_ref[h], acc_ref[h])[0].astype(o_ref.dtype)


def _merge(cfg: PrefillConfig, o_part, lse_part, sink, dtype):
    """The splits' partials ``[S, items, K, block_q * group, H]`` combined by the decode
    kernels' merge (:func:`ops.serving.kernels.merge_kernel`, which adds the sinks), in
    tiles of the query tile's rows (overhanging the partials' rows on Triton)."""
    S, M, K, _, H = o_part.shape
    R = cfg.rows
    # JAX's Triton lowering wants power-of-two blocks: the splits' block overhangs.
    Sb = pl.next_power_of_2(S) if pl.backend_traits(cfg.backend).power_of_two_blocks else S
    in_specs = [pl.BlockSpec((Sb, None, None, R, H), lambda i, h: (0, i, h, 0, 0)),
                pl.BlockSpec((Sb, None, None, R, 1), lambda i, h: (0, i, h, 0, 0)),
                None if sink is None else pl.BlockSpec((None, R, 1), lambda i, h: (h, 0, 0))]
    return pl.pallas_call(
        functools.partial(kernels.merge_kernel, splits=S),
        out_shape=jax.ShapeDtypeStruct((M, K, R, H), dtype), grid=(M, K), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, R, H), lambda i, h: (i, h, 0, 0)),
        compiler_params=_params(cfg, ("parallel", "parallel")), backend=cfg.backend,
        name="query_blocked_paged_merge",
    )(o_part, lse_part, sink)


def _params(cfg: PrefillConfig, semantics):
    if pl.backend_traits(cfg.backend).triton:
        return pl.triton.CompilerParams(num_warps=cfg.num_warps or 4,
                                        num_stages=cfg.num_stages or 2,
                                        dimension_semantics=semantics)
    return pl.CompilerParams(dimension_semantics=semantics)


def prefill(cfg: PrefillConfig, q, pages, tables, cu_q_lens, kv_lens, num_seqs, sinks):
    """Query-blocked ragged paged attention: ``q`` ``[T, N, H]`` -> ``[T, N, H]`` in q's
    dtype (rows of no sequence 0).

    Args:
      pages: ``(kv_pages,)``, ``[P, page_size, 2K, H]`` (keys at even, values at odd
        combined heads); or with :data:`ops.serving.kernels.HEADS_FIRST` ``(k_pages,
        v_pages)`` ``[K, P, page_size, H]``, then their scale pages ``[K, P, page_size]``
        with ``per_token_scales``.
      tables: int32 ``[S, pages_per_row]``; cu_q_lens, kv_lens, num_seqs: as the op's.
      sinks: float ``[N]`` or None.
    """
    T = q.shape[0]
    K, H, R, M = cfg.kv_heads, cfg.head_dim, cfg.rows, cfg.items
    seq, lo, hi, full_lo, full_hi, token, pos = work_items(
        cu_q_lens, kv_lens, num_seqs, items=M, block_q=cfg.block_q,
        capacity=cfg.pages_per_row * cfg.page_size, window=cfg.window)
    q_tiles, q_pos = _query_tiles(cfg, q, token), _row_positions(cfg, pos)
    sink = _sink_rows(cfg, sinks)
    out_shape = jax.ShapeDtypeStruct((M, K, R, H), q.dtype)
    if cfg.walk == LOOP:
        whole = pl.BlockSpec(memory_space=pl.ANY)
        tile = pl.BlockSpec((None, None, R, H), lambda i, h, s: (i, h, 0, 0))
        sink_spec = pl.BlockSpec((None, R, 1), lambda i, h, *_: (h, 0, 0))
        in_specs = [whole] * 6 + [tile, pl.BlockSpec((None, R, 1), lambda i, h, s: (i, 0, 0)),
                                  None if sink is None or cfg.merged else sink_spec]
        if cfg.layout == kernels.COMBINED:  # [P * page_size, 2K, H]
            rows = [pages[0].reshape((-1,) + pages[0].shape[2:])]
        else:  # [K, P * page_size, H] and [K, P * page_size]
            rows = [x.reshape(x.shape[:1] + (-1,) + x.shape[3:]) for x in pages]
        S = cfg.k_splits
        if cfg.merged:  # the partials keep the rows of tokens only (not the padding)
            V = cfg.block_q * cfg.group
            out_shape = [jax.ShapeDtypeStruct((S, M, K, V, H), jnp.float32),
                         jax.ShapeDtypeStruct((S, M, K, V, 1), jnp.float32)]
            out_specs = [pl.BlockSpec((None, None, None, R, H), lambda i, h, s: (s, i, h, 0, 0)),
                         pl.BlockSpec((None, None, None, R, 1), lambda i, h, s: (s, i, h, 0, 0))]
        else:
            out_specs = tile
        out = pl.pallas_call(
            functools.partial(loop_kernel, cfg=cfg), out_shape=out_shape, grid=(M, K, S),
            in_specs=in_specs + [whole] * len(rows), out_specs=out_specs,
            compiler_params=_params(cfg, ("parallel",) * 3), backend=cfg.backend,
            name="query_blocked_paged_attention",
        )(seq, lo, hi, full_lo, full_hi, tables, q_tiles, q_pos, None if cfg.merged else sink,
          *rows)
        if cfg.merged:
            out = _merge(cfg, *out, sink, q.dtype)
    else:
        kb = cfg.heads_per_program
        view = cfg.pages_view()
        tile = pl.BlockSpec((None, kb, R, H), lambda i, h, s, j, *_: (i, h, 0, 0))
        in_specs = [tile, pl.BlockSpec((None, R, 1), lambda i, h, s, j, *_: (i, 0, 0)),
                    None if sink is None else
                    pl.BlockSpec((kb, R, 1), lambda i, h, s, j, *_: (h, 0, 0))]
        scratch = [pl.tpu.VMEM((kb, R, 1), jnp.float32), pl.tpu.VMEM((kb, R, 1), jnp.float32),
                   pl.tpu.VMEM((kb, R, H), jnp.float32)]
        grid_spec = pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(M, K // kb, 1, cfg.blocks),
            in_specs=in_specs + kernels._page_specs(view), out_specs=tile, scratch_shapes=scratch)
        out = pl.pallas_call(
            functools.partial(grid_kernel, cfg=cfg), out_shape=out_shape, grid_spec=grid_spec,
            compiler_params=_params(cfg, ("parallel", "parallel", "parallel", "arbitrary")),
            backend=cfg.backend, name="query_blocked_paged_attention",
        )(tables, seq, lo, hi, q_tiles, q_pos, sink, *([pages[0]] * cfg.pages_per_block))
    return _scatter_out(cfg, out, token, T)
