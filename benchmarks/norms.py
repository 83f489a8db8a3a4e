"""Benchmark cases for ``layer_norm`` and ``rms_norm`` (:mod:`ops.reduction.norms`).

Each case pits our kernel (the platform's kernel implementation, see
:func:`benchmarks.harness.kernel_implementations`) against the baseline a user
would write without us: the normalization in plain ``jnp`` (statistics in
float32, as Flax computes them), jitted. Accuracy is measured against the
same math in float64 (:func:`benchmarks.harness.reference_output`).

Both ops are memory-bound, so cases are compared to the device's measured
copy bandwidth (``ceiling="copy"``). ``bytes_accessed`` counts the traffic a
fully fused implementation cannot avoid, with ``N = rows * hidden`` elements
of ``s`` bytes and ``P`` the parameter bytes (``hidden * s`` per scale/bias):

* fwd: read x, write y: ``2 * N * s + P``.
* fwd+bwd: the forward, then read x and the cotangent and write dx
  (``5 * N * s``), plus the params read by the forward, the scale read again
  by the backward and the parameter gradients written: ``2 * P + hidden * s``.
  The per-row float32 statistics our forward keeps (8 bytes a row) and the
  per-row-block partial sums of dscale / dbias are not counted: they are
  overhead of our kernels, not work the problem requires.

JAX's own Pallas kernels, ``jax.experimental.pallas.ops.gpu.layer_norm.
layer_norm`` and ``rms_norm.rms_norm`` (:mod:`benchmarks.jax_pallas_ops`),
are the ``jax_pallas`` column of the layer_norm and rms_norm cases, forward
and fwd+bwd (their custom VJPs), at the same epsilon: compiled by JAX's
Pallas Triton lowering on GPUs, on JAX's interpreter in full CPU runs (not
quick ones). JAX's rms_norm requires a bias, so it gets a zero one: one more
``hidden``-element read, and in the backward a ``hidden``-element dbias
written, beyond the bytes counted above. Their backward keeps the per-row
statistics in x's dtype (bfloat16 rounds them). The residual-fused variant
below has no JAX counterpart, hence no such column.

The residual-fused RMSNorm (variant ``add+scale``: ``h = x + residual; y =
rms_norm(h)``, both returned, as in every pre-norm decoder layer) is compared
with what a user writes today: the add, then ``flax.nnx.RMSNorm`` on the sum,
jitted. Its unavoidable traffic: fwd reads x and residual and writes y and h
(``4 * N * s + P``); fwd+bwd adds reading h and both cotangents and writing
the one gradient x and residual share (``4 * N * s``), plus ``P`` again and
dscale.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from benchmarks import harness, jax_pallas_ops
from ops.reduction.norms import layer_norm, rms_norm

# op name -> (center, has bias). Both ops take a scale, as in every model.
OPS = {"layer_norm": (True, True), "rms_norm": (False, False)}
VARIANT = {"layer_norm": "scale+bias", "rms_norm": "scale"}
EPSILON = 1e-6

# (rows, hidden), dtype. Accelerators: transformer activations (tokens x
# d_model) from a small model to a large one, bf16 mostly (training), a
# couple of float32 cases, hidden sizes that are and are not powers of two.
ACCELERATOR_SHAPES = (
    ((4096, 1024), "bfloat16"),
    ((16384, 4096), "bfloat16"),
    ((32768, 5120), "bfloat16"),
    ((8192, 12288), "bfloat16"),
    ((16384, 4096), "float32"),
    ((4096, 16384), "float32"),
)
# CPUs run the kernels through the Pallas interpreter: tiny sizes keep the
# whole CPU suite fast. 1000 is not a power of two (masked last chunk) and 37
# rows leave a partial row block.
CPU_SHAPES = (
    ((64, 384), "float32"),
    ((37, 1000), "bfloat16"),
)
QUICK_SHAPES = {"cpu": (((16, 256), "float32"),),
                "accelerator": (((4096, 1024), "bfloat16"),)}


def shapes(platform: str, quick: bool = False):
    """The ``((rows, hidden), dtype)`` pairs benchmarked on ``platform``."""
    return harness.pick_shapes(platform, quick, cpu=CPU_SHAPES, accelerator=ACCELERATOR_SHAPES,
                               quick_shapes=QUICK_SHAPES)


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every norm case for ``platform``: shapes x ops x passes.

    ``quick`` keeps one tiny shape (still both ops and both passes, without the
    residual-fused variant), for smoke tests.
    """
    ours = harness.kernel_implementations(platform)
    interpret = jax_pallas_ops.interpret_mode(platform, quick)
    out = []
    for shape, dtype in shapes(platform, quick):
        out += [make_case(op, shape, dtype, pass_name, ours, jax_pallas_interpret=interpret)
                for op in OPS for pass_name in harness.PASSES]
        if not quick:
            out += [make_residual_case(shape, dtype, pass_name, ours)
                    for pass_name in harness.PASSES]
    return out


