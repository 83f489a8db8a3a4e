"""LM-loss options of ``ops.cross_entropy`` and ``ops.linear_cross_entropy``:
ignore_index, label_smoothing, z_loss (and return_z_loss), logits_soft_cap and
reduction, on every kernel backend, against an independent reference built on
optax (``optax.smooth_labels`` + ``optax.softmax_cross_entropy``, the mask applied
by hand), outputs and gradients; out-of-range labels; lowering for TPU and CUDA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

from ops.reduction.cross_entropy import cross_entropy
from ops.reduction.linear_cross_entropy import linear_cross_entropy
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close

IGNORE = -100


def optax_loss(logits, labels, *, ignore_index=None, label_smoothing=0.0, z_loss=0.0,
               logits_soft_cap=None, reduction="none", return_z_loss=False):
    """The same loss from optax's pieces, float32."""
    z = logits.astype(jnp.float32)
    if logits_soft_cap is not None:
        z = logits_soft_cap * jnp.tanh(z / logits_soft_cap)
    v = z.shape[-1]
    ignored = (labels == ignore_index) if ignore_index is not None else jnp.zeros(labels.shape, bool)
    targets = optax.smooth_labels(jax.nn.one_hot(jnp.where(ignored, 0, labels), v), label_smoothing)
    zl = z_loss * jnp.square(jax.nn.logsumexp(z, axis=-1))
    loss = jnp.where(ignored, 0.0, optax.softmax_cross_entropy(z, targets) + zl)
    zl = jnp.where(ignored, 0.0, zl)
    if reduction != "none":
        loss, zl = jnp.sum(loss), jnp.sum(zl)
        if reduction == "mean":
            count = jnp.maximum(jnp.sum(~ignored), 1)
            loss, zl = loss / count, zl / count
    return (loss, zl) if return_z_loss else loss


def _labels(rng, shape, v, ignored=True):
    labels = rng.integers(0, v, size=shape)
    if ignored:
        labels.reshape(-1)[::3] = IGNORE
    return jnp.asarray(labels, jnp.int32)


def _ce_inputs(rng, dtype, *, shape, ignored=True):
    logits = jnp.asarray(3.0 * rng.standard_normal(shape), dtype)
    return logits, _labels(rng, shape[:-1], shape[-1], ignored)


def _lce_inputs(rng, dtype, *, rows, d, v, ignored=True):
    x = jnp.asarray(rng.standard_normal((*rows, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, v)) / np.sqrt(d) * 2.0, dtype)
    return x, w, _labels(rng, rows, v, ignored)


LM = dict(ignore_index=IGNORE, label_smoothing=0.1, z_loss=1e-3, reduction="mean")

CE_CASES = [
    Case("all_options_mean", inputs=dict(shape=(7, 300)), options=LM,
         implementations=("interpret", "triton", "xla")),
    Case("soft_cap_z_loss_sum_three_chunks", inputs=dict(shape=(2, 3, 300)),
         options=dict(ignore_index=IGNORE, logits_soft_cap=4.0, z_loss=1e-2, reduction="sum",
                      return_z_loss=True), tiles=dict(max_chunk=128),
         implementations=("interpret", "triton")),
    Case("smoothing_rows", inputs=dict(shape=(5, 200), ignored=False),
         options=dict(label_smoothing=0.3), dtypes=(jnp.float32, jnp.bfloat16)),
    Case("ignore_index_in_range_none", inputs=dict(shape=(6, 130)),
         options=dict(ignore_index=IGNORE, logits_soft_cap=30.0),
         implementations=("interpret", "triton")),
]

X = jnp.ones((4, 8), jnp.float32)
L = jnp.zeros((4,), jnp.int32)


def _option_bad_inputs(args):
    return [
        BadInput("smoothing_range", args, {"label_smoothing": 1.5}, ValueError, "label_smoothing",
                 r"in \[0, 1\]"),
        BadInput("smoothing_type", args, {"label_smoothing": "0.1"}, TypeError, "label_smoothing",
                 r"static real number"),
        BadInput("z_loss_negative", args, {"z_loss": -1.0}, ValueError, "z_loss", r">= 0"),
        BadInput("soft_cap_zero", args, {"logits_soft_cap": 0.0}, ValueError, "logits_soft_cap",
                 r"None or > 0"),
        BadInput("reduction", args, {"reduction": "avg"}, ValueError, "reduction",
                 r"one of \('none', 'sum', 'mean'\)"),
        BadInput("ignore_index_float", args, {"ignore_index": -100.0}, TypeError, "ignore_index",
                 r"an int or None"),
        BadInput("return_z_loss", args, {"return_z_loss": 1}, TypeError, "return_z_loss",
                 r"must be a bool"),
    ]


CROSS_ENTROPY = OpSpec(
    name="cross_entropy_lm", op=cross_entropy, reference=optax_loss, make_inputs=_ce_inputs,
    cases=CE_CASES, grad_argnums=(0,), implementations=("interpret", "xla"),
    eager_case="ignore_index_in_range_none",
    bad_inputs=_option_bad_inputs((X, L)), unavailable="mosaic_gpu", xla_is_reference=False)

