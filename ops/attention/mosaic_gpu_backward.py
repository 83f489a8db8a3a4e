"""The backward kernels of ``implementation="mosaic_gpu"``: dQ and dK/dV on ``wgmma``
(FlashAttention-2, Dao 2023, Algorithm 2, split in two kernels; the warpgroup
structure, ping-pong and pipeline of FlashAttention-3, Shah et al. 2024,
sections 3.1-3.2).

``delta = rowsum(dO * O)`` is one XLA pass; each kernel is then a producer
warpgroup streaming the walked tiles by TMA into a ring of shared-memory
stages and compute warpgroups owning their rows, recomputing the
probabilities from the saved logsumexp with :func:`ops.attention.tile_math.backward_tile`
on the accumulator registers:

* dQ: thread blocks of ``compute_wgs * block_q`` query rows of one query head;
  per key/value step ``s = q k^T`` and ``dp = dO v^T`` (``wgmma``, key and
  value tiles read transposed), ``ds = p * (dp - delta)``, ``dq += ds k``
  (``wgmma`` from registers);
* dK/dV: thread blocks of ``compute_wgs * block_kv_dkv`` key rows of one
  key/value head, walking every (query head of its group, query block): the
  tiles are formed transposed, ``s^T = k q^T`` and ``dp^T = v dO^T``, so the
  key rows are every product's M (``wgmma``'s 64 rows per warpgroup), and
  ``dv += p^T dO``, ``dk += ds^T q`` take them from registers. A GQA group's
  query heads are summed in the accumulators: no ``[B, S, N, H]``
  intermediate, no atomics. The accumulators of ``s^T`` and ``dp^T`` start at
  ``-lse / scale`` and ``-delta`` of their query columns (without a soft cap,
  resp. dropout), so a thread holds no ``block_q_dkv / 4`` columns of them
  through the elementwise work.

Both kernels run one walk (:func:`walk`, a :class:`Step` each): with two
compute warpgroups they take turns at the tensor cores as the forward's do
(:class:`~ops.attention.mosaic_gpu_tiles.Schedule`, ``bwd_turns``), so one's
elementwise work runs while the other's products do; inside a warpgroup a
step is serial (``intra_wg_stages_*=1``: ``s``, ``dp``; wait; elementwise;
the accumulating products; wait) or pipelined (2: step t's ``s``, ``dp`` and
step t-1's accumulating products issued together, step t's elementwise work
while the latter run). :func:`~ops.attention.mosaic_gpu_config.resolve_backward`
picks per kernel the walked step length (128 or 64 rows) and the schedule
that :func:`~ops.attention.mosaic_gpu_config.backward_registers` holds.

Nothing is accumulated across thread blocks and every sum runs in a fixed
order, so the gradients are bit-for-bit deterministic. Both kernels walk only
the blocks the masks let through
(:func:`~ops.attention.mosaic_gpu_tiles.range_table`, transposed for dK/dV)
and evaluate the mask only off each warpgroup's fully visible range.

Static view (``plgpu.mosaic_modules``; B=2, T=S=8192, causal, bfloat16, the
resolved tiles). Round 2 (both kernels 64 x 64 steps, each warpgroup on its
own, every step ``s``/``dp``, wait, elementwise, accumulate, wait), per step of
a compute warpgroup:

* dQ, head dim 128: 2 stage waits, 16 ``m64n64k16`` ``wgmma`` from shared
  memory (``q k^T``, ``dO v^T``), wait 0, 32 ``ex2`` a thread, 4
  ``m64n128k16`` from registers (``ds k``), wait 0, 2 releases; 132 KiB of
  shared memory (2 stages);
* dK/dV, head dim 128: 2 stage waits, 16 ``m64n64k16`` (``k q^T``, ``v
  dO^T``), wait 0, 32 ``ex2``, 8 ``m64n128k16`` from registers (``p^T dO``,
  ``ds^T q``), wait 0, 2 releases; 132 KiB; at head dim 64 both kernels 12
  ``m64n64k16`` from shared memory a step, 101 KiB (4 stages).

Now (``resolve_backward``'s choices; the turns add per step a wait for the
warpgroup's turn, a meeting after issuing and an arrival after its elementwise
work):

* head dim 128: dQ 64 x 128 steps, serial (224 registers counted): 16
  ``m64n128k16`` from shared memory, meeting, wait 0, 64 ``ex2``, arrival,
  turn, 8 ``m64n128k16`` from registers (``ds k``, K = 128), wait 0; 196 KiB,
  2 stages. dK/dV 64 x 64 steps, serial (224 with the statistics folded;
  pipelined 256, 128-row steps 288): 16 ``m64n64k16``, meeting, wait 0, 32
  ``ex2``, arrival, turn, 8 ``m64n128k16``, wait 0; 132 KiB, 2 stages;
* head dim 64: dQ 64 x 128, pipelined (224): turn, 8 ``m64n128k16`` for
  step t and 8 ``m64n64k16`` from registers for step t-1's ``ds k``, meeting,
  ``wait_group 1``, 64 ``ex2``, wait 0; 164 KiB, 4 stages. dK/dV 64 x 128,
  serial (224): 8 ``m64n128k16`` from shared memory, 64 ``ex2``, 16
  ``m64n64k16`` from registers; 167 KiB, 4 stages.

Predicted (H200; 697 TFLOP/s measured matmul ceiling; the cost model of
:mod:`ops.attention.mosaic_gpu`). The backward executes 7 products a tile
against the 5 counted, so forward+backward at 0.9x cuDNN (390 of its 433
TFLOP/s, causal, head dim 128) needs the products at about 510 TFLOP/s
executed, 0.73 of the ceiling. A ``wgmma`` of N = 64 reading both operands
from shared memory needs 128 bytes a clock of it, all an SM has (about 0.65 of
the matmul rate); N = 128 needs 96 (about 0.9); from registers, 64 or less.
So 128-row walked steps come first where the registers hold them, then the
turns: each warpgroup's elementwise work (about 300 clocks a 64 x 64 step, 600
a 64 x 128 one) hides under the other's products (770-1220 tensor-core
clocks), where round 2's independent warpgroups lose about 15% when their
elementwise work and waits coincide. At head dim 128 the dK/dV kernel (64-row
query steps, N = 64 products) is the limit: about 0.67 of the ceiling, dQ
about 0.80:

====================  ======  ======  =====  ==========
fwd+bwd               round2  now     cuDNN  ratio now
====================  ======  ======  =====  ==========
d128 causal            ~325    ~375    433   ~0.87x
d128 full              ~360    ~410    498   ~0.82x
d64 causal             ~280    ~330    362   ~0.92x
====================  ======  ======  =====  ==========

Short of 0.9x at head dim 128: what is left is the dK/dV kernel's N = 64
products (128-row query steps need 288 registers; two compute warpgroups
sharing a 128-row query step, FlashAttention-3's layout, would make ``s``
``[64, 128]`` per warpgroup with ``dk``, ``dv`` split between them, 64
registers more than a warpgroup has with ``dq`` beside them) and the 2 products
the two kernels repeat. FlashAttention-3's single kernel removes those by
adding dQ across key blocks: in float32 through TMA reduce-add stores ordered
by a per-query-block semaphore (deterministic), which the GPU interpret mode
cannot run (no semaphores), or as partials per key block reduced in a fixed
order afterwards: at B=2, 16 heads of 128, T=8192, causal, 4096 (key block of
128, query tile of 64) pairs a head, each a 32 KiB float32 ``[64, 128]``
partial: 4.3 GB written and read back, about 1.8 ms of HBM traffic at 4.8
TB/s against the whole dQ kernel's ~1.5 ms, so the two kernels stay. The lease
queue (``mosaic-gpu-attention-*-train``) times the schedules as arms.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention.config import Config
from ops.attention.masking import KEY_PAD, QUERY_PAD
from ops.attention.mosaic_gpu_config import COMPUTE_REGISTERS, MosaicGPUConfig, resolve_backward
from ops.attention.mosaic_gpu_forward import pad_rows
from ops.attention.mosaic_gpu_forward import pair_operands
from ops.attention.mosaic_gpu_pairs import Access, combined
from ops.attention.mosaic_gpu_pairs import scratch as pair_scratch
from ops.attention.mosaic_gpu_tiles import (PRODUCER_REGISTERS, WGMMA, Ring, Schedule, Walk,
                                            acc_set, col_layout, range_table, row_layout, smem,
                                            stream_keys, swizzle_transforms, zeros_tile)
from ops.attention.tile_math import Tile, backward_tile
from ops.reduction._rows import logsumexp_shift
from pallas_core import gpu as plgpu


def dkdv_accumulator_registers(tiles: MosaicGPUConfig, head_dim: int, v_dim: int) -> int:
    """float32 registers per thread of the dK/dV kernel's two accumulators."""
    return tiles.dkdv_kv * (head_dim + v_dim) // 128


