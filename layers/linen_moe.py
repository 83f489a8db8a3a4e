"""``layers.linen.MoE``: the Linen twin of :class:`layers.MoE`.

The same computation (:func:`layers.moe.apply_moe`) as a ``flax.linen``
module. Variables mirror the NNX module's tree: ``{'params': {'router':
{'kernel' [d, E]}, 'gate_up_proj' [E, d, 2 hidden], 'down_proj' [E, hidden,
d]}}``; each call sows its :class:`layers.moe.RouterStats` as
``'intermediates'`` / ``'router_stats'`` (``apply(..., mutable=['intermediates'])``),
for :func:`layers.moe.load_balancing_loss`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from layers.dense import _check_implementation
from layers.linen_mlp import _Kernel
from layers.mlp import _check_features, check_activation_name
from layers.moe import _per_expert, apply_moe, check_moe_args

__all__ = ["MoE"]


class MoE(nn.Module):
    """Mixture-of-experts SwiGLU block, the Linen twin of :class:`layers.MoE` (same
    arguments, defaults and meaning; ``in_features`` is read from ``x``).

    Attributes:
      hidden_features, num_experts, num_experts_per_token, activation,
      softmax_before_topk, capacity_factor, expert_axis, token_axes, dtype,
      param_dtype, kernel_init, implementation: as :class:`layers.MoE`.
    """

    hidden_features: int
    num_experts: int
    num_experts_per_token: int
    activation: Any = "silu"
    softmax_before_topk: bool = False
    capacity_factor: float | None = None
    expert_axis: str | None = None
    token_axes: Any = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.linear.default_kernel_init
    implementation: Any = None

    def __post_init__(self):
        owner = "layers.linen.MoE"
        _check_features(self.hidden_features, "hidden_features", owner)
        check_moe_args(owner, self.num_experts, self.num_experts_per_token,
                       self.capacity_factor, self.expert_axis, self.token_axes)
        check_activation_name(self.activation, owner)
        object.__setattr__(self, "implementation",
                           _check_implementation(self.implementation, owner))
        if isinstance(self.token_axes, list):
            object.__setattr__(self, "token_axes", tuple(self.token_axes))
        super().__post_init__()

    @nn.compact
    def __call__(self, x):
        """``[..., d]`` -> ``[..., d]``; sows ``router_stats``."""
        d, e, h = x.shape[-1], self.num_experts, self.hidden_features
        router = _Kernel(e, self.kernel_init, self.param_dtype, name="router")(d)
        init = _per_expert(self.kernel_init)
        gate_up = self.param("gate_up_proj", init, (e, d, 2 * h), self.param_dtype)
        down = self.param("down_proj", init, (e, h, d), self.param_dtype)
        x, router, gate_up, down = nn.dtypes.promote_dtype(x, router, gate_up, down,
                                                           dtype=self.dtype)
        token_axes = (self.token_axes,) if isinstance(self.token_axes, str) else self.token_axes
        y, stats = apply_moe(x, router, gate_up, down, owner="layers.linen.MoE",
                             top_k=self.num_experts_per_token, activation=self.activation,
                             softmax_before_topk=self.softmax_before_topk,
                             capacity_factor=self.capacity_factor, expert_axis=self.expert_axis,
                             token_axes=token_axes, implementation=self.implementation)
        self.sow("intermediates", "router_stats", stats)
        return y
