"""Benchmark cases for the softmax family and the reductions of :mod:`ops.reduction`.

Ops: ``softmax``, ``log_softmax``, ``logsumexp`` (:mod:`ops.reduction.softmax`)
and ``sum``, ``max`` (:mod:`ops.reduction.reduce`), forward and forward +
backward. Each case pits our kernel (the platform's kernel implementation,
see :func:`benchmarks.harness.kernel_implementations`) against the baseline a
user would write without us: ``jax.nn.softmax(x)``, ``jnp.sum(x, axis)``...
in the inputs' dtype, jitted. Accuracy is measured against the same math in
float64 (:func:`benchmarks.harness.reference_output`).

Every op here is memory-bound, so cases are compared to the device's measured
copy bandwidth (``ceiling="copy"``). ``bytes_accessed`` counts the traffic a
fully fused implementation cannot avoid, with ``N = rows * cols`` elements of
``s`` bytes (per-row results and statistics, ``rows`` elements, are
negligible and not counted):

* softmax / log_softmax: fwd reads x and writes y (``2 N s``); the backward
  reads y and the cotangent and writes dx (``+3 N s``).
* logsumexp: fwd reads x (``N s``); the backward reads x and writes dx
  (``+2 N s``).
* sum: fwd reads x (``N s``); the backward writes the broadcast cotangent
  (``+N s``).
* max: fwd reads x (``N s``); the backward reads x for the tie mask and writes
  dx (``+2 N s``).

JAX's own Pallas kernel ``jax.experimental.pallas.ops.gpu.softmax.softmax``
(:mod:`benchmarks.jax_pallas_ops`) is the ``jax_pallas`` column of the
``softmax`` forward cases: compiled by JAX's Pallas Triton lowering on GPUs,
on JAX's interpreter in full CPU runs (not quick ones). It has no VJP
(reverse mode through its ``pallas_call`` fails), so the ``fwd+bwd`` cases
have no such column; JAX has no log_softmax, logsumexp or reduction kernel.
It holds a whole row in one power-of-two block per program.

``flops`` are nominal per-element operation counts (max, subtract, exp, add,
multiply...), there so rows carry a rate; GB/s is the figure that matters.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks import harness, jax_pallas_ops
from ops.reduction import reduce as reductions
from ops.reduction.softmax import log_softmax, logsumexp, softmax

# op -> (our function, the XLA baseline, flops per element fwd / bwd,
#        bytes per element (in units of the dtype's size) fwd / bwd, variant)
_FAMILY = {
    "softmax": (softmax, jax.nn.softmax, 5, 4, 2, 3),
    "log_softmax": (log_softmax, jax.nn.log_softmax, 5, 3, 2, 3),
    "logsumexp": (logsumexp, jax.nn.logsumexp, 4, 3, 1, 2),
}
_REDUCTIONS = {
    "sum": (reductions.sum, jnp.sum, 1, 1, 1, 1),
    "max": (reductions.max, jnp.max, 1, 2, 1, 2),
}
OPS = {**_FAMILY, **_REDUCTIONS}
# Variants: the family normalizes the last axis; reductions reduce the last
# axis (one result per row) or everything (axis=None: the split-row path).
VARIANTS = {**{op: ("axis=-1",) for op in _FAMILY}, **{op: ("axis=-1", "axis=None")
                                                       for op in _REDUCTIONS}}

# (rows, cols), dtype. Accelerators: attention-score rows (32768 x 1024),
# mid-size rows, vocabulary-wide logits (4096 x 16384) in bf16, one float32.
FAMILY_ACCELERATOR_SHAPES = (
    ((32768, 1024), "bfloat16"),
    ((16384, 4096), "bfloat16"),
    ((4096, 16384), "bfloat16"),
    ((8192, 8192), "float32"),
)
REDUCTION_ACCELERATOR_SHAPES = (
    ((16384, 4096), "bfloat16"),
    ((8192, 8192), "float32"),
)
# CPUs run the kernels through the Pallas interpreter: tiny sizes. 1000 is not
# a power of two (masked last chunk) and 37 rows leave a partial row block.
CPU_SHAPES = (
    ((64, 384), "float32"),
    ((37, 1000), "bfloat16"),
)
QUICK_SHAPES = {"cpu": (((16, 256), "float32"),),
                "accelerator": (((4096, 1024), "bfloat16"),)}


def shapes(op: str, platform: str, quick: bool = False):
    """The ``((rows, cols), dtype)`` pairs benchmarked for ``op`` on ``platform``."""
    on_cpu = platform == "cpu"
    if quick:
        return QUICK_SHAPES["cpu" if on_cpu else "accelerator"]
    if on_cpu:
        return CPU_SHAPES
    return FAMILY_ACCELERATOR_SHAPES if op in _FAMILY else REDUCTION_ACCELERATOR_SHAPES


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every case for ``platform``: ops x shapes x variants x passes.

    ``quick`` keeps one tiny shape and the ``axis=-1`` variant (still every op
    and pass), for smoke tests.
    """
    ours = harness.kernel_implementations(platform)
    interpret = jax_pallas_ops.interpret_mode(platform, quick)
    return [make_case(op, shape, dtype, variant, pass_name, ours, jax_pallas_interpret=interpret)
            for op in OPS
            for shape, dtype in shapes(op, platform, quick)
            for variant in (VARIANTS[op][:1] if quick else VARIANTS[op])
            for pass_name in harness.PASSES]


