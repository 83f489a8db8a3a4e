"""Linen drop-ins: ``layers.linen.Dense`` (here), ``LayerNorm`` / ``RMSNorm`` and attention.

``layers.linen.Dense`` is a drop-in for ``flax.linen.Dense`` that runs
``ops.fused_matmul``. ``LayerNorm`` / ``RMSNorm`` come from
:mod:`layers.linen_norms`; ``MultiHeadDotProductAttention``,
``MultiHeadAttention`` and ``SelfAttention`` (flash attention through
:func:`layers.dot_product_attention`) from :mod:`layers.linen_attention`;
``GatedMLP`` and ``RotaryEmbedding`` from :mod:`layers.linen_mlp` and
:mod:`layers.linen_rotary`.

``Dense`` is a subclass of :class:`flax.linen.Dense` with two more dataclass fields,
``activation`` and ``implementation`` (both default None). Parameters are
declared under the same names (``kernel`` ``[in, features]``, ``bias``
``[features]``) with the module's own ``kernel_init`` / ``bias_init`` and
``param_dtype``, so ``init`` with the same key gives the same variables as
``nn.Dense`` and ``nn.Dense``'s variables apply to this layer unchanged.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from layers.dense import (_apply_activation, _check_activation, _check_implementation,
                          _one_fused_dtype, _precision_is_fusable)
from ops.activations import resolve_activation
from ops.matmul import fused_matmul



class Dense(nn.Dense):
    """``activation(inputs @ kernel + bias)`` over the last axis, by ``ops.fused_matmul``.

    Attributes:
      features, use_bias, dtype, param_dtype, precision, kernel_init,
      bias_init, promote_dtype, dot_general, dot_general_cls:
        exactly as :class:`flax.linen.Dense` (same defaults).
      activation: None, a name from ``ops.ACTIVATIONS`` ("relu", "gelu" =
        ``jax.nn.gelu`` tanh form, "gelu_exact", "silu", ...) or an
        elementwise JAX callable, applied to the float32 pre-activation in the
        kernel's epilogue.
      implementation: None (best for the platform, resolved at call time) or
        one of ``ops.IMPLEMENTATIONS``; passed to ``ops.fused_matmul``.

    Shapes and dtypes: ``inputs`` ``[..., K]`` -> ``[..., features]``.
    ``inputs``, ``kernel`` and ``bias`` are promoted exactly as nn.Dense does
    (``self.promote_dtype(..., dtype=self.dtype)``), and the output has the
    promoted dtype, nn.Dense's; accumulation is in float32, float32 operands
    at full precision.

    Drop-in guarantee: variables (``{'params': {'kernel', 'bias'}}``) from
    ``nn.Dense(features)`` load into this layer as they are, ``init`` with the
    same key produces the same values, and with ``activation=None`` the
    output equals nn.Dense's (up to float rounding).

    Fallback: a custom ``dot_general`` / ``dot_general_cls``, a ``precision``
    other than None/HIGHEST, a promoted dtype other than float32, bfloat16
    and float16, or promoted operands of mixed dtypes (a custom
    ``promote_dtype`` that leaves them as they are) cannot be honoured by the
    fused kernel; then nn.Dense's computation runs, followed by
    ``activation`` (in at least float32).

    Raises:
      ValueError: at construction, an unknown ``activation`` name or an
        ``implementation`` not in ``ops.IMPLEMENTATIONS`` (naming the
        argument); at call time, ``ops.fused_matmul``'s shape errors.
      TypeError: at construction, an ``activation`` that is neither None, a
        string nor a callable.
      NotImplementedError: at call time, ``implementation="mosaic_gpu"`` (no
        kernel for it yet).
    """

    activation: Any = None
    implementation: str | None = None

    def __post_init__(self):
        _check_activation(self.activation, "layers.linen.Dense")
        object.__setattr__(self, "implementation",  # a sequence as a tuple: hashable
                           _check_implementation(self.implementation, "layers.linen.Dense"))
        super().__post_init__()

    def _fusable(self) -> bool:
        return (self.dot_general is None and self.dot_general_cls is None
                and _precision_is_fusable(self.precision))

    @nn.compact
    def __call__(self, inputs):
        """``activation(inputs @ kernel + bias)``: ``[..., K]`` -> ``[..., features]``."""
        act = resolve_activation(self.activation, "layers.linen.Dense")
        if not self._fusable():
            return _apply_activation(act, super().__call__(inputs))
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        x, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if not _one_fused_dtype(x, kernel, bias):
            # nn.Dense's computation (the params are declared already).
            y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                                precision=self.precision)
            if bias is not None:
                y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
            return _apply_activation(act, y)
        return fused_matmul(x, kernel, bias, activation=act, implementation=self.implementation)


from layers.linen_norms import LayerNorm, RMSNorm  # noqa: E402 - the Linen twins of layers.norms
from layers.linen_attention import (  # noqa: E402 - the Linen twins of layers.attention
    MultiHeadAttention, MultiHeadDotProductAttention, SelfAttention)
from layers.linen_mlp import GatedMLP  # noqa: E402 - the Linen twin of layers.GatedMLP
from layers.linen_moe import MoE  # noqa: E402 - the Linen twin of layers.MoE
from layers.linen_rotary import RotaryEmbedding  # noqa: E402 - of layers.RotaryEmbedding

__all__ = ["Dense", "GatedMLP", "LayerNorm", "MoE", "MultiHeadAttention",
           "MultiHeadDotProductAttention", "RMSNorm", "RotaryEmbedding", "SelfAttention"]
