"""XLA references of the paged attention ops (also their ``"xla"`` implementation).

Every serving op reduces to *rows*: one query token with its own key range
``[start, end)`` in its own page table. :func:`gather_pages` turns a page table
into a dense ``[rows, S, K, H]`` cache and :func:`rows_attention` attends each
row over it in float32 (products at ``Precision.HIGHEST``), so these functions
are a yardstick, not a fast path: they read every page of every table.

Conventions shared with the kernels (:mod:`ops.serving.kernels`):

* logits ``= scale * q.k`` (float32), then ``soft_cap * tanh(logits / soft_cap)``;
* key ``j`` is seen by a row when ``start <= j < end``;
* a sink logit (one per query head, neither scaled nor capped) joins the
  softmax denominator as a key whose value is zero;
* a row that sees no key gets output 0 (JAX's references, which mask with a
  large finite negative logit, give the mean of the values there).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


@functools.partial(jax.jit, static_argnames="heads_axis")
def gather_pages(pages, tables, *, heads_axis: int = 0):
    """A dense ``[R, pages_per_row * page_size, K, H]`` cache from pages and tables.

    Args:
      pages: ``[K, P, page_size, H]`` (``heads_axis=0``, JAX's GPU layout) or
        ``[P, page_size, K, H]`` (``heads_axis=2``).
      tables: int32 ``[R, pages_per_row]`` page ids (clamped into ``[0, P)``).
    """
    if heads_axis == 0:
        pages = jnp.moveaxis(pages, 0, 2)  # [P, ps, K, H]
    tables = jnp.clip(tables, 0, pages.shape[0] - 1)
    dense = pages[tables]  # [R, pages_per_row, ps, K, H]
    r, n, ps, k, h = dense.shape
    return dense.reshape(r, n * ps, k, h)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def rows_attention(q, k, v, start, end, *, scale: float, soft_cap: float | None = None,
                   sinks=None):
    """float32 ``[R, N, H]``: each row's attention over its keys ``[start, end)``.

    Args:
      q: ``[R, N, H]``; k, v: ``[R, S, K, H]`` (any float dtype, used in float32),
        ``N % K == 0`` (query head ``n`` reads key/value head ``n // (N // K)``).
      start, end: int32 ``[R]``: the keys each row sees.
      sinks: None or float ``[N]`` sink logits.
    """
    r, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    f32 = jnp.float32
    qg = q.astype(f32).reshape(r, kh, g, h)
    logits = jnp.einsum("rkgh,rskh->rkgs", qg, k.astype(f32),
                        precision=lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    pos = jnp.arange(s, dtype=jnp.int32)
    seen = (pos >= start[:, None]) & (pos < end[:, None])
    logits = jnp.where(seen[:, None, None, :], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
    if sinks is not None:
        sink = sinks.astype(f32).reshape(1, kh, g, 1)
        row_max = jnp.maximum(row_max, sink)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - shift)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - shift)
    out = jnp.einsum("rkgs,rskh->rkgh", p, v.astype(f32), precision=lax.Precision.HIGHEST)
    out = out / jnp.where(total > 0, total, 1.0)
    return out.reshape(r, n, v.shape[-1])
