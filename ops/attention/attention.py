"""``ops.dot_product_attention``: flash attention, a drop-in for ``jax.nn.dot_product_attention``.

Argument checks and normalisation live here; the kernels' pallas_calls are in
:mod:`ops.attention.calls` (the kernels themselves in :mod:`ops.attention.grid_walk`
and :mod:`ops.attention.loop_walk`, their programs in :mod:`ops.attention.programs`,
the per-tile math in :mod:`ops.attention.tile_math`), the masks and block ranges in
:mod:`ops.attention.masking` and :mod:`ops.attention.range_table`, the dropout hash
in :mod:`ops.attention.dropout` and the XLA reference in :mod:`ops.attention.reference`.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops._checks import check_array, check_float_dtype, check_same_dtype
from ops._partitioning import psum, run
from ops.attention import dropout as dropout_lib
from ops.attention import calls, decode, range_table
from ops.attention.block_sizes import (BlockSizes, register_op, select_block_sizes,
                                       split_kv_applies, tuning_variant)
from ops.attention.config import AttentionProblem, Backend, Config, ScoreMath
from ops.attention.masking import (MaskSpec, block_full_visibility, block_ranges, block_visibility,
                                   fold_key_mask, fold_lengths, masked_sides)
from ops.attention.reference import attention_reference

_OP = "dot_product_attention"


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation: str | None = None,
                          return_residual: bool = False, query_segment_ids=None,
                          key_value_segment_ids=None, logits_soft_cap=None,
                          dropout_rate: float = 0.0, dropout_rng=None, block_sizes=None,
                          sinks=None):
    """Scaled dot-product attention by flash-attention kernels (FlashAttention-2).

    ``softmax(scale * q k^T + bias, masked) v`` per head, never materialising
    the ``T x S`` score matrix: the forward kernel streams key/value blocks
    through an online softmax (Dao 2023, "FlashAttention-2", Algorithm 1) and
    the backward kernels recompute the probabilities from the saved logsumexp
    (Algorithm 2). Blocks that no mask lets through are skipped, not only
    masked, so causal attention costs about half of full attention.

    Shapes (jax.nn's letters): ``B`` batch, ``T`` queries, ``S`` keys, ``N``
    query heads, ``K`` key/value heads, ``H`` head dim.

    Args:
      query: ``[B, T, N, H]`` (BTNH) or ``[T, N, H]``; float32, bfloat16 or float16.
      key, value: ``[B, S, K, H]`` and ``[B, S, K, Hv]`` (or ``[S, K, H]``,
        ``[S, K, Hv]``), query's dtype, ``N % K == 0``: grouped-query
        (``1 < K < N``) and multi-query (``K == 1``) attention read each
        key/value head once for its whole group, never repeated in memory. The
        value head dim ``Hv`` may differ from ``H`` (DeepSeek-V2's multi-head
        latent attention: 192 and 128); the output has ``Hv``.
      bias: optional float array broadcastable to ``[B, N, T, S]`` (rank <= 4,
        each dim 1 or full), added to the logits in float32; read block by block,
        never broadcast in memory. Differentiable (its gradient is summed over
        the broadcast dims; it needs a float32 ``[B, N, T, S]`` buffer).
      mask: optional boolean array broadcastable to ``[B, N, T, S]``; True attends.
      scale: logit scale; None means ``1 / sqrt(H)``.
      is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, also when
        ``T != S``, as jax.nn).
      query_seq_lengths, key_value_seq_lengths: optional int32 ``[B]``: queries /
        keys at or past the length are padding.
      local_window_size: optional ``int`` w (= ``(w, w)``) or ``(left, right)``:
        query ``i`` sees keys ``i - left <= j <= i + right``.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla" (the float32 reference), "interpret",
        "triton" (our Triton lowering), "pallas_triton" (JAX's), "mosaic_tpu" or
        "cudnn" (cuDNN's flash attention through ``jax.nn.dot_product_attention``,
        for the calls it takes: :mod:`ops.attention.cudnn`; NotImplementedError for
        the others), "mosaic_gpu" (FlashAttention-3-class warpgroup kernels on
        Hopper: :mod:`ops.attention.mosaic_gpu`; NotImplementedError for what
        they do not take, or on a GPU older than sm_90). Or a sequence of these
        tried in order, each that raises NotImplementedError skipped
        (:mod:`ops._implementation`).
      return_residual: also return the logsumexp (see Returns).
      query_segment_ids, key_value_segment_ids: optional int32 ``[B, T]`` /
        ``[B, S]`` (both or neither): a query sees only keys with its id (packed
        sequences). The ids ``-2**31`` and ``-2**31 + 1`` are reserved.
      logits_soft_cap: optional cap > 0: logits become ``cap * tanh(logits / cap)``
        (Gemma 2), before bias and masks.
      dropout_rate: probability in ``[0, 1)`` of dropping an attention
        probability (the survivors are scaled by ``1 / (1 - rate)``).
      dropout_rng: a JAX PRNG key, required when ``dropout_rate > 0``. The mask
        is a counter hash of (key, batch, head, query, key position)
        (:mod:`ops.attention.dropout`): every backend and the backward pass draw
        the same bits, and nothing ``T x S`` is stored.
      block_sizes: None (the tuning cache's entry for the device, dtype and
        shape bucket, else the heuristic; see
        :func:`ops.attention.block_sizes.select_block_sizes`), a
        :class:`BlockSizes` or a pair ``(block_q, block_k)``.
      sinks: optional float ``[N]``: a learnable sink logit per query head that
        joins every query's softmax denominator as a key whose value is zero
        (the attention sink of StreamingLLM, Xiao et al. 2023, as gpt-oss
        learns it): ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``. It is a
        logit like the scaled (and capped, biased) scores, itself neither
        scaled nor capped, and is computed in float32. Differentiable: its
        gradient is ``-sum over rows of p_sink * (dO . O)``, with ``p_sink =
        exp(sink - lse)``. A query that sees no key gets output 0 and
        logsumexp ``sink``.

    Returns:
      ``[B, T, N, Hv]`` (or ``[T, N, Hv]``) in query's dtype; with
      ``return_residual`` also the logsumexp of each query's logits, float32
      ``[B, T, N]`` (or ``[T, N]``) (jax.nn returns it in the input dtype),
      with no gradient (as jax.nn's).

    A query that sees no key at all (every key masked, a zero-length
    sequence) gets output 0 and logsumexp ``-inf``, with zero gradients, as
    FlashAttention and cuDNN do; jax.nn's XLA path returns the mean of the
    values there, since it masks with a large finite negative logit. Empty
    operands (``B``, ``T``, ``S``, ``N`` or ``H`` zero) give the empty (or,
    for ``S = 0``, zero) result of jax.nn on every implementation.

    Softmax statistics and accumulators are float32 whatever the input dtype;
    float32 inputs multiply at full float32 precision.

    Raises:
      TypeError: non-arrays, non-float or mixed q/k/v dtypes, a non-boolean mask,
        non-int32 lengths or segment ids, a bad dropout_rng, non-float sinks.
      ValueError: ranks, mismatched B / H / shapes, ``N % K != 0``, sinks not
        ``[N]``, a bias or mask
        that does not broadcast, bad lengths or segment-id shapes, a negative
        window, a soft cap <= 0, a dropout_rate outside ``[0, 1)`` or without
        dropout_rng, bad block sizes, an unknown implementation.
      NotImplementedError: an implementation that cannot run the call ("cudnn" or
        "mosaic_gpu" for an option or a device they do not take), when no other
        implementation of a sequence runs it.
    """
    args = _check(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                  key_value_seq_lengths, local_window_size, query_segment_ids,
                  key_value_segment_ids, logits_soft_cap, dropout_rate, dropout_rng, sinks)
    return OP.run(implementation, args=args, is_causal=is_causal, dropout_rate=dropout_rate,
                  dropout_rng=dropout_rng, block_sizes=block_sizes,
                  return_residual=return_residual)


def _attention(impl, args, is_causal, dropout_rate, dropout_rng, block_sizes, return_residual):
    """The checked call on one implementation (see :func:`dot_product_attention`)."""
    q, k, v, bias, mask = args["q"], args["k"], args["v"], args["bias"], args["mask"]
    T, S = q.shape[1], k.shape[1]
    spec = MaskSpec(T=T, S=S, causal=bool(is_causal), left=args["left"], right=args["right"],
                    segments=args["segments"])
    q_seg, kv_seg = fold_lengths(args["q_seg"], args["kv_seg"], args["q_len"], args["kv_len"], T, S)
    seed = dropout_lib.seed_from_rng(dropout_rng) if dropout_rate > 0 else None
    rate = float(dropout_rate)
    if impl == "xla" or 0 in q.shape or 0 in k.shape:
        # Empty operands (no queries, no keys, ...) leave the kernels nothing to do:
        # the reference's answer is exact (zeros and logsumexp -inf for S = 0).
        out, lse = attention_reference(q, k, v, bias, mask, spec=spec, scale=args["scale"],
                                       q_seg=q_seg, kv_seg=kv_seg, logits_soft_cap=args["cap"],
                                       dropout_rate=rate, seed=seed, sinks=args["sinks"])
        out = out.astype(q.dtype)
    else:
        traits = pl.backend_traits(impl)
        variant, why_not_split = _variant(args, is_causal, rate)
        key_mask = mask is not None and mask.shape[1:3] == (1, 1)
        blocks = _check_block_sizes(block_sizes, T, S, max(q.shape[-1], v.shape[-1]), q.dtype,
                                    impl, variant)
        k_splits = _k_splits(blocks, q.shape, k.shape, impl, why_not_split)
        if k_splits > 1 and key_mask:
            # A mask over keys only (a decode cache's filled positions) becomes key padding
            # ids, which split-KV decode compares and whose empty blocks it skips.
            q_seg, kv_seg = fold_key_mask(mask, q_seg, kv_seg, q.shape[0], T)
            spec, mask = dataclasses.replace(spec, segments=True), None
        cfg = Config(
            backend=Backend.of(impl),
            problem=AttentionProblem(
                spec=spec, batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2],
                head_dim=q.shape[3],
                value_head_dim=None if v.shape[-1] == q.shape[-1] else v.shape[-1],
                bias_full=None if bias is None else tuple(d != 1 for d in bias.shape),
                mask_full=None if mask is None else tuple(d != 1 for d in mask.shape)),
            score=ScoreMath(scale=args["scale"], softcap=args["cap"], dropout_rate=rate,
                            sinks=args["sinks"] is not None),
            blocks=dataclasses.replace(blocks, k_splits=k_splits))
        if mask is not None and traits.through_jax:
            mask = mask.astype(jnp.int32)  # JAX's lowerings load no booleans from memory
        out, lse = _flash(q, k, v, bias, mask, q_seg, kv_seg, seed, args["sinks"], cfg)
        lse = jnp.transpose(lse[..., 0], (0, 2, 1))
    if args["unbatched"]:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, lax.stop_gradient(lse)
    return out


def _variant(args, is_causal, rate) -> tuple[dict, str | None]:
    """The call's tuning variant (:func:`ops.attention.block_sizes.tuning_variant`) and
    why split-KV decode cannot run it (None: it can)."""
    q, k, bias, mask = args["q"], args["k"], args["bias"], args["mask"]
    key_mask = mask is not None and mask.shape[1:3] == (1, 1)
    T, group = q.shape[1], q.shape[2] // max(k.shape[2], 1)
    why_not_split = split_kv_applies(T, group, bias=bias is not None,
                                     mask=mask is not None and not key_mask, dropout=rate > 0)
    variant = tuning_variant(
        causal=bool(is_causal), window=(args["left"], args["right"]),
        segments=args["q_seg"] is not None, q_lengths=args["q_len"] is not None,
        kv_lengths=args["kv_len"] is not None, bias=bias, mask=mask, dropout=rate > 0,
        soft_cap=args["cap"] is not None, group=group,
        decode_programs=q.shape[0] * k.shape[2] if why_not_split is None else None)
    return variant, why_not_split


def _problem_of(args, is_causal, dropout_rate, **_):
    """The call's problem ``(T, S, head_dim)`` and variant (:attr:`ops._op.Op.problem_of`)."""
    q, k, v = args["q"], args["k"], args["v"]
    variant, _ = _variant(args, is_causal, float(dropout_rate))
    return (q.shape[1], k.shape[1], max(q.shape[-1], v.shape[-1])), q.dtype, variant


def _power_of_two_heads(call) -> str | None:
    """JAX's Triton lowering tiles only power-of-two head dims (``triton`` pads them)."""
    q, v = call.args["args"]["q"], call.args["args"]["v"]
    if any(d & (d - 1) for d in (q.shape[-1], v.shape[-1])):
        return (f"JAX's Triton lowering needs power-of-two head dims, got H={q.shape[-1]}, "
                f"Hv={v.shape[-1]}; use 'triton'")
    return None


# --------------------------------------------------------------------------
# Argument checks: every misuse is a TypeError / ValueError naming the argument
# --------------------------------------------------------------------------

def _as_4d(x, name, unbatched):
    if x.ndim > 4:
        raise ValueError(f"{_OP}: {name} must have rank <= 4 and broadcast to [B, N, T, S], got "
                         f"shape {tuple(x.shape)}.")
    return jnp.reshape(x, (1,) * (4 - x.ndim) + tuple(x.shape))


def _check_pair_operand(x, name, target):
    """bias / mask: each of the 4 dims is 1 or the full size."""
    for d, (got, want, letter) in enumerate(zip(x.shape, target, "BNTS")):
        if got not in (1, want):
            raise ValueError(f"{_OP}: {name} of shape {tuple(x.shape)} does not broadcast to "
                             f"[B, N, T, S] = {tuple(target)} (dim {letter} is {got}; expected 1 "
                             f"or {want}).")


def _check_per_batch(x, name, shape, unbatched):
    check_array(x, name, _OP)
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{_OP}: {name} must be int32, got {np.dtype(x.dtype).name}.")
    x = jnp.asarray(x)
    if unbatched and x.ndim == len(shape) - 1:
        x = x[None]
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{_OP}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}.")
    return x


def _check(query, key, value, bias, mask, scale, is_causal, q_len, kv_len, window, q_seg, kv_seg,
           cap, dropout_rate, dropout_rng, sinks=None) -> dict:
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_array(x, name, _OP)
        check_float_dtype(x, name, _OP)
    check_same_dtype(key, query, "key", "query", _OP)
    check_same_dtype(value, query, "value", "query", _OP)
    if query.ndim not in (3, 4) or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"{_OP}: query, key and value must all be [B, T|S, N|K, H] (rank 4) or "
                         f"[T|S, N|K, H] (rank 3); got shapes {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}.")
    unbatched = query.ndim == 3
    q, k, v = (jnp.asarray(x)[None] if unbatched else jnp.asarray(x) for x in (query, key, value))
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{_OP}: key and value must have the same shape up to their head dims "
                         f"([B, S, K]), got {tuple(key.shape)} and {tuple(value.shape)}.")
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    if k.shape[0] != B:
        raise ValueError(f"{_OP}: query and key have different batch sizes ({B} and {k.shape[0]}).")
    if k.shape[3] != H:
        raise ValueError(f"{_OP}: query and key have different head dims H ({H} and {k.shape[3]}).")
    if (K == 0 and N != 0) or (K and N % K):
        raise ValueError(f"{_OP}: the number of query heads N={N} must be a multiple of the "
                         f"number of key/value heads K={K}.")
    target = (B, N, T, S)
    if bias is not None:
        check_array(bias, "bias", _OP)
        check_float_dtype(bias, "bias", _OP)
        bias = _as_4d(jnp.asarray(bias), "bias", unbatched)
        _check_pair_operand(bias, "bias", target)
    if mask is not None:
        check_array(mask, "mask", _OP)
        if np.dtype(mask.dtype) != np.bool_:
            raise TypeError(f"{_OP}: mask must be boolean (True attends), got "
                            f"{np.dtype(mask.dtype).name}; pass an additive mask as bias.")
        mask = _as_4d(jnp.asarray(mask), "mask", unbatched)
        _check_pair_operand(mask, "mask", target)
    if scale is None:
        scale = 1.0 / float(np.sqrt(H)) if H else 1.0  # H = 0: every logit is 0 anyway
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{_OP}: scale must be None or a Python number, got {type(scale).__name__}.")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{_OP}: is_causal must be a bool, got {type(is_causal).__name__}.")
    if q_len is not None:
        q_len = _check_per_batch(q_len, "query_seq_lengths", (B,), unbatched and np.ndim(q_len) == 0)
    if kv_len is not None:
        kv_len = _check_per_batch(kv_len, "key_value_seq_lengths", (B,),
                                  unbatched and np.ndim(kv_len) == 0)
    left = right = None
    if window is not None:
        pair = (window, window) if isinstance(window, numbers.Integral) else window
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in pair)):
            raise TypeError(f"{_OP}: local_window_size must be an int or a pair of ints "
                            f"(left, right), got {window!r}.")
        left, right = int(pair[0]), int(pair[1])
        if left < 0 or right < 0:
            raise ValueError(f"{_OP}: local_window_size must be non-negative, got {window!r}.")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError(f"{_OP}: query_segment_ids and key_value_segment_ids must be given "
                         "together.")
    if q_seg is not None:
        q_seg = _check_per_batch(q_seg, "query_segment_ids", (B, T), unbatched)
        kv_seg = _check_per_batch(kv_seg, "key_value_segment_ids", (B, S), unbatched)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0:
            raise ValueError(f"{_OP}: logits_soft_cap must be None or a number > 0, got {cap!r}.")
        cap = float(cap)
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, numbers.Real):
        raise TypeError(f"{_OP}: dropout_rate must be a Python number, got "
                        f"{type(dropout_rate).__name__}.")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{_OP}: dropout_rate must be in [0, 1), got {dropout_rate!r}.")
    if dropout_rate > 0:
        if dropout_rng is None:
            raise ValueError(f"{_OP}: dropout_rate={dropout_rate} needs dropout_rng (a PRNG key).")
        if not hasattr(dropout_rng, "dtype") or not (
                jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
                or np.dtype(dropout_rng.dtype) == np.uint32):
            raise TypeError(f"{_OP}: dropout_rng must be a JAX PRNG key (jax.random.key or "
                            f"PRNGKey), got {dropout_rng!r}.")
    if sinks is not None:
        check_array(sinks, "sinks", _OP)
        check_float_dtype(sinks, "sinks", _OP)
        if tuple(sinks.shape) != (N,):
            raise ValueError(f"{_OP}: sinks must have shape [N] = ({N},) (one logit per query "
                             f"head), got {tuple(sinks.shape)}.")
        sinks = jnp.asarray(sinks)
    segments = q_seg is not None or q_len is not None or kv_len is not None
    return dict(sinks=sinks, q=q, k=k, v=v, bias=bias, mask=mask, scale=float(scale), left=left, right=right,
                q_len=q_len, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg, cap=cap,
                segments=segments, unbatched=unbatched)


