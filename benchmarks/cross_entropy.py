"""Benchmark cases for ``cross_entropy`` and ``linear_cross_entropy``.

Each case pits our kernels (the platform's kernel implementations, see
:func:`benchmarks.harness.kernel_implementations`) against the baseline a user
would write without us, jitted and in the inputs' dtype:

* cross_entropy: ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)``;
* linear_cross_entropy: ``x @ w`` then the same optax loss, which
  materialises the ``[N, V]`` logits (and, for the backward pass, their
  gradient);
* cross_entropy, variant ``masked mean`` (an LM loss: every 8th label is
  padding): ``cross_entropy(logits, labels, ignore_index=-100,
  reduction="mean")`` against optax's loss on the labels with padding
  replaced, the mask applied with ``where`` and the mean over the kept rows.

Besides time, every row reports ``peak_bytes`` (the compiled executable's
temporary plus output buffers, :func:`benchmarks.harness.compiled_peak_bytes`):
for linear cross-entropy memory is the point, since the naive version needs
``N x V`` logits. Accuracy is measured against the same math in float64
(:func:`benchmarks.harness.reference_output`).

Cost model (for TFLOP/s and GB/s):

* cross_entropy is memory-bound (ceiling "copy"): the forward reads the
  logits once; forward + backward reads them twice and writes the gradient.
  Flops are counted as 4 per logit forward (max, subtract, exp, add) and 4
  more backward.
* linear_cross_entropy is compute-bound (ceiling "matmul"): ``2*N*D*V``
  flops forward, ``6*N*D*V`` forward + backward (the logits, dx and dw
  products). Our backward recomputes the logits (another ``2*N*D*V``) to save
  memory; that recomputation is not counted, so TFLOP/s compares the
  implementations' time for the same useful work.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from benchmarks import harness
from benchmarks.matmul import mosaic_gpu_column
from ops.reduction.cross_entropy import cross_entropy
from ops.reduction.linear_cross_entropy import linear_cross_entropy

CE = "cross_entropy"
LINEAR_CE = "linear_cross_entropy"

# cross_entropy: ((N, V), dtype); linear_cross_entropy: ((N, D, V), dtype).
# Accelerators: a training batch of 8192 tokens at the vocabularies of current
# LLMs (32k: Llama 2 / Mistral; 128k: Llama 3), d_model 4096.
ACCELERATOR_SHAPES = {
    CE: (((8192, 32768), "bfloat16"), ((8192, 131072), "bfloat16"),
         ((8192, 32768), "float32")),
    LINEAR_CE: (((8192, 4096, 32768), "bfloat16"), ((8192, 4096, 131072), "bfloat16")),
}
# CPUs run our kernels through the Pallas interpreter: tiny sizes, with dims
# that divide no block so edge tiles are timed too.
CPU_SHAPES = {
    CE: (((128, 4096), "float32"), ((100, 5000), "bfloat16")),
    LINEAR_CE: (((64, 64, 2048), "float32"), ((60, 96, 3000), "bfloat16")),
}
QUICK_SHAPES = {
    "cpu": {CE: (((32, 1024), "float32"),), LINEAR_CE: (((16, 32, 512), "float32"),)},
    "accelerator": {CE: (((1024, 32768), "bfloat16"),),
                    LINEAR_CE: (((1024, 1024, 32768), "bfloat16"),)},
}


def shapes(platform: str, quick: bool = False) -> dict:
    """``{op: ((shape, dtype), ...)}`` benchmarked on ``platform``."""
    on_cpu = platform == "cpu"
    if quick:
        return QUICK_SHAPES["cpu" if on_cpu else "accelerator"]
    return CPU_SHAPES if on_cpu else ACCELERATOR_SHAPES


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every cross-entropy case for ``platform``: ops x shapes x passes.

    ``quick`` keeps one tiny shape per op (still both passes), for smoke tests.
    """
    ours = harness.kernel_implementations(platform)
    makers = {CE: make_ce_case, LINEAR_CE: make_linear_case}
    # The Mosaic GPU column: linear cross-entropy only (cross_entropy has no matmul).
    column = {CE: lambda dtype: (),
              LINEAR_CE: lambda dtype: mosaic_gpu_column(platform, dtype, quick)}
    out = [makers[op](shape, dtype, pass_name, ours + column[op](dtype))
           for op, op_shapes in shapes(platform, quick).items()
           for shape, dtype in op_shapes
           for pass_name in harness.PASSES]
    if not quick:
        out += [make_ce_case(shape, dtype, pass_name, ours, variant=MASKED)
                for shape, dtype in shapes(platform)[CE] for pass_name in harness.PASSES]
    return out


# --------------------------------------------------------------------------
# cross_entropy
# --------------------------------------------------------------------------

