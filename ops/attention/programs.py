"""What each attention kernel's program does, apart from how it walks its blocks.

A program of the forward or dQ kernel owns one query block of one head and
walks key/value blocks; a program of the dK/dV kernel owns one key/value
block of one key/value head and walks (query head of its group, query
block) pairs. For each kernel this module builds a :class:`Body`: what the
program reads once (its query or key/value block, its row of the
:mod:`~ops.attention.range_table`), the ``step`` over one walked block (the
per-tile math of :mod:`ops.attention.tile_math`), the carry before the first
step and the ``finish`` that writes the outputs. How the blocks are walked,
and how one walked block is read from its Ref, is the walk's:
:mod:`ops.attention.grid_walk` (a grid axis, carries in scratch) or
:mod:`ops.attention.loop_walk` (an in-kernel loop over ``pl.ds`` slices,
carries in registers).

A walk's reader of a key/value block is ``read(ref, j, block, axis)``: block
``j`` (``block`` rows along ``axis``) of a key/value-indexed Ref.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

import pallas_core as pl
from ops.attention.config import Config
from ops.attention.range_table import BlockRange, RangeTable
from ops._tiles import dot
from ops.attention.tile_math import (LOG2E, Tile, backward_tile, div, forward_finish,
                                     forward_update, zero_rows_past)


class AuxRefs(NamedTuple):
    """The optional operands' Refs (None when absent), in kernel order."""

    bias: Any
    mask: Any
    q_seg: Any
    k_seg: Any
    sinks: Any = None  # the forward kernel's per-head sink logits (a whole float32 [N] Ref)


def split_refs(cfg: Config, refs, leading: int, sinks: bool = False):
    """``(leading refs, AuxRefs, the rest)``: a kernel's Refs are ``leading`` fixed
    inputs, the optional bias, mask, segment ids and (``sinks``: the forward
    kernel's) sink logits, then the scalar table, the outputs and the scratch."""
    refs = list(refs)
    first, rest = refs[:leading], refs[leading:]
    problem = cfg.problem
    flags = (problem.bias_full is not None, problem.mask_full is not None, problem.spec.segments,
             problem.spec.segments, sinks and cfg.score.sinks)
    aux = AuxRefs(*(rest.pop(0) if f else None for f in flags))
    return first, aux, rest


class Body(NamedTuple):
    """One kernel's program, for a walk to drive.

    Attributes:
      lo, hi: the walked blocks that can hold a visible pair, ``[lo, hi)``.
      full: ``() -> (full_lo, full_hi)``, the fully visible sub-range (read
        from the table when called, for the walks that use it).
      step: ``step(*block, carry, masked=True) -> carry`` for one walked block.
      init: the carry before the first step.
      finish: ``finish(*carry)`` writes the outputs.
      rest: the Refs after the outputs (the grid walk's scratch).
    """

    lo: Any
    hi: Any
    full: Callable
    step: Callable
    init: tuple
    finish: Callable
    rest: list


class QueryProgram(NamedTuple):
    """What a program owning query block ``i`` of head ``n``, batch ``b`` reads once."""

    i: jax.Array
    head: jax.Array  # b * N + n
    seed: jax.Array
    ranges: BlockRange  # the key/value blocks it walks
    q_seg: jax.Array | None


def query_program(cfg: Config, table_ref, qs_ref) -> QueryProgram:
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    table = RangeTable(table_ref, pl.cdiv(cfg.problem.spec.T, cfg.blocks.block_q))
    row = table.row(b, i)
    return QueryProgram(i=i, head=b * cfg.problem.heads + n, seed=table.seed, ranges=row.read(),
                        q_seg=None if qs_ref is None else qs_ref[...])


def _query_body(prog: QueryProgram, step, init, finish, rest) -> Body:
    ranges = prog.ranges
    return Body(ranges.lo, ranges.hi, lambda: (ranges.full_lo, ranges.full_hi), step, init,
                finish, rest)


def kv_tile(cfg: Config, prog: QueryProgram, q, j, k_ref, v_ref, aux: AuxRefs, read):
    """``(tile, v)`` for key/value block ``j``, read with the walk's ``read``."""
    bk = cfg.blocks.block_k
    k = read(k_ref, j, bk, 0)
    v = read(v_ref, j, bk, 0)
    k_seg = None if aux.k_seg is None else read(aux.k_seg, j, bk, 1)
    tile = Tile(q=q, k=zero_rows_past(k, j, bk, cfg.problem.spec.S), i=prog.i, j=j, head=prog.head,
                q_seg=prog.q_seg, k_seg=k_seg,
                bias=_pair_block(aux.bias, cfg.problem.bias_full, j, bk, read),
                mask=_pair_block(aux.mask, cfg.problem.mask_full, j, bk, read))
    return tile, zero_rows_past(v, j, bk, cfg.problem.spec.S)


