"""``ops.dot_product_attention(..., implementation="mosaic_gpu")``: FlashAttention-3-class
kernels on Hopper, written on pallas_core's Mosaic GPU surface (:mod:`pallas_core.gpu`).

The kernels (FlashAttention-3, Shah et al. 2024, sections 3.1-3.3):

* forward (:mod:`ops.attention.mosaic_gpu_forward`): a TMA producer warpgroup
  feeding a ring of shared-memory key/value stages, two compute warpgroups on
  ``wgmma`` with raised registers and a ping-pong schedule, the online softmax
  of :mod:`ops.attention.tile_math` on the accumulator registers (float32
  statistics, ``exp2`` with the scale folded into one multiply-add), the
  causal walk split into unmasked blocks and a masked diagonal with fully
  masked blocks never loaded, the logsumexp residual;
* backward (:mod:`ops.attention.mosaic_gpu_backward`): ``delta = rowsum(dO *
  O)`` in XLA, then a dQ kernel and a dK/dV kernel of the same shape (a
  producer streaming the walked operands, compute warpgroups owning their
  rows, taking turns at the tensor cores as the forward's, each step serial
  or pipelined inside a warpgroup as its registers allow), every product on
  ``wgmma``, no atomics: bit-for-bit deterministic.

The same kernels run everywhere ``pallas_core.gpu.kernel`` runs them: on an
sm_90+ GPU through JAX's Mosaic GPU lowering; on a host without a GPU in
JAX's GPU interpret mode (races detected), each also lowered for ``cuda``;
an older GPU is refused before anything is traced (NotImplementedError naming
sm_90, so ``implementation=("mosaic_gpu", "triton")`` falls back), as are causal
or windowed calls under a CUDA runtime from 12.8.0 up to 12.9.1, whose ptxas
miscompiles Mosaic GPU's masked attention loops (JAX's own Mosaic GPU attention
refuses them too).

What it takes (:func:`supported` names the rest before tracing, so a
sequence of implementations falls back): float16 / bfloat16; head dims
multiples of 16 up to 256 (query/key and value apart, MLA's 192 / 128
included) whose tiles fit the shared memory; causal, local windows, sequence
lengths, segment ids, a logit soft cap, sinks (with their gradient), dropout
(the keep bits of :mod:`ops.attention.dropout`'s counter hash, drawn in the
kernels on the accumulator registers: the same bits as every other
implementation), a bias (with its gradient, written tile by tile by the dQ
kernel) and a mask array in every broadcast form, read tile by tile and never
broadcast in memory (:mod:`ops.attention.mosaic_gpu_pairs`), GQA / MQA. Not:
explicit ``block_sizes`` other than a
:class:`~ops.attention.mosaic_gpu_config.MosaicGPUConfig` (tiles of the other
kernels).

Shapes need not divide the tiles: TMA loads past an array read zeros and its
stores past it are dropped, and the per-tile mask drops keys past ``S``. TMA
needs each array's sequence dim to be a multiple of 8 rows (it tiles the
whole array), so a query or key/value length that is not is padded in XLA
(one copy of q, k, v, out); the logsumexp is written in whole tiles and
sliced.

Static view, before any GPU run (the Mosaic GPU modules ``plgpu.mosaic_modules``
reads back on a host without a GPU; PTX and SASS are jaxlib's CUDA plugin's,
which compiles the module on the GPU, so register counts and spills are not
known here: :func:`~ops.attention.mosaic_gpu_config.forward_registers` bounds
them). B=2, T=S=8192, bfloat16, the heuristic's tiles:

* forward, 16 heads of 128 (64 query rows per compute warpgroup, 128-row
  key/value tiles, 2 stages, 163 KiB of shared memory; at most 224 of the 232
  registers: float32 O and S 64 each, two 16-bit P tiles 32 each, 32 others).
  Per key/value step each compute warpgroup issues, in its ping-pong turn, 8
  ``wgmma.mma_async`` ``m64n128k16`` for tile j's ``q k^T`` (both operands in
  shared memory) and 8 for tile j-1's ``p v`` (P from registers) in two commit
  groups, then ``wgmma.wait_group 1`` (``p v`` still running), tile j's 66
  ``ex2.approx`` per thread (64 and two rescale factors) and ``wait_group 0``
  (FlashAttention-3's two-stage pipeline, section 3.2); 4 mbarrier waits (key
  stage, its turn, value stage, the meeting after issuing) and 4 arrivals; the
  producer 2 TMA tile loads; one ``setmaxregister`` each (232 up, 40 down).
  The first tile's ``q k^T`` and the last tile's ``p v`` stand alone.
  (``intra_wg_stages=1``, round 1's step: ``q k^T``, wait 0, softmax, ``p v``,
  wait 0.) At 32 heads of 64: 4 stages (147 KiB), 12 ``wgmma`` a step (4
  ``m64n128k16`` for ``q k^T``, 8 ``m64n64k16`` for ``p v``), the same 66
  ``ex2``, at most 192 registers. A soft cap adds 64 ``tanh.approx.f32`` (one
  MUFU op each) and 64 multiplies (the tanh's argument) per thread a step, its
  factor folded into the ``exp2``'s multiply-add; sinks nothing in the loop
  (they start the carry); a ``[T, S]`` bias one more TMA tile a step.
* backward at head dim 128 (round 2: dQ and dK/dV 64 x 64 steps, no
  ping-pong): dQ 64 x 128 steps, 24 ``m64n128k16`` ``wgmma`` a step (8 + 8 for
  ``q k^T`` and ``dO v^T``, 8 for ``ds k``), 64 ``ex2`` per thread, 2 TMA
  loads; dK/dV (64 key rows per warpgroup, 64-row query steps): 16
  ``m64n64k16`` (``k q^T``, ``v dO^T``) and 8 ``m64n128k16`` (``p^T dO``,
  ``ds^T q``), 32 ``ex2``, 4 TMA loads; both serial inside a warpgroup (224
  registers counted each), the two warpgroups taking turns. At head dim 64 the
  dQ kernel pipelines (step t's products issued with step t-1's ``ds k``) and
  the dK/dV kernel walks 128-row query steps. The step-by-step view and what
  limits it: :mod:`ops.attention.mosaic_gpu_backward`.

Predicted figures (H100 / H200: 989 TFLOP/s dense bf16, i.e. 4096 flops per
clock per SM; 16 ``ex2`` per clock per SM on the MUFU, FlashAttention-3's "3.9
TFLOPS of special functions"; 697 TFLOP/s is the measured matmul ceiling on the
H200). A 64 x 128 tile at head dim 128 is 4.2 MFLOP: 1024 tensor-core clocks,
against 512 MUFU clocks of ``ex2`` and about 250 of float32 work for its
softmax. The ping-pong hides one warpgroup's softmax under the other's
products, and the pipeline inside each keeps a second commit group queued, so
the tensor cores wait neither for a softmax nor for a warpgroup's own ``p v``
before its next ``q k^T``: tensor-core bound, as FlashAttention-3 (whose
ablation, section 4.3, credits this pipeline with 582 -> 661 TFLOP/s at head
dim 128, full attention, 8k). Round 1's figures (ping-pong only) and now's (the
backward as of round 3):

====================  ======  ======  =====  ==========================
case                  round1  now     cuDNN  ratio now
====================  ======  ======  =====  ==========================
fwd d128 full          ~470    ~520    519   ~1.0x
fwd d128 causal        ~420    ~465    471   ~0.99x
fwd d64 causal         ~300    ~330    352   ~0.94x
fwd+bwd d128 causal    ~300    ~375    433   ~0.87x (round 2: ~305)
fwd+bwd d128 full      --      ~410    498   ~0.82x
fwd+bwd d64 causal     --      ~330    362   ~0.92x
====================  ======  ======  =====  ==========================

At head dim 64 a tile's products take 512 tensor-core clocks and its ``ex2``
512 MUFU clocks: the ping-pong runs one softmax at a time (about 650 clocks with
the row max before and the sums after the exponentials), so the pair of tiles
is bound by the two softmaxes, not by the products; the pipeline only removes
the wait for a warpgroup's own ``p v``. A soft cap adds a MUFU ``tanh`` per
score: at head dim 128, 1024 MUFU clocks a tile against 1024 of products
(about 0.85x of the same kernel without); at 64, twice the MUFU work of a
MUFU-bound loop (about 0.6x); both short of "within 10%" (the lever left:
part of the ``exp2``\ s on the FMA pipes as a polynomial). Sinks cost nothing
measurable. The backward (7 products per tile against the 5 counted) has the
ping-pong and, where the registers hold it, the pipeline and 128-row steps;
at head dim 128 its dK/dV kernel's N = 64 products keep forward+backward near
0.87x (what is left: :mod:`ops.attention.mosaic_gpu_backward`). Persistent scheduling is not built:
2048 causal blocks of 128 rows on 132 SMs run longest first, so the last wave
holds the shortest walks, and at full attention 15.5 waves of equal blocks
lose at most 3%. The lease queue (``benchmarks/lease_queue.json``,
experiments ``mosaic-gpu-attention-*``) times these against cuDNN with the
tuner's candidates, each pipeline as an arm.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ops import _op
from ops._partitioning import psum
from ops._partitioning import run as partitioned
from ops.attention import attention as attention_op
from ops.attention import dropout as dropout_lib
from ops.attention import mosaic_gpu_backward, mosaic_gpu_forward
from ops.attention.block_sizes import BlockSizes
from ops.attention.config import AttentionProblem, Backend, Config, ScoreMath
from ops.attention.masking import MaskSpec, fold_lengths
from ops.attention.mosaic_gpu_config import MosaicGPUConfig, fits
from ops.attention.mosaic_gpu_pairs import Pair
from pallas_core.gpu import target

_OP = "dot_product_attention"
NAME = "mosaic_gpu"
_DTYPES = ("float16", "bfloat16")
MAX_HEAD_DIM = 256
# Of the 232 registers a compute warpgroup's thread gets, what the dK/dV accumulators may
# take: the two [block_kv_dkv, block_q_dkv] float32 products and their 16-bit copies need
# the rest (at 64 x 64: 32 + 32 + 16 + 16).
MAX_DKDV_ACCUMULATOR_REGISTERS = 160


def _why_not_device(call: _op.Call) -> str | None:
    """Why the call's GPU cannot run Mosaic GPU's warpgroup kernels, or None
    (:func:`pallas_core.gpu.target.why_not_gpu`)."""
    t = call.target
    return target.why_not_gpu(t.platform, t.device_kind, t.sm, "implementation='mosaic_gpu'")


# CUDA runtimes whose ptxas miscompiles Mosaic GPU's masked attention loops (JAX's own
# Mosaic GPU attention refuses causal masking on them): [first, last) as 1000 * major + 10 * minor
# + patch.
_PTXAS_MISCOMPILES = (12080, 12091)


def _cuda_runtime_version() -> int | None:
    """The CUDA runtime jaxlib's CUDA plugin was built with, None without the plugin."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    return None if cuda_versions is None else int(cuda_versions.cuda_runtime_get_version())


