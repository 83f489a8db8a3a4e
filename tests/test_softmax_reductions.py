"""ops.reduction: softmax / log_softmax / logsumexp and sum / mean / max.

Forward and gradients through the interpreter against the float32 XLA
reference, on shapes that divide neither the row block nor the chunk, with
multi-chunk rows forced by the ``max_chunk=`` test hook; lowering for TPU and
CUDA from this CPU host. Interpreter compiles dominate the run time, so the
tests share a few shapes.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings, strategies as st

from ops.reduction import reduce as red
from ops.reduction._rows import online_logsumexp_update
from ops.reduction.softmax import log_softmax, logsumexp, softmax
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.op_test_case import OpTestCase
from tests.tolerances import BACKWARD, FORWARD, assert_close

FAMILY = {"softmax": softmax, "log_softmax": log_softmax, "logsumexp": logsumexp}
JAX_FAMILY = {"softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax,
              "logsumexp": jax.nn.logsumexp}
REDUCE = {"sum": red.sum, "mean": red.mean, "max": red.max}
JNP_REDUCE = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}

# 39 rows (not a multiple of the 4-row block) of 1000 features: with
# max_chunk=256 a row takes four chunks, the last one masked (232 of 256).
SHAPE = (3, 13, 1000)
CHUNK = 256


def inputs(shape, dtype, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)


def ref32(mode, x, axis=-1):
    return JAX_FAMILY[mode](x.astype(jnp.float32), axis=axis)


def out_and_grad(fn, x, cot, mask=True):
    """``fn(x)`` and the gradient of ``sum(where(mask, fn(x), 0) * cot)``, from one compile."""
    def loss(x):
        out = fn(x)
        return jnp.sum(jnp.where(mask, out.astype(jnp.float32), 0) * cot), out
    (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return out, grad


def ours(mode, **kw):
    """The op through the interpreter. Tests jit what they run: one compile
    instead of many op-by-op dispatches keeps the file fast."""
    return lambda x, axis=-1: FAMILY[mode](x, axis, implementation="interpret", **kw)


# ---- the op battery (tests/op_battery.py) -----------------------------------------------

def _battery_inputs(rng, dtype, shape):
    return (jnp.asarray(3.0 * rng.standard_normal(shape, np.float32), dtype),)


ALL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ROWS = dict(shape=SHAPE)
FAMILY_CASES = {  # mode -> cases beyond the shared ones: other axes on a (4, 6, 130) input
    "softmax": [Case("axis_0", dict(shape=(4, 6, 130)), dict(axis=0)),
                Case("axes_0_2", dict(shape=(4, 6, 130)), dict(axis=(0, 2)), grads=False),
                Case("every_axis", dict(shape=(4, 6, 130)), dict(axis=None), grads=False),
                Case("no_rows", dict(shape=(0, 5)), dict(axis=-1))],
    "log_softmax": [Case("axis_minus_2", dict(shape=(4, 6, 130)), dict(axis=-2), grads=False)],
    "logsumexp": [Case("axes_1_0", dict(shape=(4, 6, 130)), dict(axis=(1, 0)), grads=False),
                  Case("every_axis", dict(shape=(4, 6, 130)), dict(axis=None), grads=False)],
}
REDUCE_CASES = {  # kind -> (axis, ...) on SHAPE, forward and gradient in float32
    "sum": [None, -1, 1, (0, 2)], "mean": [(-1, 0), 0], "max": [None, -1, (2, 1)],
}

X = jnp.ones((4, 8), jnp.float32)
BAD_INPUTS = [
    BadInput("axis_too_large", (X, 2), {}, ValueError, "axis", r"axis 2 is out of range for x of rank 2"),
    BadInput("axis_too_small", (X, -3), {}, ValueError, "axis", r"axis -3 is out of range"),
    BadInput("axis_repeated", (X, (0, -2)), {}, ValueError, "axis",
             r"axis \(0, -2\) names the same axis more than once"),
    BadInput("axis_float", (X, 1.0), {}, TypeError, "axis", r"axis must be None, an int or a tuple of ints"),
    BadInput("int_x", (X.astype(jnp.int32),), {}, TypeError, "x", r"x has dtype int32; expected one of float32"),
    BadInput("list_x", ([[1.0]],), {}, TypeError, "x", r"x must be a JAX or NumPy array"),
    BadInput("mosaic_gpu", (X,), {"implementation": "mosaic_gpu"}, NotImplementedError, "implementation",
             r"has no kernel yet"),
    BadInput("max_chunk", (X,), {"max_chunk": 100}, ValueError, "max_chunk",
             r"max_chunk must be None or a power of two >= 128"),
]


def _family_spec(mode):
    cases = [Case("chunks_masked", ROWS, dict(axis=-1), tiles=dict(max_chunk=CHUNK), dtypes=ALL_DTYPES),
             Case("one_chunk", ROWS, dict(axis=-1), tiles=dict(max_chunk=None), grads=False),
             *FAMILY_CASES[mode]]
    return OpSpec(name=mode, op=FAMILY[mode], reference=JAX_FAMILY[mode], make_inputs=_battery_inputs,
                  cases=cases, tiles={"interpret": dict(max_chunk=128)}, bad_inputs=BAD_INPUTS,
                  eager_case="one_chunk")


def _reduce_spec(kind):
    cases = [Case(f"axis_{axis}", ROWS, dict(axis=axis)) for axis in REDUCE_CASES[kind]]
    cases.append(Case("rows_16bit", ROWS, dict(axis=-1), dtypes=(jnp.bfloat16, jnp.float16),
                      grads=False))
    cases.append(Case("no_rows", dict(shape=(0, 4)), dict(axis=-1)))
    return OpSpec(name=kind, op=REDUCE[kind], reference=JNP_REDUCE[kind],
                  make_inputs=_battery_inputs, cases=cases, tiles={"interpret": dict(max_chunk=CHUNK)},
                  bad_inputs=BAD_INPUTS)


class TestSoftmax(OpBattery):
    spec = _family_spec("softmax")


class TestLogSoftmax(OpBattery):
    spec = _family_spec("log_softmax")


class TestLogsumexp(OpBattery):
    spec = _family_spec("logsumexp")


class TestSum(OpBattery):
    spec = _reduce_spec("sum")


class TestMean(OpBattery):
    spec = _reduce_spec("mean")


class TestMax(OpBattery):
    spec = _reduce_spec("max")


# ---- softmax family ------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(FAMILY))
def test_family_large_logits_and_masked_entries(mode):
    """Logits of +-1e4 stay exact; -inf entries (masking) contribute nothing."""
    x = jax.random.uniform(jax.random.key(1), (9, 300), jnp.float32, -1e4, 1e4)
    x = x.at[:, ::7].set(-jnp.inf).at[4, :].set(jnp.where(jnp.arange(300) == 5, 1.0, -jnp.inf))
    cot = inputs(ref32(mode, x).shape, jnp.float32, seed=2)
    expected = ref32(mode, x)
    finite = np.isfinite(np.asarray(expected))
    out, grad = out_and_grad(ours(mode, max_chunk=128), x, cot, finite)
    np.testing.assert_array_equal(np.isfinite(np.asarray(out)), finite)
    assert_close(jnp.where(finite, out, 0), jnp.where(finite, expected, 0), FORWARD[jnp.float32],
                 "forward")
    expected_grad = out_and_grad(lambda x: ref32(mode, x), x, cot, finite)[1]
    assert_close(grad, expected_grad, BACKWARD[jnp.float32], "grad")


def test_online_logsumexp_update_edge_rows():
    """All -inf so far keeps (m, s) = (-inf, 0); +inf gives +inf, as jax.nn.logsumexp."""
    @jax.jit
    def two_chunks(a, b):
        m, s = online_logsumexp_update(jnp.full((3, 1), -jnp.inf), jnp.zeros((3, 1)), a)
        m, s = online_logsumexp_update(m, s, b)
        return (m + jnp.log(s))[:, 0]

    lse = two_chunks(jnp.array([[-jnp.inf, -jnp.inf], [1.0, jnp.inf], [0.0, -jnp.inf]]),
                     jnp.array([[-jnp.inf, -jnp.inf], [2.0, 3.0], [5.0, 1.0]]))
    expected = jax.nn.logsumexp(jnp.array([[-jnp.inf] * 4, [1.0, jnp.inf, 2.0, 3.0],
                                           [0.0, -jnp.inf, 5.0, 1.0]]), axis=1)
    np.testing.assert_allclose(lse, expected, rtol=1e-6)
    assert lse[0] == -jnp.inf and lse[1] == jnp.inf


def test_family_jit_vmap_and_default():
    x = inputs((5, 7, 200), jnp.float32, seed=6)
    f = jax.jit(jax.vmap(lambda r: log_softmax(r, implementation="interpret", max_chunk=128)))
    assert_close(f(x), ref32("log_softmax", x), FORWARD[jnp.float32])
    # On CPU the default implementation is XLA, the reference itself.
    np.testing.assert_array_equal(softmax(x), jax.nn.softmax(x))
    np.testing.assert_array_equal(logsumexp(x), jax.nn.logsumexp(x))


@settings(max_examples=3, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 600), mode=st.sampled_from(list(FAMILY)),
       max_chunk=st.sampled_from([128, 512]), seed=st.integers(0, 2**16))
def test_property_family_forward(rows, cols, mode, max_chunk, seed):
    x = inputs((rows, cols), jnp.float32, seed=seed)
    assert_close(jax.jit(ours(mode, max_chunk=max_chunk))(x), ref32(mode, x), FORWARD[jnp.float32])


# ---- sum / mean / max ---------------------------------------------------------

def reduce_ref32(kind, x, axis):
    return JNP_REDUCE[kind](x.astype(jnp.float32), axis=axis)


def reduce_ours(kind, x, axis, **kw):
    return REDUCE[kind](x, axis, implementation="interpret", **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_max_gradient_splits_ties_like_jnp_max(dtype):
    x = jnp.round(inputs((6, 40), jnp.float32, seed=9, scale=1.5)).astype(dtype)  # many ties
    x = x.at[2].set(1.0)  # a row that is all ties
    cot = inputs((6,), jnp.float32, seed=10).astype(dtype)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(reduce_ours("max", x, 1) * cot)))(x)
    expected = jax.grad(lambda x: jnp.sum(jnp.max(x, axis=1) * cot))(x)
    assert grad.dtype == dtype
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(expected, np.float32))
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda x: reduce_ours("max", x, None)))(x),
                                  jax.grad(jnp.max)(x))


@pytest.mark.parametrize("length", [40000, 100003])  # a divisor split; a padded split (prime)
def test_reduce_everything_splits_long_rows(length):
    assert red._feature_split(1, length)[0] > 1
    x = inputs((length,), jnp.float32, seed=11)
    for kind in ("sum", "max"):
        out = jax.jit(lambda x: reduce_ours(kind, x, None))(x)
        assert_close(out, reduce_ref32(kind, x, None), 1e-5, kind)


def test_feature_split_heuristic():
    assert red._feature_split(4096, 10**6) == (1, 10**6, 0)  # enough rows already
    assert red._feature_split(2, 16384) == (1, 16384, 0)  # short rows
    assert red._feature_split(1, 2**20) == (128, 8192, 0)
    assert red._feature_split(1, 100003) == (13, 8192, 13 * 8192 - 100003)


def test_reduce_default_and_empty_rows():
    x = inputs((3, 5), jnp.float32)
    np.testing.assert_array_equal(red.sum(x, 1), jnp.sum(x, 1))  # CPU default: XLA
    assert np.isnan(red.mean(jnp.zeros((3, 0)), 1, implementation="interpret")).all()


# ---- lowering for TPU and CUDA from this CPU host ---------------------------------

PLATFORM = {"mosaic_tpu": ("tpu", "tpu_custom_call"),
            "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


def lowered(fn, impl, shape, dtype):
    platform, marker = PLATFORM[impl]
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct(shape, dtype)).lower(
        lowering_platforms=(platform,)).as_text()
    return text.count(marker)


@pytest.mark.parametrize("impl", list(PLATFORM))
@pytest.mark.parametrize("width", [1000, 32768])
@pytest.mark.parametrize("mode", list(FAMILY))
def test_family_lowers(impl, width, mode):
    f = lambda x: FAMILY[mode](x, axis=-1, implementation=impl)
    grad = jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))
    assert lowered(f, impl, (64, width), jnp.bfloat16) == 1
    assert lowered(grad, impl, (64, width), jnp.bfloat16) == 2  # forward and backward kernels


@pytest.mark.parametrize("impl", list(PLATFORM))
@pytest.mark.parametrize("kind, shape, axis", [("sum", (64, 1000), -1), ("max", (64, 32768), None),
                                               ("mean", (8, 32768), 0)])
def test_reduce_lowers(impl, kind, shape, axis):
    f = lambda x: REDUCE[kind](x, axis, implementation=impl)
    assert lowered(f, impl, shape, jnp.bfloat16) == 1
    # The backward is XLA; only max's needs the forward's result, so for sum and
    # mean the forward kernel is dead under grad and JAX drops it.
    assert lowered(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32))), impl, shape,
                   jnp.bfloat16) == (1 if kind == "max" else 0)


# ---- drop-ins for jnp / jax.nn: their extra arguments, with and without jit ---------

RNG = np.random.default_rng(7)
XD = jnp.asarray(3 * RNG.standard_normal((3, 5, 300)), jnp.float32)
WHERE = jnp.asarray(RNG.random((3, 5, 300)) > 0.3).at[0, 0].set(False)  # one empty row
B = jnp.asarray(RNG.standard_normal((5, 300)), jnp.float32)
BF16 = XD.astype(jnp.bfloat16)


def interpret(fn, **kw):
    return lambda x: fn(x, **kw, implementation="interpret")


def reference(fn, **kw):
    return lambda x: fn(x, **kw)


DROP_IN_CASES = [  # name, ours, theirs, keyword arguments, input
    ("sum_where_initial_keepdims", red.sum, jnp.sum,
     dict(axis=(0, 2), where=WHERE, initial=2.0, keepdims=True), XD),
    ("sum_dtype", red.sum, jnp.sum, dict(axis=-1, dtype=jnp.float32), BF16),
    ("mean_where_keepdims", red.mean, jnp.mean, dict(axis=1, where=WHERE, keepdims=True), XD),
    ("mean_dtype", red.mean, jnp.mean, dict(axis=None, dtype=jnp.float32), BF16),
    ("max_where_initial_keepdims", red.max, jnp.max,
     dict(axis=-1, where=WHERE, initial=-1.0, keepdims=True), XD),
    ("softmax_where", softmax, jax.nn.softmax, dict(axis=-1, where=WHERE), XD),
    ("log_softmax_where", log_softmax, jax.nn.log_softmax, dict(axis=(0, 2), where=WHERE), XD),
    ("logsumexp_where_keepdims_sign", logsumexp, jax.nn.logsumexp,
     dict(axis=-1, where=WHERE, keepdims=True, return_sign=True), XD),
    ("logsumexp_b_sign", logsumexp, jax.nn.logsumexp, dict(axis=-1, b=B, return_sign=True), XD),
]


class DropInTest(OpTestCase):
    """Each extra argument of the jnp / jax.nn namesake, on the interpreter, against it."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*DROP_IN_CASES)
    def test_matches_namesake(self, ours, theirs, kwargs, x):
        upcast = {"dtype"} & set(kwargs) or x.dtype == jnp.float32
        self.check_op(interpret(ours, **kwargs), reference(theirs, **kwargs), x,
                      rtol=1e-5 if upcast else 1e-2, atol=1e-5)