def _k_splits(blocks: BlockSizes, q_shape, k_shape, backend, why_not: str | None) -> int:
    """The split-KV decode splits (:mod:`ops.attention.decode`): the block sizes' own, else
    the heuristic's; 1 where decode does not apply (``why_not``:
    :func:`ops.attention.block_sizes.split_kv_applies`'s answer)."""
    (B, T, N, _), (_, S, K, _) = q_shape, k_shape
    if blocks.k_splits is None:
        if why_not is not None:
            return 1
        return decode.default_k_splits(B, K, T, S, N // K, blocks.block_k, backend)
    if blocks.k_splits > 1 and why_not is not None:
        raise ValueError(f"{_OP}: block_sizes.k_splits={blocks.k_splits} (split-KV decode) does "
                         f"not support {why_not}.")
    return blocks.k_splits


def _check_block_sizes(block_sizes, T, S, H, dtype, backend, variant=None) -> BlockSizes:
    if block_sizes is None:
        blocks = select_block_sizes(T, S, H, dtype, backend, variant).resolved()
    elif isinstance(block_sizes, BlockSizes):
        blocks = block_sizes.resolved()
    elif (isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2):
        blocks = BlockSizes(*block_sizes).resolved()
    else:
        raise ValueError(f"{_OP}: block_sizes must be None, a BlockSizes or a pair (block_q, "
                         f"block_k), got {block_sizes!r}.")
    sizes = (blocks.block_q, blocks.block_k, blocks.block_q_dkv, blocks.block_k_dkv)
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in sizes):
        raise ValueError(f"{_OP}: block sizes must be positive ints, got {block_sizes!r}.")
    traits = pl.backend_traits(backend)
    if traits.power_of_two_blocks and any(b & (b - 1) for b in sizes):
        raise ValueError(f"{_OP}: block sizes must be powers of two on {backend}, got "
                         f"{block_sizes!r}.")
    if min(sizes) < traits.min_dot:
        raise ValueError(f"{_OP}: block sizes must be >= {traits.min_dot} on {backend} (its "
                         f"smallest dot), got {block_sizes!r}.")
    # Query blocks are the operands' sublane dim, key blocks the lane dim of the
    # bias / mask / segment ids (the backend's tile; (1, 1) takes any block).
    (sublanes, lanes), where = traits.tile, f"on {backend}"
    for bq in (blocks.block_q, blocks.block_q_dkv):
        if not traits.fits_tile(bq, T, -2):
            raise ValueError(f"{_OP}: {where} query blocks must be multiples of {sublanes} or "
                             f"T, got {block_sizes!r}.")
    for bk in (blocks.block_k, blocks.block_k_dkv):
        if not traits.fits_tile(bk, S, -1):
            raise ValueError(f"{_OP}: {where} key blocks must be multiples of {lanes} or S, got "
                             f"{block_sizes!r}.")
    for name, value in (("num_warps", blocks.num_warps), ("num_stages", blocks.num_stages),
                        ("k_splits", blocks.k_splits)):
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                                  or value <= 0):
            raise ValueError(f"{_OP}: {name} must be None or a positive int, got {value!r}.")
    splits = blocks.k_splits
    if traits.power_of_two_blocks and splits is not None and splits & (splits - 1):
        raise ValueError(f"{_OP}: k_splits must be a power of two on {backend}, got {splits}.")
    return blocks