def _why_not_toolchain(call: _op.Call) -> str | None:
    """A CUDA runtime known to miscompile masked loops, for a call with a positional mask."""
    a = call.args["args"]
    masked = call.args["is_causal"] or a["left"] is not None or a["right"] is not None
    if call.target.platform != "gpu" or not masked:
        return None
    version = _cuda_runtime_version()
    if version is not None and _PTXAS_MISCOMPILES[0] <= version < _PTXAS_MISCOMPILES[1]:
        return (f"causal or windowed attention under CUDA runtime {version} (ptxas from 12.8.0 "
                "up to 12.9.1 miscompiles Mosaic GPU's masked attention loops)")
    return None


def supported(call: _op.Call) -> str | None:
    """None when the Mosaic GPU kernels can run ``call`` (a checked attention call),
    else why not (every reason, before anything is traced)."""
    why = _why_not_device(call) or _why_not_toolchain(call)
    if why is not None:
        return why
    a = call.args["args"]
    q, k, v = a["q"], a["k"], a["v"]
    reasons = []
    if np.dtype(q.dtype).name not in _DTYPES:
        reasons.append(f"dtype {np.dtype(q.dtype).name} (wgmma takes {' or '.join(_DTYPES)} here)")
    H, Hv = q.shape[-1], v.shape[-1]
    if H % 16 or Hv % 16 or H > MAX_HEAD_DIM or Hv > MAX_HEAD_DIM:
        reasons.append(f"head dims H={H}, Hv={Hv} (multiples of 16 up to {MAX_HEAD_DIM}: "
                       "wgmma's K step and its widest accumulator)")
    blocks = call.args["block_sizes"]
    if blocks is not None and not isinstance(blocks, MosaicGPUConfig):
        reasons.append("block_sizes other than an ops.attention.mosaic_gpu_config."
                       "MosaicGPUConfig (tiles for the other kernels)")
    if not reasons and 0 not in q.shape and 0 not in k.shape:
        tiles = _tiles(call)
        kernels = ("forward",) if call.pass_ == "fwd" else ("forward", "dq", "dkdv")
        pairs = tuple(Pair.of(x, mask=name == "mask") for name, x in
                      (("bias", a["bias"]), ("mask", a["mask"])) if x is not None)
        if not fits(tiles, H, Hv, np.dtype(q.dtype).itemsize, a["segments"], kernels, pairs,
                    dbias=a["bias"] is not None):
            reasons.append(f"head dims H={H}, Hv={Hv} with tiles {tiles} (over the shared "
                           "memory of a thread block)")
        elif (call.pass_ != "fwd" and mosaic_gpu_backward.dkdv_accumulator_registers(
                tiles, H, Hv) > MAX_DKDV_ACCUMULATOR_REGISTERS):
            reasons.append(f"the backward at head dims H={H}, Hv={Hv}: the dK/dV kernel's two "
                           f"float32 accumulators of {tiles.dkdv_kv} key rows would take "
                           f"{mosaic_gpu_backward.dkdv_accumulator_registers(tiles, H, Hv)} of a "
                           f"thread's registers (at most {MAX_DKDV_ACCUMULATOR_REGISTERS} leave "
                           "room for the tile products)")
    return None if not reasons else "; ".join(reasons)


