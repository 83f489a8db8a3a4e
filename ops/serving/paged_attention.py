"""``ops.paged_attention``: decode attention over a paged KV cache, a drop-in for JAX's
``jax.experimental.pallas.ops.gpu.paged_attention`` on every backend."""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ops._checks import check_float_dtype, check_same_dtype
from ops._op import Op, Tuning, register
from ops.serving import checks, kernels, prefill_kernels, sharding
from ops.serving.block_sizes import DIMS, PagedBlockSizes, check_block_sizes
from ops.serving.reference import gather_pages, rows_attention

_OP = "paged_attention"
_LAYOUT_Q = "[B, N, H]"
_LAYOUT_PAGES = "[K, total_pages, page_size, H]"


def paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales_pages=None,
                    v_scales_pages=None, *, scale=1.0, logits_soft_cap=None,
                    local_window_size=None, sinks=None, implementation=None, block_sizes=None):
    """One query token per sequence attending to its paged key/value cache.

    The layout and meaning of JAX's GPU ``paged_attention`` (same positional
    arguments), with split-KV decode (flash-decoding: each sequence's pages split
    across programs, merged by a second kernel), pages looked up through scalar
    prefetch, and all query heads of a GQA group sharing each page tile
    (:mod:`ops.serving.kernels`). As in JAX's, the logits are not scaled unless
    ``scale`` is given. On the loop walk (interpret, both Triton lowerings), where the
    tiles fit (:func:`ops.serving.block_sizes.multi_page_decode`), each sequence is a
    work item of ``ragged_paged_attention``'s query-blocked kernel
    (:mod:`ops.serving.prefill_kernels`) instead: key tiles of several pages gathered
    from ``[K, P * page_size, H]``, one online-softmax update per 128 keys whatever the
    page size (sm_90, bf16, H 128, GQA 8:1, 16-token pages: 4.2 SASS instructions per
    key against 15.2 with an update per page), so pages of 8 tokens run there too.

    Shapes: ``B`` sequences, ``N`` query heads, ``K`` key/value heads
    (``N % K == 0``), ``H`` head dim, ``P`` pages of ``page_size`` tokens.

    Args:
      q: ``[B, N, H]`` float32, bfloat16 or float16.
      k_pages, v_pages: ``[K, P, page_size, H]``, q's dtype, or int8 (dequantized in
        the kernel with the scale pages; without them the int8 values are used as is).
      block_tables: int32 ``[B, pages_per_sequence]``: page ``i`` of sequence ``b``
        (tokens ``i * page_size ..``) is ``k_pages[:, block_tables[b, i]]``. Entries
        past a sequence's length are never read (ids outside ``[0, P)`` are clamped).
      lengths: int32 ``[B]``: tokens in each sequence's cache (the query is the
        last, at position ``length - 1``), clamped to ``[0, pages_per_sequence *
        page_size]``; None: every page is full.
      k_scales_pages, v_scales_pages: optional float ``[K, P, page_size]``: a
        per-token scale of int8 pages (key ``= k_pages * k_scales_pages``).
      scale: logit scale (default 1.0, as JAX's; pass ``1 / sqrt(H)`` for the usual).
      logits_soft_cap: optional cap > 0: logits become ``cap * tanh(logits / cap)``.
      local_window_size: optional int ``w`` or pair ``(left, right)`` (jax.nn's
        convention): the query at ``length - 1`` sees keys ``length - 1 - left ..
        length - 1``; ``right`` is irrelevant (no key lies right of the query).
      sinks: optional float ``[N]``: a per-head sink logit joining each softmax's
        denominator (gpt-oss; StreamingLLM), neither scaled nor capped.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla" (the float32 reference of
        :mod:`ops.serving.reference`),
        "interpret", "triton", "mosaic_tpu", "pallas_triton" (JAX's Triton
        lowering: the same math walking the pages in an in-kernel loop, as it has
        no scalar prefetch; power-of-two head dims and pages), or a sequence tried
        in order. "mosaic_gpu" raises NotImplementedError.
      block_sizes: None (the tuning cache's entry for the device, dtype and shape
        bucket, else :meth:`PagedBlockSizes.heuristic
        <ops.serving.block_sizes.PagedBlockSizes.heuristic>`), a
        :class:`~ops.serving.block_sizes.PagedBlockSizes` or ``(pages_per_block,
        k_splits)``.

    Returns:
      ``[B, N, H]`` in q's dtype. A sequence of length 0 gets 0 (JAX's reference
      gives the mean of its values, JAX's kernel 0). No gradient: a serving op.

    Raises:
      TypeError: non-arrays, q not float, pages neither q's dtype nor int8,
        tables / lengths not int32.
      ValueError: ranks and shapes (pages differ, ``N % K``, head dims, batch),
        scales given for float pages or of the wrong shape, a negative window,
        a soft cap <= 0, a non-finite scale, bad sinks or block sizes, an unknown
        implementation.
    """
    args = _check(q, k_pages, v_pages, block_tables, lengths, k_scales_pages, v_scales_pages,
                  scale, logits_soft_cap, local_window_size, sinks)
    bs = check_block_sizes(block_sizes, _OP)
    return OP.run(implementation, args=args, block_sizes=bs)


