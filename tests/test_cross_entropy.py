"""cross_entropy and linear_cross_entropy: the op battery (tests/op_battery.py)
against optax / the naive ``x @ w`` + cross-entropy, then edge cases, peak
memory and lowering for TPU and GPU."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ops.reduction.cross_entropy import cross_entropy, reference as ce_reference
from ops.reduction.linear_cross_entropy import (LinearCrossEntropyConfig, _Config,
                                                _linear_cross_entropy, linear_cross_entropy,
                                                reference as lce_reference)
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close

optax_ce = optax.softmax_cross_entropy_with_integer_labels


def value_and_grads(fn, argnums=0):
    """Jitted ``(fn(*args), grads of sum(fn * cot))``: one compile per test, not one per op."""
    def run(cot, *args):
        out = fn(*args)
        loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)
        return out, jax.grad(loss, argnums)(*args)
    return jax.jit(run)


def make_logits(seed, lead, v, dtype):
    return _ce_inputs(np.random.default_rng(seed), dtype, lead, v)


# ---- cross_entropy -------------------------------------------------------------

def _ce_inputs(rng, dtype, lead, v):
    logits = jnp.asarray(3.0 * rng.standard_normal((*lead, v), np.float32), dtype)
    return logits, jnp.asarray(rng.integers(0, v, lead), jnp.int32)


def _optax_ce(logits, labels):
    return optax_ce(logits, labels)


LOGITS = jnp.ones((4, 10), jnp.float32)
LABELS = jnp.zeros((4,), jnp.int32)

CE_BAD = [
    BadInput("labels_rank", (LOGITS, jnp.zeros((4, 1), jnp.int32)), {}, ValueError, "labels",
             r"labels must have shape .*\(4,\)"),
    BadInput("labels_length", (LOGITS, jnp.zeros((5,), jnp.int32)), {}, ValueError, "labels",
             r"labels must have shape"),
    BadInput("float_labels", (LOGITS, jnp.zeros((4,), jnp.float32)), {}, TypeError, "labels",
             r"labels has dtype float32"),
    BadInput("int_logits", (LOGITS.astype(jnp.int32), LABELS), {}, TypeError, "logits",
             r"logits has dtype int32"),
    BadInput("scalar_logits", (jnp.ones(()), jnp.zeros((), jnp.int32)), {}, ValueError, "logits",
             r"logits must have rank >= 1"),
    BadInput("no_classes", (jnp.ones((4, 0)), LABELS), {}, ValueError, "logits", r"last dim .* is empty"),
    BadInput("list_logits", ([[1.0]], LABELS), {}, TypeError, "logits",
             r"logits must be a JAX or NumPy array"),
    BadInput("list_labels", (LOGITS, [0, 0, 0, 0]), {}, TypeError, "labels",
             r"labels must be a JAX or NumPy array"),
    BadInput("mosaic_gpu", (LOGITS, LABELS), {"implementation": "mosaic_gpu"}, NotImplementedError,
             "implementation", r"no kernel yet"),
    BadInput("max_chunk", (LOGITS, LABELS), {"max_chunk": 100}, ValueError, "max_chunk",
             r"max_chunk must be None or a power of two"),
]

CROSS_ENTROPY = OpSpec(
    name="cross_entropy", op=cross_entropy, reference=_optax_ce, make_inputs=_ce_inputs,
    cases=[
        # 13 rows (a partial row block) of 1000 classes: 8 chunks of 128, the last masked.
        Case("eight_chunks_masked", dict(lead=(13,), v=1000), tiles=dict(max_chunk=128),
             dtypes=(jnp.float32, jnp.bfloat16)),
        Case("leading_dims_one_chunk", dict(lead=(2, 3), v=300), tiles=dict(max_chunk=None)),
        # The default chunk (4096 for 16-bit): two chunks.
        Case("default_chunk_16bit", dict(lead=(5,), v=5000), tiles=dict(max_chunk=None),
             dtypes=(jnp.bfloat16,), grads=False),
    ],
    bad_inputs=CE_BAD, xla_is_reference=False, eager_case="leading_dims_one_chunk")


class TestCrossEntropy(OpBattery):
    spec = CROSS_ENTROPY


def exact_ce(logits, labels):
    """float64 NumPy cross-entropy and its gradient (cotangent 1)."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    log_s = np.log(np.exp(x - m).sum(-1, keepdims=True))
    idx = np.asarray(labels)[..., None]
    picked = np.take_along_axis(x, idx, -1)
    grad = np.exp(x - m - log_s)
    np.put_along_axis(grad, idx, np.take_along_axis(grad, idx, -1) - 1.0, -1)
    return (m - picked + log_s)[..., 0], grad