def _tiles(call: _op.Call) -> MosaicGPUConfig:
    """The call's config: ``block_sizes`` when it is one, else the tuning cache's entry,
    else the heuristic (:meth:`ops._op.Op.select`)."""
    explicit = call.args["block_sizes"]
    explicit = explicit if isinstance(explicit, MosaicGPUConfig) else None
    a = call.args["args"]
    variant, _ = attention_op._variant(a, call.args["is_causal"], float(call.args["dropout_rate"]))
    q, v = a["q"], a["v"]
    problem = call.op.problem((q.shape[1], a["k"].shape[1], max(q.shape[-1], v.shape[-1])),
                              q.dtype, variant)
    return call.op.select(problem, NAME, explicit)


def run(call: _op.Call):
    """The checked call on the Mosaic GPU kernels (see the module docstring)."""
    a = call.args["args"]
    q, k, v = a["q"], a["k"], a["v"]
    if 0 in q.shape or 0 in k.shape:  # nothing for a kernel to do: the reference is exact
        return call.op.entry("xla", **call.args)
    T, S = q.shape[1], k.shape[1]
    spec = MaskSpec(T=T, S=S, causal=bool(call.args["is_causal"]), left=a["left"],
                    right=a["right"], segments=a["segments"])
    q_seg, kv_seg = fold_lengths(a["q_seg"], a["kv_seg"], a["q_len"], a["kv_len"], T, S)
    rate = float(call.args["dropout_rate"])
    seed = dropout_lib.seed_from_rng(call.args["dropout_rng"]) if rate > 0 else None
    tiles = _tiles(call)
    cfg = Config(
        backend=Backend(NAME),
        problem=AttentionProblem(
            spec=spec, batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2],
            head_dim=q.shape[3], value_head_dim=None if v.shape[-1] == q.shape[-1] else v.shape[-1],
            bias_full=None if a["bias"] is None else tuple(d != 1 for d in a["bias"].shape),
            mask_full=None if a["mask"] is None else tuple(d != 1 for d in a["mask"].shape)),
        score=ScoreMath(scale=a["scale"], softcap=a["cap"], dropout_rate=rate,
                        sinks=a["sinks"] is not None),
        blocks=BlockSizes(tiles.block_q, tiles.block_kv).resolved())
    out, lse = _flash(q, k, v, a["bias"], a["mask"], q_seg, kv_seg, seed, a["sinks"],
                      (cfg, tiles))
    lse = jnp.transpose(lse[..., 0], (0, 2, 1))
    if a["unbatched"]:
        out, lse = out[0], lse[0]
    if call.args["return_residual"]:
        return out, jax.lax.stop_gradient(lse)
    return out