def _entry(impl, args, block_sizes):
    """The checked call on one implementation, partitioned (:mod:`ops.serving.sharding`)."""
    return sharding.paged_attention(lambda a, i: _run(a, i, block_sizes), args, impl)


def _problem_of(args, **_):
    """The call's problem (:data:`ops.serving.block_sizes.DIMS`; :attr:`ops._op.Op.problem_of`)."""
    (B, N, H), (K, _, ps, _) = args["q"].shape, args["k"].shape
    return (B, K, N // max(K, 1), H, ps, args["tables"].shape[1]), args["q"].dtype, None


def _window_left(window, op: str):
    if window is None:
        return None
    pair = (window, window) if isinstance(window, numbers.Integral) else window
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or any(
            w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0)
            for w in pair)):
        raise ValueError(f"{op}: local_window_size must be None, an int >= 0 or a pair "
                         f"(left, right) of ints >= 0 or None; got {window!r}.")
    return None if pair[0] is None else int(pair[0])


def _check(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, scale, soft_cap, window,
           sinks):
    checks.check_rank(q, "q", 3, _LAYOUT_Q, _OP)
    check_float_dtype(q, "q", _OP)
    checks.check_rank(k_pages, "k_pages", 4, _LAYOUT_PAGES, _OP)
    checks.check_rank(v_pages, "v_pages", 4, _LAYOUT_PAGES, _OP)
    if tuple(k_pages.shape) != tuple(v_pages.shape):
        raise ValueError(f"{_OP}: k_pages and v_pages must have the same shape {_LAYOUT_PAGES}; "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}.")
    quantized = checks.check_pages_dtype(k_pages, "k_pages", q, _OP)
    if checks.check_pages_dtype(v_pages, "v_pages", q, _OP) != quantized:
        check_same_dtype(v_pages, k_pages, "v_pages", "k_pages", _OP)
    B, N, H = q.shape
    K, P, ps, Hk = k_pages.shape
    checks.check_heads(N, K, _OP)
    if Hk != H:
        raise ValueError(f"{_OP}: the head dim of q ({H}) and of the pages ({Hk}) must be equal.")
    checks.check_int32(tables, "block_tables", (B, None), "[B, pages_per_sequence]", _OP)
    if lengths is not None:
        checks.check_int32(lengths, "lengths", (B,), "[B]", _OP)
    for name, s in (("k_scales_pages", k_scales), ("v_scales_pages", v_scales)):
        if s is None:
            continue
        checks.check_rank(s, name, 3, "[K, total_pages, page_size]", _OP)
        check_float_dtype(s, name, _OP)
        if not quantized:
            raise ValueError(f"{_OP}: {name} is for int8 pages; the pages are "
                             f"{np.dtype(k_pages.dtype).name}.")
        if tuple(s.shape) != (K, P, ps):
            raise ValueError(f"{_OP}: {name} must have shape {(K, P, ps)} "
                             f"[K, total_pages, page_size]; got {tuple(s.shape)}.")
    if (k_scales is None) != (v_scales is None):
        raise ValueError(f"{_OP}: give both k_scales_pages and v_scales_pages or neither.")
    return dict(q=q, k=k_pages, v=v_pages, tables=tables, lengths=lengths, k_scales=k_scales,
                v_scales=v_scales, scale=checks.check_scale(scale, _OP),
                soft_cap=checks.check_positive_float(soft_cap, "logits_soft_cap", _OP),
                left=_window_left(window, _OP), sinks=checks.check_sinks(sinks, N, _OP))


def _ranges(args):
    """Each sequence's keys ``[start, end)``."""
    B = args["q"].shape[0]
    capacity = args["tables"].shape[1] * args["k"].shape[2]
    if args["lengths"] is None:
        end = jnp.full((B,), capacity, jnp.int32)
    else:
        end = jnp.clip(args["lengths"], 0, capacity)
    start = jnp.zeros_like(end) if args["left"] is None else jnp.maximum(end - 1 - args["left"], 0)
    return start, end


