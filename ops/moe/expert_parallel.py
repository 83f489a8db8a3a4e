"""Expert parallelism for a mixture-of-experts block: experts sharded over a mesh axis.

The experts' axis of the expert weights is sharded over mesh axis ``A`` of
size ``D`` (``E_local = E / D`` experts per device); tokens are sharded over
``A`` (and any data-parallel axes, between whose shards nothing moves). In
``jax.shard_map`` each device (the GShard scheme, Lepikhin et al. 2020,
section 2.2-3; dropless as MegaBlocks, Gale et al. 2023, with ragged
exchanges instead of capacity buffers):

1. routes its own tokens and sorts its ``T_local * k`` assignments by expert
   (:func:`ops.moe.routing.route`, :func:`~ops.moe.routing.sort_by_expert`), giving
   ``counts [E]``;
2. all-gathers ``counts`` over ``A`` (``[D, E]`` int32, the only all-gather);
3. sends each expert's rows to the device owning it with one ragged
   all-to-all of ``E`` slices (slice ``e`` to device ``e // E_local``). A
   receiver's buffer is laid out as the *global* expert-sorted order of the
   ``D * T_local * k`` assignments of the axis (expert ``e``'s rows at
   ``sum(totals[:e])``, within it by source device): only its own experts'
   slab is written, and ``ops.ragged_dot(buffer, w_local, totals,
   group_offset=shard * E_local)`` computes exactly those rows, leaving the
   others zero;
4. sends the results back with the reverse ragged all-to-all (``D *
   E_local`` slices), unsorts and combines them with the routing weights.

The buffer holds ``D * T_local * k`` rows, the worst case of all tokens
choosing one device's experts: dropless needs it. The expert weights never
leave their device; gradients come back through the transposed exchanges
(JAX transposes a ragged all-to-all into the reverse one) and each device's
expert-weight gradient is its own experts' (no reduction over ``A``).

The exchange is ``jax.lax.ragged_all_to_all`` on GPUs and TPUs. XLA:CPU has
no ragged all-to-all, so on CPUs (the tests' fake devices) the same call
(same arguments and result) is emulated with a padded ``jax.lax.all_to_all``
(each destination's slices in a chunk of the operand's size):
:func:`ragged_exchange`, ``method="dense"``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ops.matmul import fused_matmul
from ops.moe import routing

__all__ = ["ragged_exchange", "sharded_moe"]

METHODS = ("auto", "ragged", "dense")


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                    axis_name, method: str = "auto"):
    """``jax.lax.ragged_all_to_all``'s meaning (same arguments and result), inside shard_map.

    ``method``: ``"ragged"`` calls it; ``"dense"`` emulates it with a padded all-to-all (each
    destination's slices gathered, in order, into a chunk of ``operand``'s rows), for
    backends without it (XLA:CPU); ``"auto"``: ``"dense"`` on CPUs, else ``"ragged"``.
    """
    if method not in METHODS:
        raise ValueError(f"ragged_exchange: method must be one of {METHODS}, got {method!r}.")
    if method == "auto":
        method = "dense" if jax.default_backend() == "cpu" else "ragged"
    if method == "ragged":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis_name)
    devices = lax.axis_size(axis_name)
    slices = input_offsets.shape[0]
    per = slices // devices
    n = operand.shape[0]
    # Send side: destination j's chunk is its slices' rows, concatenated in slice order.
    sizes = send_sizes.reshape(devices, per)
    starts = jnp.cumsum(sizes, axis=1) - sizes  # each slice's start inside its chunk
    row = jnp.arange(n, dtype=jnp.int32)
    slot = jnp.sum(row[None, None, :] >= starts[:, :, None], axis=1) - 1  # [D, n] slice of a row
    slot = jnp.clip(slot, 0, per - 1)
    within = row[None, :] - jnp.take_along_axis(starts, slot, axis=1)
    valid = within < jnp.take_along_axis(sizes, slot, axis=1)
    src = jnp.take_along_axis(input_offsets.reshape(devices, per), slot, axis=1) + within
    chunks = jnp.where(_expand(valid, operand.ndim), operand[jnp.clip(src, 0, n - 1)], 0)
    # Receive side: the chunk from source i lands slice by slice at output_offsets_ (the
    # receiver's view of the senders' output_offsets, as ragged_all_to_all defines it).
    recv = lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [D, n, ...] by source
    offsets = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True).reshape(devices, per)
    rsizes = recv_sizes.reshape(devices, per)
    rstarts = jnp.cumsum(rsizes, axis=1) - rsizes
    rslot = jnp.clip(jnp.sum(row[None, None, :] >= rstarts[:, :, None], axis=1) - 1, 0, per - 1)
    rwithin = row[None, :] - jnp.take_along_axis(rstarts, rslot, axis=1)
    rvalid = rwithin < jnp.take_along_axis(rsizes, rslot, axis=1)
    dest = jnp.where(rvalid, jnp.take_along_axis(offsets, rslot, axis=1) + rwithin,
                     output.shape[0])  # out of bounds: dropped
    return output.at[dest.reshape(-1)].set(recv.reshape(devices * n, *operand.shape[1:]),
                                           mode="drop")


def _expand(mask, ndim):
    return mask.reshape(*mask.shape, *(1,) * (ndim - 1))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where every slice goes, both ways (int32 vectors; see the module docstring)."""

    send_offsets: jax.Array  # [E] each expert's first row in the local sorted rows
    counts: jax.Array  # [E] local rows per expert
    remote_offsets: jax.Array  # [E] where they land in the owner's buffer
    back_offsets: jax.Array  # [D * E_local] the owned slices' rows in this buffer, by source
    back_sizes: jax.Array  # [D * E_local]
    back_targets: jax.Array  # [D * E_local] where they land on the source
    back_recv: jax.Array  # [E] = counts: what comes back, by (owner, local expert)


