"""``ops.ragged_paged_attention``: mixed prefill / decode attention over a paged cache, the
layout and meaning of JAX's TPU ``ragged_paged_attention``, on every backend."""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl
from ops._checks import check_float_dtype
from ops._op import Op, register
from ops.serving import checks, kernels, prefill_kernels, sharding
from ops.serving.block_sizes import DIMS, PagedBlockSizes, check_block_sizes, ragged_block_q
from ops.serving.paged_attention import sink_tile
from ops.serving.reference import gather_pages, rows_attention

_OP = "ragged_paged_attention"
_LAYOUT_PAGES = "[total_pages, page_size, 2 * K, H]"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, scale=1.0,
                           sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
                           sinks=None, implementation=None, block_sizes=None):
    """Attention for a batch of sequences of any query length over one paged KV cache.

    The layout and meaning of JAX's TPU ``ragged_paged_attention`` (its
    ``sm_scale`` is ``scale`` here): the queries of ``num_seqs`` sequences are
    concatenated; sequence ``i`` owns query tokens ``cu_q_lens[i] ..
    cu_q_lens[i + 1]`` and ``kv_lens[i]`` cached tokens, the new ones included,
    and its queries are the *last* ``q_len`` of them, each causal: query ``t`` of
    the sequence (position ``kv_len - q_len + t``) sees keys up to its own
    position. Chunked prefill (``q_len > 1``), decode (``q_len == 1``) and
    speculative verification mix in one call.

    Two kernels, chosen per call from static facts (``block_sizes.block_q``,
    else :func:`ops.serving.block_sizes.ragged_block_q`, then
    :func:`ops.serving.block_sizes.multi_page_decode`):

    * the query-blocked kernel (:mod:`ops.serving.prefill_kernels`): a program per
      (sequence, block of ``block_q`` of its tokens) and key/value head, the
      block's tokens times the GQA group as one query tile, which reads the
      pages its causal range touches once, in key tiles of ``pages_per_block``
      pages (one online-softmax update per tile, also for 16-token pages);
      ``k_splits`` programs share an item's key tiles (from ``block_sizes``, else
      as many as fill a GPU). It runs every call with ``block_q > 1`` (the
      default when ``T > S``: about ``128 / G`` tokens), and with ``block_q == 1``
      (the default when ``T <= S``, decode and verification batches, or when
      ``block_sizes`` asks for ``k_splits > 1`` without a ``block_q``) on the loop
      walk (interpreter, Triton) over pages of fewer than 64 tokens;
    * else, with ``block_q == 1`` (on Mosaic TPU, for big pages, or asked for
      with an explicit ``block_q=1``), the split-KV paged decode kernel
      (:mod:`ops.serving.kernels`): every query token is a row whose key tiles
      are single pages, so a decode token reads its cache once, split over
      programs when the batch is small, but a prefill chunk of ``q_len`` tokens
      reads its cache ``q_len`` times.

    Shapes: ``T`` query tokens (a padded budget), ``N`` query heads, ``K``
    key/value heads, ``H`` head dim, ``S`` sequence slots.

    Args:
      q: ``[T, N, H]`` float32, bfloat16 or float16.
      kv_pages: ``[total_pages, page_size, 2 * K, H]``: keys at even, values at odd
        combined heads (key/value head ``h`` is ``2h`` / ``2h + 1``); q's dtype or int8.
      kv_lens: int32 ``[S]``; page_indices: int32 ``[S, pages_per_seq]``; cu_q_lens:
        int32 ``[S + 1]``; num_seqs: int32 ``[1]``: only the first ``num_seqs``
        entries are used.
      scale: logit scale (default 1.0).
      sliding_window: optional int > 0: a query at position ``p`` sees keys
        ``p - sliding_window < j <= p`` (JAX's convention).
      soft_cap: optional cap > 0: logits ``cap * tanh(logits / cap)`` after scaling.
      k_scale, v_scale: optional Python floats: keys / values are ``kv_pages * scale``.
      sinks: optional float ``[N]`` sink logits joining each softmax's denominator.
      implementation: as :func:`ops.paged_attention`.
      block_sizes: as :func:`ops.paged_attention`, and ``block_q`` (query tokens per
        program, see above) in a :class:`ops.serving.PagedBlockSizes` or its dict.

    There is no gradient (a serving op).

    Returns:
      ``[T, N, H]`` in q's dtype; rows past ``cu_q_lens[num_seqs]`` are 0 (JAX's
      reference returns only the valid rows). Invalid metadata (a query longer
      than its cache, unsorted ``cu_q_lens``) is not detected: the affected rows
      see fewer keys.

    Raises:
      TypeError: non-arrays, q not float, pages neither q's dtype nor int8, metadata
        not int32.
      ValueError: ranks and shapes (``2 * K`` combined heads, ``N % K``, head dims,
        metadata lengths), a sliding window <= 0, a soft cap <= 0, non-float scales,
        bad sinks or block sizes, an unknown implementation.
    """
    args = _check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale,
                  sliding_window, soft_cap, k_scale, v_scale, sinks)
    bs = check_block_sizes(block_sizes, _OP)
    return OP.run(implementation, args=args, block_sizes=bs)


