"""ops.dot_product_attention: attention sinks and a value head dim of its own.

Sinks (a per-head logit joining every row's softmax denominator, as gpt-oss
learns it): the XLA reference against an explicit float64 softmax over the
keys and the sink column; every kernel against the reference, forward and
``jax.grad`` (the sink's own gradient included), with masks that leave rows
without any key. A value head dim different from the query/key one
(DeepSeek-V2's 192 / 128), forward and backward, and head dim 512. Shapes do
not divide the 16-row tiles; inputs are numpy (no threefry compiles).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from benchmarks.static import kernel_row
from ops.tuning.targets import smem_limit
from tests.tolerances import BACKWARD, FORWARD, assert_close

B, T, S, N, K, H = 2, 21, 37, 4, 2, 32
BLOCKS = (16, 16)


def _inputs(seed=0, b=B, t=T, s=S, n=N, k=K, h=H, hv=None, dtype=np.float32):
    rng = np.random.default_rng(seed)
    hv = h if hv is None else hv
    q, key = rng.standard_normal((b, t, n, h)), rng.standard_normal((b, s, k, h))
    v, do = rng.standard_normal((b, s, k, hv)), rng.standard_normal((b, t, n, hv))
    sinks = 2.0 * rng.standard_normal(n)
    cast = lambda x: jnp.asarray(x.astype(np.float32)).astype(dtype)
    return cast(q), cast(key), cast(v), cast(do), jnp.asarray(sinks, jnp.float32)


def _attend(impl, q, k, v, sinks, **kw):
    blocks = None if impl == "xla" else BLOCKS
    return ops.dot_product_attention(q, k, v, sinks=sinks, implementation=impl, block_sizes=blocks,
                                     **kw)


def _grads(impl, q, k, v, sinks, do, **kw):
    loss = lambda *a: jnp.sum(_attend(impl, *a, **kw).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, sinks)


def _check(impl, q, k, v, do, sinks, dtype=jnp.float32, **kw):
    out, lse = _attend(impl, q, k, v, sinks, return_residual=True, **kw)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, ref_lse = _attend("xla", *up, sinks, return_residual=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:-1] + (v.shape[-1],)
    assert_close(out, ref, FORWARD[dtype], "out")
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5 if dtype == jnp.float32 else 2e-2)
    ours = _grads(impl, q, k, v, sinks, do, **kw)
    want = _grads("xla", *up, sinks, do.astype(jnp.float32), **kw)
    for name, a, w in zip(("dq", "dk", "dv", "dsinks"), ours, want):
        assert_close(a, w, BACKWARD[dtype], name)
    assert ours[3].dtype == sinks.dtype


# --------------------------------------------------------------------------
# The reference: an explicit float64 softmax with a sink column
# --------------------------------------------------------------------------

def _numpy_sinks(q, k, v, sinks, scale, kv_len=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if kv_len is not None:
        s = np.where(np.arange(s.shape[-1]) < np.asarray(kv_len)[:, None, None, None], s, -np.inf)
    col = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], s.shape[:3] + (1,))
    full = np.concatenate([s, col], axis=-1)
    top = full.max(-1, keepdims=True)
    e = np.exp(full - top)
    p = e / e.sum(-1, keepdims=True)
    lse = (top + np.log(e.sum(-1, keepdims=True)))[..., 0]
    return np.einsum("bnts,bsnh->btnh", p[..., :-1], v), np.transpose(lse, (0, 2, 1))


def test_reference_is_a_softmax_with_a_sink_column():
    q, k, v, _, sinks = _inputs(1)
    lengths = jnp.array([0, 30], jnp.int32)  # batch 0 sees no key: output 0, lse = the sink
    out, lse = ops.dot_product_attention(q, k, v, sinks=sinks, key_value_seq_lengths=lengths,
                                         implementation="xla", return_residual=True)
    want, want_lse = _numpy_sinks(q, k, v, sinks, H ** -0.5, kv_len=lengths)
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, atol=2e-6)
    assert np.all(np.asarray(out[0]) == 0)
    np.testing.assert_allclose(lse[0], np.broadcast_to(sinks, (T, N)), atol=1e-6)
    # A sink at -inf is no sink at all: jax.nn's attention.
    plain = ops.dot_product_attention(q, k, v, sinks=jnp.full((N,), -jnp.inf), implementation="xla")
    assert_close(plain, jax.nn.dot_product_attention(q, k, v), FORWARD[jnp.float32], "no sink")


def test_sinks_gradient_formula():
    """d sink[n] = -sum over rows of p_sink * (dO . O): the formula the custom_vjp uses,
    against jax.grad of the reference (no kernel involved)."""
    q, k, v, do, sinks = _inputs(2)
    out, lse = _attend("xla", q, k, v, sinks, return_residual=True)
    p_sink = np.exp(np.asarray(sinks)[None, None, :] - np.asarray(lse))
    delta = np.sum(np.asarray(do, np.float64) * np.asarray(out, np.float64), axis=-1)
    want = -np.sum(p_sink * delta, axis=(0, 1))
    np.testing.assert_allclose(_grads("xla", q, k, v, sinks, do)[3], want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------
# Kernels against the reference, forward and gradients
# --------------------------------------------------------------------------

_OPTIONS = {
    "plain": {},
    "causal_lengths": dict(is_causal=True, query_seq_lengths=jnp.array([21, 9], jnp.int32),
                           key_value_seq_lengths=jnp.array([0, 30], jnp.int32)),
    "window_soft_cap": dict(local_window_size=(6, 2), logits_soft_cap=3.0),
    "dropout_bias": dict(dropout_rate=0.2, dropout_rng=jax.random.key(1),
                         bias=jnp.asarray(np.random.default_rng(5).standard_normal((1, N, T, S)),
                                          jnp.float32)),
}


@pytest.mark.parametrize("option", [pytest.param("plain", marks=pytest.mark.slow), "causal_lengths",
                                    "window_soft_cap",
                                    pytest.param("dropout_bias", marks=pytest.mark.slow)])
def test_interpret_sinks(option):
    q, k, v, do, sinks = _inputs(3)
    _check("interpret", q, k, v, do, sinks, **_OPTIONS[option])


@pytest.mark.parametrize("option", [pytest.param("plain", marks=pytest.mark.slow), "causal_lengths"])
def test_triton_sinks(option):
    q, k, v, do, sinks = _inputs(4)
    _check("triton", q, k, v, do, sinks, **_OPTIONS[option])


def test_triton_sinks_bfloat16_sinks_dtype():
    q, k, v, do, sinks = _inputs(5, dtype=jnp.bfloat16)
    _check("triton", q, k, v, do, sinks.astype(jnp.bfloat16), dtype=jnp.bfloat16, is_causal=True)


# --------------------------------------------------------------------------
# A value head dim of its own; head dim 512
# --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [pytest.param("interpret", marks=pytest.mark.slow), "triton"])
def test_value_head_dim_differs(impl):
    """DeepSeek-V2's multi-head latent attention shapes, scaled down: q/k 48, v 32."""
    q, k, v, do, sinks = _inputs(6, h=48, hv=32)
    _check(impl, q, k, v, do, sinks, is_causal=True)
    out = ops.dot_product_attention(q, k, v, implementation=impl, block_sizes=BLOCKS)
    ref = ops.dot_product_attention(q, k, v, implementation="xla")
    assert out.shape == (B, T, N, 32)
    assert_close(out, ref, FORWARD[jnp.float32], "no sinks")


