"""The backward kernels of ``implementation="mosaic_gpu"``: dQ and dK/dV on ``wgmma``
(FlashAttention-2, Dao 2023, Algorithm 2, split in two kernels; the warpgroup
structure of FlashAttention-3, Shah et al. 2024, section 3).

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
  intermediate, no atomics.

Nothing is accumulated across thread blocks, so the gradients are
bit-for-bit deterministic. Both kernels walk only the blocks the masks let
through (:func:`~ops.attention.mosaic_gpu_tiles.range_table`, transposed for
dK/dV) and evaluate the mask only off each warpgroup's fully visible range.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention.config import Config
from ops.attention.masking import KEY_PAD, QUERY_PAD
from ops.attention.mosaic_gpu_config import MosaicGPUConfig
from ops.attention.mosaic_gpu_forward import (COMPUTE_REGISTERS, PRODUCER_REGISTERS, pad_rows)
from ops.attention.mosaic_gpu_tiles import (WGMMA, Ring, Walk, col_layout, range_table,
                                            row_layout, smem, zeros_tile)
from ops.attention.tile_math import Tile, backward_tile
from pallas_core import gpu as plgpu


def dkdv_accumulator_registers(tiles: MosaicGPUConfig, head_dim: int, v_dim: int) -> int:
    """float32 registers per thread of the dK/dV kernel's two accumulators."""
    return tiles.dkdv_kv * (head_dim + v_dim) // 128


def backward(cfg: Config, tiles: MosaicGPUConfig, q, k, v, q_seg, kv_seg, out, lse, do,
             seed=None):
    """``(dq, dk, dv)`` in q's, k's and v's shapes and dtypes, from the forward's ``out``
    and float32 ``lse [B, N, T, 1]``, the cotangent ``do`` and (with dropout) the int32
    seed the forward drew its keep bits with."""
    spec = cfg.problem.spec
    T = q.shape[1]
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
    dq = _dq(cfg, tiles, q_p, k_p, v_p, do_p, lse, delta, q_seg, kv_seg, q_ids, kv_ids, seeds)
    dk, dv = _dkdv(cfg, tiles, q_p, k_p, v_p, do_p, lse, delta, q_seg, kv_seg, q_ids, kv_ids,
                   seeds)
    S = k.shape[1]
    return dq[:, :T], dk[:, :S], dv[:, :S]


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True)


# --------------------------------------------------------------------------
# dQ
# --------------------------------------------------------------------------

def _dq(cfg, tiles, q, k, v, do, lse, delta, q_seg, kv_seg, q_ids, kv_ids, seeds):
    problem, spec = cfg.problem, cfg.problem.spec
    B, _, N, H = q.shape
    Hv = problem.v_dim
    bq, bk, cw, st = tiles.block_q, tiles.dq_kv, tiles.compute_wgs, tiles.max_concurrent_steps
    nprog = pl.cdiv(spec.T, cw * bq)
    table = range_table(spec, B, bq, bk, cw, q_seg, kv_seg)
    operands = [q, k, v, do, lse, delta, table]
    if spec.segments:
        operands += [q_ids, kv_ids]
    if seeds is not None:
        operands.append(seeds)
    segments = spec.segments
    scratch = dict(
        q_smem=smem((cw, bq, H), q.dtype), do_smem=smem((cw, bq, Hv), q.dtype),
        lse_smem=plgpu.SMEM((cw, bq), jnp.float32), delta_smem=plgpu.SMEM((cw, bq), jnp.float32),
        k_smem=smem((st, bk, H), q.dtype), v_smem=smem((st, bk, Hv), q.dtype),
        q_bar=plgpu.Barrier(num_arrivals=5 if segments else 4, num_barriers=cw),
        k_full=plgpu.Barrier(num_arrivals=2 if segments else 1, num_barriers=st),
        v_full=plgpu.Barrier(num_barriers=st),
        k_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        v_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st))
    if segments:
        scratch["qseg_smem"] = plgpu.SMEM((cw, bq), jnp.int32)
        scratch["kseg_smem"] = plgpu.SMEM((st, bk), jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_dq_body, cfg=cfg, tiles=tiles),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), scratch_shapes=scratch,
        grid=(N, nprog, B), grid_names=("heads", "q", "batch"), num_threads=cw + 1,
        thread_name="wg", compiler_params=_compiler_params(),
        kernel_name="flash_attention_mosaic_gpu_dq")
    return kernel(*operands)