def _pair_block(ref, full, j, block, read):
    """The ``(bq|1, bk|1)`` tile of a bias/mask Ref at key/value block ``j`` (the whole
    Ref where its key dim is broadcast)."""
    if ref is None:
        return None
    return read(ref, j, block, 1) if full[3] else ref[...]


def forward_body(cfg: Config, refs, read, stats) -> Body:
    """Forward (FA-2 Algorithm 1): carry ``(m, l, acc)``, the running max and sum
    shaped ``stats`` (see :func:`ops.attention.tile_math.forward_update`). A sink
    logit starts the carry as a key of value zero already seen (:func:`sink_carry`)."""
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    (q_ref, k_ref, v_ref), aux, (table_ref, out_ref, lse_ref, *rest) = split_refs(
        cfg, refs, 3, sinks=True)
    prog = query_program(cfg, table_ref, aux.q_seg)
    q = q_ref[...]

    def step(j, carry, masked=True):
        tile, v = kv_tile(cfg, prog, q, j, k_ref, v_ref, aux, read)
        return forward_update(cfg.score, cfg.problem.spec, carry, tile, v, prog.seed, bq, bk,
                              masked)

    def finish(m, l, acc):
        out, lse = forward_finish(m, l, acc)
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse.reshape(lse_ref.shape)

    if aux.sinks is None:
        m0, l0 = jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32)
    else:
        m0, l0 = sink_carry(aux.sinks[pl.program_id(1)], stats)
    init = (m0, l0, jnp.zeros((bq, cfg.problem.v_dim), jnp.float32))
    return _query_body(prog, step, init, finish, rest)


def sink_carry(sink, stats):
    """``(m, l)`` of an online softmax that has seen one key of logit ``sink`` (a
    float32 scalar): the running max ``sink`` in log2 units and the sum 1. Its
    value is zero, so the accumulator starts at zero as without a sink."""
    return (jnp.full(stats, sink * LOG2E, jnp.float32), jnp.ones(stats, jnp.float32))


def dq_body(cfg: Config, refs, read, want_dbias: bool, write_dbias) -> Body:
    """dQ (FA-2 Algorithm 2, the dQ half): carry ``(dq,)``. With ``want_dbias`` the
    bias gradient of each visited block is written by ``write_dbias(ref, j,
    value)``; the dbias Ref is then the first of ``rest``."""
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), aux, rest = split_refs(cfg, refs, 6)
    table_ref, dq_ref, *rest = rest
    dbias_ref = rest[0] if want_dbias else None
    prog = query_program(cfg, table_ref, aux.q_seg)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def step(j, carry, masked=True):
        (dq,) = carry
        tile, v = kv_tile(cfg, prog, q, j, k_ref, v_ref, aux, read)
        _, dscores, dbias = backward_tile(cfg.score, cfg.problem.spec, tile, v, do, lse, delta,
                                          prog.seed, bq, bk, masked)
        if dbias_ref is not None:
            write_dbias(dbias_ref, j, dbias)
        return (dq + dot(dscores.astype(tile.k.dtype), tile.k, 1, 0),)

    def finish(dq):
        dq_ref[...] = (dq * cfg.score.scale).astype(dq_ref.dtype)

    init = (jnp.zeros((bq, cfg.problem.head_dim), jnp.float32),)
    return _query_body(prog, step, init, finish, rest)


class QueryBlock(NamedTuple):
    """What the dK/dV kernel's step reads of one (query head, query block) pair."""

    q: Any
    do: Any
    lse: Any
    delta: Any
    q_seg: Any
    bias: Any
    mask: Any