def _plan(counts, axis_name, num_local):
    """The exchange plan from this device's ``counts [E]`` (one all-gather of ``[D, E]``)."""
    all_counts = lax.all_gather(counts, axis_name)  # [D, E]
    me = lax.axis_index(axis_name)
    devices, experts = all_counts.shape
    totals = jnp.sum(all_counts, axis=0)
    expert_start = jnp.cumsum(totals) - totals  # global sorted layout
    before_me = jnp.sum(jnp.where(jnp.arange(devices)[:, None] < me, all_counts, 0), axis=0)
    send_offsets = jnp.cumsum(counts) - counts
    remote = expert_start + before_me
    # Back: owned experts o = me * E_local + l; slice (source i, l).
    owned = me * num_local + jnp.arange(num_local)
    owned_counts = all_counts[:, owned]  # [D, E_local]
    prior = jnp.cumsum(owned_counts, axis=0) - owned_counts  # rows of sources before i
    back_offsets = (expert_start[owned][None, :] + prior).reshape(-1)
    all_send_offsets = jnp.cumsum(all_counts, axis=1) - all_counts
    back_targets = all_send_offsets[:, owned].reshape(-1)
    plan = _Plan(send_offsets, counts, remote, back_offsets, owned_counts.reshape(-1),
                 back_targets, counts)
    return plan, totals


def sharded_moe(x, router, gate_up, down, *, expert_axis: str,
                token_axes: Sequence[str] | None = None, top_k: int, activation="silu",
                softmax_before_topk: bool = False, implementation=None, method: str = "auto"):
    """The MoE block with experts sharded over ``expert_axis`` of the current mesh.

    Args:
      x: ``[T, d]`` tokens (sharded over ``token_axes``, default ``(expert_axis,)``).
      router: ``[d, E]`` (replicated); gate_up ``[E, d, 2h]``, down ``[E, h, d_out]`` (their
        first axis sharded over ``expert_axis``).
      top_k, activation, softmax_before_topk, implementation: as :class:`layers.MoE`.
      method: the exchange (:func:`ragged_exchange`).

    Returns:
      ``(y [T, d_out], RouterStats)``, ``y`` sharded as ``x``, the statistics summed over
      every token (replicated).

    Raises:
      ValueError: no mesh set (``jax.set_mesh``), ``expert_axis`` not in ``token_axes`` or
        not a mesh axis, ``E`` or ``T`` not divisible by the axes' sizes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("sharded_moe: expert parallelism runs under a mesh: call it inside "
                         "`with jax.set_mesh(mesh):`.")
    token_axes = (expert_axis,) if token_axes is None else tuple(token_axes)
    if expert_axis not in mesh.axis_names or not set(token_axes) <= set(mesh.axis_names):
        raise ValueError(f"sharded_moe: expert_axis={expert_axis!r} and token_axes={token_axes} "
                         f"must be axes of the mesh {mesh.axis_names}.")
    if expert_axis not in token_axes:
        raise ValueError(f"sharded_moe: token_axes={token_axes} must include the expert axis "
                         f"{expert_axis!r} (tokens are exchanged over it).")
    devices = mesh.shape[expert_axis]
    experts = gate_up.shape[0]
    shards = 1
    for a in token_axes:
        shards *= mesh.shape[a]
    if experts % devices or x.shape[0] % shards:
        raise ValueError(f"sharded_moe: {experts} experts over {devices} devices of "
                         f"{expert_axis!r} and {x.shape[0]} tokens over {shards} shards of "
                         f"{token_axes} must divide evenly.")
    num_local = experts // devices

    def local(x, router, gate_up, down):
        logits = fused_matmul(x, router, implementation=implementation)
        weights, chosen, stats = routing.route(logits, top_k,
                                                 softmax_before_topk=softmax_before_topk)
        order, counts = routing.sort_by_expert(chosen, experts)
        rows = x[order // top_k]
        plan, totals = _plan(counts, expert_axis, num_local)
        buffer = jnp.zeros((devices * rows.shape[0], x.shape[1]), x.dtype)
        buffer = ragged_exchange(rows, buffer, plan.send_offsets, plan.counts,
                                 plan.remote_offsets, plan.back_sizes,
                                 axis_name=expert_axis, method=method)
        offset = lax.axis_index(expert_axis) * num_local
        out = routing.expert_swiglu(buffer, gate_up, down, totals, activation=activation,
                                      implementation=implementation, group_offset=offset)
        back = jnp.zeros((rows.shape[0], out.shape[1]), out.dtype)
        back = ragged_exchange(out, back, plan.back_offsets, plan.back_sizes, plan.back_targets,
                               plan.back_recv, axis_name=expert_axis, method=method)
        y = routing.combine(back, order, weights).astype(x.dtype)
        stats = jax.tree.map(lambda s: lax.psum(s, token_axes), stats)
        return y, stats

    spec = P(token_axes if len(token_axes) > 1 else token_axes[0])
    stats_spec = routing.RouterStats(P(), P(), P())
    in_specs = (spec, P(), P(expert_axis), P(expert_axis))
    args = (x, router, gate_up, down)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # Explicit axes: shard_map takes arguments already in its in_specs (a no-op when
        # they are: tokens sharded over the token axes, experts over the expert axis).
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, in_specs))
    return jax.shard_map(local, in_specs=in_specs, out_specs=(spec, stats_spec),
                         check_vma=False)(*args)

