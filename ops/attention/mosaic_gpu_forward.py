"""The forward kernel of ``implementation="mosaic_gpu"``: warp-specialized flash attention
on Hopper (FlashAttention-3, Shah et al. 2024, sections 3.1-3.3).

A thread block owns ``compute_wgs * block_q`` query rows of one (batch, query
head) and is ``compute_wgs + 1`` warpgroups:

* a **producer** warpgroup (registers lowered to 40) that walks the block's
  visible key/value blocks ``[lo, hi)`` and issues their TMA copies into a
  ring of ``max_concurrent_steps`` shared-memory stages (a key and a value
  tile per stage, each with its own "full" barrier, so ``q k^T`` starts
  before the values land), waiting on each stage's "empty" barrier before
  refilling it;
* **compute** warpgroups (registers raised to 232), each with its own
  ``block_q`` query rows (one TMA copy, kept in shared memory), walking the
  same steps: ``s = q k^T`` by ``wgmma`` (the key tile read transposed), the
  mask and online softmax of :mod:`ops.attention.tile_math` on the
  accumulator registers (statistics float32, logits in log2 units, the scale
  or a soft cap's factor folded into the ``exp2``'s multiply-add when there
  is no bias), then ``acc += p v`` by ``wgmma`` from registers. With
  ``intra_wg_stages=2`` (the default) a warpgroup pipelines its own steps
  (section 3.2, :func:`_pipelined_walk`): tile j's ``q k^T`` and tile j-1's
  ``p v`` are issued together and tile j's softmax runs while ``p v`` does;
  with 1, each step's products and softmax run in turn (:func:`_serial_walk`).
  Two compute warpgroups meet at a barrier twice a step, offset by one
  meeting (:class:`~ops.attention.mosaic_gpu_tiles.Schedule`), so one's
  softmax overlaps the other's products (section 3.1).

The walk is split as the other kernels split it: the block range comes from
:func:`ops.attention.masking.block_ranges` (blocks no query of the thread
block can see are never loaded), and each compute warpgroup evaluates the
mask only outside its own fully visible sub-range (for causal attention:
only on the diagonal blocks). Causal thread blocks are launched longest
first.

Each warpgroup writes its output rows (through its query tile's shared
memory, one TMA store) and its float32 logsumexp (natural log, ``-inf`` for a
row that saw no key; the backward's residual).

Grouped-query attention: programs are per query head, their key/value head
``n // group``; the grid runs the heads of a group next to each other (the
fastest grid axis), so a key/value tile one of them loads from HBM is read by
the others from L2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from ops.attention.config import Config
from ops.attention.masking import KEY_PAD, QUERY_PAD
from ops.attention.mosaic_gpu_config import COMPUTE_REGISTERS, MosaicGPUConfig
from ops.attention.mosaic_gpu_pairs import Access, Pair, additive_mask, combined
from ops.attention.mosaic_gpu_pairs import operand as pair_operand
from ops.attention.mosaic_gpu_pairs import scratch as pair_scratch
from ops.attention.mosaic_gpu_tiles import (WGMMA, Ring, Schedule, Walk, acc_set, col_layout,
                                            range_table, row_layout, rows_vector, smem,
                                            stream_keys, zeros_tile)
from ops.attention.programs import sink_carry
from ops.attention.tile_math import (Tile, dropped, forward_finish, log2_factor, logits_log2,
                                     online_softmax)
from pallas_core import gpu as plgpu

def pad_rows(x, axis: int, multiple: int, value=0):
    """``x`` padded along ``axis`` to a multiple of ``multiple`` (TMA tiles whole arrays:
    a sequence of 16-bit tiles must be a multiple of 8 rows)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def programs(T: int, tiles: MosaicGPUConfig) -> int:
    """Thread blocks along the queries."""
    return pl.cdiv(T, tiles.block_q * tiles.compute_wgs)


