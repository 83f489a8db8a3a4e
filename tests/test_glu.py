"""ops.gated_linear_unit: kernels against the XLA reference, float64 and Tokamax's semantics.

The forward kernel and the backward (dz in place, dx and dw) run on
``interpret`` and on ``triton`` (Triton's CPU interpreter), with shapes that
do not divide the tiles, for both forms of the weights (stacked ``[K, 2, N]``
and the pair ``(gate, up)``, each with its battery; the pair against the
stacked form bit for bit where the same products run); gradients against
``jax.grad`` of the reference; lowering for ``mosaic_tpu`` and
``pallas_triton`` from this host; partitioning over 8 fake CPU devices.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ops
import pallas_core as pl
from ops.activations import resolve_activation
from ops.decoder.glu import GluConfig, glu_backward
from ops.decoder.reference import (gated_linear_unit_reference, glu_backward_reference,
                                   glu_preactivations)
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.op_test_case import weights_like
from tests.tolerances import BACKWARD, FORWARD, assert_close


def _inputs(lead, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, k), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((k, 2, n), np.float32) / np.sqrt(max(k, 1)), dtype)
    return x, w


def _with_grads(fn):
    def run(x, w):
        out, pullback = jax.vjp(fn, x, w)
        return out, pullback(weights_like(out).astype(out.dtype))
    return jax.jit(run)


def tokamax_semantics(x, weights, activation=None):
    """Tokamax's XLA gated linear unit, written out: one einsum into x's dtype
    (its pre-activations are rounded to x's dtype), the activation and the
    product in float32, the result in x's dtype."""
    y = jnp.einsum("...k,kjn->...jn", x, weights, precision=jax.lax.Precision.HIGHEST)
    y = y.astype(jnp.promote_types(x.dtype, jnp.float32))
    gate, up = y[..., 0, :], y[..., 1, :]
    if activation is not None:
        gate = activation(gate)
    return (gate * up).astype(x.dtype)


def _battery_inputs(rng, dtype, lead, k, n):
    x = rng.standard_normal((*lead, k), np.float32)
    w = rng.standard_normal((k, 2, n), np.float32) / np.sqrt(max(k, 1))
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def _battery_op(x, w, **kwargs):
    return ops.gated_linear_unit(x, w, **kwargs)


def _battery_reference(x, w, activation=None):
    return gated_linear_unit_reference(x, w, resolve_activation(activation, "test"))


_X, _W = jnp.zeros((4, 8), jnp.float32), jnp.zeros((8, 2, 6), jnp.float32)
_G = jnp.zeros((8, 6), jnp.float32)


GLU = OpSpec(
    name="gated_linear_unit", op=_battery_op, reference=_battery_reference,
    make_inputs=_battery_inputs, grad_argnums=(0, 1),
    cases=[
        # Rows, K and N that divide no tile; leading dims; many K steps with explicit tiles.
        # Every case on triton (its interpreter compiles fast; the eager run uses it too),
        # the first two float32 ones on interpret as well.
        Case("tiny_swiglu", dict(lead=(5,), k=8, n=6), dict(activation="silu"),
             implementations=("interpret", "triton")),  # the eager run
        Case("swiglu", dict(lead=(37,), k=50, n=70), dict(activation="silu"),
             implementations=("interpret", "triton")),
        Case("bilinear_3d", dict(lead=(2, 3), k=19, n=24), implementations=("interpret", "triton")),
        Case("relu_many_k_steps", dict(lead=(20,), k=70, n=40), dict(activation="relu"),
             tiles=dict(block_sizes=(16, 32, 32))),
        Case("geglu_exact", dict(lead=(70,), k=130, n=40), dict(activation="gelu_exact"),
             dtypes=(jnp.float32, jnp.bfloat16)),
        Case("geglu_tanh_callable_f16", dict(lead=(9,), k=33, n=17),
             dict(activation=lambda z: jax.nn.gelu(z, approximate=True)), dtypes=(jnp.float16,)),
    ],
    implementations=("triton",),
    bad_inputs=[
        BadInput("x_not_array", ("x", _W), {}, TypeError, "x"),
        BadInput("x_int", (_X.astype(jnp.int32), _W), {}, TypeError, "x"),
        BadInput("weights_dtype", (_X, _W.astype(jnp.bfloat16)), {}, TypeError, "weights"),
        BadInput("weights_rank_2", (_X, jnp.zeros((8, 12))), {}, ValueError, "weights"),
        BadInput("weights_not_stacked_pairs", (_X, jnp.zeros((8, 3, 6))), {}, ValueError, "weights"),
        BadInput("weights_k", (_X, jnp.zeros((9, 2, 6))), {}, ValueError, "weights"),
        BadInput("x_scalar", (jnp.zeros(()), _W), {}, ValueError, "x"),
        BadInput("pair_shapes_differ", (_X, (_G, jnp.zeros((8, 7)))), {}, ValueError, "weights",
                 r"pair has shapes"),
        BadInput("pair_dtypes_differ", (_X, (_G, _G.astype(jnp.bfloat16))), {}, TypeError,
                 "weights"),
        BadInput("pair_of_3d", (_X, (_W, _W)), {}, ValueError, "weights"),
        BadInput("pair_k", (_X, (jnp.zeros((9, 6)),) * 2), {}, ValueError, "weights"),
        BadInput("pair_not_arrays", (_X, (_G, "up")), {}, TypeError, "weights"),
        BadInput("list_of_three", (_X, [_G, _G, _G]), {}, ValueError, "weights", r"pair"),
        BadInput("epilogue_subtile", (_X, _W), {"block_sizes": GluConfig(16, 16, 16,
                                                 epilogue_subtile=2)}, ValueError, "block_sizes"),
        BadInput("activation_name", (_X, _W), {"activation": "swish2"}, ValueError, "activation"),
        BadInput("activation_softmax", (_X, _W), {"activation": jax.nn.softmax}, ValueError, "activation"),
        BadInput("activation_int", (_X, _W), {"activation": 3}, TypeError, "activation"),
        BadInput("block_sizes", (_X, _W), {"block_sizes": (16, 16)}, ValueError, "block_sizes"),
    ])


class TestGatedLinearUnit(OpBattery):
    spec = GLU


# The paired form: weights=(gate, up), two [K, N] operands read in place.

def _pair_inputs(rng, dtype, lead, k, n):
    x, w = _battery_inputs(rng, dtype, lead, k, n)
    return x, w[:, 0], w[:, 1]


def _pair_op(x, gate, up, **kwargs):
    return ops.gated_linear_unit(x, (gate, up), **kwargs)


def _pair_reference(x, gate, up, activation=None):
    return gated_linear_unit_reference(x, (gate, up), resolve_activation(activation, "test"))


GLU_PAIR = OpSpec(
    name="gated_linear_unit_pair", op=_pair_op, reference=_pair_reference,
    make_inputs=_pair_inputs, grad_argnums=(0, 1, 2),
    cases=[
        # Rows, K and N that divide no tile: the forward masks K, dx masks N, dw masks M.
        Case("tiny_swiglu_3d", dict(lead=(2, 3), k=8, n=6), dict(activation="silu"),
             implementations=("interpret", "triton")),  # the eager run
        Case("relu_many_steps_grid", dict(lead=(18,), k=40, n=40), dict(activation="relu"),
             tiles=dict(block_sizes=(16, 32, 32)), implementations=("interpret", "triton")),
        Case("relu_many_steps_loop", dict(lead=(18,), k=40, n=40), dict(activation="relu"),
             tiles=dict(block_sizes=GluConfig(16, 32, 32, walk="loop")),
             implementations=("interpret",)),
        Case("geglu_bf16", dict(lead=(70,), k=130, n=40), dict(activation="gelu"),
             dtypes=(jnp.bfloat16,)),
    ],
    implementations=("triton",))


class TestGatedLinearUnitPair(OpBattery):
    spec = GLU_PAIR


def test_pair_equals_stacked():
    """The same tiles over the two forms (rows, K and N dividing no tile): the forward
    kernel is the same program with other operands (bitwise equal outputs); dw forms the
    same products, but the stacked form's column tiles straddle the gate/up boundary of
    its [K, 2N] view, so Triton's interpreter hands numpy's BLAS other tile contents,
    whose summation order may differ in the last bits (9.5e-7 seen): within a few ulps;
    dx sums the same products in another order (the stacked form walks the [M, 2N]
    view), so it is close."""
    x, w = _inputs((18,), 40, 40, jnp.float32, seed=11)
    kw = dict(activation="silu", implementation="triton", block_sizes=(16, 32, 32))
    out_s, (dx_s, dw_s) = _with_grads(lambda x, w: ops.gated_linear_unit(x, w, **kw))(x, w)
    out_p, (dx_p, (dg, du)) = _with_grads(lambda x, p: ops.gated_linear_unit(x, p, **kw))(
        x, (w[:, 0], w[:, 1]))
    np.testing.assert_array_equal(out_p, out_s)
    ulps = 4 * np.finfo(np.float32).eps * np.abs(dw_s).max()
    np.testing.assert_allclose(np.stack([dg, du], 1), dw_s, rtol=0, atol=ulps)
    assert_close(dx_p, dx_s, BACKWARD[jnp.float32], "dx")


def test_glu_backward_takes_the_pair():
    """The public backward (the benchmarks' "bwd" pass) in the paired form against its
    reference; preactivations must come in the form of the weights."""
    x, w = _inputs((12,), 24, 20, jnp.float32, seed=5)
    pair = (w[:, 0], w[:, 1])
    pre = glu_preactivations(x, pair)
    g = weights_like(pre[0])
    dx, (dg, du) = glu_backward(x, pair, pre, g, activation="silu", implementation="triton")
    wdx, (wdg, wdu) = glu_backward_reference(x, pair, pre, g, jax.nn.silu)
    for got, want, name in ((dx, wdx, "dx"), (dg, wdg, "dgate"), (du, wdu, "dup")):
        assert_close(got, want, BACKWARD[jnp.float32], name)
    with pytest.raises(ValueError, match="preactivations"):
        glu_backward(x, pair, jnp.stack(pre, -2), g, implementation="interpret")
    with pytest.raises(ValueError, match="preactivations"):
        glu_backward(x, w, pre, g, implementation="interpret")


def test_tuning_key_tells_the_forms_apart_and_leaves_out_epilogue_subtile():
    """The pair and the stacked weights run different backward kernels: their problems
    have different tuning keys (the pair is the plain call); epilogue_subtile, pinned,
    is no tunable field of the op (its cache entries hold the matmul's others)."""
    from ops.decoder import glu
    x, w = _X, _W
    pair = glu._problem(4, 6, 8, x.dtype, (w[:, 0], w[:, 1]))
    stacked = glu._problem(4, 6, 8, x.dtype, w)
    assert pair.variant_dict() == {"stacked": False} and stacked.variant_dict() == {"stacked": True}
    assert pair.key("triton", "NVIDIA H100") != stacked.key("triton", "NVIDIA H100")
    assert GluConfig.tunable_fields() == ("block_m", "block_n", "block_k", "num_warps",
                                          "num_stages", "group_size")
    # The op's cache entries hold those and Mosaic GPU's (MosaicGluConfig), never epilogue_subtile.
    assert glu.OP.tunable_fields()[:6] == GluConfig.tunable_fields()
    assert "epilogue_subtile" not in glu.OP.tunable_fields()
    assert GluConfig(16, 16, 16, epilogue_subtile=1).tuned() == dict(block_m=16, block_n=16,
                                                                     block_k=16)


def test_float64_and_tokamax_semantics():
    """SwiGLU against the float64 formula and Tokamax's XLA semantics (bf16: they round
    the pre-activations to bf16, the kernel keeps them in float32)."""
    x, w = _inputs((40,), 48, 36, jnp.float32, seed=3)
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    gate, up = xd @ wd[:, 0], xd @ wd[:, 1]
    exact = gate / (1 + np.exp(-gate)) * up
    got = ops.gated_linear_unit(x, w, activation="silu", implementation="triton")
    assert_close(got, exact, FORWARD[jnp.float32], "vs float64")
    assert_close(got, tokamax_semantics(x, w, jax.nn.silu), FORWARD[jnp.float32], "vs tokamax f32")
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got = ops.gated_linear_unit(xb, wb, activation="silu", implementation="triton")
    assert_close(got, tokamax_semantics(xb, wb, jax.nn.silu), 2 * FORWARD[jnp.bfloat16], "vs tokamax bf16")


@settings(max_examples=2, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 90), n=st.integers(1, 70),
       activation=st.sampled_from([None, "silu", "gelu", "relu", "sigmoid"]))
