"""ops layer_norm / rms_norm and the LayerNorm / RMSNorm layers (NNX and Linen).

Kernels run through the interpreter against the float32 XLA reference on
shapes that do not divide the blocks (13 rows; 1000 features, a masked last
chunk; multi-chunk rows forced with max_chunk), both variance formulas
(``use_fast_variance``), and lower for TPU and CUDA from this CPU host. The
layers are held to stock Flax: the same output dtype for every combination
of input dtype, ``dtype``, ``param_dtype``, ``promote_dtype``,
``use_fast_variance`` and mask, the same bits with ``implementation="xla"``,
and with the Pallas kernels (interpret) the same bits where the float32 sums
are exact, within ``tolerances.FLAX_NORM_ULPS`` elsewhere. Interpreter
compiles dominate the run time, so the shapes are few and reused.
"""
from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st
from jax import lax

import layers.linen_norms
import layers.norms
from layers.linen_norms import LayerNorm as LinenLayerNorm, RMSNorm as LinenRMSNorm
from layers.norms import LayerNorm, RMSNorm
from ops.reduction import norms
from ops.reduction.norms import layer_norm, reference, rms_norm
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close, assert_row_ulps, for_dtype

OPS = {"layer_norm": True, "rms_norm": False}  # name -> center


def run(op, x, scale, bias, fast=False, **kw):
    """The op under test; rms_norm ignores ``bias`` and ``fast`` (it has neither)."""
    if op == "layer_norm":
        return layer_norm(x, scale, bias, use_fast_variance=fast, **kw)
    return rms_norm(x, scale, **kw)


def ref32(op, x, scale, bias, fast=False):
    """The float32 reference on the (possibly 16-bit) inputs, upcast."""
    up = lambda a: None if a is None else a.astype(jnp.float32)
    return reference(up(x), up(scale), up(bias) if OPS[op] else None, center=OPS[op],
                     use_fast_variance=fast and OPS[op])


def draw(rng, shape, dtype=jnp.float32, with_params=True):
    """x with a non-zero mean (so centering matters), scale around 1, bias around 0."""
    f = shape[-1]
    x = 2.0 * rng.standard_normal(shape, np.float32) + 0.5
    scale = 1.0 + 0.5 * rng.standard_normal((f,), np.float32) if with_params else None
    bias = 0.5 * rng.standard_normal((f,), np.float32) if with_params else None
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in (x, scale, bias))


def make_inputs(seed, shape, dtype=jnp.float32, with_params=True):
    return draw(np.random.default_rng(seed), shape, dtype, with_params)


# --------------------------------------------------------------------------
# The op battery (tests/op_battery.py): forward and gradients against the float32
# reference on 13 rows (a partial row block) of 1000 features (one chunk of 1024 with
# its last columns masked; four chunks of 256, the last masked) and 14 rows of 384
# (three exact chunks, no params); every dtype; bad input
# --------------------------------------------------------------------------

ALL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def norm_cases(fast: bool):
    return [
        Case("four_chunks_masked", dict(lead=(13,), features=1000), tiles=dict(max_chunk=256),
             dtypes=ALL_DTYPES),
        Case("one_chunk_masked", dict(lead=(13,), features=1000), tiles=dict(max_chunk=None),
             grads=False),
        Case("three_chunks_no_params" + ("_fast_variance" if fast else ""),
             dict(lead=(2, 7), features=384, params=False), tiles=dict(max_chunk=128),
             options=dict(use_fast_variance=True) if fast else {}),
        Case("default_chunk_bf16", dict(lead=(13,), features=1000), tiles=dict(max_chunk=None),
             dtypes=(jnp.bfloat16,)),
        Case("no_rows", dict(lead=(0,), features=24)),
    ]


def _layer_norm_inputs(rng, dtype, lead, features, params=True):
    return draw(rng, (*lead, features), dtype, params)


def _rms_norm_inputs(rng, dtype, lead, features, params=True):
    return draw(rng, (*lead, features), dtype, params)[:2]


X = jnp.ones((4, 8), jnp.float32)
P = jnp.ones((8,), jnp.float32)


def _bad(name, args, kwargs, error, argument, match):
    return BadInput(name, args, kwargs, error, argument, match)