# --------------------------------------------------------------------------
# custom_vjp: residuals q, k, v, out, lse (float32 [B, N, T, 1], as the other
# implementations keep it); the block-range tables are rebuilt in the backward
# --------------------------------------------------------------------------

def _local(static, q, k):
    cfg, tiles = static
    return attention_op._local_config(cfg, q, k), tiles


def _partitioned_forward(static, q, k, v, bias, mask, q_seg, kv_seg, seed, sinks):
    cfg, _ = static

    def local(q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, *, reduced):
        c, tiles = _local(static, q, k)
        return mosaic_gpu_forward.forward(c, tiles, q, k, v, q_seg, kv_seg, sinks, seed, bias,
                                          mask)

    dims = attention_op._dims(cfg, bias, mask)
    return partitioned(_OP, local, (q, k, v, bias, mask, q_seg, kv_seg, seed, sinks),
                       dims.operands, (dims.out, dims.lse), gather=dims.gather)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _flash(q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, static):
    return _partitioned_forward(static, q, k, v, bias, mask, q_seg, kv_seg, seed, sinks)


def _flash_fwd(q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, static):
    # symbolic_zeros: each array argument arrives as (value, perturbed); None stays None.
    values = [None if x is None else x.value
              for x in (q, k, v, bias, mask, q_seg, kv_seg, seed, sinks)]
    bias_wanted = bias is not None and bias.perturbed
    out, lse = _partitioned_forward(static, *values)
    return (out, lse), ((*values, out, lse), bias_wanted)