def _dq_body(*refs, cfg: Config, tiles: MosaicGPUConfig, q_smem, do_smem, lse_smem, delta_smem,
             k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty, qseg_smem=None,
             kseg_smem=None):
    problem, spec, score = cfg.problem, cfg.problem.spec, cfg.score
    q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, table_gmem, *rest = refs
    qseg_gmem, kseg_gmem = (rest.pop(0), rest.pop(0)) if spec.segments else (None, None)
    seed_gmem = rest.pop(0) if score.dropout_rate > 0 else None
    (dq_gmem,) = rest
    bq, bk, cw = tiles.block_q, tiles.dq_kv, tiles.compute_wgs
    dtype = q_gmem.dtype
    wg = lax.axis_index("wg")
    n, b, prog = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("q")
    kh = lax.div(n, jnp.int32(problem.group))
    k_ring = Ring((k_smem, kseg_smem), k_full, k_empty, tiles.max_concurrent_steps)
    v_ring = Ring((v_smem,), v_full, v_empty, tiles.max_concurrent_steps)

    @pl.when(wg == cw)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        walk = Walk.read(table_gmem, b, prog)

        @pl.loop(walk.lo, walk.hi)
        def _(j):
            t, keys = j - walk.lo, pl.ds(j * bk, bk)
            k_ring.produce(t, (k_gmem.at[b, keys, kh],
                               None if kseg_gmem is None else kseg_gmem.at[b, keys]))
            v_ring.produce(t, (v_gmem.at[b, keys, kh],))

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
        walk = Walk.read(table_gmem, b, prog, wg)
        dq0 = zeros_tile((bq, problem.head_dim))
        plgpu.barrier_wait(bar)
        lse = plgpu.load(lse_smem.at[wg], (), layout=row_layout())
        delta = plgpu.load(delta_smem.at[wg], (), layout=row_layout())
        q_ids = None if qseg_smem is None else plgpu.load(qseg_smem.at[wg], (),
                                                           layout=row_layout())
        seed = None if seed_gmem is None else seed_gmem[0]
        head = b * problem.heads + n

        def step(j, dq, masked):
            t = j - walk.lo
            slot = k_ring.slot(t)
            k_ring.wait_full(t)
            v_ring.wait_full(t)

            def products(s_ref, dp_ref):  # both issued, then one wait
                plgpu.wgmma(s_ref, q_tile, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                plgpu.wgmma(dp_ref, do_tile, plgpu.transpose_ref(v_smem.at[slot], (1, 0)))
                return s_ref[...], dp_ref[...]

            s, dp = pl.run_scoped(products, plgpu.ACC((bq, bk), jnp.float32),
                                  plgpu.ACC((bq, bk), jnp.float32))
            v_ring.release(t)
            q_seg = k_seg = None
            if masked and q_ids is not None:
                q_seg = WGMMA.expand(q_ids, s, 0)
                k_seg = WGMMA.expand(plgpu.load(kseg_smem.at[slot], (), layout=col_layout()), s, 1)
            tile = Tile(q=None, k=None, i=i, j=j, head=head, q_seg=q_seg, k_seg=k_seg,
                        layout=WGMMA)
            _, dscores, _ = backward_tile(score, spec, tile, None, None, lse, delta, seed, bq, bk,
                                          masked, products=s, dp=dp)
            ds16 = dscores.astype(dtype)

            def dsk(acc_ref):
                plgpu.wgmma(acc_ref, ds16, k_smem.at[slot])

            dq = pl.run_state(dsk)(plgpu.ACC.init(dq))
            k_ring.release(t)
            return dq

        dq = walk.loops(step, dq0)
        q_tile[...] = (dq * score.scale).astype(dtype)  # the query tile's last reader is done
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_gmem.at[b, rows, n])
        plgpu.wait_smem_to_gmem(0)


# --------------------------------------------------------------------------
# dK/dV
# --------------------------------------------------------------------------

def _dkdv(cfg, tiles, q, k, v, do, lse, delta, q_seg, kv_seg, q_ids, kv_ids, seeds):
    problem, spec = cfg.problem, cfg.problem.spec
    B, _, K, H = k.shape
    Hv = problem.v_dim
    bq, bk, cw, st = tiles.dkdv_q, tiles.dkdv_kv, tiles.compute_wgs, tiles.max_concurrent_steps
    nprog = pl.cdiv(spec.S, cw * bk)
    table = range_table(spec, B, bk, bq, cw, q_seg, kv_seg, transpose=True)
    operands = [q, k, v, do, lse, delta, table]
    segments = spec.segments
    if segments:
        operands += [q_ids, kv_ids]
    if seeds is not None:
        operands.append(seeds)
    scratch = dict(
        k_smem=smem((cw, bk, H), k.dtype), v_smem=smem((cw, bk, Hv), k.dtype),
        q_smem=smem((st, bq, H), q.dtype), do_smem=smem((st, bq, Hv), q.dtype),
        lse_smem=plgpu.SMEM((st, bq), jnp.float32), delta_smem=plgpu.SMEM((st, bq), jnp.float32),
        kv_bar=plgpu.Barrier(num_arrivals=3 if segments else 2, num_barriers=cw),
        q_full=plgpu.Barrier(num_arrivals=3 if segments else 2, num_barriers=st),
        do_full=plgpu.Barrier(num_arrivals=2, num_barriers=st),
        q_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        do_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st))
    if segments:
        scratch["kseg_smem"] = plgpu.SMEM((cw, bk), jnp.int32)
        scratch["qseg_smem"] = plgpu.SMEM((st, bq), jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_dkdv_body, cfg=cfg, tiles=tiles),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=scratch, grid=(K, nprog, B), grid_names=("heads", "kv", "batch"),
        num_threads=cw + 1, thread_name="wg", compiler_params=_compiler_params(),
        kernel_name="flash_attention_mosaic_gpu_dkdv")
    return kernel(*operands)


