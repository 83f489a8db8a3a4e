"""Gated linear unit: ``activation(x @ weights[:, 0]) * (x @ weights[:, 1])``.

Dauphin et al. 2017, "Language Modeling with Gated Convolutional Networks"
(section 3) and Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU with
silu, GeGLU with gelu, ReGLU with relu, the bilinear layer with no
activation). Tokamax's semantics and layout: the gate and up projections
stacked as ``weights [K, 2, N]`` (gate at index 0), the activation on the
gate, the product in float32, the result in x's dtype.
"""
from __future__ import annotations

import jax
import numpy as np

from ops._checks import check_array, check_float_dtype, check_same_dtype
from ops._implementation import run_implementation
from ops.activations import resolve_activation
from ops.decoder.reference import gated_linear_unit_reference

_OP = "gated_linear_unit"


def gated_linear_unit(x, weights, *, activation=None, implementation=None,
                      block_sizes=None) -> jax.Array:
    """``activation(x @ weights[:, 0]) * (x @ weights[:, 1])`` with float32 accumulation.

    Args:
      x: ``[..., K]`` float32 / bfloat16 / float16; any number of leading dims.
      weights: ``[K, 2, N]``, x's dtype: the gate (``[:, 0]``) and up (``[:, 1]``)
        projections stacked (a transformers ``gate_proj.weight.T`` and
        ``up_proj.weight.T`` stacked on axis 1).
      activation: None (the bilinear GLU), a name ``ops.fused_matmul`` accepts
        (``"silu"`` for SwiGLU, ``"gelu"`` (tanh) or ``"gelu_exact"`` for GeGLU,
        ``"relu"``, ``"sigmoid"``, ...; :data:`ops.ACTIVATIONS`) or an
        elementwise JAX callable, applied to the float32 gate.
      implementation: None (cpu -> "xla", gpu -> "triton", tpu -> "mosaic_tpu"),
        a name or a sequence of names tried in order (:mod:`ops._implementation`).
      block_sizes: optional ``(block_m, block_n, block_k)``; None takes the tuning
        cache's entry, else the heuristic.

    Returns:
      ``[..., N]`` in x's dtype.

    Raises:
      TypeError: non-arrays, an integer / unsupported dtype, weights' dtype not
        x's, an activation that is neither None, a name nor a callable.
      ValueError: weights not ``[K, 2, N]`` with x's K, an unknown activation name
        or a non-elementwise callable, bad block_sizes or implementation.
    """
    act = _check(x, weights, activation, block_sizes)
    return run_implementation(implementation, _OP, lambda impl: _glu_on(impl, x, weights, act),
                              kernel_backends=())


def _check(x, weights, activation, block_sizes):
    check_array(x, "x", _OP)
    check_array(weights, "weights", _OP)
    check_float_dtype(x, "x", _OP)
    check_same_dtype(weights, x, "weights", "x", _OP)
    if x.ndim < 1:
        raise ValueError(f"{_OP}: x must have rank >= 1 [..., K], got a scalar.")
    if weights.ndim != 3 or weights.shape[1] != 2:
        raise ValueError(f"{_OP}: weights must have shape [K, 2, N] (gate and up stacked on "
                         f"axis 1), got {tuple(weights.shape)}.")
    if weights.shape[0] != x.shape[-1]:
        raise ValueError(f"{_OP}: x's last dim ({x.shape[-1]}) must equal weights' first dim "
                         f"({weights.shape[0]}); got x {tuple(x.shape)} and weights "
                         f"{tuple(weights.shape)}.")
    act = resolve_activation(activation, _OP)
    if block_sizes is not None:
        sizes = tuple(block_sizes)
        if len(sizes) != 3 or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                                      and b > 0 for b in sizes):
            raise ValueError(f"{_OP}: block_sizes must be three positive ints (block_m, block_n, "
                             f"block_k), got {block_sizes!r}.")
    return act


def _glu_on(impl, x, weights, act):
    return gated_linear_unit_reference(x, weights, act)
