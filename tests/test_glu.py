"""ops.gated_linear_unit: kernels against the XLA reference, float64 and Tokamax's semantics.

The forward kernel and the backward (dz in place, dx and dw on the tiled core)
run on ``interpret`` and on ``triton`` (Triton's CPU interpreter), with shapes
that do not divide the tiles; gradients against ``jax.grad`` of the reference;
lowering for ``mosaic_tpu`` and ``pallas_triton`` from this host; partitioning
over 8 fake CPU devices.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from ops.activations import ACTIVATIONS
from ops.decoder.reference import gated_linear_unit_reference
from tests.op_test_case import weights_like
from tests.tolerances import BACKWARD, FORWARD, assert_close, for_dtype


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


# (leading dims, K, N, activation): rows, K and N that divide no tile; leading dims.
CASES = {
    "swiglu": ((37,), 50, 70, "silu"),
    "bilinear_3d": ((2, 3), 19, 24, None),
    "geglu_exact": ((70,), 130, 40, "gelu_exact"),
    "geglu_tanh_callable": ((9,), 33, 17, lambda z: jax.nn.gelu(z, approximate=True)),
}
RUNS = ([("interpret", c, jnp.float32) for c in ("swiglu", "bilinear_3d", "geglu_exact")]
        + [("triton", c, jnp.float32) for c in ("swiglu", "bilinear_3d")]
        + [("triton", "geglu_exact", jnp.bfloat16), ("triton", "geglu_tanh_callable", jnp.float16)])


@pytest.mark.parametrize("impl, case, dtype", RUNS,
                         ids=[f"{i}-{c}-{jnp.dtype(d).name}" for i, c, d in RUNS])
def test_matches_reference_and_gradients(impl, case, dtype):
    lead, k, n, activation = CASES[case]
    x, w = _inputs(lead, k, n, dtype, seed=len(case))
    act = ACTIVATIONS[activation] if isinstance(activation, str) else activation
    out, (dx, dw) = _with_grads(lambda x, w: ops.gated_linear_unit(
        x, w, activation=activation, implementation=impl))(x, w)
    want, (wdx, wdw) = _with_grads(lambda x, w: gated_linear_unit_reference(x, w, act))(
        x.astype(jnp.float32), w.astype(jnp.float32))
    assert (out.shape, out.dtype, dx.dtype, dw.dtype) == ((*lead, n), x.dtype, x.dtype, w.dtype)
    assert_close(out, want, for_dtype(FORWARD, dtype), "out")
    assert_close(dx, wdx, for_dtype(BACKWARD, dtype), "dx")
    assert_close(dw, wdw, for_dtype(BACKWARD, dtype), "dw")


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


def test_explicit_blocks_many_k_steps_and_empty_contraction():
    x, w = _inputs((33,), 100, 40, jnp.float32, seed=5)
    f = lambda x, w: ops.gated_linear_unit(x, w, activation="relu", implementation="interpret",
                                           block_sizes=(16, 32, 32))
    out, (dx, dw) = _with_grads(f)(x, w)
    want, (wdx, wdw) = _with_grads(lambda x, w: gated_linear_unit_reference(x, w, jax.nn.relu))(x, w)
    for a, b, what in ((out, want, "out"), (dx, wdx, "dx"), (dw, wdw, "dw")):
        assert_close(a, b, BACKWARD[jnp.float32], what)
    empty = ops.gated_linear_unit(jnp.zeros((3, 0)), jnp.zeros((0, 2, 5)), activation="silu",
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


_X, _W = jnp.zeros((4, 8), jnp.float32), jnp.zeros((8, 2, 6), jnp.float32)


@pytest.mark.parametrize("args, kwargs, error, argument", [
    (("x", _W), {}, TypeError, "x"),
    ((_X.astype(jnp.int32), _W), {}, TypeError, "x"),
    ((_X, _W.astype(jnp.bfloat16)), {}, TypeError, "weights"),
    ((_X, jnp.zeros((8, 12))), {}, ValueError, "weights"),
    ((_X, jnp.zeros((8, 3, 6))), {}, ValueError, "weights"),
    ((_X, jnp.zeros((9, 2, 6))), {}, ValueError, "weights"),
    ((jnp.zeros(()), _W), {}, ValueError, "x"),
    ((_X, _W), {"activation": "swish2"}, ValueError, "activation"),
    ((_X, _W), {"activation": jax.nn.softmax}, ValueError, "activation"),
    ((_X, _W), {"activation": 3}, TypeError, "activation"),
    ((_X, _W), {"block_sizes": (16, 16)}, ValueError, "block_sizes"),
    ((_X, _W), {"implementation": "cuda"}, ValueError, "implementation"),
    ((_X, _W), {"implementation": "mosaic_gpu"}, NotImplementedError, "implementation"),
])
def test_bad_input_is_named_before_tracing(args, kwargs, error, argument, monkeypatch):
    import pallas_core.call

    def traced(*a, **k):
        raise AssertionError("a kernel was traced before the bad input was refused")

    monkeypatch.setattr(pallas_core.call, "build_call", traced)
    kwargs.setdefault("implementation", "interpret")
    with pytest.raises(error, match=rf"\b{argument}\b"):
        ops.gated_linear_unit(*args, **kwargs)


PLATFORMS = {"mosaic_tpu": ("tpu", "tpu_custom_call"), "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


@pytest.mark.parametrize("impl", list(PLATFORMS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_and_backward_lower_for_other_platforms(impl, dtype):
    platform, marker = PLATFORMS[impl]

    def grads(x, w):
        f = lambda x, w: ops.gated_linear_unit(x, w, activation="silu", implementation=impl)
        return f(x, w), jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1))(x, w)

    args = (jax.ShapeDtypeStruct((200, 384), dtype), jax.ShapeDtypeStruct((384, 2, 640), dtype))
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) >= 4  # forward, dz, dx and dw kernels


def test_mosaic_tpu_refuses_a_column_block_that_does_not_divide_n():
    x, w = _inputs((8,), 16, 700, jnp.float32)
    with pytest.raises(NotImplementedError, match="block_n"):
        jax.jit(lambda x, w: ops.gated_linear_unit(x, w, implementation="mosaic_tpu")).trace(x, w)


@pytest.mark.parametrize("mode, spec_x, spec_w, collective", [
    pytest.param("auto", ("data", None), (None, None, "model"), None,  # rows x column-parallel
                 marks=pytest.mark.slow, id="column_parallel"),
    pytest.param("explicit", ("data", None), (None, None, "model"), None,
                 marks=pytest.mark.slow, id="column_parallel_explicit"),
    pytest.param("auto", (None, "model"), ("model", None, None), "all-reduce",  # one psum
                 id="split_contraction"),
])
def test_partitions_over_a_mesh(mode, spec_x, spec_w, collective):
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    x, w = _inputs((16,), 24, 20, jnp.float32, seed=7)
    f = lambda impl: _with_grads(lambda x, w: ops.gated_linear_unit(
        x, w, activation="silu", implementation=impl))
    want, want_grads = f("xla")(x, w)
    placed = (jax.device_put(x, NamedSharding(mesh, P(*spec_x))),
              jax.device_put(w, NamedSharding(mesh, P(*spec_w))))
    compiled = f("interpret").lower(*placed).compile()
    out, grads = compiled(*placed)
    assert_close(out, want, FORWARD[jnp.float32], "out")
    for g, wg, name in zip(grads, want_grads, ("dx", "dw")):
        assert_close(g, wg, BACKWARD[jnp.float32], name)
    hlo = compiled.as_text()
    assert "maximal" not in hlo and "all-gather" not in hlo
    if collective:
        assert collective in hlo