def dkdv_body(cfg: Config, refs, read_q, transposed: bool) -> Body:
    """dK/dV (FA-2 Algorithm 2, the dK/dV half): carry ``(dk, dv)``; ``step(gi, i,
    carry, masked)`` for query head ``kh * G + gi`` and query block ``i``, whose
    operands the walk's ``read_q(refs, aux, n, i) -> QueryBlock`` reads.
    ``transposed``: tiles are ``[bk, bq]`` (see
    :func:`ops.attention.tile_math.backward_tile`), per-query rows ``[1, bq]``."""
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    g = cfg.problem.group
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), aux, rest = split_refs(cfg, refs, 6)
    table_ref, dk_ref, dv_ref, *rest = rest
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    table = RangeTable(table_ref, pl.cdiv(cfg.problem.spec.S, bk))
    seed = table.seed
    row = table.row(b, j)
    lo, hi = row.lo, row.hi
    k, v = k_ref[...], v_ref[...]
    k_seg = None if aux.k_seg is None else aux.k_seg[...]
    if transposed:  # per-key ids are a column
        k_seg = None if k_seg is None else k_seg.reshape(bk, 1)
    q_refs = (q_ref, do_ref, lse_ref, delta_ref)

    def step(gi, i, carry, masked=True):
        dk, dv = carry
        n = kh * g + gi
        blk = read_q(q_refs, aux, n, i)
        q = zero_rows_past(blk.q, i, bq, cfg.problem.spec.T)
        do = zero_rows_past(blk.do, i, bq, cfg.problem.spec.T)
        delta = zero_rows_past(blk.delta, i, bq, cfg.problem.spec.T, axis=1 if transposed else 0)
        tile = Tile(q=q, k=k, i=i, j=j, head=b * cfg.problem.heads + n, q_seg=blk.q_seg,
                    k_seg=k_seg,
                    bias=blk.bias, mask=blk.mask, transposed=transposed)
        p, dscores, _ = backward_tile(cfg.score, cfg.problem.spec, tile, v, do, blk.lse, delta,
                                      seed, bq, bk, masked)
        contract = 1 if transposed else 0  # the query axis of p / dscores
        dv = dv + dot(p.astype(do.dtype), do, contract, 0)
        dk = dk + dot(dscores.astype(q.dtype), q, contract, 0)
        return dk, dv

    def finish(dk, dv):
        dk_ref[...] = (dk * cfg.score.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)

    zeros = jnp.zeros((bk, cfg.problem.head_dim), jnp.float32)
    init = (zeros, zeros if cfg.problem.value_head_dim is None
            else jnp.zeros((bk, cfg.problem.v_dim), jnp.float32))
    return Body(lo, hi, lambda: (row.full_lo, row.full_hi), step, init, finish, rest)


def decode_body(cfg: Config, refs, read, stats) -> Body:
    """Split-KV decode (:mod:`ops.attention.decode`): a program owns every query row of
    one (batch, key/value head), its ``rows = T * G`` queries packed as a tile with
    row ``t * G + g`` for query ``t`` of head ``kh * G + g``, and walks a share of
    the key/value blocks in ``[lo, hi)`` (the walk picks the share). Carry and
    step are the forward's; the finish writes the share's normalized output and
    logsumexp (0 and -inf for a row that saw no key), which the merge kernel
    combines."""
    bk, g = cfg.blocks.block_k, cfg.problem.group
    (q_ref, k_ref, v_ref), aux, (table_ref, out_ref, lse_ref, *rest) = split_refs(cfg, refs, 3)
    rows = q_ref.shape[0]
    row = RangeTable(table_ref, 1).row(pl.program_id(0), 0)
    lo, hi = row.lo, row.hi
    q = q_ref[...]
    q_seg = None if aux.q_seg is None else aux.q_seg[...]

    def step(j, carry, masked=True):
        k = read(k_ref, j, bk, 0)
        v = read(v_ref, j, bk, 0)
        k_seg = None if aux.k_seg is None else read(aux.k_seg, j, bk, 1)
        q_pos = div(jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0), g)
        tile = Tile(q=q, k=zero_rows_past(k, j, bk, cfg.problem.spec.S), i=0, j=j, head=0,
                    q_seg=q_seg,
                    k_seg=k_seg, q_pos=q_pos)
        return forward_update(cfg.score, cfg.problem.spec, carry, tile,
                              zero_rows_past(v, j, bk, cfg.problem.spec.S), None, rows, bk, masked)

    def finish(m, l, acc):
        out, lse = forward_finish(m, l, acc)
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse.reshape(lse_ref.shape)

    init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((rows, cfg.problem.v_dim), jnp.float32))
    return Body(lo, hi, lambda: (lo, lo), step, init, finish, rest)
