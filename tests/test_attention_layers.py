"""layers.dot_product_attention, layers.MultiHeadAttention and the Linen attention twins.

Each drop-in runs against its stock Flax module holding the same state:
outputs and gradients (kernels through the interpreter, one case through the
Triton interpreter), masks, grouped-query heads, the decode cache, bf16,
dropout, the fallbacks to Flax's own attention, and the Flax modules with
``layers.dot_product_attention`` as their ``attention_fn``. Interpreter
compiles dominate the run time, so shapes are few, small and shared.

Masks never leave a query row without keys where outputs are compared with
Flax (Flax returns the mean of the values there, ours 0: tested on its own).
"""
from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import layers
import layers.attention
import layers.linen
from layers.attention import AttentionFallbackWarning
from tests.tolerances import BACKWARD, FORWARD, assert_close

B, T, F = 2, 9, 32          # batch, sequence, features
HEADS, QKV = 4, 64          # head dim 16
VALID = (9, 6)              # valid keys per batch element (padding mask)
KW = dict(num_heads=HEADS, in_features=F, qkv_features=QKV)
BIAS_INIT = jax.nn.initializers.normal(0.5)  # non-zero projection biases


@pytest.fixture(autouse=True)
def _highest_precision_and_fresh_warnings(monkeypatch):
    """Stock Flax multiplies at full float32 precision too (GPU default is TF32);
    each test sees every fallback warning afresh."""
    monkeypatch.setattr(layers.attention, "_WARNED", set())
    with jax.default_matmul_precision("float32"):
        yield


