"""The XLA reference of ``ops.ragged_dot`` (also its ``"xla"`` implementation).

``jax.lax.ragged_dot`` computes one matmul per contiguous group of rows, with
rows at or past ``sum(group_sizes)`` zero. JAX 0.10.2 documents its
``group_offset`` argument but does not implement it on a CPU, so the owned
groups are moved to the front of ``lhs`` (a roll by the first owned row),
multiplied there by ``jax.lax.ragged_dot`` with the owned groups' sizes, and
rolled back: rows of groups this call does not own come out zero.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def owned_rows(group_sizes, num_local: int, group_offset=None):
    """``(start, local_sizes)``: the first row of the owned groups and their sizes.

    The owned groups are ``[group_offset, group_offset + num_local)`` of
    ``group_sizes [G]`` (int32); a group id outside ``[0, G)`` has no rows.
    """
    sizes = group_sizes.astype(jnp.int32)
    if group_offset is None:
        if sizes.shape[0] == num_local:
            return jnp.int32(0), sizes
        offset = jnp.int32(0)
    else:
        offset = jnp.reshape(group_offset, ()).astype(jnp.int32)
    total = sizes.shape[0]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes)])
    start = starts[jnp.clip(offset, 0, total)]
    ids = offset + jnp.arange(num_local, dtype=jnp.int32)
    valid = (ids >= 0) & (ids < total)
    if total == 0:
        return start, jnp.zeros((num_local,), jnp.int32)
    return start, jnp.where(valid, sizes[jnp.clip(ids, 0, total - 1)], 0)


def ragged_dot_reference(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                         group_offset=None):
    """``out[i] = lhs[i] @ rhs[g(i)]`` with XLA, where row ``i`` belongs to group ``g(i)``.

    Args and result as :func:`ops.ragged_dot`: ``lhs [M, K]``, ``rhs [G_local,
    K, N]``, ``group_sizes [G]`` int32, ``group_offset`` None or an int32
    scalar / ``[1]``; ``[M, N]`` in ``preferred_element_type`` (default
    lhs's dtype), accumulated in float32; rows at or past the owned groups'
    end, and rows of groups not owned, are zero.
    """
    out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    m, g_local = lhs.shape[0], rhs.shape[0]
    start, local = owned_rows(group_sizes, g_local, group_offset)
    if m == 0 or g_local == 0:
        return jnp.zeros((m, rhs.shape[2]), out_dtype)
    # Never past M (sum(group_sizes) <= M is the contract; this keeps the roll from wrapping).
    ends = jnp.minimum(jnp.cumsum(local), m - start)
    local = jnp.diff(ends, prepend=jnp.int32(0))
    rolled = lhs if group_offset is None else jnp.roll(lhs, -start, axis=0)
    out = lax.ragged_dot(rolled, rhs, local, precision=precision,
                         preferred_element_type=jnp.float32)
    if group_offset is not None:
        out = jnp.roll(out, start, axis=0)
    return out.astype(out_dtype)


def dense_reference(lhs, rhs, group_sizes, group_offset=None):
    """The same product as one full matmul per owned group, each row keeping its
    group's (``G`` times the work, float32): an independent second reference."""
    m = lhs.shape[0]
    start, local = owned_rows(group_sizes, rhs.shape[0], group_offset)
    ends = start + jnp.cumsum(local)
    begins = ends - local
    row = jnp.arange(m)[:, None]
    member = (row >= begins[None, :]) & (row < ends[None, :])  # [M, G_local]
    prod = jnp.einsum("mk,gkn->gmn", lhs, rhs, precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
    return jnp.einsum("mg,gmn->mn", member.astype(jnp.float32), prod,
                      precision=lax.Precision.HIGHEST)

