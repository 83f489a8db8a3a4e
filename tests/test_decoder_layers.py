"""layers.GatedMLP, layers.RotaryEmbedding, layers.MultiHeadAttention's decoder options and
their Linen twins, against float64 numpy references of the same math (transformers' formulas)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layers
import ops

B, T, D, N, K, H = 2, 10, 32, 4, 2, 8  # T and D divide no block size
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _x(seed, shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _silu(z):
    return z / (1 + np.exp(-z))


def _gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))


def _rope(x, positions, inv_freq, rotary_dim, scaling=1.0):
    """transformers' rotate_half form in float64: pairs (i, i + R/2) of the first R features."""
    x = np.asarray(x, np.float64)
    angles = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    cos = np.concatenate([np.cos(angles)] * 2, -1)[..., None, :] * scaling
    sin = np.concatenate([np.sin(angles)] * 2, -1)[..., None, :] * scaling
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
    return np.concatenate([rot * cos + rotated * sin, rest], -1)


# --------------------------------------------------------------------------
# GatedMLP
# --------------------------------------------------------------------------

@pytest.mark.parametrize("implementation,activation,act", [
    ("xla", "silu", _silu), ("interpret", "gelu", _gelu_tanh),
    pytest.param("interpret", "silu", _silu, marks=pytest.mark.slow),
    pytest.param("xla", "gelu", _gelu_tanh, marks=pytest.mark.slow)])
def test_gated_mlp_matches_reference(implementation, activation, act):
    mlp = layers.GatedMLP(D, 40, activation=activation, implementation=implementation,
                          rngs=nnx.Rngs(0))
    x = _x(1, (B, T, D))
    g, u, d = (np.asarray(p.kernel[...], np.float64)
               for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    expected = (act(x @ g) * (x @ u)) @ d
    assert _rel(nnx.jit(lambda m, x: m(x))(mlp, jnp.asarray(x)), expected) < 2e-6
    # Gradients of every parameter and of x against jax.grad of the composition in jnp.
    graphdef, params = nnx.split(mlp, nnx.Param)
    w = jnp.asarray(_x(2, (B, T, D)))

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x) * w)

    def ref_loss(params, x):
        a = jax.nn.silu if activation == "silu" else jax.nn.gelu
        p = lambda name: params[name]["kernel"][...]  # noqa: E731
        hp = jax.lax.Precision.HIGHEST
        h = a(jnp.dot(x, p("gate_proj"), precision=hp)) * jnp.dot(x, p("up_proj"), precision=hp)
        return jnp.sum(jnp.dot(h, p("down_proj"), precision=hp) * w)

    got = jax.jit(jax.grad(loss, (0, 1)))(params, jnp.asarray(x))
    want = jax.jit(jax.grad(ref_loss, (0, 1)))(params, jnp.asarray(x))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(a, b) < 2e-5


def test_gated_mlp_parameters_map_from_transformers_names():
    mlp = layers.GatedMLP(D, 40, out_features=24, rngs=nnx.Rngs(0))
    shapes = jax.tree.map(lambda p: p.shape, nnx.state(mlp, nnx.Param).to_pure_dict())
    assert shapes == {"gate_proj": {"kernel": (D, 40)}, "up_proj": {"kernel": (D, 40)},
                      "down_proj": {"kernel": (40, 24)}}


def test_linen_gated_mlp_equals_nnx():
    x = jnp.asarray(_x(3, (B, T, D)))
    twin = layers.linen.GatedMLP(40, activation="gelu")
    variables = twin.init(jax.random.key(0), x)
    mlp = nnx.eval_shape(lambda: layers.GatedMLP(D, 40, activation="gelu", rngs=nnx.Rngs(0)))
    state = nnx.state(mlp, nnx.Param)
    nnx.replace_by_pure_dict(state, variables["params"])
    nnx.update(mlp, state)
    np.testing.assert_array_equal(np.asarray(twin.apply(variables, x)), np.asarray(mlp(x)))