def _x(seed, shape=(B, T, F), dtype=jnp.float32):
    """Standard normal inputs (numpy's generator: eager jax.random compiles per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _key_padding_mask(lengths=VALID, t=T):
    """[B, 1, T, S]: query rows all valid, keys at or past each length masked (no empty rows)."""
    keys = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    return jnp.asarray(np.broadcast_to(keys[:, None, None, :], (len(lengths), 1, t, t)))


def _nnx_pair(implementation="interpret", **kw):
    kw = {**KW, "bias_init": BIAS_INIT, "decode": False, **kw}
    stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = layers.MultiHeadAttention(**kw, implementation=implementation, rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(stock))  # ours starts from other values: the state is loaded
    return stock, ours


def _nnx_out_and_grads(module, x, ct, **call_kw):
    """Output and gradients w.r.t. (params, x) of sum(module(x) * ct), under one jit."""
    graphdef, state = nnx.split(module)

    def loss(state, x):
        out = nnx.merge(graphdef, state)(x, **call_kw)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
    return out, grads


def _call(module, *args, **kwargs):
    """``module(*args, **kwargs)`` under nnx.jit (eager interpreter kernels are slow)."""
    return nnx.jit(lambda m, *a: m(*a, **kwargs))(module, *args)


def _init(module, seed, x):
    """Linen variables of ``module`` for input ``x``, initialised under jit (eager is slow)."""
    return jax.jit(module.init)(jax.random.key(seed), x)


def _assert_tree_close(a, b, tol, what):
    """Leaf by leaf, errors relative to the largest magnitude in the whole reference tree.

    One loss's gradients share a scale; per-leaf normalisation would judge
    leaves that vanish in exact arithmetic (the key projection's bias: softmax
    ignores a per-row constant) by their rounding noise alone.
    """
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb], what
    scale = max(float(np.max(np.abs(np.asarray(v, np.float64)))) for _, v in lb)
    for (path, u), (_, v) in zip(la, lb):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert u.shape == v.shape and np.all(np.isfinite(u)), (what, path)
        err = float(np.max(np.abs(u - v))) / scale
        assert err <= tol, f"{what} {jax.tree_util.keystr(path)}: error {err:.3g} > {tol:.3g}"


def _flat_state(module):
    return list(nnx.to_flat_state(nnx.state(module)))


# --------------------------------------------------------------------------
# NNX: layers.MultiHeadAttention
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=2, normalize_qk=True, out_features=24,
                                             use_bias=False, dropout_rate=0.1,
                                             kernel_metadata={"tag": "k"})])
def test_nnx_state_and_attributes_identical(kw):
    stock = nnx.MultiHeadAttention(**KW, **kw, rngs=nnx.Rngs(3))
    ours = layers.MultiHeadAttention(**KW, **kw, rngs=nnx.Rngs(3))
    fs, fo = _flat_state(stock), _flat_state(ours)
    assert [p for p, _ in fs] == [p for p, _ in fo]
    for (path, a), (_, b) in zip(fs, fo):
        assert type(a) is type(b) and a.get_metadata() == b.get_metadata(), path
        va, vb = a[...], b[...]
        if jnp.issubdtype(va.dtype, jax.dtypes.prng_key):  # the kept dropout rng stream
            va, vb = jax.random.key_data(va), jax.random.key_data(vb)
        np.testing.assert_array_equal(np.asarray(va), np.asarray(vb), err_msg=str(path))
    for attr in ("num_heads", "num_kv_heads", "head_dim", "in_features", "qkv_features",
                 "out_features", "in_kv_features", "dtype", "param_dtype", "broadcast_dropout",
                 "dropout_rate", "deterministic", "precision", "use_bias", "decode",
                 "normalize_qk"):
        assert getattr(ours, attr) == getattr(stock, attr), attr
    assert ours.implementation is None
    assert ours.attention_fn == layers.attention._BoundAttention(None)


@pytest.mark.parametrize("case", ["key_padding", "gqa_causal"])
def test_nnx_matches_stock_outputs_and_grads(case):
    if case == "key_padding":
        kw, call = {}, dict(mask=_key_padding_mask())
    else:  # grouped-query heads, is_causal on top of a padding mask, q/k LayerNorm
        kw, call = dict(num_kv_heads=2, normalize_qk=True), dict(mask=_key_padding_mask(),
                                                                  is_causal=True)
    stock, ours = _nnx_pair(**kw)
    x, ct = _x(10), _x(11, (B, T, F))
    out_s, g_s = _nnx_out_and_grads(stock, x, ct, **call)
    out_o, g_o = _nnx_out_and_grads(ours, x, ct, **call)
    assert out_o.shape == (B, T, F) and out_o.dtype == jnp.float32
    assert_close(out_o, out_s, FORWARD[jnp.float32], "output")
    _assert_tree_close(g_o, g_s, BACKWARD[jnp.float32], "grad")


def test_nnx_cross_attention_and_batch_dims():
    """inputs_k/inputs_v of another length, and two batch dims (flattened and restored)."""
    stock, ours = _nnx_pair("xla")
    q, kv = _x(12, (2, 3, 5, F)), _x(13, (2, 3, T, F))
    mask = jnp.broadcast_to(_key_padding_mask((9, 4, 7), T)[:, :, :5][None], (2, 3, 1, 5, T))
    out = _call(ours, q, kv, mask=mask)
    assert out.shape == (2, 3, 5, F)
    assert_close(out, _call(stock, q, kv, mask=mask), FORWARD[jnp.float32], "output")


def test_nnx_triton():
    stock, ours = _nnx_pair("triton", num_heads=2, qkv_features=32)
    x, ct = _x(14, (1, 5, F)), _x(15, (1, 5, F))
    out_s, g_s = _nnx_out_and_grads(stock, x, ct, is_causal=True)
    out_o, g_o = _nnx_out_and_grads(ours, x, ct, is_causal=True)
    assert_close(out_o, out_s, FORWARD[jnp.float32], "output")
    _assert_tree_close(g_o, g_s, BACKWARD[jnp.float32], "grad")


def test_nnx_decode_matches_stock():
    """init_cache, then one token at a time: the cache and every step as the stock layer's."""
    stock, ours = _nnx_pair(num_kv_heads=2)
    xs = _x(16, (B, 6, F))
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = {}
    for name, module in (("stock", stock), ("ours", ours)):
        module.init_cache(xs.shape)
        outs[name] = jnp.concatenate([step(module, xs[:, i:i + 1]) for i in range(xs.shape[1])],
                                     axis=1)
    assert_close(outs["ours"], outs["stock"], FORWARD[jnp.float32], "decoded")
    assert int(ours.cache_index[...]) == xs.shape[1]
    assert_close(ours.cached_key[...], stock.cached_key[...], FORWARD[jnp.float32], "cached key")
    assert ours.cached_key[...].shape == (B, 6, 2, QKV // HEADS)
    # Decoding token by token is causal attention over the whole sequence.
    assert_close(outs["ours"], _call(stock, xs, is_causal=True, decode=False), FORWARD[jnp.float32],
                 "decoded vs causal")


def test_nnx_load_state_from_stock():
    stock = nnx.MultiHeadAttention(**KW, bias_init=BIAS_INIT, decode=False, rngs=nnx.Rngs(5))
    ours = layers.MultiHeadAttention(**KW, decode=False, rngs=nnx.Rngs(6))
    x = _x(17)
    ref = _call(stock, x)
    assert not np.allclose(_call(ours, x), ref)
    nnx.update(ours, nnx.state(stock))
    assert_close(_call(ours, x), ref, FORWARD[jnp.float32], "after update")
    graphdef, _ = nnx.split(layers.MultiHeadAttention(**KW, decode=False, implementation="xla",
                                                      rngs=nnx.Rngs(7)))
    merged = nnx.merge(graphdef, nnx.state(stock))
    assert isinstance(merged, layers.MultiHeadAttention) and merged.implementation == "xla"
    assert_close(_call(merged, x), ref, FORWARD[jnp.float32], "merged")


def test_nnx_bf16():
    """bf16 compute (float32 params): within bf16 tolerance of the float32 stock layer."""
    kw = dict(dtype=jnp.bfloat16)
    stock, ours = _nnx_pair(**kw)
    stock32 = nnx.MultiHeadAttention(**KW, decode=False, rngs=nnx.Rngs(0))
    nnx.update(stock32, nnx.state(stock))
    x, mask = _x(18), _key_padding_mask()
    out = _call(ours, x.astype(jnp.bfloat16), mask=mask)
    ref16 = _call(stock, x.astype(jnp.bfloat16), mask=mask)
    assert out.dtype == ref16.dtype == jnp.bfloat16
    assert_close(out, _call(stock32, x, mask=mask), FORWARD[jnp.bfloat16], "vs float32")
    assert_close(out, ref16, FORWARD[jnp.bfloat16], "vs stock bf16")


def test_nnx_dropout():
    """Dropout (on "xla", Flax's own): differs from the deterministic output, reproducible
    for one key; deterministic=True matches the stock layer (which needs no rng then)."""
    stock, ours = _nnx_pair("xla", dropout_rate=0.5)
    x = _x(19)
    plain = _call(ours, x, deterministic=True)
    assert_close(plain, _call(stock, x, deterministic=True), FORWARD[jnp.float32], "deterministic")
    dropped = nnx.jit(lambda m, x, rngs: m(x, deterministic=False, rngs=rngs))
    d1, d2, d3 = (dropped(ours, x, nnx.Rngs(dropout=seed)) for seed in (42, 42, 43))
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))
    assert not np.allclose(d1, plain, atol=1e-3) and not np.allclose(d1, d3, atol=1e-3)
    # The stored rng stream (keep_rngs=True) advances: two calls drop differently.
    own = nnx.jit(lambda m, x: m(x, deterministic=False))
    assert not np.allclose(own(ours, x), own(ours, x), atol=1e-3)


