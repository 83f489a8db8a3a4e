"""``python -m benchmarks.static``: the static performance gate (docs/design.md §7.4).

Every op's Triton kernels, at model sizes, compiled ahead of time for
``sm_90`` on this host (Triton's own ptxas; no GPU needed), and, for the
memory-bound ones, run once in Triton's interpreter on one program's rows to
count their global-memory traffic. Per kernel it reports:

* registers per thread and spilled bytes (``ptxas -v``), shared memory;
* ``wgmma.mma_async`` (Hopper's asynchronous tensor-core MMA), ``mma.sync``
  (the pre-Hopper one), ``cp.async`` (pipelined global->shared copies) and
  ``cp.async.bulk.tensor`` (TMA) instruction counts in the PTX;
* static ``ld.global`` / ``st.global`` instruction counts;
* SASS instructions (``nvdisasm``, :mod:`pallas_core.triton.sass`): in the
  whole kernel, and per iteration of each loop (what a thread issues per
  key/value block of attention, per K step of a matmul), in address order;
* reads and writes per element (:mod:`benchmarks.traffic`): how many times
  the kernel touches each element it touches; for a memory-bound kernel this
  is its number of passes over HBM (L2 aside).

A kernel fails the gate (:func:`violations`) on a register spill, shared
memory over the target's limit, a ``tt.dot`` of 16-bit operands that did not
become ``wgmma`` or any ``mma.sync`` beside such dots on sm_90, a
memory-bound kernel reading its input more often than its design states
(:attr:`GateCase.design_reads`), or a committed :class:`Budget` overrun
(:data:`BUDGETS`: instructions per loop iteration, registers, instructions
in the kernel, TMA present), each budget with its reason. The shipped GPU
configurations are the heuristics' and every entry of the packaged tuning
cache for the target's GPUs (:data:`ops.tuning.targets.TARGET_DEVICE_KINDS`).

Writes ``benchmarks/results/static_<target>.md`` and ``.json``; exits 1 when
any kernel fails. ``--quick``: the CI subset (:func:`quick_cases`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

import ops
import ops.tuning as tuning
import pallas_core as pl
from benchmarks.traffic import count_traffic
from pallas_core.triton import sass
from ops.matmul.config import MatmulConfig
from ops.reduction import _rows
from ops.reduction.norms import default_block_rows
from ops.tuning import search
from ops.tuning.targets import TARGET_DEVICE_KINDS, smem_limit

RESULTS_ROOT = Path(__file__).resolve().parent / "results"

ROW_FEATURES = (4096, 32768, 128256)  # rows of model widths: hidden sizes and a 128k vocabulary
ROWS = 4096


@dataclasses.dataclass(frozen=True)
class GateCase:
    """One op call whose kernels the gate compiles.

    Attributes:
      name: ``op/variant/shape/dtype/pass``.
      fn: the function (jax.grad for backward cases), traced with ``args``.
      args: ``jax.ShapeDtypeStruct`` arguments at model size.
      traffic_args: for memory-bound cases, the same call on one program's
        rows (concrete random arrays), run in the interpreter to count traffic;
        None: not counted (compute-bound).
      design_reads: kernel name -> reads per element its design states; a
        kernel not listed is not checked for traffic.
      device_kind: the device kind lookups see while compiling (a shipped
        tuned config's), or None for the heuristics.
      step_elements: for memory-bound cases, the input elements one program
        handles per loop step (rows per program x chunk width; a whole row
        block when there is no loop): instructions per element divide by it.
      itemsize: bytes per element of the input, for bytes moved per element.
    """

    name: str
    fn: Callable
    args: tuple
    traffic_args: Callable[[], tuple] | None = None
    design_reads: Mapping[str, float] = dataclasses.field(default_factory=dict)
    device_kind: str | None = None
    step_elements: int | None = None
    itemsize: int | None = None


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _random(shape, dtype, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _loss(y):
    """A scalar of every output element with a non-constant cotangent."""
    y = y.astype(jnp.float32)
    return jnp.sum(y * jnp.cos(y))


def matmul_cases(sizes=(4096, 8192), dtype=jnp.bfloat16) -> list[GateCase]:
    """fused_matmul forward at ``s^3`` with and without the bias+gelu epilogue, with the
    exact (erf) gelu at the largest size, and forward+backward with the epilogue at the
    smallest size."""
    cases = []
    for s in sizes:
        x, w, b = _sds((s, s), dtype), _sds((s, s), dtype), _sds((s,), dtype)
        cases.append(GateCase(f"fused_matmul/plain/{s}x{s}x{s}/{jnp.dtype(dtype).name}/fwd",
                              lambda x, w: ops.fused_matmul(x, w, implementation="triton"), (x, w)))
        cases.append(GateCase(
            f"fused_matmul/bias+gelu/{s}x{s}x{s}/{jnp.dtype(dtype).name}/fwd",
            lambda x, w, b: ops.fused_matmul(x, w, b, activation="gelu", implementation="triton"),
            (x, w, b)))
    s = sizes[-1]
    cases.append(GateCase(
        f"fused_matmul/bias+gelu_exact/{s}x{s}x{s}/{jnp.dtype(dtype).name}/fwd",
        lambda x, w, b: ops.fused_matmul(x, w, b, activation="gelu_exact", implementation="triton"),
        (_sds((s, s), dtype), _sds((s, s), dtype), _sds((s,), dtype))))
    s = sizes[0]
    cases.append(GateCase(
        f"fused_matmul/bias+gelu/{s}x{s}x{s}/{jnp.dtype(dtype).name}/fwd+bwd",
        jax.grad(lambda x, w, b: _loss(ops.fused_matmul(x, w, b, activation="gelu",
                                                        implementation="triton")), (0, 1, 2)),
        (_sds((s, s), dtype), _sds((s, s), dtype), _sds((s,), dtype))))
    # The tuner's 128 x 256 candidate: its epilogue in halves (MatmulConfig.epilogue_subtile).
    wide = MatmulConfig(128, 256, 64, 8, 3, 8, epilogue_subtile=2)
    cases.append(GateCase(
        f"fused_matmul/bias+gelu+128x256+subtile2/{s}x{s}x{s}/{jnp.dtype(dtype).name}/fwd+bwd",
        jax.grad(lambda x, w, b: _loss(ops.fused_matmul(x, w, b, activation="gelu", block_sizes=wide,
                                                        implementation="triton")), (0, 1, 2)),
        (_sds((s, s), dtype), _sds((s, s), dtype), _sds((s,), dtype))))
    # Float32 training on the default tiles (128 x 128 x 32): the backward steps halved
    # for 4-byte operands (ops.matmul.fused_matmul.backward_step).
    s, f32 = sizes[0], jnp.float32
    cases.append(GateCase(
        f"fused_matmul/bias+gelu/{s}x{s}x{s}/float32/fwd+bwd",
        jax.grad(lambda x, w, b: _loss(ops.fused_matmul(x, w, b, activation="gelu",
                                                        implementation="triton")), (0, 1, 2)),
        (_sds((s, s), f32), _sds((s, s), f32), _sds((s,), f32))))
    s = sizes[-1]
    cases.append(GateCase(
        f"fused_matmul/bias+gelu+128x256+subtile2+tma/{s}x{s}x{s}/{jnp.dtype(dtype).name}/fwd",
        _with_tma(lambda x, w, b: ops.fused_matmul(x, w, b, activation="gelu", block_sizes=wide,
                                                   implementation="triton")),
        (_sds((s, s), dtype), _sds((s, s), dtype), _sds((s,), dtype))))
    return cases


def _passes(features: int, dtype) -> int:
    """Reads per element of a two-pass row kernel: 1 when the row is one chunk
    (held in registers between the passes), 2 when it is walked twice."""
    rows_layout = _rows.row_layout(ROWS, features, dtype, "triton")
    return 1 if rows_layout.num_chunks == 1 else 2


def row_cases(features=ROW_FEATURES, dtype=jnp.bfloat16, ops_=("layer_norm", "rms_norm", "softmax",
                                                               "cross_entropy"),
              backward: bool = True) -> list[GateCase]:
    """Forward+backward (forward only without ``backward``) of the row-wise ops
    over ``ROWS`` rows of each width.

    Designed reads per element (the ops' docstrings): the norms and softmax
    read a row once when it fits one chunk and twice otherwise, forward and
    backward alike (statistics pass, then output pass); cross-entropy reads
    its logits once forward (online logsumexp and the label's logit in one
    pass) and once backward.
    """
    cases = []
    dt = jnp.dtype(dtype).name
    for op in ops_:
        for f in features:
            two_pass = _passes(f, dtype)
            if op == "cross_entropy":
                design = {"cross_entropy_fwd": 1, "cross_entropy_bwd": 1}
            else:
                design = {f"{op}_fwd": two_pass, f"{op}_bwd": two_pass}
            fn, args, one_program, step = _row_call(op, f, dtype, backward)
            cases.append(GateCase(f"{op}/-/{ROWS}x{f}/{dt}/{'fwd+bwd' if backward else 'fwd'}", fn,
                                  args, one_program, design, step_elements=step,
                                  itemsize=jnp.dtype(dtype).itemsize))
    return cases


def _row_call(op, features, dtype, backward):
    """``(fn, model-size args, () -> one program's concrete args, elements per loop
    step)``; fn is the gradient when ``backward``, else the forward pass."""
    problem = search.Problem(op, (ROWS, features), jnp.dtype(dtype).name)
    forward, args = problem.function()
    argnums = (0,) if op == "cross_entropy" else tuple(range(len(args)))
    fn = jax.grad(lambda *a: _loss(forward(*a)), argnums) if backward else forward
    layout = _rows.row_layout(ROWS, features, dtype, "triton")
    block_rows = layout.block_rows
    if op in ("layer_norm", "rms_norm"):
        block_rows = default_block_rows(ROWS, features, dtype, "triton")

    def one_program():
        return tuple(search.Problem(op, (block_rows, features), problem.dtype).make_inputs(
            jax.random.key(features)))

    return fn, tuple(args), one_program, block_rows * min(layout.chunk, features)


def residual_norm_cases(features: int = 4096, dtype=jnp.bfloat16) -> list[GateCase]:
    """Fused add + RMSNorm (``rms_norm(x, scale, residual=r)``), forward+backward over
    ``ROWS`` rows of ``features``. Designed traffic, rows of one chunk: the forward
    reads x and the residual once each and writes y and h once each; the backward
    reads h and both cotangents once each and writes the one gradient once."""
    dt = jnp.dtype(dtype).name

    def loss(x, r, s):
        y, h = ops.rms_norm(x, s, residual=r, implementation="triton")
        return _loss(y) + _loss(h)

    block_rows = default_block_rows(ROWS, features, dtype, "triton")
    layout = _rows.row_layout(ROWS, features, dtype, "triton")

    def one_program():
        return (_random((block_rows, features), dtype, 1), _random((block_rows, features), dtype, 2),
                _random((features,), dtype, 3))

    design = {"rms_norm_residual_fwd": 1, "rms_norm_residual_bwd": 1}
    return [GateCase(f"rms_norm/residual/{ROWS}x{features}/{dt}/fwd+bwd",
                     jax.grad(loss, (0, 1, 2)),
                     (_sds((ROWS, features), dtype), _sds((ROWS, features), dtype),
                      _sds((features,), dtype)),
                     one_program, design, step_elements=block_rows * min(layout.chunk, features),
                     itemsize=jnp.dtype(dtype).itemsize)]


def attention_cases(seq=4096, head_dims=(64, 128), dtype=jnp.bfloat16,
                    causal_modes=(False, True)) -> list[GateCase]:
    """Forward+backward flash attention, causal and not, 16 heads over 4 key/value heads."""
    cases = []
    for h in head_dims:
        for causal in causal_modes:
            def fn(q, k, v, causal=causal):
                return _loss(ops.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="triton"))
            cases.append(GateCase(
                f"dot_product_attention/{'causal' if causal else 'full'}/1x{seq}x{seq}x16x4x{h}/"
                f"{jnp.dtype(dtype).name}/fwd+bwd",
                jax.grad(fn, (0, 1, 2)),
                (_sds((1, seq, 16, h), dtype), _sds((1, seq, 4, h), dtype), _sds((1, seq, 4, h), dtype))))
    return cases


def attention_decode_cases(batch=8, context=8192, heads=32, kv_heads=4, h=128,
                           dtype=jnp.bfloat16) -> list[GateCase]:
    """Split-KV decode of ``ops.dot_product_attention`` (the split kernel and its merge):
    one query per sequence over a dense ``context``-long cache, GQA ``heads / kv_heads``;
    and causal attention with sinks, forward+backward, 16 heads over 4 at 4096."""
    dt, seq = jnp.dtype(dtype).name, 4096

    def decode(q, k, v):
        return ops.dot_product_attention(q, k, v, implementation="triton")

    def sinks(q, k, v, s):
        return _loss(ops.dot_product_attention(q, k, v, is_causal=True, sinks=s,
                                               implementation="triton"))
    cache = _sds((batch, context, kv_heads, h), dtype)
    return [GateCase(f"dot_product_attention/decode+gqa{heads // kv_heads}/"
                     f"{batch}x1x{context}x{heads}x{kv_heads}x{h}/{dt}/fwd",
                     decode, (_sds((batch, 1, heads, h), dtype), cache, cache)),
            GateCase(f"dot_product_attention/causal+sinks/1x{seq}x{seq}x16x4x{h}/{dt}/fwd+bwd",
                     jax.grad(sinks, (0, 1, 2, 3)),
                     (_sds((1, seq, 16, h), dtype), _sds((1, seq, 4, h), dtype),
                      _sds((1, seq, 4, h), dtype), _sds((16,), jnp.float32)))]


# decode_cases' ragged decode case at its default sizes (budgeted below).
RAGGED_DECODE = "ragged_paged_attention/decode+gqa8/8x8192x32x4x128/bfloat16/fwd"


def decode_cases(batch=8, context=8192, heads=32, kv_heads=4, h=128, page_size=16,
                 dtype=jnp.bfloat16) -> list[GateCase]:
    """Paged decode attention (split-KV and its merge): one query token per sequence over
    ``context`` cached tokens in pages of ``page_size``, GQA ``heads / kv_heads``; and the
    query-blocked ragged kernel on prefill chunks over the same kind of cache."""
    pages = context // page_size

    def fn(q, k, v, tables, lengths):
        return ops.paged_attention(q, k, v, tables, lengths, scale=h ** -0.5,
                                   implementation="triton")
    cache = _sds((kv_heads, batch * pages, page_size, h), dtype)

    # Chunked prefill: 4 sequences x 512 new tokens at the end of 4096-token caches, the
    # query-blocked kernel (16 tokens x 8 heads per query tile, 128-key tiles of 8 pages).
    seqs, chunk, cached = 4, 512, 4096

    def prefill(q, kv, kv_lens, tables, cu, num_seqs):
        return ops.ragged_paged_attention(q, kv, kv_lens, tables, cu, num_seqs, scale=h ** -0.5,
                                          implementation="triton")
    return [GateCase(
        f"paged_attention/decode/{batch}x{context}x{heads}x{kv_heads}x{h}/{jnp.dtype(dtype).name}/fwd",
        fn, (_sds((batch, heads, h), dtype), cache, cache, _sds((batch, pages), jnp.int32),
             _sds((batch,), jnp.int32))),
        # Decode over the same cache: one token per item of the query-blocked kernel,
        # eight 16-token pages per key tile, split-KV and its merge.
        GateCase(
        f"ragged_paged_attention/decode+gqa{heads // kv_heads}/{batch}x{context}x{heads}x"
        f"{kv_heads}x{h}/{jnp.dtype(dtype).name}/fwd", prefill,
        (_sds((batch, heads, h), dtype), _sds((batch * pages, page_size, 2 * kv_heads, h), dtype),
         _sds((batch,), jnp.int32), _sds((batch, pages), jnp.int32), _sds((batch + 1,), jnp.int32),
         _sds((1,), jnp.int32))),
        GateCase(
        f"ragged_paged_attention/prefill+gqa{heads // kv_heads}/{seqs}x{chunk}x{cached}x{heads}x"
        f"{kv_heads}x{h}/{jnp.dtype(dtype).name}/fwd",
        prefill, (_sds((seqs * chunk, heads, h), dtype),
                  _sds((seqs * cached // page_size, page_size, 2 * kv_heads, h), dtype),
                  _sds((seqs,), jnp.int32), _sds((seqs, cached // page_size), jnp.int32),
                  _sds((seqs + 1,), jnp.int32), _sds((1,), jnp.int32)))]


def decoder_op_cases(dtype=jnp.bfloat16) -> list[GateCase]:
    """Llama 3 8B's decoder ops: the rotary embedding of its queries (4 x 4096 tokens, 32
    heads of 128; one read of x, the design), and the SwiGLU MLP's gated linear unit
    (8192 tokens, 4096 -> 14336) forward and forward+backward, stacked and paired weights."""
    dt = jnp.dtype(dtype).name
    b, t, heads, h = 4, 4096, 32, 128
    inv_freq = _sds((h // 2,), jnp.float32)

    def rope(x, positions, inv_freq):
        return ops.apply_rotary_embedding(x, positions, inv_freq, implementation="triton")

    tokens = 2  # one program of the heuristic's blocks: 2 tokens x 32 heads x 128
    one_program = lambda: (_random((tokens, heads, h), dtype, 0), jnp.arange(tokens, dtype=jnp.int32),
                           ops.rope_frequencies(h)[0])
    m, k, n = 8192, 4096, 14336
    glu_args = (_sds((m, k), dtype), _sds((k, 2, n), dtype))

    def glu(x, w):
        return ops.gated_linear_unit(x, w, activation="silu", implementation="triton")

    # The pair (gate, up) as layers.GatedMLP passes it: the forward is the stacked form's
    # program (same SASS); the backward's dx sums two products per step and dw keeps two
    # accumulators (no [K, 2N] view of a pair), so they get their own row.
    pair_args = (_sds((m, k), dtype), _sds((k, n), dtype), _sds((k, n), dtype))

    return [
        GateCase(f"apply_rotary_embedding/rotate_half/{b}x{t}x{heads}x{h}/{dt}/fwd", rope,
                 (_sds((b, t, heads, h), dtype), _sds((b, t), jnp.int32), inv_freq), one_program,
                 {"rotary_embedding": 1}, step_elements=tokens * heads * h,
                 itemsize=jnp.dtype(dtype).itemsize),
        GateCase(f"gated_linear_unit/swiglu/{m}x{k}x{n}/{dt}/fwd", glu, glu_args),
        GateCase(f"gated_linear_unit/swiglu/{m}x{k}x{n}/{dt}/fwd+bwd",
                 jax.grad(lambda x, w: _loss(glu(x, w)), (0, 1)), glu_args),
        GateCase(f"gated_linear_unit/swiglu_pair/{m}x{k}x{n}/{dt}/fwd+bwd",
                 jax.grad(lambda x, g, u: _loss(glu(x, (g, u))), (0, 1, 2)), pair_args),
    ]


def moe_cases(dtype=jnp.bfloat16) -> list[GateCase]:
    """ops.ragged_dot at Mixtral 8x7B's first expert GEMM (16k tokens, top-2: 32768 rows
    over 8 experts, 4096 -> 14336): the grouped forward, and forward+backward (dlhs and
    the per-group drhs)."""
    dt = jnp.dtype(dtype).name
    m, k, n, g = 32768, 4096, 14336, 8
    args = (_sds((m, k), dtype), _sds((g, k, n), dtype), _sds((g,), jnp.int32))

    def gmm(lhs, rhs, group_sizes):
        return ops.ragged_dot(lhs, rhs, group_sizes, implementation="triton")

    return [
        GateCase(f"ragged_dot/{g}-groups/{m}x{k}x{n}/{dt}/fwd", gmm, args),
        GateCase(f"ragged_dot/{g}-groups/{m}x{k}x{n}/{dt}/fwd+bwd",
                 jax.grad(lambda a, b, s: _loss(gmm(a, b, s)), (0, 1)), args),
    ]


def _with_tma(fn: Callable) -> Callable:
    """``fn`` with the library's ``tma`` default on while it is traced (pl.triton.enable_tma)."""
    def traced(*args):
        with pl.triton.enable_tma():
            return fn(*args)
    return traced