def test_large_logits_stay_finite():
    logits = jnp.array([[1e4, -1e4, 0.0, 5.0], [-1e4, -1e4, 1e4, 1e4]] * 3, jnp.float32)
    labels = jnp.array([1, 0, 2, 3, 0, 2])
    out, grad = value_and_grads(lambda x: cross_entropy(x, labels, implementation="interpret"))(
        jnp.ones(6), logits)
    loss64, grad64 = exact_ce(logits, labels)
    # Exact to float32 rounding, even for the log(2) losses between two 1e4 logits
    # (a rounded logsumexp near 1e4 would be off by 2e-4 there, as optax's is).
    np.testing.assert_allclose(out, loss64, rtol=1e-6)
    np.testing.assert_allclose(grad, grad64, atol=1e-6)


def test_out_of_range_labels_give_nan_loss():
    logits, _ = make_logits(1, (4,), 130, jnp.float32)
    labels = jnp.array([5, -1, 130, 129])
    # The gradient of a bad row is g * softmax (no label term), as jax.grad of optax
    # for labels >= V; selecting the row away (jnp.where) gives zero loss and gradient.
    ce = lambda x: cross_entropy(x, labels, implementation="interpret")
    masked = lambda x: jnp.sum(jnp.where(labels == 5, ce(x), 0.0))
    out, grad, grad_masked = jax.jit(lambda x: (ce(x), jax.grad(lambda x: jnp.sum(ce(x)))(x),
                                                jax.grad(masked)(x)))(logits)
    xla = cross_entropy(logits, labels, implementation="xla")
    for impl, loss in (("interpret", out), ("xla", xla)):
        assert np.isnan(loss[1]) and np.isnan(loss[2]), impl
        np.testing.assert_allclose(loss[np.array([0, 3])],
                                   optax_ce(logits, labels)[np.array([0, 3])], rtol=1e-6)
    np.testing.assert_array_equal(grad_masked[1:], 0.0)
    np.testing.assert_allclose(grad[2], jax.nn.softmax(logits[2]), atol=1e-7)


def test_jit_vmap_default_and_xla():
    logits, labels = make_logits(4, (3, 5), 200, jnp.float32)
    f = jax.jit(jax.vmap(lambda x, l: cross_entropy(x, l, implementation="interpret")))
    assert_close(f(logits, labels), optax_ce(logits, labels), FORWARD[jnp.float32])
    np.testing.assert_array_equal(cross_entropy(logits, labels, implementation="xla"),
                                  ce_reference(logits, labels))
    # On CPU the default implementation is XLA.
    assert_close(cross_entropy(logits, labels), optax_ce(logits, labels), FORWARD[jnp.float32])


# ---- linear_cross_entropy -------------------------------------------------------

def make_linear(seed, lead, d, v, dtype):
    return _lce_inputs(np.random.default_rng(seed), dtype, lead, d, v)


def naive(x, w, labels):
    """What a user writes: float32 logits, then optax."""
    logits = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return optax_ce(logits, labels)


def check_linear(fn, x, w, labels, dtype, cot):
    out, grads = value_and_grads(lambda x, w: fn(x, w, labels), (0, 1))(cot, x, w)
    assert out.dtype == dtype and out.shape == labels.shape
    up = lambda a: a.astype(jnp.float32)
    expected_out, expected = value_and_grads(lambda x, w: naive(x, w, labels), (0, 1))(
        cot, up(x), up(w))
    assert_close(out, expected_out, FORWARD[dtype], "loss")
    for name, g, e, a in zip("xw", grads, expected, (x, w)):
        assert g.dtype == a.dtype, name
        assert_close(g, e, BACKWARD[dtype], f"d{name}")


