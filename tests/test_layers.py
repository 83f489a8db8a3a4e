"""layers.Dense (NNX) and layers.linen.Dense: drop-in for nnx.Linear / nn.Dense."""
from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import layers
import layers.dense
import layers.linen

IN, OUT = 24, 40
SHAPE = (2, 5, IN)  # leading batch dims; no dim a multiple of a block size
F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _x(seed, shape=SHAPE, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _close(a, b, **tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _flat(module):
    return list(nnx.to_flat_state(nnx.state(module)))


def _assert_same_state(a, b):
    fa, fb = _flat(a), _flat(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, va), (_, vb) in zip(fa, fb):
        assert type(va) is type(vb), path
        assert va.get_metadata() == vb.get_metadata(), path
        assert va[...].shape == vb[...].shape, path
        assert va[...].dtype == vb[...].dtype, path
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(path))


@pytest.fixture
def count_fused(monkeypatch):
    """Counts calls of ops.fused_matmul made by both layers."""
    calls = []
    real = layers.dense.fused_matmul

    def spy(*args, **kwargs):
        calls.append(kwargs.get("implementation"))
        return real(*args, **kwargs)

    monkeypatch.setattr(layers.dense, "fused_matmul", spy)
    monkeypatch.setattr(layers.linen, "fused_matmul", spy)
    return calls


# --------------------------------------------------------------------------
# NNX
# --------------------------------------------------------------------------

@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_state_identical_to_linear(use_bias):
    bias_init = jax.nn.initializers.normal(0.5)  # non-zero so the bias values are checked too
    kw = dict(use_bias=use_bias, bias_init=bias_init, rngs=nnx.Rngs(0))
    dense = layers.Dense(IN, OUT, activation="relu", implementation="xla", **kw)
    linear = nnx.Linear(IN, OUT, **{**kw, "rngs": nnx.Rngs(0)})
    _assert_same_state(dense, linear)
    assert dense.kernel[...].shape == (IN, OUT)
    assert (dense.bias is None) == (not use_bias)


def test_nnx_defaults_and_metadata_identical():
    dense = layers.Dense(IN, OUT, rngs=nnx.Rngs(3))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(3))
    _assert_same_state(dense, linear)
    for attr in ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision",
                 "dot_general", "promote_dtype", "preferred_element_type"):
        assert getattr(dense, attr) == getattr(linear, attr), attr
    kw = dict(param_dtype=jnp.bfloat16, kernel_metadata={"tag": "k"},
              bias_metadata={"tag": "b"})
    _assert_same_state(layers.Dense(IN, OUT, rngs=nnx.Rngs(4), **kw),
                       nnx.Linear(IN, OUT, rngs=nnx.Rngs(4), **kw))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_matches_linear(use_bias, implementation, count_fused):
    kw = dict(use_bias=use_bias, bias_init=jax.nn.initializers.normal(1.0))
    dense = layers.Dense(IN, OUT, implementation=implementation, rngs=nnx.Rngs(1), **kw)
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(1), **kw)
    x = _x(10)
    y = dense(x)
    assert y.shape == (*SHAPE[:-1], OUT) and y.dtype == jnp.float32
    _close(y, linear(x), **F32_TOL)
    assert count_fused == [implementation]


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_nnx_gelu_activation(implementation):
    dense = layers.Dense(IN, OUT, activation="gelu", implementation=implementation,
                         bias_init=jax.nn.initializers.normal(1.0), rngs=nnx.Rngs(2))
    linear = nnx.Linear(IN, OUT, bias_init=jax.nn.initializers.normal(1.0), rngs=nnx.Rngs(2))
    x = _x(11)
    _close(dense(x), jax.nn.gelu(linear(x)), **F32_TOL)


@pytest.mark.parametrize("activation", ["relu", "silu", "tanh", "gelu_exact",
                                        lambda z: jnp.sin(z) * z])
def test_nnx_other_activations(activation):
    ref = {"relu": jax.nn.relu, "silu": jax.nn.silu, "tanh": jnp.tanh,
           "gelu_exact": lambda z: jax.nn.gelu(z, approximate=False)}
    dense = layers.Dense(IN, OUT, activation=activation, rngs=nnx.Rngs(2))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(2))
    x = _x(12)
    act = ref.get(activation, activation) if isinstance(activation, str) else activation
    _close(dense(x), act(linear(x)), **F32_TOL)


def test_nnx_load_state_from_linear():
    linear = nnx.Linear(IN, OUT, bias_init=jax.nn.initializers.normal(1.0), rngs=nnx.Rngs(5))
    dense = layers.Dense(IN, OUT, implementation="interpret", rngs=nnx.Rngs(6))
    x = _x(13)
    assert not np.allclose(dense(x), linear(x))
    nnx.update(dense, nnx.state(linear))
    _close(dense(x), linear(x), **F32_TOL)
    # The same through split / merge: Dense's graphdef with Linear's state.
    graphdef, _ = nnx.split(layers.Dense(IN, OUT, rngs=nnx.Rngs(7)))
    merged = nnx.merge(graphdef, nnx.state(linear))
    assert isinstance(merged, layers.Dense)
    _close(merged(x), linear(x), **F32_TOL)


