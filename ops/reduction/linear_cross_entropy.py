"""Linear cross-entropy: ``cross_entropy(x @ w, labels)`` without the logits.

A language model's last layer and loss, fused so that the ``[N, V]`` logits
(N tokens, V = 32k-256k classes) are never stored: for N = 16k tokens and
V = 128k they would take 8 GiB in float32, more than the rest of a training
step. The idea follows Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models" (arXiv:2411.09009): compute logits one
``[rows, vocab]`` tile at a time, reduce each tile into a running logsumexp
and the label's logit, and in the backward pass recompute the tiles from
``x``, ``w`` and the saved logsumexp. The code here is our own.

Forward (a Pallas kernel, "fused logits + online logsumexp"): each program
owns a block of rows and a range of the vocabulary; for every vocabulary tile
it forms ``x_block @ w[:, tile]`` in a float32 accumulator (walking D in
chunks), folds the tile into an online logsumexp
(:func:`~ops.reduction._rows.online_logsumexp_update`) and picks the label's
logit. How the work is laid out depends on the backend (the two walks of
the tiled-matmul core, :mod:`ops.matmul.tiled`):

* ``"grid"`` (interpret, mosaic_tpu): grid ``(row blocks, vocab tiles, D
  chunks)``, the last two ``"arbitrary"``; the tile accumulator is VMEM
  scratch, the running statistics live in the (revisited) output blocks
  (docs/pallas_core.md section 5). One program per row block sees the whole vocabulary.
* ``"loop"`` (pallas_triton, whose programs all run concurrently): grid
  ``(row blocks, vocab splits)``, both parallel; each program loops over its
  split's tiles and, inside, over D. Splitting the vocabulary gives the GPU
  ``row blocks x splits`` programs instead of only ``row blocks``.

Each program writes its rows' partial statistics (running max, sum of
exponentials, picked logit) for its vocabulary range, ``[splits, N, 1]``
float32 (one split on the grid path); a tiny jnp reduction merges them into
the logsumexp and the loss (no grid axis revisits an output across programs
that could run concurrently). Cost: ``2*N*D*V`` flops, like ``x @ w``.

Backward (Pallas kernels inside an XLA loop over vocabulary chunks of
``vocab_chunk`` columns): per chunk,

1. ``dz = g * (softmax - onehot)`` for the chunk by one Pallas kernel: a
   tiled matmul ``x @ w[:, chunk]`` whose epilogue recomputes
   ``exp((z - m) - log_s)`` from the saved logsumexp (kept as the row max
   and the log of the shifted sum, as in cross_entropy); ``[N, chunk]`` in x's dtype;
2. ``dx += dz @ w[:, chunk]^T`` and ``dw[:, chunk] = x^T @ dz`` by the tiled
   matmul core :mod:`ops.matmul.tiled` (float32 accumulation).

Every output block has exactly one writer (dx is accumulated across chunks
by the XLA loop, dw's chunks are disjoint), so there are no write races and
no atomics on any backend, and results are deterministic.

Recomputation vs memory: the backward recomputes the logits once (another
``2*N*D*V`` flops, so 8*N*D*V in all for forward + backward against 6*N*D*V
when the logits are kept), in exchange for never holding ``N x V`` values:
peak memory is ``O(N*D + D*V + N*chunk)`` (inputs, dw, one dz chunk and a
float32 dx accumulator). The paper's backward instead accumulates dx and dw
from concurrent programs with atomic adds, so no dz tile leaves the chip;
ours stores one dz chunk to memory per step and stays race-free and
deterministic. ``vocab_chunk`` trades that buffer (``N * chunk`` elements)
against the number of loop steps. (The paper's gradient filtering, which
skips tiles whose softmax underflows, is not implemented.)

Semantics (as ``cross_entropy``): per-example losses in x's dtype; labels
outside ``[0, V)`` give NaN loss and gradients without the label term.
The ``"xla"`` implementation is the naive ``x @ w`` then cross-entropy,
which does materialise the float32 logits.

LM-loss options (:mod:`ops.reduction.lm_loss`, as on ``cross_entropy``):
``logits_soft_cap`` caps every logits tile in the forward kernels before
the online logsumexp, and the dz epilogue recomputes the cap and multiplies
by its derivative ``1 - tanh**2``. ``label_smoothing`` makes the forward
kernels also sum each row's (capped) logits, a fourth per-split statistic
merged like the picked logit, and the dz epilogue take ``a / V`` off every
class's target. The z-loss needs only ``lse`` with its cotangent, which the
dz epilogue takes as one more per-row operand (``dz += g_lse * softmax``).
Ignoring rows and the reduction act on the ``[rows]`` losses outside the
kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from ops import _op
from ops._checks import check_array, check_matmul_operands
from ops._implementation import KERNEL_BACKENDS, check_implementation
from ops._partitioning import psum, reduced_axes, reshape, run
from ops._tiles import mosaic_tpu_matmul_blocks
from ops.matmul import mosaic_gpu, tiled
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig
from ops.matmul.mosaic_gpu_lce import LceKernels, MosaicLceConfig
from ops.reduction import _rows, lm_loss
# Named import: the package re-exports the function cross_entropy, which shadows the module.
from ops.reduction.cross_entropy import check_labels

_OP = "linear_cross_entropy"


def linear_cross_entropy(x, w, labels, *, ignore_index: int | None = None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logits_soft_cap: float | None = None, reduction: str = "none",
                         return_z_loss: bool = False, implementation: str | None = None,
                         block_sizes=None, vocab_chunk: int | None = None):
    """Per-example ``cross_entropy(x @ w, labels)`` without materialising ``x @ w``.

    Args:
      x: ``[..., D]`` float32 / bfloat16 / float16 (the final hidden states).
      w: ``[D, V]``, same dtype as x (the output projection / unembedding).
      labels: integer array of shape ``x.shape[:-1]``, classes in ``[0, V)``;
        labels outside that range that are not ``ignore_index`` give a NaN loss.
      ignore_index, label_smoothing, z_loss, logits_soft_cap, reduction,
        return_z_loss: the LM-loss options of :func:`ops.cross_entropy`, with
        the same defaults (none active; pass ``ignore_index=-100`` for
        transformers' padding labels) and meaning
        (:mod:`ops.reduction.lm_loss`), on the logits ``x @ w``.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla" (naive, materialises the logits), "interpret",
        "triton" (ours), "pallas_triton", "mosaic_tpu"; or a sequence of these
        tried in order (:mod:`ops._implementation`).
      block_sizes: optional ``(block_rows, block_vocab, block_d)`` tile of the
        logits kernels, or a :class:`LinearCrossEntropyConfig` (which also sets
        the dz kernel's ``epilogue_subtile``); None picks by shape, dtype and
        backend.
      vocab_chunk: vocabulary columns per backward step (rounded down to a
        multiple of block_vocab, at least one tile); None picks it so one
        ``[N, chunk]`` buffer stays near 64M elements. A tuning / test hook.

    Returns:
      ``[...]`` losses in x's dtype (the dtype of the naive ``x @ w`` + optax),
      computed in float32; a float32 scalar for ``"sum"`` / ``"mean"``;
      ``(loss, z_loss)`` with ``return_z_loss``.

    Raises:
      TypeError: non-array inputs, x not floating point, w's dtype not x's,
        labels not integer, an option of the wrong type.
      ValueError: w not rank 2, D mismatch, empty vocabulary, labels' shape not
        ``x.shape[:-1]``, an option out of range, an unknown implementation,
        bad block_sizes or vocab_chunk.


    Pallas kernels: the forward (fused logits + online logsumexp + label pick),
    the backward's dz kernel (logits recomputed with the softmax gradient as
    epilogue) and the dx / dw matmuls; the loop over vocabulary chunks in the
    backward and the merge of per-split statistics are XLA. Differentiable in
    x and w; jit- and vmap-compatible.
    """
    check_matmul_operands(x, w, _OP, contract="D", out="V")
    check_array(labels, "labels", _OP)
    if w.shape[1] == 0:
        raise ValueError(f"{_OP}: w has no columns (an empty vocabulary).")
    check_labels(x.shape[:-1], labels, "x", _OP)
    options = lm_loss.check_options(
        _OP, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        logits_soft_cap=logits_soft_cap, reduction=reduction, return_z_loss=return_z_loss)
    check_implementation(implementation, _OP)
    blocks = _check_block_sizes(block_sizes)
    if vocab_chunk is not None and (not isinstance(vocab_chunk, (int, np.integer))
                                    or isinstance(vocab_chunk, bool) or vocab_chunk <= 0):
        raise ValueError(f"{_OP}: vocab_chunk must be a positive int, got {vocab_chunk!r}.")
    return OP.run(implementation, x=x, w=w, labels=labels, blocks=blocks, vocab_chunk=vocab_chunk,
                  options=options)


def _linear_cross_entropy_on(impl, x, w, labels, blocks, vocab_chunk,
                             options=lm_loss.LossOptions(), kernels=None):
    """The checked call on one implementation (see :func:`linear_cross_entropy`);
    ``kernels``: another core's (:class:`_Config`), None for the tiled core's."""
    if impl == "xla" or x.size == 0:
        # No rows, or a hidden dim of 0 (all logits 0: the loss is log V): XLA's answer.
        return _reference(x, w, labels, options)
    if kernels is None and isinstance(blocks, MosaicMatmulConfig):
        raise NotImplementedError(f"{_OP}: block_sizes is a {type(blocks).__name__}, the tiles "
                                  f"of implementation='mosaic_gpu', not of {impl!r}.")
    lead = x.shape[:-1]
    x2 = reshape(x, (-1, x.shape[-1]))
    labels2 = reshape(labels, (-1, 1)).astype(jnp.int32)
    config = _Config(backend=impl, block_sizes=blocks,
                     vocab_chunk=None if vocab_chunk is None else int(vocab_chunk),
                     soft_cap=options.logits_soft_cap, lse_grad=options.needs_lse_grad,
                     smoothing=options.label_smoothing,
                     num_classes=w.shape[1] if options.label_smoothing else 0,
                     kernels=kernels)
    out = _linear_cross_entropy(x2, w, labels2, config)
    loss, lse = out if config.lse_grad else (out, None)
    loss = reshape(loss, lead)
    lse = None if lse is None else reshape(lse, lead)
    return lm_loss.finish(loss, lse, labels, w.shape[1], options, x.dtype)


def _check_block_sizes(block_sizes):
    if block_sizes is None:
        return None
    if isinstance(block_sizes, (LinearCrossEntropyConfig, MosaicMatmulConfig)):
        block_sizes.check(_OP)
        return block_sizes
    sizes = tuple(block_sizes)
    if len(sizes) != 3 or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                                  and b > 0 for b in sizes):
        raise ValueError(f"{_OP}: block_sizes must be three positive ints "
                         f"(block_rows, block_vocab, block_d) or a LinearCrossEntropyConfig, "
                         f"got {block_sizes!r}.")
    return tuple(int(b) for b in sizes)


# --------------------------------------------------------------------------
# XLA reference (also the "xla" implementation): the naive x @ w, then CE
# --------------------------------------------------------------------------

def reference(x, w, labels, **options):
    """``cross_entropy(x @ w, labels, **options)`` with XLA: float32 logits
    (materialised), x's dtype out (for ``reduction="none"``)."""
    return _reference(x, w, labels, lm_loss.check_options(_OP, **options))


def _reference(x, w, labels, options: lm_loss.LossOptions):
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    loss, lse = lm_loss.row_losses(logits, labels, options)
    return lm_loss.finish(loss, lse, labels, w.shape[1], options, x.dtype)


# --------------------------------------------------------------------------
# Tiling shared by the kernels
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
    backend: str
    block_sizes: "tuple[int, int, int] | LinearCrossEntropyConfig | None" = None
    vocab_chunk: int | None = None
    strategy: str | None = None  # None: by backend; tests force "loop" on the interpreter
    soft_cap: float | None = None  # logits -> cap * tanh(logits / cap) in the kernels
    lse_grad: bool = False         # lse is an output whose cotangent the dz kernel takes
    smoothing: float = 0.0         # label smoothing a: targets (1 - a) onehot + a / V
    num_classes: int = 0           # V (the whole vocabulary, however w is sharded) for a / V
    # Another core's kernels (ops.matmul.mosaic_gpu_lce.LceKernels), None: the tiled core's.
    kernels: object = None


@dataclasses.dataclass(frozen=True)
class _Dims:
    """How ``[rows, d] @ [d, vocab]`` is tiled.

    ``tiles_per_split`` vocabulary tiles form one split (the loop path's
    second grid axis); ``padded_d`` is the width of the loop path's full-D
    blocks (D itself, or the next power of two when block_d does not divide D,
    so that the last D chunk stays inside the block).
    """

    rows: int
    d: int
    vocab: int
    block_rows: int
    block_v: int
    block_d: int
    tiles_per_split: int
    strategy: str
    epilogue_subtile: int | None = None

    @property
    def num_row_blocks(self) -> int:
        return pl.cdiv(self.rows, self.block_rows)

    @property
    def num_v_tiles(self) -> int:
        return pl.cdiv(self.vocab, self.block_v)

    @property
    def num_d(self) -> int:
        return max(1, pl.cdiv(self.d, self.block_d))

    @property
    def num_splits(self) -> int:
        return pl.cdiv(self.num_v_tiles, self.tiles_per_split)

    @property
    def padded_d(self) -> int:
        return tiled.loop_k_width(self.d, self.block_d, "mask")

    @property
    def masks_d(self) -> bool:
        return self.d % self.block_d != 0


def _k_size(dims: _Dims) -> int | None:
    """The contraction extent the core masks past (None when block_d divides D)."""
    return dims.d if dims.masks_d else None


def _logits_tile_loop(x_ref, w_ref, col0, dims: _Dims):
    """Loop path: ``x_block @ w_block[:, col0:col0 + block_v]`` over D chunks, float32."""
    return tiled.loop_accumulate(x_ref, w_ref, ca=1, cb=0, block_k=dims.block_d, num_k=dims.num_d,
                                 out_shape=(x_ref.shape[0], dims.block_v),
                                 k_size=_k_size(dims),
                                 b_cols=pl.ds(col0, dims.block_v))


def _mask_vocab(z, tile, dims: _Dims, soft_cap=None):
    """The tile soft-capped (``soft_cap``), then columns of vocabulary tile ``tile``
    past V set to -inf (they hold garbage)."""
    z = lm_loss.soft_cap(z, soft_cap)
    col = tile * dims.block_v + lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if dims.vocab % dims.block_v:
        z = jnp.where(col < dims.vocab, z, -jnp.inf)
    return z, col


def _fold_tile(z, col, labels, m, s, picked, *total, dims: _Dims):
    """Online logsumexp and label pick over one float32 logits tile; with ``total``
    (label smoothing), the running sum of the row's logits too."""
    m, s = _rows.online_logsumexp_update(m, s, z)
    picked = picked + jnp.sum(jnp.where(col == labels, z, 0.0), axis=1, keepdims=True)
    if not total:
        return m, s, picked
    real = z if dims.vocab % dims.block_v == 0 else jnp.where(col < dims.vocab, z, 0.0)
    return m, s, picked, total[0] + jnp.sum(real, axis=1, keepdims=True)


# --------------------------------------------------------------------------
# Forward kernels: fused logits tile + online logsumexp + label pick
# --------------------------------------------------------------------------

def _forward_grid_kernel(x_ref, w_ref, labels_ref, m_ref, s_ref, p_ref, *refs,
                         dims: _Dims, soft_cap=None):
    *t_ref, acc_ref = refs  # t_ref: [the logits-sum output] with label smoothing
    j = pl.program_id(1)

    @pl.when((j == 0) & (pl.program_id(2) == 0))
    def _init_stats():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        p_ref[...] = jnp.zeros(p_ref.shape, jnp.float32)
        for t in t_ref:
            t[...] = jnp.zeros(t.shape, jnp.float32)

    def fold(acc):
        z, col = _mask_vocab(acc, j, dims, soft_cap)
        m, s, p, *total = _fold_tile(z, col, labels_ref[...], m_ref[...], s_ref[...], p_ref[...],
                                     *(t[...] for t in t_ref), dims=dims)
        m_ref[...], s_ref[...], p_ref[...] = m, s, p
        for t, value in zip(t_ref, total):
            t[...] = value

    tiled.grid_accumulate(x_ref, w_ref, acc_ref, fold, ca=1, cb=0, k_axis=2,
                          block_k=dims.block_d, k_size=_k_size(dims))


def _forward_loop_kernel(x_ref, w_ref, labels_ref, m_ref, s_ref, p_ref, *t_ref, dims: _Dims,
                         soft_cap=None):
    split = pl.program_id(1)
    labels = labels_ref[...]
    t_per = dims.tiles_per_split
    first_tile = split * t_per

    def tile(t, carry):
        z = _logits_tile_loop(x_ref, w_ref, t * dims.block_v, dims)
        z, col = _mask_vocab(z, first_tile + t, dims, soft_cap)
        return _fold_tile(z, col, labels, *carry, dims=dims)

    shape = (labels.shape[0], 1)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32))
    if t_ref:
        init += (jnp.zeros(shape, jnp.float32),)
    if dims.num_v_tiles % t_per:  # the last split has fewer tiles: never read past V
        trips = jnp.minimum(t_per, dims.num_v_tiles - first_tile)
    else:
        trips = t_per
    m, s, p, *total = lax.fori_loop(0, trips, tile, init) if t_per > 1 else tile(0, init)
    m_ref[...], s_ref[...], p_ref[...] = m, s, p
    for t, value in zip(t_ref, total):
        t[...] = value