def xla_primitives(jaxpr, out=None) -> set[str]:
    """The primitives of a jaxpr and its nested calls, outside kernels (pallas_call's
    body is not entered)."""
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        if "pallas" in eqn.primitive.name:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    xla_primitives(sub, out)
    return out


def test_gated_mlp_reads_the_projections_in_place():
    """gate_proj and up_proj reach ops.gated_linear_unit as a pair: no stacked copy of the
    weights in the forward, no concatenate or split of them in the backward (NNX and
    Linen; traced for pallas_triton, whose kernels stay pallas_call primitives)."""
    x = jnp.asarray(_x(5, (B, T, D)))
    mlp = nnx.eval_shape(lambda: layers.GatedMLP(D, 64, implementation="pallas_triton",
                                                 rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(mlp, nnx.Param)
    twin = layers.linen.GatedMLP(64, implementation="pallas_triton")
    variables = jax.eval_shape(twin.init, jax.random.key(0), x)
    for fn, arg in ((lambda p: jnp.sum(nnx.merge(graphdef, p)(x)), params),
                    (lambda v: jnp.sum(twin.apply(v, x)), variables)):
        prims = xla_primitives(jax.make_jaxpr(jax.grad(fn))(arg).jaxpr)
        assert "pallas_call" in prims, sorted(prims)
        assert not prims & {"stack", "unstack", "concatenate", "split", "slice", "dynamic_slice"}, \
            sorted(prims)


def test_gated_mlp_bf16_compute():
    mlp = layers.GatedMLP(D, 40, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y = mlp(jnp.asarray(_x(4, (B, T, D))))
    assert y.dtype == jnp.bfloat16 and y.shape == (B, T, D)


# --------------------------------------------------------------------------
# RotaryEmbedding
# --------------------------------------------------------------------------

@pytest.mark.parametrize("implementation,rotary_dim,scaling", [
    ("xla", H, LLAMA3), ("interpret", H // 2, None),
    pytest.param("interpret", H, LLAMA3, marks=pytest.mark.slow),
    pytest.param("xla", H // 2, None, marks=pytest.mark.slow)])
def test_rotary_embedding_matches_rotate_half(implementation, rotary_dim, scaling):
    rope = layers.RotaryEmbedding(rotary_dim, theta=500.0, scaling=scaling,
                                  implementation=implementation)
    x = _x(5, (B, T, N, H))
    positions = np.stack([np.arange(T), np.arange(T) + 40]).astype(np.int32)
    inv_freq, _ = ops.rope_frequencies(rotary_dim, theta=500.0, scaling=scaling)
    got = rope(jnp.asarray(x), jnp.asarray(positions))
    assert _rel(got, _rope(x, positions, inv_freq, rotary_dim)) < 2e-6
    twin = layers.linen.RotaryEmbedding(rotary_dim, theta=500.0, scaling=scaling,
                                        implementation=implementation)
    np.testing.assert_array_equal(np.asarray(twin.apply({}, jnp.asarray(x), positions)),
                                  np.asarray(got))


# --------------------------------------------------------------------------
# MultiHeadAttention's decoder options
# --------------------------------------------------------------------------

def _attention_reference(params, x, *, positions, inv_freq, eps, scale, window, cap):
    """Projections, per-head RMS norms, rope, GQA, causal window and soft cap in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    q = np.einsum("btd,dnh->btnh", x, p["query"]["kernel"])
    k = np.einsum("btd,dnh->btnh", x, p["key"]["kernel"])
    v = np.einsum("btd,dnh->btnh", x, p["value"]["kernel"])
    rms = lambda a, s: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps) * s  # noqa: E731
    q, k = rms(q, p["query_norm"]["scale"]), rms(k, p["key_norm"]["scale"])
    q, k = _rope(q, positions, inv_freq, H), _rope(k, positions, inv_freq, H)
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = cap * np.tanh(logits / cap)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    logits = np.where((j <= i) & (j >= i - window), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", probs, v)
    return np.einsum("btnh,nhd->btd", out, p["out"]["kernel"])


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_attention_decoder_options_match_reference(implementation):
    rope = layers.RotaryEmbedding(H, theta=1000.0, implementation=implementation)
    attn = layers.MultiHeadAttention(
        N, D, num_kv_heads=K, use_bias=False, decode=False, rotary=rope, qk_norm="rms_norm",
        qk_norm_epsilon=1e-5, scale=0.3, local_window_size=(3, 0), logits_soft_cap=2.0,
        implementation=implementation, rngs=nnx.Rngs(0))
    state = nnx.state(attn, nnx.Param)
    params = jax.tree.map(np.asarray, state.to_pure_dict())
    params["query_norm"]["scale"] = 1 + 0.1 * _x(6, (H,))
    params["key_norm"]["scale"] = 1 + 0.1 * _x(7, (H,))
    nnx.replace_by_pure_dict(state, params)
    nnx.update(attn, state)
    assert set(params) == {"query", "key", "value", "out", "query_norm", "key_norm"}
    x = 2 * _x(8, (B, T, D))
    positions = np.arange(T, dtype=np.int32) + 5
    got = nnx.jit(lambda m, x, p: m(x, positions=p, is_causal=True))(
        attn, jnp.asarray(x), jnp.asarray(positions))
    inv_freq, _ = ops.rope_frequencies(H, theta=1000.0)
    expected = _attention_reference(params, x, positions=positions, inv_freq=inv_freq, eps=1e-5,
                                    scale=0.3, window=3, cap=2.0)
    assert _rel(got, expected) < 5e-6


@pytest.mark.slow
def test_attention_decoder_gradients_interpret_vs_xla():
    """The decoder path's backward on the kernels equals jax.grad of the XLA references."""
    def make(impl):
        return layers.MultiHeadAttention(
            N, D, num_kv_heads=K, use_bias=False, decode=False,
            rotary=layers.RotaryEmbedding(H, implementation=impl), qk_norm="rms_norm",
            local_window_size=(4, 0), logits_soft_cap=3.0, implementation=impl, rngs=nnx.Rngs(1))
    x, w = jnp.asarray(_x(9, (B, T, D))), jnp.asarray(_x(10, (B, T, D)))
    grads = []
    for impl in ("xla", "interpret"):
        graphdef, params = nnx.split(make(impl), nnx.Param)
        loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x, is_causal=True) * w)  # noqa: E731
        grads.append(jax.jit(jax.grad(loss, (0, 1)))(params, x))
    for a, b in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0])):
        assert _rel(a, b) < 2e-5


def test_attention_without_options_is_the_drop_in():
    attn = layers.MultiHeadAttention(N, D, decode=False, rngs=nnx.Rngs(0))
    assert attn.decoder_options is None and attn.query_norm is None
    with pytest.raises(ValueError, match="positions"):
        attn(jnp.ones((B, T, D)), positions=jnp.arange(T))


# --------------------------------------------------------------------------
# Bad input: errors naming the argument, at construction
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(activation=None), ValueError, "activation"),
    (dict(activation="nope"), ValueError, "activation"),
    (dict(hidden_features=0), ValueError, "hidden_features"),
    (dict(out_features=-1), ValueError, "out_features"),
    (dict(implementation="cuda"), ValueError, "implementation"),
])
def test_gated_mlp_rejects(kwargs, error, match):
    args = {"in_features": D, "hidden_features": 40, **kwargs}
    with pytest.raises(error, match=match):
        layers.GatedMLP(**args, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rotary_dim=3), ValueError, "rotary_dim"),
    (dict(rotary_dim=0), ValueError, "rotary_dim"),
    (dict(theta=1.0), ValueError, "theta"),
    (dict(scaling="llama3"), TypeError, "scaling"),
    (dict(implementation="gpu"), ValueError, "implementation"),
])
def test_rotary_embedding_rejects(kwargs, error, match):
    args = {"rotary_dim": H, **kwargs}
    with pytest.raises(error, match=match):
        layers.RotaryEmbedding(**args)
    with pytest.raises(error, match=match):
        layers.linen.RotaryEmbedding(**args)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(qk_norm="layer_norm"), ValueError, "qk_norm"),
    (dict(qk_norm="rms_norm", qk_norm_epsilon=-1.0), ValueError, "qk_norm_epsilon"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(rotary="rope"), TypeError, "rotary"),
    (dict(local_window_size=4, attention_fn=nnx.dot_product_attention), ValueError,
     "attention_fn"),
])
def test_attention_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        layers.MultiHeadAttention(N, D, decode=False, rngs=nnx.Rngs(0), **kwargs)


