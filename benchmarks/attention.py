"""Benchmark cases for ``ops.dot_product_attention`` (flash attention).

Each case pits our kernels (every implementation in
:func:`benchmarks.harness.kernel_implementations`: ``triton`` and
``pallas_triton`` on GPUs, ``interpret`` on CPUs; and the Mosaic GPU kernels,
``mosaic_gpu``, :func:`mosaic_gpu_column`) against the baseline a user
would write without us: ``jax.nn.dot_product_attention(implementation="xla")``
in the inputs' dtype, jitted, which materialises the ``[B, N, T, S]`` logits
in float32 (and, for the backward pass, their gradient). On GPUs the cuDNN
flash attention behind the same function (``implementation="cudnn"``) is an
extra column; where cuDNN rejects a shape, or the XLA baseline runs out of
memory (its logits at T = 16k, head dim 64, take 32 GiB), the harness records
an error row for that implementation instead of stopping the run.

Accuracy is measured against exact attention in float64 (inputs upcast,
products at ``Precision.HIGHEST``, :func:`benchmarks.harness.reference_output`), written here independently of both
``ops`` and ``jax.nn`` (:func:`exact_reference`). It walks the queries in
chunks of :data:`REFERENCE_CHUNK` rows, each rematerialised in the backward
pass, so that even the 16k-token reference needs only one chunk's logits.

Cost model (FlashAttention-2's convention, so TFLOP/s compare with published
numbers; ceiling "matmul"): the forward is two products of ``2*B*N*T*S*H``
flops each (``q k^T`` and ``p v``), ``4*B*N*T*S*H``; the backward counts 2.5
forwards (five products: the recomputed logits, dV, dP, dQ, dK), so fwd+bwd
counts ``3.5 * 4*B*N*T*S*H``. Causal attention counts half of that, the work
below the diagonal. Every row also reports ``peak_bytes`` (temporary plus
output buffers of the compiled executable): the point of flash attention is
never to hold ``T x S`` scores.

JAX's own Pallas kernel, ``jax.experimental.pallas.ops.gpu.attention.mha``
(:mod:`benchmarks.jax_pallas_ops`), is the ``jax_pallas`` column, forward and
fwd+bwd (its custom VJP), at scale ``1/sqrt(H)``: compiled by JAX's Pallas
Triton lowering on GPUs, on JAX's interpreter in full CPU runs (not quick
ones). It has no grouped-query attention (it reads key/value head ``n`` for
query head ``n``), so the ``+gqa`` cases have no such column, nor would
lengths its blocks do not divide (:func:`benchmarks.jax_pallas_ops.mha_unsupported`).

Passes: ``fwd`` and ``fwd+bwd`` (:data:`benchmarks.harness.PASSES`). There is
no backward-only pass: a case's inputs are fresh arrays shared by every
implementation, while a backward alone would start from each
implementation's own residuals; its time is about fwd+bwd minus fwd.

Shapes ``(B, T, S, N, K, H)`` (batch, queries, keys, query heads, key/value
heads, head dim):

* GPUs: FlashAttention-2's benchmark grid, 16k tokens per batch
  (``B * T = 16384``) at T = S = 512, 2k, 4k, 8k and 16k, a 2048-wide model
  (``N * H = 2048``: head dim 64 with 32 heads, 128 with 16), causal and not,
  bfloat16; plus grouped-query attention 8:1 (32 query heads sharing 4
  key/value heads) at 4k, causal; plus a logit soft cap (``logits_soft_cap=30``,
  Gemma 2's) at 8k, causal, head dims 128 and 64 (variant ``causal+softcap30``),
  which jax.nn cannot express: its baseline is the same attention written in
  jnp (:func:`xla_soft_capped_attention`), and neither cuDNN nor JAX's ``mha``
  has a column; the same kernel's rate without the cap is the plain causal case.
* CPUs run our kernels through the Pallas interpreter: tiny sizes, one
  causal float32 case and one grouped-query bfloat16 case whose 200 rows fill
  no block exactly.

:func:`memory_report` (``python -m benchmarks.attention_memory``) compares
the compiled memory of a training step's attention, ours against the XLA
baseline, without running it.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import ops
from benchmarks import harness, jax_pallas_ops

OP = "dot_product_attention"

# Rows of queries per chunk of the exact reference (see exact_reference).
REFERENCE_CHUNK = 1024


class Shape(NamedTuple):
    """One attention problem: ``query [B, T, N, H]``, ``key / value [B, S, K, H]``."""
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str
    soft_cap: float | None = None  # logits_soft_cap, or None

    @property
    def variant(self) -> str:
        """``causal`` or ``full``, with ``+gqaG`` when G query heads share a key/value head
        and ``+softcapC`` with a logit soft cap C."""
        mask = "causal" if self.causal else "full"
        group = self.heads // self.kv_heads
        name = mask if group == 1 else f"{mask}+gqa{group}"
        return name if self.soft_cap is None else f"{name}+softcap{self.soft_cap:g}"

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.batch, self.q_len, self.kv_len, self.heads, self.kv_heads, self.head_dim)


def _model_shape(seq_len: int, head_dim: int, causal: bool, *, tokens: int = 16384,
                 width: int = 2048, kv_group: int = 1, dtype: str = "bfloat16",
                 soft_cap: float | None = None) -> Shape:
    """``tokens`` per batch at ``seq_len``, ``width // head_dim`` query heads."""
    heads = width // head_dim
    return Shape(tokens // seq_len, seq_len, seq_len, heads, heads // kv_group, head_dim, causal,
                 dtype, soft_cap)