def _forward_call(x2, w, labels2, config: _Config):
    """Per-split statistics ``(max, sum of exp(z - max), picked logit)``, each float32
    ``[splits, rows, 1]``, and with label smoothing the sum of the logits too."""
    if config.kernels is not None:
        return config.kernels.forward_stats(x2, w, labels2, _kernels_config(x2, w, config),
                                            soft_cap=config.soft_cap,
                                            smoothing=bool(config.smoothing))
    dims = _dims(x2, w, config)
    n = x2.shape[0]
    bm, bv, bd = dims.block_rows, dims.block_v, dims.block_d
    stat_shape = jax.ShapeDtypeStruct((dims.num_splits, n, 1), jnp.float32)
    n_stats = 4 if config.smoothing else 3
    if dims.strategy == "grid":
        grid = (dims.num_row_blocks, dims.num_v_tiles, dims.num_d)
        stat_spec = pl.BlockSpec((None, bm, 1), lambda i, j, k: (0, i, 0))
        call = pl.pallas_call(
            functools.partial(_forward_grid_kernel, dims=dims, soft_cap=config.soft_cap),
            out_shape=[stat_shape] * n_stats, grid=grid,
            in_specs=[pl.BlockSpec((bm, bd), lambda i, j, k: (i, k)),
                      pl.BlockSpec((bd, bv), lambda i, j, k: (k, j)),
                      pl.BlockSpec((bm, 1), lambda i, j, k: (i, 0))],
            out_specs=[stat_spec] * n_stats,
            scratch_shapes=[pl.tpu.VMEM((bm, bv), jnp.float32)],
            compiler_params=pl.CompilerParams((pl.PARALLEL, pl.ARBITRARY, pl.ARBITRARY)),
            backend=config.backend, name="linear_cross_entropy_fwd")
    else:
        grid = (dims.num_row_blocks, dims.num_splits)
        split_cols = dims.tiles_per_split * bv
        stat_spec = pl.BlockSpec((None, bm, 1), lambda i, j: (j, i, 0))
        call = pl.pallas_call(
            functools.partial(_forward_loop_kernel, dims=dims, soft_cap=config.soft_cap),
            out_shape=[stat_shape] * n_stats, grid=grid,
            in_specs=[pl.BlockSpec((bm, dims.padded_d), lambda i, j: (i, 0)),
                      pl.BlockSpec((dims.padded_d, split_cols), lambda i, j: (0, j)),
                      pl.BlockSpec((bm, 1), lambda i, j: (i, 0))],
            out_specs=[stat_spec] * n_stats,
            compiler_params=_loop_params(dims, config.backend),
            backend=config.backend, name="linear_cross_entropy_fwd")
    return call(x2, w, labels2)