def tiles_for(cfg: Config, tiles: MosaicGPUConfig, itemsize: int, want_dbias: bool = False,
              pairs=()) -> MosaicGPUConfig:
    """The backward's fields of ``tiles`` resolved for the call ``cfg``
    (:func:`~ops.attention.mosaic_gpu_config.resolve_backward`)."""
    problem = cfg.problem
    return resolve_backward(tiles, problem.head_dim, problem.v_dim, itemsize,
                            problem.spec.segments, pairs, want_dbias,
                            soft_cap=cfg.score.softcap is not None,
                            dropout=cfg.score.dropout_rate > 0)


def backward(cfg: Config, tiles: MosaicGPUConfig, q, k, v, q_seg, kv_seg, out, lse, do,
             seed=None, bias=None, mask=None, want_dbias: bool = False):
    """``(dq, dk, dv)`` in q's, k's and v's shapes and dtypes, from the forward's ``out``
    and float32 ``lse [B, N, T, 1]``, the cotangent ``do``, (with dropout) the int32
    seed the forward drew its keep bits with, and the forward's ``bias`` / ``mask``;
    with ``want_dbias`` also the float32 gradient of the logits ``[B, N, T, S]`` (the
    bias's, before it is summed over the bias's broadcast dims), which the dQ kernel
    writes tile by tile (zeros where no pair is visible)."""
    spec = cfg.problem.spec
    T = q.shape[1]
    pairs_dq = pair_operands(bias, mask, transposed=False)
    tiles = tiles_for(cfg, tiles, q.dtype.itemsize, want_dbias, tuple(p for p, _ in pairs_dq))
    cw = tiles.compute_wgs
    # Per-query statistics [B, N, L], L covering whole tiles of both kernels.
    multiple = math.lcm(cw * tiles.block_q, tiles.dkdv_q)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
    delta = pad_rows(jnp.transpose(delta, (0, 2, 1)), 2, multiple)
    lse = pad_rows(lse[..., 0], 2, multiple)
    q_p, k_p, v_p, do_p = (pad_rows(x, 1, 8) for x in (q, k, v, do))
    if spec.segments:
        q_ids = pad_rows(q_seg, 1, lse.shape[2], QUERY_PAD)
        kv_multiple = math.lcm(cw * tiles.dkdv_kv, tiles.dq_kv)
        kv_ids = pad_rows(kv_seg, 1, kv_multiple, KEY_PAD)
    else:
        q_ids = kv_ids = None
    seeds = None if cfg.score.dropout_rate == 0 else jnp.reshape(seed, (1,)).astype(jnp.int32)
    dq, dbias = _dq(cfg, tiles, q_p, k_p, v_p, do_p, lse, delta, q_seg, kv_seg, q_ids, kv_ids,
                    seeds, pairs_dq, want_dbias)
    dk, dv = _dkdv(cfg, tiles, q_p, k_p, v_p, do_p, lse, delta, q_seg, kv_seg, q_ids, kv_ids,
                   seeds, pair_operands(bias, mask, transposed=True))
    S = k.shape[1]
    if want_dbias:
        return dq[:, :T], dk[:, :S], dv[:, :S], dbias[:, :, :T, :S]
    return dq[:, :T], dk[:, :S], dv[:, :S]


