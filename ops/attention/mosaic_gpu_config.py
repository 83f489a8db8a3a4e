"""The tiles of the Mosaic GPU attention kernels: :class:`MosaicGPUConfig`, its heuristic,
the tuner's candidates and the shared-memory budget that bounds them.

A config is what ``implementation="mosaic_gpu"`` of :func:`ops.dot_product_attention`
runs with (``block_sizes=`` takes one), registered with the op layer
(:mod:`ops._op`) so the tuning cache stores it and the tuner searches its
:meth:`MosaicGPUConfig.candidates`.

Shared memory, per thread block (sm_90 gives a block up to 227 KiB), 16-bit
operands (:func:`smem_bytes`):

* forward: the query tiles of the compute warpgroups ``cw x block_q x H``
  (the output tiles reuse them when ``Hv == H``, else ``cw x block_q x Hv``
  more), and ``max_concurrent_steps`` stages of one key tile ``block_kv x H``
  and one value tile ``block_kv x Hv``; the float32 logsumexp ``cw x block_q``
  and, with segment ids, the int32 ids of the query rows and of each stage's keys;
* dQ: query, dO tiles per warpgroup and stages of key/value tiles
  ``block_kv_dq`` rows long;
* dK/dV: key, value tiles per warpgroup (``block_kv_dkv`` rows) and stages of
  query, dO tiles ``block_q_dkv`` rows long with their float32 logsumexp and delta.

At head dim 128 (bfloat16, 2 compute warpgroups of 64 query rows): 32 KiB of
query tiles and 64 KiB per stage of 128-row key/value tiles, so 2 stages (163
KiB as the lowering counts; 3 would need 227.1 KiB); at head dim 64, 4 stages
of 128-row tiles (147 KiB); at 256, 2 stages of 64-row tiles (195 KiB); MLA's
192 / 128 (its output tiles apart from the query tiles), 3 stages of 64-row
tiles (203 KiB; 128-row tiles do not fit even 2 stages).

Registers (:func:`forward_registers`, against the 232 a compute thread gets):
the forward's two-stage pipeline inside a warpgroup holds the float32 output
and products and two 16-bit probability tiles, so at head dim 128 a 64 x 128
tile takes at most 224 (64 + 64 + 2 x 32 + 32; FlashAttention-3's 176- and
192-row key tiles do not fit), at 64 a 64 x 128 tile 192 and 128 x 64 224,
at 256 a 64 x 64 tile 224; 256-row key tiles fit only at head dim 16 with the
serial step (``intra_wg_stages=1``).

The backward (:func:`backward_registers`, :func:`resolve_backward`, which sets
its fields at trace time): its rings have their own stages
(``max_concurrent_steps_bwd``, the most up to 4 that both kernels hold), and
each kernel takes the longest walked step and the pipeline inside a warpgroup
that its registers hold: at head dim 128 dQ 64 x 128 serial (64 + 128 + 32 =
224: dQ, ``s`` and ``dp``, others; 2 stages of 128-row key/value tiles, 196
KiB) and dK/dV 64 x 64 serial (128 + 64 + 32 = 224, the per-query statistics
folded into the products' accumulators; 240 with a soft cap or dropout, the
fewest there is); at head dim 64 dQ 64 x 128 pipelined (224) and dK/dV 64 x 128
serial (224), 4 stages.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

import pallas_core as pl
from ops import _op

SMEM_BYTES = 227 * 1024  # what one thread block may allocate on sm_90
_BARRIER_BYTES = 8
# What Mosaic GPU's lowering adds to a kernel's own scratch: its cross-warp reduction
# scratch (CompilerParams.reduction_scratch_bytes, 2 KiB by default) and alignment
# (the lowering's own count came out 2560 bytes above the buffers at every size tried).
_RESERVED_BYTES = 2048 + 1024
# Rows of the tiles a warpgroup holds (wgmma's M is 64 per warpgroup).
_ROW_QUANTUM = 64
MAX_STAGES = 8
# Registers per thread of a compute warpgroup after setmaxregister (two compute warpgroups
# and a producer at 40: 128 * (2 * 232 + 40) = 64512 of the SM's 65536).
COMPUTE_REGISTERS = 232
# What a compute thread holds besides its tiles: addresses, loop indices and ring phases,
# the row statistics (m, l, the rescale factor, 2 rows a thread), the mask's positions.
_OTHER_REGISTERS = 32


@dataclasses.dataclass(frozen=True)
class MosaicGPUConfig(_op.KernelConfig):
    """Tiles of the Mosaic GPU attention kernels (``implementation="mosaic_gpu"``).

    Attributes:
      block_q: query rows per compute warpgroup in the forward and dQ kernels
        (a multiple of 64: ``wgmma``'s M per warpgroup); a thread block owns
        ``compute_wgs * block_q`` query rows.
      block_kv: key/value rows per pipeline step of the forward kernel (a
        multiple of 64, at most 256: the ``N`` of the ``q k^T`` ``wgmma``).
      max_concurrent_steps: shared-memory stages of the key/value ring (at least
        2, at most :data:`MAX_STAGES`): how far the TMA producer runs ahead.
      compute_wgs: compute (consumer) warpgroups per thread block, 1 or 2; with 2
        their softmax and matrix products alternate (a ping-pong schedule).
      block_kv_dq: key/value rows per step of the dQ kernel (None: 64).
      block_kv_dkv: key/value rows per compute warpgroup of the dK/dV kernel (None: 64).
      block_q_dkv: query rows per step of the dK/dV kernel (None: 64).
      intra_wg_stages: the forward's software pipeline inside a compute
        warpgroup (FlashAttention-3 section 3.2): 2 issues the next key tile's
        ``q k^T`` and this tile's ``p v`` together before the softmax of the
        next tile, so that softmax runs while the tensor cores work (a second
        ``[block_q, block_kv]`` float32 accumulator and the previous tile's 16-bit
        probabilities stay in registers); 1 runs ``q k^T``, softmax and ``p v``
        of a tile in turn (registers for one tile).
      max_concurrent_steps_bwd: shared-memory stages of the backward kernels'
        rings (None: the most, up to 4, that both kernels' shared memory holds).
      bwd_turns: compute warpgroups taking turns at the tensor cores in the
        backward kernels: 2 (with ``compute_wgs=2``) is the ping-pong of the
        forward (:class:`~ops.attention.mosaic_gpu_tiles.Schedule`: one
        warpgroup's elementwise work runs while the other's products do), 1 lets
        each issue its products whenever it is ready (None: ``compute_wgs``).
      intra_wg_stages_dq / intra_wg_stages_dkdv: the pipeline inside a compute
        warpgroup of the dQ / dK/dV kernel: 2 issues step t's ``s``, ``dp``
        products with step t-1's accumulating products (``dq += ds k``; ``dv +=
        p^T dO``, ``dk += ds^T q``) and runs step t's elementwise work while the
        latter are on the tensor cores (step t-1's 16-bit operands stay in
        registers); 1 waits for step t-1's accumulating products before issuing
        step t's. None: 2 where :func:`backward_registers` fits the registers and
        the ring has 3 stages, else 1 (:func:`resolve_backward`).
    """

    block_q: int = _op.tunable(64)
    block_kv: int = _op.tunable(128)
    max_concurrent_steps: int = _op.tunable(2)
    compute_wgs: int = _op.tunable(2)
    block_kv_dq: int | None = _op.tunable(None)
    block_kv_dkv: int | None = _op.tunable(None)
    block_q_dkv: int | None = _op.tunable(None)
    intra_wg_stages: int = _op.tunable(2)
    max_concurrent_steps_bwd: int | None = _op.tunable(None)
    bwd_turns: int | None = _op.tunable(None)
    intra_wg_stages_dq: int | None = _op.tunable(None)
    intra_wg_stages_dkdv: int | None = _op.tunable(None)

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_kv_dq", "block_kv_dkv", "block_q_dkv"):
            value = getattr(self, name)
            if value is None and name not in ("block_q", "block_kv"):
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                    or value <= 0 or value % _ROW_QUANTUM or value > 256):
                raise ValueError(f"MosaicGPUConfig: {name} must be a multiple of {_ROW_QUANTUM} "
                                 f"up to 256 (wgmma's rows per warpgroup), got {value!r}.")
        for name in ("max_concurrent_steps", "max_concurrent_steps_bwd"):
            steps = getattr(self, name)
            if steps is None and name == "max_concurrent_steps_bwd":
                continue
            if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not (
                    2 <= steps <= MAX_STAGES):
                raise ValueError(f"MosaicGPUConfig: {name} must be an int in [2, "
                                 f"{MAX_STAGES}], got {steps!r}.")
        for name in ("compute_wgs", "intra_wg_stages", "bwd_turns", "intra_wg_stages_dq",
                     "intra_wg_stages_dkdv"):
            value = getattr(self, name)
            if value is None and name not in ("compute_wgs", "intra_wg_stages"):
                continue
            if value not in (1, 2) or isinstance(value, bool):
                raise ValueError(f"MosaicGPUConfig: {name} must be 1 or 2, got {value!r}.")
        if self.bwd_turns is not None and self.bwd_turns > self.compute_wgs:
            raise ValueError(f"MosaicGPUConfig: bwd_turns={self.bwd_turns} takes turns between "
                             f"more compute warpgroups than compute_wgs={self.compute_wgs}.")

    @property
    def dq_kv(self) -> int:
        return self.block_kv_dq or 64

    @property
    def dkdv_kv(self) -> int:
        return self.block_kv_dkv or 64

    @property
    def dkdv_q(self) -> int:
        return self.block_q_dkv or 64

    @classmethod
    def heuristic(cls, problem: _op.Problem, device: _op.Device) -> "MosaicGPUConfig":
        """64 query rows per warpgroup, 2 compute warpgroups, the two-stage pipeline
        inside each (``intra_wg_stages=2``), and the longest key/value tile (128, else
        64) with the most stages (up to 4) that the forward's shared memory
        (:func:`smem_bytes`) and a compute thread's registers
        (:func:`forward_registers`) hold at the problem's head dims; the backward's
        tiles 64. In the interpret mode (no GPU) the same: the kernels run as they
        would on one."""
        _, S, head_dim = problem.shape
        itemsize = np.dtype(problem.dtype).itemsize
        segments, pairs = _segments(problem), _pairs(problem)
        for bk in (128, 64):
            for stages in (4, 3, 2):
                config = cls(64, bk, stages)
                if (smem_bytes(config, "forward", head_dim, head_dim, itemsize, segments,
                               pairs) <= SMEM_BYTES
                        and forward_registers(config, head_dim, head_dim) <= COMPUTE_REGISTERS):
                    return config
        return cls(64, 64, 2)

    @classmethod
    def candidates(cls, problem: _op.Problem, device: _op.Device) -> tuple["MosaicGPUConfig", ...]:
        """Key/value tiles of 64, 128, 192 and 256 rows (no longer than the keys rounded
        up to 64), 2 to 4 stages, one or two compute warpgroups of 64 query rows (128 at
        head dims up to 64), the forward's pipeline inside a warpgroup of 2 or 1
        stages, every one whose forward, dQ and dK/dV kernels fit the shared memory
        (:func:`smem_bytes`) and whose forward fits a compute thread's registers
        (:func:`forward_registers`); the backward's tiles 64 or 128 key rows for dQ
        (128 where :func:`backward_registers` holds them), the rest of the backward
        resolved by :func:`resolve_backward`."""
        T, S, head_dim = problem.shape
        itemsize = np.dtype(problem.dtype).itemsize
        segments, pairs = _segments(problem), _pairs(problem)
        longest = max(64, pl.cdiv(S, 64) * 64)
        out = []
        for bq, bk, stages, wgs, bk_dq, overlap in itertools.product(
                (64, 128) if head_dim <= 64 else (64,), (64, 128, 192, 256), (2, 3, 4), (2, 1),
                (64, 128), (2, 1)):
            if bk > longest and bk != 64:
                continue
            config = cls(bq, bk, stages, wgs, block_kv_dq=bk_dq, intra_wg_stages=overlap)
            if (forward_registers(config, head_dim, head_dim) <= COMPUTE_REGISTERS
                    and fits(config, head_dim, head_dim, itemsize, segments, pairs=pairs)
                    and (bk_dq == 64 or backward_registers(
                        config, "dq", head_dim, head_dim, stages=1) <= COMPUTE_REGISTERS)):
                out.append(config)
        return tuple(out) or (cls.heuristic(problem, device),)


def _pairs(problem: _op.Problem) -> tuple:
    """The bias and mask operands the problem's variant names."""
    from ops.attention.mosaic_gpu_pairs import Pair
    variant = problem.variant_dict()
    pairs = (Pair.from_variant(variant.get("bias"), variant.get("bias_dtype") or "float32"),
             Pair.from_variant(variant.get("mask"), None))
    return tuple(p for p in pairs if p is not None)


def _segments(problem: _op.Problem) -> bool:
    variant = problem.variant_dict()
    return bool(variant.get("segments") or variant.get("q_lengths") or variant.get("kv_lengths"))


def forward_registers(config: MosaicGPUConfig, head_dim: int, v_dim: int) -> int:
    """An upper bound on the registers a forward compute thread needs (its 128 threads
    share each register tile): the float32 output accumulator ``block_q x v_dim``, the
    float32 products ``block_q x block_kv``, the 16-bit probabilities of one tile (two
    with ``intra_wg_stages=2``: the previous tile's stay in registers while its ``p v``
    runs), and :data:`_OTHER_REGISTERS`. ``head_dim`` is only on the shared-memory side
    (the query and key tiles stay there)."""
    del head_dim
    bq, bk = config.block_q, config.block_kv
    tiles16 = config.intra_wg_stages
    return (bq * v_dim + bq * bk) // 128 + tiles16 * bq * bk // 256 + _OTHER_REGISTERS


def backward_registers(config: MosaicGPUConfig, kernel: str, head_dim: int, v_dim: int, *,
                       stages: int = 1, lse_folded: bool = True,
                       delta_folded: bool = True) -> int:
    """An upper bound on the registers a compute thread of the backward's ``kernel``
    ("dq" or "dkdv") needs with ``stages`` steps in flight inside a warpgroup
    (:attr:`MosaicGPUConfig.intra_wg_stages_dq` / ``_dkdv``), as
    :func:`forward_registers` counts the forward's: the float32 accumulators (dQ
    ``block_q x head_dim``; dK and dV ``block_kv_dkv x (head_dim + v_dim)``), the
    step's two float32 products ``s`` and ``dp``, the previous step's 16-bit operands
    still read by its ``wgmma`` with 2 stages (dQ: ``ds``; dK/dV: ``p`` and ``ds``;
    this step's are formed where its float32 products die), the dK/dV kernel's
    per-query statistics (its tiles are transposed, so a thread holds ``block_q_dkv
    / 4`` columns of the logsumexp and of delta each, unless folded into the products'
    accumulators: ``lse_folded`` without a soft cap, ``delta_folded`` without
    dropout), and :data:`_OTHER_REGISTERS`."""
    if kernel == "dq":
        rows, walked = config.block_q, config.dq_kv
        accumulators, operands, columns = rows * head_dim // 128, rows * walked // 256, 0
    elif kernel == "dkdv":
        rows, walked = config.dkdv_kv, config.dkdv_q
        accumulators, operands = rows * (head_dim + v_dim) // 128, 2 * rows * walked // 256
        columns = (walked // 4) * ((not lse_folded) + (not delta_folded))
    else:
        raise ValueError(f"kernel: expected 'dq' or 'dkdv', got {kernel!r}.")
    products = 2 * rows * walked // 128
    return accumulators + products + (stages - 1) * operands + columns + _OTHER_REGISTERS


def resolve_backward(config: MosaicGPUConfig, head_dim: int, v_dim: int, itemsize: int,
                     segments: bool = False, pairs=(), dbias: bool = False,
                     soft_cap: bool = False, dropout: bool = False) -> MosaicGPUConfig:
    """``config`` with every backward field set (the kernels run with these); fields
    already set are kept.

    Each kernel takes the first of (128-row walked steps, pipelined), (128, serial),
    (64, pipelined), (64, serial) (:attr:`MosaicGPUConfig.block_kv_dq` /
    ``block_q_dkv``; ``intra_wg_stages_dq`` / ``_dkdv``) that
    :func:`backward_registers` holds within :data:`COMPUTE_REGISTERS` and whose
    shared memory (:func:`smem_bytes`) holds a ring of 2 stages, 3 when pipelined
    (so the producer refills a slot while the previous step's accumulating products
    still read theirs); none: 64-row serial steps, the fewest registers. Longer steps
    first: a ``wgmma`` of N = 64 reading both operands from shared memory (``s`` and
    ``dp`` of 64-row steps) needs 128 bytes a clock of it, all an SM has; N = 128
    needs 96. The ring: the most stages, up to 4, both kernels' shared memory holds
    (a kernel left with fewer than 3 is serial); the turns: ``compute_wgs``."""
    fields = {"dq": "block_kv_dq", "dkdv": "block_q_dkv"}
    given = config.max_concurrent_steps_bwd
    chosen, most = {}, {}

    def ring(candidate, kernel):
        """The most stages (up to 4, or the given count) the kernel's memory holds."""
        for st in ((given,) if given else (4, 3, 2)):
            if smem_bytes(dataclasses.replace(candidate, max_concurrent_steps_bwd=st), kernel,
                          head_dim, v_dim, itemsize, segments, pairs, dbias) <= SMEM_BYTES:
                return st
        return 0

    for kernel, field in fields.items():
        stages_field = f"intra_wg_stages_{kernel}"
        walked_options = (getattr(config, field),) if getattr(config, field) else (128, 64)
        stage_options = ((getattr(config, stages_field),) if getattr(config, stages_field)
                         else (2, 1))
        for walked, stages in itertools.product(walked_options, stage_options):
            candidate = dataclasses.replace(config, **{field: walked})
            steps = ring(candidate, kernel)
            if steps >= (3 if stages == 2 else 2) and backward_registers(
                    candidate, kernel, head_dim, v_dim, stages=stages, lse_folded=not soft_cap,
                    delta_folded=not dropout) <= COMPUTE_REGISTERS:
                chosen[kernel], most[kernel] = (walked, stages), steps
                break
        else:  # over the registers whatever the steps: the fewest
            walked = getattr(config, field) or 64
            chosen[kernel] = (walked, stage_options[-1])
            most[kernel] = ring(dataclasses.replace(config, **{field: walked}), kernel)
    steps = given or max(2, min(most.values()))
    stages = {k: 1 if s == 2 and steps < 3 and getattr(config, f"intra_wg_stages_{k}") is None
              else s for k, (_, s) in chosen.items()}
    return dataclasses.replace(
        config, max_concurrent_steps_bwd=steps, block_kv_dq=chosen["dq"][0],
        block_q_dkv=chosen["dkdv"][0],
        bwd_turns=config.compute_wgs if config.bwd_turns is None else config.bwd_turns,
        intra_wg_stages_dq=stages["dq"], intra_wg_stages_dkdv=stages["dkdv"])


def smem_bytes(config: MosaicGPUConfig, kernel: str, head_dim: int, v_dim: int, itemsize: int,
               segments: bool = False, pairs=(), dbias: bool = False) -> int:
    """The shared memory one thread block of ``kernel`` ("forward", "dq" or "dkdv")
    allocates with ``config`` at head dims ``head_dim`` (query/key) and ``v_dim``
    (value/output), 16-bit operands of ``itemsize`` bytes (see the module docstring);
    ``pairs``: the bias / mask operands (:class:`ops.attention.mosaic_gpu_pairs.Pair`);
    ``dbias``: the dQ kernel also writes the bias gradient (a float32 tile per
    warpgroup). The backward kernels' rings have ``max_concurrent_steps_bwd``
    stages (unresolved: 2, the fewest)."""
    cw, st = config.compute_wgs, config.max_concurrent_steps
    if kernel != "forward":  # the backward's rings (unresolved: the fewest stages)
        st = config.max_concurrent_steps_bwd or 2
    rows, walked = {"forward": (config.block_q, config.block_kv),
                    "dq": (config.block_q, config.dq_kv),
                    "dkdv": (config.dkdv_kv, config.dkdv_q)}.get(kernel, (0, 0))
    extra = sum(p.smem_bytes(rows, walked, cw, st, kernel == "dkdv") for p in pairs if p)
    if dbias and kernel == "dq":
        extra += cw * rows * walked * 4
    if kernel == "forward":
        bq, bk = config.block_q, config.block_kv
        total = cw * bq * head_dim * itemsize
        total += cw * bq * v_dim * itemsize if v_dim != head_dim else 0  # own output tiles
        total += st * bk * (head_dim + v_dim) * itemsize + cw * bq * 4
        total += (cw * bq * 4 + st * bk * 4) if segments else 0
        barriers = cw + 4 * st + 1
    elif kernel == "dq":
        bq, bk = config.block_q, config.dq_kv
        total = cw * bq * (head_dim + v_dim) * itemsize + 2 * cw * bq * 4
        total += st * bk * (head_dim + v_dim) * itemsize
        total += (cw * bq * 4 + st * bk * 4) if segments else 0
        barriers = cw + 4 * st + 1
    elif kernel == "dkdv":
        bq, bk = config.dkdv_q, config.dkdv_kv
        total = cw * bk * (head_dim + v_dim) * itemsize
        total += st * bq * (head_dim + v_dim) * itemsize + 2 * st * bq * 4
        total += (cw * bk * 4 + st * bq * 4) if segments else 0
        barriers = cw + 4 * st + 1
    else:
        raise ValueError(f"kernel: expected 'forward', 'dq' or 'dkdv', got {kernel!r}.")
    return total + extra + barriers * _BARRIER_BYTES + _RESERVED_BYTES


def fits(config: MosaicGPUConfig, head_dim: int, v_dim: int, itemsize: int, segments: bool,
         kernels=("forward", "dq", "dkdv"), pairs=(), dbias: bool = False) -> bool:
    """Whether every one of ``kernels`` fits :data:`SMEM_BYTES` with ``config``."""
    return all(smem_bytes(config, k, head_dim, v_dim, itemsize, segments, pairs, dbias)
               <= SMEM_BYTES for k in kernels)