def _merge_stats(m, s, p, *logit_sum):
    """Merges per-split statistics into ``(max, log_s, picked[, logit sum])``, float32
    ``[rows, 1]``, with ``logsumexp = max + log_s`` (kept apart for accuracy, as in
    cross_entropy)."""
    if m.shape[0] == 1:
        return (m[0], jnp.log(s[0]), p[0], *(t[0] for t in logit_sum))
    big = jnp.max(m, axis=0)
    shift = jnp.where(jnp.isfinite(big), big, 0.0)
    total = jnp.sum(s * jnp.exp(m - shift), axis=0)
    return (shift, jnp.log(total), jnp.sum(p, axis=0), *(jnp.sum(t, axis=0) for t in logit_sum))


# --------------------------------------------------------------------------
# Backward kernel: dz = g * (softmax - onehot) for one vocabulary chunk,
# logits recomputed by a tiled matmul whose epilogue applies the softmax grad
# --------------------------------------------------------------------------

def _dz_epilogue(z, refs: tiled.TileRefs, *, dims: _Dims, soft_cap=None, smoothing=0.0,
                 num_classes=0):
    labels_ref, m_ref, log_s_ref, g_ref, *g_lse_ref = refs.extras
    dz_ref = refs.outs[0]
    col = pl.program_id(1) * dims.block_v + lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if refs.col_offset:  # a piece of the tile (epilogue_subtile)
        col = col + refs.col_offset
    onehot = (col == labels_ref[...]).astype(jnp.float32)
    if smoothing:  # the target (1 - a) onehot + a / V
        onehot = (1.0 - smoothing) * onehot + smoothing / num_classes
    if soft_cap is not None:
        t = jnp.tanh(z / soft_cap)
        z = soft_cap * t
    # Columns past the chunk and rows past N hold garbage; their stores are discarded.
    g = g_ref[...]
    p = jnp.exp((z - m_ref[...]) - log_s_ref[...])
    dz = g * (p - onehot)
    if g_lse_ref:  # d lse / d z = softmax
        dz = dz + g_lse_ref[0][...] * p
    if soft_cap is not None:  # the cap's derivative
        dz = dz * (1.0 - t * t)
    dz_ref[...] = dz.astype(dz_ref.dtype)