# --------------------------------------------------------------------------
# custom_vjp: residuals q, k, v, out, lse and the seed (the scalar tables are
# recomputed in the backward, on each device's batch block)
# --------------------------------------------------------------------------

def _tables(cfg: Config, q_seg, kv_seg, seed):
    """The scalar tables of the forward/dQ kernels and of the dK/dV kernel."""
    def ranges(bq, bk, transpose=False, bound_q=False):
        vis = block_visibility(cfg.problem.spec, bq, bk, q_seg, kv_seg)
        # Only the loop strategy skips masks on fully visible blocks (loop_walk.walk_blocks).
        # A kernel must walk with masks every side the table was built with: the dQ
        # kernel's sides (bound_q) include the forward's, so one table serves both.
        full = (block_full_visibility(cfg.problem.spec, bq, bk, q_seg, kv_seg)
                if cfg.backend.strategy == "loop" else None)
        sides = masked_sides(cfg.problem.spec, bq, bk, transpose=transpose, bound_q=bound_q)
        return range_table.pack(seed, block_ranges(vis, cfg.problem.batch, transpose=transpose,
                                                   full=full, sides=sides))

    return (ranges(cfg.blocks.block_q, cfg.blocks.block_k),
            ranges(cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv, transpose=True, bound_q=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _flash(q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, cfg):
    return _partitioned_forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, sinks)


def _flash_fwd(q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, cfg):
    # symbolic_zeros: each array argument arrives as (value, perturbed); None stays None.
    values = [None if x is None else x.value
              for x in (q, k, v, bias, mask, q_seg, kv_seg, seed, sinks)]
    bias_wanted = bias is not None and bias.perturbed
    out, lse = _partitioned_forward(cfg, *values)
    return (out, lse), ((*values, out, lse), bias_wanted)


def _sinks_grad(sinks, out, lse, do):
    """The sinks' gradient, ``-sum over (batch, query) of p_sink * (dO . O)`` with
    ``p_sink = exp(sink - lse)``: the sink takes probability from every key in
    proportion, so ``d out / d sink = -p_sink * out``. One XLA pass over O and dO."""
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
    lse = jnp.transpose(lse[..., 0], (0, 2, 1))  # [B, T, N]
    z = sinks.astype(jnp.float32)
    p_sink = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(z - lse))
    return (-jnp.sum(p_sink * delta, axis=(0, 1))).astype(sinks.dtype)