def _flash_bwd(static, saved, cotangents):
    (q, k, v, bias, mask, q_seg, kv_seg, seed, sinks, out, lse), bias_wanted = saved
    cfg, _ = static
    do = cotangents[0]
    if type(do).__name__ == "SymbolicZero":  # out unused: every gradient is zero
        do = jnp.zeros(out.shape, out.dtype)
    dsinks = None if sinks is None else attention_op._sinks_grad(sinks, out, lse, do)

    def local(q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, do, *, reduced):
        c, tiles = _local(static, q, k)
        grads = mosaic_gpu_backward.backward(c, tiles, q, k, v, q_seg, kv_seg, out, lse, do,
                                             seed, bias, mask, want_dbias=bias_wanted)
        if not bias_wanted:
            return grads
        dq, dk, dv, dbias = grads
        # A bias broadcast over batch or heads sums its gradient over them, across devices
        # too where those dims are split (as the other implementations do).
        axes = tuple(d for d, full in enumerate(c.problem.bias_full) if not full)
        dbias = jnp.sum(dbias, axis=axes, keepdims=True)
        split = [f for f, full in zip(("b", "k"), c.problem.bias_full[:2]) if not full]
        return dq, dk, dv, psum(dbias, reduced, *split).astype(bias.dtype)

    dims = attention_op._dims(cfg, bias, mask)
    grads = partitioned(
        _OP, local, (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, do),
        (*dims.operands[:8], dims.out, dims.lse, dims.out),
        dims.operands[:3] + ((dims.operands[3],) if bias_wanted else ()),
        gather=dims.gather, reduce=("b", "k"), out_like=(0, 1, 2, 3))
    dq, dk, dv, *dbias = grads
    return (dq, dk, dv, dbias[0] if bias_wanted else None, None, None, None, None, dsinks)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


IMPLEMENTATION = _op.register_implementation(
    _OP, _op.Implementation(NAME, run, config=MosaicGPUConfig, supported=supported,
                            platforms=("gpu",)))

__all__ = ["IMPLEMENTATION", "MosaicGPUConfig", "run", "supported"]