def _dz_call(x2, w_chunk, local_labels, m, log_s, g2, config: _Config, g_lse2=None):
    """``g * (softmax - onehot)`` for the columns of ``w_chunk``: ``[rows, chunk]``, x's dtype,
    by the tiled-matmul core (:func:`ops.matmul.tiled.matmul_call`) with the softmax
    gradient as epilogue.

    ``local_labels`` are the labels relative to the chunk's first column (-1
    for invalid labels), so the kernel needs no column offset. ``g_lse2``: the
    cotangent of lse, ``[rows, 1]`` float32, with ``config.lse_grad``.
    """
    dims = _dims(x2, w_chunk, config)
    n, v = x2.shape[0], w_chunk.shape[1]
    if dims.strategy == tiled.GRID:
        params = pl.CompilerParams((pl.PARALLEL, pl.PARALLEL, pl.ARBITRARY))
    else:
        params = _loop_params(dims, config.backend)
    return tiled.matmul_call(
        x2, w_chunk, ca=1, cb=0, blocks=(dims.block_rows, dims.block_v, dims.block_d),
        backend=config.backend, out_shape=[jax.ShapeDtypeStruct((n, v), x2.dtype)],
        epilogue=functools.partial(_dz_epilogue, dims=dims, soft_cap=config.soft_cap,
                                   smoothing=config.smoothing, num_classes=config.num_classes),
        extras=[(a, tiled.ROWS) for a in (local_labels, m, log_s, g2)
                + ((g_lse2,) if g_lse2 is not None else ())], walk=dims.strategy,
        k_edge="mask", compiler_params=params, epilogue_subtile=dims.epilogue_subtile,
        name="linear_cross_entropy_dz")[0]


