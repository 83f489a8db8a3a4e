"""Split-KV decode (flash-decoding) in ops.dot_product_attention.

A few queries against a long key/value range: the keys split across
programs, each writing a partial output and logsumexp, merged by a second
kernel, every query head of a GQA group in one tile. Checked against the
float32 XLA reference and the unsplit kernel (the same math in another
order), forward and gradients (the backward is the flash kernels', fed the
merged logsumexp), with the options decode supports; GQA 4:1; key lengths
that do not divide the 32-key blocks, lengths of 0 and short caches;
interpret, triton in Triton's CPU interpreter, and lowering for TPU / CUDA.
Inputs are numpy (no threefry compiles).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layers
import ops
from ops.attention import BlockSizes, decode
from tests.tolerances import BACKWARD, FORWARD, assert_close

B, S, N, K, H = 2, 300, 8, 2, 32


def _inputs(seed=0, b=B, t=1, s=S, n=N, k=K, h=H, hv=None, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hv = h if hv is None else hv
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return f(b, t, n, h), f(b, s, k, h), f(b, s, k, hv), f(b, t, n, hv), f(n).astype(jnp.float32)


def _attend(impl, q, k, v, splits, **kw):
    blocks = None if impl == "xla" else BlockSizes(16, 32, k_splits=splits)
    return ops.dot_product_attention(q, k, v, implementation=impl, block_sizes=blocks, **kw)


def _options(name, t=1, sinks=None):
    ids = lambda *sizes: jnp.asarray(np.broadcast_to(
        np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(sizes)]), (B, sum(sizes))))
    return {
        "plain": {},
        "lengths": dict(key_value_seq_lengths=jnp.array([0, 157], jnp.int32)),
        "window_cap_sinks": dict(local_window_size=(40, 0), logits_soft_cap=2.0, sinks=sinks,
                                 key_value_seq_lengths=jnp.array([300, 90], jnp.int32)),
        "causal": dict(is_causal=True),
        "segments": dict(query_segment_ids=ids(*([1] * t)) if t > 1 else ids(1),
                         key_value_segment_ids=ids(100, 150, 50)),
        "q_lengths": dict(query_seq_lengths=jnp.array([t, max(t - 2, 0)], jnp.int32)),
    }[name]


def _calls(monkeypatch):
    """A counter of decode.forward's calls (split-KV decode ran)."""
    calls = []
    original = decode.forward
    monkeypatch.setattr(decode, "forward", lambda *a: calls.append(1) or original(*a))
    return calls


_CASES = [("plain", 1), ("lengths", 1), ("window_cap_sinks", 3), ("segments", 3), ("q_lengths", 1)]
_SLOW_CASES = [("plain", 3), ("lengths", 3), ("window_cap_sinks", 1), ("causal", 1), ("causal", 3),
               ("segments", 1), ("q_lengths", 3)]


@pytest.mark.parametrize("option,t", _CASES + [pytest.param(*c, marks=pytest.mark.slow)
                                               for c in _SLOW_CASES])
def test_interpret_matches_reference_and_unsplit(option, t, monkeypatch):
    q, k, v, _, sinks = _inputs(t, t=t)
    kw = _options(option, t, sinks)
    calls = _calls(monkeypatch)
    out, lse = _attend("interpret", q, k, v, 4, return_residual=True, **kw)
    assert calls, "split-KV decode did not run"
    ref, ref_lse = _attend("xla", q, k, v, None, return_residual=True, **kw)
    one, one_lse = _attend("interpret", q, k, v, 1, return_residual=True, **kw)
    for want, want_lse, what in ((ref, ref_lse, "reference"), (one, one_lse, "unsplit")):
        assert_close(out, want, FORWARD[jnp.float32], what)
        assert np.array_equal(np.isinf(lse), np.isinf(want_lse)), what
        np.testing.assert_allclose(np.asarray(lse)[np.isfinite(lse)],
                                   np.asarray(want_lse)[np.isfinite(want_lse)], atol=1e-5)


def _grads(impl, q, k, v, do, splits, **kw):
    kw = dict(kw)
    sinks = kw.pop("sinks", None)

    def loss(q, k, v, sinks):
        out = _attend(impl, q, k, v, splits, sinks=sinks, **kw)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    return jax.grad(loss, argnums)(q, k, v, sinks)


