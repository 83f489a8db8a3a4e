"""The XLA reference of :func:`ops.dot_product_attention` (also its ``"xla"`` implementation).

Computes the whole ``[B, N, T, S]`` score matrix in float32 (products at
``Precision.HIGHEST``), so it is the yardstick the kernels are tested
against, not a fast path. Conventions, shared with the kernels:

* scores ``= scale * q.k``, then ``logits_soft_cap * tanh(scores / cap)``,
  then ``+ bias``, then masking (:mod:`ops.attention.masking`);
* a query that sees no key gets output 0 and logsumexp ``-inf`` (and zero
  gradients), as FlashAttention and cuDNN do, where jax.nn's XLA path gives
  the mean of the values (its masked logits are a large finite negative);
* dropout multiplies the normalized probabilities by ``keep / (1 - rate)``
  with the keep bits of :mod:`ops.attention.dropout`; the logsumexp is that
  of the undropped logits;
* a sink logit (one per query head, neither scaled nor capped) joins every
  row's softmax denominator as a key whose value is zero (StreamingLLM's
  attention sink as gpt-oss learns it): the probabilities sum to less than 1,
  the logsumexp includes it, and a row that sees no key gets output 0 and
  logsumexp = the sink.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ops.attention import dropout as dropout_lib
from ops.attention.masking import MaskSpec, visible


def _grouped(x, num_kv_heads: int):
    """A ``[B', N', T', S']`` bias or mask as ``[B', K or 1, G or 1, T', S']``."""
    b, n, t, s = x.shape
    if n == 1:
        return x.reshape(b, 1, 1, t, s)
    return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def attention_reference(q, k, v, bias=None, mask=None, *, spec: MaskSpec, scale: float,
                        q_seg=None, kv_seg=None, logits_soft_cap: float | None = None,
                        dropout_rate: float = 0.0, seed=None, sinks=None):
    """``(out, lse)``: out float32 ``[B, T, N, Hv]``, lse float32 ``[B, T, N]``.

    Args:
      q: ``[B, T, N, H]``; k: ``[B, S, K, H]``, v: ``[B, S, K, Hv]``, ``N % K == 0``.
      bias: None or 4-D broadcastable to ``[B, N, T, S]`` (added in float32).
      mask: None or 4-D boolean broadcastable to ``[B, N, T, S]`` (True attends).
      spec: the positional mask (:class:`MaskSpec`).
      q_seg, kv_seg: int32 ``[B, T]`` / ``[B, S]`` ids (lengths folded in), or None.
      dropout_rate, seed: dropout on the probabilities (seed from
        :func:`ops.attention.dropout.seed_from_rng`).
      sinks: None or float ``[N]``: each query head's sink logit.
    """
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh if kh else 1  # no heads at all: an empty result
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, t, kh, g, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(f32), precision=lax.Precision.HIGHEST)
    scores = scores * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    if bias is not None:
        scores = scores + _grouped(bias.astype(f32), kh)
    q_pos = jnp.arange(t, dtype=jnp.int32)[:, None]
    k_pos = jnp.arange(s, dtype=jnp.int32)[None, :]
    seg_q = None if q_seg is None else q_seg[:, None, None, :, None]
    seg_k = None if kv_seg is None else kv_seg[:, None, None, None, :]
    vis = visible(spec, q_pos, k_pos, seg_q, seg_k)
    if mask is not None:
        m = _grouped(mask, kh)
        vis = m if vis is None else vis & m
    if vis is not None:
        scores = jnp.where(vis, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
    if sinks is not None:
        sink = sinks.astype(f32).reshape(kh, g)[None, :, :, None, None]
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(row_max)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - shift)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - shift)
    seen = total > 0
    probs = p / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    if dropout_rate > 0.0:
        heads = (jnp.arange(b, dtype=jnp.int32)[:, None, None] * n
                 + jnp.arange(kh, dtype=jnp.int32)[None, :, None] * g
                 + jnp.arange(g, dtype=jnp.int32)[None, None, :])[..., None, None]
        keep = dropout_lib.keep_mask(seed, heads, q_pos, k_pos, dropout_rate)
        probs = jnp.where(keep, probs * (1.0 / (1.0 - dropout_rate)), 0.0)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(f32), precision=lax.Precision.HIGHEST)
    out = out.reshape(b, t, n, v.shape[-1])
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, n)
    return out, lse