# --------------------------------------------------------------------------
# The walk of a compute warpgroup, shared by both kernels
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """What one kernel does in a walked step ``t`` (its ring slots ``t % stages``), in
    the order :func:`walk` issues it.

    Attributes:
      products: ``products(t, s_ref, dp_ref)`` issues ``s`` and ``dp`` (two ``wgmma``
        commit groups) into the two float32 accumulators, after waiting for the
        step's operands to land.
      grads: ``grads(position, t, s, dp, masked)`` the elementwise work on the
        products (released operands it no longer needs): the tuple of 16-bit left
        operands of the accumulating products.
      accumulate: ``accumulate(t, acc_refs, operands)`` issues the accumulating
        products (one ``wgmma`` commit group per accumulator).
      done: ``done(t)`` releases the step's ring slots once those have run.
      tile: ``[rows, walked]`` of ``s`` and ``dp``.
    """

    products: Callable
    grads: Callable
    accumulate: Callable
    done: Callable
    tile: tuple[int, int]


def walk(loops: Callable, count, first, step: Step, accs: tuple, sched: Schedule,
         stages: int) -> tuple:
    """A compute warpgroup's walk of the backward: ``loops(body, carry, skip_first)``
    runs ``carry = body(position, t, carry, masked)`` over the ``count`` walked steps
    (``t`` from 0; the first, at ``first``, left out with ``skip_first``); returns
    the float32 accumulators ``accs`` after every step.

    ``stages=1``: step t issues its ``s`` and ``dp``, waits, runs its elementwise
    work, then (in its turn) its accumulating products, and waits for them before
    step t+1 issues (the fewest registers: nothing of step t is alive in step
    t+1's). ``stages=2`` (FlashAttention-3's pipeline inside a warpgroup, section
    3.2): step t issues its ``s`` and ``dp`` and step t-1's accumulating products
    together, waits for the first two only (``wgmma.wait_group`` with the
    accumulating groups left), runs its elementwise work while those run, then
    waits for them; the first step's products and the last step's accumulation
    stand alone. With ``sched`` (two compute warpgroups taking turns) each
    warpgroup issues in its turn and meets the other after issuing and after its
    elementwise work, so one's elementwise work runs while the other's products do
    (section 3.1, as the forward).
    """
    rows, walked = step.tile
    acc_shapes = tuple(a.shape for a in accs)
    sched.stagger()
    if stages == 1:
        def body(position, t, accs, masked):
            def issue(s_ref, dp_ref):
                step.products(t, s_ref, dp_ref)
                sched.meet()  # the other warpgroup's elementwise work runs while these do
                return s_ref[...], dp_ref[...]

            s, dp = pl.run_scoped(issue, plgpu.ACC((rows, walked), jnp.float32),
                                  plgpu.ACC((rows, walked), jnp.float32))
            operands = lax.optimization_barrier(step.grads(position, t, s, dp, masked))
            sched.arrive()
            sched.wait()
            accs = pl.run_state(lambda refs: step.accumulate(t, refs, operands))(
                tuple(plgpu.ACC.init(a) for a in accs))
            step.done(t)
            return accs

        accs = loops(body, accs, False)
    else:
        def pipelined(accs):
            def first_products(s_ref, dp_ref):
                step.products(0, s_ref, dp_ref)
                sched.meet()
                s, dp = (plgpu.wgmma_accumulator_load(r, wait_n=0) for r in (s_ref, dp_ref))
                return step.grads(first, 0, s, dp, True)

            operands = pl.run_scoped(first_products, plgpu.ACC((rows, walked), jnp.float32),
                                     plgpu.ACC((rows, walked), jnp.float32))
            operands = lax.optimization_barrier(operands)
            sched.arrive()

            def body(position, t, carry, masked):
                accs, previous = carry
                sched.wait()

                def issue(s_ref, dp_ref, *acc_refs):
                    for ref, value in zip(acc_refs, accs):
                        acc_set(ref, value)
                    step.products(t, s_ref, dp_ref)
                    step.accumulate(t - 1, acc_refs, previous)
                    sched.meet()
                    # s and dp done, the accumulating products running: the barrier keeps
                    # the elementwise work after the wait.
                    s, dp = lax.optimization_barrier(tuple(
                        plgpu.wgmma_accumulator_load(r, wait_n=len(acc_refs))
                        for r in (s_ref, dp_ref)))
                    operands = step.grads(position, t, s, dp, masked)
                    accs_new = lax.optimization_barrier(tuple(
                        plgpu.wgmma_accumulator_load(r, wait_n=0) for r in acc_refs))
                    return accs_new, operands

                accs, operands = pl.run_scoped(
                    issue, plgpu.ACC((rows, walked), jnp.float32),
                    plgpu.ACC((rows, walked), jnp.float32),
                    *(plgpu.ACC(shape, jnp.float32) for shape in acc_shapes))
                step.done(t - 1)
                accs, operands = lax.optimization_barrier((accs, operands))
                sched.arrive()
                return accs, operands

            accs, operands = loops(body, (accs, operands), True)
            last = count - 1
            sched.wait()  # the last step's accumulation, in its turn
            accs = pl.run_state(lambda refs: step.accumulate(last, refs, operands))(
                tuple(plgpu.ACC.init(a) for a in accs))
            step.done(last)
            return accs

        accs = lax.cond(count > 0, pipelined, lambda a: a, accs)
    sched.unstagger()
    return accs


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True)


