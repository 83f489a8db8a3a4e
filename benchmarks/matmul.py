"""Benchmark cases for ``ops.fused_matmul``: ``act(x @ w + bias)``.

Each case pits our kernel (the platform's kernel implementation, see
:func:`benchmarks.harness.kernel_implementations`) against the baseline a user
would write without us: ``act(jnp.dot(x, w) + b)``, jitted, computed in the
inputs' dtype. Accuracy is measured against the same math in float64
(:func:`benchmarks.harness.reference_output`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import ops
from benchmarks import harness
from ops.activations import resolve_activation

OP = "fused_matmul"

# variant name -> (has bias, activation name or None)
VARIANTS = {"plain": (False, None), "bias+gelu_exact": (True, "gelu_exact")}
# Variants make_case builds beyond the suite's (the queued experiments use them).
EXTRA_VARIANTS = {"bias+gelu": (True, "gelu"), "bias+softplus": (True, "softplus")}

# (M, K, N), dtype. Accelerators: square products plus a transformer MLP
# up-projection (M tokens, K = d_model, N = 4 * d_model).
ACCELERATOR_SHAPES = (
    ((8192, 8192, 8192), "bfloat16"),
    ((8192, 4096, 16384), "bfloat16"),
    ((4096, 4096, 4096), "bfloat16"),
    ((4096, 4096, 4096), "float32"),
)
# CPUs run the kernel through the Pallas interpreter: sizes stay small so the
# whole suite finishes in a couple of minutes. 512x384x640 has dims that are
# not powers of two, so edge blocks and a padded contraction are timed too.
CPU_SHAPES = (
    ((256, 256, 256), "float32"),
    ((256, 256, 256), "bfloat16"),
    ((512, 384, 640), "float32"),
    ((512, 384, 640), "bfloat16"),
)
QUICK_SHAPES = {"cpu": (((128, 64, 96), "float32"),),
                "accelerator": (((512, 512, 512), "bfloat16"),)}


def mosaic_gpu_column(platform: str, dtype: str, quick: bool = False) -> tuple[str, ...]:
    """The matmul family's Mosaic GPU column (``implementation="mosaic_gpu"``, the
    warp-specialized core of :mod:`ops.matmul.mosaic_gpu_core`): on GPUs (an sm_90+ one
    runs it; an older one's row records its refusal) for the 16-bit dtypes it takes, and in
    a CPU's full run, where it runs in JAX's GPU interpret mode (not in quick runs: the
    interpreter takes seconds per kernel). Shared by the fused_matmul, gated linear unit,
    linear cross-entropy and ragged_dot cases."""
    if dtype not in ("bfloat16", "float16"):
        return ()
    if platform in ("gpu", "cuda") or (platform == "cpu" and not quick):
        return ("mosaic_gpu",)
    return ()


def shapes(platform: str, quick: bool = False):
    """The ``((M, K, N), dtype)`` pairs benchmarked on ``platform``."""
    return harness.pick_shapes(platform, quick, cpu=CPU_SHAPES, accelerator=ACCELERATOR_SHAPES,
                               quick_shapes=QUICK_SHAPES)


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every fused_matmul case for ``platform``: shapes x variants x passes.

    ``quick`` keeps one tiny shape (still every variant and pass), for smoke tests.
    """
    ours = harness.kernel_implementations(platform)
    return [make_case(shape, dtype, variant, pass_name,
                      ours + mosaic_gpu_column(platform, dtype, quick))
            for shape, dtype in shapes(platform, quick)
            for variant in VARIANTS
            for pass_name in harness.PASSES]


def make_case(shape, dtype: str, variant: str, pass_name: str,
              implementations: tuple[str, ...]) -> harness.Case:
    """One case: ``shape = (M, K, N)``, our ``implementations`` vs the XLA baseline."""
    m, k, n = shape
    has_bias, activation = {**VARIANTS, **EXTRA_VARIANTS}[variant]
    fns = {harness.BASELINE: functools.partial(_xla_baseline, activation=activation)}
    for implementation in implementations:
        fns[implementation] = functools.partial(_ours, activation=activation,
                                                implementation=implementation)
    reference = functools.partial(_reference, activation=activation)
    if pass_name == "fwd+bwd":
        fns = {name: harness.forward_and_backward(fn) for name, fn in fns.items()}
        reference = harness.forward_and_backward(reference)
    return harness.Case(
        op=OP, variant=variant, shape=(m, k, n), dtype=dtype, pass_name=pass_name,
        # The backward pass is two more products of the same size (dx and dw).
        flops=2.0 * m * n * k * (3 if pass_name == "fwd+bwd" else 1),
        make_inputs=functools.partial(_make_inputs, shape=(m, k, n), dtype=dtype,
                                      has_bias=has_bias, with_cotangent=pass_name == "fwd+bwd"),
        implementations=fns, reference=reference, ceiling="matmul")


def _make_inputs(key, *, shape, dtype, has_bias, with_cotangent):
    """``(x, w[, bias][, cotangent])``; w scaled by 1/sqrt(K) so outputs are O(1),
    the range where the activation's shape (and its error) matters."""
    m, k, n = shape
    kx, kw, kb, kc = jax.random.split(key, 4)
    inputs = [harness.random_normal(kx, (m, k), dtype),
              harness.random_normal(kw, (k, n), dtype, scale=k ** -0.5)]
    if has_bias:
        inputs.append(harness.random_normal(kb, (n,), dtype))
    if with_cotangent:
        inputs.append(harness.random_normal(kc, (m, n), dtype))
    return tuple(inputs)


def _xla_baseline(x, w, bias=None, *, activation):
    """What a user writes: plain JAX in the inputs' dtype."""
    y = jnp.dot(x, w)
    if bias is not None:
        y = y + bias
    act = resolve_activation(activation, "bench")
    return act(y) if act is not None else y


def _ours(x, w, bias=None, *, activation, implementation):
    return ops.fused_matmul(x, w, bias, activation=activation, implementation=implementation)


def _reference(x, w, bias=None, *, activation):
    """The exact answer: inputs upcast (:func:`benchmarks.harness.upcast`), full-precision products."""
    y = jnp.dot(harness.upcast(x), harness.upcast(w), precision=lax.Precision.HIGHEST)
    if bias is not None:
        y = y + harness.upcast(bias)
    act = resolve_activation(activation, "bench")
    return act(y) if act is not None else y