def test_linear_loop_strategy_on_interpret():
    """The pallas_triton kernel layout (vocabulary splits of 4 tiles, the last one short,
    and in-kernel loops over tiles and D), run here by the interpreter: rows (39), D (50)
    and V (800) divide no block; the backward walks 3 full vocabulary chunks plus a
    32-column tail."""
    x, w, labels = make_linear(5, (3, 13), 50, 800, jnp.float32)
    cot = jnp.asarray(np.random.default_rng(6).standard_normal(labels.shape), jnp.float32)
    config = _Config("interpret", block_sizes=(16, 128, 32), vocab_chunk=256, strategy="loop")

    def fn(x, w, labels):
        out = _linear_cross_entropy(x.reshape(-1, x.shape[-1]), w,
                                    labels.reshape(-1, 1).astype(jnp.int32), config)
        return out.reshape(labels.shape).astype(x.dtype)  # float32 rows, as the op rounds them

    check_linear(fn, x, w, labels, jnp.float32, cot)


@pytest.mark.parametrize("impl, parts", [("interpret", 2), ("triton", 4)])
def test_linear_dz_epilogue_in_pieces(impl, parts):
    """``LinearCrossEntropyConfig.epilogue_subtile``: the backward's dz kernel runs its
    epilogue on column pieces of each 128-column tile (the one-hot from the piece's column
    offset; labels fall in every piece): loss and gradients equal the whole-tile run's
    bit for bit and the naive reference within tolerance (interpret: the grid walk;
    triton: the loop walk in Triton's CPU interpreter)."""
    x, w, _ = make_linear(12, (2, 9), 40, 300, jnp.float32)
    labels = jnp.arange(0, 288, 16, dtype=jnp.int32).reshape(2, 9)  # every 16th column
    cot = jnp.asarray(np.random.default_rng(13).standard_normal(labels.shape), jnp.float32)
    whole = LinearCrossEntropyConfig(16, 128, 32)
    pieces = dataclasses.replace(whole, epilogue_subtile=parts)
    run = lambda config: lambda x, w, l: linear_cross_entropy(x, w, l, implementation=impl,
                                                              block_sizes=config)
    got, want, naive_ = (value_and_grads(lambda x, w: fn(x, w, labels), (0, 1))(cot, x, w)
                         for fn in (run(pieces), run(whole), naive))
    for g, e, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(naive_)):
        assert_close(g, r, BACKWARD[jnp.float32])
        np.testing.assert_array_equal(g, e)


def test_linear_dz_pieces_reach_the_triton_source_and_off_leaves_it_alone():
    pytest.importorskip("triton")
    from pallas_core import triton as pl_triton
    sds = [jax.ShapeDtypeStruct((18, 40), jnp.bfloat16), jax.ShapeDtypeStruct((40, 300), jnp.bfloat16),
           jax.ShapeDtypeStruct((18,), jnp.int32)]

    def dz_source(parts):
        config = LinearCrossEntropyConfig(16, 128, 32, epilogue_subtile=parts)
        loss = lambda x, w, l: jnp.sum(linear_cross_entropy(x, w, l, implementation="triton",
                                                            block_sizes=config).astype(jnp.float32))
        sources = pl_triton.source(jax.grad(loss, (0, 1)), *sds)
        return [s for s in sources if "linear_cross_entropy_dz" in s]

    whole = dz_source(None)
    assert len(whole) == 1 and "tl.split" not in whole[0]
    assert dz_source(1) == whole and dz_source(2)[0].count("tl.split") == 1


def _lce_inputs(rng, dtype, lead, d, v):
    x = rng.standard_normal((*lead, d), np.float32)
    w = 3.0 * rng.standard_normal((d, v), np.float32) / np.sqrt(d)
    return (jnp.asarray(x, dtype), jnp.asarray(w, dtype),
            jnp.asarray(rng.integers(0, v, lead), jnp.int32))


X = jnp.ones((4, 8), jnp.float32)
W = jnp.ones((8, 16), jnp.float32)

