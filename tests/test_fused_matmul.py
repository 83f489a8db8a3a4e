"""ops.fused_matmul: the op battery (tests/op_battery.py) against the XLA float32
reference, and the matmul-specific checks beside it (activations, vmap, property
sweeps)."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import ops
from ops.activations import ACTIVATIONS, resolve_activation
from ops.matmul import reference
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close

ACTS = [None, "relu", "gelu", "gelu_exact", "silu", "sigmoid", "tanh", jax.nn.softplus]


def act_name(act):
    return getattr(act, "__name__", str(act))


def make_inputs(rng, dtype, lead, k, n, bias=True):
    """x ~ N(0, 1) of shape [*lead, k], w ~ N(0, 1/k) of [k, n], bias ~ N(0, 1) of [n]."""
    x = rng.standard_normal((*lead, k), np.float32)
    w = rng.standard_normal((k, n), np.float32) / np.sqrt(max(k, 1))
    b = rng.standard_normal((n,), np.float32) if bias else None
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in (x, w, b))


def ref32(x, w, b, act):
    """The float32 reference on the (possibly 16-bit) inputs, upcast."""
    up = lambda a: None if a is None else a.astype(jnp.float32)
    return reference(up(x), up(w), up(b), resolve_activation(act, "test"))


def _op(x, w, b, **kwargs):
    return ops.fused_matmul(x, w, b, **kwargs)


def _reference(x, w, b, activation=None):
    return reference(x, w, b, resolve_activation(activation, "test"))


F32_BF16 = (jnp.float32, jnp.bfloat16)
CASES = [
    # Every activation forward: 87 rows of 50 into 70 columns, dividing no tile of (16, 32, 16).
    *[Case(f"act_{act_name(a)}", dict(lead=(3, 29), k=50, n=70), dict(activation=a),
           dtypes=F32_BF16, grads=False) for a in ACTS],
    # Forward and the gradients of x, w and bias (when present).
    *[Case(f"grad_{act_name(a)}{'' if bias else '_no_bias'}", dict(lead=(37,), k=45, n=70, bias=bias),
           dict(activation=a), dtypes=F32_BF16) for a in (None, "gelu_exact", "relu")
      for bias in (True, False)],
    Case("grad_softplus_no_bias", dict(lead=(13,), k=40, n=24, bias=False),
         dict(activation=jax.nn.softplus), tiles=dict(block_sizes=(8, 16, 16))),
    Case("silu_f16", dict(lead=(33,), k=40, n=24), dict(activation="silu"),
         tiles=dict(block_sizes=(16, 16, 16)), dtypes=(jnp.float16,), grads=False),
    # The default tiles: one block, and several with edges.
    Case("default_tiles_one_block", dict(lead=(5,), k=3, n=7), dict(activation="gelu"),
         tiles=dict(block_sizes=None), grads=False),
    Case("default_tiles_multi_block", dict(lead=(300,), k=200, n=260), dict(activation="gelu"),
         tiles=dict(block_sizes=None), grads=False),
    # No rows: the output and the gradients are empty or zero, on every implementation.
    Case("empty_rows", dict(lead=(0,), k=24, n=40), dict(activation="relu")),
]

X = jnp.ones((4, 8), jnp.float32)
W = jnp.ones((8, 16), jnp.float32)

BAD_INPUTS = [
    BadInput("k_mismatch", (X, jnp.ones((9, 16)), None), {}, ValueError, "w",
             r"x's last dim \(8\) must equal w's first dim \(9\)"),
    BadInput("w_rank", (X, jnp.ones((8, 16, 1)), None), {}, ValueError, "w", r"w must have rank 2"),
    BadInput("bias_length", (X, W, jnp.ones((15,))), {}, ValueError, "bias",
             r"bias must have shape \[N\] = \(16,\)"),
    BadInput("bias_rank", (X, W, jnp.ones((1, 16))), {}, ValueError, "bias", r"bias must have shape"),
    BadInput("int_x", (X.astype(jnp.int32), W.astype(jnp.int32), None), {}, TypeError, "x",
             r"x has dtype int32"),
    BadInput("mixed_dtypes", (X, W.astype(jnp.bfloat16), None), {}, TypeError, "w",
             r"w has dtype bfloat16 but x has float32"),
    BadInput("bias_dtype", (X, W, jnp.ones((16,), jnp.float16)), {}, TypeError, "bias",
             r"bias has dtype float16"),
    BadInput("list_x", ([[1.0]], W, None), {}, TypeError, "x", r"x must be a JAX or NumPy array"),
    BadInput("unknown_activation", (X, W, None), {"activation": "gelu_fast"}, ValueError,
             "activation", r"unknown activation 'gelu_fast'"),
    BadInput("activation_type", (X, W, None), {"activation": 3}, TypeError, "activation",
             r"activation must be None, a name or a callable"),
    BadInput("mosaic_gpu_says_why", (X, W, None), {"implementation": "mosaic_gpu"},
             NotImplementedError, "implementation", r"wgmma"),
    BadInput("block_sizes", (X, W, None), {"block_sizes": (16, 16)}, ValueError, "block_sizes",
             r"block_sizes must be three positive ints"),
]

FUSED_MATMUL = OpSpec(
    name="fused_matmul", op=_op, reference=_reference, make_inputs=make_inputs, cases=CASES,
    grad_argnums=(0, 1, 2), dtypes=(jnp.float32,),
    tiles={"interpret": dict(block_sizes=(16, 32, 16))}, bad_inputs=BAD_INPUTS,
    eager_case="grad_softplus_no_bias")


class TestFusedMatmul(OpBattery):
    spec = FUSED_MATMUL


def test_jit_vmap_and_default_implementation():
    x, w, b = make_inputs(np.random.default_rng(6), jnp.float32, (3, 9), 20, 24)
    f = jax.jit(jax.vmap(lambda x: ops.fused_matmul(x, w, b, activation="relu",
                                                    implementation="interpret", block_sizes=(8, 8, 8))))
    assert_close(f(x), ref32(x, w, b, "relu"), FORWARD[jnp.float32])
    # On CPU the default implementation is XLA.
    assert_close(ops.fused_matmul(x, w, b), ref32(x, w, b, None), FORWARD[jnp.float32])


def test_gelu_exact_means_jax_gelu_erf_form():
    x = jnp.linspace(-8, 8, 4001)
    np.testing.assert_allclose(ACTIVATIONS["gelu_exact"](x), jax.nn.gelu(x, approximate=False), atol=1e-6)
    # The tanh form without jax.nn.gelu's cancellation of 1 + tanh below x = -1 (the values
    # there are below 0.2 in size; tests/test_triton_backend.py checks the accuracy).
    np.testing.assert_allclose(ACTIVATIONS["gelu"](x), jax.nn.gelu(x), rtol=1e-6, atol=1e-6)


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 70), n=st.integers(1, 70),
       lead=st.lists(st.integers(1, 3), max_size=2),
       act=st.sampled_from([None, "relu", "gelu", "gelu_exact", "sigmoid"]),
       with_bias=st.booleans(), blocks=st.tuples(*[st.sampled_from([8, 16, 32])] * 3),
       seed=st.integers(0, 2**16))
def test_property_forward(m, k, n, lead, act, with_bias, blocks, seed):
    x, w, b = make_inputs(np.random.default_rng(seed), jnp.float32, (*lead, m), k, n, with_bias)
    out = ops.fused_matmul(x, w, b, activation=act, implementation="interpret", block_sizes=blocks)
    assert_close(out, ref32(x, w, b, act), FORWARD[jnp.float32])


@settings(max_examples=4, deadline=None)
@given(m=st.integers(1, 48), k=st.integers(1, 48), n=st.integers(1, 48),
       act=st.sampled_from([None, "gelu", "silu"]), blocks=st.tuples(*[st.sampled_from([8, 16])] * 3),
       seed=st.integers(0, 2**16))
def test_property_gradients(m, k, n, act, blocks, seed):
    x, w, b = make_inputs(np.random.default_rng(seed), jnp.float32, (m,), k, n)
    f = lambda fn: (lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b))))
    grads = jax.grad(f(lambda x, w, b: ops.fused_matmul(
        x, w, b, activation=act, implementation="interpret", block_sizes=blocks)), (0, 1, 2))(x, w, b)
    expected = jax.grad(f(lambda x, w, b: ref32(x, w, b, act)), (0, 1, 2))(x, w, b)
    for g, e in zip(grads, expected):
        assert_close(g, e, BACKWARD[jnp.float32])
