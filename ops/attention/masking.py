"""Which (query, key) pairs attend: one definition for the reference and every kernel.

A pair ``(q, k)`` of batch ``b`` is visible when every requested condition
holds (jax.nn.dot_product_attention's conventions):

* ``is_causal``: ``k <= q`` (top-left aligned, also when ``T != S``);
* ``local_window_size = (left, right)``: ``q - left <= k <= q + right``;
* sequence lengths: ``q < query_seq_lengths[b]`` and ``k < key_value_seq_lengths[b]``;
* segment ids: ``query_segment_ids[b, q] == key_value_segment_ids[b, k]``;
* ``mask[b, n, q, k]`` (boolean, broadcast) is True.

Sequence lengths are folded into segment ids (:func:`fold_lengths`): a padded
query gets the id ``QUERY_PAD`` and a padded key ``KEY_PAD``, two reserved
values that equal no other id, so kernels only ever compare ids. The
positional conditions and the ids are evaluated elementwise on a tile by
:func:`visible`; the same function evaluates them on the whole ``T x S``
grid in the reference.

Block skipping (:func:`block_ranges`): for each query block, the key/value
blocks that can hold a visible pair form a range ``[lo, hi)`` computed once
in XLA (exactly for the positional conditions, conservatively from per-block
id ranges for segments); kernels visit only that range. The transposed table
serves the dK/dV kernel, which walks query blocks for a key/value block.
An explicit ``mask`` array is applied elementwise but not used to skip.
Inside ``[lo, hi)`` the table also gives the range ``[full_lo, full_hi)``
of blocks every pair of which is visible (:func:`block_full_visibility`):
the Triton kernels walk it without evaluating the conditions at all.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import pallas_core as pl
from ops.attention.range_table import BlockRange

QUERY_PAD = np.int32(np.iinfo(np.int32).min)  # the id of a query past its sequence length
KEY_PAD = np.int32(np.iinfo(np.int32).min + 1)  # the id of a key past its sequence length


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static (trace-time) part of the mask.

    Attributes:
      T, S: query and key lengths.
      causal: ``k <= q``.
      left, right: the local window's reach (None: unbounded).
      segments: whether segment ids (user ids or folded lengths) are compared.
    """

    T: int
    S: int
    causal: bool = False
    left: int | None = None
    right: int | None = None
    segments: bool = False

    @property
    def right_reach(self) -> int | None:
        """How far right of ``q`` a key may be: the window's right reach, capped at 0 if causal."""
        if self.causal:
            return 0 if self.right is None else min(self.right, 0)
        return self.right


def visible(spec: MaskSpec, q_pos, k_pos, q_seg=None, k_seg=None, *, bound_k: bool = False):
    """Elementwise visibility of ``(q_pos, k_pos)``; None when everything is visible.

    Args:
      q_pos, k_pos: int32 absolute positions, broadcastable against each other.
      q_seg, k_seg: int32 ids at those positions (with ``spec.segments``).
      bound_k: also require ``k_pos < spec.S`` (tiles that overhang the keys).
    """
    conds = []
    right = spec.right_reach
    if right is not None:
        conds.append(k_pos <= q_pos + right)
    if spec.left is not None:
        conds.append(k_pos >= q_pos - spec.left)
    if bound_k:
        conds.append(k_pos < spec.S)
    if spec.segments:
        conds.append(q_seg == k_seg)
    if not conds:
        return None
    out = conds[0]
    for c in conds[1:]:
        out = out & c
    return out


