"""The paged decode kernels: split-KV attention over page tables, and the merge.

Both paged ops reduce to *rows* (:mod:`ops.serving.reference`): a row is one
query token with the ``G`` query heads of each key/value head, a key range
``[start, end)`` and a page table. ``ops.paged_attention`` has one row per
sequence; ``ops.ragged_paged_attention`` one per query token, each seeing its
sequence's cache up to its own position.

Attention kernel (flash-decoding: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding
for long-context inference"; FlashAttention-2's online softmax per tile, from
:mod:`ops.attention.tile_math`): the grid is ``(row, key/value head, split,
page block)``. A program owns one (row, key/value head, split) and walks the
split's page blocks along the last (``"arbitrary"``) axis; each step reads
``pages_per_block`` pages, each through its own BlockSpec whose index map looks
the page up in the table (scalar prefetch, ``PrefetchScalarGridSpec``), so the
cache is never gathered. All ``G`` query heads of the group share each page
tile: the query tile is ``[G, H]`` (padded to 64 rows on the Triton backends, see
:func:`group_rows`). Blocks outside ``[start, end)`` are skipped, and their
index maps repeat the row's last visible page (a TPU skips a copy of the same
block). Keys of a visible page outside the range are masked, and their values
zeroed (an unwritten slot may hold anything, NaN included). int8 pages are
dequantized per token in the kernel (JAX's per-token scales ``[K, P, page_size]``,
or one static scale per cache). On ``pallas_triton`` (no scalar prefetch, no
scratch, no sequential grid axes) the same per-block update runs in the ``"loop"``
walk: one program per (row, key/value head, split) loops over its blocks and reads
the table, the ranges and the pages from whole-array Refs (:func:`loop_kernel`).

Cost of the per-page update: every page is one online-softmax step, so the
accumulator is rescaled once per page. At sm_90, bf16, h128, GQA 8:1 the loop
takes 15.3 SASS instructions per key with 16-token pages (8 per step) and 8.6 with
one 128-token page per step; an update over several pages at once (one max and
one rescale per step) would bring small pages to the latter.

Merge kernel: each split writes its normalized partial output and logsumexp
(float32); one program per (row, key/value head) combines them with weights
``exp(lse_s - lse)`` (FlashAttention's split-KV combine), the sink logits
joining the denominator as one more term. With one split and no sinks the
attention kernel writes the output directly and there is no merge.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops.attention.tile_math import ScoreMath, Tile, div, forward_finish, forward_update
from ops.reduction._rows import logsumexp_shift

HEADS_FIRST = "heads_first"  # separate k/v pages [K, P, page_size, H] (JAX's GPU paged attention)
COMBINED = "combined"  # one cache [P, page_size, 2K, H], k and v interleaved (JAX's TPU ragged)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Everything static about one paged decode call.

    Attributes:
      layout: :data:`HEADS_FIRST` or :data:`COMBINED`.
      rows, kv_heads, group, head_dim: the query ``[rows, kv_heads * group, head_dim]``.
      group_rows: the query tile's rows (``group`` padded for ``tl.dot``).
      page_size, total_pages, pages_per_row: the cache and the table's width.
      pages_per_block: pages read per grid step; k_splits: splits of each table.
      per_token_scales: int8 pages with per-token scale pages (HEADS_FIRST).
      k_scale, v_scale: one static dequantization scale per cache (COMBINED), or None.
      indirect: rows read table ``table_rows[row]`` (else table ``row``).
      sinks: whether sink logits join the merge.
      heads_per_program: key/value heads one program owns (COMBINED only; the
        TPU reads all ``2K`` combined heads of a page, its tiling's minimum).
      walk: ``"grid"`` (the page blocks are the last grid axis, pages placed by the
        index maps through scalar prefetch, carries in scratch) or ``"loop"`` (for
        JAX's Pallas Triton lowering, which has neither scalar prefetch nor scratch
        nor sequential grid axes: each program loops over its blocks and reads the
        table and the pages from whole-array Refs, carries in registers).
    """

    backend: str
    layout: str
    rows: int
    kv_heads: int
    group: int
    group_rows: int
    head_dim: int
    page_size: int
    total_pages: int
    pages_per_row: int
    pages_per_block: int
    k_splits: int
    scale: float
    soft_cap: float | None
    dtype: str
    per_token_scales: bool = False
    k_scale: float | None = None
    v_scale: float | None = None
    indirect: bool = False
    sinks: bool = False
    heads_per_program: int = 1
    walk: str = "grid"
    num_warps: int | None = None
    num_stages: int | None = None

    @property
    def heads_block(self):
        """The key/value heads dim of a program's blocks: squeezed (None) for one head."""
        return None if self.heads_per_program == 1 else self.heads_per_program

    @property
    def blocks_per_split(self) -> int:
        return pl.cdiv(pl.cdiv(self.pages_per_row, self.pages_per_block), self.k_splits)

    @property
    def block_keys(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def merged(self) -> bool:
        """Whether the attention kernel writes partials for the merge kernel."""
        return self.k_splits > 1 or self.sinks

    @classmethod
    def build(cls, op, impl: str, explicit, *, rows: int, kv_heads: int, group: int,
              head_dim: int, page_size: int, total_pages: int, pages_per_row: int, dtype,
              **fields) -> "DecodeConfig":
        """The config of one call of ``op`` (an :class:`ops._op.Op` whose dims are
        :data:`ops.serving.block_sizes.DIMS`) on ``impl``: block sizes ``explicit``, else
        the tuning cache's, else the heuristic's; the query tile for the backend.

        Raises:
          NotImplementedError: pages of fewer than 16 tokens on the Triton backends.
        """
        check_page_size(impl, page_size, op.name)
        problem = op.problem((rows, kv_heads, group, head_dim, page_size, pages_per_row), dtype)
        bs = op.select(problem, impl, explicit)
        fields["walk"] = walk(impl)
        if pl.backend_traits(impl).power_of_two_blocks:
            for name, n in (("head_dim", head_dim), ("page_size", page_size)):
                if n & (n - 1):
                    raise NotImplementedError(f"{op.name}: implementation={impl!r} needs a "
                                              f"power-of-two {name}; got {n}.")
        return cls(backend=impl, rows=rows, kv_heads=kv_heads, group=group,
                   group_rows=group_rows(impl, group), head_dim=head_dim, page_size=page_size,
                   total_pages=total_pages, pages_per_row=pages_per_row,
                   pages_per_block=min(bs.pages_per_block, pages_per_row), k_splits=bs.k_splits,
                   dtype=np.dtype(dtype).name, num_warps=bs.num_warps,
                   num_stages=bs.num_stages, **fields)

    @property
    def score(self) -> ScoreMath:
        """The score math the shared tile math reads (scale, soft cap, no dropout; the
        positional mask is applied by the caller as a mask tile, sinks by the merge)."""
        return ScoreMath(scale=self.scale, softcap=self.soft_cap)


def walk(backend: str) -> str:
    """How the kernels walk a row's page blocks on ``backend`` (:attr:`DecodeConfig.walk`):
    ``"grid"`` where a grid axis runs in order (``sequential_grid`` of its traits),
    ``"loop"`` elsewhere (JAX's Triton lowering)."""
    return "grid" if pl.backend_traits(backend).sequential_grid else "loop"


def group_rows(backend: str, group: int) -> int:
    """The query tile's rows for a GQA group of ``group`` heads: on the Triton backends a
    power of two >= 64, so both products run on Hopper's ``wgmma`` (64 rows per warpgroup;
    a 16-row tile, ``tl.dot``'s minimum, lowers to ``mma.sync``); elsewhere the group
    itself. The padding rows cost tensor-core work only: decode stays memory-bound."""
    if pl.backend_traits(backend).triton:
        return max(64, pl.next_power_of_2(group))
    return group


def check_page_size(backend: str, page_size: int, op: str) -> None:
    """Raises NotImplementedError for pages of fewer than 16 tokens on the Triton backends:
    a page is one key tile there, and ``tl.dot`` needs 16 rows."""
    if pl.backend_traits(backend).triton and page_size < 16:
        raise NotImplementedError(f"{op}: implementation={backend!r} needs page_size >= 16 "
                                  f"(a page is one tl.dot tile); got {page_size}.")


# --------------------------------------------------------------------------
# BlockSpecs: pages looked up in the table by the index maps
# --------------------------------------------------------------------------

def _page_of(cfg: DecodeConfig, p: int):
    """Index-map helper: the page id of page ``p`` of the step's block, clamped to the
    row's visible pages and to the cache."""
    def page(b, s, j, tables, table_rows, start, end):
        idx = (s * cfg.blocks_per_split + j) * cfg.pages_per_block + p
        first = div(start[b], cfg.page_size)
        last = div(jnp.maximum(end[b] - 1, 0), cfg.page_size)
        idx = jnp.minimum(jnp.maximum(idx, first), last)
        row = table_rows[b] if cfg.indirect else b
        return jnp.minimum(jnp.maximum(tables[row, idx], 0), cfg.total_pages - 1)
    return page


def _page_specs(cfg: DecodeConfig):
    """In-specs of the pages (and per-token scales), ``pages_per_block`` of each."""
    ps, h = cfg.page_size, cfg.head_dim
    specs = []
    if cfg.layout == HEADS_FIRST:
        # Scales come as [K, P, 1, page_size]: a (1, page_size) block is whole in its
        # last two dims (the TPU's tiling rule), where (page_size,) of [K, P, page_size] is not.
        kinds = [(ps, h)] * 2 + ([(1, ps)] * 2 if cfg.per_token_scales else [])
        for tail in kinds:
            for p in range(cfg.pages_per_block):
                page = _page_of(cfg, p)

                def index_map(b, n, s, j, *scalars, page=page, tail=tail):
                    return (n, page(b, s, j, *scalars)) + (0,) * len(tail)
                specs.append(pl.BlockSpec((None, None) + tail, index_map))
    else:
        for p in range(cfg.pages_per_block):
            page = _page_of(cfg, p)

            def index_map(b, n, s, j, *scalars, page=page):
                return (page(b, s, j, *scalars), 0, n, 0)
            specs.append(pl.BlockSpec((None, ps, 2 * cfg.heads_per_program, h), index_map))
    return specs


def _params(cfg: DecodeConfig, semantics):
    if pl.backend_traits(cfg.backend).triton:
        warps = cfg.num_warps or 4
        stages = cfg.num_stages or 2
        return pl.triton.CompilerParams(num_warps=warps, num_stages=stages,
                                        dimension_semantics=semantics)
    return pl.CompilerParams(dimension_semantics=semantics)


# --------------------------------------------------------------------------
# The attention kernel
# --------------------------------------------------------------------------

def _read_page(cfg: DecodeConfig, refs, p: int, dtype, head: int = 0):
    """``(k, v)`` of page ``p`` of the step (of the program's key/value head ``head``),
    ``[page_size, H]`` in ``dtype``."""
    n = cfg.pages_per_block
    if cfg.layout == COMBINED:
        kv = refs[p]  # [page_size, 2 * heads, H], or the (key, value) views of the loop walk
        k, v = ((kv[0][...], kv[1][...]) if isinstance(kv, tuple)
                else (kv[:, 2 * head, :], kv[:, 2 * head + 1, :]))
        scales = (cfg.k_scale, cfg.v_scale)
        if cfg.k_scale is None and k.dtype == dtype:
            return k, v
        out = []
        for x, c in zip((k, v), scales):
            x = x.astype(jnp.float32)
            out.append((x if c is None else x * c).astype(dtype))
        return tuple(out)
    k, v = refs[p][...], refs[n + p][...]
    if cfg.per_token_scales:
        ks, vs = (refs[i * n + p][...].astype(jnp.float32).T for i in (2, 3))  # [page_size, 1]
        k = (k.astype(jnp.float32) * ks).astype(dtype)
        v = (v.astype(jnp.float32) * vs).astype(dtype)
    return k.astype(dtype), v.astype(dtype)


def _num_page_refs(cfg: DecodeConfig) -> int:
    per_page = 1 if cfg.layout == COMBINED else (4 if cfg.per_token_scales else 2)
    return per_page * cfg.pages_per_block


def _block_visible(cfg: DecodeConfig, first, lo, hi):
    return (first < hi) & (first + cfg.block_keys > lo)


def _update_block(cfg: DecodeConfig, carry, q, page_refs, first, lo, hi, head: int):
    """The online-softmax carry after the step's pages (``page_refs`` as the grid walk's
    blocks: see :func:`_read_page`), keys outside ``[lo, hi)`` masked, their values zeroed."""
    ps, score = cfg.page_size, cfg.score
    for p in range(cfg.pages_per_block):
        k, v = _read_page(cfg, page_refs, p, q.dtype, head)
        pos = first + p * ps + lax.broadcasted_iota(jnp.int32, (ps, 1), 0)
        seen = (pos >= lo) & (pos < hi)  # [ps, 1]
        v = jnp.where(seen, v, jnp.zeros_like(v))
        tile = Tile(q=q, k=k, i=0, j=0, head=0, mask=seen.T)
        carry = forward_update(score, None, carry, tile, v, None, cfg.group_rows, ps, masked=False)
    return carry


def _init_carry(cfg: DecodeConfig, lead=()):
    rows = lead + (cfg.group_rows,)
    return (jnp.full(rows + (1,), -jnp.inf, jnp.float32), jnp.zeros(rows + (1,), jnp.float32),
            jnp.zeros(rows + (cfg.head_dim,), jnp.float32))


def loop_kernel(tables, table_rows, start_ref, end_ref, q_ref, *refs, cfg: DecodeConfig):
    """The ``"loop"`` walk: one program per (row, key/value head, split) loops over the
    split's page blocks; the table, ranges and pages are whole-array Refs it indexes
    itself, with the index maps' page lookup (:func:`_page_of`)."""
    n_arrays = 1 if cfg.layout == COMBINED else (4 if cfg.per_token_scales else 2)
    arrays, outs = refs[:n_arrays], refs[n_arrays:]
    o_ref, lse_ref = outs if cfg.merged else (outs[0], None)
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = start_ref[b], end_ref[b]
    q = q_ref[...]
    scalars = (tables, table_rows, start_ref, end_ref)

    def block(j, carry):
        first = (s * cfg.blocks_per_split + j) * cfg.block_keys

        def visit(carry):
            pages = [_page_of(cfg, p)(b, s, j, *scalars) for p in range(cfg.pages_per_block)]
            if cfg.layout == COMBINED:
                views = [(arrays[0].at[page, :, 2 * h, :], arrays[0].at[page, :, 2 * h + 1, :])
                         for page in pages]
            else:
                views = [a.at[h, page] for a in arrays for page in pages]
            return _update_block(cfg, carry, q, views, first, lo, hi, 0)
        return lax.cond(_block_visible(cfg, first, lo, hi), visit, lambda c: c, carry)

    out, lse = forward_finish(*lax.fori_loop(0, cfg.blocks_per_split, block, _init_carry(cfg)))
    o_ref[...] = out.astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = lse


def attention_kernel(tables, table_rows, start_ref, end_ref, q_ref, *refs, cfg: DecodeConfig):
    del tables, table_rows  # read by the index maps
    n_pages = _num_page_refs(cfg)
    page_refs, refs = refs[:n_pages], refs[n_pages:]
    if cfg.merged:
        o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    else:
        (o_ref, m_ref, l_ref, acc_ref), lse_ref = refs, None
    b, s, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi = start_ref[b], end_ref[b]
    first = (s * cfg.blocks_per_split + j) * cfg.block_keys

    @pl.when(j == 0)
    def _init():
        lead = () if cfg.heads_block is None else (cfg.heads_block,)
        for ref, x in zip((m_ref, l_ref, acc_ref), _init_carry(cfg, lead)):
            ref[...] = x

    heads = [None] if cfg.heads_block is None else range(cfg.heads_block)
    at = lambda ref, h: ref if h is None else ref.at[h]  # noqa: E731 - one head's view

    @pl.when(_block_visible(cfg, first, lo, hi))
    def _step():
        for h in heads:
            carry = (at(m_ref, h)[...], at(l_ref, h)[...], at(acc_ref, h)[...])
            carry = _update_block(cfg, carry, at(q_ref, h)[...], page_refs, first, lo, hi, h or 0)
            for ref, x in zip((m_ref, l_ref, acc_ref), carry):
                at(ref, h)[...] = x

    @pl.when(j == cfg.blocks_per_split - 1)
    def _finish():
        for h in heads:
            out, lse = forward_finish(at(m_ref, h)[...], at(l_ref, h)[...], at(acc_ref, h)[...])
            at(o_ref, h)[...] = out.astype(o_ref.dtype)
            if lse_ref is not None:
                at(lse_ref, h)[...] = lse


def merge_kernel(o_ref, lse_ref, sink_ref, out_ref, *, splits: int):
    """Combines the splits' partial outputs ``[S, G, H]`` by their logsumexps ``[S, G, 1]``,
    one split at a time (two passes: the max, then the weighted sum), so a program holds
    one ``[G, H]`` tile, whatever the number of splits. ``splits`` may be fewer than the
    blocks' leading dim (a block overhanging the splits)."""
    m = lax.fori_loop(1, splits, lambda s, m: jnp.maximum(m, lse_ref[s]), lse_ref[0])
    sink = None if sink_ref is None else sink_ref[...].astype(jnp.float32)
    if sink is not None:
        m = jnp.maximum(m, sink)
    shift = logsumexp_shift(m)

    def add(s, carry):
        total, acc = carry
        w = jnp.exp(lse_ref[s] - shift)
        return total + w, acc + w * o_ref[s]

    zeros = jnp.zeros(out_ref.shape, jnp.float32)
    total, acc = lax.fori_loop(0, splits, add, (jnp.zeros(m.shape, jnp.float32), zeros))
    if sink is not None:
        total = total + jnp.exp(sink - shift)
    out_ref[...] = (acc / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


# --------------------------------------------------------------------------
# The calls
# --------------------------------------------------------------------------

def decode(cfg: DecodeConfig, q, pages, scales, tables, table_rows, start, end, sinks):
    """Paged decode attention of ``q`` ``[rows, K, group, H]`` -> same shape, q's dtype.

    The query, partial and output blocks are ``group_rows`` tall: past ``group`` they
    overhang the arrays (their rows are independent: what a padding row reads is
    never mixed into a real one, and its writes are dropped).

    Args:
      pages: ``(k_pages, v_pages)`` (HEADS_FIRST) or ``(kv_pages,)`` (COMBINED).
      scales: ``(k_scales_pages, v_scales_pages)`` ``[K, P, page_size]`` with
        ``cfg.per_token_scales``, else ().
      tables: int32 ``[table rows, pages_per_row]``; table_rows: int32 ``[rows]`` or None.
      start, end: int32 ``[rows]``: each row's keys.
      sinks: float32 ``[K, group, 1]`` or None.
    """
    R, K, G, Gp, H = cfg.rows, cfg.kv_heads, cfg.group, cfg.group_rows, cfg.head_dim
    kb = cfg.heads_block
    scales = [x.reshape(x.shape[:2] + (1, x.shape[2])) for x in scales]
    out_shape = ([jax.ShapeDtypeStruct((cfg.k_splits, R, K, G, H), jnp.float32),
                  jax.ShapeDtypeStruct((cfg.k_splits, R, K, G, 1), jnp.float32)] if cfg.merged
                 else [jax.ShapeDtypeStruct((R, K, G, H), q.dtype)])
    if cfg.walk == "loop":
        whole = pl.BlockSpec(memory_space=pl.ANY)
        scalar_specs = [None if x is None else whole for x in (tables, table_rows, start, end)]
        q_spec = pl.BlockSpec((None, None, Gp, H), lambda b, h, s: (b, h, 0, 0))
        out_specs = ([pl.BlockSpec((None, None, None, Gp, H), lambda b, h, s: (s, b, h, 0, 0)),
                      pl.BlockSpec((None, None, None, Gp, 1), lambda b, h, s: (s, b, h, 0, 0))]
                     if cfg.merged else [q_spec])
        outs = pl.pallas_call(
            functools.partial(loop_kernel, cfg=cfg), out_shape=out_shape, grid=(R, K, cfg.k_splits),
            in_specs=scalar_specs + [q_spec] + [whole] * (len(pages) + len(scales)),
            out_specs=out_specs, compiler_params=_params(cfg, ("parallel",) * 3),
            backend=cfg.backend, name="paged_decode_attention",
        )(tables, table_rows, start, end, q, *pages, *scales)
    else:
        grid = (R, K // cfg.heads_per_program, cfg.k_splits, cfg.blocks_per_split)
        n = cfg.pages_per_block
        operands = [x for x in pages for _ in range(n)] + [x for x in scales for _ in range(n)]
        q_spec = pl.BlockSpec((None, kb, Gp, H), lambda b, h, s, j, *_: (b, h, 0, 0))
        out_specs = ([pl.BlockSpec((None, None, kb, Gp, H), lambda b, h, s, j, *_: (s, b, h, 0, 0)),
                      pl.BlockSpec((None, None, kb, Gp, 1), lambda b, h, s, j, *_: (s, b, h, 0, 0))]
                     if cfg.merged else [q_spec])
        lead = () if kb is None else (kb,)
        scratch = [pl.tpu.VMEM(lead + (Gp, 1), jnp.float32),
                   pl.tpu.VMEM(lead + (Gp, 1), jnp.float32), pl.tpu.VMEM(lead + (Gp, H), jnp.float32)]
        grid_spec = pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=grid, in_specs=[q_spec] + _page_specs(cfg),
            out_specs=out_specs, scratch_shapes=scratch)
        outs = pl.pallas_call(
            functools.partial(attention_kernel, cfg=cfg), out_shape=out_shape,
            grid_spec=grid_spec,
            compiler_params=_params(cfg, ("parallel", "parallel", "parallel", "arbitrary")),
            backend=cfg.backend, name="paged_decode_attention",
        )(tables, table_rows, start, end, q, *operands)
    if not cfg.merged:
        return outs[0]
    o_part, lse_part = outs
    # JAX's Triton lowering wants power-of-two blocks: the splits' block overhangs (the
    # merge reads only the first k_splits).
    S = pl.next_power_of_2(cfg.k_splits) if cfg.walk == "loop" else cfg.k_splits
    in_specs = [pl.BlockSpec((S, None, None, Gp, H), lambda b, h: (0, b, h, 0, 0)),
                pl.BlockSpec((S, None, None, Gp, 1), lambda b, h: (0, b, h, 0, 0)),
                None if sinks is None else pl.BlockSpec((None, Gp, 1), lambda b, h: (h, 0, 0))]
    return pl.pallas_call(
        functools.partial(merge_kernel, splits=cfg.k_splits),
        out_shape=jax.ShapeDtypeStruct((R, K, G, H), q.dtype), grid=(R, K),
        in_specs=in_specs, out_specs=pl.BlockSpec((None, None, Gp, H), lambda b, h: (b, h, 0, 0)),
        compiler_params=_params(cfg, ("parallel", "parallel")), backend=cfg.backend,
        name="paged_decode_merge",
    )(o_part, lse_part, sinks)