def _chunk_grads(x2, w, labels2, m, log_s, g2, start, size: int, config: _Config, g_lse2=None):
    """``(dx contribution float32 [N, D], dw[:, start:start+size])`` of one vocabulary chunk."""
    n, d = x2.shape
    w_chunk = lax.dynamic_slice_in_dim(w, start, size, axis=1)
    valid = (labels2 >= 0) & (labels2 < w.shape[1])
    local = jnp.where(valid, labels2 - start, -1)
    if config.kernels is not None:
        dz = config.kernels.dz(x2, w_chunk, local, m, log_s, g2, _kernels_config(x2, w, config),
                               soft_cap=config.soft_cap, smoothing=config.smoothing,
                               num_classes=config.num_classes, g_lse2=g_lse2)
        return config.kernels.products(x2, w_chunk, dz)
    dz = _dz_call(x2, w_chunk, local, m, log_s, g2, config, g_lse2)
    backend = config.backend
    # dx[N, D] = dz[N, chunk] @ w_chunk[D, chunk]^T
    dx = tiled.matmul(dz, w_chunk, ca=1, cb=1, backend=backend, out_dtype=jnp.float32,
                      blocks=tiled.default_block_sizes(n, d, size, x2.dtype, backend),
                      name="linear_cross_entropy_dx")
    # dw[D, chunk] = x[N, D]^T @ dz[N, chunk]
    dw = tiled.matmul(x2, dz, ca=0, cb=0, backend=backend, out_dtype=w.dtype,
                      blocks=tiled.default_block_sizes(d, size, n, x2.dtype, backend),
                      name="linear_cross_entropy_dw")
    return dx, dw