def fold_lengths(q_seg, kv_seg, q_len, kv_len, T: int, S: int):
    """Segment ids ``([B, T], [B, S])`` with sequence lengths folded in; ``(None, None)`` if neither.

    Past ``q_len[b]`` a query's id becomes ``QUERY_PAD``, past ``kv_len[b]`` a
    key's becomes ``KEY_PAD``: a padded query sees no key and a padded key is
    seen by no query, exactly the length masks of jax.nn.
    """
    if q_seg is None and q_len is None and kv_len is None:
        return None, None
    batch = next(x.shape[0] for x in (q_seg, q_len, kv_len) if x is not None)
    if q_seg is None:
        q_seg = jnp.zeros((batch, T), jnp.int32)
        kv_seg = jnp.zeros((batch, S), jnp.int32)
    if q_len is not None:
        q_seg = jnp.where(jnp.arange(T)[None, :] < q_len[:, None], q_seg, QUERY_PAD)
    if kv_len is not None:
        kv_seg = jnp.where(jnp.arange(S)[None, :] < kv_len[:, None], kv_seg, KEY_PAD)
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def fold_key_mask(mask, q_seg, kv_seg, batch: int, T: int):
    """Segment ids ``([B, T], [B, S])`` with a key-only boolean mask ``[B or 1, 1, 1, S]``
    folded in: a masked-out key gets ``KEY_PAD``, which no query's id equals."""
    keys = jnp.broadcast_to(mask[:, 0, 0, :], (batch, mask.shape[-1]))
    if q_seg is None:
        q_seg = jnp.zeros((batch, T), jnp.int32)
        kv_seg = jnp.zeros(keys.shape, jnp.int32)
    return q_seg, jnp.where(keys, kv_seg, KEY_PAD).astype(jnp.int32)


def _block_id_range(seg, block: int):
    """Per-block (min, max) of ids ``[B, L]`` -> two ``[B, cdiv(L, block)]``."""
    length = seg.shape[1]
    nblocks = pl.cdiv(length, block)
    padded = jnp.pad(seg, ((0, 0), (0, nblocks * block - length)), mode="edge")
    tiles = padded.reshape(seg.shape[0], nblocks, block)
    return tiles.min(axis=2), tiles.max(axis=2)


def block_visibility(spec: MaskSpec, block_q: int, block_k: int, q_seg=None, kv_seg=None):
    """``[B or 1, nq, nk]`` bool: whether query block i and key block j can share a visible pair."""
    return _block_pairs(spec, block_q, block_k, q_seg, kv_seg, every=False)


def block_full_visibility(spec: MaskSpec, block_q: int, block_k: int, q_seg=None, kv_seg=None):
    """``[B or 1, nq, nk]`` bool: whether every pair of query block i and key block j is
    visible, so a kernel may skip :func:`visible` there.

    Both blocks must be whole (no rows past T or S), every offset ``k - q`` in the
    pair inside the window / causal reach, and with segments one id throughout
    both blocks. (An explicit ``mask`` array is applied on every block anyway.)
    """
    return _block_pairs(spec, block_q, block_k, q_seg, kv_seg, every=True)


def _block_pairs(spec: MaskSpec, block_q: int, block_k: int, q_seg, kv_seg, *, every: bool):
    """Per block pair, whether some (``every=False``) or every pair of positions is visible."""
    nq, nk = pl.cdiv(spec.T, block_q), pl.cdiv(spec.S, block_k)
    q_first = np.arange(nq) * block_q
    q_last = np.minimum(q_first + block_q, spec.T) - 1
    k_first = np.arange(nk) * block_k
    k_last = np.minimum(k_first + block_k, spec.S) - 1
    # The pair offsets k - q inside a block pair span [nearest, farthest].
    nearest = k_first[None, :] - q_last[:, None]
    farthest = k_last[None, :] - q_first[:, None]
    if every:
        whole = (q_first + block_q <= spec.T)[:, None] & (k_first + block_k <= spec.S)[None, :]
        pairs, right_off, left_off = whole, farthest, nearest
    else:
        pairs, right_off, left_off = np.ones((nq, nk), bool), nearest, farthest
    if spec.right_reach is not None:
        pairs &= right_off <= spec.right_reach
    if spec.left is not None:
        pairs &= left_off >= -spec.left
    out = jnp.asarray(pairs)[None]
    if spec.segments:
        q_min, q_max = _block_id_range(q_seg, block_q)
        k_min, k_max = _block_id_range(kv_seg, block_k)
        if every:  # one id throughout both blocks, the same
            ids = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
                   & (q_min[:, :, None] == k_min[:, None, :]))
        else:  # the id ranges overlap
            ids = (jnp.maximum(q_min[:, :, None], k_min[:, None, :])
                   <= jnp.minimum(q_max[:, :, None], k_max[:, None, :]))
        out = out & ids
    return out


