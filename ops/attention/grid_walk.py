"""The attention kernels walking a grid axis (interpret, mosaic_tpu).

The walked blocks are the last grid axis, marked ``"arbitrary"``: each grid
step sees one walked block through its BlockSpec. The carries (running
statistics and accumulators) live in scratch, initialised under
``pl.when(step == 0)`` and finished under ``pl.when(step == last)``
(docs/pallas_core.md section 5); steps outside the program's visible range
are skipped with ``pl.when``. What a step computes is the kernel's
:class:`~ops.attention.programs.Body`.
"""
from __future__ import annotations

import jax.numpy as jnp

import pallas_core as pl
from ops.attention import programs
from ops.attention.config import Config
from ops.attention.programs import QueryBlock
from ops.attention.tile_math import div, rem


def _whole_block(ref, *_):
    """A grid step's walked block is the Ref's whole block."""
    return ref[...]


def _load(refs):
    return tuple(r[...] for r in refs)


def _store(refs, values):
    for r, x in zip(refs, values):
        r[...] = x


def _walk(body: programs.Body, scratch, t, visited, step, after_step=None):
    """Drive ``body`` over grid axis 3 (index ``t``): carries in ``scratch``,
    ``step(carry)`` where ``visited`` (a condition, or a function giving one
    when the step is staged) holds; ``after_step()`` staged after it."""
    @pl.when(t == 0)
    def _init():
        _store(scratch, body.init)

    @pl.when(visited() if callable(visited) else visited)
    def _step():
        _store(scratch, step(_load(scratch)))

    if after_step is not None:
        after_step()

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        body.finish(*_load(scratch))


def forward_kernel(*refs, cfg: Config):
    body = programs.forward_body(cfg, refs, _whole_block, stats=(cfg.blocks.block_q, 1))
    j = pl.program_id(3)
    _walk(body, body.rest, j, lambda: (j >= body.lo) & (j < body.hi),
          lambda carry: body.step(j, carry))


def dq_kernel(*refs, cfg: Config, want_dbias: bool):
    def write_dbias(ref, j, value):
        ref[...] = value

    body = programs.dq_body(cfg, refs, _whole_block, want_dbias, write_dbias)
    dbias_ref, scratch = (body.rest[0], body.rest[1:]) if want_dbias else (None, body.rest)
    j = pl.program_id(3)
    run = (j >= body.lo) & (j < body.hi)

    def skipped():
        @pl.when(jnp.logical_not(run))
        def _zeros():  # the block is written back whatever happens: make it zeros
            dbias_ref[...] = jnp.zeros(dbias_ref.shape, jnp.float32)

    _walk(body, scratch, j, run, lambda carry: body.step(j, carry),
          after_step=skipped if want_dbias else None)


def _read_query_block(refs, aux, n, i) -> QueryBlock:
    """The grid step's (query head, query block) blocks, whole."""
    q, do, lse, delta = _load(refs)
    q_seg = None if aux.q_seg is None else aux.q_seg[...]
    bias, mask = (None if r is None else r[...] for r in (aux.bias, aux.mask))
    return QueryBlock(q, do, lse, delta, q_seg, bias, mask)


def dkdv_kernel(*refs, cfg: Config):
    nq = pl.cdiv(cfg.problem.spec.T, cfg.blocks.block_q_dkv)
    body = programs.dkdv_body(cfg, refs, _read_query_block, transposed=False)
    t = pl.program_id(3)  # walks (query head of the group, query block)
    gi, i = div(t, nq), rem(t, nq)
    _walk(body, body.rest, t, lambda: (i >= body.lo) & (i < body.hi),
          lambda carry: body.step(gi, i, carry))


def decode_kernel(*refs, cfg: Config, per_split: int):
    """Split-KV decode: program ``(b, kh, s)`` walks key/value blocks ``s * per_split +
    t`` (grid axis 3, ``t < per_split``) that fall in its visible range ``[lo, hi)``
    (the BlockSpecs' static shares: a grid axis's blocks are fixed before the table
    is read)."""
    body = programs.decode_body(cfg, refs, _whole_block, stats=(refs[0].shape[0], 1))
    t = pl.program_id(3)
    j = pl.program_id(2) * per_split + t
    _walk(body, body.rest, t, lambda: (j >= body.lo) & (j < body.hi),
          lambda carry: body.step(j, carry))