COMMON_BAD = [  # (name, args after x, kwargs, error, argument, match) for both norms
    ("list_x", ([[1.0]],), {}, TypeError, "x", r"x must be a JAX or NumPy array"),
    ("int_x", (X.astype(jnp.int32),), {}, TypeError, "x", r"x has dtype int32"),
    ("scalar_x", (jnp.float32(1.0),), {}, ValueError, "x", r"x must have rank >= 1"),
    ("no_features", (jnp.ones((3, 0)),), {}, ValueError, "features", r"features\) must be >= 1"),
    ("negative_epsilon", (X,), {"epsilon": -1e-5}, ValueError, "epsilon", r"epsilon must be >= 0"),
    ("nan_epsilon", (X,), {"epsilon": float("nan")}, ValueError, "epsilon", r"epsilon must be >= 0"),
    ("string_epsilon", (X,), {"epsilon": "1e-6"}, TypeError, "epsilon",
     r"epsilon must be a static real number"),
    ("max_chunk", (X,), {"max_chunk": 100}, ValueError, "max_chunk",
     r"max_chunk must be None or a power of two"),
    ("mosaic_gpu", (X,), {"implementation": "mosaic_gpu"}, NotImplementedError, "implementation",
     r"has no kernel yet"),
]

LAYER_NORM_BAD = [_bad(*case) for case in COMMON_BAD] + [
    _bad("scale_shape", (X, jnp.ones((9,))), {}, ValueError, "scale",
         r"layer_norm: scale must have shape \[features\] = \(8,\)"),
    _bad("bias_shape", (X, P, jnp.ones((1, 8))), {}, ValueError, "bias",
         r"bias must have shape \[features\]"),
    _bad("int_scale", (X, P.astype(jnp.int32)), {}, TypeError, "scale",
         r"layer_norm: scale has dtype int32"),
    _bad("float64_bias", (X, P, np.ones(8, np.float64)), {}, TypeError, "bias",
         r"bias has dtype float64"),
    _bad("list_scale", (X, [1.0] * 8), {}, TypeError, "scale", r"scale must be a JAX or NumPy array"),
    _bad("int_fast_variance", (X,), {"use_fast_variance": 1}, TypeError, "use_fast_variance",
         r"use_fast_variance must be a bool"),
    _bad("none_fast_variance", (X,), {"use_fast_variance": None}, TypeError, "use_fast_variance",
         r"use_fast_variance must be a bool"),
]

RMS_NORM_BAD = [_bad(*case) for case in COMMON_BAD] + [
    _bad("scale_shape", (X, jnp.ones((8, 1))), {}, ValueError, "scale",
         r"rms_norm: scale must have shape"),
    _bad("complex_scale", (X, P.astype(jnp.complex64)), {}, TypeError, "scale",
         r"rms_norm: scale has dtype complex64"),
    _bad("fast_variance", (X,), {"use_fast_variance": True}, TypeError, "use_fast_variance",
         r"unexpected keyword argument 'use_fast_variance'"),
]

LAYER_NORM = OpSpec(
    name="layer_norm", op=layer_norm, make_inputs=_layer_norm_inputs, cases=norm_cases(True),
    reference=lambda x, s, b, use_fast_variance=False: reference(
        x, s, b, center=True, use_fast_variance=use_fast_variance),
    grad_argnums=(0, 1, 2), bad_inputs=LAYER_NORM_BAD)

RMS_NORM = OpSpec(
    name="rms_norm", op=rms_norm, make_inputs=_rms_norm_inputs, cases=norm_cases(False),
    reference=lambda x, s: reference(x, s, center=False), grad_argnums=(0, 1),
    bad_inputs=RMS_NORM_BAD)


class TestLayerNorm(OpBattery):
    spec = LAYER_NORM


class TestRmsNorm(OpBattery):
    spec = RMS_NORM


def test_forward_is_stable_for_a_large_mean():
    """Chunked Welford/Chan statistics keep full precision where E[x^2] - E[x]^2 would not."""
    x = 0.1 * jax.random.normal(jax.random.key(2), (8, 1000), jnp.float32) + 1000.0
    x64 = np.asarray(x, np.float64)
    centered = x64 - x64.mean(-1, keepdims=True)
    exact = centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-6)
    y = layer_norm(x, implementation="interpret", max_chunk=256)
    # x itself is rounded to float32 near 1000 (ulp 6e-5, std 0.1): ~1e-3 is the floor.
    np.testing.assert_allclose(np.asarray(y), exact, atol=3e-3)


def test_default_on_cpu_is_the_reference():
    x, s, b = make_inputs(3, (4, 6, 40))
    np.testing.assert_array_equal(layer_norm(x, s, b, use_fast_variance=True),
                                  reference(x, s, b, center=True, use_fast_variance=True))
    np.testing.assert_array_equal(layer_norm(x, s, b, epsilon=1e-3),
                                  reference(x, s, b, epsilon=1e-3, center=True))


def test_jit_vmap_and_constant_rows():
    x, s, b = make_inputs(4, (3, 5, 300))
    f = jax.jit(jax.vmap(lambda x: layer_norm(x, s, b, implementation="interpret",
                                              max_chunk=128)))
    assert_close(f(x), ref32("layer_norm", x, s, b), FORWARD[jnp.float32], "jit(vmap)")
    # A constant row has zero variance: the output is exactly the bias, not NaN.
    const = jnp.full((3, 200), 7.0)
    np.testing.assert_array_equal(layer_norm(const, None, b[:200], implementation="interpret",
                                             max_chunk=128), jnp.broadcast_to(b[:200], (3, 200)))