# --------------------------------------------------------------------------
# dQ
# --------------------------------------------------------------------------

def _dbias_layout(cfg: Config, tiles: MosaicGPUConfig):
    """``(shape, staging SMEM)`` of the bias gradient the dQ kernel writes: float32 ``[B,
    N, T, S]`` with T padded to 8 rows and S to 8 columns (what TMA tiles), staged
    through one ``[block_q, block_kv_dq]`` tile per compute warpgroup."""
    problem, spec = cfg.problem, cfg.problem.spec
    rows, cols = pl.cdiv(spec.T, 8) * 8, pl.cdiv(spec.S, 8) * 8
    bq, bk = tiles.block_q, tiles.dq_kv
    swizzle = next(w for w in (128, 64, 32) if math.gcd(cols * 4, bk * 4) % w == 0)
    staging = plgpu.SMEM((tiles.compute_wgs, bq, bk), jnp.float32,
                         transforms=swizzle_transforms(swizzle // 4, jnp.float32))
    return (problem.batch, problem.heads, rows, cols), staging


def _dq(cfg, tiles, q, k, v, do, lse, delta, q_seg, kv_seg, q_ids, kv_ids, seeds, pairs,
        want_dbias):
    problem, spec = cfg.problem, cfg.problem.spec
    B, _, N, H = q.shape
    Hv = problem.v_dim
    bq, bk, cw, st = tiles.block_q, tiles.dq_kv, tiles.compute_wgs, tiles.max_concurrent_steps_bwd
    nprog = pl.cdiv(spec.T, cw * bq)
    table = range_table(spec, B, bq, bk, cw, q_seg, kv_seg)
    operands = [q, k, v, do, lse, delta, table]
    if spec.segments:
        operands += [q_ids, kv_ids]
    if seeds is not None:
        operands.append(seeds)
    operands += [array for _, array in pairs]
    segments = spec.segments
    ringed = sum(pair.mode != "scalar" for pair, _ in pairs)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    dbias_smem = None
    if want_dbias:
        shape, dbias_smem = _dbias_layout(cfg, tiles)
        out_shape.append(jax.ShapeDtypeStruct(shape, jnp.float32))
    scratch = dict(
        q_smem=smem((cw, bq, H), q.dtype), do_smem=smem((cw, bq, Hv), q.dtype),
        lse_smem=plgpu.SMEM((cw, bq), jnp.float32), delta_smem=plgpu.SMEM((cw, bq), jnp.float32),
        k_smem=smem((st, bk, H), q.dtype), v_smem=smem((st, bk, Hv), q.dtype),
        q_bar=plgpu.Barrier(num_arrivals=5 if segments else 4, num_barriers=cw),
        k_full=plgpu.Barrier(num_arrivals=1 + segments + ringed, num_barriers=st),
        v_full=plgpu.Barrier(num_barriers=st),
        k_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        v_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        schedule=plgpu.Barrier(num_arrivals=2) if tiles.bwd_turns == 2 else None,
        pairs_smem=tuple(pair_scratch(pair, array, bq, bk, cw, st, False) for pair, array in pairs),
        dbias_smem=dbias_smem)
    if segments:
        scratch["qseg_smem"] = plgpu.SMEM((cw, bq), jnp.int32)
        scratch["kseg_smem"] = plgpu.SMEM((st, bk), jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_dq_body, cfg=cfg, tiles=tiles, pairs=tuple(p for p, _ in pairs)),
        out_shape=out_shape, scratch_shapes=scratch,
        grid=(N, nprog, B), grid_names=("heads", "q", "batch"), num_threads=cw + 1,
        thread_name="wg", compiler_params=_compiler_params(),
        kernel_name="flash_attention_mosaic_gpu_dq")
    outs = kernel(*operands)
    return outs[0], (outs[1] if want_dbias else None)


def _dq_body(*refs, cfg: Config, tiles: MosaicGPUConfig, pairs: tuple, q_smem, do_smem,
             lse_smem, delta_smem, k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty,
             schedule, pairs_smem, dbias_smem, qseg_smem=None, kseg_smem=None):
    problem, spec, score = cfg.problem, cfg.problem.spec, cfg.score
    q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, table_gmem, *rest = refs
    qseg_gmem, kseg_gmem = (rest.pop(0), rest.pop(0)) if spec.segments else (None, None)
    seed_gmem = rest.pop(0) if score.dropout_rate > 0 else None
    bq, bk, cw = tiles.block_q, tiles.dq_kv, tiles.compute_wgs
    accesses = tuple(Access(pair, False, rest.pop(0), buf, bq, bk, cw)
                     for pair, buf in zip(pairs, pairs_smem))
    dq_gmem, *dbias_gmem = rest
    dbias_gmem = dbias_gmem[0] if dbias_gmem else None
    dtype = q_gmem.dtype
    wg = lax.axis_index("wg")
    n, b, prog = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("q")
    kh = lax.div(n, jnp.int32(problem.group))
    k_ring = Ring((k_smem, kseg_smem, *(a.smem for a in accesses)), k_full, k_empty,
                  tiles.max_concurrent_steps_bwd)
    v_ring = Ring((v_smem,), v_full, v_empty, tiles.max_concurrent_steps_bwd)

    @pl.when(wg == cw)
    def _producer():
        stream_keys(table_gmem, b, prog, n, kh, k_ring, v_ring, k_gmem, v_gmem, kseg_gmem,
                    accesses, bk, cw * bq)

    @pl.when(wg < cw)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        i = prog * cw + wg
        rows = pl.ds(i * bq, bq)
        bar = q_bar.at[wg]
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, n], q_tile, bar)
        plgpu.copy_gmem_to_smem(do_gmem.at[b, rows, n], do_tile, bar)
        plgpu.copy_gmem_to_smem(lse_gmem.at[b, n, rows], lse_smem.at[wg], bar)
        plgpu.copy_gmem_to_smem(delta_gmem.at[b, n, rows], delta_smem.at[wg], bar)
        if qseg_gmem is not None:
            plgpu.copy_gmem_to_smem(qseg_gmem.at[b, rows], qseg_smem.at[wg], bar)
        walked = Walk.read(table_gmem, b, prog, wg)
        dq0 = zeros_tile((bq, problem.head_dim))
        plgpu.barrier_wait(bar)
        lse = plgpu.load(lse_smem.at[wg], (), layout=row_layout())
        delta = plgpu.load(delta_smem.at[wg], (), layout=row_layout())
        q_ids = None if qseg_smem is None else plgpu.load(qseg_smem.at[wg], (),
                                                           layout=row_layout())
        seed = None if seed_gmem is None else seed_gmem[0]
        head = b * problem.heads + n

        def products(t, s_ref, dp_ref):  # both issued, then waited for together
            slot = k_ring.slot(t)
            k_ring.wait_full(t)
            v_ring.wait_full(t)
            plgpu.wgmma(s_ref, q_tile, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            plgpu.wgmma(dp_ref, do_tile, plgpu.transpose_ref(v_smem.at[slot], (1, 0)))

        def grads(j, t, s, dp, masked):
            slot = k_ring.slot(t)
            v_ring.release(t)
            q_seg = k_seg = None
            if masked and q_ids is not None:
                q_seg = WGMMA.expand(q_ids, s, 0)
                k_seg = WGMMA.expand(plgpu.load(kseg_smem.at[slot], (), layout=col_layout()), s, 1)
            bias = combined(accesses, b, n, slot, wg, s)
            tile = Tile(q=None, k=None, i=i, j=j, head=head, q_seg=q_seg, k_seg=k_seg, bias=bias,
                        layout=WGMMA)
            _, dscores, dbias = backward_tile(score, spec, tile, None, None, lse, delta, seed, bq,
                                              bk, masked, products=s, dp=dp)
            if dbias_gmem is not None:
                _store_dbias(dbias, dbias_smem.at[wg], dbias_gmem.at[b, n, rows, pl.ds(j * bk, bk)])
            return (dscores.astype(dtype),)

        def accumulate(t, acc_refs, operands):
            (dq_ref,), (ds16,) = acc_refs, operands
            plgpu.wgmma(dq_ref, ds16, k_smem.at[k_ring.slot(t)])

        def loops(body, carry, skip_first):
            return walked.loops(lambda j, c, masked: body(j, j - walked.lo, c, masked), carry,
                                start=walked.lo + 1 if skip_first else None)

        (dq,) = walk(loops, walked.hi - walked.lo, walked.lo,
                     Step(products, grads, accumulate, k_ring.release, (bq, bk)), (dq0,),
                     Schedule(schedule, wg), tiles.intra_wg_stages_dq)
        if dbias_gmem is not None:  # the blocks no pair of which is visible: zeros
            _zero_dbias_outside(walked, dbias_smem.at[wg], dbias_gmem.at[b, n, rows], bq, bk)
        q_tile[...] = (dq * score.scale).astype(dtype)  # the query tile's last reader is done
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_gmem.at[b, rows, n])
        plgpu.wait_smem_to_gmem(0)