ACCELERATOR_SHAPES = tuple(
    _model_shape(seq_len, head_dim, causal)
    for head_dim in (64, 128)
    for seq_len in (512, 2048, 4096, 8192, 16384)
    for causal in (False, True)
) + (_model_shape(4096, 64, True, kv_group=8),) + tuple(
    _model_shape(8192, head_dim, True, soft_cap=30.0) for head_dim in (128, 64))
CPU_SHAPES = (
    Shape(1, 128, 128, 2, 2, 32, True, "float32"),
    Shape(1, 200, 200, 4, 2, 32, False, "bfloat16"),
)
QUICK_SHAPES = {"cpu": (Shape(1, 128, 128, 2, 2, 32, True, "float32"),),
                "accelerator": (_model_shape(2048, 128, True, tokens=4096),)}


def shapes(platform: str, quick: bool = False) -> tuple[Shape, ...]:
    """The attention problems benchmarked on ``platform``."""
    return harness.pick_shapes(platform, quick, cpu=CPU_SHAPES, accelerator=ACCELERATOR_SHAPES,
                               quick_shapes=QUICK_SHAPES)


def extra_implementations(platform: str) -> tuple[str, ...]:
    """Other attention kernels timed beside ours: jax.nn's cuDNN path on GPUs."""
    return ("cudnn",) if platform in ("gpu", "cuda") else ()


def mosaic_gpu_column(platform: str, shape: Shape, quick: bool = False) -> tuple[str, ...]:
    """Our Mosaic GPU kernels' column (``implementation="mosaic_gpu"``,
    :mod:`ops.attention.mosaic_gpu`): on GPUs (an sm_90+ one runs them; an older one's
    row records its refusal), and in a CPU's full run, where they run in JAX's GPU
    interpret mode, on the 16-bit shapes they take (not in quick runs: the
    interpreter takes seconds per kernel)."""
    if platform in ("gpu", "cuda"):
        return ("mosaic_gpu",)
    if platform == "cpu" and not quick and shape.dtype in ("bfloat16", "float16"):
        return ("mosaic_gpu",)
    return ()


def cases(platform: str, quick: bool = False) -> list[harness.Case]:
    """Every attention case for ``platform``: shapes x passes.

    ``quick`` keeps one small shape (still both passes), for smoke tests.
    """
    ours = harness.kernel_implementations(platform)
    extra = extra_implementations(platform)
    interpret = jax_pallas_ops.interpret_mode(platform, quick)
    return [make_case(shape, pass_name, ours + mosaic_gpu_column(platform, shape, quick), extra,
                      jax_pallas_interpret=interpret)
            for shape in shapes(platform, quick)
            for pass_name in harness.PASSES]


def flops(shape: Shape, pass_name: str) -> float:
    """FlashAttention-2's count: ``4*B*N*T*S*H`` forward, 3.5x that for fwd+bwd, half if causal."""
    b, t, s, n, _, h = shape.dims
    forward = 4.0 * b * n * t * s * h * (0.5 if shape.causal else 1.0)
    return forward * (3.5 if pass_name == "fwd+bwd" else 1.0)