def test_attention_decode_with_cache_equals_full_sequence():
    """Prompt then one token at a time through the dense cache (rotated keys, sliding
    window) gives the outputs of the whole sequence at once."""
    attn = layers.MultiHeadAttention(N, D, num_kv_heads=K, use_bias=False, decode=False,
                                     rotary=layers.RotaryEmbedding(H), local_window_size=(3, 0),
                                     logits_soft_cap=5.0, rngs=nnx.Rngs(0))
    x = jnp.asarray(_x(12, (B, T, D)))
    full = nnx.jit(lambda m, x: m(x, is_causal=True))(attn, x)
    with pytest.raises(ValueError, match="init_cache"):
        attn(x[:, :1], decode=True)
    attn.init_cache((B, T, D))
    step = nnx.jit(lambda m, x: m(x, decode=True))  # one compile per new-token count
    steps = [step(attn, x[:, :6])] + [step(attn, x[:, t:t + 1]) for t in range(6, T)]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full),
                               rtol=1e-5, atol=1e-5)


def test_linen_gated_mlp_rejects_at_construction():
    with pytest.raises(ValueError, match="activation"):
        layers.linen.GatedMLP(8, activation=None)
    with pytest.raises(ValueError, match="hidden_features"):
        layers.linen.GatedMLP(0)
    assert isinstance(layers.linen.GatedMLP(8), nn.Module)