# --------------------------------------------------------------------------
# custom_vjp wiring
# --------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear_cross_entropy(x2, w, labels2, config: _Config):
    """Float32 per-row losses ``[rows]``; with ``config.lse_grad``, ``(loss, lse)``."""
    return _linear_cross_entropy_fwd(x2, w, labels2, config)[0]


def _linear_cross_entropy_fwd(x2, w, labels2, config):
    loss, m, log_s = _partitioned_forward(x2, w, labels2, config)
    out = (loss, (m + log_s)[:, 0]) if config.lse_grad else loss
    return out, (x2, w, labels2, m, log_s)


def _linear_cross_entropy_bwd(config, residuals, g):
    x2, w, labels2, m, log_s = residuals
    gs = g if config.lse_grad else (g,)

    def local(x2, w, labels2, m, log_s, *gs, reduced):
        local_labels = _shard_labels(labels2, w.shape[1], reduced)
        dx, dw = _backward(x2, w, local_labels, m, log_s, gs, config)
        # dx sums over the vocabulary, dw over rows: partial sums where those are split.
        return psum(dx, reduced, "v"), psum(dw, reduced, "m")

    dx, dw = run(_OP, local, (x2, w, labels2, m, log_s, *gs),
                 _OPERANDS + ("m one", "m one") + ("m",) * len(gs),
                 ("m d", "d v"), gather=("d",), reduce=("m", "v"), out_like=(0, 1))
    return dx, dw, None  # labels are integers: no cotangent


# Multi-device (ops._partitioning): rows ("m") run where they live; a
# vocabulary-sharded w ("v", vocab-parallel cross-entropy as in Megatron-LM)
# gives each device the statistics of its own columns, combined with a pmax
# and two psums of [rows] values, so w is never gathered; a sharded hidden dim
# ("d") is gathered (the logits feed a softmax, so partial products cannot be
# summed after it).
_OPERANDS = ("m d", "d v", "m one")


def _partitioned_forward(x2, w, labels2, config: _Config):
    """``(loss float32 [rows], m, log_s float32 [rows, 1])`` on a mesh."""
    def local(x2, w, labels2, *, reduced):
        global_vocab = w.shape[1] * _vocab_shards(reduced)
        local_labels = _shard_labels(labels2, w.shape[1], reduced)
        m, log_s, picked, *logit_sum = _combine_vocab_shards(
            _merge_stats(*_forward_call(x2, w, local_labels, config)), reduced)
        valid = (labels2 >= 0) & (labels2 < global_vocab)
        loss = (m - picked) + log_s
        if config.smoothing:  # (1 - a) (m - z[label]) + a (m - mean(z)) + log_s
            a = config.smoothing
            loss = (1.0 - a) * (m - picked) + a * (m - logit_sum[0] / global_vocab) + log_s
        loss = jnp.where(valid, loss, jnp.nan)
        return loss[:, 0], m, log_s

    return run(_OP, local, (x2, w, labels2), _OPERANDS, ("m", "m one", "m one"),
               gather=("d",), reduce=("v",))


def _vocab_shards(reduced) -> int:
    axes = reduced_axes(reduced, "v")
    return lax.psum(1, axes) if axes else 1


def _shard_labels(labels2, local_vocab: int, reduced):
    """Labels relative to this device's vocabulary shard; -1 for those another
    device holds (the kernels would otherwise match them to padding columns)."""
    axes = reduced_axes(reduced, "v")
    if not axes:
        return labels2
    local = labels2 - lax.axis_index(axes) * local_vocab
    return jnp.where((local >= 0) & (local < local_vocab), local, -1)


def _combine_vocab_shards(stats, reduced):
    """Per-shard ``(max, log_s, picked[, logit sum])`` -> the whole vocabulary's, by
    collectives.

    The same merge as :func:`_merge_stats` across devices: the largest shift,
    each shard's sum rescaled to it, the label's logit from the one shard that
    holds it (the others picked 0), the shards' logit sums added.
    """
    m, log_s, picked, *logit_sum = stats
    axes = reduced_axes(reduced, "v")
    if not axes:
        return stats
    big = lax.pmax(m, axes)
    shift = jnp.where(jnp.isfinite(big), big, 0.0)
    total = lax.psum(jnp.exp(log_s + (m - shift)), axes)
    return (shift, jnp.log(total), lax.psum(picked, axes),
            *(lax.psum(t, axes) for t in logit_sum))


