"""``layers.linen.GatedMLP``: the Linen twin of :class:`layers.GatedMLP`.

The same computation (the shared :func:`layers.mlp.gated_mlp`: the gate and up
kernels reach ``ops.gated_linear_unit`` as a pair, read in place, no per-call
stack) as a ``flax.linen`` module. Its variables mirror the NNX module's tree:
``{'params': {'gate_proj': {'kernel'}, 'up_proj': {'kernel'}, 'down_proj':
{'kernel'}}}``, each kernel ``[in, out]`` as ``nn.Dense`` declares it, so a
transformers ``mlp.*_proj.weight`` maps with a transpose.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from layers.dense import _check_implementation
from layers.mlp import _check_features, check_activation_name, gated_mlp

__all__ = ["GatedMLP"]


class _Kernel(nn.Module):
    """Declares ``kernel [in, features]`` as ``nn.Dense`` would and returns it."""

    features: int
    kernel_init: Callable
    param_dtype: Any

    @nn.compact
    def __call__(self, in_features: int):
        return self.param("kernel", self.kernel_init, (in_features, self.features),
                          self.param_dtype)


class GatedMLP(nn.Module):
    """Gated MLP ``down_proj(activation(gate_proj(x)) * up_proj(x))``, the Linen twin of
    :class:`layers.GatedMLP` (same arguments, defaults and meaning; ``in_features`` is
    read from ``x``).

    Attributes:
      hidden_features: the gated width.
      out_features: None (``x``'s features) or the output features.
      activation: the gate's activation (``"silu"``: SwiGLU; ``"gelu"``: GeGLU, tanh form).
      dtype, param_dtype, kernel_init: as ``nn.Dense``.
      implementation: None, a name from ``ops.IMPLEMENTATIONS`` or a sequence of them.
    """

    hidden_features: int
    out_features: int | None = None
    activation: Any = "silu"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.linear.default_kernel_init
    implementation: Any = None

    def __post_init__(self):
        owner = "layers.linen.GatedMLP"
        _check_features(self.hidden_features, "hidden_features", owner)
        _check_features(self.out_features, "out_features", owner, optional=True)
        check_activation_name(self.activation, owner)
        object.__setattr__(self, "implementation",
                           _check_implementation(self.implementation, owner))
        super().__post_init__()

    @nn.compact
    def __call__(self, x):
        """``[..., in]`` -> ``[..., out_features or in]``."""
        d = x.shape[-1]
        kernel = lambda n, name: _Kernel(n, self.kernel_init, self.param_dtype, name=name)  # noqa: E731
        gate = kernel(self.hidden_features, "gate_proj")(d)
        up = kernel(self.hidden_features, "up_proj")(d)
        down = kernel(self.out_features or d, "down_proj")(self.hidden_features)
        x, gate, up, down = nn.dtypes.promote_dtype(x, gate, up, down, dtype=self.dtype)
        return gated_mlp(x, gate, up, down, activation=self.activation,
                         implementation=self.implementation)
