"""Our Triton lowering keeps XLA's semantics at the edges.

Inputs are the values where a plain ``tl`` builtin and XLA disagree: NaN,
infinities, signed zeros, halfway ties, tiny arguments (log1p, expm1,
tanh), out-of-range float -> int conversions and shift amounts. Each kernel
runs through our lowering (in Triton's interpreter) and through the
interpret backend (XLA on the CPU); results must agree bit for bit where XLA
defines them exactly (NaN equal to NaN, the sign of zero included), and to a
few float32 ulps for the transcendental functions.

What the interpreter cannot show (it runs on numpy, where ``np.maximum``
keeps NaNs anyway) is checked in the PTX compiled for sm_90.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

pytest.importorskip("triton")
pytest.importorskip("torch")
# NaN, inf and overflow inputs are the point: numpy, under Triton's interpreter, warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_EDGES = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 1e-6, -1e-6, 1e-30, -1e-30, 3.0, -3.0, 1e4, -1e4,
          88.0, -88.0, 100.0, -100.0, np.inf, -np.inf, np.nan, 2.0**23 + 1, -(2.0**23 + 1), 0.7, -0.7,
          1e-3, 20.0, -20.0, 7.0, 4e9]
RNG = np.random.default_rng(0)
# Each edge value twice per row, in shuffled places; a second operand rolled against the first.
X = np.stack([RNG.permutation(_EDGES * 2) for _ in range(8)]).astype(np.float32)  # (8, 64)
Y = np.roll(X, 5, axis=1) * np.float32(-1.0)
I = np.resize(np.array([7, -7, 3, -3, 0, 1, -1, 2**31 - 1, -2**31, 5, -5, 100], np.int32), (8, 64))
J = np.resize(np.array([2, 2, -2, -2, 3, -3, 5, 7, 3, 1, -1, 9, 31, 32, 33, 0], np.int32), (8, 64))


def run_both(fn, *args):
    def kernel(*refs):
        refs[-1][...] = fn(*(r[...] for r in refs[:-1]))

    out = jax.eval_shape(fn, *args)
    return [np.asarray(pl.pallas_call(kernel, out_shape=out, backend=b)(*args)) for b in ("triton", "interpret")]


def assert_same_bits(got, want, rtol=0.0):
    """Equal, NaN for NaN and the sign of zero included (``rtol`` for approximations)."""
    if np.issubdtype(got.dtype, np.integer) or got.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    both_nan = np.isnan(got) & np.isnan(want)
    close = np.isclose(got, want, rtol=rtol, atol=0.0) & (np.signbit(got) == np.signbit(want))
    bad = ~(both_nan | close)
    assert not bad.any(), [(g, w) for g, w in zip(got[bad][:5], want[bad][:5])]


EXACT = {
    "round_half_even": lambda x, y: jnp.round(x),
    "round_away_from_zero": lambda x, y: jax.lax.round(x, jax.lax.RoundingMethod.AWAY_FROM_ZERO),
    "sign": lambda x, y: jnp.sign(x),
    "neg_keeps_signed_zero": lambda x, y: -x,
    "max_min_keep_nan": lambda x, y: jnp.maximum(x, y) * 2 + jnp.minimum(x, y),
    "clip_keeps_nan": lambda x, y: jax.lax.clamp(-1.0, x, 1.0),
    "reduce_max_min_keep_nan": lambda x, y: jnp.max(x, axis=1, keepdims=True) + jnp.min(y, axis=1, keepdims=True),
    "argmax_argmin_pick_nan": lambda x, y: jnp.argmax(x, axis=1) * 100 + jnp.argmin(y, axis=1),
    "cummax_keeps_nan": lambda x, y: jax.lax.cummax(x, axis=1),
    "is_finite": lambda x, y: jnp.isfinite(x) & ~jnp.isnan(y),
    "to_int32_saturates": lambda x, y: x.astype(jnp.int32),
    "to_uint8_saturates": lambda x, y: x.astype(jnp.uint8),
    "bf16_to_int16_saturates": lambda x, y: x.astype(jnp.bfloat16).astype(jnp.int16),
    "to_bool": lambda x, y: x.astype(jnp.bool_),
    "bitcast": lambda x, y: jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.int32) ^ 1, jnp.float32),
}

APPROXIMATE = {  # float32 ulps of slack, for transcendental functions computed another way
    "log1p": lambda x, y: jnp.log1p(x),
    "expm1": lambda x, y: jnp.expm1(x),
    "tanh": lambda x, y: jnp.tanh(x),
    "pow": lambda x, y: jax.lax.pow(jnp.abs(x), jnp.clip(y, -4.0, 4.0)),
    "pow_negative_base_integral_exponent": lambda x, y: jax.lax.pow(x, jnp.clip(jnp.round(y), -3.0, 3.0)),
    "tan": lambda x, y: jnp.tan(jnp.clip(x, -1.5, 1.5)),
}

INTEGER = {
    "shift_left": lambda a, b: jax.lax.shift_left(a, b),
    "shift_left_literal_past_width": lambda a, b: jax.lax.shift_left(a, 33) + jax.lax.shift_left(a, 4),
    "shift_right_arithmetic": lambda a, b: jax.lax.shift_right_arithmetic(a, b),
    "shift_right_logical": lambda a, b: jax.lax.shift_right_logical(a, b),
    "div_rem_truncate": lambda a, b: jax.lax.div(a, jnp.where(b == 0, 1, b)) * 1000 + jax.lax.rem(a, jnp.where(b == 0, 1, b)),
    "reduce_and_or_xor": lambda a, b: (jax.lax.reduce_and_p.bind(a, axes=(1,)) + jax.lax.reduce_or_p.bind(b, axes=(1,))
                                        + jax.lax.reduce_xor_p.bind(a ^ b, axes=(1,))),
    "cumprod_prod": lambda a, b: jnp.cumprod(jnp.clip(b, -2, 2), axis=1) + jnp.prod(jnp.clip(a, -1, 1), axis=1, keepdims=True),
    "integer_pow": lambda a, b: jnp.clip(a, -5, 5) ** 5 + b ** 2,
    "sign_abs": lambda a, b: jnp.sign(a) * 3 + jnp.abs(b),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_float_semantics(name):
    assert_same_bits(*run_both(EXACT[name], X, Y))


@pytest.mark.parametrize("name", sorted(APPROXIMATE))
def test_transcendentals_keep_relative_accuracy_near_zero(name):
    # log(1 + x) would be off by up to 5% at x = 1e-6 and zero at 1e-30; these must not be.
    assert_same_bits(*run_both(APPROXIMATE[name], X, Y), rtol=8 * 2.0**-23)


@pytest.mark.parametrize("name", sorted(INTEGER))
def test_integer_semantics(name):
    assert_same_bits(*run_both(INTEGER[name], I, J))


def test_bfloat16_arithmetic_dot_and_rounding():
    """Triton's interpreter mishandles bf16 (pallas_core.triton.interpreter_fixes); GPUs do not."""
    a = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (64, 16), jnp.bfloat16)
    fns = {
        "bf16 dot": lambda a, b: jnp.dot(a, b),
        "bf16 dot, f32 out": lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32),
        "rounding to bf16": lambda a, b: (a.astype(jnp.float32) * 1.001).astype(jnp.bfloat16),
        "bf16 arithmetic and comparisons": lambda a, b: jnp.where(a > -0.5, a * 50 - a / 3, -a) + (a < -a),
        "int <-> bf16": lambda a, b: (a * 50).astype(jnp.int32).astype(jnp.bfloat16) + jnp.arange(64).astype(jnp.bfloat16),
    }
    for what, fn in fns.items():
        got, want = run_both(fn, a, b)
        # XLA on the CPU may keep a chain of bf16 ops in float32 (excess precision);
        # Triton rounds after each, as bf16 hardware does: one bf16 ulp apart.
        rtol = 2.0**-7 if what == "bf16 arithmetic and comparisons" else 1e-6
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=rtol, atol=1e-6,
                                   err_msg=what)


