"""ops.fused_matmul: forward and gradients against the XLA float32 reference."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings, strategies as st

import ops
from ops.activations import ACTIVATIONS, resolve_activation
from ops.matmul import reference
from tests.op_test_case import OpTestCase
from tests.tolerances import BACKWARD, FORWARD, assert_close

ACTS = [None, "relu", "gelu", "gelu_exact", "silu", "sigmoid", "tanh", jax.nn.softplus]


def make_inputs(key, lead, k, n, dtype, with_bias=True):
    kx, kw, kb = jax.random.split(key, 3)
    x = jax.random.normal(kx, (*lead, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
    b = jax.random.normal(kb, (n,), jnp.float32) if with_bias else None
    cast = lambda a: None if a is None else a.astype(dtype)
    return cast(x), cast(w), cast(b)


def ref32(x, w, b, act):
    """The float32 reference on the (possibly 16-bit) inputs, upcast."""
    up = lambda a: None if a is None else a.astype(jnp.float32)
    return reference(up(x), up(w), up(b), resolve_activation(act, "test"))


@pytest.mark.parametrize("act", ACTS, ids=lambda a: getattr(a, "__name__", str(a)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_non_dividing_shapes(act, dtype):
    x, w, b = make_inputs(jax.random.key(0), (3, 29), 50, 70, dtype)
    out = ops.fused_matmul(x, w, b, activation=act, implementation="interpret", block_sizes=(16, 32, 16))
    assert out.dtype == dtype and out.shape == (3, 29, 70)
    assert_close(out, ref32(x, w, b, act), FORWARD[dtype], "forward")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("act", [None, "gelu_exact", "relu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_reference(act, dtype, with_bias):
    x, w, b = make_inputs(jax.random.key(1), (37,), 45, 70, dtype, with_bias)
    cot = jax.random.normal(jax.random.key(2), (37, 70), jnp.float32)

    def loss(fn):
        return lambda x, w, b: jnp.sum(fn(x, w, b).astype(jnp.float32) * cot)

    ours = loss(lambda x, w, b: ops.fused_matmul(x, w, b, activation=act, implementation="interpret",
                                                 block_sizes=(16, 32, 16)))
    argnums = (0, 1, 2) if with_bias else (0, 1)
    grads = jax.grad(ours, argnums)(x, w, b)
    expected = jax.grad(loss(lambda x, w, b: ref32(x, w, b, act)), argnums)(
        *(None if a is None else a.astype(jnp.float32) for a in (x, w, b)))
    for name, g, e, a in zip("xwb", grads, expected, (x, w, b)):
        assert g.dtype == a.dtype, name
        assert_close(g, e, BACKWARD[dtype], f"d{name}")


def test_default_blocks_single_and_multi_block():
    for shape in [(5, 3, 7), (300, 200, 260)]:
        m, k, n = shape
        x, w, b = make_inputs(jax.random.key(3), (m,), k, n, jnp.float32)
        out = ops.fused_matmul(x, w, b, activation="gelu", implementation="interpret")
        assert_close(out, ref32(x, w, b, "gelu"), FORWARD[jnp.float32], str(shape))


def test_float16():
    x, w, b = make_inputs(jax.random.key(4), (33,), 40, 24, jnp.float16)
    out = ops.fused_matmul(x, w, b, activation="silu", implementation="interpret", block_sizes=(16, 16, 16))
    assert out.dtype == jnp.float16
    assert_close(out, ref32(x, w, b, "silu"), FORWARD[jnp.float16])


def test_xla_implementation_is_the_reference():
    x, w, b = make_inputs(jax.random.key(5), (4, 6), 10, 12, jnp.float32)
    np.testing.assert_array_equal(ops.fused_matmul(x, w, b, activation="tanh", implementation="xla"),
                                  reference(x, w, b, jnp.tanh))


def test_jit_vmap_and_default_implementation():
    x, w, b = make_inputs(jax.random.key(6), (3, 9), 20, 24, jnp.float32)
    f = jax.jit(jax.vmap(lambda x: ops.fused_matmul(x, w, b, activation="relu",
                                                    implementation="interpret", block_sizes=(8, 8, 8))))
    assert_close(f(x), ref32(x, w, b, "relu"), FORWARD[jnp.float32])
    # On CPU the default implementation is XLA.
    assert_close(ops.fused_matmul(x, w, b), ref32(x, w, b, None), FORWARD[jnp.float32])


def test_gelu_exact_means_jax_gelu_erf_form():
    x = jnp.linspace(-8, 8, 4001)
    np.testing.assert_allclose(ACTIVATIONS["gelu_exact"](x), jax.nn.gelu(x, approximate=False), atol=1e-6)
    np.testing.assert_array_equal(ACTIVATIONS["gelu"](x), jax.nn.gelu(x))


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 70), n=st.integers(1, 70),
       lead=st.lists(st.integers(1, 3), max_size=2),
       act=st.sampled_from([None, "relu", "gelu", "gelu_exact", "sigmoid"]),
       with_bias=st.booleans(), blocks=st.tuples(*[st.sampled_from([8, 16, 32])] * 3),
       seed=st.integers(0, 2**16))
def test_property_forward(m, k, n, lead, act, with_bias, blocks, seed):
    x, w, b = make_inputs(jax.random.key(seed), (*lead, m), k, n, jnp.float32, with_bias)
    out = ops.fused_matmul(x, w, b, activation=act, implementation="interpret", block_sizes=blocks)
    assert_close(out, ref32(x, w, b, act), FORWARD[jnp.float32])


@settings(max_examples=4, deadline=None)
@given(m=st.integers(1, 48), k=st.integers(1, 48), n=st.integers(1, 48),
       act=st.sampled_from([None, "gelu", "silu"]), blocks=st.tuples(*[st.sampled_from([8, 16])] * 3),
       seed=st.integers(0, 2**16))
def test_property_gradients(m, k, n, act, blocks, seed):
    x, w, b = make_inputs(jax.random.key(seed), (m,), k, n, jnp.float32)
    f = lambda fn: (lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b))))
    grads = jax.grad(f(lambda x, w, b: ops.fused_matmul(
        x, w, b, activation=act, implementation="interpret", block_sizes=blocks)), (0, 1, 2))(x, w, b)
    expected = jax.grad(f(lambda x, w, b: ref32(x, w, b, act)), (0, 1, 2))(x, w, b)
    for g, e in zip(grads, expected):
        assert_close(g, e, BACKWARD[jnp.float32])


# ---- bad input -----------------------------------------------------------------

X = jnp.ones((4, 8), jnp.float32)
W = jnp.ones((8, 16), jnp.float32)


@pytest.mark.parametrize("args, kwargs, error, pattern", [
    ((X, jnp.ones((9, 16))), {}, ValueError, r"x's last dim \(8\) must equal w's first dim \(9\)"),
    ((X, jnp.ones((8, 16, 1))), {}, ValueError, r"w must have rank 2"),
    ((X, W, jnp.ones((15,))), {}, ValueError, r"bias must have shape \[N\] = \(16,\)"),
    ((X, W, jnp.ones((1, 16))), {}, ValueError, r"bias must have shape"),
    ((X.astype(jnp.int32), W.astype(jnp.int32)), {}, TypeError, r"x has dtype int32"),
    ((X, W.astype(jnp.bfloat16)), {}, TypeError, r"w has dtype bfloat16 but x has float32"),
    ((X, W, jnp.ones((16,), jnp.float16)), {}, TypeError, r"bias has dtype float16"),
    (([[1.0]], W), {}, TypeError, r"x must be a JAX or NumPy array"),
    ((X, W), {"activation": "gelu_fast"}, ValueError, r"unknown activation 'gelu_fast'"),
    ((X, W), {"activation": 3}, TypeError, r"activation must be None, a name or a callable"),
    ((X, W), {"implementation": "cuda"}, ValueError, r"implementation must be None or one of"),
    ((X, W), {"implementation": "mosaic_gpu"}, NotImplementedError, r"wgmma"),
    ((X, W), {"block_sizes": (16, 16)}, ValueError, r"block_sizes must be three positive ints"),
])
def test_bad_input(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ops.fused_matmul(*args, **kwargs)


def test_empty_batch():
    x, w, b = make_inputs(jax.random.key(7), (0,), 24, 40, jnp.float32)
    out = ops.fused_matmul(x, w, b, activation="relu", implementation="interpret")
    assert out.shape == (0, 40)
    grads = jax.grad(lambda x, w, b: ops.fused_matmul(x, w, b, implementation="interpret").sum(),
                     (0, 1, 2))(x, w, b)
    chex.assert_trees_all_equal(grads, (jnp.zeros((0, 24)), jnp.zeros((24, 40)), jnp.zeros((40,))))


class VariantsTest(OpTestCase):
    """The interpreter's kernels eagerly and under jit, values and gradients (small shapes
    that divide no block)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("bias_gelu", "gelu", True),
                                    ("no_bias_callable", jax.nn.softplus, False))
    def test_matches_reference(self, act, with_bias):
        rng = np.random.default_rng(8)
        x = jnp.asarray(rng.standard_normal((13, 40)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((40, 24)) / 6, jnp.float32)
        b = jnp.asarray(rng.standard_normal(24), jnp.float32) if with_bias else None
        op = lambda x, w, b: ops.fused_matmul(x, w, b, activation=act, implementation="interpret",
                                              block_sizes=(8, 16, 16))
        self.check_op(op, lambda x, w, b: ref32(x, w, b, act), x, w, b,
                      argnums=(0, 1, 2) if with_bias else (0, 1), rtol=1e-5, atol=1e-5)