LCE_BAD = [
    BadInput("labels_shape", (X, W, jnp.zeros((4, 1), jnp.int32)), {}, ValueError, "labels",
             r"labels must have shape x.shape\[:-1\]"),
    BadInput("float_labels", (X, W, jnp.zeros((4,), jnp.float32)), {}, TypeError, "labels",
             r"labels has dtype float32"),
    BadInput("d_mismatch", (X, jnp.ones((9, 16)), LABELS), {}, ValueError, "w",
             r"x's last dim \(8\) must equal w's first"),
    BadInput("w_rank", (X, jnp.ones((8, 16, 1)), LABELS), {}, ValueError, "w", r"w must have rank 2"),
    BadInput("empty_vocabulary", (X, jnp.ones((8, 0)), LABELS), {}, ValueError, "w",
             r"empty vocabulary"),
    BadInput("mixed_dtypes", (X, W.astype(jnp.bfloat16), LABELS), {}, TypeError, "w",
             r"w has dtype bfloat16 but x has float32"),
    BadInput("int_x", (X.astype(jnp.int32), W.astype(jnp.int32), LABELS), {}, TypeError, "x",
             r"x has dtype int32"),
    BadInput("block_sizes", (X, W, LABELS), {"block_sizes": (8, 128)}, ValueError, "block_sizes",
             r"block_sizes must be three"),
    BadInput("vocab_chunk", (X, W, LABELS), {"vocab_chunk": 0}, ValueError, "vocab_chunk",
             r"vocab_chunk must be a positive int"),
    # Mosaic GPU's kernels (ops/matmul/mosaic_gpu_lce.py) take 16-bit operands only.
    BadInput("mosaic_gpu", (X, W, LABELS), {"implementation": "mosaic_gpu"}, NotImplementedError,
             "implementation", r"mosaic_gpu.*float32"),
]

LINEAR_CROSS_ENTROPY = OpSpec(
    name="linear_cross_entropy", op=linear_cross_entropy, reference=naive,
    make_inputs=_lce_inputs, grad_argnums=(0, 1),
    cases=[
        # The interpreter's grid kernels: rows (39), D (50) and V (800) divide no block;
        # the backward walks 3 full vocabulary chunks plus a 32-column tail.
        Case("vocab_chunks", dict(lead=(3, 13), d=50, v=800), tiles=dict(vocab_chunk=256),
             dtypes=(jnp.float32, jnp.bfloat16)),
        Case("explicit_blocks", dict(lead=(2, 9), d=40, v=300),
             tiles=dict(block_sizes=(16, 128, 32))),
    ],
    bad_inputs=LCE_BAD, xla_is_reference=False, eager_case="explicit_blocks")


class TestLinearCrossEntropy(OpBattery):
    spec = LINEAR_CROSS_ENTROPY


def test_linear_xla_and_default():
    x, w, labels = _lce_inputs(np.random.default_rng(7), jnp.float32, (2, 9), 40, 300)
    np.testing.assert_array_equal(linear_cross_entropy(x, w, labels, implementation="xla"),
                                  lce_reference(x, w, labels))
    assert_close(linear_cross_entropy(x, w, labels), naive(x, w, labels), FORWARD[jnp.float32])


def test_linear_out_of_range_labels_and_large_logits():
    x, w, _ = make_linear(8, (6,), 16, 200, jnp.float32)
    x = x * 1e3  # logits of order 1e3-1e4
    labels = jnp.array([0, -1, 200, 199, 7, 1000])
    lce = lambda x, w: linear_cross_entropy(x, w, labels, implementation="interpret")
    out, (gx, gw) = value_and_grads(lce, (0, 1))((labels == 7).astype(jnp.float32), x, w)
    assert np.all(np.isnan(out[np.array([1, 2, 5])]))
    good = np.array([0, 3, 4])
    assert np.all(np.isfinite(out[good]))
    np.testing.assert_allclose(out[good], naive(x, w, labels)[good], rtol=1e-5)
    assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gw))
    np.testing.assert_array_equal(gx[np.array([0, 1, 2, 3, 5])], 0.0)