def test_nnx_sow_weights_falls_back_once():
    stock, ours = _nnx_pair()
    x, mask = _x(20), _key_padding_mask()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ours(x, mask=mask, sow_weights=True)
        out2 = ours(x, mask=mask, sow_weights=True)
    fallbacks = [w for w in caught if issubclass(w.category, AttentionFallbackWarning)]
    assert len(fallbacks) == 1 and "probabilities" in str(fallbacks[0].message)
    ref = stock(x, mask=mask, sow_weights=True)
    assert_close(out, ref, FORWARD[jnp.float32], "output")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    w_ours = nnx.state(ours, nnx.Intermediate)["attention_weights"].get_value()
    w_stock = nnx.state(stock, nnx.Intermediate)["attention_weights"].get_value()
    assert len(w_ours) == 2 and len(w_stock) == 1  # sown by each call
    assert_close(w_ours[0], w_stock[0], FORWARD[jnp.float32], "sown weights")


@pytest.mark.parametrize("bad", ["cuda", "XLA", "", 1])
def test_bad_implementation_raises_at_construction(bad):
    with pytest.raises(ValueError, match="implementation"):
        layers.MultiHeadAttention(**KW, implementation=bad, rngs=nnx.Rngs(0))
    for cls in (layers.linen.MultiHeadDotProductAttention, layers.linen.SelfAttention,
                layers.linen.MultiHeadAttention):
        with pytest.raises(ValueError, match="implementation"):
            cls(num_heads=HEADS, implementation=bad)