def test_float_max_min_keep_nans_on_the_gpu():
    """On a GPU a plain tl.maximum drops NaNs (max.f32); ours must compile to max.NaN.f32."""
    sds = jax.ShapeDtypeStruct((16, 32), jnp.float32)

    def kernel(x_ref, y_ref, o_ref):
        x, y = x_ref[...], y_ref[...]
        o_ref[...] = jnp.maximum(x, y) + jnp.minimum(x, y) + jnp.max(x, axis=1, keepdims=True)

    f = lambda x, y: pl.pallas_call(kernel, out_shape=sds, backend="triton")(x, y)
    (report,) = pl.triton.compile(f, sds, sds, target="sm_90")
    ops = set(re.findall(r"\b((?:max|min)(?:\.\w+)*)\b", report["asm"]["ptx"]))
    float_ops = {op for op in ops if op.endswith("f32")}
    assert float_ops and all(".NaN" in op for op in float_ops), ops


def test_every_semantic_fix_compiles_for_sm90():
    """The helpers above run in the interpreter; they must also build for the GPU."""
    sds = jax.ShapeDtypeStruct((8, 64), jnp.float32)

    def kernel(x_ref, y_ref, i_ref, j_ref, o_ref, n_ref):
        x, y = x_ref[...], y_ref[...]
        floats = [fn(x, y) for fn in (*EXACT.values(), *APPROXIMATE.values())]
        o_ref[...] = sum(jnp.broadcast_to(f.astype(jnp.float32).reshape(8, -1), (8, 64)) for f in floats)
        n_ref[...] = sum(jnp.broadcast_to(fn(i_ref[...], j_ref[...]).reshape(8, -1), (8, 64))
                         for fn in INTEGER.values())

    ints = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    f = lambda *a: pl.pallas_call(kernel, out_shape=(sds, ints), backend="triton")(*a)
    (report,) = pl.triton.compile(f, sds, sds, ints, ints, target="sm_90")
    assert "cubin" in report["asm"]


