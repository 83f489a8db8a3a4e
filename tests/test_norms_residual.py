"""Residual-fused and offset norms: ``ops.rms_norm`` / ``ops.layer_norm`` with
``residual=`` (``(norm(x + residual), x + residual)`` from one kernel, both
cotangents in the backward) and ``scale_offset=`` (Gemma's ``1 + scale``), the
per-head norm over ``[B, T, N, H]``, the Flax layers' ``scale_offset`` and call-time
``residual``, and lowering for TPU and CUDA from this host.

The battery (:mod:`tests.op_battery`) checks outputs and both gradients against an
independent float32 reference: the unfused ``x + residual`` then the norm with
``scale + offset`` written out in ``jnp``.
"""
from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layers.linen_norms
import layers.norms
from layers.linen_norms import LayerNorm as LinenLayerNorm, RMSNorm as LinenRMSNorm
from layers.norms import LayerNorm, RMSNorm
from ops.reduction.norms import layer_norm, rms_norm
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close


def _unfused(x, residual, scale, bias=None, *, center, scale_offset=0.0, use_fast_variance=False,
             epsilon=1e-6):
    """The composition a user writes: add, then normalize; float32 throughout."""
    h = x + residual
    mean = jnp.mean(h, -1, keepdims=True) if center else 0.0
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    y = (h - mean) * jax.lax.rsqrt(var + epsilon)
    if scale is not None:
        y = y * (scale + scale_offset)
    if bias is not None:
        y = y + bias
    return y, h


def _inputs(rng, dtype, *, shape, scale=True, bias=False):
    f = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    r = (0.5 * rng.standard_normal(shape) + 0.25).astype(np.float32)
    out = [jnp.asarray(x, dtype), jnp.asarray(r, dtype),
           jnp.asarray(0.2 * rng.standard_normal(f), jnp.float32) if scale else None]
    if bias:
        out.append(jnp.asarray(0.3 * rng.standard_normal(f), jnp.float32))
    return tuple(out)


X = jnp.ones((4, 8), jnp.float32)
S = jnp.ones((8,), jnp.float32)


def _bad_inputs(with_bias: bool):
    """Positional ``(x, residual, scale[, bias])`` as the specs' ops take them."""
    tail = (None,) if with_bias else ()
    return [
        BadInput("residual_shape", (X, jnp.ones((4, 9)), S, *tail), {}, ValueError, "residual",
                 r"residual must have x's shape"),
        BadInput("residual_dtype", (X, X.astype(jnp.bfloat16), S, *tail), {}, TypeError,
                 "residual", r"residual has dtype bfloat16 but x has float32"),
        BadInput("residual_int", (X, X.astype(jnp.int32), S, *tail), {}, TypeError, "residual",
                 r"residual has dtype int32"),
        BadInput("residual_list", (X, [[1.0] * 8] * 4, S, *tail), {}, TypeError, "residual",
                 r"residual must be a JAX or NumPy array"),
        BadInput("offset_without_scale", (X, X, None, *tail), {"scale_offset": 1.0}, ValueError,
                 "scale_offset", r"needs a scale"),
        BadInput("offset_nan", (X, X, S, *tail), {"scale_offset": float("nan")}, ValueError,
                 "scale_offset", r"must be finite"),
        BadInput("offset_string", (X, X, S, *tail), {"scale_offset": "1"}, TypeError,
                 "scale_offset", r"static real number"),
    ]


_SPEC_COMMON = dict(implementations=("interpret", "xla"), dtypes=(jnp.float32,),
                    unavailable="mosaic_gpu", xla_is_reference=False)
_ALL = ("interpret", "triton", "xla")

RESIDUAL_RMS_NORM = OpSpec(
    name="rms_norm_residual",
    op=lambda x, r, s, **kw: rms_norm(x, s, residual=r, **kw),
    reference=lambda x, r, s, scale_offset=0.0: _unfused(x, r, s, center=False,
                                                         scale_offset=scale_offset),
    make_inputs=_inputs, grad_argnums=(0, 1, 2),
    cases=[
        Case("gemma_offset", inputs=dict(shape=(5, 200)), options=dict(scale_offset=1.0),
             implementations=_ALL),
        Case("gemma_offset_16bit", inputs=dict(shape=(5, 200)), options=dict(scale_offset=1.0),
             dtypes=(jnp.bfloat16,), implementations=("interpret",)),
        Case("three_chunks", inputs=dict(shape=(2, 3, 300)), tiles=dict(max_chunk=128),
             implementations=("interpret",)),
        Case("no_scale", inputs=dict(shape=(3, 130), scale=False), implementations=("interpret",)),
    ],
    bad_inputs=_bad_inputs(with_bias=False),
    **_SPEC_COMMON)