def _dkdv_body(*refs, cfg: Config, tiles: MosaicGPUConfig, k_smem, v_smem, q_smem, do_smem,
               lse_smem, delta_smem, kv_bar, q_full, do_full, q_empty, do_empty, kseg_smem=None,
               qseg_smem=None):
    problem, spec, score = cfg.problem, cfg.problem.spec, cfg.score
    q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, table_gmem, *rest = refs
    qseg_gmem, kseg_gmem = (rest.pop(0), rest.pop(0)) if spec.segments else (None, None)
    seed_gmem = rest.pop(0) if score.dropout_rate > 0 else None
    dk_gmem, dv_gmem = rest
    bq, bk, cw = tiles.dkdv_q, tiles.dkdv_kv, tiles.compute_wgs
    G = problem.group
    dtype = q_gmem.dtype
    wg = lax.axis_index("wg")
    kh, b, prog = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("kv")
    q_ring = Ring((q_smem, lse_smem, qseg_smem), q_full, q_empty, tiles.max_concurrent_steps)
    do_ring = Ring((do_smem, delta_smem), do_full, do_empty, tiles.max_concurrent_steps)

    def walk_group(walk: Walk, step, carry):
        """``step(g, i, t, carry, masked)`` for every query head ``kh * G + g`` of the group
        and query block ``i`` of ``[lo, hi)``; ``t`` counts the steps."""
        count = walk.hi - walk.lo

        def head(g, carry):
            return walk.loops(lambda i, c, masked: step(g, i, g * count + i - walk.lo, c, masked),
                              carry)

        return lax.fori_loop(0, G, head, carry)

    @pl.when(wg == cw)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        walk = Walk.read(table_gmem, b, prog)

        def produce(g, i, t, carry, masked):
            n, rows = kh * G + g, pl.ds(i * bq, bq)
            q_ring.produce(t, (q_gmem.at[b, rows, n], lse_gmem.at[b, n, rows],
                               None if qseg_gmem is None else qseg_gmem.at[b, rows]))
            do_ring.produce(t, (do_gmem.at[b, rows, n], delta_gmem.at[b, n, rows]))
            return carry

        walk_group(Walk(walk.lo, walk.hi, walk.lo, walk.lo), produce, 0)

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
        walk = Walk.read(table_gmem, b, prog, wg)
        carry0 = (zeros_tile((bk, problem.head_dim)), zeros_tile((bk, problem.v_dim)))
        plgpu.barrier_wait(bar)
        k_ids = None if kseg_smem is None else plgpu.load(kseg_smem.at[wg], (),
                                                           layout=row_layout())
        seed = None if seed_gmem is None else seed_gmem[0]

        def step(g, i, t, carry, masked):
            dk, dv = carry
            slot = q_ring.slot(t)
            q_ring.wait_full(t)
            do_ring.wait_full(t)

            def products(s_ref, dp_ref):  # s^T and dp^T, both issued, then one wait
                plgpu.wgmma(s_ref, k_tile, plgpu.transpose_ref(q_smem.at[slot], (1, 0)))
                plgpu.wgmma(dp_ref, v_tile, plgpu.transpose_ref(do_smem.at[slot], (1, 0)))
                return s_ref[...], dp_ref[...]

            s, dp = pl.run_scoped(products, plgpu.ACC((bk, bq), jnp.float32),
                                  plgpu.ACC((bk, bq), jnp.float32))
            lse = plgpu.load(lse_smem.at[slot], (), layout=col_layout())
            delta = plgpu.load(delta_smem.at[slot], (), layout=col_layout())
            q_seg = k_seg = None
            if masked and k_ids is not None:
                k_seg = WGMMA.expand(k_ids, s, 0)
                q_seg = WGMMA.expand(plgpu.load(qseg_smem.at[slot], (), layout=col_layout()), s, 1)
            tile = Tile(q=None, k=None, i=i, j=j, head=b * problem.heads + kh * G + g,
                        q_seg=q_seg, k_seg=k_seg, transposed=True, layout=WGMMA)
            p, dscores, _ = backward_tile(score, spec, tile, None, None, lse, delta, seed, bq, bk,
                                          masked, products=s, dp=dp)
            p16, ds16 = p.astype(dtype), dscores.astype(dtype)

            def accumulate(refs):
                dv_ref, dk_ref = refs
                plgpu.wgmma(dv_ref, p16, do_smem.at[slot])
                plgpu.wgmma(dk_ref, ds16, q_smem.at[slot])

            dv, dk = pl.run_state(accumulate)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
            do_ring.release(t)
            q_ring.release(t)
            return dk, dv

        dk, dv = walk_group(walk, step, carry0)
        k_tile[...] = (dk * score.scale).astype(dtype)  # the tiles' last readers are done
        v_tile[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_gmem.at[b, keys, kh])
        plgpu.copy_smem_to_gmem(v_tile, dv_gmem.at[b, keys, kh])
        plgpu.wait_smem_to_gmem(0)