def make_case(op: str, shape, dtype: str, pass_name: str, implementations: tuple[str, ...], *,
              jax_pallas_interpret: bool | None = None) -> harness.Case:
    """One case: ``op`` on ``shape = (rows, hidden)``, our ``implementations`` vs XLA.

    ``jax_pallas_interpret`` (:func:`benchmarks.jax_pallas_ops.interpret_mode`):
    None leaves out the ``jax_pallas`` column (JAX's kernel), else its
    ``interpret`` flag.
    """
    rows, hidden = shape
    center, has_bias = OPS[op]
    fns = {harness.BASELINE: functools.partial(_xla_baseline, center=center)}
    for implementation in implementations:
        fns[implementation] = functools.partial(_ours, op=op, implementation=implementation)
    if jax_pallas_interpret is not None:
        fns[jax_pallas_ops.NAME] = functools.partial(_jax_pallas, op=op,
                                                     interpret=jax_pallas_interpret)
    ref = functools.partial(_reference, center=center)
    if pass_name == "fwd+bwd":
        fns = {name: harness.forward_and_backward(fn) for name, fn in fns.items()}
        ref = harness.forward_and_backward(ref)
    itemsize = jnp.dtype(dtype).itemsize
    n = rows * hidden
    n_params = 1 + int(has_bias)
    params = n_params * hidden * itemsize
    if pass_name == "fwd":
        bytes_accessed = 2 * n * itemsize + params
    else:
        bytes_accessed = 5 * n * itemsize + 2 * params + hidden * itemsize
    # Nominal flops per element: LayerNorm forward 8 (sum, subtract, square,
    # sum, scale by rstd, scale, add bias, ...), RMSNorm 5; the backward about
    # twice the forward. Memory bound either way: GB/s is the figure of merit.
    per_elem = 8 if center else 5
    flops = float(per_elem * n * (3 if pass_name == "fwd+bwd" else 1))
    return harness.Case(
        op=op, variant=VARIANT[op], shape=(rows, hidden), dtype=dtype, pass_name=pass_name,
        flops=flops,
        make_inputs=functools.partial(_make_inputs, shape=(rows, hidden), dtype=dtype,
                                      has_bias=has_bias, with_cotangent=pass_name == "fwd+bwd"),
        implementations=fns, reference=ref, ceiling="copy", bytes_accessed=float(bytes_accessed))


def _make_inputs(key, *, shape, dtype, has_bias, with_cotangent):
    """``(x, scale[, bias][, cotangent])``: activations with a non-zero mean (1.0)
    so centering matters, scale around 1, bias around 0."""
    rows, hidden = shape
    kx, ks, kb, kc = jax.random.split(key, 4)
    x = (harness.random_normal(kx, (rows, hidden), jnp.float32) + 1.0).astype(dtype)
    inputs = [x, (1.0 + harness.random_normal(ks, (hidden,), jnp.float32, 0.1)).astype(dtype)]
    if has_bias:
        inputs.append(harness.random_normal(kb, (hidden,), dtype, 0.1))
    if with_cotangent:
        inputs.append(harness.random_normal(kc, (rows, hidden), dtype))
    return tuple(inputs)


def _xla_baseline(x, scale, bias=None, *, center):
    """What a user writes: float32 statistics (as Flax does), output in x's dtype."""
    return _normalize(x.astype(jnp.float32), scale.astype(jnp.float32),
                      None if bias is None else bias.astype(jnp.float32), center).astype(x.dtype)


def _normalize(xf, scale, bias, center):
    """The normalization in ``xf``'s dtype: statistics, rsqrt, scale, bias."""
    if center:
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        y = (xf - mean) * lax.rsqrt(jnp.var(xf, axis=-1, keepdims=True) + EPSILON)
    else:
        y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + EPSILON)
    y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _ours(x, scale, bias=None, *, op, implementation):
    if op == "layer_norm":
        return layer_norm(x, scale, bias, epsilon=EPSILON, implementation=implementation)
    return rms_norm(x, scale, epsilon=EPSILON, implementation=implementation)