def grads_vs_reference(op, x, s, b, fast=False, **kw):
    cot = jax.random.normal(jax.random.key(9), x.shape, jnp.float32)
    loss = lambda fn: (lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot))
    argnums = tuple(i for i, a in enumerate((x, s, b)) if a is not None
                    and (i < 2 or OPS[op]))
    ours = jax.grad(loss(lambda *a: run(op, *a, fast, implementation="interpret", **kw)),
                    argnums)(x, s, b)
    up = [None if a is None else a.astype(jnp.float32) for a in (x, s, b)]
    expected = jax.grad(loss(lambda *a: ref32(op, *a, fast)), argnums)(*up)
    return [("xsb"[i], (x, s, b)[i]) for i in argnums], ours, expected


# --------------------------------------------------------------------------
# use_fast_variance: Flax's max(0, E[x**2] - E[x]**2)
# --------------------------------------------------------------------------

def test_fast_variance_forward_and_gradients_with_mixed_dtypes():
    """Running sums over four chunks (the last masked), and params whose dtypes differ
    from x's and from each other's; every gradient in its argument's dtype."""
    x_dtype, max_chunk = jnp.bfloat16, 256
    x, s, b = make_inputs(20, (13, 1000))
    x, s, b = x.astype(x_dtype), s.astype(jnp.float32), b.astype(jnp.float16)
    y = layer_norm(x, s, b, use_fast_variance=True, implementation="interpret",
                   max_chunk=max_chunk)
    assert y.dtype == x_dtype
    assert_close(y, ref32("layer_norm", x, s, b, fast=True), for_dtype(FORWARD, x_dtype), "forward")
    names, ours, expected = grads_vs_reference("layer_norm", x, s, b, True, max_chunk=max_chunk)
    for (name, arg), g, e in zip(names, ours, expected):
        assert g.dtype == arg.dtype and g.shape == arg.shape, name
        assert_close(g, e, for_dtype(BACKWARD, x_dtype), f"d{name}")


def test_fast_variance_clip_and_its_gradient():
    """Rows whose E[x**2] - E[x]**2 rounds to <= 0 get variance 0, as Flax clips it,
    and the gradient of the clipped formula: the variance term of dx has the weight
    d max(0, v) / dv, 0 below the clip and 1/2 at a tie (JAX's jnp.maximum)."""
    f, eps = 256, 1e-6
    k = jax.random.split(jax.random.key(22), 4)
    # Variance 1e-6 next to E[x**2] = 1e6, whose ulp is 0.0625: v is rounding noise.
    x = 1000.0 + 1e-3 * jax.random.normal(k[0], (16, f))
    x = x.at[0].set(0.0)                                     # v == 0 exactly: the tie
    x = x.at[1].set(2.0 * jax.random.normal(k[1], (f,)))    # an ordinary row
    s = 1.0 + 0.5 * jax.random.normal(k[2], (f,))
    config = norms._Config(op="layer_norm", backend="interpret", center=True, epsilon=eps,
                           fast_variance=True)
    _, stats = norms._forward_call(x, s, None, config, want_stats=True)
    weight = np.asarray(stats["weight"])[:, 0]
    assert weight[0] == 0.5 and weight[1] == 1.0
    clipped = np.flatnonzero(weight == 0.0)
    assert clipped.size >= 2, weight  # about half of the noisy rows round below 0
    np.testing.assert_array_equal(np.asarray(stats["rstd"])[clipped, 0],
                                  np.float32(lax.rsqrt(jnp.float32(eps))))

    cot = jax.random.normal(k[3], x.shape)
    loss = lambda fn: (lambda x: jnp.sum(fn(x) * cot))
    dx = jax.grad(loss(lambda x: layer_norm(x, s, use_fast_variance=True,
                                            implementation="interpret")))(x)
    # Below the clip the variance is the constant 0: only the mean carries a gradient.
    clipped_formula = lambda x: (x - jnp.mean(x, -1, keepdims=True)) * (lax.rsqrt(eps) * s)
    expected_clipped = jax.grad(loss(clipped_formula))(x)
    expected = jax.grad(loss(lambda x: reference(x, s, epsilon=eps, use_fast_variance=True)))(x)
    assert_close(dx[clipped], expected_clipped[clipped], BACKWARD[jnp.float32], "dx clipped")
    assert_close(dx[:2], expected[:2], BACKWARD[jnp.float32], "dx tie and ordinary")