def make_case(shape: Shape, pass_name: str, implementations: tuple[str, ...],
              extra: tuple[str, ...] = (), *,
              jax_pallas_interpret: bool | None = None) -> harness.Case:
    """One case: our ``implementations`` and jax.nn's ``extra`` ones vs the XLA baseline.

    ``jax_pallas_interpret`` (:func:`benchmarks.jax_pallas_ops.interpret_mode`):
    None leaves out the ``jax_pallas`` column (JAX's ``mha``), else its
    ``interpret`` flag; problems ``mha`` cannot express get no column either.
    """
    cap = shape.soft_cap
    if cap is None:
        fns = {harness.BASELINE: functools.partial(jax_nn_attention, causal=shape.causal,
                                                   implementation="xla")}
        for name in extra:
            fns[name] = functools.partial(jax_nn_attention, causal=shape.causal,
                                          implementation=name)
    else:  # jax.nn (and so cuDNN through it) has no soft cap
        fns = {harness.BASELINE: functools.partial(xla_soft_capped_attention,
                                                   causal=shape.causal, soft_cap=cap)}
    for name in implementations:
        fns[name] = functools.partial(ours_attention, causal=shape.causal, implementation=name,
                                      soft_cap=cap)
    # No column where mha cannot compute this problem (GQA, lengths its blocks do not divide,
    # a soft cap).
    if jax_pallas_interpret is not None and cap is None and jax_pallas_ops.mha_unsupported(
            shape.q_len, shape.kv_len, shape.heads, shape.kv_heads) is None:
        fns[jax_pallas_ops.NAME] = functools.partial(jax_pallas_ops.mha, causal=shape.causal,
                                                     interpret=jax_pallas_interpret)
    reference = functools.partial(exact_reference, causal=shape.causal, soft_cap=cap)
    fwd_bwd = pass_name == "fwd+bwd"
    if fwd_bwd:
        fns = {name: harness.forward_and_backward(fn) for name, fn in fns.items()}
        reference = harness.forward_and_backward(reference)
    return harness.Case(
        op=OP, variant=shape.variant, shape=shape.dims, dtype=shape.dtype, pass_name=pass_name,
        flops=flops(shape, pass_name),
        make_inputs=functools.partial(_make_inputs, shape=shape, with_cotangent=fwd_bwd),
        implementations=fns, reference=reference, ceiling="matmul", report_memory=True)


def _make_inputs(key, *, shape: Shape, with_cotangent: bool):
    """``(query, key, value[, cotangent])``, standard normal: with the default
    ``1/sqrt(H)`` scale the logits have unit spread, as in a trained model."""
    b, t, s, n, k, h = shape.dims
    kq, kk, kv, kc = jax.random.split(key, 4)
    inputs = [harness.random_normal(kq, (b, t, n, h), shape.dtype),
              harness.random_normal(kk, (b, s, k, h), shape.dtype),
              harness.random_normal(kv, (b, s, k, h), shape.dtype)]
    if with_cotangent:
        inputs.append(harness.random_normal(kc, (b, t, n, h), shape.dtype))
    return tuple(inputs)


def jax_nn_attention(q, k, v, *, causal: bool, implementation: str):
    """What a user writes: ``jax.nn.dot_product_attention`` in the inputs' dtype."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)


def xla_soft_capped_attention(q, k, v, *, causal: bool, soft_cap: float):
    """What a user writes for a soft-capped attention, which jax.nn cannot express: the
    logits ``cap * tanh(q k^T / (sqrt(H) cap))`` in float32, masked, softmax, ``p v`` in
    the inputs' dtype (XLA materialises the ``[B, N, T, S]`` logits, as jax.nn's XLA
    path does)."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    logits = soft_cap * jnp.tanh(logits * (h ** -0.5 / soft_cap))
    if causal:
        logits = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, v.shape[-1])


def ours_attention(q, k, v, *, causal: bool, implementation: str, soft_cap: float | None = None):
    return ops.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation,
                                     logits_soft_cap=soft_cap)