def tma_cases(s: int = 8192, seq: int = 4096, head_dims=(64, 128), dtype=jnp.bfloat16) -> list[GateCase]:
    """The tensor-descriptor (TMA) variants of the plain matmul's and the attention forward's
    kernels (``PALLAS_CORE_TRITON_TMA=1``; off by default until a GPU run validates the launch)."""
    dt = jnp.dtype(dtype).name
    cases = [GateCase(f"fused_matmul/plain+tma/{s}x{s}x{s}/{dt}/fwd",
                      _with_tma(lambda x, w: ops.fused_matmul(x, w, implementation="triton")),
                      (_sds((s, s), dtype), _sds((s, s), dtype)))]
    m = 4096
    cases.append(GateCase(
        f"fused_matmul/bias+gelu+tma/{m}x{m}x{m}/{dt}/fwd+bwd",
        _with_tma(jax.grad(lambda x, w, b: _loss(ops.fused_matmul(x, w, b, activation="gelu",
                                                                  implementation="triton")), (0, 1, 2))),
        (_sds((m, m), dtype), _sds((m, m), dtype), _sds((m,), dtype))))
    for h in head_dims:
        cases.append(GateCase(
            f"dot_product_attention/full+tma/1x{seq}x{seq}x16x4x{h}/{dt}/fwd",
            _with_tma(lambda q, k, v: ops.dot_product_attention(q, k, v, implementation="triton")),
            (_sds((1, seq, 16, h), dtype), _sds((1, seq, 4, h), dtype), _sds((1, seq, 4, h), dtype))))
    return cases