LINEAR_CROSS_ENTROPY = OpSpec(
    name="linear_cross_entropy_lm",
    op=linear_cross_entropy,
    reference=lambda x, w, labels, **kw: optax_loss(
        jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST), labels, **kw),
    make_inputs=_lce_inputs, grad_argnums=(0, 1),
    tiles={"interpret": dict(block_sizes=(16, 128, 32), vocab_chunk=256)},
    cases=[
        Case("all_options_mean", inputs=dict(rows=(2, 5), d=40, v=300), options=LM,
             implementations=("interpret", "triton", "xla")),
        Case("soft_cap_smoothing_z_loss_sum", inputs=dict(rows=(9,), d=16, v=300),
             options=dict(ignore_index=IGNORE, logits_soft_cap=3.0, label_smoothing=0.2,
                          z_loss=1e-2, reduction="sum", return_z_loss=True)),
        Case("eager_tiny", inputs=dict(rows=(3,), d=8, v=130),
             options=dict(ignore_index=IGNORE, z_loss=1e-2), implementations=("interpret", "triton")),
    ],
    implementations=("interpret", "xla"),
    bad_inputs=_option_bad_inputs((X, jnp.ones((8, 16)), L)),
    unavailable="mosaic_gpu", xla_is_reference=False, eager_case="eager_tiny")


class TestCrossEntropyLM(OpBattery):
    spec = CROSS_ENTROPY


class TestLinearCrossEntropyLM(OpBattery):
    spec = LINEAR_CROSS_ENTROPY


def test_defaults_are_optax():
    """With no option, both ops keep optax's per-example losses in the input dtype."""
    logits, labels = _ce_inputs(np.random.default_rng(0), jnp.bfloat16, shape=(4, 50),
                                ignored=False)
    out = jax.jit(lambda z: cross_entropy(z, labels, implementation="interpret"))(logits)
    assert out.dtype == jnp.bfloat16 and out.shape == (4,)
    assert_close(out, optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels), FORWARD[jnp.bfloat16], "defaults")


def test_ignored_rows_have_zero_loss_and_gradient():
    logits, labels = _ce_inputs(np.random.default_rng(1), jnp.float32, shape=(6, 140))
    ignored = np.asarray(labels) == IGNORE
    all_ignored = jnp.full_like(labels, IGNORE)

    @jax.jit
    def run(x):
        loss_fn = lambda x, l, r: cross_entropy(x, l, ignore_index=IGNORE, z_loss=1e-2,
                                                label_smoothing=0.2, reduction=r,
                                                implementation="interpret")
        loss, vjp = jax.vjp(lambda x: loss_fn(x, labels, "none"), x)
        # A batch of padding only: the mean is 0 (not NaN), and so is its gradient.
        mean, mean_grad = jax.value_and_grad(lambda x: loss_fn(x, all_ignored, "mean"))(x)
        return loss, vjp(jnp.ones_like(loss))[0], mean, mean_grad

    loss, grad, mean, mean_grad = run(logits)
    assert np.all(np.asarray(loss)[ignored] == 0) and np.all(np.asarray(grad)[ignored] == 0)
    assert np.all(np.asarray(loss)[~ignored] > 0) and np.all(np.asarray(grad)[~ignored] != 0)
    assert float(mean) == 0.0 and not np.any(np.asarray(mean_grad))


def test_out_of_range_labels_are_nan_and_a_checkify_error():
    logits = jnp.zeros((3, 10), jnp.float32)
    labels = jnp.asarray([1, IGNORE, 10], jnp.int32)
    checked = jax.jit(checkify.checkify(lambda x, l: cross_entropy(
        x, l, ignore_index=IGNORE, implementation="interpret")))
    err, loss = checked(logits, labels)
    np.testing.assert_array_equal(np.isnan(np.asarray(loss)), [False, False, True])
    with pytest.raises(checkify.JaxRuntimeError, match=r"labels outside \[0, 10\)"):
        err.throw()
    err, _ = checked(logits, labels.at[2].set(3))
    assert err.get() is None


PLATFORM = {"mosaic_tpu": ("tpu", "tpu_custom_call"),
            "pallas_triton": ("cuda", "__gpu$xla.gpu.triton")}


@pytest.mark.parametrize("impl", list(PLATFORM))
def test_options_lower(impl):
    options = dict(ignore_index=IGNORE, z_loss=1e-4, logits_soft_cap=30.0, reduction="mean")

    def grads(logits, x, w, labels):
        ce = jax.grad(lambda z: cross_entropy(z, labels, label_smoothing=0.1, implementation=impl,
                                              **options))(logits)
        lce = jax.grad(lambda x, w: linear_cross_entropy(x, w, labels, implementation=impl,
                                                         **options), (0, 1))(x, w)
        return ce, lce

    specs = [jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16),
             jax.ShapeDtypeStruct((64, 256), jnp.bfloat16),
             jax.ShapeDtypeStruct((256, 1000), jnp.bfloat16),
             jax.ShapeDtypeStruct((64,), jnp.int32)]
    platform, marker = PLATFORM[impl]
    text = jax.jit(grads).trace(*specs).lower(lowering_platforms=(platform,)).as_text()
    for name in ("cross_entropy_fwd", "cross_entropy_bwd", "linear_cross_entropy_fwd",
                 "linear_cross_entropy_dz"):
        assert name in text, name
    assert text.count(marker) >= 6


def test_linear_options_vocab_parallel():
    """w sharded over the vocabulary on 8 devices: the smoothing's logit sums and the
    capped statistics combine across shards; outputs and gradients equal one device's."""
    from jax.sharding import PartitionSpec as P

    from tests.test_sharding import AUTO, _normal, check
    x, w = _normal(0, (4, 6, 32)), _normal(1, (32, 200), 0.25)
    labels = jax.random.randint(jax.random.key(2), (4, 6), 0, 200).at[0].set(IGNORE)
    check(lambda impl: lambda x, w: linear_cross_entropy(
              x, w, labels, ignore_index=IGNORE, label_smoothing=0.1, logits_soft_cap=2.0,
              z_loss=1e-2, implementation=impl),
          (x, w), (P("data"), P(None, "model")), mode=AUTO, argnums=(0, 1),
          out_spec=P("data"), collective="all-reduce")