def _backward(x2, w, labels2, m, log_s, gs, config: _Config):
    """One device: ``(dx, dw)`` for the columns of ``w`` (``labels2`` relative to them);
    ``gs``: the loss's cotangent, and lse's with ``config.lse_grad``."""
    n, d = x2.shape
    v = w.shape[1]
    g2, *g_lse2 = (g.astype(jnp.float32).reshape(-1, 1) for g in gs)
    if config.kernels is not None:
        block_v = config.kernels.block_vocab(_kernels_config(x2, w, config))
    else:
        block_v = _dims(x2, w, config).block_v
    chunk = _vocab_chunk(n, v, block_v, config)
    num_full, tail = divmod(v, chunk)
    grads = functools.partial(_chunk_grads, x2, w, labels2, m, log_s, g2, config=config,
                              g_lse2=g_lse2[0] if g_lse2 else None)
    dx = jnp.zeros((n, d), jnp.float32)
    dw = jnp.zeros((d, v), w.dtype)

    def body(c, carry):
        dx, dw = carry
        start = c * chunk
        dx_c, dw_c = grads(start, chunk)
        return dx + dx_c, lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=1)

    if num_full == 1:
        dx, dw = body(0, (dx, dw))
    elif num_full > 1:
        dx, dw = lax.fori_loop(0, num_full, body, (dx, dw))
    if tail:
        dx_c, dw_c = grads(num_full * chunk, tail)
        dx = dx + dx_c
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c, num_full * chunk, axis=1)
    return dx.astype(x2.dtype), dw


_linear_cross_entropy.defvjp(_linear_cross_entropy_fwd, _linear_cross_entropy_bwd)


# --------------------------------------------------------------------------
# Block-size heuristic
# --------------------------------------------------------------------------


def _prev_pow2(v: int) -> int:
    return 1 << max(0, int(v).bit_length() - 1)


def default_block_sizes(rows: int, d: int, vocab: int, dtype, backend: str) -> tuple[int, int, int]:
    """``(block_rows, block_vocab, block_d)`` of the logits tiles.

    * mosaic_tpu: whole dims when small, else 256 rows x 1024 vocabulary
      columns x 512 of D (multiples of the 8 x 128 tiling; x, w and the
      float32 tile accumulator take about 2.5 MiB of VMEM, twice that with
      double buffering); block_d prefers a divisor of D so no chunk is masked.
    * pallas_triton: powers of two, 64 x 128 x 64 for 16-bit dtypes (32 of D
      for float32): a tensor-core tile whose float32 accumulator (32 KiB) sits
      in registers alongside the running statistics.
    * interpret: small powers of two (at most 32 x 256 x 64), so edge tiles
      and multi-tile rows are exercised on small test shapes.
    """
    traits = pl.backend_traits(backend)
    if traits.hardware == "tpu":
        return mosaic_tpu_matmul_blocks(rows, vocab, d, max_m=256, max_n=1024)
    if traits.triton:
        cap_d = 32 if np.dtype(dtype) == np.float32 else 64
        return (min(64, max(16, pl.next_power_of_2(rows))), min(128, max(16, pl.next_power_of_2(vocab))),
                min(cap_d, max(16, pl.next_power_of_2(d))))
    return (min(32, max(8, pl.next_power_of_2(rows))), min(256, max(128, pl.next_power_of_2(vocab))),
            min(64, max(8, pl.next_power_of_2(d))))


def _tiles_per_split(num_v_tiles: int, backend: str) -> int:
    """Vocabulary tiles per program on the loop path: 32 (4096 columns of 128) on
    GPUs, so V = 128k gives 32 splits and N = 8k tokens about 4k programs; 4 on
    the interpreter so tests see several splits."""
    cap = 4 if pl.backend_traits(backend).interpreted else 32
    return max(1, min(cap, num_v_tiles))


def _kernels_config(x2, w, config: _Config):
    """The logits tiles' config of another core's kernels (``config.kernels``): the
    caller's (three ints become that core's config class), else the op's selection."""
    explicit = config.block_sizes
    cls = OP.config_type(config.backend)
    if isinstance(explicit, tuple):
        explicit = cls(*explicit)
    return OP.select(OP.problem((x2.shape[0], x2.shape[1], w.shape[1]), x2.dtype),
                     config.backend, explicit)


def _dims(x2, w, config: _Config) -> _Dims:
    rows, d = x2.shape
    vocab = w.shape[1]
    explicit = config.block_sizes
    if isinstance(explicit, tuple):
        explicit = LinearCrossEntropyConfig(*explicit)
    if explicit is not None:  # the walk is the backend's, never the caller's
        explicit = dataclasses.replace(explicit, walk=tiled.strategy(config.backend))
    tiles = OP.select(OP.problem((rows, d, vocab), x2.dtype), config.backend, explicit)
    bm, bv, bd = tiles.blocks
    subtile = tiles.epilogue_subtile
    strategy = config.strategy or tiles.walk
    num_v_tiles = pl.cdiv(vocab, bv)
    # The grid path walks the whole vocabulary in one program per row block: one split.
    tiles = _tiles_per_split(num_v_tiles, config.backend) if strategy == "loop" else num_v_tiles
    return _Dims(rows=rows, d=d, vocab=vocab, block_rows=bm, block_v=bv, block_d=bd,
                 tiles_per_split=tiles, strategy=strategy,
                 epilogue_subtile=subtile)


# One backward step's [N, chunk] dz buffer stays near this many elements
# (128 MiB in bfloat16) unless the vocabulary is smaller.
_CHUNK_ELEMENTS = 1 << 26