def _flash_bwd(cfg, saved, cotangents):
    (q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, out, lse), bias_wanted = saved
    do = cotangents[0]
    if type(do).__name__ == "SymbolicZero":  # out unused: every gradient is zero
        do = jnp.zeros(out.shape, out.dtype)
    dsinks = None if sinks is None else _sinks_grad(sinks, out, lse, do)

    def local(q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, do, *, reduced):
        c = _local_config(cfg, q, k)
        table = _tables(c, q_seg, kv_seg, seed)
        # delta = rowsum(dO * O) (FA-2 Algorithm 2, line 4): one fused XLA pass over O and dO.
        delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        delta = jnp.transpose(delta, (0, 2, 1))[..., None]
        dq, dbias = calls.dq_call(c, q, k, v, do, lse, delta, bias, mask, q_seg, kv_seg,
                                    table[0], want_dbias=bias_wanted)
        dk, dv = calls.dkdv_call(c, q, k, v, do, lse, delta, bias, mask, q_seg, kv_seg,
                                   table[1])
        if not bias_wanted:
            return dq, dk, dv
        # A bias broadcast over batch or heads sums its gradient over them, across
        # devices too where those dims are split.
        axes = tuple(d for d, full in enumerate(c.problem.bias_full) if not full)
        dbias = jnp.sum(dbias, axis=axes, keepdims=True)
        split = [f for f, full in zip(("b", "k"), c.problem.bias_full[:2]) if not full]
        return dq, dk, dv, psum(dbias, reduced, *split).astype(bias.dtype)

    dims = _dims(cfg, bias, mask)
    grads = run(_OP, local, (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, do),
                (*dims.operands[:8], dims.out, dims.lse, dims.out),
                (dims.operands[0], dims.operands[1], dims.operands[2])
                + ((dims.operands[3],) if bias_wanted else ()),
                gather=dims.gather, reduce=("b", "k"), out_like=(0, 1, 2, 3))
    dq, dk, dv, *dbias = grads
    return dq, dk, dv, (dbias[0] if bias_wanted else None), None, None, None, None, dsinks