def make_case(op: str, shape, dtype: str, variant: str, pass_name: str,
              implementations: tuple[str, ...], *,
              jax_pallas_interpret: bool | None = None) -> harness.Case:
    """One case: ``op`` on a ``(rows, cols)`` array, our ``implementations`` vs XLA.

    ``jax_pallas_interpret`` (:func:`benchmarks.jax_pallas_ops.interpret_mode`):
    None leaves out the ``jax_pallas`` column, else its ``interpret`` flag; only
    ``softmax``'s forward cases have one (module docstring).
    """
    rows, cols = shape
    fn, baseline, flops_fwd, flops_bwd, bytes_fwd, bytes_bwd = OPS[op]
    axis = None if variant == "axis=None" else -1
    extra = {"axis": axis} if op in _REDUCTIONS or op == "logsumexp" else {}
    xla_fn = functools.partial(baseline, **extra)
    fns = {harness.BASELINE: xla_fn}
    for implementation in implementations:
        fns[implementation] = functools.partial(fn, implementation=implementation, **extra)
    with_bwd = pass_name == "fwd+bwd"
    # JAX's softmax kernel has no VJP: forward only; JAX has no log_softmax or logsumexp kernel.
    if jax_pallas_interpret is not None and op == "softmax" and not with_bwd:
        fns[jax_pallas_ops.NAME] = functools.partial(jax_pallas_ops.softmax,
                                                     interpret=jax_pallas_interpret)
    reference = functools.partial(_reference, xla_fn)
    if with_bwd:
        fns = {name: harness.forward_and_backward(f) for name, f in fns.items()}
        reference = harness.forward_and_backward(reference)
    n = rows * cols
    itemsize = jnp.dtype(dtype).itemsize
    if op in _FAMILY:
        out_shape = (rows,) if op == "logsumexp" else (rows, cols)
    else:
        out_shape = () if axis is None else (rows,)
    return harness.Case(
        op=op, variant=variant, shape=(rows, cols), dtype=dtype, pass_name=pass_name,
        flops=float(n * (flops_fwd + (flops_bwd if with_bwd else 0))),
        make_inputs=functools.partial(_make_inputs, shape=(rows, cols), dtype=dtype,
                                      cotangent_shape=out_shape if with_bwd else None),
        implementations=fns, reference=reference, ceiling="copy",
        bytes_accessed=float(n * itemsize * (bytes_fwd + (bytes_bwd if with_bwd else 0))))


def _make_inputs(key, *, shape, dtype, cotangent_shape):
    """``(x[, cotangent])``: standard-normal logits (the scale of trained
    models' pre-softmax scores) and cotangent."""
    kx, kc = jax.random.split(key)
    inputs = [harness.random_normal(kx, shape, dtype)]
    if cotangent_shape is not None:
        inputs.append(harness.random_normal(kc, cotangent_shape, dtype))
    return tuple(inputs)


def _reference(fn, x):
    """The exact answer: the baseline's math on x upcast (:func:`benchmarks.harness.upcast`)."""
    return fn(harness.upcast(x))