def make_ce_case(shape, dtype: str, pass_name: str,
                 implementations: tuple[str, ...], variant: str = "plain") -> harness.Case:
    """One cross_entropy case: ``shape = (N, V)``, ours vs optax; ``variant`` "plain"
    (per-example losses) or :data:`MASKED` (the masked mean)."""
    n, v = shape
    baseline, ours, reference, make_inputs = _CE_VARIANTS[variant]
    fns = {harness.BASELINE: baseline, **{
        impl: functools.partial(ours, implementation=impl) for impl in implementations}}
    fwd_bwd = pass_name == "fwd+bwd"
    if fwd_bwd:
        fns = {name: harness.forward_and_backward(fn, nondiff=1) for name, fn in fns.items()}
        reference = harness.forward_and_backward(reference, nondiff=1)
    itemsize = jnp.dtype(dtype).itemsize
    logits_bytes = n * v * itemsize
    return harness.Case(
        op=CE, variant=variant, shape=(n, v), dtype=dtype, pass_name=pass_name,
        flops=(8.0 if fwd_bwd else 4.0) * n * v,
        make_inputs=functools.partial(make_inputs, shape=(n, v), dtype=dtype,
                                      with_cotangent=fwd_bwd),
        implementations=fns, reference=reference, ceiling="copy",
        bytes_accessed=(3 if fwd_bwd else 1) * logits_bytes, report_memory=True)


def _ce_inputs(key, *, shape, dtype, with_cotangent):
    """``(logits, labels[, cotangent])``; logits of scale 2, a realistic spread."""
    n, v = shape
    kx, kl, kc = jax.random.split(key, 3)
    inputs = [harness.random_normal(kx, (n, v), dtype, scale=2.0),
              jax.random.randint(kl, (n,), 0, v)]
    if with_cotangent:
        inputs.append(harness.random_normal(kc, (n,), dtype))
    return tuple(inputs)


def _optax_ce(logits, labels):
    """What a user writes: optax in the logits' dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def _ours_ce(logits, labels, *, implementation):
    return cross_entropy(logits, labels, implementation=implementation)


def _reference_ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(harness.upcast(logits), labels)


IGNORE_INDEX = -100  # transformers' padding label
MASKED = "masked mean"


def _masked_inputs(key, *, shape, dtype, with_cotangent):
    """``(logits, labels with every 8th one IGNORE_INDEX[, scalar cotangent])``."""
    logits, labels = _ce_inputs(key, shape=shape, dtype=dtype, with_cotangent=False)
    labels = labels.at[::8].set(IGNORE_INDEX)
    return (logits, labels, jnp.ones((), dtype)) if with_cotangent else (logits, labels)


def _optax_masked_mean(logits, labels):
    """What a user writes with optax: replace padding labels, mask with where, mean."""
    mask = labels != IGNORE_INDEX
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return jnp.sum(jnp.where(mask, loss, 0)) / jnp.maximum(jnp.sum(mask), 1)


def _ours_masked_mean(logits, labels, *, implementation):
    return cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="mean",
                         implementation=implementation)


def _reference_masked_mean(logits, labels):
    return _optax_masked_mean(harness.upcast(logits), labels)


# variant -> (baseline, ours, reference, input maker)
_CE_VARIANTS = {"plain": (_optax_ce, _ours_ce, _reference_ce, _ce_inputs),
                MASKED: (_optax_masked_mean, _ours_masked_mean, _reference_masked_mean,
                         _masked_inputs)}


# --------------------------------------------------------------------------
# linear_cross_entropy
# --------------------------------------------------------------------------

def make_linear_case(shape, dtype: str, pass_name: str,
                     implementations: tuple[str, ...]) -> harness.Case:
    """One linear_cross_entropy case: ``shape = (N, D, V)``, ours vs ``x @ w`` + optax."""
    n, d, v = shape
    fns = {harness.BASELINE: _naive_linear_ce, **{
        impl: functools.partial(_ours_linear_ce, implementation=impl) for impl in implementations}}
    reference = _reference_linear_ce
    fwd_bwd = pass_name == "fwd+bwd"
    if fwd_bwd:
        fns = {name: harness.forward_and_backward(fn, nondiff=1) for name, fn in fns.items()}
        reference = harness.forward_and_backward(reference, nondiff=1)
    return harness.Case(
        op=LINEAR_CE, variant="plain", shape=(n, d, v), dtype=dtype, pass_name=pass_name,
        flops=2.0 * n * d * v * (3 if fwd_bwd else 1),
        make_inputs=functools.partial(_linear_inputs, shape=(n, d, v), dtype=dtype,
                                      with_cotangent=fwd_bwd),
        implementations=fns, reference=reference, ceiling="matmul", report_memory=True)


def _linear_inputs(key, *, shape, dtype, with_cotangent):
    """``(x, w, labels[, cotangent])``; w scaled by 1/sqrt(D) so logits are O(1)."""
    n, d, v = shape
    kx, kw, kl, kc = jax.random.split(key, 4)
    inputs = [harness.random_normal(kx, (n, d), dtype),
              harness.random_normal(kw, (d, v), dtype, scale=d ** -0.5),
              jax.random.randint(kl, (n,), 0, v)]
    if with_cotangent:
        inputs.append(harness.random_normal(kc, (n,), dtype))
    return tuple(inputs)


def _naive_linear_ce(x, w, labels):
    """What a user writes: the logits in the inputs' dtype, then optax."""
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)


def _ours_linear_ce(x, w, labels, *, implementation):
    return linear_cross_entropy(x, w, labels, implementation=implementation)


def _reference_linear_ce(x, w, labels):
    logits = jnp.dot(harness.upcast(x), harness.upcast(w), precision=lax.Precision.HIGHEST)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


# --------------------------------------------------------------------------