def tuned_cases(target: str) -> list[GateCase]:
    """One case per entry of the packaged cache for ``target``'s GPUs (the shipped tuned
    configs), compiled with the entry in force."""
    kinds = TARGET_DEVICE_KINDS.get(target, ())
    cases = []
    tuned = {op.name for op in search.tuned_ops()}
    for key, _ in sorted(tuning.load(tuning.PACKAGED_CACHE).items()):
        op, impl, kind, dtype, bucket, variant = key
        if kind not in kinds or impl != "triton" or op not in tuned:
            continue  # another GPU's or backend's entry, or one of an op with no tuner call
        problem = search.Problem(op, tuple(bucket), dtype, impl)
        if dict(variant) != tuning.full_variant(op, problem.variant()):
            continue  # a variant the problem's call does not make: its entry would not apply
        fn, args = problem.function()
        cases.append(GateCase(f"{problem.name}/tuned for {kind}", fn, tuple(args), device_kind=kind))
    return cases


def all_cases(target: str = "sm_90") -> list[GateCase]:
    """The full gate: every op at model sizes and every shipped tuned config."""
    return (matmul_cases() + row_cases() + residual_norm_cases() + attention_cases()
            + attention_decode_cases()
            + decode_cases() + decoder_op_cases() + moe_cases() + tma_cases() + tuned_cases(target))