def forward(cfg: Config, tiles: MosaicGPUConfig, q, k, v, q_seg, kv_seg, sinks, seed=None,
            bias=None, mask=None):
    """``(out [B, T, N, Hv] in q's dtype, lse float32 [B, N, T, 1])`` of one attention call
    (``cfg``: the call's static description, its backend "mosaic_gpu"; ``q_seg`` /
    ``kv_seg``: int32 ids with lengths folded in, or None; ``sinks``: float ``[N]``
    or None; ``seed``: the int32 dropout seed with ``cfg.score.dropout_rate > 0``;
    ``bias`` / ``mask``: 4-D ``[B', N', T', S']`` arrays (each dim 1 or full) or None,
    read as :mod:`ops.attention.mosaic_gpu_pairs` says)."""
    problem, spec = cfg.problem, cfg.problem.spec
    B, T, N, _ = q.shape
    S = k.shape[1]
    bq, bk, cw = tiles.block_q, tiles.block_kv, tiles.compute_wgs
    nprog = programs(T, tiles)
    q_p, k_p, v_p = pad_rows(q, 1, 8), pad_rows(k, 1, 8), pad_rows(v, 1, 8)
    table = range_table(spec, B, bq, bk, cw, q_seg, kv_seg)
    operands = [q_p, k_p, v_p, table]
    if sinks is not None:
        operands.append(sinks.astype(jnp.float32))
    if cfg.score.dropout_rate > 0:
        operands.append(jnp.reshape(seed, (1,)).astype(jnp.int32))
    if spec.segments:
        operands += [pad_rows(q_seg, 1, nprog * cw * bq, QUERY_PAD),
                     pad_rows(kv_seg, 1, pl.cdiv(S, bk) * bk, KEY_PAD)]
    pairs = pair_operands(bias, mask, transposed=False)
    operands += [array for _, array in pairs]
    rows = nprog * cw * bq  # the logsumexp's rows: whole tiles (a TMA store per warpgroup)
    out_shape = [jax.ShapeDtypeStruct(q_p.shape[:3] + (problem.v_dim,), q.dtype),
                 jax.ShapeDtypeStruct((B, N, rows), jnp.float32)]
    kernel = plgpu.kernel(
        functools.partial(_body, cfg=cfg, tiles=tiles, has_sinks=sinks is not None,
                          pairs=tuple(pair for pair, _ in pairs)),
        out_shape=out_shape, scratch_shapes=_scratch(cfg, tiles, q.dtype, pairs),
        grid=(N, nprog, B), grid_names=("heads", "q", "batch"),
        num_threads=cw + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="flash_attention_mosaic_gpu_fwd")
    out, lse = kernel(*operands)
    return out[:, :T], lse[:, :, :T, None]


def pair_operands(bias, mask, transposed: bool) -> list:
    """``[(Pair, array)]`` of the bias and the mask (as an additive bias) present, the
    arrays as a kernel reads them (:func:`ops.attention.mosaic_gpu_pairs.operand`)."""
    found = []
    if bias is not None:
        pair = Pair.of(bias)
        found.append((pair, pair_operand(pair, bias, transposed)))
    if mask is not None:
        pair = Pair.of(mask, mask=True)
        found.append((pair, pair_operand(pair, additive_mask(mask), transposed)))
    return found