def test_linear_peak_memory_has_no_logits_buffer():
    """fwd+bwd never holds N x V values: XLA's temp buffers are well below the
    naive version's, and below one float32 N x V array."""
    n, d, v = 64, 32, 8192

    def fwd_bwd(f):
        return lambda x, w, l: jax.value_and_grad(lambda x, w: jnp.sum(f(x, w, l)), (0, 1))(x, w)

    ours = fwd_bwd(lambda x, w, l: linear_cross_entropy(x, w, l, implementation="interpret",
                                                        vocab_chunk=1024))
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    temp = lambda f: jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
    ours_bytes, naive_bytes = temp(ours), temp(fwd_bwd(naive))
    logits_bytes = n * v * 4
    assert naive_bytes >= logits_bytes
    assert ours_bytes < logits_bytes / 2 and ours_bytes < naive_bytes / 4, (ours_bytes, naive_bytes)


# ---- lowering for TPU and GPU from this CPU host --------------------------------

PLATFORM = {"mosaic_tpu": ("tpu", "tpu_custom_call"),
            "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


def lower_text(fn, impl, *shapes_dtypes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(PLATFORM[impl][0],)).as_text()


@pytest.mark.parametrize("impl", ["mosaic_tpu", "pallas_triton"])
def test_cross_entropy_lowers(impl):
    n, v = 200, 32768
    fwd = lambda x, l: cross_entropy(x, l, implementation=impl)
    grad = jax.grad(lambda x, l: jnp.sum(fwd(x, l).astype(jnp.float32)))
    specs = [((n, v), jnp.bfloat16), ((n,), jnp.int32)]
    marker = PLATFORM[impl][1]
    assert lower_text(fwd, impl, *specs).count(marker) == 1
    assert lower_text(grad, impl, *specs).count(marker) == 2  # forward + backward kernels
    if impl == "mosaic_tpu":
        # float32 rows of 128k classes: the backward's double-buffered logits and
        # dlogits blocks outgrow the default scoped VMEM, so the kernel raises it.
        text = lower_text(grad, impl, ((64, 131072), jnp.float32), ((64,), jnp.int32))
        assert "scoped_memory_configs" in text


@pytest.mark.parametrize("impl", ["mosaic_tpu", "pallas_triton"])
def test_linear_cross_entropy_lowers(impl):
    n, d, v = 200, 256, 32768
    fwd = lambda x, w, l: linear_cross_entropy(x, w, l, implementation=impl)
    grad = jax.grad(lambda x, w, l: jnp.sum(fwd(x, w, l).astype(jnp.float32)), (0, 1))
    specs = [((n, d), jnp.bfloat16), ((d, v), jnp.bfloat16), ((n,), jnp.int32)]
    marker = PLATFORM[impl][1]
    assert lower_text(fwd, impl, *specs).count(marker) == 1
    # Forward, then per vocabulary chunk: the dz kernel and the dx and dw matmuls.
    assert lower_text(grad, impl, *specs).count(marker) >= 4


# ---- benchmark cases ------------------------------------------------------------

def test_benchmark_cases_report_peak_memory():
    from benchmarks import cross_entropy as bench, harness
    quick = bench.cases("cpu", quick=True)
    assert {(c.op, c.pass_name) for c in quick} == {
        (op, p) for op in ("cross_entropy", "linear_cross_entropy") for p in harness.PASSES}
    variants = [c.variant for c in bench.cases("gpu")]
    assert (variants.count("plain"), variants.count(bench.MASKED)) == (10, 6)
    assert all(c.report_memory for c in quick)
    case = next(c for c in quick if c.op == "cross_entropy" and c.pass_name == "fwd")
    rows = harness.run_case(case, key=jax.random.key(0), ceilings={}, warmup=0, iters=1)
    assert [r["implementation"] for r in rows] == ["xla", *harness.kernel_implementations("cpu")]
    for row in rows:
        assert row["error"] is None and row["max_rel_error"] < 1e-5, row
        assert set(row) == set(harness.ROW_KEYS) | {"peak_bytes"}
        assert row["peak_bytes"] > 0
