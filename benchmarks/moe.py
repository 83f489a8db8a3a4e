"""Benchmark cases for ``ops.ragged_dot``, the grouped matmul of mixture-of-experts layers.

Each case pits our kernels against what a user has without them:

* ``xla`` (the baseline): ``jax.lax.ragged_dot``, jitted (on a GPU, JAX 0.10.2
  lowers it to a dense computation);
* ``dense_loop``: one ``jnp.dot`` per expert over its rows, the group sizes
  baked in as Python ints (what a user writes when routing is known while
  tracing; it recompiles for every routing, so it is a best case for the
  loop, and together its products are a dense matmul of the same FLOPs).

FLOPs count only the useful rows: ``2 * sum(group_sizes) * K * N`` per
product (forward one, backward two: dlhs and drhs). Group sizes come from a
fixed skewed draw (a Dirichlet over experts, as a router's load looks, some
experts empty at 64), the same for every implementation and every call.
Accuracy is against per-group products in float64
(:func:`benchmarks.harness.reference_output`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ops
from benchmarks import harness
from benchmarks.matmul import mosaic_gpu_column

OP = "ragged_dot"
DENSE_LOOP = "dense_loop"

# (M rows = tokens x top-k, K, N, G experts), dtype. Accelerators: Mixtral 8x7B's
# expert up-projection at 16k tokens top-2; a fine-grained MoE (64 experts, top-8,
# 2048 -> 1024, OLMoE-like) at 16k tokens; the down-projection of the first.
ACCELERATOR_SHAPES = (
    ((32768, 4096, 14336, 8), "bfloat16"),
    ((32768, 14336, 4096, 8), "bfloat16"),
    ((131072, 2048, 1024, 64), "bfloat16"),
)
# CPUs run the interpreters: small, with dims that divide no tile.
CPU_SHAPES = (((200, 96, 160, 8), "float32"), ((256, 128, 192, 4), "bfloat16"))
QUICK_SHAPES = {"cpu": (((64, 32, 48, 4), "float32"),),
                "accelerator": (((4096, 1024, 2048, 8), "bfloat16"),)}


def shapes(platform: str, quick: bool = False):
    """The ``((M, K, N, G), dtype)`` pairs benchmarked on ``platform``."""
    return harness.pick_shapes(platform, quick, cpu=CPU_SHAPES, accelerator=ACCELERATOR_SHAPES,
                               quick_shapes=QUICK_SHAPES)


def group_sizes(m: int, groups: int, seed: int = 0) -> tuple[int, ...]:
    """A skewed split of ``m`` rows over ``groups`` (Dirichlet(0.3) shares, rounded so the
    sizes sum to ``m``); deterministic per ``(m, groups, seed)``."""
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(groups, 0.3))
    sizes = np.floor(shares * m).astype(int)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return tuple(int(s) for s in sizes)


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every ragged_dot case for ``platform``: shapes x passes (fwd, fwd+bwd); ``quick``
    keeps one tiny shape and its forward (a smoke test; tests/test_ragged_dot.py checks
    the backward kernels)."""
    ours = harness.kernel_implementations(platform)
    passes = ("fwd",) if quick else harness.PASSES
    return [make_case(shape, dtype, pass_name, ours + mosaic_gpu_column(platform, dtype, quick))
            for shape, dtype in shapes(platform, quick) for pass_name in passes]


def make_case(shape, dtype: str, pass_name: str, implementations) -> harness.Case:
    """One case: ``shape = (M, K, N, G)``."""
    m, k, n, g = shape
    sizes = group_sizes(m, g)
    fns = {harness.BASELINE: _lax, DENSE_LOOP: functools.partial(_dense_loop, sizes=sizes)}
    for impl in implementations:
        fns[impl] = functools.partial(_ours, implementation=impl)
    reference = functools.partial(_reference, sizes=sizes)
    if pass_name == "fwd+bwd":
        fns = {name: harness.forward_and_backward(fn, nondiff=1) for name, fn in fns.items()}
        reference = harness.forward_and_backward(reference, nondiff=1)
    useful = 2.0 * sum(sizes) * k * n
    return harness.Case(
        op=OP, variant=f"{g}-experts", shape=(m, k, n), dtype=dtype, pass_name=pass_name,
        flops=useful * (3 if pass_name == "fwd+bwd" else 1),
        make_inputs=functools.partial(_make_inputs, shape=shape, sizes=sizes, dtype=dtype,
                                      with_cotangent=pass_name == "fwd+bwd"),
        implementations=fns, reference=reference, ceiling="matmul")


def _make_inputs(key, *, shape, sizes, dtype, with_cotangent):
    """``(lhs, rhs, group_sizes[, cotangent])``; rhs scaled by 1/sqrt(K)."""
    m, k, n, g = shape
    kl, kr, kc = jax.random.split(key, 3)
    inputs = [harness.random_normal(kl, (m, k), dtype),
              harness.random_normal(kr, (g, k, n), dtype, scale=k ** -0.5),
              jnp.asarray(sizes, jnp.int32)]
    if with_cotangent:
        inputs.append(harness.random_normal(kc, (m, n), dtype))
    return tuple(inputs)


def _lax(lhs, rhs, gs):
    return lax.ragged_dot(lhs, rhs, gs)


def _ours(lhs, rhs, gs, *, implementation):
    return ops.ragged_dot(lhs, rhs, gs, implementation=implementation)


def _dense_loop(lhs, rhs, gs, *, sizes):
    """One matmul per expert over its (static) rows; rows past the sum are zero."""
    del gs
    outs, start = [], 0
    for g, size in enumerate(sizes):
        outs.append(jnp.dot(lhs[start:start + size], rhs[g]))
        start += size
    tail = lhs.shape[0] - start
    if tail:
        outs.append(jnp.zeros((tail, rhs.shape[2]), lhs.dtype))
    return jnp.concatenate(outs)


def _reference(lhs, rhs, gs, *, sizes):
    """Per-group products of the upcast inputs at full precision."""
    del gs
    lhs, rhs = harness.upcast(lhs), harness.upcast(rhs)
    outs, start = [], 0
    for g, size in enumerate(sizes):
        outs.append(jnp.dot(lhs[start:start + size], rhs[g], precision=lax.Precision.HIGHEST))
        start += size
    return jnp.concatenate(outs)
