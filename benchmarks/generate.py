"""Greedy generation through our decoder with a dense or a paged key/value cache, token for
token against transformers' ``generate(do_sample=False)``.

Run as ``python -m benchmarks.generate`` (``pip install -e ".[models]"``: transformers
and torch; nothing is downloaded).

What it does:

1. Model. The Llama 3 model of :mod:`benchmarks.decoder` (its tiny config: width 64,
   2 layers, 4 query heads of 16 over 2 key/value heads, Llama 3 rope scaling, byte
   vocabulary of 256) with the same seeded random weights, mapped into our
   :class:`benchmarks.decoder.Decoder` (``--family`` picks another family of that
   module; sliding windows and soft caps reach the caches too).
2. Prompts. Windows of real text, the byte tokens ``benchmarks.decoder`` and
   ``benchmarks.lm`` use (the Python standard library's sources), of different
   lengths (``--prompt-lengths``) in one batch.
3. Reference. transformers' ``generate(do_sample=False)`` of ``--new-tokens`` tokens in
   float32 on the CPU, every prompt in one batch, left-padded with an attention mask
   (transformers then numbers each prompt's positions from its first real token, as we
   do); no end-of-sequence token, so every sequence gets all its tokens. With
   ``--hf-one-at-a-time`` each prompt runs alone instead (no padding at all).
4. Ours, per ``--implementations`` and ``--caches``, greedy (``argmax`` of the float32
   logits, the first maximum on ties, as ``torch.argmax``):

   * ``dense``: per layer a ``[B, S, K, H]`` key and value cache (``S`` = the longest
     prompt plus the new tokens). Prefill runs the prompts right-padded to the longest
     one (padding sits after each prompt's last token, so causality keeps it out of the
     real tokens, and decode steps overwrite its cache slots before any query can see
     them), then one token per sequence per step at its own position. Each step writes
     the new keys and values at their positions and attends with
     ``ops.dot_product_attention`` over the cache with a boolean mask of the keys each
     query sees (``j <= position``, and the layer's sliding window); in a decode step
     that mask covers keys only, so the op runs its split-KV decode kernels.
   * ``paged``: per layer one cache ``[total_pages, page_size, 2 * K, H]`` (JAX's
     ragged layout), ``--page-size`` tokens per page, each sequence's pages drawn at
     random from the pool (a seeded permutation: tables are not contiguous). Every
     step is one ragged batch ``[1, T]``: prefill concatenates the prompts (a ragged
     chunk per sequence, ``cu_q_lens`` their boundaries), a decode step holds one token
     per sequence. The new keys and values go to their slots (``page * page_size +
     offset``) with ``ops.update_kv_pages`` (the cache donated to the jitted step, so
     written in place where the backend allows), attention is
     ``ops.ragged_paged_attention`` (the logit scale passed explicitly: the op's
     default, as JAX's, is 1.0).

   The cache plugs into each layer through Flax's attention hook: for the duration of
   one traced step, each layer's ``attention_fn`` is the layer's cache, which receives
   the projected, normed and rotated query, key and value heads ``[B, T, heads, H]``
   (:meth:`layers.MultiHeadAttention.attend`) and returns the attention output; the
   positions of the new tokens go to :meth:`Decoder.hidden_states`, which hands them to
   the rotary embedding. Every sequence keeps its own length and positions (nnx's
   ``init_cache`` holds one index for the whole batch, which prompts of different
   lengths cannot share). Prefill and decode are one jitted function each, traced
   once (``--token-budget``: one for both, paged). ``--k-splits`` (default 2) forces
   the split-KV splits of the attention over either cache, since the ops' heuristics
   leave caches of a few dozen keys unsplit; ``--layers-implementation`` runs the
   model's other layers on another implementation than the caches (CI: XLA).

5. Checks: every new token equals transformers', and until a sequence's first
   differing token its logits agree with transformers' within
   ``max |ours - theirs| / max |theirs| <=`` :data:`LOGITS_TOL`. On a differing token
   the report names the first one (prompt, step), both models' two best tokens and
   margins, and the logits error up to there: the check is never loosened to pass.

Results: a table on the terminal, ``generate.json`` and ``generate.md`` in
``--out-dir`` (default ``benchmarks/results/latest/``). Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ops
from benchmarks import decoder
from ops.attention.block_sizes import BlockSizes
from benchmarks.lm import load_corpus

CACHES = ("dense", "paged")
LOGITS_TOL = decoder.LOGITS_TOL  # float32: max |ours - theirs| / max |theirs|
PAD = 0  # the left padding token of transformers' batch (masked out)


# --------------------------------------------------------------------------
# Prompts and the transformers reference
# --------------------------------------------------------------------------

def text_prompts(data: np.ndarray, lengths, seed: int) -> list[np.ndarray]:
    """int32 prompts of the given lengths: seeded random windows of the byte stream ``data``."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        start = int(rng.integers(0, len(data) - n))
        out.append(data[start:start + n].astype(np.int32))
    return out