def _scratch(cfg: Config, tiles: MosaicGPUConfig, dtype, pairs) -> dict:
    problem, segments = cfg.problem, cfg.problem.spec.segments
    bq, bk, cw, st = tiles.block_q, tiles.block_kv, tiles.compute_wgs, tiles.max_concurrent_steps
    H, Hv = problem.head_dim, problem.v_dim
    ringed = sum(pair.mode != "scalar" for pair, _ in pairs)
    scratch = dict(
        q_smem=smem((cw, bq, H), dtype),
        o_smem=None if Hv == H else smem((cw, bq, Hv), dtype),
        k_smem=smem((st, bk, H), dtype),
        v_smem=smem((st, bk, Hv), dtype),
        lse_smem=plgpu.SMEM((cw, bq), jnp.float32),
        q_bar=plgpu.Barrier(num_arrivals=2 if segments else 1, num_barriers=cw),
        k_full=plgpu.Barrier(num_arrivals=1 + segments + ringed, num_barriers=st),
        v_full=plgpu.Barrier(num_barriers=st),
        k_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        v_empty=plgpu.Barrier(num_arrivals=cw, num_barriers=st),
        schedule=plgpu.Barrier(num_arrivals=2) if cw == 2 else None,
        pairs_smem=tuple(pair_scratch(pair, array, bq, bk, cw, st, False) for pair, array in pairs),
    )
    if segments:
        scratch["qseg_smem"] = plgpu.SMEM((cw, bq), jnp.int32)
        scratch["kseg_smem"] = plgpu.SMEM((st, bk), jnp.int32)
    return scratch


def _body(*refs, cfg: Config, tiles: MosaicGPUConfig, has_sinks: bool, pairs: tuple, q_smem,
          o_smem, k_smem, v_smem, lse_smem, q_bar, k_full, v_full, k_empty, v_empty, schedule,
          pairs_smem, qseg_smem=None, kseg_smem=None):
    problem, spec, score = cfg.problem, cfg.problem.spec, cfg.score
    refs = list(refs)
    q_gmem, k_gmem, v_gmem, table_gmem = refs[:4]
    rest = refs[4:]
    sinks_gmem = rest.pop(0) if has_sinks else None
    seed_gmem = rest.pop(0) if score.dropout_rate > 0 else None
    qseg_gmem, kseg_gmem = (rest.pop(0), rest.pop(0)) if spec.segments else (None, None)
    bq, bk, cw = tiles.block_q, tiles.block_kv, tiles.compute_wgs
    accesses = tuple(Access(pair, False, rest.pop(0), buf, bq, bk, cw)
                     for pair, buf in zip(pairs, pairs_smem))
    out_gmem, lse_gmem = rest
    dtype = q_gmem.dtype

    wg = lax.axis_index("wg")
    n, b = lax.axis_index("heads"), lax.axis_index("batch")
    prog = lax.axis_index("q")
    if spec.causal:  # the longest walks first
        prog = programs(spec.T, tiles) - 1 - prog
    kh = lax.div(n, jnp.int32(problem.group))
    k_ring = Ring((k_smem, kseg_smem, *(a.smem for a in accesses)), k_full, k_empty,
                  tiles.max_concurrent_steps)
    v_ring = Ring((v_smem,), v_full, v_empty, tiles.max_concurrent_steps)

    @pl.when(wg == cw)
    def _producer():
        stream_keys(table_gmem, b, prog, n, kh, k_ring, v_ring, k_gmem, v_gmem, kseg_gmem,
                    accesses, bk, cw * bq)

    @pl.when(wg < cw)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        i = prog * cw + wg  # this warpgroup's query block
        rows = pl.ds(i * bq, bq)
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, n], q_tile, q_bar.at[wg])
        if qseg_gmem is not None:
            plgpu.copy_gmem_to_smem(qseg_gmem.at[b, rows], qseg_smem.at[wg], q_bar.at[wg])
        walk = Walk.read(table_gmem, b, prog, wg)
        if sinks_gmem is None:
            m0, l0 = rows_vector(-jnp.inf, bq), rows_vector(0.0, bq)
        else:
            m0, l0 = (plgpu.layout_cast(x, row_layout())
                      for x in sink_carry(sinks_gmem[n], (bq,)))
        acc0 = zeros_tile((bq, problem.v_dim))
        seed = None if seed_gmem is None else seed_gmem[0]
        head = b * problem.heads + n  # the dropout hash's head coordinate
        plgpu.barrier_wait(q_bar.at[wg])
        q_ids = None if qseg_smem is None else plgpu.load(qseg_smem.at[wg], (),
                                                           layout=row_layout())
        sched = Schedule(schedule, wg)

        def tile_of(j, slot, s, masked):
            """Tile ``j`` with what its softmax reads from the ring's ``slot`` (the bias,
            the key ids), so the slot may be released after."""
            q_seg = k_seg = None
            if masked and q_ids is not None:
                q_seg = WGMMA.expand(q_ids, s, 0)
                k_seg = WGMMA.expand(plgpu.load(kseg_smem.at[slot], (), layout=col_layout()), s, 1)
            bias = combined(accesses, b, n, slot, wg, s)
            return Tile(q=None, k=None, i=i, j=j, head=head, q_seg=q_seg, k_seg=k_seg, bias=bias,
                        layout=WGMMA)

        def probabilities(tile, s, m, l, masked):
            """The online-softmax step on the products ``s``: ``(m, l, p16, alpha)``."""
            s, _ = logits_log2(score, spec, tile, bq, bk, masked=masked, scaled=False, products=s,
                               fold_cap=True)
            m, l, p, alpha = online_softmax(m, l, s, log2_factor(score, tile, fold_cap=True), WGMMA)
            p = dropped(score, tile, seed, p, bq, bk)  # after the statistics, as forward_update
            return m, l, p.astype(dtype), alpha

        sched.stagger()
        if tiles.intra_wg_stages == 2:
            m, l, acc = lax.cond(walk.hi > walk.lo, lambda c: _pipelined_walk(
                c, walk, k_ring, v_ring, sched, q_tile, k_smem, v_smem, tile_of, probabilities),
                lambda c: c, (m0, l0, acc0))
        else:
            m, l, acc = _serial_walk((m0, l0, acc0), walk, k_ring, v_ring, sched, q_tile, k_smem,
                                     v_smem, tile_of, probabilities)
        sched.unstagger()
        out, lse = forward_finish(m, l, acc, WGMMA)
        o_tile = q_tile if o_smem is None else o_smem.at[wg]
        o_tile[...] = out.astype(dtype)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_tile, out_gmem.at[b, rows, n])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem.at[b, n, rows])
        plgpu.wait_smem_to_gmem(0)


