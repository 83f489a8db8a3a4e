"""Benchmark cases for the decoder ops: ``apply_rotary_embedding`` and ``gated_linear_unit``.

Each case pits our kernels against the XLA composition a user writes today,
jitted:

* rotary embedding: ``cos`` / ``sin`` tables ``[B, T, R]`` computed from the
  positions in float32 and cast to x's dtype, ``x * cos + rotate_half(x) * sin``
  in x's dtype (transformers' ``apply_rotary_pos_emb`` in ``jnp``), the
  pass-through features concatenated back;
* gated linear unit: two matmuls and the gate, ``act(x @ w[:, 0]) * (x @ w[:, 1])``
  in the inputs' dtype. Each case comes in both weight forms of
  ``ops.gated_linear_unit``, side by side at the same shapes: stacked ``[K, 2,
  N]`` (variant ``swiglu``, ...) and the pair ``(gate, up)`` of ``[K, N]``
  arrays (variant ``swiglu/pair``, ...), the form ``layers.GatedMLP`` passes,
  so the path models take is measured; its baseline is the same XLA math on
  the two arrays.

Accuracy is measured against the same math in float64
(:func:`benchmarks.harness.reference_output`). Passes: ``fwd``, ``bwd`` (the
backward alone: for the rotary embedding the gradient of x, whose forward
XLA drops as dead code, the rotation having no residuals; for the GLU the
backward from the forward's pre-activations, given as inputs) and ``fwd+bwd``.

The rotary embedding is memory-bound (``ceiling="copy"``): with ``N = B T
Nh H`` elements of ``s`` bytes, a fused kernel reads x and writes the result,
``2 N s`` bytes per direction (``4 N s`` for fwd+bwd), plus 4 bytes per token
of positions. The GLU is compute-bound (``ceiling="matmul"``): ``4 M K N``
flops forward (two products), ``8 M K N`` backward (dx and dw over ``2N``
columns).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import ops
from benchmarks import harness
from benchmarks.matmul import mosaic_gpu_column
from ops.activations import resolve_activation
from ops.decoder.glu import glu_backward
from ops.decoder.reference import glu_backward_reference, glu_preactivations

PASSES = ("fwd", "bwd", "fwd+bwd")

# --------------------------------------------------------------------------
# Rotary embedding
# --------------------------------------------------------------------------

ROPE = "apply_rotary_embedding"
# (B, T, heads, head_dim, rotary_dim), dtype. Accelerators: Llama 3 8B's queries and
# (GQA) keys at 4 x 4096 tokens, a partial rotary head (Phi-2: 32 of 80 features).
ROPE_ACCELERATOR = (
    ((4, 4096, 32, 128, 128), "bfloat16"),
    ((4, 4096, 8, 128, 128), "bfloat16"),
    ((4, 2048, 32, 80, 32), "bfloat16"),
    ((4, 4096, 32, 128, 128), "float32"),
)
# CPUs run the interpreters: small, with tokens and heads that divide no block and a
# partial rotary head whose halves are not powers of two.
ROPE_CPU = (((2, 64, 4, 32, 32), "float32"), ((1, 37, 3, 40, 24), "bfloat16"))
ROPE_QUICK = {"cpu": (((1, 16, 2, 16, 16), "float32"),),
              "accelerator": (((1, 1024, 8, 128, 128), "bfloat16"),)}
THETA = 500000.0

# --------------------------------------------------------------------------
# Gated linear unit
# --------------------------------------------------------------------------

GLU = "gated_linear_unit"
# variant -> activation name
GLU_VARIANTS = {"swiglu": "silu", "geglu_tanh": "gelu"}
# (M, K, N), dtype. Accelerators: Llama 3 8B's MLP (4096 -> 14336) at 8192 tokens,
# Gemma 2 2B's (2304 -> 9216), and a float32 case.
GLU_ACCELERATOR = (
    ((8192, 4096, 14336), "bfloat16"),
    ((8192, 2304, 9216), "bfloat16"),
    ((4096, 2048, 5632), "float32"),
)
# On CPUs one activation per shape: SwiGLU in float32, GeGLU (tanh) in bfloat16.
GLU_CPU = (((128, 96, 160), "float32"), ((100, 72, 90), "bfloat16"))
GLU_CPU_VARIANT = {"float32": "swiglu", "bfloat16": "geglu_tanh"}
GLU_QUICK = {"cpu": (((64, 32, 48), "float32"),),
             "accelerator": (((1024, 1024, 2816), "bfloat16"),)}
# The weight forms: stacked [K, 2, N] (Tokamax's layout) and the pair (gate, up) of [K, N].
GLU_FORMS = ("stacked", "pair")


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every decoder-op case for ``platform``: shapes x variants x passes (on CPUs one
    GLU activation per shape).

    ``quick`` keeps one tiny shape per op and its fwd+bwd pass (which runs every
    kernel), for smoke tests; the GLU in both weight forms (their backward kernels
    differ).
    """
    ours = harness.kernel_implementations(platform)
    rope_shapes = harness.pick_shapes(platform, quick, cpu=ROPE_CPU, accelerator=ROPE_ACCELERATOR,
                                      quick_shapes=ROPE_QUICK)
    glu_shapes = harness.pick_shapes(platform, quick, cpu=GLU_CPU, accelerator=GLU_ACCELERATOR,
                                     quick_shapes=GLU_QUICK)
    passes = ("fwd+bwd",) if quick else PASSES

    def variants(dtype):
        if quick:
            return ("swiglu",)
        return (GLU_CPU_VARIANT[dtype],) if platform == "cpu" else tuple(GLU_VARIANTS)

    return ([rope_case(shape, dtype, p, ours) for shape, dtype in rope_shapes for p in passes]
            + [glu_case(shape, dtype, v, p, ours + mosaic_gpu_column(platform, dtype, quick),
                        form)
               for shape, dtype in glu_shapes for v in variants(dtype) for p in passes
               for form in GLU_FORMS])