def test_implementation_sequence_falls_back_to_stock_attention():
    """A sequence reaches the bound attention_fn as a tuple; an entry without a kernel falls
    back to the next, here "xla" (stock Flax attention, bit for bit)."""
    stock, ours = _nnx_pair(implementation=["mosaic_gpu", "xla"])
    assert ours.implementation == ("mosaic_gpu", "xla")
    assert ours.attention_fn == layers.attention._BoundAttention(("mosaic_gpu", "xla"))
    x = _x(22)
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(stock(x)))
    module = layers.linen.SelfAttention(num_heads=HEADS, implementation=["mosaic_gpu", "xla"])
    assert module.implementation == ("mosaic_gpu", "xla") and hash(module.attention_fn)
    with pytest.raises(ValueError, match="implementation"):
        layers.linen.SelfAttention(num_heads=HEADS, implementation=("xla", "cuda"))


def test_nnx_explicit_attention_fn_kept():
    seen = []

    def attention_fn(*args, **kwargs):
        seen.append(kwargs["is_causal"])
        return nnx.dot_product_attention(*args, **kwargs)

    stock, _ = _nnx_pair()
    ours = layers.MultiHeadAttention(**KW, decode=False, attention_fn=attention_fn,
                                     rngs=nnx.Rngs(0))
    nnx.update(ours, nnx.state(stock))
    x = _x(21)
    assert_close(ours(x, is_causal=True), stock(x, is_causal=True), FORWARD[jnp.float32], "out")
    assert seen == [True]


# --------------------------------------------------------------------------
# layers.dot_product_attention as the attention_fn of the stock modules, and directly
# --------------------------------------------------------------------------

def test_function_as_attention_fn_of_stock_nnx():
    stock, _ = _nnx_pair()
    hooked = nnx.MultiHeadAttention(**KW, decode=False, rngs=nnx.Rngs(0),
                                    attention_fn=functools.partial(layers.dot_product_attention,
                                                                   implementation="interpret"))
    nnx.update(hooked, nnx.state(stock))
    x, mask = _x(22), _key_padding_mask()
    assert_close(_call(hooked, x, mask=mask), _call(stock, x, mask=mask), FORWARD[jnp.float32],
                 "output")


def test_function_as_attention_fn_of_stock_linen():
    x, mask = _x(23), _key_padding_mask()
    stock = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV)
    hooked = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV,
                                             attention_fn=layers.dot_product_attention)
    variables = _init(stock, 24, x)
    run = lambda m: jax.jit(functools.partial(m.apply, mask=mask))(variables, x)
    assert_close(run(hooked), run(stock), FORWARD[jnp.float32], "output")


def test_fully_masked_rows_are_zero():
    """Documented difference: a query that sees no key gets 0 (Flax: the mean of the values)."""
    q, k, v = (_x(s, (B, 5, 2, 16)) for s in (25, 26, 27))
    mask = np.ones((B, 1, 5, 5), bool)
    mask[1, :, 3, :] = False  # batch 1, query 3: no keys
    ours = jax.jit(functools.partial(layers.dot_product_attention, implementation="interpret"))(
        q, k, v, mask=mask)
    ref = jax.jit(nnx.dot_product_attention)(q, k, v, mask=mask)
    ours, ref, v = np.asarray(ours), np.asarray(ref), np.asarray(v)
    np.testing.assert_array_equal(ours[1, 3], 0.0)
    assert_close(ref[1, 3], np.broadcast_to(v[1].mean(0), (2, 16)), FORWARD[jnp.float32], "flax")
    keep = np.ones((B, 5), bool)
    keep[1, 3] = False
    assert_close(ours[keep], ref[keep], FORWARD[jnp.float32], "other rows")