def quick_cases() -> list[GateCase]:
    """The CI subset (compiles are slow on the CI host): the tensor-core kernel with
    its epilogue, causal flash attention at head dim 64 (forward with its two
    key/value loops, dQ, dK/dV: every budget kind but TMA), and the forward pass
    of a memory-bound op whose rows take several chunks (the two-pass design)."""
    matmul = [c for c in matmul_cases(sizes=(4096,)) if c.name.startswith("fused_matmul/bias+gelu/")
              and c.name.endswith("/fwd")]
    return (matmul + attention_cases(head_dims=(64,), causal_modes=(True,))
            + row_cases(features=(32768,), ops_=("softmax",), backward=False))


# ----------------------------------------------------------------------------
# Budgets
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Budget:
    """What one kernel of one gate case may cost on sm_90, and why.

    Attributes:
      loops: the most SASS instructions per iteration of each loop, in address
        order (a kernel with a different number of loops fails: its structure
        changed and the budget needs a look).
      registers: the most registers per thread.
      instructions: the most SASS instructions in the whole kernel.
      tma: the kernel must move tiles with TMA (``cp.async.bulk.tensor``).
      reason: where the figures come from.
    """

    reason: str
    loops: tuple[int, ...] | None = None
    registers: int | None = None
    instructions: int | None = None
    tma: bool = False


def _attention_case(mode: str, h: int) -> str:
    return f"dot_product_attention/{mode}/1x4096x4096x16x4x{h}/bfloat16/fwd+bwd"