def _vocab_chunk(rows: int, vocab: int, block_v: int, config: _Config) -> int:
    """Vocabulary columns per backward step: ``vocab_chunk`` if given, else the
    largest power of two with ``rows * chunk <= 64M`` (at least one tile, at
    most the vocabulary rounded up to a power of two)."""
    if config.vocab_chunk is not None:
        chunk = config.vocab_chunk
    else:
        chunk = min(pl.next_power_of_2(vocab), _prev_pow2(max(1, _CHUNK_ELEMENTS // max(rows, 1))))
    return max(block_v, chunk // block_v * block_v)


def _loop_params(dims: _Dims, backend: str):
    """Triton's warps and stages where JAX lowers the loop walk with Triton (JAX picks
    its lowering from the params' type); the grid's semantics elsewhere."""
    traits = pl.backend_traits(backend)
    if traits.triton and traits.through_jax:
        warps = 8 if dims.block_rows * dims.block_v > 64 * 128 else 4
        return pl.triton.CompilerParams(num_warps=warps, num_stages=3,
                                        dimension_semantics=(pl.PARALLEL, pl.PARALLEL))
    return pl.CompilerParams((pl.PARALLEL, pl.PARALLEL))


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig(_op.KernelConfig):
    """The logits tiles (:mod:`ops._op`; ``block_sizes=(block_rows, block_vocab,
    block_d)`` becomes one): rows, vocabulary columns and hidden-dim step of a
    ``[rows, d] @ [d, vocab]`` tile, and ``walk``, how the vocabulary is walked
    (:func:`ops.matmul.tiled.strategy` of the backend; not tuned, and a caller's
    is replaced by it). ``epilogue_subtile`` (None, 1, 2 or 4 dividing
    ``block_vocab``): the backward's dz kernel runs its softmax-gradient epilogue
    on that many column pieces of the tile in turn, each stored before the next
    (:func:`ops.matmul.tiled.subtiled`: fewer live registers at wide tiles);
    None or 1: the whole tile. The forward kernel's online logsumexp always
    takes whole tiles. Results do not depend on it. The heuristic is
    :func:`default_block_sizes` on every backend (no interpreter tiles); no tuning
    problems are registered."""

    block_rows: int = _op.tunable()
    block_vocab: int = _op.tunable()
    block_d: int = _op.tunable()
    walk: str = tiled.GRID
    epilogue_subtile: int | None = _op.tunable(None)

    def check(self, op: str) -> None:
        """Raises ValueError naming ``block_sizes`` when a tile is not a positive int or
        ``epilogue_subtile`` not None or one of 1, 2, 4 dividing ``block_vocab``."""
        for name in ("block_rows", "block_vocab", "block_d"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{op}: block_sizes.{name} must be a positive int, got {value!r}.")
        parts = self.epilogue_subtile
        if parts is not None and (parts not in tiled.SUBTILES or self.block_vocab % parts):
            raise ValueError(f"{op}: block_sizes.epilogue_subtile must be None or one of "
                             f"{tiled.SUBTILES} dividing block_vocab = {self.block_vocab}, "
                             f"got {parts!r}.")

    @property
    def blocks(self) -> tuple[int, int, int]:
        return (self.block_rows, self.block_vocab, self.block_d)

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "LinearCrossEntropyConfig":
        rows, d, vocab = problem.shape
        return cls(*default_block_sizes(rows, d, vocab, problem.dtype, device.backend),
                   walk=tiled.strategy(device.backend))


def _problem_of(x, w, **_):
    """The call's problem ``(rows, d, vocab)`` (:attr:`ops._op.Op.problem_of`)."""
    return (math.prod(x.shape[:-1]), w.shape[0], w.shape[1]), x.dtype, None


# The op exists for memory: the default never takes the XLA path, which forms the logits.
OP = _op.register(_op.Op(name=_OP, dims=("rows", "d", "vocab"),
                         configs=dict.fromkeys(KERNEL_BACKENDS, LinearCrossEntropyConfig),
                         reference=reference, entry=_linear_cross_entropy_on,
                         problem_of=_problem_of, function=linear_cross_entropy,
                         not_default={"xla": "it forms the N x V logits in memory, which "
                                             "linear_cross_entropy exists to avoid"}))


# implementation="mosaic_gpu": the logits tiles on the warp-specialized Mosaic GPU core
# (ops/matmul/mosaic_gpu_lce.py): statistics by a row epilogue, dz as a tile epilogue.

def _mosaic_supported(call: _op.Call) -> str | None:
    """None when the Mosaic GPU kernels run ``call``, else why not: float32, a
    ``LinearCrossEntropyConfig`` (the other kernels' tiles) as ``block_sizes``, a GPU
    older than sm_90."""
    a = call.args
    return mosaic_gpu.why_not(a["x"].dtype, block_sizes=a["blocks"], call=call)


def _mosaic_run(call: _op.Call):
    blocks = call.args["blocks"]
    explicit = MosaicLceConfig(*blocks) if isinstance(blocks, tuple) else blocks
    return _linear_cross_entropy_on("mosaic_gpu", **call.args, kernels=LceKernels(explicit))


_op.register_implementation(_OP, _op.Implementation(
    "mosaic_gpu", _mosaic_run, config=MosaicLceConfig, supported=_mosaic_supported,
    platforms=("gpu",)))
