"""The routing math of a mixture-of-experts block, shared by ``layers.MoE`` (one device)
and :mod:`ops.moe.expert_parallel` (experts sharded over a mesh axis).

Router top-k (Mixtral's softmax over the top-k logits, or softmax then top-k),
the load-balancing statistics and loss (Switch Transformer, Fedus et al. 2021,
section 2.2, as transformers' ``load_balancing_loss_func``), the sort of the
assignments by expert (GShard's capacity as an option, Lepikhin et al. 2020,
section 2.2), the experts as SwiGLU through two ``ops.ragged_dot`` calls, and
the weighted combine. :mod:`layers.moe` documents the block.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ops.activations import resolve_activation
from ops.matmul import fused_matmul
from ops.moe.ragged_dot import ragged_dot

__all__ = ["RouterStats", "capacity_of", "combine", "expert_swiglu", "load_balancing_loss",
           "moe_ffn", "route", "sort_by_expert"]


class RouterStats(NamedTuple):
    """One layer's router statistics over its tokens (float32, summed, not averaged, so
    that layers and shards add up).

    Attributes:
      counts: ``[E]`` top-k assignments per expert (summing to ``k * tokens``).
      prob_sum: ``[E]`` the softmax probabilities over all experts, summed over tokens.
      tokens: ``[]`` the number of tokens.
    """

    counts: jax.Array
    prob_sum: jax.Array
    tokens: jax.Array


def load_balancing_loss(stats: RouterStats | Sequence[RouterStats]) -> jax.Array:
    """The Switch Transformer load-balancing loss of one layer's or several layers' statistics.

    ``E * sum_e (counts_e / tokens) * (prob_sum_e / tokens)`` with every term summed over
    the layers first: transformers' ``load_balancing_loss_func`` over the concatenated
    router logits of all layers (Fedus et al. 2021, section 2.2, with top-k counting).
    A float32 scalar, without the coefficient (transformers' ``router_aux_loss_coef``).
    """
    items = [stats] if isinstance(stats, RouterStats) else list(stats)
    if not items:
        raise ValueError("load_balancing_loss: no router statistics given.")
    counts = sum(s.counts for s in items)
    probs = sum(s.prob_sum for s in items)
    tokens = sum(s.tokens for s in items)
    return counts.shape[-1] * jnp.sum((counts / tokens) * (probs / tokens))


def route(logits, top_k: int, *, softmax_before_topk: bool = False):
    """``(weights [T, k] float32, experts [T, k] int32, RouterStats)`` from router logits ``[T, E]``.

    Mixtral (default): softmax over the top-k logits; ``softmax_before_topk``: the top-k
    of the softmax over all experts, not renormalised.
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if softmax_before_topk:
        weights, experts = lax.top_k(probs, top_k)
    else:
        top, experts = lax.top_k(logits, top_k)
        weights = jax.nn.softmax(top, axis=-1)
    num_experts = logits.shape[-1]
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    stats = RouterStats(counts, jnp.sum(probs, axis=0),
                        jnp.asarray(logits.shape[0], jnp.float32))
    return weights, experts.astype(jnp.int32), stats


def sort_by_expert(experts, num_experts: int, capacity: int | None = None):
    """``(order [T k], group_sizes [E] int32)``: the flat assignments (``t * k + s``) sorted by
    expert (stable), and the rows each expert takes. With ``capacity``, each expert keeps its
    first ``capacity`` rows and the dropped ones are sorted after every kept row."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    if capacity is None:
        return order, sizes
    sorted_e = flat[order]
    starts = jnp.cumsum(sizes) - sizes
    keep = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[sorted_e] < capacity
    order = order[jnp.argsort(jnp.where(keep, sorted_e, num_experts), stable=True)]
    return order, jnp.minimum(sizes, capacity)


def expert_swiglu(rows, gate_up, down, group_sizes, *, activation, implementation,
                  group_offset=None):
    """``down[g] (act(rows gate[g]) * (rows up[g]))`` per group of rows: two ``ops.ragged_dot``.

    ``rows [M, d]`` sorted by group, ``gate_up [G, d, 2h]`` (gate first), ``down [G, h, d_out]``;
    rows past the owned groups come out zero.
    """
    act = resolve_activation(activation, "layers.MoE")
    h = ragged_dot(rows, gate_up, group_sizes, group_offset=group_offset,
                       implementation=implementation)
    hidden = gate_up.shape[-1] // 2
    gated = act(h[:, :hidden].astype(jnp.float32)) * h[:, hidden:].astype(jnp.float32)
    return ragged_dot(gated.astype(rows.dtype), down, group_sizes, group_offset=group_offset,
                          implementation=implementation)


def combine(expert_out, order, weights):
    """``[T, d]``: the rows of ``expert_out`` (in ``order``) back in assignment order, weighted
    by ``weights [T, k]`` and summed over the k slots (float32)."""
    tokens, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    back = expert_out[inverse].reshape(tokens, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", back, weights)


def capacity_of(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None):
    """GShard's expert capacity ``ceil(factor * T * k / E)`` (None: dropless)."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def moe_ffn(x, router, gate_up, down, *, top_k: int, activation="silu",
            softmax_before_topk: bool = False, capacity_factor: float | None = None,
            implementation=None):
    """The MoE block on tokens ``x [T, d]`` on one device: ``(y [T, d_out], RouterStats)``.

    ``router [d, E]``, ``gate_up [E, d, 2h]`` (gate first), ``down [E, h, d_out]``, all in
    ``x``'s dtype; ``y`` in ``x``'s dtype (accumulated in float32).
    """
    logits = fused_matmul(x, router, implementation=implementation)
    weights, experts, stats = route(logits, top_k, softmax_before_topk=softmax_before_topk)
    num_experts = gate_up.shape[0]
    order, sizes = sort_by_expert(
        experts, num_experts, capacity_of(x.shape[0], top_k, num_experts, capacity_factor))
    rows = x[order // top_k]
    out = expert_swiglu(rows, gate_up, down, sizes, activation=activation,
                        implementation=implementation)
    return combine(out, order, weights).astype(x.dtype), stats