def test_any_shape_forward_and_backward(m, k, n, activation):
    x, w = _inputs((m,), k, n, jnp.float32, seed=m * 131 + k * 7 + n)
    if (m + k + n) % 2:  # the weights' form follows the shape, so the two fixed examples take both
        w = (w[:, 0], w[:, 1])
    act = resolve_activation(activation, "test")
    out, (dx, dw) = _with_grads(lambda x, w: ops.gated_linear_unit(
        x, w, activation=activation, implementation="triton"))(x, w)
    want, (wdx, wdw) = _with_grads(lambda x, w: gated_linear_unit_reference(x, w, act))(x, w)
    assert_close(out, want, FORWARD[jnp.float32], "out")
    assert_close(dx, wdx, BACKWARD[jnp.float32], "dx")
    assert jax.tree.structure(dw) == jax.tree.structure(wdw)
    for got, expected in zip(jax.tree.leaves(dw), jax.tree.leaves(wdw)):
        assert_close(got, expected, BACKWARD[jnp.float32], "dw")


def test_empty_contraction_gives_zeros():
    empty = ops.gated_linear_unit(jnp.zeros((3, 0)), jnp.zeros((0, 2, 5)), activation="silu",
                                  implementation="interpret")
    np.testing.assert_array_equal(empty, np.zeros((3, 5), np.float32))
    empty = ops.gated_linear_unit(jnp.zeros((3, 0)), (jnp.zeros((0, 5)),) * 2, activation="silu",
                                  implementation="interpret")
    np.testing.assert_array_equal(empty, np.zeros((3, 5), np.float32))