@pytest.mark.parametrize("impl", [pytest.param("interpret", marks=pytest.mark.slow), "triton"])
def test_gradients_through_split_forward(impl):
    q, k, v, do, sinks = _inputs(5, t=2, s=140)
    kw = _options("window_cap_sinks", 2, sinks)
    ours = _grads(impl, q, k, v, do, 4, **kw)
    want = _grads("xla", q, k, v, do, None, **kw)
    for name, a, w in zip(("dq", "dk", "dv", "dsinks"), ours, want):
        assert_close(a, w, BACKWARD[jnp.float32], name)


@pytest.mark.parametrize("option", ["lengths", "segments"])
def test_triton_matches_reference(option):
    q, k, v, _, sinks = _inputs(6)
    kw = _options(option, 1, sinks)
    out = _attend("triton", q, k, v, 8, **kw)
    assert_close(out, _attend("xla", q, k, v, None, **kw), FORWARD[jnp.float32], option)


def test_triton_bfloat16_value_head_dim_and_sinks():
    q, k, v, _, sinks = _inputs(7, t=1, h=64, hv=32, dtype=jnp.bfloat16)
    kw = dict(sinks=sinks, key_value_seq_lengths=jnp.array([211, 300], jnp.int32))
    out = _attend("triton", q, k, v, 4, **kw)
    ref = _attend("xla", *(x.astype(jnp.float32) for x in (q, k, v)), None, **kw)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, 1, N, 32)
    assert_close(out, ref, FORWARD[jnp.bfloat16], "bf16")


@pytest.mark.parametrize("impl", ["interpret", "triton"])
def test_blocks_past_the_length_are_never_read(impl):
    """Keys past every length hold NaN: a split that read them would return NaN."""
    q, k, v, _, _ = _inputs(8)
    k, v = k.at[:, 160:].set(jnp.nan), v.at[:, 160:].set(jnp.nan)
    kw = dict(key_value_seq_lengths=jnp.array([150, 40], jnp.int32))
    out = _attend(impl, q, k, v, 4, **kw)
    ref = _attend("xla", q, k[:, :160], v[:, :160], None, **kw)
    assert_close(out, ref, FORWARD[jnp.float32], impl)


def test_chosen_automatically_and_by_key_only_masks(monkeypatch):
    """Default block sizes pick split-KV decode for one query over 1024 keys; a mask over
    keys only (a decode cache's filled positions) is folded into key padding and keeps it."""
    q, k, v, _, _ = _inputs(9, b=1, s=1024, n=4, k=1)
    calls = _calls(monkeypatch)
    out = ops.dot_product_attention(q, k, v, implementation="interpret")
    assert len(calls) == 1
    assert_close(out, _attend("xla", q, k, v, None), FORWARD[jnp.float32], "auto")
    mask = jnp.asarray(np.arange(1024) < 700)[None, None, None, :]
    out = ops.dot_product_attention(q, k, v, mask=mask, implementation="interpret")
    assert len(calls) == 2
    assert_close(out, _attend("xla", q, k, v, None, mask=mask), FORWARD[jnp.float32], "mask")


def test_multi_head_attention_decode_uses_split_kv(monkeypatch):
    """layers.MultiHeadAttention(decode=True): each generated token attends over the
    cache through split-KV decode, and matches Flax's own layer token for token."""
    from flax import nnx
    feats, heads, length = 32, 4, 512
    make = lambda cls, **kw: cls(num_heads=heads, in_features=feats, qkv_features=feats,
                                 decode=True, rngs=nnx.Rngs(0), **kw)
    ours, stock = make(layers.MultiHeadAttention, implementation="interpret"), make(
        nnx.MultiHeadAttention)
    x = jnp.asarray(np.random.default_rng(10).standard_normal((1, 3, feats)), jnp.float32)
    for layer in (ours, stock):
        layer.init_cache((1, length, feats))
    calls = _calls(monkeypatch)
    for i in range(2):
        token = x[:, i:i + 1]
        assert_close(ours(token), stock(token), 1e-5, f"token {i}")
    assert len(calls) == 2