@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_grads_match_linear(use_bias):
    kw = dict(use_bias=use_bias, bias_init=jax.nn.initializers.normal(1.0))
    dense = layers.Dense(IN, OUT, activation="gelu", implementation="interpret",
                         rngs=nnx.Rngs(8), **kw)
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(8), **kw)
    x, ct = _x(14), _x(15, (*SHAPE[:-1], OUT))

    def grads(module, post):
        graphdef, state = nnx.split(module)

        def loss(state, x):
            return jnp.sum(post(nnx.merge(graphdef, state)(x)) * ct)

        return jax.grad(loss, argnums=(0, 1))(state, x)

    (gs_d, gx_d), (gs_l, gx_l) = grads(dense, lambda y: y), grads(linear, jax.nn.gelu)
    _close(gx_d, gx_l, rtol=1e-4, atol=1e-4)
    fd, fl = list(nnx.to_flat_state(gs_d)), list(nnx.to_flat_state(gs_l))
    assert [p for p, _ in fd] == [p for p, _ in fl]
    for (path, a), (_, b) in zip(fd, fl):
        _close(a[...], b[...], rtol=1e-4, atol=1e-4)



def test_nnx_grad_transform():
    dense = layers.Dense(IN, OUT, activation="gelu", rngs=nnx.Rngs(8))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(8))
    x, ct = _x(14), _x(15, (*SHAPE[:-1], OUT))
    g_d = nnx.grad(lambda m: jnp.sum(m(x) * ct))(dense)
    g_l = nnx.grad(lambda m: jnp.sum(jax.nn.gelu(m(x)) * ct))(linear)
    for name in ("kernel", "bias"):
        _close(g_d[name][...], g_l[name][...], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_nnx_bf16_compute_f32_params(implementation):
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32,
              bias_init=jax.nn.initializers.normal(1.0))
    dense = layers.Dense(IN, OUT, activation="gelu", implementation=implementation,
                         rngs=nnx.Rngs(9), **kw)
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(9), **kw)
    _assert_same_state(dense, linear)
    assert dense.kernel[...].dtype == jnp.float32
    x = _x(16)  # float32 inputs are promoted to bf16 like nnx.Linear does
    y, ref = dense(x), linear(x)
    assert y.dtype == ref.dtype == jnp.bfloat16
    _close(y, jax.nn.gelu(ref.astype(jnp.float32)), **BF16_TOL)


def test_nnx_dtype_inferred_from_inputs():
    dense = layers.Dense(IN, OUT, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    linear = nnx.Linear(IN, OUT, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    for x in (_x(17, dtype=jnp.bfloat16), _x(17)):
        y, ref = dense(x), linear(x)
        assert y.dtype == ref.dtype
        _close(y, ref, **BF16_TOL)


def test_nnx_under_jit():
    dense = layers.Dense(IN, OUT, activation="silu", rngs=nnx.Rngs(0))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    x = _x(18)
    _close(nnx.jit(lambda m, x: m(x))(dense, x), jax.nn.silu(linear(x)), **F32_TOL)


def test_nnx_under_vmap():
    dense = layers.Dense(IN, OUT, activation="relu", implementation="xla", rngs=nnx.Rngs(0))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    x = _x(22)
    _close(jax.vmap(dense)(x), jax.nn.relu(linear(x)), **F32_TOL)


def test_nnx_fallback_unsupported_dtype(count_fused):
    # complex params: not a fused_matmul dtype, so nnx.Linear's computation runs.
    kw = dict(param_dtype=jnp.complex64)
    dense = layers.Dense(IN, OUT, activation="tanh", rngs=nnx.Rngs(0), **kw)
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0), **kw)
    x = _x(23)
    y, ref = dense(x), jnp.tanh(linear(x))
    assert y.dtype == ref.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not count_fused


@pytest.mark.parametrize("bad", ["gelu2", "", "RELU"])
def test_nnx_bad_activation(bad):
    with pytest.raises(ValueError, match="activation"):
        layers.Dense(IN, OUT, activation=bad, rngs=nnx.Rngs(0))