RESIDUAL_LAYER_NORM = OpSpec(
    name="layer_norm_residual",
    op=lambda x, r, s, b, **kw: layer_norm(x, s, b, residual=r, **kw),
    reference=lambda x, r, s, b, scale_offset=0.0, use_fast_variance=False: _unfused(
        x, r, s, b, center=True, scale_offset=scale_offset),
    make_inputs=lambda rng, dtype, **kw: _inputs(rng, dtype, bias=True, **kw),
    grad_argnums=(0, 1, 2, 3),
    cases=[
        Case("offset_two_pass", inputs=dict(shape=(7, 130)), options=dict(scale_offset=1.0),
             implementations=_ALL),
        Case("fast_variance_three_chunks", inputs=dict(shape=(4, 300)),
             options=dict(use_fast_variance=True), tiles=dict(max_chunk=128),
             implementations=("interpret",)),
    ],
    bad_inputs=_bad_inputs(with_bias=True),
    **_SPEC_COMMON)


class TestResidualRmsNorm(OpBattery):
    spec = RESIDUAL_RMS_NORM


class TestResidualLayerNorm(OpBattery):
    spec = RESIDUAL_LAYER_NORM


def test_xla_path_is_the_unfused_composition_bit_for_bit():
    """``implementation="xla"`` is ``x + residual`` then the plain norm, to the bit."""
    x, r, s = _inputs(np.random.default_rng(0), jnp.bfloat16, shape=(6, 96))
    y, h = rms_norm(x, s, residual=r, scale_offset=1.0, implementation="xla")
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_array_equal(y, rms_norm(x + r, s + 1.0, implementation="xla"))