def test_function_float_mask_bias_and_batch_dims():
    """Linen-style float masks, a bias broadcast over an inner batch dim, two batch dims.

    (Linen's function is the reference: nnx's flattens a bias with fewer batch
    dims than the query into the wrong shape.)
    """
    q, k, v = (_x(s, (2, 3, 5, 2, 16)) for s in (28, 29, 30))
    mask = np.ones((2, 1, 1, 5, 5), np.float32)
    mask[1, ..., 4] = 0.0
    bias = _x(31, (3, 2, 5, 5))
    out = jax.jit(layers.dot_product_attention)(q, k, v, bias, mask)
    assert out.shape == q.shape
    assert_close(out, jax.jit(nn.dot_product_attention)(q, k, v, bias, mask),
                 FORWARD[jnp.float32], "out")


def test_function_dropout_needs_rng():
    q = _x(32, (B, 5, 2, 16))
    with pytest.raises(ValueError, match="dropout_rng"):
        layers.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=False)


@pytest.mark.parametrize("precision", [lax.Precision.HIGH, ("tensorfloat32", "highest")])
def test_function_precision_falls_back(precision):
    q, k, v = (_x(s, (B, 5, 2, 16)) for s in (33, 34, 35))
    with pytest.warns(AttentionFallbackWarning, match="precision"):
        out = layers.dot_product_attention(q, k, v, precision=precision)
    assert_close(out, nnx.dot_product_attention(q, k, v, precision=precision),
                 FORWARD[jnp.float32], "out")


# --------------------------------------------------------------------------
# Linen
# --------------------------------------------------------------------------

def test_linen_init_identical():
    x = _x(40)
    kw = dict(num_heads=HEADS, qkv_features=QKV, out_features=24, normalize_qk=True,
              bias_init=BIAS_INIT)
    ours = layers.linen.MultiHeadDotProductAttention(**kw).init(jax.random.key(41), x)
    theirs = nn.MultiHeadDotProductAttention(**kw).init(jax.random.key(41), x)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    module = layers.linen.MultiHeadDotProductAttention(**kw, implementation="interpret")
    assert module.attention_fn == layers.attention._BoundAttention("interpret")
    assert module.clone(implementation="xla").attention_fn == layers.attention._BoundAttention("xla")


def test_linen_inside_a_parent_keeps_names():
    class Block(nn.Module):
        cls: type

        @nn.compact
        def __call__(self, x):
            return self.cls(num_heads=HEADS, qkv_features=QKV)(x)

    x = _x(42)
    ours = Block(layers.linen.MultiHeadDotProductAttention).init(jax.random.key(43), x)
    theirs = Block(nn.MultiHeadDotProductAttention).init(jax.random.key(43), x)
    assert list(ours["params"]) == list(theirs["params"]) == ["MultiHeadDotProductAttention_0"]


def test_linen_matches_stock_outputs_and_grads():
    x, ct, mask = _x(44), _x(45), _key_padding_mask()
    stock = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV, bias_init=BIAS_INIT)
    ours = layers.linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV,
                                                     implementation="interpret")
    variables = _init(stock, 46, x)

    def run(module):
        def loss(v, x):
            out = module.apply(v, x, mask=mask)
            return jnp.sum(out * ct), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(variables, x)
        return out, grads

    (out_s, g_s), (out_o, g_o) = run(stock), run(ours)
    assert_close(out_o, out_s, FORWARD[jnp.float32], "output")
    _assert_tree_close(g_o, g_s, BACKWARD[jnp.float32], "grad")


def test_linen_self_attention():
    x, mask = _x(47), _key_padding_mask()
    variables = _init(nn.SelfAttention(num_heads=HEADS), 48, x)
    ref = jax.jit(nn.SelfAttention(num_heads=HEADS).apply)(variables, x, mask)
    out = jax.jit(layers.linen.SelfAttention(num_heads=HEADS, implementation="interpret").apply)(
        variables, x, mask)
    assert_close(out, ref, FORWARD[jnp.float32], "output")