def test_nnx_activation_of_wrong_type():
    with pytest.raises(TypeError, match="activation"):
        layers.Dense(IN, OUT, activation=3, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bad", ["cuda", "XLA", "", 1])
def test_nnx_bad_implementation(bad):
    with pytest.raises(ValueError, match="implementation"):
        layers.Dense(IN, OUT, implementation=bad, rngs=nnx.Rngs(0))


def test_nnx_wrong_input_dim():
    dense = layers.Dense(IN, OUT, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError):
        dense(jnp.ones((3, IN + 1)))


def test_nnx_fallback_custom_dot_general(count_fused):
    seen = []

    def my_dot_general(*args, **kwargs):
        seen.append(1)
        return lax.dot_general(*args, **kwargs)

    dense = layers.Dense(IN, OUT, activation="gelu", dot_general=my_dot_general,
                         rngs=nnx.Rngs(0))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    x = _x(19)
    _close(dense(x), jax.nn.gelu(linear(x)), **F32_TOL)
    assert seen and not count_fused


@pytest.mark.parametrize("kw", [dict(precision=lax.Precision.DEFAULT),
                                dict(precision="high"),
                                dict(preferred_element_type=jnp.float32, dtype=jnp.bfloat16)])
def test_nnx_fallback_precision_and_element_type(kw, count_fused):
    dense = layers.Dense(IN, OUT, activation="relu", rngs=nnx.Rngs(0), **kw)
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0), **kw)
    x = _x(20)
    y, ref = dense(x), jax.nn.relu(linear(x))
    assert y.dtype == ref.dtype
    _close(y, ref, **F32_TOL)
    assert not count_fused


@pytest.mark.parametrize("precision", [lax.Precision.HIGHEST, "highest",
                                       (lax.Precision.HIGHEST, lax.Precision.HIGHEST)])
def test_nnx_highest_precision_is_fused(precision, count_fused):
    dense = layers.Dense(IN, OUT, precision=precision, rngs=nnx.Rngs(0))
    linear = nnx.Linear(IN, OUT, precision=precision, rngs=nnx.Rngs(0))
    x = _x(21)
    _close(dense(x), linear(x), **F32_TOL)
    assert count_fused == [None]


# --------------------------------------------------------------------------
# Linen
# --------------------------------------------------------------------------

@pytest.mark.parametrize("use_bias", [True, False])
def test_linen_init_identical(use_bias):
    x = _x(30)
    key = jax.random.key(31)
    ours = layers.linen.Dense(OUT, use_bias=use_bias, activation="gelu").init(key, x)
    theirs = nn.Dense(OUT, use_bias=use_bias).init(key, x)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ours["params"]["kernel"].shape == (IN, OUT)


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_linen_nn_dense_variables_load(use_bias, implementation, count_fused):
    x = _x(32)
    variables = nn.Dense(OUT, use_bias=use_bias,
                         bias_init=nn.initializers.normal(1.0)).init(jax.random.key(33), x)
    ref = nn.Dense(OUT, use_bias=use_bias).apply(variables, x)
    ours = layers.linen.Dense(OUT, use_bias=use_bias, implementation=implementation)
    y = ours.apply(variables, x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    _close(y, ref, **F32_TOL)
    assert count_fused == [implementation]


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_linen_activation(implementation):
    x = _x(34)
    variables = nn.Dense(OUT, bias_init=nn.initializers.normal(1.0)).init(jax.random.key(35), x)
    ref = jax.nn.gelu(nn.Dense(OUT).apply(variables, x))
    y = layers.linen.Dense(OUT, activation="gelu", implementation=implementation).apply(variables, x)
    _close(y, ref, **F32_TOL)


def test_linen_grads_interpret():
    x, ct = _x(36), _x(37, (*SHAPE[:-1], OUT))
    variables = nn.Dense(OUT, bias_init=nn.initializers.normal(1.0)).init(jax.random.key(38), x)
    ours = layers.linen.Dense(OUT, activation="silu", implementation="interpret")

    def loss(apply, v, x):
        return jnp.sum(apply(v, x) * ct)

    g_ours = jax.grad(loss, argnums=(1, 2))(ours.apply, variables, x)
    g_ref = jax.grad(loss, argnums=(1, 2))(
        lambda v, x: jax.nn.silu(nn.Dense(OUT).apply(v, x)), variables, x)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        _close(a, b, rtol=1e-4, atol=1e-4)


def test_linen_bf16():
    x = _x(39)
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    variables = nn.Dense(OUT, **kw).init(jax.random.key(40), x)
    ref = nn.Dense(OUT, **kw).apply(variables, x)
    y = layers.linen.Dense(OUT, implementation="interpret", **kw).apply(variables, x)
    assert y.dtype == ref.dtype == jnp.bfloat16
    _close(y, ref, **BF16_TOL)


def test_linen_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        layers.linen.Dense(OUT, activation="nope")
    with pytest.raises(ValueError, match="implementation"):
        layers.linen.Dense(OUT, implementation="cuda")


def test_linen_fallback_custom_dot_general(count_fused):
    seen = []

    def my_dot_general(*args, **kwargs):
        seen.append(1)
        return lax.dot_general(*args, **kwargs)

    x = _x(41)
    variables = nn.Dense(OUT).init(jax.random.key(42), x)
    y = layers.linen.Dense(OUT, activation="tanh", dot_general=my_dot_general).apply(variables, x)
    _close(y, jnp.tanh(nn.Dense(OUT).apply(variables, x)), **F32_TOL)
    assert seen and not count_fused


# --------------------------------------------------------------------------
# Output dtypes: the stock layer's for every combination
# --------------------------------------------------------------------------

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dtypes_match_flax_for_every_combination(x_dtype, count_fused):
    """NNX and Linen, every (dtype, param_dtype, promote_dtype): the stock layer's output
    dtype and values. A promote_dtype that keeps the operands' own dtypes (mixed
    precision) leaves them mixed, which the fused kernel does not take: then the stock
    computation runs, whose dtype lax.dot_general picks."""
    x = _x(50, dtype=x_dtype)
    expected_fused = 0
    for dtype, param_dtype, keep in itertools.product([None, *DTYPES], [jnp.float32, jnp.bfloat16],
                                                      [False, True]):
        kw = dict(dtype=dtype, param_dtype=param_dtype, bias_init=nn.initializers.normal(1.0))
        what = f"x {jnp.dtype(x_dtype).name}, {kw}, keep dtypes: {keep}"
        nnx_kw = dict(kw, promote_dtype=lambda args, **_: args) if keep else kw
        y = layers.Dense(IN, OUT, implementation="xla", rngs=nnx.Rngs(0), **nnx_kw)(x)
        ref = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0), **nnx_kw)(x)
        assert y.dtype == ref.dtype, what
        _close(y, ref, **(F32_TOL if ref.dtype == jnp.float32 else BF16_TOL))
        linen_kw = dict(kw, promote_dtype=lambda *args, **_: list(args)) if keep else kw
        variables = nn.Dense(OUT, **linen_kw).init(jax.random.key(51), x)
        y = layers.linen.Dense(OUT, implementation="xla", **linen_kw).apply(variables, x)
        ref = nn.Dense(OUT, **linen_kw).apply(variables, x)
        assert y.dtype == ref.dtype, what
        _close(y, ref, **(F32_TOL if ref.dtype == jnp.float32 else BF16_TOL))
        expected_fused += 2 if not keep or jnp.dtype(x_dtype) == jnp.dtype(param_dtype) else 0
    assert count_fused == ["xla"] * expected_fused