def _generation_config(new_tokens: int):
    import transformers
    return transformers.GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=new_tokens, pad_token_id=PAD,
        output_logits=True, return_dict_in_generate=True)


def hf_generate(model, prompts: list[np.ndarray], new_tokens: int, *,
                one_at_a_time: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy tokens ``[B, new_tokens]`` and the logits they were picked from,
    float32 ``[new_tokens, B, V]``: one left-padded batch with an attention mask, or each
    prompt alone."""
    import torch
    config = _generation_config(new_tokens)
    if one_at_a_time:
        runs = [hf_generate(model, [p], new_tokens) for p in prompts]
        return (np.concatenate([t for t, _ in runs]), np.concatenate([lg for _, lg in runs], 1))
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), PAD, np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):], mask[b, longest - len(p):] = p, 1
    # No end of sequence: generate() fills a None of the given config from the model's own
    # generation config (eos_token_id=2 in Llama's), so that one is cleared for the call.
    defaults, eos = model.generation_config, model.generation_config.eos_token_id
    defaults.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(input_ids=torch.from_numpy(ids),
                                 attention_mask=torch.from_numpy(mask), generation_config=config)
    finally:
        defaults.eos_token_id = eos
    tokens = out.sequences[:, longest:].numpy()
    logits = np.stack([s.float().numpy() for s in out.logits])
    return tokens, logits


# --------------------------------------------------------------------------
# Caches: each layer's attention_fn for one traced step
# --------------------------------------------------------------------------

def _attention_options(attn) -> tuple[float, int | None, float | None]:
    """``(scale, left, soft_cap)`` of a decoder layer's attention: the logit scale (its
    default ``1 / sqrt(head_dim)``), the sliding window's left extent (None: none)."""
    opts = attn.decoder_options
    scale = opts.scale if opts is not None and opts.scale is not None else attn.head_dim ** -0.5
    window = None if opts is None else opts.local_window_size
    left = None if window is None else (window[0] if isinstance(window, tuple) else window)
    return scale, left, None if opts is None else opts.logits_soft_cap


class DenseLayerCache:
    """One layer's dense cache ``k, v [B, S, K, H]`` as the layer's ``attention_fn``.

    Called with the new tokens' heads ``[B, T, *, H]`` at ``positions [B, T]``: writes
    their keys and values at those positions and returns the attention of the queries
    over the cache (key ``j`` visible to a query at position ``p`` when ``j <= p`` and
    within the sliding window). ``k`` and ``v`` then hold the updated cache.
    """

    def __init__(self, attn, k, v, positions, implementation, k_splits=None):
        self.k, self.v, self.positions, self.implementation = k, v, positions, implementation
        self.k_splits = k_splits
        self.scale, self.left, self.soft_cap = _attention_options(attn)

    def __call__(self, query, key, value, *, is_causal, **unused):
        assert is_causal, "a decoder cache serves causal self-attention"
        B, T = self.positions.shape
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        self.k = self.k.at[rows, self.positions].set(key.astype(self.k.dtype))
        self.v = self.v.at[rows, self.positions].set(value.astype(self.v.dtype))
        j = jnp.arange(self.k.shape[1], dtype=jnp.int32)
        p = self.positions[:, None, :, None]  # [B, 1, T, 1]
        mask = j <= p
        if self.left is not None:
            mask &= j >= p - self.left
        blocks = None
        if T == 1 and self.k_splits is not None:  # a decode step: split-KV's splits forced
            blocks = BlockSizes(block_q=16, block_k=16, k_splits=self.k_splits)
        return ops.dot_product_attention(query, self.k, self.v, mask=mask, scale=self.scale,
                                         logits_soft_cap=self.soft_cap,
                                         implementation=self.implementation, block_sizes=blocks)