def _serial_walk(carry, walk: Walk, k_ring: Ring, v_ring: Ring, sched: Schedule, q_tile, k_smem,
                 v_smem, tile_of, probabilities):
    """One compute warpgroup's walk, each tile's ``q k^T``, softmax and ``p v`` in turn
    (``intra_wg_stages=1``); with two warpgroups, one's softmax runs while the other's
    products do (:class:`~ops.attention.mosaic_gpu_tiles.Schedule`)."""
    bq, bk = q_tile.shape[0], k_smem.shape[1]

    @pl.when(walk.hi > walk.lo)
    def _():
        k_ring.wait_full(0)

    def step(j, carry, masked):
        m, l, acc = carry
        t = j - walk.lo
        slot = k_ring.slot(t)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_tile, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            sched.meet()  # the other warpgroup's softmax runs while this product does
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
        tile = tile_of(j, slot, s, masked)
        k_ring.release(t)
        m, l, p16, alpha = probabilities(tile, s, m, l, masked)
        acc = acc * WGMMA.expand(alpha, acc, 0)
        # Statistics and rescale before the meeting: the other warpgroup's products
        # start once this softmax is done.
        m, l, acc, p16 = lax.optimization_barrier((m, l, acc, p16))
        sched.arrive()
        v_ring.wait_full(t)
        sched.wait()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

            @pl.when(j + 1 < walk.hi)
            def _():
                k_ring.wait_full(t + 1)  # while the product runs

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        v_ring.release(t)
        return m, l, acc

    return walk.loops(step, carry)