def _jax_pallas(x, scale, bias=None, *, op, interpret):
    """JAX's own kernel for ``op`` (:mod:`benchmarks.jax_pallas_ops`)."""
    if op == "layer_norm":
        return jax_pallas_ops.layer_norm(x, scale, bias, epsilon=EPSILON, interpret=interpret)
    return jax_pallas_ops.rms_norm(x, scale, epsilon=EPSILON, interpret=interpret)


def _reference(x, scale, bias=None, *, center):
    """The exact answer: the inputs upcast (:func:`benchmarks.harness.upcast`)."""
    return _normalize(harness.upcast(x), harness.upcast(scale),
                      None if bias is None else harness.upcast(bias), center)


RESIDUAL_VARIANT = "add+scale"


def make_residual_case(shape, dtype: str, pass_name: str,
                       implementations: tuple[str, ...]) -> harness.Case:
    """Fused add + RMSNorm on ``shape = (rows, hidden)``: ``rms_norm(x, scale,
    residual=r)`` against the add then ``nnx.RMSNorm`` (module docstring)."""
    rows, hidden = shape
    fns = {harness.BASELINE: _add_then_nnx_rms_norm}
    for implementation in implementations:
        fns[implementation] = functools.partial(_ours_residual, implementation=implementation)
    ref = _residual_reference
    if pass_name == "fwd+bwd":
        fns = {name: _forward_and_backward_pair(fn) for name, fn in fns.items()}
        ref = _forward_and_backward_pair(ref)
    itemsize = jnp.dtype(dtype).itemsize
    n = rows * hidden
    params = hidden * itemsize
    if pass_name == "fwd":
        bytes_accessed = 4 * n * itemsize + params
    else:
        bytes_accessed = 8 * n * itemsize + 2 * params + hidden * itemsize
    flops = float(6 * n * (3 if pass_name == "fwd+bwd" else 1))
    return harness.Case(
        op="rms_norm", variant=RESIDUAL_VARIANT, shape=(rows, hidden), dtype=dtype,
        pass_name=pass_name, flops=flops,
        make_inputs=functools.partial(_make_residual_inputs, shape=(rows, hidden), dtype=dtype,
                                      with_cotangent=pass_name == "fwd+bwd"),
        implementations=fns, reference=ref, ceiling="copy", bytes_accessed=float(bytes_accessed))


def _make_residual_inputs(key, *, shape, dtype, with_cotangent):
    """``(x, residual, scale[, cotangent of y, cotangent of h])``."""
    kx, kr, ks, kc, kh = jax.random.split(key, 5)
    x = harness.random_normal(kx, shape, dtype)
    residual = harness.random_normal(kr, shape, dtype)
    scale = (1.0 + harness.random_normal(ks, (shape[1],), jnp.float32, 0.1)).astype(dtype)
    inputs = [x, residual, scale]
    if with_cotangent:
        inputs += [harness.random_normal(kc, shape, dtype), harness.random_normal(kh, shape, dtype)]
    return tuple(inputs)


def _forward_and_backward_pair(fn):
    """``(x, residual, scale, gy, gh) -> ((y, h), grads)``: both outputs carry a cotangent."""
    def fwd_bwd(x, residual, scale, gy, gh):
        out, pullback = jax.vjp(fn, x, residual, scale)
        return out, pullback((gy.astype(out[0].dtype), gh.astype(out[1].dtype)))
    return fwd_bwd


def _add_then_nnx_rms_norm(x, residual, scale):
    """The unfused layer: the residual add, then Flax's RMSNorm with ``scale`` as its param."""
    h = x + residual
    norm = nnx.RMSNorm(h.shape[-1], epsilon=EPSILON, param_dtype=scale.dtype,
                       rngs=nnx.Rngs(0))
    norm.scale[...] = scale
    return norm(h), h


def _ours_residual(x, residual, scale, *, implementation):
    return rms_norm(x, scale, epsilon=EPSILON, residual=residual, implementation=implementation)


def _residual_reference(x, residual, scale):
    """The exact answer on upcast inputs (the sum itself exact, as in float64)."""
    h = harness.upcast(x) + harness.upcast(residual)
    return _normalize(h, harness.upcast(scale), None, False), h