def exact_reference(q, k, v, *, causal: bool, chunk: int = REFERENCE_CHUNK,
                    soft_cap: float | None = None):
    """Exact attention: ``softmax(q k^T / sqrt(H)) v`` per head (the logits ``soft_cap *
    tanh(logits / soft_cap)`` with a soft cap), in the dtype of
    :func:`benchmarks.harness.upcast` (float64 under the harness's reference, else float32).

    Queries are processed ``chunk`` rows at a time (all at once when ``chunk``
    does not divide T), each chunk under ``jax.checkpoint``, so that the
    forward and the backward both hold one ``[B, N, chunk, S]`` block of
    logits, never all ``T x S``. Causal masking is top-left aligned (query
    ``i`` sees keys ``j <= i``), as jax.nn's.
    """
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    group = n // kv_heads
    rows = chunk if t % chunk == 0 else t
    k, v = harness.upcast(k), harness.upcast(v)
    # [chunks, B, rows, K, G, H]: query head kv_head * G + g reads key/value head kv_head.
    q_chunks = jnp.moveaxis(harness.upcast(q).reshape(b, t // rows, rows, kv_heads, group, h), 1, 0)

    @jax.checkpoint
    def chunk_attention(first_row, q_chunk):
        logits = jnp.einsum("btkgh,bskh->bkgts", q_chunk, k, precision=lax.Precision.HIGHEST)
        logits = logits * (h ** -0.5)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        if causal:
            q_pos = first_row + jnp.arange(rows)[:, None]
            logits = jnp.where(jnp.arange(s)[None, :] <= q_pos, logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bkgts,bskh->btkgh", probs, v, precision=lax.Precision.HIGHEST)

    first_rows = jnp.arange(0, t, rows)
    out = lax.map(lambda args: chunk_attention(*args), (first_rows, q_chunks))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, n, h)


# --------------------------------------------------------------------------
# Memory of a training step, compiled but not run
# --------------------------------------------------------------------------

# (B, T = S, N = K, H) and dtype of memory_report's default problem.
MEMORY_SHAPE = (1, 2048, 4, 64)
MEMORY_DTYPE = "float32"


def memory_report(seq_len: int = MEMORY_SHAPE[1], *, batch: int = MEMORY_SHAPE[0],
                  heads: int = MEMORY_SHAPE[2], head_dim: int = MEMORY_SHAPE[3],
                  dtype: str = MEMORY_DTYPE, causal: bool = False,
                  implementation: str = "interpret", platform: str = "cpu") -> dict[str, Any]:
    """Compiled memory of attention's forward + backward, ours against the XLA baseline.

    For each of ``jax.nn.dot_product_attention(implementation="xla")`` and
    ``ops.dot_product_attention(implementation=implementation)`` the gradient
    of the sum of the outputs with respect to q, k and v (q, k, v of shape
    ``[batch, seq_len, heads, head_dim]``) is jitted, lowered and compiled for
    the first ``platform`` device, and XLA's ``memory_analysis()`` read off.
    Nothing runs, so sizes that would be slow to execute (the interpreter on
    a CPU) cost only their compile time.

    Returns:
      ``{"config": ..., "implementations": {name: {"temp_bytes",
      "argument_bytes", "output_bytes", "peak_bytes"}}, "ratios": {...}}``
      where ``peak_bytes`` is temp plus output bytes (the memory beyond the
      arguments, as :func:`benchmarks.harness.compiled_peak_bytes`) and the
      ratios are the baseline's bytes over ours (how many times less we need).
    """
    device = jax.devices(platform)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    arg = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.dtype(dtype),
                               sharding=sharding)
    fns = {
        harness.BASELINE: functools.partial(jax_nn_attention, causal=causal, implementation="xla"),
        implementation: functools.partial(ours_attention, causal=causal,
                                          implementation=implementation),
    }
    results = {}
    for name, fn in fns.items():
        def loss(q, k, v, fn=fn):
            return jnp.sum(fn(q, k, v).astype(jnp.float32))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(arg, arg, arg).compile()
        stats = compiled.memory_analysis()
        temp, args_, out = (int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes),
                            int(stats.output_size_in_bytes))
        results[name] = {"temp_bytes": temp, "argument_bytes": args_, "output_bytes": out,
                         "peak_bytes": temp + out}
    base, ours = results[harness.BASELINE], results[implementation]
    ratios = {field: (base[field] / ours[field] if ours[field] else None)
              for field in ("temp_bytes", "peak_bytes")}
    config = {"batch": batch, "q_len": seq_len, "kv_len": seq_len, "heads": heads,
              "kv_heads": heads, "head_dim": head_dim, "dtype": jnp.dtype(dtype).name,
              "causal": causal, "pass": "fwd+bwd (grad of sum of outputs w.r.t. q, k, v)",
              "platform": device.platform, "device_kind": device.device_kind}
    return {"config": config, "implementations": results, "ratios": ratios}