# Triton's fused-attention tutorial (06, host tensor descriptors, no warp
# specialization) compiled for sm_90 at our tiles, warps and stages (bf16,
# T = S = 4096): SASS per key/value iteration 515 (h64), 340 (h128), causal
# 516 + 717 (h64) and 338 + 447 (h128); 186 (h64) and 140 (h128) registers.
# Its causal register counts were not taken; a kernel of ours written to the
# tutorial's structure (two inlined loops, the diagonal one masked, pointer
# loads) at these tiles takes 238 (h64) and 181 (h128).
_TUTORIAL = "Triton's attention tutorial at the same tiles"
_CAUSAL_REGISTERS = ("registers: today's figure, below the {} a kernel of the tutorial's structure "
                     "takes at these tiles")
_FROZEN = "today's figure, a regression guard (no public kernel to compare with at this shape)"

BUDGETS: dict[tuple[str, str], Budget] = {
    (_attention_case("full", 64), "flash_attention_fwd"): Budget(
        f"{_TUTORIAL}: 515 per iteration, 186 registers (+16)", loops=(515,), registers=202),
    (_attention_case("causal", 64), "flash_attention_fwd"): Budget(
        f"{_TUTORIAL}: 516 + 717 per iteration (off-diagonal, diagonal); "
        + _CAUSAL_REGISTERS.format(238), loops=(516, 717), registers=229),
    (_attention_case("full", 128), "flash_attention_fwd"): Budget(
        f"{_TUTORIAL}: 340 per iteration, 140 registers (+16)", loops=(340,), registers=156),
    (_attention_case("causal", 128), "flash_attention_fwd"): Budget(
        f"{_TUTORIAL}: 338 + 447 per iteration; " + _CAUSAL_REGISTERS.format(181),
        loops=(338, 447), registers=166),
    (_attention_case("full", 64), "flash_attention_dq"): Budget(_FROZEN, loops=(414,), registers=228),
    (_attention_case("causal", 64), "flash_attention_dq"): Budget(
        _FROZEN, loops=(425, 638), registers=248),
    (_attention_case("full", 128), "flash_attention_dq"): Budget(_FROZEN, loops=(272,), registers=156),
    (_attention_case("causal", 128), "flash_attention_dq"): Budget(
        _FROZEN, loops=(272, 420), registers=166),
    # dK/dV with transposed tiles (every GEMM on wgmma): before, 262 / 316 + 263 (h64) and
    # 350 / 417 + 351 (h128) instructions per iteration with half the GEMMs on mma.sync.
    # One iteration (64 queries x 128 keys at h64, 32 x 128 at h128; 8 warps) is four GEMMs
    # of 2 * bq * 128 * H FLOPs: 4.2 MFLOP at h64 (396 instructions: 94 per MFLOP, against
    # 122 with 32-query tiles), 4.2 MFLOP at h128 (299: 71 per MFLOP).
    (_attention_case("full", 64), "flash_attention_dkdv"): Budget(_FROZEN, loops=(396,), registers=208),
    (_attention_case("causal", 64), "flash_attention_dkdv"): Budget(
        _FROZEN, loops=(510, 400), registers=242),
    (_attention_case("full", 128), "flash_attention_dkdv"): Budget(
        _FROZEN, loops=(299,), registers=212),
    (_attention_case("causal", 128), "flash_attention_dkdv"): Budget(
        _FROZEN, loops=(357, 311), registers=241),
    # The plain K loop (128 x 128 x 64, 8 warps, 3 stages): 83 instructions per step, of
    # which 8 HGMMA; the same kernel with tensor-descriptor loads (CompilerParams(tma=True))
    # takes 69, but tma stays off by default (jax_triton does not allocate the global
    # scratch in-kernel descriptors need; docs/pallas_core.md).
    **{(f"fused_matmul/plain/{s}x{s}x{s}/bfloat16/fwd", "fused_matmul"): Budget(
        "K loop and registers: " + _FROZEN + "; 69 per step with TMA loads (plain+tma)", loops=(83,),
        registers=98) for s in (4096, 8192)},
    # Tensor-descriptor (TMA) variants, PALLAS_CORE_TRITON_TMA=1 (tma_cases). Each
    # cp.async.bulk.tensor wait adds two SASS "loops" after the main one: the mbarrier
    # try-wait retry (2 instructions) and the branch from that out-of-line wait back into
    # the loop body, which spans the code between them; neither is an iteration.
    ("fused_matmul/plain+tma/8192x8192x8192/bfloat16/fwd", "fused_matmul"): Budget(
        "K loop 69 per step against 83 with cp.async (no per-step address arithmetic), 90 "
        "registers; then the TMA wait's retry (2) and its branch back (140)", loops=(69, 2, 140),
        registers=90, tma=True),
    # The backward's products with descriptors: the transposed operand's box is read
    # through a transposed shared-memory view, no per-step address arithmetic.
    ("fused_matmul/bias+gelu+tma/4096x4096x4096/bfloat16/fwd+bwd", "fused_matmul_dx"): Budget(
        "K loop 98 per step, 90 registers (cp.async: 156, 146); then the TMA wait's retry and "
        "branch back", loops=(98, 2, 161), registers=90, tma=True),
    ("fused_matmul/bias+gelu+tma/4096x4096x4096/bfloat16/fwd+bwd", "fused_matmul_dw"): Budget(
        "K loop 82 per step, 90 registers (cp.async: 145, 96); then the TMA wait's retry and "
        "branch back", loops=(82, 2, 152), registers=90, tma=True),
    # The attention forward with descriptors: batch and head fixed per program, folded into
    # 2-D descriptors made at the access (pallas_core.triton.descriptors); with 4-D boxes
    # reshaped to 2-D it took 222 / 170 registers. Pointer loads: 500 / 335 per iteration,
    # 195 / 141 registers.
    **{(f"dot_product_attention/full+tma/1x4096x4096x16x4x{h}/bfloat16/fwd", "flash_attention_fwd"): Budget(
        f"{_TUTORIAL}: {tutorial} per iteration, {regs} registers (+16; ours {ours}); then the "
        "waits' retries and branches back", loops=(tutorial, *waits), registers=regs + 16, tma=True)
       for h, tutorial, regs, ours, waits in ((64, 515, 186, "507, 189", (2, 1450, 2, 1103)),
                                              (128, 340, 140, "328, 138", (2, 1190, 2, 845)))},
    # The exact gelu's epilogue (ops.activations.gelu_exact: relu(x) - a Phi(-a), the exponent
    # carried beyond float32 and Mills' ratio as a corrected rational; 2.02 ulps over the whole
    # float32 range where products contract into FMAs) within 1.25x the same kernel with
    # libdevice's erff in 0.5 x (1 + erf(x / sqrt 2)): 2616 SASS instructions at this tile,
    # so 3270 (ours: 3256; with libdevice's erfcf, jax.nn.gelu's x erfc(-x / sqrt 2) / 2: 3968).
    ("fused_matmul/bias+gelu_exact/8192x8192x8192/bfloat16/fwd", "fused_matmul_bias_gelu_exact"): Budget(
        "1.25x the same kernel with libdevice's erff (2616 instructions): 3270; K loop: "
        + _FROZEN, loops=(83,), instructions=3270),
    # The backward's two matmuls, named apart so each K loop has its budget. dx = dz @ w^T
    # reads w transposed (156 instructions per step, 146 registers); dw = x^T @ dz reads x
    # transposed (145, 96 registers); the forward's loop, both operands in place, takes 83.
    ("fused_matmul/bias+gelu/4096x4096x4096/bfloat16/fwd+bwd", "fused_matmul_dx"): Budget(
        "K loop and registers: " + _FROZEN + "; w read transposed", loops=(156,), registers=146),
    ("fused_matmul/bias+gelu/4096x4096x4096/bfloat16/fwd+bwd", "fused_matmul_dw"): Budget(
        "K loop and registers: " + _FROZEN + "; x read transposed", loops=(145,), registers=96),
    # Float32 training at the default 128 x 128 x 32 tile: no spill (the gate fails on any).
    # dx (128 x 32 tiles) and dw (32 x 128) step 64 deep over N / M (16 KiB + 24 KiB of
    # float32 per stage, 80 KiB at 3 stages); 128 deep, as the 16-bit tiles take, dw (x
    # read transposed) spilled 1080 bytes at 255 registers (5669 SASS per 128-deep step,
    # 216 of them local loads/stores: 4680 now) and dx took 226 registers. Float32 dots
    # run on FFMA (2048 per 64-deep step), not wgmma.
    ("fused_matmul/bias+gelu/4096x4096x4096/float32/fwd+bwd", "fused_matmul_dx"): Budget(
        "K loop and registers: " + _FROZEN + " (226 registers at a 128-deep step)",
        loops=(2339,), registers=128),
    ("fused_matmul/bias+gelu/4096x4096x4096/float32/fwd+bwd", "fused_matmul_dw"): Budget(
        "no spill (1080 bytes at 255 registers with a 128-deep step); K loop and registers: "
        + _FROZEN, loops=(2340,), registers=72),
    # The 128 x 256 x 64 candidate with its epilogue in halves, in training (the forward
    # also stores the pre-activation): whole, that forward takes 255 registers and spills
    # 272 bytes; in halves 224 (216 before tanh's reciprocal became rcp.approx, which took
    # 496 instructions off; one 256-thread block per SM either way), no spill. Its K loop
    # does twice the 128 x 128 tile's work per step (83). dx / dw: the backward steps
    # capped (128 / 64), which before took 288 / 240 KiB of shared memory, over sm_90's 227.
    **{("fused_matmul/bias+gelu+128x256+subtile2/4096x4096x4096/bfloat16/fwd+bwd", kernel): Budget(
        reason, loops=loops, registers=regs) for kernel, loops, regs, reason in (
        ("fused_matmul_bias_gelu", (97,), 224,
         "registers: 224 in halves against 255 and a 272-byte spill whole; K loop 97 per "
         "128x256x64 step (the 128x128 tile: 83 per half of that work): " + _FROZEN),
        ("fused_matmul_dx", (156,), 146, "the 128x128 tile's dx figures (the contraction step "
         "capped at 128: 256 took 288 KiB of shared memory)"),
        ("fused_matmul_dw", (91,), 106, "contraction step capped at 64 (128 took 240 KiB of "
         "shared memory): " + _FROZEN))},
    # The same tile with TMA, each half one descriptor store (Triton's persistent matmul
    # tutorial's EPILOGUE_SUBTILE): 172 registers against 255 for the whole tile. After the
    # K loop (80 per step), each TMA wait's retry (2) and its branch back into the code,
    # whose spans hold the epilogue halves: 15 instructions per element more since gelu's
    # tanh form is within 2 ulps for x < -1 too (jit_helpers' gelu_tanh: 42 per element).
    ("fused_matmul/bias+gelu+128x256+subtile2+tma/8192x8192x8192/bfloat16/fwd",
     "fused_matmul_bias_gelu"): Budget(
        "registers: 172 in halves against 255 whole; K loop 80 per 128x256x64 step: " + _FROZEN
        + "; then the TMA waits' retries and branches back (spans: the epilogue halves with "
        "gelu within 2 ulps)", loops=(80, 2, 5893, 2, 5795, 2, 2877),
        registers=172, tma=True),
    # Decode over 16-token pages: the per-page split-KV kernel (paged_attention's) takes
    # 1970 instructions per 128 keys (eight one-page updates, 15.4 per key); the
    # query-blocked kernel's 128-key tiles 603 whole and 1083 on the masked last tile.
    (RAGGED_DECODE, "query_blocked_paged_attention"): Budget(
        "a quarter of the per-page decode kernel's 15.4 per key (1970 per 128 keys) on whole "
        "tiles: " + _FROZEN, loops=(603, 1083), registers=219),
    # paged_attention's separate key and value pages on the same tiles: 1947 per 128 keys
    # per page, 539 / 1018 on 128-key tiles.
    ("paged_attention/decode/8x8192x32x4x128/bfloat16/fwd", "query_blocked_paged_attention"): Budget(
        "under a third of the per-page decode kernel's 15.2 per key (1947 per 128 keys) on "
        "whole tiles: " + _FROZEN, loops=(539, 1018), registers=221),
    # 03-style matmul at our 128 x 128 x 64 tile with a libdevice tanh gelu: 2848 SASS
    # instructions; the bias+gelu kernel may take 1.25x that (the epilogue's tanh is
    # ours: pallas_core.triton.jit_helpers, within 2 ulps). The K loop: today's figure.
    ("fused_matmul/bias+gelu/4096x4096x4096/bfloat16/fwd", "fused_matmul_bias_gelu"): Budget(
        "1.25x Triton's matmul tutorial with libdevice's gelu (2848 instructions); K loop: "
        + _FROZEN, loops=(83,), instructions=3560),
    ("fused_matmul/bias+gelu/8192x8192x8192/bfloat16/fwd", "fused_matmul_bias_gelu"): Budget(
        "1.25x Triton's matmul tutorial with libdevice's gelu (2848 instructions); K loop: "
        + _FROZEN, loops=(83,), instructions=3560),
}