def _run(args, impl: str, bs):
    q = args["q"]
    B, N, H = q.shape
    K, P, ps, _ = args["k"].shape
    start, end = _ranges(args)
    if impl == "xla" or 0 in (B, N, H, K, P, ps, args["tables"].shape[1]):
        k, v = (_dequantized(args[n], args[f"{n}_scales"], q.dtype) for n in ("k", "v"))
        out = rows_attention(q, gather_pages(k, args["tables"]), gather_pages(v, args["tables"]),
                             start, end, scale=args["scale"], soft_cap=args["soft_cap"],
                             sinks=args["sinks"])
        return out.astype(q.dtype)
    G = N // K
    pcfg = prefill_kernels.decode_config(
        OP, impl, bs, rows=B, kv_heads=K, group=G, head_dim=H, page_size=ps, total_pages=P,
        pages_per_row=args["tables"].shape[1], dtype=q.dtype, scale=args["scale"],
        soft_cap=args["soft_cap"], window=None if args["left"] is None else args["left"] + 1,
        k_scale=None, v_scale=None, sinks=args["sinks"] is not None, layout=kernels.HEADS_FIRST,
        per_token_scales=args["k_scales"] is not None)
    if pcfg is not None:  # one query token per sequence, each a work item of length `end`
        pages = (args["k"], args["v"]) + (() if args["k_scales"] is None else
                                          (args["k_scales"], args["v_scales"]))
        cu = jnp.arange(B + 1, dtype=jnp.int32)
        return prefill_kernels.prefill(pcfg, q, pages, args["tables"], cu, end,
                                       jnp.asarray([B], jnp.int32), args["sinks"])
    cfg = kernels.DecodeConfig.build(
        OP, impl, bs, rows=B, kv_heads=K, group=G, head_dim=H, page_size=ps, total_pages=P,
        pages_per_row=args["tables"].shape[1], dtype=q.dtype, layout=kernels.HEADS_FIRST,
        scale=args["scale"], soft_cap=args["soft_cap"],
        per_token_scales=args["k_scales"] is not None, sinks=args["sinks"] is not None)
    qg = q.reshape(B, K, G, H)
    scales = () if args["k_scales"] is None else (args["k_scales"], args["v_scales"])
    out = kernels.decode(cfg, qg, (args["k"], args["v"]), scales, args["tables"], None, start, end,
                         sink_tile(args["sinks"], K))
    return out.reshape(B, N, H)


def sink_tile(sinks, K: int):
    """Sink logits ``[N]`` as the merge kernel's float32 ``[K, G, 1]``."""
    return None if sinks is None else sinks.astype(jnp.float32).reshape(K, -1, 1)


def _dequantized(pages, page_scales, dtype):
    if page_scales is None:
        return pages.astype(dtype)
    return (pages.astype(jnp.float32) * page_scales.astype(jnp.float32)[..., None]).astype(dtype)


def _reference(q, k_pages, v_pages, block_tables, lengths, **kwargs):
    """The XLA reference (the ``"xla"`` implementation)."""
    return paged_attention(q, k_pages, v_pages, block_tables, lengths, implementation="xla",
                           **kwargs)


def _example(problem, implementation: str):
    """A decode call of ``problem``'s dims for the tuner: every sequence full, each in
    pages of its own (the tables are made in the call, not drawn at random)."""
    rows, K, G, H, ps, pps = problem.shape
    sds = jax.ShapeDtypeStruct
    cache = sds((K, rows * pps, ps, H), problem.dtype)
    args = [sds((rows, K * G, H), problem.dtype), cache, cache]

    def fn(q, k_pages, v_pages):
        tables = jnp.arange(rows * pps, dtype=jnp.int32).reshape(rows, pps)
        return paged_attention(q, k_pages, v_pages, tables, None, scale=H ** -0.5,
                               implementation=implementation)
    return fn, args


OP = register(Op(
    name=_OP, dims=DIMS, configs={b: PagedBlockSizes for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
    reference=_reference, entry=_entry, problem_of=_problem_of, function=paged_attention,
    tuning=Tuning(example=_example, shapes=((1, 4, 8, 128, 16, 512), (8, 4, 8, 128, 16, 512),
                                            (64, 4, 8, 128, 16, 512), (8, 4, 8, 128, 16, 8192)),
                  quick=((2, 2, 4, 64, 16, 8),), order=60),
    missing_reason=" (mosaic_gpu: no kernel for it yet; use 'triton')"))
