"""XLA references of the decoder ops (also their ``"xla"`` implementations).

Each is the plain composition a user writes today, computed in float32 and
rounded once to the input's dtype: rotary embedding from ``cos`` / ``sin``
tables, the gated linear unit as one matmul of the stacked weights (or one per
projection of a pair), the activation and a product.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def rotary_angles(positions, inv_freq):
    """``positions[..., None] * inv_freq`` in float32: ``[..., R/2]`` angles in radians,
    the product transformers' rotary modules form (one float32 rounding)."""
    return positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)


def rotary_pairs(x, rotary_dim: int, interleaved: bool):
    """``(x1, x2, rest)``: the two members of each rotated pair and the pass-through features.

    rotate_half pairing (Llama, GPT-NeoX, transformers' ``rotate_half``): feature
    ``i`` with ``i + R/2``; interleaved (GPT-J): ``2i`` with ``2i + 1``.
    """
    half = rotary_dim // 2
    if interleaved:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    else:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return x1, x2, x[..., rotary_dim:]


def merge_pairs(y1, y2, rest, interleaved: bool):
    """Inverse of :func:`rotary_pairs`."""
    if interleaved:
        rotated = jnp.stack([y1, y2], axis=-1).reshape(*y1.shape[:-1], 2 * y1.shape[-1])
    else:
        rotated = jnp.concatenate([y1, y2], axis=-1)
    return jnp.concatenate([rotated, rest.astype(rotated.dtype)], axis=-1)


def rotary_embedding_reference(x, positions, inv_freq, *, interleaved: bool = False,
                               attention_scaling: float = 1.0):
    """Rotary embedding with XLA: ``x [..., T, N, H]``, ``positions`` broadcastable to
    ``[..., T]``, ``inv_freq [R/2]``.

    Builds the ``cos`` / ``sin`` tables ``[..., T, R/2]`` in float32 (times
    ``attention_scaling``), rotates each pair ``(x1, x2)`` to ``(x1 cos - x2 sin,
    x2 cos + x1 sin)`` in float32, passes features ``R..H`` through, and rounds
    once to x's dtype (float64 inputs stay float64 when x64 is enabled).
    """
    compute = jnp.promote_types(x.dtype, jnp.float32)
    angles = rotary_angles(positions, inv_freq).astype(compute)
    cos = (jnp.cos(angles) * attention_scaling)[..., None, :]
    sin = (jnp.sin(angles) * attention_scaling)[..., None, :]
    x1, x2, rest = rotary_pairs(x.astype(compute), 2 * inv_freq.shape[-1], interleaved)
    y = merge_pairs(x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest, interleaved)
    return y.astype(x.dtype)


def gated_linear_unit_reference(x, weights, activation: Callable | None = None):
    """``activation(x @ gate) * (x @ up)`` with XLA.

    ``weights`` is ``[K, 2, N]`` (gate and up stacked on axis 1: one matmul of x
    with the ``[K, 2N]`` view) or a pair ``(gate, up)`` of ``[K, N]`` arrays
    (one matmul each); float32 accumulation, IEEE float32 products, the
    activation and the product in float32, the result rounded once to x's dtype.
    """
    gate, up = glu_preactivations(x, weights)
    if activation is not None:
        gate = activation(gate)
    return (gate * up).astype(x.dtype)


def glu_preactivations(x, weights):
    """``(x @ gate, x @ up)`` in float32 (the GLU's two accumulators) for stacked
    ``[K, 2, N]`` or paired ``(gate, up)`` weights."""
    def product(w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

    if isinstance(weights, (tuple, list)):
        return product(weights[0]), product(weights[1])
    k, _, n = weights.shape
    y = product(weights.reshape(k, 2 * n))
    return y[..., :n], y[..., n:]


__all__ = ["gated_linear_unit_reference", "glu_backward_reference", "glu_preactivations", "merge_pairs", "rotary_angles",
           "rotary_embedding_reference", "rotary_pairs"]


def glu_backward_reference(x, weights, preactivations, g, activation: Callable | None = None):
    """``(dx, dweights)`` of :func:`gated_linear_unit_reference` from the forward's
    pre-activations, as XLA's autodiff computes them: ``dgate = g * up *
    act'(gate)``, ``dup = g * act(gate)`` in float32, then ``dx = [dgate, dup] @
    weights^T`` and ``dweights = x^T [dgate, dup]``.

    Stacked weights ``[K, 2, N]`` take preactivations ``[..., 2, N]`` (gate, up)
    and give ``dweights [K, 2, N]``; paired weights ``(gate, up)`` take a pair of
    ``[..., N]`` and give the pair ``(dgate_w, dup_w)``."""
    paired = isinstance(weights, (tuple, list))
    compute = jnp.promote_types(x.dtype, jnp.float32)
    if paired:
        gate, up = (p.astype(compute) for p in preactivations)
    else:
        gate = preactivations[..., 0, :].astype(compute)
        up = preactivations[..., 1, :].astype(compute)
    g = g.astype(compute)
    if activation is None:
        act, dgate = gate, g * up
    else:
        act, pullback = jax.vjp(activation, gate)
        (dgate,) = pullback(g * up)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=compute, precision=lax.Precision.HIGHEST)

    if paired:
        dzs = [d.astype(x.dtype).reshape(-1, d.shape[-1]) for d in (dgate, g * act)]
        dx = dot(dzs[0], weights[0].T) + dot(dzs[1], weights[1].T)
        dws = tuple(dot(x2.T, dz).astype(w.dtype) for dz, w in zip(dzs, weights))
        return dx.astype(x.dtype).reshape(x.shape), dws
    n = weights.shape[2]
    dz = jnp.stack([dgate, g * act], axis=-2).astype(x.dtype).reshape(-1, 2 * n)
    w2 = weights.reshape(k, 2 * n)
    dx = dot(dz, w2.T)
    dw = dot(x2.T, dz)
    return dx.astype(x.dtype).reshape(x.shape), dw.astype(weights.dtype).reshape(weights.shape)
