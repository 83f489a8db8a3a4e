"""``layers.MoE``: a mixture-of-experts feed-forward block (Mixtral's sparse MoE).

Per token ``x`` (Shazeer et al. 2017, "Outrageously Large Neural Networks";
Fedus et al. 2021, "Switch Transformers", section 2; Jiang et al. 2024,
"Mixtral of Experts", section 2.1):

1. Router: ``logits = x @ router`` (``[d, E]``, computed in the compute
   dtype, then float32). Mixtral's convention (the default): the top-k
   logits, and their softmax as the weights (the same as transformers'
   softmax over all experts, top-k, renormalised). With
   ``softmax_before_topk=True``: the softmax over all experts, then its top-k
   values as the weights, not renormalised (Switch, GShard, DeepSeek-V2,
   Qwen-MoE's ``norm_topk_prob=False``).
2. Permutation: the ``T * k`` (token, slot) assignments are sorted by expert
   (a stable sort: within an expert, by token then slot), so each expert's
   rows are one contiguous group; the inverse permutation brings the results
   back to assignment order.
3. Experts, SwiGLU: ``down[e] (act(x gate[e]) * (x up[e]))``, gate and up as
   one grouped matmul ``ops.ragged_dot(rows, gate_up_proj, group_sizes)``
   (``[E, d, 2 hidden]``: both projections in one pass over the rows) and
   the down projection as a second. ``ops.ragged_dot`` has no epilogue, so
   the gate runs between the two (in float32).
4. Combine: ``y[t] = sum_s weight[t, s] * expert_out[t, s]``.

Dropless by default: every assignment is computed, the grouped matmul
taking whatever rows each expert gets. With ``capacity_factor=c`` each
expert takes at most ``ceil(c * T * k / E)`` rows (GShard's expert capacity,
Lepikhin et al. 2020, section 2.2): the rest (later tokens first) are
dropped, their outputs are zero (the residual carries them) and they cost
nothing (sorted past the kept rows, where ``ops.ragged_dot`` writes zeros).

Load balancing: every call sows the router's statistics (:class:`RouterStats`:
per expert the top-k assignments and the summed softmax probabilities, and
the number of tokens) as ``nnx.Intermediate`` ``router_stats`` (Linen:
``'intermediates'``); :func:`load_balancing_loss` turns those of one or
more layers into the Switch Transformer auxiliary loss (section 2.2, eq. 4-6)
exactly as transformers' ``load_balancing_loss_func`` does:
``E * sum_e f_e P_e`` with ``f_e`` the fraction of the top-k assignments
routed to ``e`` (summing to k over the experts) and ``P_e`` the mean router
probability, both pooled over every layer's tokens. Uniform routing gives
``k``. Its gradient flows through ``P`` only (``f`` counts a top-k).

Expert parallelism: ``expert_axis="name"`` shards the experts' axis of
``gate_up_proj`` / ``down_proj`` over that mesh axis (run under
``jax.set_mesh(mesh)``): tokens, sharded over ``token_axes`` (default: the
expert axis), are routed where they are, sent to the devices owning their
experts and back (:mod:`ops.moe.expert_parallel`), and each device runs
``ops.ragged_dot`` with ``group_offset`` over its own experts only. The
experts' weights never move.

Not built: router jitter noise and router z-loss (training-time options of
some recipes), padding masks in the statistics (transformers'
``attention_mask`` argument), shared experts (DeepSeek, Qwen-MoE: add a
``layers.GatedMLP`` beside this block).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_kernel_init

from layers.dense import Dense, _check_implementation
from layers.mlp import _check_features, check_activation_name
from ops.moe import expert_parallel
from ops.moe.routing import RouterStats, load_balancing_loss, moe_ffn

__all__ = ["MoE", "RouterStats", "collect_router_stats", "load_balancing_loss"]


def check_moe_args(owner: str, num_experts, top_k, capacity_factor, expert_axis, token_axes):
    """Constructor checks shared by the NNX and Linen modules."""
    _check_features(num_experts, "num_experts", owner)
    _check_features(top_k, "num_experts_per_token", owner)
    if top_k > num_experts:
        raise ValueError(f"{owner}: num_experts_per_token={top_k} exceeds num_experts="
                         f"{num_experts}.")
    if capacity_factor is not None and (
            isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
            or not capacity_factor > 0):
        raise ValueError(f"{owner}: invalid argument capacity_factor={capacity_factor!r}; "
                         "expected None (dropless) or a positive number.")
    if expert_axis is not None and not isinstance(expert_axis, str):
        raise TypeError(f"{owner}: expert_axis must be None or a mesh axis name (str), got "
                        f"{expert_axis!r}.")
    if token_axes is not None:
        axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
        if expert_axis is None or not all(isinstance(a, str) for a in axes):
            raise ValueError(f"{owner}: token_axes={token_axes!r} needs expert_axis and must "
                             "be mesh axis names.")


def apply_moe(x, router, gate_up, down, *, owner, top_k, activation, softmax_before_topk,
              capacity_factor, expert_axis, token_axes, implementation):
    """``[..., d]`` -> ``([..., d_out], RouterStats)`` on one device or expert-parallel."""
    d = router.shape[0]
    if x.shape[-1] != d:
        raise ValueError(f"{owner}: x has {x.shape[-1]} features in its last axis, the layer "
                         f"expects in_features={d}.")
    lead = x.shape[:-1]
    flat = x.reshape(-1, d)
    kwargs = dict(top_k=top_k, activation=activation, softmax_before_topk=softmax_before_topk,
                  implementation=implementation)
    if expert_axis is None:
        y, stats = moe_ffn(flat, router, gate_up, down, capacity_factor=capacity_factor,
                           **kwargs)
    else:
        if capacity_factor is not None:
            raise NotImplementedError(f"{owner}: capacity_factor with expert_axis is not built "
                                      "(expert parallelism is dropless).")
        y, stats = expert_parallel.sharded_moe(
            flat, router, gate_up, down, expert_axis=expert_axis, token_axes=token_axes,
            **kwargs)
    return y.reshape(*lead, y.shape[-1]), stats


def _per_expert(init):
    """An initializer of ``[E, in, out]`` drawing each expert's ``[in, out]`` with ``init``
    (its fans those of one expert's matrix)."""
    def f(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)
    return f


class MoE(nnx.Module):
    """Mixture-of-experts SwiGLU block with a top-k router (see the module docstring).

    Args:
      in_features: ``d``, the features of ``x`` (and of the output).
      hidden_features: each expert's gated width (transformers' ``intermediate_size``).
      num_experts: ``E``.
      num_experts_per_token: ``k``, experts per token (Mixtral: 2 of 8).
      activation: the gate's activation, a name from ``ops.ACTIVATIONS`` (``"silu"``:
        SwiGLU) or an elementwise callable.
      softmax_before_topk: False: Mixtral's softmax over the top-k logits; True: the
        top-k of the softmax over all experts, not renormalised.
      capacity_factor: None (dropless, the default) or ``c > 0``: each expert takes at
        most ``ceil(c * T * k / E)`` rows of a call's ``T`` tokens, the later ones dropped.
      expert_axis: None, or a mesh axis name over which the experts are sharded (expert
        parallelism; call under ``jax.set_mesh``; ``E`` divisible by its size).
      token_axes: the mesh axes the tokens are sharded over (default: ``expert_axis``);
        must include ``expert_axis``; the number of tokens must divide evenly.
      dtype: the compute dtype (None: the promoted type of ``x`` and the parameters).
      param_dtype: the parameters' dtype.
      kernel_init: initializer of the router and of each expert's matrices (``nnx.Linear``'s
        default, LeCun normal, fans of one expert's matrix).
      implementation: None, a name of ``ops.IMPLEMENTATIONS`` or a sequence, for the router's
        ``ops.fused_matmul`` and the experts' ``ops.ragged_dot``.
      rngs: the parameters' rngs.

    Parameters: ``router.kernel [d, E]``; ``gate_up_proj [E, d, 2 hidden]`` (gate in the first
    half: transformers' ``experts.gate_up_proj [E, 2 hidden, d]`` transposed in its last two
    axes); ``down_proj [E, hidden, d]`` (transformers' ``[E, d, hidden]`` transposed).

    Call: ``x [..., d]`` -> ``[..., d]`` in the compute dtype; sows ``router_stats``
    (:class:`RouterStats`) as ``nnx.Intermediate`` (``nnx.pop(model, nnx.Intermediate)``).

    Raises:
      ValueError / TypeError: at construction, non-positive sizes, ``k > E``, a bad
        ``capacity_factor``, activation or implementation; at call time, ``x``'s last axis
        not ``d``, ``E`` not divisible by the expert axis, tokens not divisible by the
        token axes.
    """

    def __init__(self, in_features: int, hidden_features: int, num_experts: int,
                 num_experts_per_token: int, *, activation: Any = "silu",
                 softmax_before_topk: bool = False, capacity_factor: float | None = None,
                 expert_axis: str | None = None, token_axes=None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init, implementation=None,
                 rngs: nnx.Rngs):
        owner = "layers.MoE"
        _check_features(in_features, "in_features", owner)
        _check_features(hidden_features, "hidden_features", owner)
        check_moe_args(owner, num_experts, num_experts_per_token, capacity_factor, expert_axis,
                       token_axes)
        self.activation = check_activation_name(activation, owner)
        self.implementation = _check_implementation(implementation, owner)
        self.in_features, self.hidden_features = in_features, hidden_features
        self.num_experts, self.num_experts_per_token = num_experts, num_experts_per_token
        self.softmax_before_topk = bool(softmax_before_topk)
        self.capacity_factor = capacity_factor
        self.expert_axis = expert_axis
        self.token_axes = (token_axes,) if isinstance(token_axes, str) else (
            None if token_axes is None else tuple(token_axes))
        self.dtype = dtype
        self.router = Dense(in_features, num_experts, use_bias=False, dtype=dtype,
                            param_dtype=param_dtype, kernel_init=kernel_init,
                            implementation=self.implementation, rngs=rngs)
        init = _per_expert(kernel_init)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, in_features,
                                                           2 * hidden_features), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, hidden_features,
                                                        in_features), param_dtype))

    def __call__(self, x):
        """``[..., d]`` -> ``[..., d]``; sows ``router_stats``."""
        x, router, gate_up, down = nnx_dtypes.promote_dtype(
            (x, self.router.kernel[...], self.gate_up_proj[...], self.down_proj[...]),
            dtype=self.dtype)
        y, stats = apply_moe(x, router, gate_up, down, owner="layers.MoE",
                             top_k=self.num_experts_per_token, activation=self.activation,
                             softmax_before_topk=self.softmax_before_topk,
                             capacity_factor=self.capacity_factor, expert_axis=self.expert_axis,
                             token_axes=self.token_axes, implementation=self.implementation)
        self.sow(nnx.Intermediate, "router_stats", stats)
        return y


def collect_router_stats(state) -> list[RouterStats]:
    """Every :class:`RouterStats` in a popped ``nnx.Intermediate`` state (or any pytree), in
    tree order."""
    leaves = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, RouterStats))
    return [v for v in leaves if isinstance(v, RouterStats)]

