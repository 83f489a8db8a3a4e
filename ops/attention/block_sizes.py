"""Attention on the op layer (:mod:`ops._op`): the config :class:`BlockSizes` with its
per-backend heuristic and candidates, the variant :class:`AttentionVariant`, and the op's
registration (:func:`register_op`)."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import jax
import numpy as np

import pallas_core as pl
from ops import _op, tuning
from ops._implementation import KERNEL_BACKENDS
from ops.attention.reference import attention_reference
from pallas_core.triton import backend as triton_backend

_OP = "dot_product_attention"

# (block_q, block_k, num_warps, num_stages): the tuner's space for the forward kernel.
_SPACE = tuple(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))
# Split-KV decode (ops.attention.decode): the query rows (T * G) one program holds, and at
# most this many programs share one key range.
MAX_ROWS = 64
MAX_SPLITS = 64
# The tuner's space for split-KV decode: key blocks, splits (powers of two up to MAX_SPLITS).
_DECODE_BLOCK_K = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class BlockSizes(_op.KernelConfig):
    """Tiles of the attention kernels (``block_sizes=`` of :func:`ops.dot_product_attention`),
    the op's config on every backend (:mod:`ops._op`; every field is tunable).

    Attributes:
      block_q, block_k: query / key-value rows per tile of the forward and dQ
        kernels.
      block_q_dkv, block_k_dkv: the same for the dK/dV kernel (None: as the
        forward's).
      num_warps, num_stages: Triton launch parameters (None: the heuristic's).
      k_splits: split-KV decode (:mod:`ops.attention.decode`): programs sharing
        each (batch, key/value head)'s key range, merged by a second kernel; 1
        runs the unsplit kernels, None lets the heuristic decide.

    On ``pallas_triton`` block sizes must be powers of two; on ``mosaic_tpu``
    a query block must be a multiple of 8 (or T) and a key block a multiple of
    128 (or S); every backend needs them positive, and ``triton`` needs them
    >= 16 (``tl.dot``'s minimum).
    """

    block_q: int = _op.tunable()
    block_k: int = _op.tunable()
    block_q_dkv: int | None = _op.tunable(None)
    block_k_dkv: int | None = _op.tunable(None)
    num_warps: int | None = _op.tunable(None)
    num_stages: int | None = _op.tunable(None)
    k_splits: int | None = _op.tunable(None)

    def resolved(self) -> "BlockSizes":
        return dataclasses.replace(self, block_q_dkv=self.block_q_dkv or self.block_q,
                                   block_k_dkv=self.block_k_dkv or self.block_k)

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "BlockSizes":
        """:func:`default_block_sizes` of ``problem`` ``(T, S, head_dim)``, or in Triton's
        CPU interpreter :func:`interpreter_block_sizes`."""
        T, S, head_dim = problem.shape
        if device.interpreter:
            return interpreter_block_sizes(T, S)
        return default_block_sizes(T, S, head_dim, problem.dtype, device.backend)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["BlockSizes", ...]:
        """Forward and dQ tiles of 64 or 128 query and 32..128 key rows (clamped to the
        sequences), 4 or 8 warps, 2 or 3 stages; the dK/dV tiles stay the heuristic's.
        For a call split-KV decode can run (its variant's ``decode_programs`` set) those
        with ``k_splits=1`` (the unsplit kernels) and split-KV decode's key tiles of
        32..128 rows with every power-of-two ``k_splits`` from 2 up to
        :data:`MAX_SPLITS` and the key blocks."""
        T, S, _ = problem.shape
        tiles = [cls(_op.fit(bq, T), _op.fit(bk, S), num_warps=w, num_stages=st)
                 for bq, bk, w, st in _SPACE]
        if problem.variant_dict()["decode_programs"] is None:
            return tuple(dict.fromkeys(tiles))
        base = cls.heuristic(problem, device)
        split = []
        for bk in _DECODE_BLOCK_K:
            bk, splits = _op.fit(bk, S), 2
            while splits <= min(pl.cdiv(S, bk), MAX_SPLITS):
                split.append(cls(base.block_q, bk, base.block_q_dkv, base.block_k_dkv,
                                 k_splits=splits))
                splits *= 2
        return tuple(dict.fromkeys([dataclasses.replace(c, k_splits=1) for c in tiles] + split))


@dataclasses.dataclass(frozen=True)
class AttentionVariant(_op.Variant):
    """What changes the attention kernels beyond the shape bucket and dtype (the tuning
    key's variant; defaults: a plain call). Scalar constants that leave the kernels'
    structure alone (the scale, the cap's and the dropout rate's values) are not part of
    it, nor are the batch size and the head count, except for split-KV decode, whose
    ``k_splits`` is chosen for how many programs batch x key/value heads already give.

    Attributes:
      causal: causal masking.
      window_left, window_right: each side of the local window, bucketed
        (:func:`ops.tuning.shape_bucket`); None: unbounded.
      segments, q_lengths, kv_lengths: segment ids, query / key-value lengths given.
      bias, mask: the full (not broadcast) dims of the bias / mask among "BNTS"
        ("" all broadcast); None: absent. bias_dtype: the bias's dtype name.
      dropout, soft_cap: dropout / a logit soft cap on.
      group: query heads per key/value head (GQA / MQA).
      decode_programs: for a call split-KV decode can run
        (:func:`split_kv_applies`), batch x key/value heads, bucketed
        (:func:`ops.tuning.shape_bucket`): the programs one split gives, which the
        best ``k_splits`` depends on; None for every other call.
    """

    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    segments: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False
    bias: str | None = None
    bias_dtype: str | None = None
    mask: str | None = None
    dropout: bool = False
    soft_cap: bool = False
    group: int = 1
    decode_programs: int | None = None


def split_kv_applies(T: int, group: int, *, bias: bool, mask: bool,
                     dropout: bool) -> str | None:
    """None when split-KV decode (:mod:`ops.attention.decode`) can run a call with ``T``
    queries of ``group`` query heads per key/value head, else why not (for the error of an
    explicit ``k_splits > 1``)."""
    if bias or mask or dropout:
        return "a bias, a mask array or dropout (use the unsplit kernels: k_splits=1)"
    if T * group > MAX_ROWS:
        return (f"T * (N // K) = {T * group} query rows per key/value head (at most {MAX_ROWS}: "
                "split-KV decode is for few queries)")
    return None


def default_block_sizes(T: int, S: int, head_dim: int, dtype, backend: str) -> BlockSizes:
    """The heuristic (untuned until a GPU run): tiles that fit each backend's memories.

    * triton / pallas_triton: forward and dQ tiles of 128 query x 64 key
      rows for 16-bit inputs, halved for head dims above 128 (as
      FlashAttention-2's Triton kernels on sm_80/sm_90); the dK/dV kernel,
      which holds two ``[block_k, H]`` float32 accumulators and forms its
      tiles transposed (the key block is every product's M dim, which
      ``wgmma`` needs at 64 rows or more), takes 64 query x 128 key rows at
      (padded) head dim 64 (sm_90 bf16: 94 SASS instructions per MFLOP of the
      loop, against 122 at 32 x 128), 32 x 128 at the others up to 128 (64 x
      128 spills at 128, and at 32 with the 4 warps its accumulators get) and
      16 x 64 up to 256 (the key block and its two float32 accumulators fill the
      registers; 32 x 64 spills); never more than the
      (power-of-two rounded) sequence. Above 256 (head dim 512): 32 x 32
      forward and dQ tiles and 16 x 32 dK/dV tiles on 8 warps, whose products
      run on ``mma.sync``, not ``wgmma``: its 64-row minimum per warp group does
      not fit (64 x 512 q, dO and float32 dQ tiles fill a thread's 255 registers
      and spill; two 64 x 512 float32 dK/dV accumulators are the whole register
      file). They compile for sm_90 without spills within its shared memory.
      The head dim here is the larger of the query/key and value head dims. 16-bit inputs at every head dim 32..256 compile for
      sm_90 without register spills (tests/test_attention_static.py). float32
      inputs multiply at IEEE precision on FMA units, not tensor cores, which
      needs far more registers: 16 x 16 tiles, 4 warps up to head dim 64 and
      8 above, and one pipeline stage (two hold a second float32 K/V tile in
      registers and spill at head dims >= 128). float32 attention is a
      correctness path on GPUs, not a fast one.
    * mosaic_tpu: 128 x 128 (the MXU and lane width), or the whole sequence
      when shorter.
    * interpret: 64 x 64, or the whole (rounded) sequence when shorter.
    """
    wide = np.dtype(dtype).itemsize >= 4
    traits = pl.backend_traits(backend)
    if traits.triton:
        padded_h = pl.next_power_of_2(head_dim)
        if wide:  # float32 products run on FMA units (IEEE precision): the smallest tiles
            return BlockSizes(16, 16, block_q_dkv=16, block_k_dkv=16,
                              num_warps=4 if padded_h <= 64 else 8, num_stages=1)
        if padded_h == 64:
            bq, bk, bq_dkv, bk_dkv = 128, 64, 64, 128
        elif padded_h <= 128:
            bq, bk, bq_dkv, bk_dkv = 128, 64, 32, 128
        elif padded_h <= 256:
            bq, bk, bq_dkv, bk_dkv = 64, 32, 16, 64
        else:  # 512: 32-row tiles on mma.sync (see the docstring)
            bq, bk, bq_dkv, bk_dkv = 32, 32, 16, 32
        fit_t = lambda b: min(b, max(16, pl.next_power_of_2(T)))
        fit_s = lambda b: min(b, max(16, pl.next_power_of_2(S)))
        return BlockSizes(fit_t(bq), fit_s(bk), block_q_dkv=fit_t(bq_dkv), block_k_dkv=fit_s(bk_dkv))
    if traits.hardware == "tpu":
        return BlockSizes(T if T <= 128 else 128, S if S <= 128 else 128)
    return BlockSizes(min(64, pl.next_power_of_2(T)), min(64, pl.next_power_of_2(S)))


def tuning_variant(*, causal: bool = False, window: tuple[int | None, int | None] = (None, None),
                   segments: bool = False, q_lengths: bool = False, kv_lengths: bool = False,
                   bias=None, mask=None, dropout: bool = False, soft_cap: bool = False,
                   group: int = 1, decode_programs: int | None = None) -> dict:
    """The tuning cache's variant of an attention call as a dict (:class:`AttentionVariant`):
    everything besides the shape bucket and dtype that changes its kernels.

    Args:
      window: ``(left, right)`` of the local window, None for an unbounded side;
        each side is bucketed (:func:`ops.tuning.shape_bucket`).
      bias, mask: the ``[B, N, T, S]``-shaped (4-d) operands or None; the key holds
        which of their dims are full (not broadcast) and the bias dtype.
      group: query heads per key/value head.
      decode_programs: batch x key/value heads when split-KV decode can run the
        call, else None; bucketed.
    """
    def full_dims(x):
        return None if x is None else "".join(l for l, d in zip("BNTS", x.shape) if d != 1)

    left, right = (None if w is None else tuning.shape_bucket((w,))[0] for w in window)
    return AttentionVariant(
        causal=bool(causal), window_left=left, window_right=right, segments=bool(segments),
        q_lengths=bool(q_lengths), kv_lengths=bool(kv_lengths), bias=full_dims(bias),
        bias_dtype=None if bias is None else np.dtype(bias.dtype).name, mask=full_dims(mask),
        dropout=bool(dropout), soft_cap=bool(soft_cap), group=int(group),
        decode_programs=None if decode_programs is None
        else tuning.shape_bucket((max(1, decode_programs),))[0]).as_dict()


def select_block_sizes(T: int, S: int, head_dim: int, dtype, backend: str,
                       variant: dict | None = None) -> BlockSizes:
    """The tiles when the caller gives none (:meth:`ops._op.Op.select`): the tuning
    cache's entry (key ``(T, S, head_dim)`` and ``variant``, from
    :func:`tuning_variant`, None for a plain call; fields the entry leaves out
    come from the heuristic), else :meth:`BlockSizes.heuristic`:
    :func:`default_block_sizes`, whose GPU tiles give way to
    :func:`interpreter_block_sizes` on ``triton`` in Triton's CPU interpreter
    (:func:`pallas_core.triton.backend.wants_interpreter_tiles`).

    Raises:
      ops.tuning.TuningCacheError: a malformed user or packaged cache file.
    """
    op = _op.get(_OP)
    return op.select(op.problem((T, S, head_dim), dtype, variant), backend)


def interpreter_block_sizes(T: int, S: int) -> BlockSizes:
    """Tiles for Triton's CPU interpreter, whose cost is per tl operation rather
    than per element (:func:`pallas_core.triton.backend.interpreter_tiles`): the
    whole (power-of-two rounded) sequence up to 128 rows per tile for every kernel, so a sentence-length sequence is one query tile and one
    key/value step (a program per batch entry and head), and a longer one a few."""
    bq, bk = triton_backend.interpreter_tiles((T, S), cap=128)
    return BlockSizes(bq, bk, block_q_dkv=bq, block_k_dkv=bk)


# The tuner's decode problem: one token against 8192 cached ones at head dim 128, 8 query
# heads per key/value head, 32 (batch, key/value head) programs (the static gate's case).
_DECODE_TUNING = (1, 8192, 128)


def _example_dims(shape: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """``(batch, heads, kv_heads, causal)`` of the tuner's call for ``(T, S, head_dim)``:
    the decode problem's (32 x 8 over 1, full), else batch 1 and 16 query heads over 16
    key/value heads, causal self-attention when ``T == S`` and full attention otherwise."""
    if tuple(shape) == _DECODE_TUNING:
        return 32, 8, 1, False
    return 1, 16, 16, shape[0] == shape[1]


def _tuning_variant(shape: tuple[int, ...]) -> dict:
    """The variant the tuner's call for ``shape`` has (:func:`_example_dims`), as
    :func:`ops.dot_product_attention` computes it."""
    batch, heads, kv_heads, causal = _example_dims(shape)
    group = heads // kv_heads
    decode = split_kv_applies(shape[0], group, bias=False, mask=False, dropout=False) is None
    return tuning_variant(causal=causal, group=group,
                          decode_programs=batch * kv_heads if decode else None)


def _example(fn: Callable) -> Callable:
    """The tuner's call of ``fn`` (:func:`ops.dot_product_attention`) for a problem
    ``(T, S, head_dim)``, batch and heads as :func:`_example_dims` gives them."""
    def example(problem: _op.Problem, implementation: str):
        t, s, h = problem.shape
        batch, heads, kv_heads, causal = _example_dims(problem.shape)
        q = jax.ShapeDtypeStruct((batch, t, heads, h), problem.dtype)
        kv = jax.ShapeDtypeStruct((batch, s, kv_heads, h), problem.dtype)
        return (lambda q, k, v: fn(q, k, v, is_causal=causal, implementation=implementation),
                [q, kv, kv])

    return example


def _training(fn: Callable) -> Callable:
    """The tuner's training step of ``fn`` for a self-attention problem (``T == S``):
    :func:`_example`'s call and its backward (dQ, dK/dV); None for the decode step,
    which is not trained."""
    step = _op.vjp_training(_example(fn))

    def training(problem: _op.Problem, implementation: str):
        t, s, _ = problem.shape
        return step(problem, implementation) if t == s else None

    return training


def register_op(fn: Callable, check: Callable | None = None, **op_fields) -> _op.Op:
    """Registers attention (``fn``: :func:`ops.dot_product_attention`, ``check``: its
    argument checks, ``op_fields``: the rest of :class:`ops._op.Op`'s, its entry among
    them) with the op layer.

    The tuner fills the cache for 2048 and 4096 tokens at head dims 64 and 128 (the
    static gate's sizes), self-attention being causal (an example with ``T == S`` is
    causal, otherwise full), and for one split-KV decode step (the tiles and
    ``k_splits`` of one query against 8192 keys, head dim 128, GQA group 8, 32
    programs before splitting); ``--quick`` tunes 512 tokens at head dim 64."""
    return _op.register(_op.Op(
        name=_OP, dims=("T", "S", "head_dim"), configs=dict.fromkeys(KERNEL_BACKENDS, BlockSizes),
        reference=attention_reference, check=check, variant=AttentionVariant,
        tuning=_op.Tuning(example=_example(fn),
                          shapes=tuple((t, t, h) for t in (2048, 4096) for h in (64, 128))
                          + (_DECODE_TUNING,),
                          quick=((512, 512, 64),), variant=_tuning_variant,
                          order=20, training=_training(fn)), function=fn, **op_fields))