# Multi-device (ops._partitioning): batch ("b") and heads run where they live.
# Query heads are the compound (kv heads "k", group "g"), so a heads split
# keeps every GQA group on one device (only "k" is split: the kv-head count
# must be a multiple of the devices on the heads axis, else heads are
# gathered). Sequences ("t", "s") and the head dim ("h") are gathered: every
# query row needs all keys. With dropout, batch and heads are gathered too:
# the keep bits hash the global (batch, head) index, and a local one would
# drop other entries than one device does.

@dataclasses.dataclass(frozen=True)
class _Signature:
    operands: tuple[str, ...]  # q, k, v, bias, mask, q_seg, kv_seg, seed, sinks
    out: str
    lse: str
    gather: tuple[str, ...]


def _dims(cfg: Config, bias, mask) -> _Signature:
    def pair(full):  # bias / mask [B or 1, N or 1, T or 1, S or 1]
        if full is None:
            return ""
        return " ".join(f if is_full else "one" for f, is_full in zip(("b", "(k g)", "t", "s"), full))

    # The value head dim is its own factor ("hv") when it differs from the query/key one.
    hv = "h" if cfg.problem.value_head_dim is None else "hv"
    gather = ("t", "s", "h") + ((hv,) if hv != "h" else ()) + (
        ("b", "k") if cfg.score.dropout_rate > 0 else ())
    return _Signature(
        operands=("b t (k g) h", "b s k h", f"b s k {hv}", pair(cfg.problem.bias_full),
                  pair(cfg.problem.mask_full), "b t", "b s", "", "(k g)"),
        out=f"b t (k g) {hv}", lse="b (k g) t one", gather=gather)


