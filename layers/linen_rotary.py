"""``layers.linen.RotaryEmbedding``: the Linen twin of :class:`layers.RotaryEmbedding`.

The same computation (the shared :func:`layers.rotary.rotate`) as a
``flax.linen`` module without variables.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn

from layers.dense import _check_implementation
from layers.rotary import _check_rotary_dim, _check_theta, _frozen_scaling, rotate

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, the Linen twin of :class:`layers.RotaryEmbedding`
    (same arguments and meaning; no variables). ``__call__(x, positions)``.

    Attributes:
      rotary_dim, theta, interleaved, implementation: as the NNX module.
      scaling: None or the rope type and parameters; a mapping is kept as sorted
        ``(name, value)`` items (hashable, as a Linen field must be).
    """

    rotary_dim: int
    theta: float = 10000.0
    scaling: Mapping[str, Any] | tuple | None = None
    interleaved: bool = False
    implementation: Any = None

    def __post_init__(self):
        owner = "layers.linen.RotaryEmbedding"
        _check_rotary_dim(self.rotary_dim, owner)
        object.__setattr__(self, "theta", _check_theta(self.theta, owner))
        if not isinstance(self.scaling, tuple):
            object.__setattr__(self, "scaling", _frozen_scaling(self.scaling, owner))
        object.__setattr__(self, "implementation",
                           _check_implementation(self.implementation, owner))
        super().__post_init__()

    def __call__(self, x, positions):
        """``x`` ``[B, T, N, H]`` / ``[T, N, H]`` rotated by ``positions`` ``[B, T]`` / ``[T]``."""
        return rotate(x, positions, rotary_dim=self.rotary_dim, theta=self.theta,
                      scaling=self.scaling, interleaved=bool(self.interleaved),
                      implementation=self.implementation)