def test_forward_reads_each_x_tile_once():
    """The generated Triton kernel loads the x tile once per contraction step and
    feeds both accumulators' dots from it."""
    S = jax.ShapeDtypeStruct
    src = pl.triton.source(lambda x, w: ops.gated_linear_unit(x, w, activation="silu",
                                                              implementation="triton"),
                           S((512, 256), jnp.bfloat16), S((256, 2, 512), jnp.bfloat16))[0]
    loop = src.split("for ")[1].split("pass")[0]
    assert loop.count("tl.load(p0") == 1 and loop.count("tl.dot(") == 2, loop


PLATFORMS = {"mosaic_tpu": ("tpu", "tpu_custom_call"), "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


def _lowered(impl, x, weights):
    """The jitted forward and gradients traced and lowered for ``impl``'s platform."""
    platform, _ = PLATFORMS[impl]

    def grads(x, w):
        f = lambda x, w: ops.gated_linear_unit(x, w, activation="silu", implementation=impl)
        return f(x, w), jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1))(x, w)

    return jax.jit(grads).trace(x, weights).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("impl", list(PLATFORMS))
@pytest.mark.parametrize("dtype, paired", [(jnp.bfloat16, False), (jnp.float32, False),
                                           (jnp.bfloat16, True)], ids=["bf16", "f32", "bf16_pair"])