def test_max_of_nothing_names_the_argument():
    """jnp.max's rule, with a message that says which argument is empty."""
    with pytest.raises(ValueError, match=r"max: x of shape \(0, 3\) has no elements along "
                                         r"axis=None.*initial"):
        red.max(jnp.zeros((0, 3)), implementation="interpret")
    with pytest.raises(ValueError, match=r"axis=1"):
        red.max(jnp.zeros((4, 0)), axis=1)
    assert red.max(jnp.zeros((4, 0)), axis=0).shape == (0,)  # nothing reduced to nothing
    np.testing.assert_array_equal(red.max(jnp.zeros((4, 0)), axis=1, initial=0.5,
                                          implementation="interpret"), np.full(4, 0.5))
    np.testing.assert_array_equal(red.sum(jnp.zeros((0, 3)), implementation="interpret"), 0.0)
    assert np.isnan(red.mean(jnp.zeros((0, 3)), implementation="interpret"))


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: red.sum(X, out=X), ValueError, r"sum: out must be None"),
    (lambda: red.mean(X, dtype=jnp.int32), TypeError, r"mean: dtype must be float32, bfloat16"),
    (lambda: red.sum(X, keepdims=1), TypeError, r"sum: keepdims must be a bool"),
    (lambda: red.sum(X, initial=jnp.ones(2)), ValueError, r"sum: initial must be a scalar"),
    (lambda: red.max(X, where=X > 0), ValueError, r"max: where needs initial"),
    (lambda: red.sum(X, where=X), TypeError, r"sum: where must be a boolean array"),
    (lambda: softmax(X, where=jnp.ones((3,), bool)), ValueError,
     r"softmax: where of shape \(3,\) does not broadcast to x's shape \(4, 8\)"),
    (lambda: logsumexp(X, b=[1.0]), TypeError, r"logsumexp: b must be a JAX or NumPy array"),
    (lambda: logsumexp(X, b=jnp.ones((2, 8))), ValueError, r"does not broadcast"),
    (lambda: logsumexp(X, return_sign=None), TypeError, r"return_sign must be a bool"),
])
def test_bad_drop_in_arguments(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