# --------------------------------------------------------------------------
# dK/dV
# --------------------------------------------------------------------------

def _store_dbias(dbias, staging, dst):
    """One tile of the bias gradient, through the warpgroup's staging tile (once the TMA
    store of the previous tile has read it)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    staging[...] = dbias
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(staging, dst)


def _zero_dbias_outside(walk: Walk, staging, dst_rows, bq: int, bk: int):
    """Zero tiles of the bias gradient for the key blocks outside ``[lo, hi)``."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    staging[...] = zeros_tile((bq, bk))
    plgpu.commit_smem()
    blocks = pl.cdiv(dst_rows.shape[-1], bk)

    def zero(j, carry):
        plgpu.copy_smem_to_gmem(staging, dst_rows.at[:, pl.ds(j * bk, bk)])
        return carry

    lax.fori_loop(0, walk.lo, zero, 0)
    lax.fori_loop(walk.hi, blocks, zero, 0)


def _dkdv(cfg, tiles, q, k, v, do, lse, delta, q_seg, kv_seg, q_ids, kv_ids, seeds, pairs):
    problem, spec = cfg.problem, cfg.problem.spec
    B, _, K, H = k.shape
    Hv = problem.v_dim
    bq, bk, cw = tiles.dkdv_q, tiles.dkdv_kv, tiles.compute_wgs
    st = tiles.max_concurrent_steps_bwd
    nprog = pl.cdiv(spec.S, cw * bk)
    table = range_table(spec, B, bk, bq, cw, q_seg, kv_seg, transpose=True)
    operands = [q, k, v, do, lse, delta, table]
    segments = spec.segments
    if segments:
        operands += [q_ids, kv_ids]
    if seeds is not None:
        operands.append(seeds)
    operands += [array for _, array in pairs]
    ringed = sum(pair.mode != "scalar" for pair, _ in pairs)
    scratch = dict(
        k_smem=smem((cw, bk, H), k.dtype), v_smem=smem((cw, bk, Hv), k.dtype),
        q_smem=smem((st, bq, H), q.dtype), do_smem=smem((st, bq, Hv), q.dtype),
        lse_smem=plgpu.SMEM((st, bq), jnp.float32), delta_smem=plgpu.SMEM((st, bq), jnp.float32),
        kv_bar=plgpu.Barrier(num_arrivals=3 if segments else 2, num_barriers=cw),
        q_full=plgpu.Barrier(num_arrivals=2 + segments + ringed, num_barriers=st),
        do_full=plgpu.Barrier(num_arrivals=2, num_barriers=st),
        q_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        do_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        schedule=plgpu.Barrier(num_arrivals=2) if tiles.bwd_turns == 2 else None,
        pairs_smem=tuple(pair_scratch(pair, array, bk, bq, cw, st, True) for pair, array in pairs))
    if segments:
        scratch["kseg_smem"] = plgpu.SMEM((cw, bk), jnp.int32)
        scratch["qseg_smem"] = plgpu.SMEM((st, bq), jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_dkdv_body, cfg=cfg, tiles=tiles, pairs=tuple(p for p, _ in pairs)),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=scratch, grid=(K, nprog, B), grid_names=("heads", "kv", "batch"),
        num_threads=cw + 1, thread_name="wg", compiler_params=_compiler_params(),
        kernel_name="flash_attention_mosaic_gpu_dkdv")
    return kernel(*operands)