def test_forward_and_backward_lower_for_other_platforms(impl, dtype, paired):
    S = jax.ShapeDtypeStruct
    w = (S((384, 640), dtype),) * 2 if paired else S((384, 2, 640), dtype)
    text = _lowered(impl, S((200, 384), dtype), w)
    assert text.count(PLATFORMS[impl][1]) >= 4  # forward, dz, dx and dw kernels


def test_mosaic_tpu_refuses_a_column_block_that_does_not_divide_n():
    """Stacked weights need block_n to divide N on mosaic_tpu; the pair does not."""
    x, w = _inputs((8,), 16, 700, jnp.float32)
    with pytest.raises(NotImplementedError, match="block_n"):
        jax.jit(lambda x, w: ops.gated_linear_unit(x, w, implementation="mosaic_tpu")).trace(x, w)
    S = jax.ShapeDtypeStruct
    text = _lowered("mosaic_tpu", S((8, 600), jnp.float32), (S((600, 700), jnp.float32),) * 2)
    assert text.count("tpu_custom_call") >= 4


@pytest.mark.parametrize("mode, spec_x, spec_w, collective, paired", [
    pytest.param("auto", ("data", None), (None, None, "model"), None, False,  # column-parallel
                 marks=pytest.mark.slow, id="column_parallel"),
    pytest.param("explicit", ("data", None), (None, None, "model"), None, False,
                 marks=pytest.mark.slow, id="column_parallel_explicit"),
    pytest.param("explicit", ("data", None), (None, None, "model"), None, True,
                 marks=pytest.mark.slow, id="column_parallel_explicit_pair"),
    pytest.param("auto", (None, "model"), ("model", None, None), "all-reduce", False,  # one psum
                 id="split_contraction"),
    pytest.param("auto", (None, "model"), ("model", None, None), "all-reduce", True,
                 id="split_contraction_pair"),
])
def test_partitions_over_a_mesh(mode, spec_x, spec_w, collective, paired):
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    x, w = _inputs((16,), 24, 20, jnp.float32, seed=7)
    if paired:  # (gate, up), each [K, N] split as the stacked form's K and N dims
        w = (w[:, 0], w[:, 1])
        spec_w = (spec_w[0], spec_w[2])
    f = lambda impl: _with_grads(lambda x, w: ops.gated_linear_unit(
        x, w, activation="silu", implementation=impl))
    want, want_grads = f("xla")(x, w)
    placed = (jax.device_put(x, NamedSharding(mesh, P(*spec_x))),
              jax.device_put(w, NamedSharding(mesh, P(*spec_w))))
    compiled = f("interpret").lower(*placed).compile()
    out, grads = compiled(*placed)
    assert_close(out, want, FORWARD[jnp.float32], "out")
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for g, wg in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert_close(g, wg, BACKWARD[jnp.float32], "grads")
    hlo = compiled.as_text()
    assert "maximal" not in hlo and "all-gather" not in hlo
    if collective:
        assert collective in hlo