class PagedLayerCache:
    """One layer's paged cache ``[total_pages, page_size, 2 * K, H]`` as its ``attention_fn``.

    Called with one ragged batch ``[1, T, *, H]`` (``meta``: ``slots [T]``, ``kv_lens
    [S]``, ``page_indices [S, pages_per_seq]``, ``cu_q_lens [S + 1]``, ``num_seqs [1]``, as
    :func:`ops.ragged_paged_attention` takes them, the new tokens counted in ``kv_lens``):
    writes the new keys and values with :func:`ops.update_kv_pages` and attends with
    :func:`ops.ragged_paged_attention`. ``pages`` then holds the updated cache.
    """

    def __init__(self, attn, pages, meta: dict, implementation, k_splits=None):
        self.pages, self.meta, self.implementation = pages, meta, implementation
        self.block_sizes = None if k_splits is None else (1, k_splits)
        self.scale, self.left, self.soft_cap = _attention_options(attn)

    def __call__(self, query, key, value, *, is_causal, **unused):
        assert is_causal and query.shape[0] == 1, "a paged cache serves one causal ragged batch"
        m, impl = self.meta, self.implementation
        self.pages = ops.update_kv_pages(self.pages, key[0].astype(self.pages.dtype),
                                         value[0].astype(self.pages.dtype), m["slots"],
                                         implementation=impl)
        out = ops.ragged_paged_attention(
            query[0], self.pages, m["kv_lens"], m["page_indices"], m["cu_q_lens"],
            m["num_seqs"], scale=self.scale,
            sliding_window=None if self.left is None else self.left + 1,
            soft_cap=self.soft_cap, implementation=impl, block_sizes=self.block_sizes)
        return out[None]


def _with_caches(model: decoder.Decoder, caches, tokens, positions, last):
    """Float32 logits ``[B, V]`` of the tokens at ``last``, each layer's attention served by
    its cache: ``tokens, positions [B, T]`` with ``last [B]`` one index per row, or one
    ragged row ``[1, T]`` with ``last [B]`` indices into it."""
    attns = [block.attn for block in model.layers]
    saved = [a.attention_fn for a in attns]
    try:
        for a, c in zip(attns, caches):
            a.attention_fn = c
        h = model.hidden_states(tokens, positions)
    finally:
        for a, fn in zip(attns, saved):
            a.attention_fn = fn
    rows = h[0, last] if isinstance(caches[0], PagedLayerCache) else h[jnp.arange(len(last)), last]
    return model.logits(rows).astype(jnp.float32)


def _dense_step(graphdef, params, ks, vs, tokens, positions, last, options):
    model = nnx.merge(graphdef, params)
    caches = [DenseLayerCache(b.attn, k, v, positions, *options)
              for b, k, v in zip(model.layers, ks, vs)]
    logits = _with_caches(model, caches, tokens, positions, last)
    return logits, tuple(c.k for c in caches), tuple(c.v for c in caches)


def _paged_step(graphdef, params, pages, tokens, positions, last, meta, options):
    model = nnx.merge(graphdef, params)
    caches = [PagedLayerCache(b.attn, p, meta, *options)
              for b, p in zip(model.layers, pages)]
    logits = _with_caches(model, caches, tokens, positions, last)
    return logits, tuple(c.pages for c in caches)


# Traced once per model structure, shapes and (implementation, k_splits); caches donated.
_DENSE_STEP = jax.jit(_dense_step, static_argnums=(0, 7), donate_argnums=(2, 3))
_PAGED_STEP = jax.jit(_paged_step, static_argnums=(0, 7), donate_argnums=(2,))