def _first_last(vis):
    """``[..., n]`` bool -> int32 ``(lo, hi)``: the range from the first to the last True (0, 0 if none)."""
    n = vis.shape[-1]
    any_ = vis.any(axis=-1)
    lo = jnp.argmax(vis, axis=-1)
    hi = n - jnp.argmax(vis[..., ::-1], axis=-1)
    return jnp.where(any_, lo, 0).astype(jnp.int32), jnp.where(any_, hi, 0).astype(jnp.int32)


def masked_sides(spec: MaskSpec, block_q: int, block_k: int, *, transpose: bool = False,
                 bound_q: bool = False) -> tuple[bool, bool]:
    """``(leading, trailing)``: whether a walk over a block's visible range may meet
    tiles a mask boundary crosses before / after its fully visible blocks.

    Walking key blocks for a query block (``transpose=False``) a left window
    or segments cut the start and a causal or right reach, segments or a
    ragged key edge the end; walking query blocks for a key block
    (``transpose=True``) the roles of the reaches swap and the ragged edge is
    the queries' (``bound_q``: rows past T are masked, as in the backward).
    (False, False): no tile needs a mask at all.
    """
    right, left = spec.right_reach is not None, spec.left is not None
    ragged_k, ragged_q = spec.S % block_k != 0, bound_q and spec.T % block_q != 0
    if transpose:
        leading, trailing = right, left or ragged_q
        ragged_row = ragged_k  # the walking key block itself is cut: no full blocks
    else:
        leading, trailing = left, right or ragged_k
        ragged_row = ragged_q
    leading |= spec.segments
    trailing |= spec.segments or (ragged_row and not leading)
    return leading, trailing


def block_ranges(vis, batch: int, *, transpose: bool = False, full=None,
                 sides: tuple[bool, bool] = (True, True)) -> BlockRange:
    """The per-block loop ranges, a :class:`~ops.attention.range_table.BlockRange`
    of int32 ``[batch, blocks]`` arrays (:func:`ops.attention.range_table.pack`
    puts them in the kernels' scalar table).

    ``vis`` is :func:`block_visibility`'s ``[B or 1, nq, nk]``, ``full``
    :func:`block_full_visibility`'s (None: no block is known to be fully
    visible). Without ``transpose``, entry ``[b, i]`` describes query block
    ``i`` of batch ``b``: ``lo, hi``, the key/value blocks it visits, and
    ``full_lo, full_hi``, a sub-range ``lo <= full_lo <= full_hi <= hi`` of
    blocks every pair of which is visible. ``sides`` (:func:`masked_sides`)
    says which of ``[lo, full_lo)`` and ``[full_hi, hi)`` a kernel walks with
    masks; the sub-range is emptied (set to ``hi, hi`` or, without a leading
    side, ``lo, lo``) when there is none, when it has gaps, or when it would
    leave masked blocks on a side the kernel does not walk. With ``transpose``
    the roles swap (query blocks per key/value block, entry ``[b, j]``).
    """
    if transpose:
        vis = jnp.swapaxes(vis, 1, 2)
        full = None if full is None else jnp.swapaxes(full, 1, 2)
    vis = jnp.broadcast_to(vis, (batch, *vis.shape[1:]))
    lo, hi = _first_last(vis)
    leading, trailing = sides
    empty = hi if leading else lo
    if full is None:
        full_lo, full_hi = empty, empty
    else:
        full = jnp.broadcast_to(full, vis.shape)
        first, last = _first_last(full)
        # Only a run without gaps may skip masking: count the full blocks in [first, last).
        inside = (jnp.arange(full.shape[-1]) >= first[..., None]) & (jnp.arange(full.shape[-1]) < last[..., None])
        ok = (first < last) & (jnp.sum(full & inside, axis=-1) == last - first)
        ok &= (first == lo) | leading
        ok &= (last == hi) | trailing
        full_lo, full_hi = jnp.where(ok, first, empty), jnp.where(ok, last, empty)
    return BlockRange(lo, hi, full_lo, full_hi)