def _dkdv_body(*refs, cfg: Config, tiles: MosaicGPUConfig, pairs: tuple, k_smem, v_smem, q_smem,
               do_smem, lse_smem, delta_smem, kv_bar, q_full, do_full, q_empty, do_empty,
               schedule, pairs_smem, kseg_smem=None, qseg_smem=None):
    problem, spec, score = cfg.problem, cfg.problem.spec, cfg.score
    q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, table_gmem, *rest = refs
    qseg_gmem, kseg_gmem = (rest.pop(0), rest.pop(0)) if spec.segments else (None, None)
    seed_gmem = rest.pop(0) if score.dropout_rate > 0 else None
    bq, bk, cw = tiles.dkdv_q, tiles.dkdv_kv, tiles.compute_wgs
    accesses = tuple(Access(pair, True, rest.pop(0), buf, bk, bq, cw)
                     for pair, buf in zip(pairs, pairs_smem))
    dk_gmem, dv_gmem = rest
    G = problem.group
    dtype = q_gmem.dtype
    wg = lax.axis_index("wg")
    kh, b, prog = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("kv")
    q_ring = Ring((q_smem, lse_smem, qseg_smem, *(a.smem for a in accesses)), q_full, q_empty,
                  tiles.max_concurrent_steps_bwd)
    do_ring = Ring((do_smem, delta_smem), do_full, do_empty, tiles.max_concurrent_steps_bwd)

    def walk_group(walk: Walk, step, carry, skip_first: bool = False):
        """``step(g, i, t, carry, masked)`` for every query head ``kh * G + g`` of the group
        and query block ``i`` of ``[lo, hi)``; ``t`` counts the steps (``skip_first``:
        from the second)."""
        count = walk.hi - walk.lo

        def head(g, carry):
            start = walk.lo + (g == 0).astype(jnp.int32) if skip_first else None
            return walk.loops(lambda i, c, masked: step(g, i, g * count + i - walk.lo, c, masked),
                              carry, start=start)

        return lax.fori_loop(0, G, head, carry)

    @pl.when(wg == cw)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        walked = Walk.read(table_gmem, b, prog)

        def produce(g, i, t, carry, masked):
            n, rows = kh * G + g, pl.ds(i * bq, bq)
            q_ring.produce(t, (q_gmem.at[b, rows, n], lse_gmem.at[b, n, rows],
                               None if qseg_gmem is None else qseg_gmem.at[b, rows],
                               *(a.step_source(b, n, prog * cw * bk, i) for a in accesses)))
            do_ring.produce(t, (do_gmem.at[b, rows, n], delta_gmem.at[b, n, rows]))
            return carry

        walk_group(Walk(walked.lo, walked.hi, walked.lo, walked.lo), produce, 0)

    @pl.when(wg < cw)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        j = prog * cw + wg  # this warpgroup's key/value block
        keys = pl.ds(j * bk, bk)
        bar = kv_bar.at[wg]
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(k_gmem.at[b, keys, kh], k_tile, bar)
        plgpu.copy_gmem_to_smem(v_gmem.at[b, keys, kh], v_tile, bar)
        if kseg_gmem is not None:
            plgpu.copy_gmem_to_smem(kseg_gmem.at[b, keys], kseg_smem.at[wg], bar)
        walked = Walk.read(table_gmem, b, prog, wg)
        accs0 = (zeros_tile((bk, problem.v_dim)), zeros_tile((bk, problem.head_dim)))
        plgpu.barrier_wait(bar)
        k_ids = None if kseg_smem is None else plgpu.load(kseg_smem.at[wg], (),
                                                           layout=row_layout())
        seed = None if seed_gmem is None else seed_gmem[0]
        # The per-query statistics go into the products' accumulators before the
        # products are added (s^T - lse / scale, dp^T - delta), so a thread holds
        # no [bq / 4] columns of them through the elementwise work; not with a soft cap
        # (its tanh takes the raw products) or dropout (it scales dO v^T alone).
        lse_folded, delta_folded = score.softcap is None, score.dropout_rate == 0

        def columns(ref, slot):
            return plgpu.load(ref.at[slot], (), layout=col_layout())

        def products(t, s_ref, dp_ref):  # s^T and dp^T, both issued, then one wait
            slot = q_ring.slot(t)
            q_ring.wait_full(t)
            do_ring.wait_full(t)
            if lse_folded:
                shift = logsumexp_shift(columns(lse_smem, slot)) * (-1.0 / score.scale)
                acc_set(s_ref, lax.broadcast_in_dim(shift, (bk, bq), [1]))
            if delta_folded:
                acc_set(dp_ref, lax.broadcast_in_dim(-columns(delta_smem, slot), (bk, bq), [1]))
            plgpu.wgmma(s_ref, k_tile, plgpu.transpose_ref(q_smem.at[slot], (1, 0)))
            plgpu.wgmma(dp_ref, v_tile, plgpu.transpose_ref(do_smem.at[slot], (1, 0)))

        def grads(position, t, s, dp, masked):
            g, i = position
            slot = q_ring.slot(t)
            lse = None if lse_folded else columns(lse_smem, slot)
            delta = None if delta_folded else columns(delta_smem, slot)
            q_seg = k_seg = None
            if masked and k_ids is not None:
                k_seg = WGMMA.expand(k_ids, s, 0)
                q_seg = WGMMA.expand(columns(qseg_smem, slot), s, 1)
            n = kh * G + g
            tile = Tile(q=None, k=None, i=i, j=j, head=b * problem.heads + n,
                        q_seg=q_seg, k_seg=k_seg, transposed=True, layout=WGMMA,
                        bias=combined(accesses, b, n, slot, wg, s))
            p, dscores, _ = backward_tile(score, spec, tile, None, None, lse, delta, seed, bq, bk,
                                          masked, products=s, dp=dp)
            return p.astype(dtype), dscores.astype(dtype)

        def accumulate(t, acc_refs, operands):
            (dv_ref, dk_ref), (p16, ds16) = acc_refs, operands
            slot = q_ring.slot(t)
            plgpu.wgmma(dv_ref, p16, do_smem.at[slot])
            plgpu.wgmma(dk_ref, ds16, q_smem.at[slot])

        def done(t):
            do_ring.release(t)
            q_ring.release(t)

        def loops(body, carry, skip_first):
            return walk_group(walked, lambda g, i, t, c, masked: body((g, i), t, c, masked),
                              carry, skip_first)

        dv, dk = walk(loops, G * (walked.hi - walked.lo), (0, walked.lo),
                      Step(products, grads, accumulate, done, (bk, bq)), accs0,
                      Schedule(schedule, wg), tiles.intra_wg_stages_dkdv)
        k_tile[...] = (dk * score.scale).astype(dtype)  # the tiles' last readers are done
        v_tile[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_gmem.at[b, keys, kh])
        plgpu.copy_smem_to_gmem(v_tile, dv_gmem.at[b, keys, kh])
        plgpu.wait_smem_to_gmem(0)
