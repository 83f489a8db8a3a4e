"""Per-tile math of the attention kernels (FlashAttention-2, Dao 2023).

What one (query block, key/value block) pair computes, whichever kernel and
whichever walk it belongs to: the masked logits in log2 units
(:func:`logits_log2`), the forward pass's online-softmax update of one
key/value tile (:func:`forward_update`, Algorithm 1, lines 8-10) and its
finish (:func:`forward_finish`, lines 12-13), and the backward pass's tile
(:func:`backward_tile`, Algorithm 2, lines 11-14): probabilities recomputed
from the saved logsumexp, their dropout, and the score gradients. Everything
is float32 whatever the input dtype; the products accumulate in float32
(:func:`ops._tiles.dot`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from ops._tiles import dot
from ops.attention import dropout as dropout_lib
from ops.attention.masking import MaskSpec, visible
from ops.reduction._rows import logsumexp_shift

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def div(a, b):
    """``a // b`` for non-negative ints as one truncating division (jnp's floor
    division adds sign fix-ups, which Mosaic TPU cannot lower off a TPU)."""
    return lax.div(a, jnp.int32(b)) if isinstance(b, int) else lax.div(a, b)


def rem(a, b):
    """``a % b`` for non-negative ints (see :func:`div`)."""
    return lax.rem(a, jnp.int32(b)) if isinstance(b, int) else lax.rem(a, b)


@dataclasses.dataclass(frozen=True)
class RegisterLayout:
    """How a kernel's tile values are laid out, as far as the per-tile math cares: how
    it makes index tiles (:meth:`iota`) and broadcasts a per-row or per-column
    statistic against a tile (:meth:`expand`).

    The default (:data:`PLAIN`) is jnp's: ``lax.broadcasted_iota``, ``[:, None]`` and
    bias / mask tiles transposed in registers for a transposed tile. A Mosaic GPU
    kernel, whose register values carry a ``wgmma`` layout that a reshape or a
    transpose cannot change, gives its own (``ops.attention.mosaic_gpu_tiles``):
    iotas made in the accumulator's layout, ``broadcast_in_dim`` from the row /
    column layout, and bias tiles loaded in the tile's orientation.
    """

    def iota(self, shape, axis: int):
        """int32 indices ``0 .. shape[axis] - 1`` along ``axis`` of a ``shape`` tile."""
        return lax.broadcasted_iota(jnp.int32, shape, axis)

    def expand(self, x, like, axis: int):
        """``x`` broadcasting against the 2-D tile ``like``: a 1-D statistic of its
        rows (``axis=0``) or of its columns (``axis=1``) gains the other axis; a
        2-D one (``[rows, 1]`` / ``[1, cols]`` columns and rows) is kept."""
        if x.ndim == 1 < like.ndim:
            return x[:, None] if axis == 0 else x[None, :]
        return x

    def pair(self, x, transposed: bool):
        """A ``[bq|1, bk|1]`` bias / mask tile in the tile's orientation (``[bk|1, bq|1]``
        when the tile is transposed)."""
        return x.T if transposed else x


PLAIN = RegisterLayout()


def positions(first, block: int, shape, axis: int, layout: RegisterLayout = PLAIN):
    """Absolute int32 positions along ``axis`` of a ``shape`` tile that is block ``first``."""
    return first * block + layout.iota(shape, axis)


def zero_rows_past(x, first, block: int, limit: int, axis: int = 0):
    """Rows (entries along ``axis``) of a tile at or past ``limit`` set to 0 (edge tiles
    hold unspecified padding, and 0 * NaN would leak into products)."""
    if limit % block == 0:
        return x
    rows = positions(first, block, x.shape, axis)
    return jnp.where(rows < limit, x, jnp.zeros_like(x))


@dataclasses.dataclass(frozen=True)
class ScoreMath:
    """How a tile's products ``q k^T`` become probabilities: the part of an attention
    call's config (:class:`ops.attention.config.Config`) the per-tile math reads, also
    what the paged kernels (:mod:`ops.serving.kernels`) give it.

    Attributes:
      scale: the factor of the products (float; e.g. ``1 / sqrt(head_dim)``).
      softcap: the logit soft cap ``c`` of ``c * tanh(scores / c)``, or None.
      dropout_rate: probability of dropping a probability, in ``[0, 1)`` (0: none).
      sinks: whether a per-head sink logit joins every row's softmax denominator
        (read by the kernels that start or merge the softmax, not per tile).
    """

    scale: float
    softcap: float | None = None
    dropout_rate: float = 0.0
    sinks: bool = False


@dataclasses.dataclass
class Tile:
    """What one (query block, key/value block) pair needs, already read from refs."""

    q: jax.Array | None  # [bq, H] (None where the caller gives the products)
    k: jax.Array | None  # [bk, H]
    i: jax.Array  # query block index
    j: jax.Array  # key/value block index
    head: jax.Array  # b * N + n, for dropout
    bias: jax.Array | None = None  # [bq or 1, bk or 1]
    mask: jax.Array | None = None
    q_seg: jax.Array | None = None  # [bq, 1] ([1, bq] when transposed)
    k_seg: jax.Array | None = None  # [1, bk] ([bk, 1] when transposed)
    transposed: bool = False  # the tile's products are k q^T, [bk, bq] (see backward_tile)
    q_pos: jax.Array | None = None  # int32 query positions of the tile's rows when they are not
    # block i's (split-KV decode packs the query heads of a GQA group as rows)
    layout: RegisterLayout = PLAIN  # how index tiles are made and statistics broadcast


def logits_log2(score: ScoreMath, spec: MaskSpec | None, tile: Tile, bq: int, bk: int, *,
                bound_q: bool = False, masked: bool = True, scaled: bool = True, products=None,
                fold_cap: bool = False):
    """``(s2, capped)``: masked logits in log2 units ``[bq, bk]`` (-inf where not visible)
    and ``tanh(scores / cap)`` for the soft cap's derivative (None without one).
    ``spec`` is the call's positional and segment masking (None only with
    ``masked=False``).

    ``masked=False``: the tile is known to be fully visible (a block of the
    ``full_lo .. full_hi`` range of :func:`ops.attention.masking.block_ranges`),
    so the positional, segment and edge conditions are not evaluated; an
    explicit ``mask`` operand still is.

    ``scaled=False`` (only without soft cap and bias, see :func:`log2_factor`):
    the raw products ``q k^T`` come back, masked, and the caller folds the
    factor ``scale * log2(e)`` into its next operation (the forward pass's
    max subtraction: one fused multiply-add per score instead of a multiply and
    a subtraction).

    ``products``: the float32 products ``q k^T`` (``k q^T`` transposed) when the
    caller formed them itself (a Mosaic GPU kernel's ``wgmma``); None: formed
    here from ``tile.q`` and ``tile.k``.

    ``fold_cap`` (with ``scaled=False``, a soft cap and no bias): ``tanh(scores /
    cap)`` comes back, masked, and the cap's factor ``cap * log2(e)`` is the
    caller's to fold into its multiply-add as the scale is without a cap
    (:func:`log2_factor` with ``fold_cap``): one multiply less per score.
    """
    t = tile.transposed
    if products is not None:
        s = products
    else:
        s = dot(tile.k, tile.q, 1, 1) if t else dot(tile.q, tile.k, 1, 1)
    capped = None
    if score.softcap is not None:
        capped = jnp.tanh(s * (score.scale / score.softcap))
        folded = fold_cap and not scaled and tile.bias is None
        s2 = capped if folded else capped * (score.softcap * LOG2E)
    elif scaled or tile.bias is not None:
        s2 = s * (score.scale * LOG2E)
    else:
        s2 = s
    if tile.bias is not None:
        s2 = s2 + tile.layout.pair(tile.bias, t).astype(jnp.float32) * LOG2E
    vis = None
    if masked:
        shape, q_axis = ((bk, bq), 1) if t else ((bq, bk), 0)
        q_pos = (positions(tile.i, bq, shape, q_axis, tile.layout) if tile.q_pos is None
                 else tile.q_pos)
        k_pos = positions(tile.j, bk, shape, 1 - q_axis, tile.layout)
        vis = visible(spec, q_pos, k_pos, tile.q_seg, tile.k_seg, bound_k=spec.S % bk != 0)
        if bound_q and spec.T % bq:
            vis = (q_pos < spec.T) if vis is None else vis & (q_pos < spec.T)
    if tile.mask is not None:
        m = tile.layout.pair(tile.mask, t) != 0
        vis = m if vis is None else vis & m
    if vis is not None:
        s2 = jnp.where(vis, s2, -jnp.inf)
    return s2, capped


def log2_factor(score: ScoreMath, tile: Tile, fold_cap: bool = False) -> float:
    """What :func:`logits_log2` with ``scaled=False`` left for the caller to multiply
    the logits by: ``scale * log2(e)`` for plain scores, ``cap * log2(e)`` for
    soft-capped ones with ``fold_cap`` (no bias), 1 when a soft cap or a bias
    already put them in log2 units."""
    if tile.bias is not None:
        return 1.0
    if score.softcap is not None:
        return score.softcap * LOG2E if fold_cap else 1.0
    return score.scale * LOG2E


def dropout_keep(score: ScoreMath, tile: Tile, seed, bq: int, bk: int):
    """The keep bits of the tile's entries (in its orientation), or None without dropout."""
    if score.dropout_rate == 0.0:
        return None
    shape, q_axis = ((bk, bq), 1) if tile.transposed else ((bq, bk), 0)
    return dropout_lib.keep_mask(seed, tile.head, positions(tile.i, bq, shape, q_axis, tile.layout),
                                 positions(tile.j, bk, shape, 1 - q_axis, tile.layout),
                                 score.dropout_rate)


def _apply_dropout(score: ScoreMath, x, keep):
    if keep is None:
        return x
    return jnp.where(keep, x * (1.0 / (1.0 - score.dropout_rate)), 0.0)


def dropped(score: ScoreMath, tile: Tile, seed, p, bq: int, bk: int):
    """The tile's probabilities ``p`` after dropout (kept entries scaled by ``1 / (1 -
    rate)``, the keep bits of :func:`dropout_keep`); ``p`` itself without dropout."""
    return _apply_dropout(score, p, dropout_keep(score, tile, seed, bq, bk))


def online_softmax(m, l, s, c: float, layout: RegisterLayout = PLAIN):
    """The statistics step of the online softmax (FA-2 Algorithm 1, lines 8-10) on
    logits ``s`` ``[rows, cols]`` (log2 units once multiplied by ``c``; -inf where
    masked): ``(m_new, l_new, p, alpha)``, the new running max and sum, the
    unnormalised probabilities ``exp2(s * c - m_new)`` and the factor ``alpha``
    that rescales what was accumulated before. ``m`` and ``l`` are ``[rows]``
    vectors or ``[rows, 1]`` columns (see :func:`forward_update`). The row max is
    taken on the raw products and then scaled (``c`` is positive, so the order is
    the same), and ``c`` meets the max subtraction in one multiply-add."""
    row_max = jnp.max(s, axis=1, keepdims=m.ndim == 2)
    m_new = jnp.maximum(m, row_max * c if c != 1.0 else row_max)
    shift = logsumexp_shift(m_new)
    p = jnp.exp2((s * c if c != 1.0 else s) - layout.expand(shift, s, 0))
    alpha = jnp.exp2(m - shift)
    l = l * alpha + jnp.sum(p, axis=1, keepdims=m.ndim == 2)
    return m_new, l, p, alpha


def forward_update(score: ScoreMath, spec: MaskSpec | None, carry, tile: Tile, v, seed, bq: int,
                   bk: int, masked: bool = True):
    """One online-softmax step (FA-2 Algorithm 1, lines 8-10) for one key/value block
    (``spec`` as :func:`logits_log2`'s).

    The running max ``m`` and sum ``l`` are ``[bq]`` vectors (loop strategy:
    each thread holds its rows' statistics once, so the ``exp2`` of the
    rescale factor and the finiteness test run once per row) or ``[bq, 1]``
    columns (grid strategy: TPU scratch). The row max is taken on the raw
    products and then scaled (the factor is positive, so the order is the
    same), and the scale meets the max subtraction in one multiply-add,
    ``s * c - m``, before ``exp2``.
    """
    m, l, acc = carry
    s, _ = logits_log2(score, spec, tile, bq, bk, masked=masked, scaled=False)
    m_new, l, p, alpha = online_softmax(m, l, s, log2_factor(score, tile), tile.layout)
    p = dropped(score, tile, seed, p, bq, bk)
    acc = acc * tile.layout.expand(alpha, acc, 0) + dot(p.astype(v.dtype), v, 1, 0)
    return m_new, l, acc


def forward_finish(m, l, acc, layout: RegisterLayout = PLAIN):
    """``(out, lse)``: a row that saw no key gets 0 and -inf (``lse`` shaped as ``m``)."""
    seen = l > 0
    out = acc / layout.expand(jnp.where(seen, l, 1.0), acc, 0)
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)
    return out, lse