def _entry(impl, args, block_sizes):
    """The checked call on one implementation, partitioned (:mod:`ops.serving.sharding`)."""
    return sharding.ragged_paged_attention(lambda a, i: _run(a, i, block_sizes), args, impl)


def _problem_of(args, **_):
    """The call's problem (:data:`ops.serving.block_sizes.DIMS`; :attr:`ops._op.Op.problem_of`)."""
    (T, N, H), (_, ps, K2, _) = args["q"].shape, args["kv"].shape
    K = K2 // 2
    return (T, K, N // max(K, 1), H, ps, args["tables"].shape[1]), args["q"].dtype, None


def _check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale, window, soft_cap,
           k_scale, v_scale, sinks):
    checks.check_rank(q, "q", 3, "[T, N, H]", _OP)
    check_float_dtype(q, "q", _OP)
    checks.check_rank(kv_pages, "kv_pages", 4, _LAYOUT_PAGES, _OP)
    checks.check_pages_dtype(kv_pages, "kv_pages", q, _OP)
    T, N, H = q.shape
    P, ps, K2, Hk = kv_pages.shape
    if K2 % 2:
        raise ValueError(f"{_OP}: kv_pages must hold 2 * K combined heads {_LAYOUT_PAGES} "
                         f"(keys and values interleaved); got {K2}.")
    checks.check_heads(N, K2 // 2, _OP)
    if Hk != H:
        raise ValueError(f"{_OP}: the head dim of q ({H}) and of kv_pages ({Hk}) must be equal.")
    checks.check_int32(page_indices, "page_indices", (None, None), "[S, pages_per_seq]", _OP)
    S = page_indices.shape[0]
    checks.check_int32(kv_lens, "kv_lens", (S,), "[S] (S = page_indices.shape[0])", _OP)
    checks.check_int32(cu_q_lens, "cu_q_lens", (S + 1,), "[S + 1]", _OP)
    checks.check_int32(num_seqs, "num_seqs", (1,), "[1]", _OP)
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral)
                               or window <= 0):
        raise ValueError(f"{_OP}: sliding_window must be None or an int > 0, got {window!r}.")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Real)
                              or not np.isfinite(s)):
            raise ValueError(f"{_OP}: {name} must be None or a finite Python number, got {s!r}.")
    return dict(q=q, kv=kv_pages, kv_lens=kv_lens, tables=page_indices, cu=cu_q_lens,
                num_seqs=num_seqs, scale=checks.check_scale(scale, _OP),
                window=None if window is None else int(window),
                soft_cap=checks.check_positive_float(soft_cap, "soft_cap", _OP),
                k_scale=None if k_scale is None else float(k_scale),
                v_scale=None if v_scale is None else float(v_scale),
                sinks=checks.check_sinks(sinks, N, _OP))