def test_our_reductions_and_scans_never_run_element_by_element(monkeypatch):
    """Triton's interpreter runs our combine functions with numpy (interpreter_fixes), keeping
    the semantics above: its element-by-element path, which took about a second per small
    reduction, must never be taken for them."""
    from triton.runtime import interpreter

    def refuse(*args, **kwargs):
        raise AssertionError("Triton's interpreter reduced element by element")

    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", refuse)
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", refuse)
    floats = [EXACT["reduce_max_min_keep_nan"], EXACT["argmax_argmin_pick_nan"], EXACT["cummax_keeps_nan"],
              lambda x, y: jnp.sum(x, axis=1) + jnp.sum(y),
              lambda x, y: jax.lax.cummin(x, axis=1) + jnp.cumsum(y, axis=0),
              lambda x, y: jnp.max(x.astype(jnp.bfloat16), axis=0) + jnp.argmin(y.astype(jnp.bfloat16), axis=0)]
    for fn in floats:
        assert_same_bits(*run_both(fn, X, Y))
    for fn in (INTEGER["reduce_and_or_xor"], INTEGER["cumprod_prod"], lambda a, b: jnp.sum(a, axis=0) + jnp.max(b)):
        assert_same_bits(*run_both(fn, I, J))


def test_bfloat16_softmax_with_masked_load():
    """The bfloat16 softmax idiom of GPU kernel libraries (masked load filled with -inf, max,
    exp, sum) runs on our lowering and agrees with the interpret backend (it once
    failed in Triton's interpreter with an OverflowError on bfloat16 bit patterns)."""
    x = jax.random.normal(jax.random.key(0), (16, 128), jnp.bfloat16) * 4

    def softmax(x_ref, o_ref):
        col = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 1)
        v = pl.load(x_ref, (slice(None), slice(None)), mask=col < 100, other=-jnp.inf)
        # Subtract in float32: XLA on the CPU keeps a bfloat16 ``v - m`` in float32 (excess
        # precision) where the GPU rounds it, and exp turns one bfloat16 ulp into percents.
        m = jnp.max(v, axis=1, keepdims=True)
        e = jnp.exp(v.astype(jnp.float32) - m.astype(jnp.float32))
        o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)

    got, want = (np.asarray(pl.pallas_call(softmax, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                           backend=b)(x), np.float32) for b in ("triton", "interpret"))
    assert np.all(got[:, 100:] == 0) and np.all(want[:, 100:] == 0)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)  # one bfloat16 rounding apart