def test_fast_variance_on_triton():
    """Our Triton lowering (Triton's CPU interpreter): fast variance over three chunks,
    params of other dtypes than x, forward and all three gradients."""
    x = 3.0 * jax.random.normal(jax.random.key(23), (5, 300)) + 1.0
    s = jnp.linspace(0.5, 1.5, 300, dtype=jnp.bfloat16)
    b = jnp.linspace(-1.0, 1.0, 300)
    fn = lambda impl, max_chunk: (lambda *a: layer_norm(
        *a, use_fast_variance=True, implementation=impl, max_chunk=max_chunk))
    y, vjp = jax.vjp(fn("triton", 128), x, s, b)
    y_ref, vjp_ref = jax.vjp(fn("xla", None), x, s, b)
    assert_close(y, y_ref, FORWARD[jnp.float32], "forward")
    for name, g, e in zip("xsb", vjp(jnp.sin(y_ref)), vjp_ref(jnp.sin(y_ref))):
        assert g.dtype == e.dtype, name
        assert_close(g, e, for_dtype(BACKWARD, g.dtype), f"d{name}")


@settings(max_examples=3, deadline=None)
@given(rows=st.integers(1, 20), features=st.integers(1, 300),
       lead=st.lists(st.integers(1, 3), max_size=1), op=st.sampled_from(list(OPS)),
       max_chunk=st.sampled_from([None, 128]), with_params=st.booleans(),
       fast=st.booleans(), seed=st.integers(0, 2**16))
def test_property_forward_and_gradients(rows, features, lead, op, max_chunk, with_params, fast,
                                        seed):
    # E[x**2] - E[x]**2 is ill-conditioned on a row of a few features whose sample
    # variance happens to be tiny against its mean: there the kernel and the
    # reference round differently by design (ops.reduction.norms), so not below 8.
    fast = fast and features >= 8
    x, s, b = make_inputs(seed, (*lead, rows, features), with_params=with_params)
    y = run(op, x, s, b, fast, implementation="interpret", max_chunk=max_chunk)
    assert_close(y, ref32(op, x, s, b, fast), FORWARD[jnp.float32], "forward")
    if features <= (2 if OPS[op] else 1):
        # d/dx x / sqrt(x**2 + eps) = eps / (x**2 + eps)**1.5, ~1e-7 here, which both sides
        # can only compute as 1 - xhat**2: rounding noise, nothing to compare. LayerNorm of
        # two features is the same: its centred values are +-d/2, normalized to +-1.
        return
    names, ours, expected = grads_vs_reference(op, x, s, b, fast, max_chunk=max_chunk)
    for (name, _), g, e in zip(names, ours, expected):
        assert_close(g, e, BACKWARD[jnp.float32], f"d{name}")


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------

def test_traced_epsilon_is_refused():
    with pytest.raises(TypeError, match="epsilon must be a static real number"):
        jax.jit(lambda e: layer_norm(X, epsilon=e))(1e-6)


# --------------------------------------------------------------------------
# Lowering for TPU and CUDA from this CPU host
# --------------------------------------------------------------------------

PLATFORM = {"mosaic_tpu": ("tpu", "tpu_custom_call"),
            "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


def lower_text(fn, impl, *shapes_dtypes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(PLATFORM[impl][0],)).as_text()


@pytest.mark.parametrize("impl", list(PLATFORM))
@pytest.mark.parametrize("op, features, fast", [
    ("layer_norm", 1000, False), ("layer_norm", 5120, False),
    ("layer_norm", 1000, True), ("layer_norm", 5120, True),   # with float32 params
    ("rms_norm", 1000, False), ("rms_norm", 5120, False)])
def test_forward_and_backward_lower(impl, op, features, fast):
    def fwd(x, s, b):
        return run(op, x, s, b, fast, implementation=impl)

    def grads(x, s, b):
        argnums = (0, 1, 2) if OPS[op] else (0, 1)
        return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums)(x, s, b)

    params = jnp.float32 if fast else jnp.bfloat16
    specs = [((2, 300, features), jnp.bfloat16), ((features,), params), ((features,), params)]
    marker = PLATFORM[impl][1]
    text = lower_text(fwd, impl, *specs)
    assert text.count(marker) == 1 and f"{op}_fwd" in text
    text = lower_text(grads, impl, *specs)
    assert text.count(marker) == 2 and f"{op}_bwd" in text


# --------------------------------------------------------------------------
# Layers: NNX
# --------------------------------------------------------------------------

NF = 40
LAYER_SHAPE = (2, 5, NF)
INITS = dict(scale_init=jax.nn.initializers.normal(1.0))


def _flat(module):
    return list(nnx.to_flat_state(nnx.state(module)))


def assert_same_state(a, b):
    fa, fb = _flat(a), _flat(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, va), (_, vb) in zip(fa, fb):
        assert type(va) is type(vb), path
        assert va.get_metadata() == vb.get_metadata(), path
        assert va[...].dtype == vb[...].dtype, path
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(path))


def _close(a, b, tol=1e-5):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