def backward_tile(score: ScoreMath, spec: MaskSpec | None, tile: Tile, v, do, lse, delta, seed,
                  bq: int, bk: int, masked: bool = True, products=None, dp=None):
    """``(p_dropped, dscores, dbias)`` of one tile (FA-2 Algorithm 2, lines 11-14;
    ``spec`` as :func:`logits_log2`'s).

    ``dscores`` is the gradient of the scaled scores ``scale * q.k`` (before the
    soft cap); ``dbias`` that of the logits after it, i.e. of the bias.

    A transposed tile (``tile.transposed``, the dK/dV kernel on the loop
    strategy) forms everything as ``[bk, bq]``: ``s^T = k q^T`` and ``dp^T =
    v dO^T``, with ``lse`` and ``delta`` given as ``[1, bq]`` rows. The
    key/value block is then the products' M dimension, so with 64 or more key
    rows every 16-bit product runs on Hopper's ``wgmma`` (a ``[32, 128]``
    tile has M = 32 and lowers to ``mma.sync``), and ``dv += p^T dO``,
    ``dk += ds^T q`` take the tiles as they are.

    ``products`` and ``dp``: the float32 products ``q k^T`` and ``dO v^T`` (both
    transposed with ``tile.transposed``) when the caller formed them itself (a
    Mosaic GPU kernel's ``wgmma``; ``v`` and ``do`` are then unused); ``lse`` and
    ``delta`` may then be 1-D per-query vectors, broadcast by ``tile.layout``.

    ``lse`` None: the caller's ``products`` already have each query's
    ``logsumexp_shift(lse) / scale`` taken off (it started their accumulator
    there; not with a soft cap, whose tanh takes the raw products). ``delta``
    None: ``dp`` is already ``dO v^T - delta`` (not with dropout, which scales
    ``dO v^T`` alone).
    """
    q_axis = 1 if tile.transposed else 0
    s2, capped = logits_log2(score, spec, tile, bq, bk, bound_q=True, masked=masked,
                             products=products)
    if lse is None and score.softcap is not None:
        raise ValueError("backward_tile: lse=None (folded into the products) with a soft cap.")
    if delta is None and score.dropout_rate:
        raise ValueError("backward_tile: delta=None (folded into dp) with dropout.")
    if lse is not None:
        s2 = s2 - tile.layout.expand(logsumexp_shift(lse * LOG2E), s2, q_axis)
    p = jnp.exp2(s2)
    keep = dropout_keep(score, tile, seed, bq, bk)
    if dp is None:
        dp = dot(v, do, 1, 1) if tile.transposed else dot(do, v, 1, 1)
    dp = _apply_dropout(score, dp, keep)
    dbias = p * (dp if delta is None else dp - tile.layout.expand(delta, dp, q_axis))
    dscores = dbias if capped is None else dbias * (1.0 - capped * capped)
    return _apply_dropout(score, p, keep), dscores, dbias