def test_linen_decode_matches_stock():
    xs = _x(49, (B, 6, F))
    kw = dict(num_heads=HEADS, qkv_features=QKV, decode=True)
    stock = nn.MultiHeadDotProductAttention(**kw)
    ours = layers.linen.MultiHeadDotProductAttention(**kw, implementation="interpret")
    variables = _init(stock, 50, xs)
    outs = {}
    for name, module in (("stock", stock), ("ours", ours)):
        step = jax.jit(lambda v, x, m=module: m.apply(v, x, mutable=["cache"]))
        cache, steps = variables["cache"], []
        for i in range(xs.shape[1]):
            out, mutated = step({"params": variables["params"], "cache": cache}, xs[:, i:i + 1])
            cache = mutated["cache"]
            steps.append(out)
        outs[name] = jnp.concatenate(steps, axis=1)
        assert int(cache["cache_index"]) == xs.shape[1]
    assert_close(outs["ours"], outs["stock"], FORWARD[jnp.float32], "decoded")


def test_linen_sow_weights_falls_back_once():
    x = _x(51)
    stock = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = layers.linen.MultiHeadDotProductAttention(num_heads=HEADS, implementation="interpret")
    variables = _init(stock, 52, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, state = ours.apply(variables, x, sow_weights=True, mutable=["intermediates"])
        ours.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    assert len([w for w in caught if issubclass(w.category, AttentionFallbackWarning)]) == 1
    ref, ref_state = stock.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    assert_close(out, ref, FORWARD[jnp.float32], "output")
    _assert_tree_close(state, ref_state, FORWARD[jnp.float32], "sown weights")


def test_linen_bf16_force_fp32_softmax():
    """bf16 compute; force_fp32_for_softmax gives Linen's float32 attention output."""
    x = _x(53)
    kw = dict(num_heads=HEADS, dtype=jnp.bfloat16, force_fp32_for_softmax=True)
    variables = _init(nn.MultiHeadDotProductAttention(**kw), 54, x)
    hooked = nn.MultiHeadDotProductAttention(**kw, attention_fn=layers.dot_product_attention)
    out = jax.jit(hooked.apply)(variables, x)
    ref = jax.jit(nn.MultiHeadDotProductAttention(**kw).apply)(variables, x)
    ref32 = jax.jit(nn.MultiHeadDotProductAttention(num_heads=HEADS).apply)(variables, x)
    assert out.dtype == ref.dtype == jnp.bfloat16  # the output projection's dtype
    attn = jax.jit(functools.partial(layers.dot_product_attention, force_fp32_for_softmax=True))(
        *(x.astype(jnp.bfloat16)[..., None, :16],) * 3)
    assert attn.dtype == jnp.float32  # as Linen's attention returns it
    assert_close(out, ref32, FORWARD[jnp.bfloat16], "vs float32")
    assert_close(out, ref, FORWARD[jnp.bfloat16], "vs stock bf16")


# --------------------------------------------------------------------------
# implementation="xla" (the CPU default) is stock Flax, bit for bit
# --------------------------------------------------------------------------

def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(u.dtype, jax.dtypes.prng_key):  # the dropout rng streams
            u, v = jax.random.key_data(u), jax.random.key_data(v)
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("case", ["mask_causal_gqa", "dropout", "fully_masked_row"])
def test_nnx_xla_is_stock_bit_for_bit(case):
    kw = {**KW, "bias_init": BIAS_INIT, "decode": False}
    call = dict(mask=_key_padding_mask())
    if case == "mask_causal_gqa":
        kw.update(num_kv_heads=2, normalize_qk=True)
        call.update(is_causal=True)
    elif case == "dropout":  # Flax's own dropout bits, from the same rng stream
        kw.update(dropout_rate=0.3)
        call.update(deterministic=False)
    else:  # a query that sees no key: Flax's mean of the values, not the kernels' 0
        call["mask"] = call["mask"].at[1, :, 2, :].set(False)
    stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(3))
    ours = layers.MultiHeadAttention(**kw, implementation="xla", rngs=nnx.Rngs(3))
    _assert_trees_equal(nnx.state(ours), nnx.state(stock))
    x, ct = _x(60), _x(61)

    @nnx.jit
    def out_and_grads(module, x):  # gradients w.r.t. the params (nnx also advances the rngs)
        def loss(module, x):
            out = module(x, **call)
            return jnp.sum(out * ct), out
        (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(module, x)
        return out, grads

    _assert_trees_equal(out_and_grads(ours, x), out_and_grads(stock, x))


def test_nnx_xla_sow_weights_is_stock_without_a_warning():
    stock, ours = _nnx_pair("xla")
    x = _x(62)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionFallbackWarning)
        out = ours(x, sow_weights=True)
    _assert_trees_equal(out, stock(x, sow_weights=True))
    _assert_trees_equal(nnx.state(ours, nnx.Intermediate), nnx.state(stock, nnx.Intermediate))