# --------------------------------------------------------------------------
# Rotary embedding cases
# --------------------------------------------------------------------------

def rope_case(shape, dtype: str, pass_name: str, implementations) -> harness.Case:
    """One case: ``shape = (B, T, heads, head_dim, rotary_dim)``."""
    b, t, heads, head_dim, rotary_dim = shape
    inv_freq, _ = ops.rope_frequencies(rotary_dim, theta=THETA)
    fns = {harness.BASELINE: functools.partial(_xla_rope, inv_freq=inv_freq)}
    for impl in implementations:
        fns[impl] = functools.partial(_our_rope, inv_freq=inv_freq, implementation=impl)
    ref = functools.partial(_rope_reference, inv_freq=inv_freq)
    if pass_name == "fwd+bwd":
        fns = {k: harness.forward_and_backward(f, nondiff=1) for k, f in fns.items()}
        ref = harness.forward_and_backward(ref, nondiff=1)
    elif pass_name == "bwd":
        fns = {k: _gradient_only(f) for k, f in fns.items()}
        ref = _gradient_only(ref)
    n = b * t * heads * head_dim
    s = jnp.dtype(dtype).itemsize
    directions = 2 if pass_name == "fwd+bwd" else 1
    variant = "rotate_half" + ("" if rotary_dim == head_dim else f"/partial{rotary_dim}")
    return harness.Case(
        op=ROPE, variant=variant, shape=(b, t, heads, head_dim), dtype=dtype, pass_name=pass_name,
        # Per rotated pair: 4 multiplies and 2 adds; cos/sin once per token and frequency.
        flops=float(3 * b * t * heads * rotary_dim * directions),
        make_inputs=functools.partial(_rope_inputs, shape=shape, dtype=dtype,
                                      with_cotangent=pass_name != "fwd"),
        implementations=fns, reference=ref, ceiling="copy",
        bytes_accessed=float(directions * (2 * n * s + 4 * b * t)))