@pytest.mark.slow
def test_triton_head_dim_512_bfloat16():
    q, k, v, do, sinks = _inputs(7, t=17, s=24, n=2, k=1, h=512, dtype=jnp.bfloat16)
    _check("triton", q, k, v, do, sinks, dtype=jnp.bfloat16, is_causal=True)


@pytest.mark.parametrize("h,hv", [(512, 512), (192, 128)])
def test_large_head_dims_compile_for_sm90_without_spills(h, hv):
    """The heuristic's tiles at head dim 512 (32-row tiles on mma.sync, 8 warps) and
    at DeepSeek's 192 / 128 fit sm_90: no spills, shared memory within the limit."""
    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(ops.dot_product_attention(
            q, k, v, is_causal=True, implementation="triton").astype(jnp.float32))
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((1, 2048, 8, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 2048, 2, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 2048, 2, hv), jnp.bfloat16)]
    reports = pl.triton.compile(grads, *args, target="sm_90")
    assert len(reports) == 3
    for r in reports:
        row = kernel_row(r)
        assert row["spill_bytes"] == 0, (r["name"], row["spill_bytes"])
        assert row["shared_memory_bytes"] <= smem_limit("sm_90"), (r["name"], row)


# --------------------------------------------------------------------------
# Lowering for TPU and CUDA from this host
# --------------------------------------------------------------------------

@pytest.mark.parametrize("impl,platform,marker", [("mosaic_tpu", "tpu", "tpu_custom_call"),
                                                  ("pallas_triton", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_with_sinks_and_value_head_dim(impl, platform, marker):
    def loss(q, k, v, sinks):
        out = ops.dot_product_attention(q, k, v, sinks=sinks, is_causal=True, implementation=impl)
        return jnp.sum(out.astype(jnp.float32))

    args = [jax.ShapeDtypeStruct((2, 200, 4, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300, 2, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.float32)]
    text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 3  # forward, dQ, dK/dV


def test_pallas_triton_needs_power_of_two_head_dims():
    q, k, v, _, _ = _inputs(8, h=48, hv=32)
    with pytest.raises(NotImplementedError, match="power-of-two head dims"):
        ops.dot_product_attention(q, k, v, implementation="pallas_triton")
    out = ops.dot_product_attention(q, k, v, implementation=("pallas_triton", "xla"))
    assert out.shape == (B, T, N, 32)


# --------------------------------------------------------------------------
# Bad input, named before anything is traced
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kw,error,words", [
    (dict(sinks=jnp.zeros((N + 1,))), ValueError, "sinks must have shape"),
    (dict(sinks=jnp.zeros((1, N))), ValueError, "sinks must have shape"),
    (dict(sinks=jnp.zeros((N,), jnp.int32)), TypeError, "sinks"),
    (dict(sinks=[0.0] * N), TypeError, "sinks"),
])
def test_bad_sinks(kw, error, words):
    q, k, v, _, _ = _inputs(9)
    with pytest.raises(error, match=words):
        ops.dot_product_attention(q, k, v, **kw)


def test_value_must_match_key_but_for_its_head_dim():
    q, k, v, _, _ = _inputs(10, hv=16)
    with pytest.raises(ValueError, match=r"same shape up to their head dims"):
        ops.dot_product_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match=r"same shape up to their head dims"):
        ops.dot_product_attention(q, k, v[:, :, :1])