class Calls(list):
    """The implementation of every op call the layers make, in order; ``fast`` holds
    each call's use_fast_variance (None for rms_norm, which has none)."""

    def __init__(self):
        super().__init__()
        self.fast = []


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the op calls the layers make (:class:`Calls`)."""
    calls = Calls()
    for module in (layers.norms, layers.linen_norms):
        for name in ("layer_norm", "rms_norm"):
            real = getattr(module, name)

            def spy(*args, _real=real, **kwargs):
                calls.append(kwargs.get("implementation"))
                calls.fast.append(kwargs.get("use_fast_variance"))
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return calls


NNX_PAIRS = [
    (LayerNorm, nnx.LayerNorm, dict(bias_init=jax.nn.initializers.normal(1.0), **INITS)),
    (RMSNorm, nnx.RMSNorm, INITS),
]


@pytest.mark.parametrize("ours, theirs, kw", NNX_PAIRS, ids=["LayerNorm", "RMSNorm"])
def test_nnx_state_and_attributes_identical(ours, theirs, kw):
    assert_same_state(ours(NF, rngs=nnx.Rngs(0), implementation="xla", **kw),
                      theirs(NF, rngs=nnx.Rngs(0), **kw))
    meta = dict(param_dtype=jnp.bfloat16, scale_metadata={"tag": "s"}, use_scale=True)
    if theirs is nnx.LayerNorm:
        meta.update(bias_metadata={"tag": "b"}, use_bias=False)
    a, b = ours(NF, rngs=nnx.Rngs(1), **meta), theirs(NF, rngs=nnx.Rngs(1), **meta)
    assert_same_state(a, b)
    for attr in ("num_features", "epsilon", "dtype", "param_dtype", "use_scale", "reduction_axes",
                 "feature_axes", "axis_name", "use_fast_variance", "promote_dtype"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.epsilon == 1e-6


@pytest.mark.parametrize("ours, theirs, kw", NNX_PAIRS, ids=["LayerNorm", "RMSNorm"])
def test_nnx_outputs_grads_and_state_loading(ours, theirs, kw, kernel_calls):
    flax_layer = theirs(NF, rngs=nnx.Rngs(2), **kw)
    layer = ours(NF, implementation="interpret", rngs=nnx.Rngs(3))
    x = make_inputs(10, LAYER_SHAPE)[0]
    nnx.update(layer, nnx.state(flax_layer))  # Flax's state loads unchanged
    _close(layer(x), flax_layer(x))
    assert kernel_calls == ["interpret"]
    ct = jax.random.normal(jax.random.key(11), LAYER_SHAPE)
    g_ours = nnx.grad(lambda m, x: jnp.sum(m(x) * ct), argnums=(0, 1))(layer, x)
    g_flax = nnx.grad(lambda m, x: jnp.sum(m(x) * ct), argnums=(0, 1))(flax_layer, x)
    _close(g_ours[1], g_flax[1], 1e-4)
    for name in ("scale", "bias"):
        if getattr(flax_layer, name, None) is not None:
            _close(g_ours[0][name][...], g_flax[0][name][...], 1e-4)


def test_nnx_fallback_configurations(kernel_calls):
    x = make_inputs(13, LAYER_SHAPE)[0]
    mask = jnp.arange(NF) < 30
    configs = [dict(reduction_axes=(1, 2), feature_axes=-1), dict(feature_axes=(1, 2))]
    for kw in configs:
        feats = 5 * NF if kw.get("feature_axes") == (1, 2) else NF
        a = LayerNorm(feats, implementation="interpret", rngs=nnx.Rngs(0), **kw)
        b = nnx.LayerNorm(feats, rngs=nnx.Rngs(0), **kw)
        _close(a(x), b(x))  # feature_axes (1, 2): Flax reshapes [5 * NF] params onto them
    _close(LayerNorm(NF, rngs=nnx.Rngs(0))(x, mask=mask), nnx.LayerNorm(NF, rngs=nnx.Rngs(0))(x, mask=mask))
    _close(RMSNorm(NF, rngs=nnx.Rngs(0))(x, mask), nnx.RMSNorm(NF, rngs=nnx.Rngs(0))(x, mask))
    assert kernel_calls == []


def test_nnx_bad_implementation():
    with pytest.raises(ValueError, match=r"layers.LayerNorm: invalid argument implementation='gpu'"):
        LayerNorm(NF, implementation="gpu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layers.RMSNorm: invalid argument implementation=3"):
        RMSNorm(NF, implementation=3, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------
# Layers: Linen
# --------------------------------------------------------------------------

LINEN_PAIRS = [
    (LinenLayerNorm, nn.LayerNorm, dict(bias_init=jax.nn.initializers.normal(1.0), **INITS)),
    (LinenRMSNorm, nn.RMSNorm, INITS),
]


@pytest.mark.parametrize("ours, theirs, kw", LINEN_PAIRS, ids=["LayerNorm", "RMSNorm"])
def test_linen_variables_outputs_and_grads(ours, theirs, kw, kernel_calls):
    x = make_inputs(14, LAYER_SHAPE)[0]
    flax_vars = theirs(**kw).init(jax.random.key(0), x)
    our_vars = ours(implementation="xla", **kw).init(jax.random.key(0), x)
    assert jax.tree.structure(flax_vars) == jax.tree.structure(our_vars)
    jax.tree.map(np.testing.assert_array_equal, flax_vars, our_vars)
    layer = ours(implementation="interpret", **kw)
    _close(layer.apply(flax_vars, x), theirs(**kw).apply(flax_vars, x))
    ct = jax.random.normal(jax.random.key(15), LAYER_SHAPE)
    loss = lambda m: (lambda v, x: jnp.sum(m.apply(v, x) * ct))
    g_ours = jax.grad(loss(layer), (0, 1))(flax_vars, x)
    g_flax = jax.grad(loss(theirs(**kw)), (0, 1))(flax_vars, x)
    jax.tree.map(lambda a, b: _close(a, b, 1e-4), g_ours, g_flax)
    assert kernel_calls == ["xla", "interpret", "interpret"]


@pytest.mark.parametrize("ours, theirs", [(LinenLayerNorm, nn.LayerNorm), (LinenRMSNorm, nn.RMSNorm)],
                         ids=["LayerNorm", "RMSNorm"])
def test_linen_fallbacks_follow_flax(ours, theirs, kernel_calls):
    # Configurations the kernel does not cover run Flax's own computation.
    x = make_inputs(16, LAYER_SHAPE)[0]
    for kw in (dict(reduction_axes=(1, 2)), dict(force_float32_reductions=False)):
        v = theirs(**kw).init(jax.random.key(2), x)
        _close(ours(**kw).apply(v, x), theirs(**kw).apply(v, x))
    assert kernel_calls == []
    with pytest.raises(ValueError, match=r"invalid argument implementation='tpu'"):
        ours(implementation="tpu").init(jax.random.key(0), x)


def test_linen_applied_variables_decide_the_dtypes(kernel_calls):
    """Variables of another dtype than param_dtype (float32 into a bf16 module) count with
    their own dtype, as in Flax; complex ones, which the kernel does not take, run Flax's
    own computation."""
    x = make_inputs(17, LAYER_SHAPE, jnp.bfloat16)[0]
    kw = dict(param_dtype=jnp.bfloat16, bias_init=jax.nn.initializers.normal(1.0), **INITS)
    v32 = nn.LayerNorm(**kw).init(jax.random.key(4), x.astype(jnp.float32))
    v32 = jax.tree.map(lambda a: a.astype(jnp.float32), v32)
    y = LinenLayerNorm(implementation="xla", **kw).apply(v32, x)
    ref = nn.LayerNorm(**kw).apply(v32, x)
    assert y.dtype == ref.dtype == jnp.float32
    np.testing.assert_array_equal(y, ref)
    assert kernel_calls == ["xla"]
    vc = jax.tree.map(lambda a: a.astype(jnp.complex64), v32)
    y, ref = LinenLayerNorm(**kw).apply(vc, x), nn.LayerNorm(**kw).apply(vc, x)
    assert y.dtype == ref.dtype == jnp.complex64
    np.testing.assert_array_equal(y, ref)
    assert kernel_calls == ["xla"]


# --------------------------------------------------------------------------
# Layers against stock Flax: the output dtype of every dtype combination, the
# bits on "xla"; on the Pallas kernels (interpret) the bits where the sums are
# exact, FLAX_NORM_ULPS elsewhere
# --------------------------------------------------------------------------

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def keep_dtypes(args, **kwargs):
    """A mixed-precision ``promote_dtype``: x and the params keep their own dtypes."""
    return args


def layer_input(features, dtype, rows=5):
    """Rows standardized to mean 0.5 and standard deviation 2, so |mean| <= std in each
    (the condition of FLAX_NORM_ULPS); 5 rows: a full block of 4 and a partial one."""
    z = jax.random.normal(jax.random.key(30), (rows, features))
    z = (z - z.mean(-1, keepdims=True)) / z.std(-1, keepdims=True)
    return (0.5 + 2.0 * z).astype(dtype)


def _scale_init(key, shape, dtype):
    return (1.0 + 0.5 * jax.random.normal(key, shape)).astype(dtype)


def layer_kwargs(name, **kw):
    """Constructor arguments with a non-trivial scale (and bias for LayerNorm)."""
    kw = dict(kw, scale_init=_scale_init)
    if name == "LayerNorm":
        kw["bias_init"] = jax.nn.initializers.normal(0.5)
    return kw


def assert_same_bits(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                                  err_msg=what)


NNX_MODULES = {"LayerNorm": (LayerNorm, nnx.LayerNorm), "RMSNorm": (RMSNorm, nnx.RMSNorm)}
LINEN_MODULES = {"LayerNorm": (LinenLayerNorm, nn.LayerNorm), "RMSNorm": (LinenRMSNorm, nn.RMSNorm)}
MASK = jnp.arange(NF) < 30
# (use_fast_variance, mask): a mask makes the layers run Flax's own __call__ whatever
# the variance form, so it is checked with Flax's default form only.
FAST_AND_MASK = [(True, None), (False, None), (True, MASK)]


@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", NNX_MODULES)
def test_nnx_dtypes_and_bits_match_flax_on_xla(name, x_dtype, kernel_calls):
    """Every (dtype, param_dtype, promote_dtype, use_fast_variance, mask): Flax's dtype and bits."""
    ours, theirs = NNX_MODULES[name]
    x = layer_input(NF, x_dtype)
    grid = [(*dtypes, fast, mask) for *dtypes, (fast, mask) in itertools.product(
        [None, *DTYPES], [jnp.float32, jnp.bfloat16], [None, keep_dtypes], FAST_AND_MASK)]
    for dtype, param_dtype, promote, fast, mask in grid:
        kw = layer_kwargs(name, dtype=dtype, param_dtype=param_dtype, use_fast_variance=fast)
        if promote is not None:
            kw["promote_dtype"] = promote
        a = ours(NF, implementation="xla", rngs=nnx.Rngs(0), **kw)
        b = theirs(NF, rngs=nnx.Rngs(0), **kw)
        assert_same_bits(a(x, mask=mask), b(x, mask=mask), f"{name}({kw}, mask={mask is not None})")
    # Masked calls run Flax's own __call__; the rest run the op, with the flag.
    assert kernel_calls.fast == [fast if name == "LayerNorm" else None
                                 for *_, fast, mask in grid if mask is None]
    assert kernel_calls == ["xla"] * len(kernel_calls.fast)