def _gradient_only(fn):
    """``(x, positions, cotangent) -> dx``: the backward pass alone (the rotation's
    backward needs no residual, so the forward is dead code under jit)."""
    def bwd(x, positions, cotangent):
        _, pullback = jax.vjp(lambda x: fn(x, positions), x)
        return pullback(cotangent.astype(x.dtype))[0]
    return bwd


def _rope_inputs(key, *, shape, dtype, with_cotangent):
    b, t, heads, head_dim, _ = shape
    kx, kc, kp = jax.random.split(key, 3)
    x = harness.random_normal(kx, (b, t, heads, head_dim), dtype)
    # Positions of packed sequences: each row restarts at a random offset.
    start = jax.random.randint(kp, (b, 1), 0, 4 * t)
    positions = (start + jnp.arange(t, dtype=jnp.int32)[None]).astype(jnp.int32)
    inputs = [x, positions]
    if with_cotangent:
        inputs.append(harness.random_normal(kc, x.shape, dtype))
    return tuple(inputs)


def _xla_rope(x, positions, *, inv_freq):
    """What a user writes (transformers' rotary module in jnp): float32 tables cast to
    x's dtype, the rotation in x's dtype."""
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb).astype(x.dtype)[..., None, :], jnp.sin(emb).astype(x.dtype)[..., None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def _our_rope(x, positions, *, inv_freq, implementation):
    return ops.apply_rotary_embedding(x, positions, inv_freq, implementation=implementation)


def _rope_reference(x, positions, *, inv_freq):
    """The exact answer: float32 angles (every implementation's), rotation in the upcast dtype."""
    xw = harness.upcast(x)
    rotary_dim = 2 * inv_freq.shape[0]
    angles = (positions.astype(jnp.float32)[..., None] * inv_freq).astype(xw.dtype)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    half = rotary_dim // 2
    x1, x2, rest = xw[..., :half], xw[..., half:rotary_dim], xw[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


# --------------------------------------------------------------------------
# Gated linear unit cases
# --------------------------------------------------------------------------

def glu_case(shape, dtype: str, variant: str, pass_name: str, implementations,
             form: str = "stacked") -> harness.Case:
    """One case: ``shape = (M, K, N)``, activation of ``variant``, weights in ``form``
    (one of :data:`GLU_FORMS`; the pair's variant is suffixed ``/pair``).

    The pair's inputs are flat, ``(x, gate, up[, ...])``, each projection its own
    argument (and gradient), as a model holds them.

    Raises:
      ValueError: an unknown ``form``.
    """
    if form not in GLU_FORMS:
        raise ValueError(f"form: expected one of {GLU_FORMS}, got {form!r}.")
    m, k, n = shape
    activation = GLU_VARIANTS[variant]
    paired = form == "pair"
    if pass_name == "bwd":
        fns = {harness.BASELINE: functools.partial(_xla_glu_bwd, activation=activation)}
        for impl in implementations:
            fns[impl] = functools.partial(glu_backward, activation=activation, implementation=impl)
        ref = functools.partial(_glu_bwd_reference, activation=activation)
    else:
        fns = {harness.BASELINE: functools.partial(_xla_glu, activation=activation)}
        for impl in implementations:
            fns[impl] = functools.partial(_our_glu, activation=activation, implementation=impl)
        ref = functools.partial(_glu_reference, activation=activation)
    if paired:
        fns = {name: _paired(fn, pass_name) for name, fn in fns.items()}
        ref = _paired(ref, pass_name)
    if pass_name == "fwd+bwd":
        fns = {name: harness.forward_and_backward(fn) for name, fn in fns.items()}
        ref = harness.forward_and_backward(ref)
    flops = {"fwd": 4.0, "bwd": 8.0, "fwd+bwd": 12.0}[pass_name] * m * k * n
    return harness.Case(
        op=GLU, variant=variant + ("/pair" if paired else ""), shape=(m, k, n), dtype=dtype,
        pass_name=pass_name, flops=flops,
        make_inputs=functools.partial(_glu_inputs, shape=shape, dtype=dtype, pass_name=pass_name,
                                      paired=paired),
        implementations=fns, reference=ref, ceiling="matmul")


def _paired(fn, pass_name: str):
    """``fn`` of stacked-form arguments (the weights and, for "bwd", the
    pre-activations as one argument each) called with the pair form's flat
    arguments: ``(x, gate, up[, cotangent])``, or ``(x, gate, up, z_gate, z_up,
    cotangent)`` for "bwd"."""
    if pass_name == "bwd":
        return lambda x, gate, up, z_gate, z_up, g: fn(x, (gate, up), (z_gate, z_up), g)
    return lambda x, gate, up: fn(x, (gate, up))


def _glu_inputs(key, *, shape, dtype, pass_name, paired=False):
    """``(x, weights[, cotangent])``, or for "bwd" ``(x, weights, preactivations,
    cotangent)`` with the pre-activations the forward keeps; ``paired``: the weights
    (and pre-activations) as two ``[K, N]`` (``[M, N]``) arrays each, flat."""
    m, k, n = shape
    kx, kw, kc = jax.random.split(key, 3)
    x = harness.random_normal(kx, (m, k), dtype)
    w = harness.random_normal(kw, (k, 2, n), dtype, scale=k ** -0.5)
    weights = (w[:, 0], w[:, 1]) if paired else (w,)
    if pass_name == "fwd":
        return (x, *weights)
    g = harness.random_normal(kc, (m, n), dtype)
    if pass_name == "fwd+bwd":
        return (x, *weights, g)
    gate, up = (z.astype(dtype) for z in glu_preactivations(x, w))
    return (x, *weights, *((gate, up) if paired else (jnp.stack((gate, up), axis=-2),)), g)


def _xla_glu(x, w, *, activation):
    """What a user writes: two matmuls and the gate, in the inputs' dtype."""
    act = resolve_activation(activation, "bench")
    gate, up = w if isinstance(w, tuple) else (w[:, 0], w[:, 1])
    return act(jnp.dot(x, gate)) * jnp.dot(x, up)


def _xla_glu_bwd(x, w, z, g, *, activation):
    """XLA autodiff's backward of :func:`_xla_glu` from its residuals (the two products),
    its weight gradient in the form of ``w``."""
    act = resolve_activation(activation, "bench")
    paired = isinstance(w, tuple)
    gate_w, up_w = w if paired else (w[:, 0], w[:, 1])
    gate, up = z if paired else (z[:, 0], z[:, 1])
    _, pullback = jax.vjp(lambda a, b: act(a) * b, gate, up)
    dgate, dup = pullback(g)
    dx = jnp.dot(dgate, gate_w.T) + jnp.dot(dup, up_w.T)
    dw = (jnp.dot(x.T, dgate), jnp.dot(x.T, dup))
    return dx, (dw if paired else jnp.stack(dw, axis=1))


def _our_glu(x, w, *, activation, implementation):
    return ops.gated_linear_unit(x, w, activation=activation, implementation=implementation)


def _glu_reference(x, w, *, activation):
    """The exact answer: inputs upcast, full-precision products."""
    act = resolve_activation(activation, "bench")
    xw = harness.upcast(x)
    gate_w, up_w = (harness.upcast(p) for p in (w if isinstance(w, tuple) else (w[:, 0], w[:, 1])))
    gate = jnp.dot(xw, gate_w, precision=lax.Precision.HIGHEST)
    up = jnp.dot(xw, up_w, precision=lax.Precision.HIGHEST)
    return act(gate) * up


def _glu_bwd_reference(x, w, z, g, *, activation):
    return glu_backward_reference(harness.upcast(x), jax.tree.map(harness.upcast, w),
                                  jax.tree.map(harness.upcast, z), harness.upcast(g),
                                  resolve_activation(activation, "bench"))