def _local_config(cfg: Config, q, k) -> Config:
    """``cfg`` for this device's block of batch and heads."""
    return dataclasses.replace(cfg, problem=dataclasses.replace(
        cfg.problem, batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2]))


def _partitioned_forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, sinks=None):
    """``(out, lse)`` of :func:`calls.forward_call`, partitioned over batch and heads."""
    def local(q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, *, reduced):
        c = _local_config(cfg, q, k)
        if c.blocks.k_splits > 1:
            return decode.forward(c, q, k, v, q_seg, kv_seg, sinks)
        table, _ = _tables(c, q_seg, kv_seg, seed)
        return calls.forward_call(c, q, k, v, bias, mask, q_seg, kv_seg, table, sinks)

    dims = _dims(cfg, bias, mask)
    return run(_OP, local, (q, k, v, bias, mask, q_seg, kv_seg, seed, sinks), dims.operands,
               (dims.out, dims.lse), gather=dims.gather)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


# The op layer's registry (ops/_op.py); cuDNN's flash attention registers itself beside ours
# (ops/attention/cudnn.py).
OP = register_op(dot_product_attention, _check, entry=_attention, problem_of=_problem_of,
                 supported={"pallas_triton": _power_of_two_heads},
                 missing_reason=" (JAX's Mosaic GPU lowering has no generic dot_general for the "
                 "kernels as written; use 'triton')")