@pytest.mark.parametrize("cls", ["MultiHeadDotProductAttention", "MultiHeadAttention"])
def test_linen_xla_is_stock_bit_for_bit(cls):
    """Outputs, gradients and variables (dropout included) of the Linen twins equal the
    stock module's exactly."""
    x, ct, mask = _x(63), _x(64), _key_padding_mask()
    kw = dict(num_heads=HEADS, qkv_features=QKV, bias_init=BIAS_INIT, dropout_rate=0.2,
              deterministic=False)
    stock, ours = getattr(nn, cls)(**kw), getattr(layers.linen, cls)(**kw, implementation="xla")
    variables = _init(stock, 65, x)
    _assert_trees_equal(_init(ours, 65, x), variables)

    def run(module):
        def loss(v, x):
            out = module.apply(v, x, mask=mask, rngs={"dropout": jax.random.key(66)})
            return jnp.sum(out * ct), out
        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(variables, x)

    _assert_trees_equal(run(ours), run(stock))


def test_linen_attention_alias_equivalence():
    """Flax's own alias test, on our twins: MultiHeadAttention and
    MultiHeadDotProductAttention give identical outputs and variables (and so does
    the stock alias)."""
    query, inputs_kv = _x(67, (3, 5)), _x(68, (3, 5))
    kw = dict(num_heads=1, qkv_features=4, kernel_init=nn.initializers.ones,
              bias_init=nn.initializers.zeros, deterministic=False, implementation="xla")
    results = []
    for module in (layers.linen.MultiHeadAttention(**kw),
                   layers.linen.MultiHeadDotProductAttention(**kw)):
        variables = module.init(jax.random.key(69), query, inputs_kv)
        results.append((module.apply(variables, query, inputs_kv), variables))
    kw.pop("implementation")
    stock = nn.MultiHeadAttention(**kw)
    variables = stock.init(jax.random.key(69), query, inputs_kv)
    results.append((stock.apply(variables, query, inputs_kv), variables))
    _assert_trees_equal(results[0], results[1])
    _assert_trees_equal(results[0], results[2])


def test_linen_attention_alias_submodule():
    """Flax's alias-submodule test on our twins: the alias keeps its own auto-name
    and the same variables under a parent, as the stock alias does."""
    def parent(cls):
        class Parent(nn.Module):
            @nn.compact
            def __call__(self, x):
                return cls(num_heads=1, qkv_features=4, implementation="xla")(x) \
                    if cls.__module__.startswith("layers") else cls(num_heads=1, qkv_features=4)(x)
        return Parent()

    x = _x(70, (3, 5))
    ours = parent(layers.linen.MultiHeadAttention)
    theirs = parent(nn.MultiHeadAttention)
    v_ours, v_theirs = ours.init(jax.random.key(71), x), theirs.init(jax.random.key(71), x)
    assert list(v_ours["params"]) == list(v_theirs["params"]) == ["MultiHeadAttention_0"]
    _assert_trees_equal((ours.apply(v_ours, x), v_ours), (theirs.apply(v_theirs, x), v_theirs))