def test_linen_attention_decoder_options_equal_nnx():
    kw = dict(use_bias=False, qk_norm="rms_norm", qk_norm_epsilon=1e-5, scale=0.3,
              local_window_size=(3, 0), logits_soft_cap=2.0)
    twin = layers.linen.MultiHeadDotProductAttention(
        num_heads=N, num_kv_heads=K, rotary=layers.linen.RotaryEmbedding(H, theta=1000.0), **kw)
    x = jnp.asarray(_x(11, (B, T, D)))
    variables = jax.jit(lambda x: twin.init(jax.random.key(0), x, is_causal=True))(x)
    attn = layers.MultiHeadAttention(N, D, num_kv_heads=K, decode=False,
                                     rotary=layers.RotaryEmbedding(H, theta=1000.0),
                                     rngs=nnx.Rngs(0), **kw)
    state = nnx.state(attn, nnx.Param)
    nnx.replace_by_pure_dict(state, variables["params"])  # the same tree, Linen's names
    nnx.update(attn, state)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda v, x: twin.apply(v, x, is_causal=True))(variables, x)),
        np.asarray(nnx.jit(lambda m, x: m(x, is_causal=True))(attn, x)))
    with pytest.raises(ValueError, match="num_kv_heads"):
        layers.linen.MultiHeadDotProductAttention(num_heads=N, num_kv_heads=3)
    with pytest.raises(ValueError, match="positions"):
        plain = layers.linen.MultiHeadDotProductAttention(num_heads=N)
        jax.eval_shape(lambda x: plain.init(jax.random.key(0), x, positions=jnp.arange(T)), x)