def budget_fields(case: str, kernel: str) -> dict:
    """The row fields of the budget of ``kernel`` in ``case`` (all None without one)."""
    b = BUDGETS.get((case, kernel))
    return dict(budget_loops=None if b is None or b.loops is None else list(b.loops),
                budget_registers=None if b is None else b.registers,
                budget_instructions=None if b is None else b.instructions,
                budget_tma=None if b is None else b.tma,
                budget_reason=None if b is None else b.reason)


# ----------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------

_PTX_COUNTS = {
    "wgmma": r"\bwgmma\.mma_async\b",
    "mma_sync": r"\bmma\.sync\b",
    "cp_async": r"\bcp\.async\.c[ag]\b",
    "tma": r"\bcp\.async\.bulk\.tensor\b",
    "ld_global": r"\bld\.global\b",
    "st_global": r"\bst\.global\b",
}


# A tt.dot whose operands are 16-bit tensors (what sm_90 runs on wgmma).
_SIXTEEN_BIT_DOT = re.compile(r"tt\.dot [^\n]*: tensor<[^>]*x(?:bf16|f16)> \* ")


def ptx_counts(ptx: str) -> dict[str, int]:
    """Instruction counts of interest in a PTX module (static: a loop body counts once)."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in _PTX_COUNTS.items()}


def analyze(case: GateCase, target: str = "sm_90") -> list[dict]:
    """One row per kernel of ``case``: the compile report's figures, PTX counts, traffic."""
    device = tuning.device_kind(case.device_kind) if case.device_kind else contextlib.nullcontext()
    with device:
        reports = pl.triton.compile(case.fn, *case.args, target=target)
    traffic = {}
    if case.traffic_args is not None:
        jax.clear_caches()  # traced before (by compile): trace again so the counter sees the launches
        args = case.traffic_args()
        with count_traffic() as counted:
            jax.block_until_ready(jax.jit(case.fn)(*args))
        traffic = dict(counted)
    rows = []
    for r in reports:
        counted = traffic.get(r["name"])
        rows.append(dict(
            case=case.name, **kernel_row(r), **budget_fields(case.name, r["name"]),
            reads_per_element=None if counted is None else counted.reads_per_element,
            writes_per_element=None if counted is None else counted.writes_per_element,
            design_reads=case.design_reads.get(r["name"]),
            accesses_per_element=None if counted is None else _accesses_per_element(counted)))
        rows[-1].update(per_element(rows[-1], case.step_elements, case.itemsize))
    return rows