def test_tuned_k_splits_serve_their_program_count(monkeypatch):
    """The tuning key of a call split-KV decode can run holds batch x key/value heads,
    bucketed: a cached ``k_splits`` serves calls with that many programs, and calls with
    another count keep the heuristic's (traced only)."""
    from ops import tuning
    from ops.attention.block_sizes import tuning_variant
    seen = []
    original = decode.forward
    monkeypatch.setattr(decode, "forward",
                        lambda cfg, *a: seen.append(cfg.blocks.k_splits) or original(cfg, *a))
    entry = tuning.make_entry(
        "dot_product_attention", "interpret", jax.devices()[0].device_kind, "float32",
        (1, 1024, 32), dict(block_q=16, block_k=32, k_splits=8),
        variant=tuning_variant(group=4, decode_programs=2))
    attend = lambda q, k, v: ops.dot_product_attention(q, k, v, implementation="interpret")
    with tuning.override([entry]):
        for b in (2, 1, 3):
            q, kv = np.zeros((b, 1, 4, 32), np.float32), np.zeros((b, 1024, 1, 32), np.float32)
            jax.make_jaxpr(attend)(q, kv, kv)
    heuristic = [decode.default_k_splits(b, 1, 1, 1024, 4, 64, "interpret") for b in (1, 3)]
    assert seen == [8, *heuristic] and 8 not in heuristic


def test_heuristic():
    """GPU rule: enough programs to fill an H100 twice, >= 4 key blocks per split, a
    power of two; none for many queries; on Mosaic TPU only a lone program splits."""
    assert decode.default_k_splits(1, 8, 1, 8192, 8, 64, "triton") == 32
    assert decode.default_k_splits(8, 8, 1, 8192, 8, 64, "triton") == 4
    assert decode.default_k_splits(64, 8, 1, 8192, 8, 64, "triton") == 1
    assert decode.default_k_splits(1, 8, 1, 512, 8, 64, "triton") == 2
    assert decode.default_k_splits(1, 8, 16, 8192, 8, 64, "triton") == 1  # 128 rows
    assert decode.default_k_splits(1, 1, 1, 8192, 8, 128, "mosaic_tpu") == 2
    assert decode.default_k_splits(2, 1, 1, 8192, 8, 128, "mosaic_tpu") == 1


@pytest.mark.parametrize("impl,platform,marker", [("mosaic_tpu", "tpu", "tpu_custom_call"),
                                                  ("pallas_triton", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_split_and_merge(impl, platform, marker):
    def f(q, k, v, sinks, lengths):
        return ops.dot_product_attention(
            q, k, v, sinks=sinks, key_value_seq_lengths=lengths, is_causal=False,
            local_window_size=(1000, 0), implementation=impl,
            block_sizes=BlockSizes(128 if impl == "mosaic_tpu" else 64, 128, k_splits=4))

    args = [jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 4096, 1, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 4096, 1, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 2  # split, merge


@pytest.mark.parametrize("kw,words", [
    (dict(bias=jnp.zeros((B, N, 1, S))), "does not support a bias"),
    (dict(mask=jnp.ones((B, N, 1, S), bool)), "does not support a bias, a mask"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout"),
    (dict(block_sizes=BlockSizes(16, 32, k_splits=0)), "k_splits must be None or a positive"),
    (dict(implementation="pallas_triton", block_sizes=BlockSizes(16, 32, k_splits=3)),
     "power of two"),
])
def test_bad_k_splits(kw, words):
    q, k, v, _, _ = _inputs(11)
    kw = dict(kw)
    kw.setdefault("block_sizes", BlockSizes(16, 32, k_splits=4))
    kw.setdefault("implementation", "interpret")
    with pytest.raises(ValueError, match=words):
        ops.dot_product_attention(q, k, v, **kw)


def test_too_many_query_rows_for_explicit_splits():
    q, k, v, _, _ = _inputs(12, t=17)  # 17 queries x 4 heads per key/value head = 68 rows
    with pytest.raises(ValueError, match="query rows"):
        _attend("interpret", q, k, v, 4)