def test_implementation_sequence_kept_as_tuple_and_falls_back(count_fused):
    """A sequence of implementations reaches the op as a tuple (hashable: a Flax attribute or
    dataclass field) and falls back past one without a kernel, in all the layers."""
    x = np.asarray(_x(7))
    dense = layers.Dense(IN, OUT, implementation=["mosaic_gpu", "xla"], rngs=nnx.Rngs(0))
    assert dense.implementation == ("mosaic_gpu", "xla")
    ref = layers.Dense(IN, OUT, implementation="xla", rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(dense(x)), np.asarray(ref(x)))
    linen = layers.linen.Dense(OUT, implementation=["mosaic_gpu", "xla"])
    assert linen.implementation == ("mosaic_gpu", "xla") and hash(linen.implementation)
    variables = linen.init(jax.random.key(0), x)
    np.testing.assert_array_equal(
        np.asarray(linen.apply(variables, x)),
        np.asarray(layers.linen.Dense(OUT, implementation="xla").apply(variables, x)))
    assert count_fused == [("mosaic_gpu", "xla"), "xla", ("mosaic_gpu", "xla"), ("mosaic_gpu", "xla"),
                           "xla"]
    for norm in (layers.LayerNorm(IN, implementation=["mosaic_gpu", "xla"], rngs=nnx.Rngs(0)),
                 layers.RMSNorm(IN, implementation=["mosaic_gpu", "xla"], rngs=nnx.Rngs(0))):
        assert norm.implementation == ("mosaic_gpu", "xla")
        assert norm(x).shape == x.shape
    for cls in (layers.linen.LayerNorm, layers.linen.RMSNorm):
        module = cls(implementation=["mosaic_gpu", "xla"])
        assert module.implementation == ("mosaic_gpu", "xla")
        assert module.apply(module.init(jax.random.key(0), x), x).shape == x.shape


@pytest.mark.parametrize("bad", [[], ("xla", "cuda"), ("xla", None)])
def test_implementation_bad_sequence(bad):
    with pytest.raises(ValueError, match="implementation"):
        layers.Dense(IN, OUT, implementation=bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="implementation"):
        layers.linen.Dense(OUT, implementation=bad)
    with pytest.raises(ValueError, match="implementation"):
        layers.RMSNorm(IN, implementation=bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="implementation"):
        layers.linen.LayerNorm(implementation=bad)