def _accesses_per_element(counted) -> float | None:
    """Elements loaded and stored, over every operand, per distinct element of the
    largest operand read (a :class:`benchmarks.traffic.KernelTraffic`)."""
    distinct = max((o.distinct(o.load_addresses) for o in counted.operands.values()), default=0)
    if not distinct:
        return None
    return sum(o.loads + o.stores for o in counted.operands.values()) / distinct


def per_element(row: Mapping, step_elements: int | None, itemsize: int | None) -> dict:
    """A memory-bound kernel's cost per input element: ``sass_per_element``, the SASS
    instructions every thread of a program issues per loop step (all loops of a
    step, or the whole kernel without one), times its threads, over the elements of
    a step; ``bytes_per_element``, elements loaded and stored over all operands
    (counted in the interpreter) per input element, times the input's itemsize
    (float32 statistics and int32 labels counted at that size too)."""
    if not step_elements:
        return dict(sass_per_element=None, bytes_per_element=None)
    loops = row.get("loop_instructions") or [row["sass_instructions"]]
    issued = sum(loops) * row["num_warps"] * 32
    moved = None
    if itemsize and row.get("accesses_per_element") is not None:
        moved = row["accesses_per_element"] * itemsize
    return dict(sass_per_element=issued / step_elements, bytes_per_element=moved)


def kernel_row(report: Mapping) -> dict:
    """The gate's figures of one :func:`pallas_core.triton.compile` report (no traffic):
    what :func:`violations` checks, for tests that compile kernels of their own."""
    ttir = report["asm"]["ttir"]
    text = sass.disassemble(report["asm"]["cubin"])
    return dict(kernel=report["name"], target=report["target"], num_warps=report["num_warps"],
                num_stages=report["num_stages"], registers=report["registers"],
                spill_bytes=report["spill_bytes"], shared_memory_bytes=report["shared_memory_bytes"],
                has_dot="tt.dot" in ttir, sixteen_bit=bool(_SIXTEEN_BIT_DOT.search(ttir)),
                **ptx_counts(report["asm"]["ptx"]),
                sass_instructions=len(sass.instructions(text)[0]),
                loop_instructions=[loop.size for loop in sass.loops(text)])


def violations(row: Mapping, target: str = "sm_90") -> list[str]:
    """Why one kernel's row fails the gate (empty when it passes)."""
    found = []
    if row["spill_bytes"]:
        found.append(f"spills {row['spill_bytes']} bytes ({row['registers']} registers)")
    if row["shared_memory_bytes"] > smem_limit(target):
        found.append(f"{row['shared_memory_bytes']} bytes of shared memory > {smem_limit(target)}")
    hopper = int(target[3:]) >= 90
    if row["has_dot"] and row["sixteen_bit"] and not row["wgmma"] and hopper:
        found.append("a 16-bit dot that is not wgmma.mma_async")
    if row["has_dot"] and row["sixteen_bit"] and row.get("mma_sync") and hopper:
        found.append(f"{row['mma_sync']} mma.sync beside 16-bit dots (all of them belong on wgmma)")
    found += _budget_overruns(row)
    design, reads = row.get("design_reads"), row.get("reads_per_element")
    if design is not None and (reads is None or reads > design + 1e-9):
        found.append(f"reads each input element {reads} times, designed {design}")
    return found