def token_rows(args):
    """``(seq, start, end)`` int32 ``[T]``: each query token's sequence and keys ``[start, end)``
    (``end = 0`` for tokens past ``cu_q_lens[num_seqs]``)."""
    capacity = args["tables"].shape[1] * args["kv"].shape[1]
    return _token_rows(args["q"].shape[0], capacity, args["window"], args["cu"], args["kv_lens"],
                       args["num_seqs"])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _token_rows(T: int, capacity: int, window, cu, kv_lens, num_seqs):
    S = kv_lens.shape[0]
    n = jnp.clip(num_seqs[0], 0, S)
    t = jnp.arange(T, dtype=jnp.int32)
    ends = jnp.where(jnp.arange(S) < n, cu[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.minimum(jnp.searchsorted(ends, t, side="right").astype(jnp.int32), S - 1)
    q_start = cu[seq]
    q_len = cu[seq + 1] - q_start
    valid = (t < cu[n]) & (t >= q_start)
    end = jnp.where(valid, jnp.clip(kv_lens[seq] - q_len + (t - q_start) + 1, 0, capacity), 0)
    start = jnp.zeros_like(end) if window is None else jnp.maximum(end - window, 0)
    return seq, start, end


def _dequantized(x, c, dtype):
    return (x.astype(jnp.float32) * c).astype(dtype) if c is not None else x.astype(dtype)


def _run(args, impl: str, bs):
    q, kv = args["q"], args["kv"]
    T, N, H = q.shape
    P, ps, K2, _ = kv.shape
    K = K2 // 2
    S, pps = args["tables"].shape
    if 0 in (T, N, H, P, ps, S, pps):
        return jnp.zeros(q.shape, q.dtype)
    seq, start, end = token_rows(args)
    if impl == "xla":
        tables = args["tables"][seq]
        k = gather_pages(_dequantized(kv[:, :, 0::2], args["k_scale"], q.dtype), tables,
                         heads_axis=2)
        v = gather_pages(_dequantized(kv[:, :, 1::2], args["v_scale"], q.dtype), tables,
                         heads_axis=2)
        out = rows_attention(q, k, v, start, end, scale=args["scale"], soft_cap=args["soft_cap"],
                             sinks=args["sinks"])
        return out.astype(q.dtype)
    G = N // K
    block_q = ragged_block_q(bs, T, S, G)
    fields = dict(kv_heads=K, group=G, head_dim=H, page_size=ps, total_pages=P,
                  pages_per_row=pps, dtype=q.dtype, scale=args["scale"],
                  soft_cap=args["soft_cap"], window=args["window"], k_scale=args["k_scale"],
                  v_scale=args["v_scale"], sinks=args["sinks"] is not None)
    if block_q > 1:
        problem = OP.problem((T, K, G, H, ps, pps), q.dtype)
        pcfg = prefill_kernels.PrefillConfig.build(
            _OP, impl, OP.select(problem, impl, bs), tokens=T, slots=S, block_q=block_q,
            explicit_splits=bs is not None, **fields)
    else:  # decode: the multi-page key tiles where they serve
        pcfg = prefill_kernels.decode_config(OP, impl, bs, rows=T, **fields)
    if pcfg is not None:
        return prefill_kernels.prefill(pcfg, q, (kv,), args["tables"], args["cu"], args["kv_lens"],
                                       args["num_seqs"], args["sinks"])
    cfg = kernels.DecodeConfig.build(
        OP, impl, bs, rows=T, kv_heads=K, group=G, head_dim=H, page_size=ps, total_pages=P,
        pages_per_row=pps, dtype=q.dtype, layout=kernels.COMBINED, scale=args["scale"],
        soft_cap=args["soft_cap"], k_scale=args["k_scale"], v_scale=args["v_scale"],
        indirect=True, sinks=args["sinks"] is not None,
        heads_per_program=1 if pl.backend_traits(impl).triton else K)
    qg = q.reshape(T, K, G, H)
    out = kernels.decode(cfg, qg, (kv,), (), args["tables"], seq, start, end,
                         sink_tile(args["sinks"], K))
    return out.reshape(T, N, H)


def _reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs):
    """The XLA reference (the ``"xla"`` implementation)."""
    return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  implementation="xla", **kwargs)


OP = register(Op(
    name=_OP, dims=DIMS, configs={b: PagedBlockSizes for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
    reference=_reference, entry=_entry, problem_of=_problem_of,
    function=ragged_paged_attention,
    missing_reason=" (mosaic_gpu: no kernel for it yet; use 'triton')"))