def _pipelined_walk(carry, walk: Walk, k_ring: Ring, v_ring: Ring, sched: Schedule, q_tile,
                    k_smem, v_smem, tile_of, probabilities):
    """One compute warpgroup's walk of a non-empty ``[lo, hi)`` with FlashAttention-3's
    two-stage pipeline inside the warpgroup (section 3.2, ``intra_wg_stages=2``).

    Step ``j`` issues ``s_j = q k_j^T`` into a fresh accumulator and then ``acc +=
    p_{j-1} v_{j-1}`` (two ``wgmma`` commit groups), waits for the first group only
    (``wgmma.wait_group 1``), runs tile ``j``'s softmax while ``p v`` is still on the
    tensor cores, then waits for it and rescales ``acc`` by tile ``j``'s factor. The
    first tile's ``q k^T`` and the last tile's ``p v`` stand alone (prologue and
    epilogue). With two warpgroups the ping-pong schedule holds as in the serial
    walk: each issues its products in its turn and meets the other after issuing and
    after its softmax (:class:`~ops.attention.mosaic_gpu_tiles.Schedule`), so one's
    softmax also overlaps the other's products (section 3.1).
    """
    m, l, acc = carry
    bq, bk = q_tile.shape[0], k_smem.shape[1]

    def k_transposed(slot):
        return plgpu.transpose_ref(k_smem.at[slot], (1, 0))

    # Prologue: the first tile's products and softmax (masked: a fully visible tile
    # masks to itself).
    k_ring.wait_full(0)
    slot0 = k_ring.slot(0)

    def first(s_ref):
        plgpu.wgmma(s_ref, q_tile, k_transposed(slot0))
        sched.meet()
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=0)
        tile = tile_of(walk.lo, slot0, s, True)
        k_ring.release(0)
        return probabilities(tile, s, m, l, True)

    m, l, p16, _ = pl.run_scoped(first, plgpu.ACC((bq, bk), jnp.float32))
    m, l, p16 = lax.optimization_barrier((m, l, p16))
    sched.arrive()

    def step(j, carry, masked):
        m, l, acc, p16 = carry
        t = j - walk.lo
        slot, prev = k_ring.slot(t), k_ring.slot(t - 1)
        k_ring.wait_full(t)
        sched.wait()

        def products(s_ref, acc_ref):
            acc_set(acc_ref, acc)
            plgpu.wgmma(s_ref, q_tile, k_transposed(slot))
            v_ring.wait_full(t - 1)
            plgpu.wgmma(acc_ref, p16, v_smem.at[prev])
            sched.meet()  # the other warpgroup's softmax runs while these products do
            # q k^T done, p v running; the barrier keeps the softmax after the wait.
            s = lax.optimization_barrier(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
            tile = tile_of(j, slot, s, masked)
            k_ring.release(t)
            m_new, l_new, p16_new, alpha = probabilities(tile, s, m, l, masked)
            acc_new = lax.optimization_barrier(plgpu.wgmma_accumulator_load(acc_ref, wait_n=0))
            return m_new, l_new, p16_new, alpha, acc_new

        m, l, p16, alpha, acc = pl.run_scoped(products, plgpu.ACC((bq, bk), jnp.float32),
                                              plgpu.ACC(acc.shape, jnp.float32))
        v_ring.release(t - 1)
        acc = acc * WGMMA.expand(alpha, acc, 0)
        m, l, acc, p16 = lax.optimization_barrier((m, l, acc, p16))
        sched.arrive()
        return m, l, acc, p16

    m, l, acc, p16 = walk.loops(step, (m, l, acc, p16), start=walk.lo + 1)
    # Epilogue: the last tile's p v.
    last = walk.hi - 1 - walk.lo
    sched.wait()

    def pv(acc_ref):
        v_ring.wait_full(last)
        plgpu.wgmma(acc_ref, p16, v_smem.at[k_ring.slot(last)])

    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    v_ring.release(last)
    return m, l, acc
