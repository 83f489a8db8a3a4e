"""Benchmark cases for ``ops.paged_attention``: decode over a paged KV cache.

Each case pits our kernels (:func:`benchmarks.harness.kernel_implementations`:
``triton`` and ``pallas_triton`` on GPUs, ``interpret`` and ``triton`` in
Triton's CPU interpreter on CPUs) against:

* ``xla`` (the baseline a user writes without us): the pages gathered into a
  dense ``[B, S, K, H]`` cache with ``jnp.take``, then
  ``jax.nn.dot_product_attention(implementation="xla")`` with the sequence
  lengths, jitted, in the inputs' dtype;
* ``jax_pallas``: JAX's own GPU kernel, ``jax.experimental.pallas.ops.gpu.
  paged_attention`` (its defaults: ``k_splits=16``, 8 pages per step,
  ``block_h=16``), on JAX's Pallas Triton lowering on GPUs and on JAX's
  interpreter (``interpret=True``) on CPUs;
* ``jax_pallas_on_pallas_core``: the same kernel's source run on pallas_core
  (:func:`benchmarks.jax_pallas_tests.load_on_pallas_core`: only its Pallas
  imports swapped, same arguments): pallas_core's interpreter on CPUs, its
  default GPU backend (``triton``, our Triton code generator) on GPUs.

Decode is memory-bound (``ceiling="copy"``): one call reads each sequence's
keys and values once, ``2 B S K H s`` bytes at ``s`` bytes per element, plus
the queries and outputs (``2 B N H s``); GB/s is of those bytes and ``%
ceiling`` the fraction of a copy of as many bytes on the same device. FLOPs:
``4 B N S H`` (two products per key). Tokens/s is ``B / time``: one new token
per sequence per call.

Accuracy is measured against exact attention in float64 over the gathered
cache (:func:`reference`), written independently of ``ops``.

Shapes ``(B, S, N, K, H, page_size)``: GPUs decode batches of 1, 8 and 64 at
contexts of 1k, 8k, 32k and 128k tokens (every sequence full; batch 64 up to 32k), GQA 8:1 (32
query heads over 4 key/value heads of 128, Llama-3-8B's attention), pages of
16 tokens (vLLM's default), bfloat16; CPUs run the interpreters at tiny
sizes.

Prefill chunks (``ops.ragged_paged_attention``): ``S`` sequences each bring a
chunk of ``C`` new tokens, the last ``C`` of a full ``L``-token cache (chunked
prefill; GPUs: 4 x 512 against 4k, GQA 8:1, 16-token pages, bfloat16). Two rows
side by side: ``prefill-per-token`` (``block_q=1``: every query token a row of
the split-KV decode kernel, reading its sequence's cache alone) and
``prefill-query-blocked`` (the default here: ``block_q`` tokens per program,
:mod:`ops.serving.prefill_kernels`). FLOPs: ``4 N H`` per visible (query, key)
pair. GB/s is of the cache bytes each path reads (:func:`prefill_cache_bytes`:
the pages each program's key range touches, per key/value head, keys and
values; plus q and the output), so the two rows' bytes differ by about
``block_q``. The baseline gathers each sequence's pages into a dense cache and
runs ``jax.nn.dot_product_attention`` with a causal mask aligned to the
cache's end.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

import ops
from benchmarks import harness
from ops.serving.block_sizes import ragged_block_q
from benchmarks.jax_pallas_tests import load_on_pallas_core

OP = "paged_attention"
PAGE_SIZE = 16

# (B, S, N, K, H, page_size, dtype)
# Batch 64 at 128k (17 GB of cache) is left out: the float64 reference of the harness
# holds the cache in float64 on the device (68 GB).
ACCELERATOR_SHAPES = tuple((b, s, 32, 4, 128, PAGE_SIZE, "bfloat16")
                           for b in (1, 8, 64) for s in (1024, 8192, 32768, 131072)
                           if (b, s) != (64, 131072))
CPU_SHAPES = ((2, 256, 8, 1, 32, PAGE_SIZE, "float32"), (3, 512, 16, 2, 64, PAGE_SIZE, "bfloat16"))
QUICK_SHAPES = {"cpu": ((1, 64, 8, 1, 32, PAGE_SIZE, "float32"),),
                "accelerator": ((8, 8192, 32, 4, 128, PAGE_SIZE, "bfloat16"),)}

# Prefill chunks: (S sequences, C new tokens each, L cached tokens each, N, K, H, page_size, dtype)
PREFILL_ACCELERATOR_SHAPES = ((4, 512, 4096, 32, 4, 128, PAGE_SIZE, "bfloat16"),)
PREFILL_CPU_SHAPES = ((2, 24, 96, 8, 2, 32, PAGE_SIZE, "float32"),)
# A quick CPU run (CI's smoke test of the suite) leaves the prefill rows out: two more
# interpreter runs of a second op there; tests/test_ragged_paged_attention.py covers them.
PREFILL_QUICK_SHAPES = {"cpu": (), "accelerator": PREFILL_ACCELERATOR_SHAPES}


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    shapes = harness.pick_shapes(platform, quick, cpu=CPU_SHAPES, accelerator=ACCELERATOR_SHAPES,
                                 quick_shapes=QUICK_SHAPES)
    ours = harness.kernel_implementations(platform)
    # A quick CPU run skips JAX's kernel on JAX's interpreter (a smoke test of ours).
    theirs = not (quick and platform == "cpu")
    out = [make_case(shape, ours, interpret=platform == "cpu", theirs=theirs) for shape in shapes]
    prefill = harness.pick_shapes(platform, quick, cpu=PREFILL_CPU_SHAPES,
                                  accelerator=PREFILL_ACCELERATOR_SHAPES,
                                  quick_shapes=PREFILL_QUICK_SHAPES)
    return out + [make_prefill_case(shape, ours, blocked) for shape in prefill
                  for blocked in (False, True)]


def make_case(shape, implementations, *, interpret: bool, theirs: bool = True) -> harness.Case:
    b, s, n, k, h, ps, dtype = shape
    itemsize = jnp.dtype(dtype).itemsize
    fns = {harness.BASELINE: gathered_xla}
    for name in implementations:
        fns[name] = functools.partial(ours, implementation=name)
    if theirs:
        fns["jax_pallas"] = functools.partial(jax_pallas, interpret=interpret)
        fns["jax_pallas_on_pallas_core"] = functools.partial(
            jax_pallas, interpret=interpret, module=jax_paged_on_pallas_core())
    return harness.Case(
        op=OP, variant=f"decode+gqa{n // k}", shape=(b, s, n, k, h, ps), dtype=dtype,
        pass_name="fwd", flops=4.0 * b * n * s * h, make_inputs=functools.partial(
            _make_inputs, shape=shape), implementations=fns, reference=reference,
        ceiling="copy", bytes_accessed=float(2 * b * s * k * h * itemsize + 2 * b * n * h * itemsize))


def _make_inputs(key, *, shape):
    """q, k/v pages of a cache holding exactly the batch's sequences (in a shuffled page
    order), the tables and full lengths. The logits have unit spread at scale 1/sqrt(H),
    which q carries (JAX's kernel does not scale)."""
    b, s, n, k, h, ps, dtype = shape
    pages = s // ps
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = harness.random_normal(kq, (b, n, h), dtype, scale=h ** -0.5)
    cache = (k, b * pages, ps, h)
    k_pages = harness.random_normal(kk, cache, dtype)
    v_pages = harness.random_normal(kv, cache, dtype)
    tables = jax.random.permutation(kp, b * pages).reshape(b, pages).astype(jnp.int32)
    lengths = jnp.full((b,), s, jnp.int32)
    return q, k_pages, v_pages, tables, lengths


def _dense(pages, tables):
    """``[K, P, ps, H]`` pages -> ``[B, S, K, H]`` by the tables."""
    x = jnp.take(pages, tables, axis=1)  # [K, B, pages, ps, H]
    k, b, n, ps, h = x.shape
    return jnp.moveaxis(x, 0, 3).reshape(b, n * ps, k, h)


def gathered_xla(q, k_pages, v_pages, tables, lengths):
    """The pages gathered, then jax.nn's XLA attention with the lengths (scale 1: q is scaled)."""
    k, v = _dense(k_pages, tables), _dense(v_pages, tables)
    out = jax.nn.dot_product_attention(q[:, None], k, v, scale=1.0, key_value_seq_lengths=lengths,
                                       implementation="xla")
    return out[:, 0]


def ours(q, k_pages, v_pages, tables, lengths, *, implementation):
    return ops.paged_attention(q, k_pages, v_pages, tables, lengths, implementation=implementation)


def jax_paged_on_pallas_core():
    """JAX's GPU paged attention module loaded on pallas_core."""
    return load_on_pallas_core(jax_paged.__name__)


def jax_pallas(q, k_pages, v_pages, tables, lengths, *, interpret: bool, module=jax_paged):
    """JAX's kernel (``module``: JAX's own, or its source loaded on pallas_core) with its
    defaults but ``k_splits`` (at most the table's width, which it must divide)."""
    return module.paged_attention(q, k_pages, v_pages, tables, lengths, interpret=interpret,
                                  k_splits=min(16, tables.shape[1]))


def reference(q, k_pages, v_pages, tables, lengths):
    """Exact decode attention over each sequence's first ``length`` tokens (dtype of
    :func:`benchmarks.harness.upcast`)."""
    q, k, v = (harness.upcast(x) for x in (q, _dense(k_pages, tables), _dense(v_pages, tables)))
    b, n, h = q.shape
    kh = k.shape[2]
    logits = jnp.einsum("bkgh,bskh->bkgs", q.reshape(b, kh, n // kh, h), k,
                        precision=lax.Precision.HIGHEST)
    seen = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    logits = jnp.where(seen[:, None, None, :], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgs,bskh->bkgh", p, v, precision=lax.Precision.HIGHEST).reshape(b, n, h)


# --------------------------------------------------------------------------
# Prefill chunks: ops.ragged_paged_attention per token vs query-blocked
# --------------------------------------------------------------------------

def prefill_blocks(shape, blocked: bool) -> dict:
    """The explicit block sizes of a prefill row: the query-blocked kernel's defaults
    (:func:`ops.serving.block_sizes.ragged_block_q`, 128-key tiles) or ``block_q=1``
    (the per-token path) with 128 keys per step and one split."""
    s, c, _, n, k, _, ps, _ = shape
    pages = max(1, 128 // ps)
    block_q = ragged_block_q(None, s * c, s, n // k) if blocked else 1
    return dict(pages_per_block=pages, k_splits=1, block_q=block_q)


def prefill_cache_bytes(shape, blocked: bool) -> float:
    """Cache bytes one call reads: per program (a query block, or one token), the pages of
    key tiles its causal range ``[0, position]`` touches, keys and values of each of the
    ``K`` heads."""
    s, c, L, n, k, h, ps, dtype = shape
    bs = prefill_blocks(shape, blocked)
    bq, keys = bs["block_q"], bs["pages_per_block"] * ps
    last = L - c + np.arange(c)  # each token's position
    if bq > 1:
        ends = last[np.minimum(np.arange(0, c, bq) + bq, c) - 1] + 1
        read = np.sum(-(-ends // keys) * keys)
    else:
        read = np.sum(-(-(last + 1) // ps) * ps)
    return float(s * read * 2 * k * h * jnp.dtype(dtype).itemsize)


def make_prefill_case(shape, implementations, blocked: bool) -> harness.Case:
    s, c, L, n, k, h, ps, dtype = shape
    itemsize = jnp.dtype(dtype).itemsize
    bs = prefill_blocks(shape, blocked)
    fns = {harness.BASELINE: prefill_xla}
    for name in implementations:
        fns[name] = functools.partial(prefill_ours, implementation=name, block_sizes=bs)
    pairs = s * c * (L - c) + s * c * (c + 1) // 2  # visible (query, key) pairs
    return harness.Case(
        op="ragged_paged_attention",
        variant=f"prefill-{'query-blocked' if blocked else 'per-token'}+gqa{n // k}",
        shape=(s, c, L, n, k, h, ps), dtype=dtype, pass_name="fwd", flops=4.0 * n * h * pairs,
        make_inputs=functools.partial(_prefill_inputs, shape=shape), implementations=fns,
        reference=prefill_reference, ceiling="copy",
        bytes_accessed=prefill_cache_bytes(shape, blocked) + 2.0 * s * c * n * h * itemsize)


def _prefill_inputs(key, *, shape):
    """q ``[S * C, N, H]`` (scaled by 1/sqrt(H)), a combined cache of exactly the
    sequences' pages in shuffled order, full ``kv_lens``, tables, ``cu_q_lens``, num_seqs."""
    s, c, L, n, k, h, ps, dtype = shape
    pages = L // ps
    kq, kc, kp = jax.random.split(key, 3)
    q = harness.random_normal(kq, (s * c, n, h), dtype, scale=h ** -0.5)
    kv = harness.random_normal(kc, (s * pages, ps, 2 * k, h), dtype)
    tables = jax.random.permutation(kp, s * pages).reshape(s, pages).astype(jnp.int32)
    return (q, kv, jnp.full((s,), L, jnp.int32), tables,
            jnp.arange(s + 1, dtype=jnp.int32) * c, jnp.asarray([s], jnp.int32))


def prefill_ours(q, kv, kv_lens, tables, cu, num_seqs, *, implementation, block_sizes):
    return ops.ragged_paged_attention(q, kv, kv_lens, tables, cu, num_seqs,
                                      implementation=implementation, block_sizes=block_sizes)


def _prefill_dense(q, kv, tables):
    """``q [S, C, N, H]`` and the dense ``[S, L, K, H]`` keys and values of each sequence."""
    s = tables.shape[0]
    x = jnp.take(kv, tables, axis=0)  # [S, pages, ps, 2K, H]
    x = x.reshape(s, -1, x.shape[-2], x.shape[-1])
    return q.reshape(s, -1, q.shape[-2], q.shape[-1]), x[:, :, 0::2], x[:, :, 1::2]


def _end_aligned_causal(c: int, L: int):
    """``[C, L]``: query ``t`` (position ``L - C + t``) sees keys up to its position."""
    return jnp.arange(L)[None, :] <= (L - c + jnp.arange(c))[:, None]


def prefill_xla(q, kv, kv_lens, tables, cu, num_seqs):
    """Each sequence's pages gathered, then jax.nn's XLA attention (scale 1: q is scaled)."""
    qs, k, v = _prefill_dense(q, kv, tables)
    mask = _end_aligned_causal(qs.shape[1], k.shape[1])[None, None]
    out = jax.nn.dot_product_attention(qs, k, v, scale=1.0, mask=mask, implementation="xla")
    return out.reshape(q.shape)


def prefill_reference(q, kv, kv_lens, tables, cu, num_seqs):
    """Exact attention of each chunk over its sequence's cache, causal from the end."""
    qs, k, v = (harness.upcast(x) for x in _prefill_dense(q, kv, tables))
    s, c, n, h = qs.shape
    kh = k.shape[2]
    logits = jnp.einsum("sckgh,slkh->skgcl", qs.reshape(s, c, kh, n // kh, h), k,
                        precision=lax.Precision.HIGHEST)
    logits = jnp.where(_end_aligned_causal(c, k.shape[1]), logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("skgcl,slkh->sckgh", p, v, precision=lax.Precision.HIGHEST)
    return out.reshape(q.shape)