def _budget_overruns(row: Mapping) -> list[str]:
    found = []
    loops, budget = row.get("loop_instructions"), row.get("budget_loops")
    if budget is not None:
        if loops is None or len(loops) != len(budget):
            found.append(f"{0 if loops is None else len(loops)} loop(s), budgeted {len(budget)}")
        else:
            found += [f"loop {n}: {got} instructions per iteration > {most}"
                      for n, (got, most) in enumerate(zip(loops, budget)) if got > most]
    for key, what in (("registers", "registers"), ("sass_instructions", "instructions")):
        most = row.get("budget_" + ("registers" if key == "registers" else "instructions"))
        if most is not None and (row.get(key) is None or row[key] > most):
            found.append(f"{row.get(key)} {what} > {most}")
    if row.get("budget_tma") and not row.get("tma"):
        found.append("no TMA (cp.async.bulk.tensor), budgeted")
    return found


# ----------------------------------------------------------------------------
# Writers and CLI
# ----------------------------------------------------------------------------

COLUMNS = ("case", "kernel", "warps", "stages", "regs (budget)", "spill B", "smem KiB", "wgmma",
           "mma.sync", "cp.async", "TMA", "ld.global", "st.global", "SASS", "SASS/loop iteration (budget)",
           "reads/elem", "design", "writes/elem", "SASS/elem", "bytes/elem", "verdict")


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_row(row: Mapping) -> list[str]:
    bad = row.get("violations", [])
    regs = _fmt(row["registers"])
    if row.get("budget_registers") is not None:
        regs += f" ({row['budget_registers']})"
    loops = " + ".join(str(n) for n in row.get("loop_instructions") or []) or "-"
    if row.get("budget_loops") is not None:
        loops += " (" + " + ".join(str(n) for n in row["budget_loops"]) + ")"
    return [row["case"], row["kernel"], _fmt(row["num_warps"]), _fmt(row["num_stages"]),
            regs, _fmt(row["spill_bytes"]),
            f"{row['shared_memory_bytes'] / 1024:.1f}", _fmt(row["wgmma"]), _fmt(row["mma_sync"]),
            _fmt(row["cp_async"]), _fmt(row["tma"]), _fmt(row["ld_global"]), _fmt(row["st_global"]),
            _fmt(row.get("sass_instructions")), loops,
            _fmt(row["reads_per_element"]), _fmt(row["design_reads"]),
            _fmt(row["writes_per_element"]), _fmt(row.get("sass_per_element")),
            _fmt(row.get("bytes_per_element")), "FAIL: " + "; ".join(bad) if bad else "ok"]


def write_markdown(path: Path, meta: Mapping, rows: Sequence[Mapping]) -> None:
    lines = [f"# Static performance gate: {meta['target']}", "",
             f"- Commit: {meta['commit'] or 'unknown'}; date {meta['date']}; host without a GPU "
             "(Triton's ptxas; nothing timed).",
             f"- Shared-memory limit per block: {smem_limit(meta['target']) // 1024} KiB.",
             "- PTX instruction counts are static (a loop body counts once). SASS: instructions "
             "in the kernel and per iteration of each loop, per thread (nvdisasm), with the "
             "committed budget in parentheses; the budgets' reasons are in the JSON and in "
             "benchmarks/static.py (BUDGETS). reads/elem and "
             "writes/elem: elements accessed over distinct elements accessed, counted in "
             "Triton's interpreter on one program's rows: the passes over HBM of a memory-bound "
             "kernel; `design` is what the op's design states (the gate fails above it). "
             "SASS/elem (memory-bound kernels): instructions issued per input element, all "
             "threads of a program over the elements of one loop step; bytes/elem: elements "
             "loaded and stored over all operands per input element x the input's itemsize.",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def run(cases: Sequence[GateCase], target: str = "sm_90", log=print) -> list[dict]:
    """Analyzes every case; each row gains ``violations``."""
    rows = []
    for case in cases:
        start = time.monotonic()
        case_rows = analyze(case, target)
        for row in case_rows:
            row["violations"] = violations(row, target)
        rows += case_rows
        failed = sum(bool(r["violations"]) for r in case_rows)
        log(f"{case.name}: {len(case_rows)} kernel(s), {failed} failing "
            f"({time.monotonic() - start:.1f} s)")
    return rows


def main(argv=None) -> int:
    from benchmarks.__main__ import git_commit
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.static",
        description="The static performance gate: compile every op's Triton kernels at model "
                    "sizes for a GPU target on this host (no GPU needed) and fail on spills, "
                    "shared memory over the limit, 16-bit dots off the tensor cores, extra "
                    "passes over memory or a budget overrun. Needs triton and torch (the bench "
                    "extra).")
    parser.add_argument("--target", default="sm_90",
                        help="CUDA target to compile for, sm_XY (default sm_90).")
    parser.add_argument("--quick", action="store_true", help="The CI subset only.")
    parser.add_argument("--filter", default=None, metavar="SUBSTR",
                        help="Only cases whose name contains SUBSTR.")
    parser.add_argument("--out", type=Path, default=RESULTS_ROOT,
                        help="Folder for static_<target>.md and .json (default benchmarks/results).")
    args = parser.parse_args(argv)
    smem_limit(args.target)  # a clear error for an unknown target, before compiling anything
    cases = quick_cases() if args.quick else all_cases(args.target)
    if args.filter:
        cases = [c for c in cases if args.filter in c.name]
    rows = run(cases, args.target)
    meta = dict(target=args.target, commit=git_commit(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"static_{args.target}{'_quick' if args.quick else ''}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_markdown(args.out / f"{stem}.md", meta, rows)
    failing = [r for r in rows if r["violations"]]
    for r in failing:
        print(f"FAIL {r['case']} {r['kernel']}: {'; '.join(r['violations'])}")
    print(f"{len(rows)} kernel(s), {len(failing)} failing; table in {args.out / (stem + '.md')}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