def test_per_head_norm_reads_q_in_place():
    """A q/k norm over the head dim of [B, T, N, H]: equal to the norm of each head, and the
    compiled program moves no data around the kernel (no transpose or copy)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 5, 3, 64)), jnp.float32)
    s = jnp.asarray(rng.standard_normal(64), jnp.float32)
    f = jax.jit(lambda q, s: rms_norm(q, s, implementation="interpret"))
    y = f(q, s)
    for n in range(3):
        assert_close(y[:, :, n], rms_norm(q[:, :, n], s, implementation="xla"),
                     FORWARD[jnp.float32], f"head {n}")
    jaxpr = str(jax.make_jaxpr(lambda q, s: rms_norm(q, s, implementation="interpret"))(q, s))
    assert "transpose" not in jaxpr
    hlo = f.lower(q, s).compile().as_text()
    moves = re.findall(r"= f32\[([\d,]*)\][^ ]* (?:copy|transpose)\(", hlo)
    assert not [m for m in moves if np.prod([int(d) for d in m.split(",") if d]) >= q.size], moves


PLATFORM = {"mosaic_tpu": ("tpu", "tpu_custom_call"),
            "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


@pytest.mark.parametrize("impl", list(PLATFORM))
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_residual_kernels_lower(impl, op):
    fn = rms_norm if op == "rms_norm" else layer_norm

    def grads(x, r, s):
        def loss(x, r, s):
            y, h = fn(x, s, residual=r, scale_offset=1.0, implementation=impl)
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(jnp.sin(h.astype(jnp.float32)))
        return jax.grad(loss, (0, 1, 2))(x, r, s)

    specs = [jax.ShapeDtypeStruct((2, 40, 1000), jnp.bfloat16)] * 2 + [
        jax.ShapeDtypeStruct((1000,), jnp.float32)]
    platform, marker = PLATFORM[impl]
    text = jax.jit(grads).trace(*specs).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 2
    assert f"{op}_residual_fwd" in text and f"{op}_residual_bwd" in text


# --------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------

@pytest.fixture
def op_calls(monkeypatch):
    """The keyword arguments of every op call the norm layers make."""
    calls = []
    for module in (layers.norms, layers.linen_norms):
        for name in ("layer_norm", "rms_norm"):
            real = getattr(module, name)

            def spy(*args, _real=real, **kwargs):
                calls.append(kwargs)
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return calls


NNX = [(RMSNorm, nnx.RMSNorm), (LayerNorm, nnx.LayerNorm)]
LINEN = [(LinenRMSNorm, nn.RMSNorm), (LinenLayerNorm, nn.LayerNorm)]


@pytest.mark.parametrize("ours, theirs", NNX, ids=["RMSNorm", "LayerNorm"])
def test_nnx_residual_and_gemma_offset(ours, theirs, op_calls):
    rng = np.random.default_rng(3)
    x, r = (jnp.asarray(rng.standard_normal((2, 3, 48)), jnp.float32) for _ in range(2))
    theirs_ = theirs(48, rngs=nnx.Rngs(0))
    # Fused (float32 throughout): one call with the residual, Flax's bits on "xla".
    y, h = ours(48, rngs=nnx.Rngs(0), implementation="xla")(x, residual=r)
    assert op_calls[-1].get("residual") is not None
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_array_equal(y, theirs_(x + r))
    # Gemma: zero-initialised scale plus an offset of 1 is Flax's ones-initialised module.
    gemma = ours(48, rngs=nnx.Rngs(0), implementation="xla", scale_offset=1.0,
                 scale_init=nnx.initializers.zeros)
    y, h = gemma(x, residual=r)
    np.testing.assert_array_equal(y, theirs_(x + r))
    # bfloat16 activations, float32 params: Flax's float32 output; the add runs unfused.
    n = len(op_calls)
    y16, h16 = gemma(x.astype(jnp.bfloat16), residual=r.astype(jnp.bfloat16))
    assert (y16.dtype, h16.dtype) == (jnp.float32, jnp.bfloat16)
    assert op_calls[n].get("residual") is None
    np.testing.assert_array_equal(h16, x.astype(jnp.bfloat16) + r.astype(jnp.bfloat16))


def test_nnx_residual_gradients_match_the_unfused_module():
    rng = np.random.default_rng(4)
    x, r = (jnp.asarray(rng.standard_normal((4, 40)), jnp.float32) for _ in range(2))
    module = RMSNorm(40, rngs=nnx.Rngs(0), implementation="interpret", scale_offset=1.0)

    def loss(module, x, r, fused):
        y, h = module(x, residual=r) if fused else (module(x + r), x + r)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(h))

    got = nnx.grad(loss, argnums=(0, 1, 2))(module, x, r, True)
    want = nnx.grad(loss, argnums=(0, 1, 2))(module, x, r, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, BACKWARD[jnp.float32], "grads")


@pytest.mark.parametrize("ours, theirs", LINEN, ids=["RMSNorm", "LayerNorm"])
def test_linen_residual_and_offset(ours, theirs, op_calls):
    rng = np.random.default_rng(5)
    x, r = (jnp.asarray(rng.standard_normal((3, 40)), jnp.bfloat16) for _ in range(2))
    module = ours(implementation="interpret", scale_offset=1.0, scale_init=nn.initializers.zeros,
                  dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    variables = module.init(jax.random.key(0), x, residual=r)
    stock = theirs(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    stock_vars = stock.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, stock_vars)
    n = len(op_calls)
    y, h = module.apply(variables, x, residual=r)
    assert op_calls[n].get("residual") is not None  # bfloat16 throughout: fused
    np.testing.assert_array_equal(h, x + r)
    assert_close(y, stock.apply(stock_vars, x + r), FORWARD[jnp.bfloat16], "linen")


def test_layer_offset_arguments_are_checked():
    with pytest.raises(ValueError, match="scale_offset=1.0 needs use_scale=True"):
        RMSNorm(8, use_scale=False, scale_offset=1.0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="scale_offset must be a real number"):
        LayerNorm(8, scale_offset="1", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs use_scale=True"):
        LinenRMSNorm(use_scale=False, scale_offset=1.0).init(jax.random.key(0), X)
    # Flax's own path (two reduction axes) has no offset: an error, not a silent 0.
    with pytest.raises(NotImplementedError, match="scale_offset=1.0 runs on the kernel path"):
        RMSNorm(8, scale_offset=1.0, reduction_axes=(-2, -1), rngs=nnx.Rngs(0))(X)


@pytest.mark.slow  # the row-wise rule itself is covered in CI by tests/test_sharding.py
def test_residual_norm_rows_sharded_run_locally():
    """On 8 devices with the rows sharded: both outputs and all gradients equal the
    single-device values; dscale ends in one all-reduce and nothing is gathered."""
    from jax.sharding import PartitionSpec as P

    from tests.test_sharding import AUTO, _normal, check
    x, r, scale = _normal(0, (16, 6, 40)), _normal(1, (16, 6, 40)), _normal(2, (40,), 0.5)

    def op(impl):
        def both(x, r, s):  # y and h both carry a cotangent
            y, h = rms_norm(x, s, residual=r, scale_offset=1.0, implementation=impl)
            return y + 2.0 * h
        return both

    check(op, (x, r, scale), (P("data"), P("data"), P()), mode=AUTO, argnums=(0, 1, 2),
          out_spec=P("data"), collective="all-reduce")