@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", LINEN_MODULES)
def test_linen_dtypes_and_bits_match_flax_on_xla(name, x_dtype, kernel_calls):
    """Every (dtype, param_dtype, use_fast_variance, mask): Flax's dtype and bits."""
    ours, theirs = LINEN_MODULES[name]
    x = layer_input(NF, x_dtype)
    grid = [(*dtypes, fast, mask) for *dtypes, (fast, mask) in itertools.product(
        [None, *DTYPES], [jnp.float32, jnp.bfloat16], FAST_AND_MASK)]
    for dtype, param_dtype, fast, mask in grid:
        kw = layer_kwargs(name, dtype=dtype, param_dtype=param_dtype, use_fast_variance=fast)
        v = theirs(**kw).init(jax.random.key(1), x)
        assert_same_bits(ours(implementation="xla", **kw).apply(v, x, mask=mask),
                         theirs(**kw).apply(v, x, mask=mask),
                         f"{name}({kw}, mask={mask is not None})")
    assert kernel_calls.fast == [fast if name == "LayerNorm" else None
                                 for *_, fast, mask in grid if mask is None]
    assert kernel_calls == ["xla"] * len(kernel_calls.fast)


# (x dtype, dtype, param_dtype, promote_dtype, features, use_fast_variance): the kernel
# signatures the layers make (x / param dtypes), every output dtype, one and two chunks
# (16-bit x upcast to a float32 output: EXACT_CASES).
KERNEL_CASES = {
    "f32": (jnp.float32, None, jnp.float32, None, 200, True),  # 200 of 256 columns: masked chunk
    "bf16": (jnp.bfloat16, None, jnp.bfloat16, None, 40, False),
    "f16-params-promoted": (jnp.float16, jnp.float16, jnp.float32, None, 200, True),
    "bf16-x-f32-params": (jnp.bfloat16, jnp.bfloat16, jnp.float32, keep_dtypes, 200, False),
    "f32-kernel-f16-out": (jnp.float32, jnp.float16, jnp.float32, keep_dtypes, 40, True),
    "f16-x-bf16-out": (jnp.float16, jnp.bfloat16, jnp.bfloat16, keep_dtypes, 200, True),
    "two-chunks-fast": (jnp.float32, None, jnp.float32, None, 2500, True),   # 2048 + 452
    "two-chunks-two-pass": (jnp.float32, None, jnp.float32, None, 2500, False),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_nnx_kernels_match_flax_within_ulps(case, kernel_calls):
    x_dtype, dtype, param_dtype, promote, features, fast = KERNEL_CASES[case]
    x = layer_input(features, x_dtype)
    names = ["LayerNorm", "RMSNorm"] if fast else ["LayerNorm"]  # RMSNorm has no variance form
    for name in names:
        ours, theirs = NNX_MODULES[name]
        kw = layer_kwargs(name, dtype=dtype, param_dtype=param_dtype, use_fast_variance=fast)
        if promote is not None:
            kw["promote_dtype"] = promote
        y = ours(features, implementation="interpret", rngs=nnx.Rngs(0), **kw)(x)
        flax_layer = theirs(features, rngs=nnx.Rngs(0), **kw)
        bias = flax_layer.bias[...] if name == "LayerNorm" else None
        assert_row_ulps(y, flax_layer(x), bias, f"{name}({kw})",
                        two_pass=not fast or name == "RMSNorm")
    assert kernel_calls == ["interpret"] * len(names)
    assert kernel_calls.fast == [fast, None][:len(names)]


# (module, features, use_fast_variance, x dtype, param_dtype, promote_dtype)
EXACT_CASES = {
    "LayerNorm-fast-masked-chunk": ("LayerNorm", 200, True, jnp.float32, jnp.float32, None),
    "LayerNorm-two-pass-bf16-x-f32-out": ("LayerNorm", 200, False, jnp.bfloat16, jnp.float32,
                                          keep_dtypes),
    "RMSNorm-masked-chunk": ("RMSNorm", 200, True, jnp.float32, jnp.float32, None),
    "LayerNorm-fast-two-chunks": ("LayerNorm", 4096, True, jnp.float32, jnp.float32, None),
    "RMSNorm-two-chunks": ("RMSNorm", 4096, True, jnp.float32, jnp.float32, None),
}


@pytest.mark.parametrize("case", EXACT_CASES)
def test_nnx_kernels_match_flax_bit_for_bit_when_sums_are_exact(case, kernel_calls):
    """Small integers whose row mean is exactly 2: every float32 row sum (of x, x**2 and
    (x - mean)**2) is exact in any order, and the kernels then give Flax's bits: the same
    operations in the same order. Both run under jit, where XLA fuses Flax's final
    ``y * mul + bias`` into one multiply-add as it does in the kernel (op by op it rounds
    twice; ops.reduction.norms). Not two-pass rows longer than one chunk: their Chan
    merge is another formula."""
    name, features, fast, x_dtype, param_dtype, promote = EXACT_CASES[case]
    r = jax.random.randint(jax.random.key(32), (5, features), -8, 9)
    r = r.at[:, -1].add(-jnp.sum(r, axis=-1))  # each row sums to 0
    x = (r + 2).astype(x_dtype)
    kw = layer_kwargs(name, param_dtype=param_dtype, use_fast_variance=fast)
    if promote is not None:
        kw["promote_dtype"] = promote
    ours, theirs = NNX_MODULES[name]
    call = nnx.jit(lambda module, x: module(x))
    assert_same_bits(call(ours(features, implementation="interpret", rngs=nnx.Rngs(5), **kw), x),
                     call(theirs(features, rngs=nnx.Rngs(5), **kw), x), case)
    assert kernel_calls == ["interpret"]


@pytest.mark.parametrize("name", LINEN_MODULES)
def test_linen_kernels_match_flax_within_ulps(name, kernel_calls):
    """bf16 x with float32 params and a bf16 output (Linen's mixed precision), fast variance."""
    ours, theirs = LINEN_MODULES[name]
    x = layer_input(200, jnp.bfloat16)
    kw = layer_kwargs(name, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    v = theirs(**kw).init(jax.random.key(3), x)
    assert_row_ulps(ours(implementation="interpret", **kw).apply(v, x), theirs(**kw).apply(v, x),
                    v["params"].get("bias"), name, two_pass=name == "RMSNorm")
    assert kernel_calls == ["interpret"]


def test_nnx_mixed_precision_gradients_match_flax():
    """Gradients through the kernels: bf16 x, float32 params kept float32 (a promote_dtype
    that keeps dtypes), bf16 output; dtypes and values as Flax's. Two-pass variance here,
    the default fast one in test_nnx_outputs_grads_and_state_loading."""
    kw = layer_kwargs("LayerNorm", dtype=jnp.bfloat16, promote_dtype=keep_dtypes,
                      use_fast_variance=False)
    ours = LayerNorm(NF, implementation="interpret", rngs=nnx.Rngs(4), **kw)
    theirs = nnx.LayerNorm(NF, rngs=nnx.Rngs(4), **kw)
    x = layer_input(NF, jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(31), x.shape)
    loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) * ct)
    (g_ours, gx_ours), (g_flax, gx_flax) = (nnx.grad(loss, argnums=(0, 1))(m, x)
                                            for m in (ours, theirs))
    assert gx_ours.dtype == gx_flax.dtype == jnp.bfloat16
    assert_close(gx_ours, gx_flax, BACKWARD[jnp.bfloat16], "dx")
    for p in ("scale", "bias"):
        assert g_ours[p][...].dtype == g_flax[p][...].dtype == jnp.float32, p
        assert_close(g_ours[p][...], g_flax[p][...], BACKWARD[jnp.float32], f"d{p}")