class DenseGenerator:
    """Greedy steps over a dense cache ``[B, capacity, K, H]`` per layer (module docstring)."""

    def __init__(self, model: decoder.Decoder, batch: int, capacity: int, implementation,
                 k_splits=None):
        cfg = model.cfg
        self.graphdef, self.params = nnx.split(model)
        self.options = (implementation, k_splits)
        dtype = model.embed.embedding[...].dtype
        shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.ks = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        self.vs = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        self.lengths = np.zeros(batch, np.int32)

    def _step(self, tokens, positions, last):
        logits, self.ks, self.vs = _DENSE_STEP(
            self.graphdef, self.params, self.ks, self.vs, jnp.asarray(tokens),
            jnp.asarray(positions), jnp.asarray(last), self.options)
        return np.asarray(logits)

    def prefill(self, prompts: list[np.ndarray]) -> np.ndarray:
        lengths = np.array([len(p) for p in prompts], np.int32)
        longest = int(lengths.max())
        tokens = np.zeros((len(prompts), longest), np.int32)  # right-padded
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        positions = np.broadcast_to(np.arange(longest, dtype=np.int32), tokens.shape)
        self.lengths = lengths
        return self._step(tokens, positions, lengths - 1)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        logits = self._step(tokens[:, None], self.lengths[:, None],
                            np.zeros(len(tokens), np.int32))
        self.lengths = self.lengths + 1
        return logits


class PagedGenerator:
    """Greedy steps over a paged cache ``[total_pages, page_size, 2 * K, H]`` per layer, each
    sequence owning ``ceil(capacity / page_size)`` pages drawn at random from the pool.

    ``token_budget``: None (each step's ragged batch as long as its tokens: prefill and
    decode compile apart) or a fixed length every step is padded to (padding tokens
    have slot -1, which ``ops.update_kv_pages`` skips, and lie past ``cu_q_lens[-1]``,
    where ``ops.ragged_paged_attention`` writes zeros): one compiled step, as a serving
    engine's fixed token budget.
    """

    def __init__(self, model: decoder.Decoder, batch: int, capacity: int, implementation,
                 k_splits=None, *, page_size: int, seed: int, token_budget: int | None = None):
        cfg = model.cfg
        self.graphdef, self.params = nnx.split(model)
        self.options, self.page_size = (implementation, k_splits), page_size
        self.token_budget = token_budget
        per_seq = -(-capacity // page_size)
        pool = np.random.default_rng(seed).permutation(batch * per_seq).astype(np.int32)
        self.page_indices = pool.reshape(batch, per_seq)
        dtype = model.embed.embedding[...].dtype
        shape = (batch * per_seq, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
        self.pages = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        self.lengths = np.zeros(batch, np.int32)

    def _step(self, tokens, q_lens):
        """One ragged batch: ``tokens`` concatenated, ``q_lens[s]`` of them sequence ``s``'s."""
        seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), q_lens)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        positions = (self.lengths[seq] + np.arange(len(tokens)) - cu[seq]).astype(np.int32)
        slots = (self.page_indices[seq, positions // self.page_size] * self.page_size
                 + positions % self.page_size).astype(np.int32)
        kv_lens = (self.lengths + q_lens).astype(np.int32)
        if self.token_budget is not None:
            if len(tokens) > self.token_budget:
                raise ValueError(f"a step of {len(tokens)} tokens exceeds token_budget="
                                 f"{self.token_budget}")
            pad = self.token_budget - len(tokens)
            tokens, positions = np.pad(tokens, (0, pad)), np.pad(positions, (0, pad))
            slots = np.pad(slots, (0, pad), constant_values=-1)
        meta = {"slots": slots, "kv_lens": kv_lens, "page_indices": self.page_indices,
                "cu_q_lens": cu, "num_seqs": np.array([len(q_lens)], np.int32)}
        logits, self.pages = _PAGED_STEP(
            self.graphdef, self.params, self.pages, jnp.asarray(tokens[None]),
            jnp.asarray(positions[None]), jnp.asarray(cu[1:] - 1),
            jax.tree.map(jnp.asarray, meta), self.options)
        self.lengths = kv_lens
        return np.asarray(logits)

    def prefill(self, prompts: list[np.ndarray]) -> np.ndarray:
        return self._step(np.concatenate(prompts).astype(np.int32),
                          np.array([len(p) for p in prompts], np.int32))

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        return self._step(tokens.astype(np.int32), np.ones(len(tokens), np.int32))


def generate(model: decoder.Decoder, prompts: list[np.ndarray], new_tokens: int, *,
             cache: str = "dense", page_size: int = 16, seed: int = 0,
             implementation=None, k_splits: int | None = None,
             token_budget: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy generation: tokens ``[B, new_tokens]`` and the float32 logits they were picked
    from ``[new_tokens, B, V]``.

    Args:
      model: a :class:`benchmarks.decoder.Decoder` (float32 for the comparison).
      prompts: B int32 token arrays, each of length >= 1 (lengths may differ).
      new_tokens: tokens to generate per prompt (>= 1).
      cache: ``"dense"`` or ``"paged"`` (the module docstring describes both).
      page_size: tokens per page of the paged cache.
      seed: the paged cache's page assignment (a seeded permutation of the pool).
      implementation: the cache's ops' implementation (None: the model's); the model's
        own layers keep theirs.
      k_splits: None (each op's heuristic) or the split-KV splits of the attention over
        the cache: the dense cache's decode steps (key tiles of 16) and every paged step
        (one page per grid step).
      token_budget: the paged cache's fixed step length (:class:`PagedGenerator`; at least
        the prompts' total length); None: unpadded steps.

    Raises:
      ValueError: an unknown cache, no prompts or an empty one, new_tokens or page_size < 1,
        a token_budget below the prompts' total length.
    """
    if cache not in CACHES:
        raise ValueError(f"generate: cache={cache!r}; expected one of {CACHES}")
    if not prompts or any(len(p) < 1 for p in prompts):
        raise ValueError("generate: prompts must be a non-empty list of non-empty token arrays")
    if new_tokens < 1 or page_size < 1:
        raise ValueError(f"generate: new_tokens ({new_tokens}) and page_size ({page_size}) "
                         "must be >= 1")
    total = sum(len(p) for p in prompts)
    if token_budget is not None and token_budget < total:
        raise ValueError(f"generate: token_budget={token_budget} is below the prompts' "
                         f"{total} tokens")
    impl = model.implementation if implementation is None else implementation
    capacity = max(len(p) for p in prompts) + new_tokens
    gen = (DenseGenerator(model, len(prompts), capacity, impl, k_splits) if cache == "dense"
           else PagedGenerator(model, len(prompts), capacity, impl, k_splits,
                               page_size=page_size, seed=seed, token_budget=token_budget))
    steps = [gen.prefill(prompts)]
    for _ in range(1, new_tokens):
        steps.append(gen.decode(steps[-1].argmax(-1).astype(np.int32)))
    logits = np.stack(steps)
    return logits.argmax(-1).T.astype(np.int32), logits


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------

def _top2(logits: np.ndarray) -> tuple[list[int], float]:
    best = np.argsort(logits)[::-1][:2]
    return [int(t) for t in best], float(logits[best[0]] - logits[best[1]])


def compare(tokens, logits, ref_tokens, ref_logits) -> dict:
    """Token equality and, up to each sequence's first differing token, the logits error
    (``max |ours - theirs| / max |theirs|`` over those steps); at the first difference
    (earliest step, then lowest prompt) both models' two best tokens and margins."""
    same = tokens == ref_tokens
    first = [int(np.argmin(row)) if not row.all() else len(row) for row in same]
    ours_ = np.concatenate([logits[:n, b] for b, n in enumerate(first)])
    theirs = np.concatenate([ref_logits[:n, b] for b, n in enumerate(first)])
    out = {"tokens_equal": bool(same.all()), "same_fraction": float(same.mean()),
           "logits_rel_err": decoder.relative_error(ours_, theirs) if ours_.size else 0.0,
           "first_difference": None}
    if not same.all():
        step = min(first)
        b = first.index(step)
        (ours_best, ours_margin), (ref_best, ref_margin) = (
            _top2(logits[step, b]), _top2(ref_logits[step, b]))
        out["first_difference"] = {
            "prompt": b, "step": step, "ours": int(tokens[b, step]),
            "theirs": int(ref_tokens[b, step]), "ours_top2": ours_best,
            "ours_margin": ours_margin, "theirs_top2": ref_best, "theirs_margin": ref_margin,
            "logits_rel_err_there": decoder.relative_error(logits[step, b],
                                                           ref_logits[step, b])}
    return out


def _failure(row: dict) -> str | None:
    where = f"{row['implementation']} {row['cache']}"
    d = row["first_difference"]
    if d is not None:
        return (f"{where}: prompt {d['prompt']} step {d['step']}: token {d['ours']} vs "
                f"transformers' {d['theirs']} (our margin {d['ours_margin']:.3g} between "
                f"{d['ours_top2']}, theirs {d['theirs_margin']:.3g} between {d['theirs_top2']}; "
                f"logits error there {d['logits_rel_err_there']:.2e}, over the equal tokens "
                f"before each sequence's first difference {row['logits_rel_err']:.2e})")
    if not row["logits_rel_err"] <= LOGITS_TOL:
        return f"{where}: logits error {row['logits_rel_err']:.3e} > {LOGITS_TOL:g}"
    return None


# --------------------------------------------------------------------------
# Report and command line
# --------------------------------------------------------------------------

def markdown(result: dict) -> str:
    a = result["args"]
    layers_impl = a["layers_implementation"] or "as the caches'"
    lines = ["# Greedy generation with our caches vs transformers", "",
             f"{result['date']}, JAX {result['jax']}, transformers {result['transformers']}, "
             f"torch {result['torch']}, backend {result['backend']}. {a['family']} (tiny config, "
             f"seeded random weights), float32; prompts of {a['prompt_lengths']} bytes of "
             f"stdlib source; transformers "
             + ("one prompt at a time" if a["hf_one_at_a_time"] else "left-padded in one batch")
             + f"; page size {a['page_size']}, k_splits {a['k_splits']}, token budget "
             f"{a['token_budget'] or 'none'}; the model's layers {layers_impl}.", "",
             "| impl | cache | prompts | new tokens | tokens equal | logits err | "
             "first difference | s |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        d = r["first_difference"]
        diff = "" if d is None else (f"prompt {d['prompt']} step {d['step']}: {d['ours']} vs "
                                     f"{d['theirs']} (margins {d['ours_margin']:.2g} / "
                                     f"{d['theirs_margin']:.2g})")
        lines.append(f"| {r['implementation']} | {r['cache']} | {r['prompts']} | "
                     f"{r['new_tokens']} | {r['same_fraction']:.0%} | {r['logits_rel_err']:.2e} "
                     f"| {diff} | {r['seconds']:.1f} |")
    lines += ["", f"Logits error: max |ours - transformers| / max |transformers| over the steps "
              f"before a sequence's first differing token (at most {LOGITS_TOL:g}).", "",
              "Result: " + ("PASS" if result["passed"] else "FAIL")]
    lines += [f"- {f}" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def _per_impl(items, flag: str) -> dict[str, int]:
    out = {}
    for item in items or []:
        impl, _, n = item.partition("=")
        if impl not in ops.IMPLEMENTATIONS or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"{flag} takes IMPL=N (N >= 1), got {item!r}")
        out[impl] = int(n)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.generate",
        description=__doc__.split("\n\n")[0].replace("``", "") + " Exits 1 if a check fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", default="llama3", choices=decoder.FAMILIES[:-1],
                   help="The benchmarks.decoder family (its tiny config and seeded weights).")
    p.add_argument("--implementations", default="xla,interpret,triton",
                   help="Comma-separated implementations of our model and caches.")
    p.add_argument("--caches", default="dense,paged", help="Comma-separated caches.")
    p.add_argument("--prompt-lengths", default="5,41,17,30",
                   help="Comma-separated prompt lengths in bytes (one prompt each).")
    p.add_argument("--new-tokens", type=int, default=32, help="Greedy tokens per prompt.")
    p.add_argument("--new-tokens-for", action="append", metavar="IMPL=N",
                   help="New tokens for one implementation, repeatable (triton=8 unless given: "
                        "Triton's CPU interpreter costs about 0.1 ms of Python per operation).")
    p.add_argument("--prompts-for", action="append", metavar="IMPL=N",
                   help="Only the first N prompts for one implementation, repeatable "
                        "(triton=2 unless given).")
    p.add_argument("--page-size", type=int, default=16,
                   help="Tokens per page of the paged cache (triton: >= 16).")
    p.add_argument("--k-splits", type=int, default=2,
                   help="Split-KV splits of the attention over the caches, forced (the dense "
                        "cache's decode steps with key tiles of 16: on mosaic_tpu pass 0); 0: "
                        "each op's heuristic, which keeps caches of a few dozen keys unsplit.")
    p.add_argument("--layers-implementation", default=None,
                   help="The implementation of the model's own layers (projections, norms, "
                        "rotary, MLP, head); default: each of --implementations, as the caches'.")
    p.add_argument("--token-budget", type=int, default=0,
                   help="Pad every paged step to this many tokens (one compiled step; at least "
                        "the prompts' total length); 0: unpadded steps.")
    p.add_argument("--hf-one-at-a-time", action="store_true",
                   help="Run transformers on each prompt alone instead of one left-padded batch.")
    p.add_argument("--seed", type=int, default=0, help="Weights, prompts and page assignment.")
    p.add_argument("--data-bytes", type=int, default=200_000,
                   help="Bytes of standard-library source to read.")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "latest"),
                   help="Where generate.json and generate.md go.")
    args = p.parse_args(argv)
    args.implementations = [s.strip() for s in args.implementations.split(",") if s.strip()]
    for impl in args.implementations + [args.layers_implementation or "xla"]:
        if impl not in ops.IMPLEMENTATIONS:
            p.error(f"unknown implementation {impl!r}; expected one of {ops.IMPLEMENTATIONS}")
    args.caches = [s.strip() for s in args.caches.split(",") if s.strip()]
    if not args.caches or not set(args.caches) <= set(CACHES):
        p.error(f"--caches takes a comma-separated subset of {CACHES}")
    try:
        args.prompt_lengths = [int(s) for s in args.prompt_lengths.split(",") if s.strip()]
        args.new_tokens_for = {"triton": 8, **_per_impl(args.new_tokens_for, "--new-tokens-for")}
        args.prompts_for = {"triton": 2, **_per_impl(args.prompts_for, "--prompts-for")}
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(f"{e} (--prompt-lengths takes comma-separated ints)")
    if not args.prompt_lengths or min(args.prompt_lengths) < 1:
        p.error("--prompt-lengths needs at least one length, each >= 1")
    if args.new_tokens < 1 or args.page_size < 1 or args.k_splits < 0:
        p.error("--new-tokens and --page-size must be >= 1, --k-splits >= 0")
    if args.token_budget and args.token_budget < sum(args.prompt_lengths):
        p.error(f"--token-budget {args.token_budget} is below the prompts' "
                f"{sum(args.prompt_lengths)} tokens")
    return args


def run(args) -> dict:
    """The checks of ``args`` (see :func:`parse_args`); the result dict written as JSON."""
    import torch
    import transformers
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    data, _ = load_corpus(args.data_bytes)
    prompts = text_prompts(data, args.prompt_lengths, args.seed)
    hf = decoder.hf_model(args.family, decoder.tiny_hf_config(args.family), args.seed)
    cfg = decoder.config_from_hf(args.family, hf.config)
    params = decoder.MAPPERS[args.family](decoder.hf_state(hf), cfg)
    ref_tokens, ref_logits = hf_generate(hf, prompts, args.new_tokens,
                                         one_at_a_time=args.hf_one_at_a_time)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "transformers": transformers.__version__,
              "torch": torch.__version__, "backend": jax.default_backend(),
              "args": vars(args), "rows": [], "failures": []}
    for impl in args.implementations:
        model = decoder.build_decoder(cfg, params,
                                      implementation=args.layers_implementation or impl)
        n = args.new_tokens_for.get(impl, args.new_tokens)
        b = args.prompts_for.get(impl, len(prompts))
        for cache in args.caches:
            start = time.perf_counter()
            tokens, logits = generate(model, prompts[:b], n, cache=cache,
                                      page_size=args.page_size, seed=args.seed,
                                      implementation=impl, k_splits=args.k_splits or None,
                                      token_budget=(args.token_budget or None)
                                      if cache == "paged" else None)
            row = {"implementation": impl, "cache": cache, "prompts": b, "new_tokens": n,
                   "seconds": time.perf_counter() - start,
                   **compare(tokens, logits, ref_tokens[:b, :n], ref_logits[:n, :b])}
            result["rows"].append(row)
            failure = _failure(row)
            if failure:
                result["failures"].append(failure)
            print(f"{impl:<9} {cache:<5} {b} prompts x {n} tokens: {row['same_fraction']:.0%} "
                  f"equal, logits err {row['logits_rel_err']:.2e}  {row['seconds']:.1f} s",
                  flush=True)
    result["passed"] = not result["failures"]
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result = run(args)
    return decoder.write_report(result, args.out_dir, "generate", markdown(result))


if __name__ == "__main__":
    sys.exit(main())
