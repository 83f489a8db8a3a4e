"""``ops.dot_product_attention(implementation="mosaic_gpu")`` on a host without a GPU.

The Mosaic GPU kernels (ops/attention/mosaic_gpu*.py) run here in JAX's GPU
interpret mode with race detection (a race raises ``pallas_core.gpu.RaceError``),
each also lowered for ``cuda``: outputs, the logsumexp and gradients against a
float64 reference (written out in the test, jax.vjp for its gradients) on fresh random
inputs whose lengths do not divide the tiles, bfloat16 and float16, each option
built; the lowered modules' instructions; the refusals (an option not built, a
GPU older than sm_90) and the fallback of a sequence of implementations. The
interpreter costs seconds per kernel: the CI cases combine options, the sweeps
are ``slow``.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops import _op
from ops.attention import mosaic_gpu, mosaic_gpu_backward, mosaic_gpu_forward
from ops.attention.masking import MaskSpec, fold_lengths, visible
from ops.attention.mosaic_gpu_config import (COMPUTE_REGISTERS, SMEM_BYTES, MosaicGPUConfig,
                                             backward_registers, fits, resolve_backward,
                                             smem_bytes)
from pallas_core import gpu as plgpu
from pallas_core.gpu import target
from tests.tolerances import BACKWARD, FORWARD, assert_close, for_dtype

_KEYS = ("query_seq_lengths", "key_value_seq_lengths", "query_segment_ids",
         "key_value_segment_ids")


def _inputs(seed, b, t, s, n, k, h, hv=None, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), 4)
    hv = hv or h
    return (jax.random.normal(keys[0], (b, t, n, h), dtype),
            jax.random.normal(keys[1], (b, s, k, h), dtype),
            jax.random.normal(keys[2], (b, s, k, hv), dtype),
            jax.random.normal(keys[3], (b, t, n, hv), dtype))


def _segments(seed, b, length, parts=3):
    ids = jax.random.randint(jax.random.key(seed), (b, length), 0, parts)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


def _grouped(x, kv_heads):
    """A ``[B', N', T', S']`` bias / mask as ``[B', K', G', T', S']`` (heads split by group)."""
    b, n, t, s = x.shape
    return x.reshape(b, 1, 1, t, s) if n == 1 else x.reshape(b, kv_heads, n // kv_heads, t, s)


def _attention64(q, k, v, sinks, spec: MaskSpec, scale, cap, q_seg, kv_seg, bias=None,
                 mask=None):
    """``(out [B, T, N, Hv], lse [B, T, N])`` in float64, written out: scores, soft cap,
    bias, the mask of :func:`ops.attention.masking.visible` and the mask array, a sink
    column, softmax (a row that sees nothing: output 0, logsumexp -inf)."""
    b, t, n, _ = q.shape
    g = n // k.shape[2]
    qg = q.reshape(b, t, k.shape[2], g, -1)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) * scale
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    if bias is not None:
        s = s + _grouped(bias, k.shape[2])
    vis = visible(spec, jnp.arange(t)[:, None], jnp.arange(spec.S)[None, :],
                  None if q_seg is None else q_seg[:, None, None, :, None],
                  None if kv_seg is None else kv_seg[:, None, None, None, :])
    if mask is not None:
        vis = _grouped(mask, k.shape[2]) if vis is None else vis & _grouped(mask, k.shape[2])
    s = s if vis is None else jnp.where(vis, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.reshape(k.shape[2], g)[None, :, :, None, None]
        top = jnp.maximum(top, sink)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    e = jnp.exp(s - top)
    total = e.sum(-1, keepdims=True) + (0.0 if sinks is None else jnp.exp(sink - top))
    seen = total > 0
    p = e / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    out = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, v.shape[-1])
    return out, jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, n)


def _reference64(q, k, v, do, sinks=None, bias=None, mask=None, *, is_causal=False,
                 local_window_size=None, logits_soft_cap=None, scale=None, **ids):
    """``(out, lse, grads)`` in float64 (:func:`_attention64`; grads of q, k, v and, when
    given, sinks and bias)."""
    T, S, H = q.shape[1], k.shape[1], q.shape[-1]
    left = right = None
    if local_window_size is not None:
        left, right = ((local_window_size,) * 2 if isinstance(local_window_size, int)
                       else local_window_size)
    q_seg, kv_seg = fold_lengths(*(ids.get(name) for name in (
        "query_segment_ids", "key_value_segment_ids", "query_seq_lengths",
        "key_value_seq_lengths")), T, S)
    spec = MaskSpec(T=T, S=S, causal=is_causal, left=left, right=right,
                    segments=q_seg is not None)
    with jax.enable_x64(True):
        up = lambda x: jnp.asarray(np.asarray(x, np.float64))

        def f(q, k, v, *extra):
            extra = list(extra)
            s_ = extra.pop(0) if sinks is not None else None
            b_ = extra.pop(0) if bias is not None else None
            return _attention64(q, k, v, s_, spec, scale or H ** -0.5, logits_soft_cap, q_seg,
                                kv_seg, b_, None if mask is None else jnp.asarray(mask))

        @jax.jit
        def run(do, *primals):
            (out, lse), pullback = jax.vjp(f, *primals)
            return out, lse, pullback((do, jnp.zeros_like(lse)))

        primals = [up(q), up(k), up(v)] + [up(x) for x in (sinks, bias) if x is not None]
        out, lse, grads = run(up(do), *primals)
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def _mosaic(q, k, v, do, sinks=None, bias=None, mask=None, block_sizes=None, **kw):
    """``(out, lse, grads)`` of implementation="mosaic_gpu", jitted (one trace)."""

    def f(q, k, v, *extra):
        extra = list(extra)
        s_ = extra.pop(0) if sinks is not None else None
        b_ = extra.pop(0) if bias is not None else None
        return ops.dot_product_attention(q, k, v, b_, mask, implementation="mosaic_gpu",
                                         sinks=s_, block_sizes=block_sizes,
                                         return_residual=True, **kw)

    @jax.jit
    def run(q, k, v, do, *extra):
        (out, lse), pullback = jax.vjp(f, q, k, v, *extra)
        return out, lse, pullback((do, jnp.zeros_like(lse)))

    return run(q, k, v, do, *[x for x in (sinks, bias) if x is not None])


def _check(seed, shape, dtype, sinks=False, bias=None, mask=None, block_sizes=None, grads=True,
           **kw):
    """The op on mosaic_gpu against :func:`_reference64`; ``bias`` / ``mask``: the shape
    of a random float32 bias / boolean mask (80% attending), or None."""
    q, k, v, do = _inputs(seed, *shape, dtype=dtype)
    keys = jax.random.split(jax.random.key(seed + 1), 3)
    sink = jax.random.normal(keys[0], (q.shape[2],), jnp.float32) if sinks else None
    bias = None if bias is None else jax.random.normal(keys[1], bias, jnp.float32)
    mask = None if mask is None else jax.random.bernoulli(keys[2], 0.8, mask)
    want_out, want_lse, want_grads = _reference64(q, k, v, do, sink, bias, mask, **kw)
    if grads:
        out, lse, got = _mosaic(q, k, v, do, sink, bias, mask, block_sizes, **kw)
    else:
        out, lse = ops.dot_product_attention(q, k, v, bias, mask, implementation="mosaic_gpu",
                                             sinks=sink, block_sizes=block_sizes,
                                             return_residual=True, **kw)
    fwd_tol, bwd_tol = for_dtype(FORWARD, dtype), for_dtype(BACKWARD, dtype)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, want_out, fwd_tol, "out")
    seen = np.isfinite(want_lse)
    assert (np.isfinite(np.asarray(lse)) == seen).all(), "rows that see no key: -inf"
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-2, rtol=0)
    if grads:
        names = (["dq", "dk", "dv"] + ["dsinks"] * (sink is not None)
                 + ["dbias"] * (bias is not None))
        for name, g, want in zip(names, got, want_grads):
            assert g.dtype == (jnp.float32 if name in ("dsinks", "dbias") else q.dtype), name
            if name == "dbias" and not bias.shape[3] > 1:
                # Summed over the keys, a row's bias gradient is sum_j p_j (dp_j - delta) = 0:
                # only rounding is left, held to the per-entry gradients' scale.
                full = _reference64(q, k, v, do, sink, jnp.broadcast_to(bias, (
                    q.shape[0], q.shape[2], q.shape[1], k.shape[1])), mask, **kw)[2][-1]
                assert np.max(np.abs(np.asarray(g) - want)) <= bwd_tol * np.max(np.abs(full)) * \
                    k.shape[1], name
                continue
            assert_close(g, want, bwd_tol, name)


# --- forward and gradients in the interpret mode (CI: options combined) --------------------------


def test_causal_gqa_soft_cap_sinks_bias_bfloat16():
    # B=2, T=S=72 (not a multiple of the 64-row tiles), 4 query heads over 2 key/value heads;
    # a bias broadcast over the batch, read in tiles, and its gradient.
    _check(0, (2, 72, 72, 4, 2, 64), jnp.bfloat16, sinks=True, bias=(1, 4, 72, 72),
           is_causal=True, logits_soft_cap=5.0)


def test_window_segments_lengths_mla_dims_key_mask_float16():
    # T != S, neither a multiple of the tiles; head dims 48 / 32 (a value head dim of its
    # own, as MLA's 192 / 128), a two-sided window, segment ids with key lengths folded in,
    # a mask over keys per batch entry; the backward's serial steps (each waits for its
    # accumulating products before the next issues), 128 rows a step in both kernels
    # (the causal GQA case: dQ 128 and dK/dV 64, pipelined).
    b, t, s = 1, 100, 88
    _check(1, (b, t, s, 2, 1, 48, 32), jnp.float16, local_window_size=(24, 12),
           mask=(b, 1, 1, s), query_segment_ids=_segments(3, b, t),
           key_value_segment_ids=_segments(3, b, s),
           key_value_seq_lengths=jnp.array([80], jnp.int32),
           block_sizes=MosaicGPUConfig(64, 128, 4, intra_wg_stages_dq=1, intra_wg_stages_dkdv=1))


def test_full_attention_one_compute_warpgroup_soft_cap_forward():
    # One compute warpgroup (no ping-pong), 64-row key tiles, 3 stages; S not a multiple of 8
    # (TMA tiles whole arrays: k and v are padded in XLA) and a query row set past T; a soft
    # cap without bias (its factor folded into the exp2's multiply-add).
    _check(2, (1, 70, 150, 2, 2, 64), jnp.bfloat16, grads=False, logits_soft_cap=4.0,
           block_sizes=MosaicGPUConfig(64, 64, 3, compute_wgs=1))


def _against_xla(seed, shape, dtype, grads, **kw):
    """implementation="mosaic_gpu" against the op's XLA path on float32 inputs (dropout:
    both draw the same keep bits from the counter hash, so only rounding differs)."""
    q, k, v, do = _inputs(seed, *shape, dtype=dtype)
    blocks = kw.pop("block_sizes", None)
    f = lambda impl: lambda q, k, v: ops.dot_product_attention(
        q, k, v, implementation=impl, block_sizes=blocks if impl == "mosaic_gpu" else None, **kw)
    up = lambda x: x.astype(jnp.float32)
    want, pullback = jax.vjp(f("xla"), up(q), up(k), up(v))
    if not grads:
        assert_close(f("mosaic_gpu")(q, k, v), want, for_dtype(FORWARD, dtype), "out")
        return
    got, got_grads = jax.jit(lambda q, k, v, do: (lambda o, pb: (o, pb(do)))(
        *jax.vjp(f("mosaic_gpu"), q, k, v)))(q, k, v, do)
    assert_close(got, want, for_dtype(FORWARD, dtype), "out")
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, pullback(up(do))):
        assert_close(g, w, for_dtype(BACKWARD, dtype), name)


def test_dropout_forward_draws_the_xla_paths_bits():
    # The serial walk (no pipeline inside a warpgroup) with its ping-pong.
    _against_xla(5, (1, 64, 72, 2, 1, 32), jnp.bfloat16, grads=False, dropout_rate=0.3,
                 dropout_rng=jax.random.key(7),
                 block_sizes=MosaicGPUConfig(64, 64, 2, intra_wg_stages=1))


def test_races_are_checked(monkeypatch):
    """The kernels run under the race detector: drop the wait for the value tile's TMA
    copy and the forward kernel is caught reading it unordered."""
    from ops.attention import mosaic_gpu_tiles

    real = mosaic_gpu_tiles.Ring.wait_full

    def skip_values(self, t):
        if self.buffers[0].shape[-1] == 32:  # the value ring (Hv = 32 here)
            return None
        return real(self, t)

    monkeypatch.setattr(mosaic_gpu_tiles.Ring, "wait_full", skip_values)
    q, k, v, _ = _inputs(4, 1, 64, 64, 1, 1, 64, 32)
    with pytest.raises(Exception, match="RaceError|race"):
        jax.block_until_ready(ops.dot_product_attention(q, k, v, implementation="mosaic_gpu"))


# --- what the kernels lower to (cuda, from this host) --------------------------------------------


def test_lowered_modules_have_wgmma_tma_barriers_and_register_reallocation():
    """The kernels of a training step at head dim 128 with the serial steps of round 1's
    forward and round 2's backward (no turns in the backward); the backward's step
    lengths as resolved by default (128 key rows a dQ step, 64 query rows a dK/dV one)."""
    B, T, N, H = 2, 1024, 4, 128
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    config = MosaicGPUConfig(64, 128, 2, intra_wg_stages=1, bwd_turns=1)

    def train(q, k, v):
        out, pullback = jax.vjp(
            lambda q, k, v: ops.dot_product_attention(q, k, v, is_causal=True, block_sizes=config,
                                                      implementation="mosaic_gpu"), q, k, v)
        return pullback(out)

    fwd, dq, dkdv = plgpu.mosaic_modules(train, q, q, q)
    # Per key/value step of 64 x 128 tiles: 8 m64n128k16 wgmma for q k^T and 8 for p v, in
    # each of the three loops (masked, unmasked, masked).
    assert fwd.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 3 * 16
    # dQ (128 key rows a step): q k^T, dO v^T and ds k 8 m64n128k16 each; dK/dV (64 query
    # rows a step): k q^T and v dO^T 8 each (m64n64k16), p^T dO and ds^T q 4 each.
    assert dq.count("wgmma.mma_async.sync.aligned.m64n128k16") == 3 * 24
    assert dkdv.count("wgmma.mma_async") == 3 * 24
    for module in (fwd, dq, dkdv):
        assert module.count("nvvm.setmaxregister") == 2  # 232 up (compute), 40 down (TMA)
        assert "nvvm.cp.async.bulk.tensor.shared.cluster.global" in module  # TMA loads
        assert re.search(r"cp\.async\.bulk\.tensor\.global\.shared", module)  # TMA stores
        assert "nvvm.mbarrier.try_wait.parity" in module and "nvvm.mbarrier.arrive" in module
    assert "ex2.approx" in fwd  # the softmax on exp2
    # Every kernel serial, dQ's steps waiting for no turn (see the next test).
    _assert_schedules((fwd, dq, dkdv), (1, 1, 1), turns=False)


_EVENTS = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+[^{]*\{[^}]*\}, (\{)?"
                     r"|wgmma\.wait\.group\.sync\.aligned (\d+)|ex2\.approx|scf\.for")


def _wgmma_schedule(module: str) -> str:
    """The order of a compute warpgroup's tensor-core and exp2 work in a lowered module,
    runs of one kind merged: ``qk`` a ``wgmma`` reading both operands from shared
    memory, ``pv`` one taking its left operand from registers, ``wait0`` / ``wait1``
    ``wgmma.wait_group``, ``exp2`` ``ex2.approx``, ``loop`` each ``scf.for``."""
    events = []
    for match in _EVENTS.finditer(module):
        text = match.group(0)
        if text.startswith("wgmma.mma"):
            event = "pv" if match.group(1) else "qk"
        elif text.startswith("wgmma.wait"):
            event = "wait" + match.group(2)
        else:
            event = "exp2" if text.startswith("ex2") else "loop"
        if not events or events[-1] != event or event == "loop":
            events.append(event)
    return " ".join(events)


def _compute_loop_waits(module: str) -> list[int]:
    """``mbarrier`` waits in each ``scf.for`` body up to its first ``scf.yield`` that
    holds a ``wgmma`` (a compute warpgroup's loop carries its accumulators; the last
    three are its masked, unmasked and masked loops)."""
    counts = []
    for body in module.split("scf.for")[1:]:
        if "wgmma.mma_async" in body:
            counts.append(body.split("scf.yield")[0].count("mbarrier.try_wait"))
    return counts


def _assert_schedules(modules, orders, turns: bool):
    """The forward's, dQ's and dK/dV's lowered modules follow their pipelines inside a
    warpgroup (``orders``: each one's stages), and dQ's steps wait as the turns say."""
    for name, module, stages in zip(("fwd", "dq", "dkdv"), modules, orders):
        # The loops before the compute warpgroups' three (masked, unmasked, masked): the
        # producer's, and in dK/dV the loops over the group's query heads.
        before = "loop loop loop" if name == "dkdv" else "loop"
        if stages == 2:
            step = f"loop qk pv wait{2 if name == 'dkdv' else 1} exp2 wait0"
            want = f"{before} qk wait0 exp2 {step} {step} {step} pv wait0"
        else:
            step = "loop qk wait0 exp2 pv wait0"
            want = f"{before} {step} {step} {step}"
        assert _wgmma_schedule(module) == want, name
    # dQ's steps wait for the key and value stages, and with turns for its turn and at
    # the meeting after issuing.
    waits = _compute_loop_waits(modules[1])[-3:]
    assert waits == [2 + 2 * turns] * 3, waits


def test_kernels_issue_the_next_products_before_this_steps_elementwise_work():
    """FlashAttention-3's two-stage pipeline inside a warpgroup (section 3.2), read off the
    lowered kernels of a training step (``orders``: the forward's, dQ's and dK/dV's
    stages). Forward: in every loop step ``q k^T`` of tile j and ``p v`` of tile j-1 are
    issued, the wait leaves one group (``p v``) in flight, tile j's exp2s run, and only
    then the last wait; the first tile's ``q k^T`` and the last ``p v`` stand alone; with
    ``intra_wg_stages=1`` each step runs ``q k^T``, its exp2s and ``p v`` in turn. The
    backward kernels alike: 2 issues step t's ``s``, ``dp`` and step t-1's accumulating
    products, waits with those left (1 group in dQ, 2 in dK/dV), runs step t's exp2s;
    1 waits for ``s``, ``dp``, runs the exp2s, then issues and waits for the
    accumulating products (the previous test; the defaults at head dim 128). With two
    warpgroups taking turns, each step of a compute loop waits twice more (its turn, the
    meeting after issuing) than without. Here at head dim 64, every kernel pipelined
    (64-row dK/dV steps), turns."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    config = MosaicGPUConfig(64, 128, 2, block_q_dkv=64)

    def train(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: ops.dot_product_attention(
            q, k, v, is_causal=True, implementation="mosaic_gpu", block_sizes=config), q, k, v)
        return pullback(out)

    _assert_schedules(plgpu.mosaic_modules(train, q, q, q), (2, 2, 2), turns=True)


@pytest.mark.parametrize("h, hv", [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_heuristic_tiles_fit_shared_memory_as_the_lowering_counts(h, hv):
    """The heuristic's forward lowers for cuda within sm_90's 227 KiB (the lowering
    checks), and the budget it was picked by is no smaller than the lowering's count."""
    from jax.experimental.mosaic.gpu import core as mosaic_core
    problem = ops._op.get("dot_product_attention").problem((4096, 4096, max(h, hv)), "bfloat16")
    tiles = MosaicGPUConfig.heuristic(problem, _op.Device("mosaic_gpu"))
    predicted = smem_bytes(tiles, "forward", h, hv, 2)
    assert predicted <= SMEM_BYTES
    q = jax.ShapeDtypeStruct((1, 256, 2, h), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 256, 2, hv), jnp.bfloat16)
    f = lambda q, k, v: ops.dot_product_attention(q, k, v, implementation="mosaic_gpu",
                                                  block_sizes=tiles)
    old = mosaic_core._SMEM_SIZE_BOUND
    mosaic_core._SMEM_SIZE_BOUND = 1  # every kernel "too big": the error says its count
    try:
        with pytest.raises(ValueError, match=r"smem_bytes=(\d+)") as info:
            plgpu.mosaic_modules(f, q, q, v)
    finally:
        mosaic_core._SMEM_SIZE_BOUND = old
    counted = int(re.search(r"smem_bytes=(\d+)", str(info.value)).group(1))
    assert counted <= predicted <= counted + 1024, (tiles, counted, predicted)


# --- refusals, fallbacks, configs ----------------------------------------------------------------


@pytest.mark.parametrize("kw, words", [(dict(block_sizes=(64, 64)), "block_sizes")])
def test_options_not_built_fall_back(kw, words):
    q = jax.random.normal(jax.random.key(5), (1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=words):
        ops.dot_product_attention(q, q, q, implementation="mosaic_gpu", **kw)
    got = ops.dot_product_attention(q, q, q, implementation=("mosaic_gpu", "xla"), **kw)
    want = ops.dot_product_attention(q, q, q, implementation="xla", **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype, h, hv, words", [
    (jnp.float32, 64, 64, "dtype float32"), (jnp.bfloat16, 24, 24, "head dims"),
    (jnp.bfloat16, 320, 320, "head dims"), (jnp.float16, 64, 264, "head dims"),
])
def test_shapes_not_built_are_named(dtype, h, hv, words):
    q = jnp.zeros((1, 8, 1, h), dtype)
    v = jnp.zeros((1, 8, 1, hv), dtype)
    with pytest.raises(NotImplementedError, match=words):
        ops.dot_product_attention(q, q, v, implementation="mosaic_gpu")


def test_backward_that_would_not_fit_registers_is_refused_under_differentiation():
    q = jnp.zeros((1, 8, 1, 256), jnp.bfloat16)
    f = lambda q: ops.dot_product_attention(q, q, q, implementation="mosaic_gpu").sum()
    with pytest.raises(NotImplementedError, match="dK/dV kernel|shared memory"):
        jax.grad(f)(q)
    # The forward alone runs at that head dim (checked abstractly: it lowers).
    (module,) = plgpu.mosaic_modules(lambda q: ops.dot_product_attention(
        q, q, q, implementation="mosaic_gpu"), jax.ShapeDtypeStruct((1, 64, 1, 256), jnp.bfloat16))
    assert "wgmma.mma_async" in module


class _Device:
    platform = "gpu"

    def __init__(self, kind, cc):
        self.device_kind, self.compute_capability = kind, cc


@pytest.mark.parametrize("kind, cc", [("NVIDIA A100-SXM4-80GB", "8.0"),
                                      ("Tesla V100-SXM2-16GB", "7.0")])
def test_refuses_gpus_older_than_sm90_before_tracing(monkeypatch, kind, cc):
    monkeypatch.setattr(target, "default_device", lambda: _Device(kind, cc))
    monkeypatch.setattr(_op.Target, "current", classmethod(lambda cls: cls("gpu", kind)))
    traced = []
    monkeypatch.setattr(mosaic_gpu_forward, "forward", lambda *args: traced.append(args))
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=f"sm_90.*{kind}|{kind}.*sm_90"):
        ops.dot_product_attention(q, q, q, implementation="mosaic_gpu")
    assert not traced


def test_empty_operands_give_the_reference():
    q = jnp.zeros((1, 0, 2, 64), jnp.bfloat16)
    k = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    assert ops.dot_product_attention(q, k, k, implementation="mosaic_gpu").shape == (1, 0, 2, 64)


def test_config_is_checked_and_the_tuner_gets_candidates():
    for bad in (dict(block_q=32), dict(block_kv=320), dict(max_concurrent_steps=1),
                dict(compute_wgs=3), dict(block_q_dkv=48), dict(intra_wg_stages=3),
                dict(max_concurrent_steps_bwd=1), dict(bwd_turns=3), dict(intra_wg_stages_dq=0),
                dict(intra_wg_stages_dkdv=True), dict(compute_wgs=1, bwd_turns=2)):
        with pytest.raises(ValueError, match="MosaicGPUConfig"):
            MosaicGPUConfig(**bad)
    op = ops._op.get("dot_product_attention")
    assert op.config_type("mosaic_gpu") is MosaicGPUConfig
    device = _op.Device("mosaic_gpu")
    for dims in ((8192, 8192, 128), (8192, 8192, 64), (4096, 4096, 256)):
        problem = op.problem(dims, "bfloat16", {"causal": True})
        candidates = MosaicGPUConfig.candidates(problem, device)
        assert candidates and len(set(candidates)) == len(candidates)
        head_dim = dims[2]
        assert all(fits(c, head_dim, head_dim, 2, False) for c in candidates), dims
    problem = op.problem((8192, 8192, 128), "bfloat16")
    assert MosaicGPUConfig.heuristic(problem, device) == MosaicGPUConfig(64, 128, 2)
    assert mosaic_gpu_backward.dkdv_accumulator_registers(MosaicGPUConfig(), 128, 128) == 128


@pytest.mark.parametrize("h, hv, kw, want", [
    # dQ 128-row steps, serial: 64 + 128 + 32 = 224 registers (2 stages of them fill the
    # shared memory); dK/dV 64-row steps, serial: 128 + 64 + 32 = 224 with the statistics
    # folded (pipelined 256, 128-row steps 288).
    (128, 128, {}, (2, 128, 1, 64, 1)),
    # dQ pipelined: 32 + 128 + 32 + 32; dK/dV 128-row steps serial: 64 + 128 + 32.
    (64, 64, {}, (4, 128, 2, 128, 1)),
    # dK/dV: + 2 x 16 columns of statistics, 64-row steps pipelined: 64 + 64 + 32 + 32 + 32.
    (64, 64, dict(soft_cap=True, dropout=True), (4, 128, 2, 64, 2)),
    # The logsumexp's 16 columns: nothing holds the dK/dV kernel within 232; the fewest.
    (128, 128, dict(soft_cap=True), (2, 128, 1, 64, 1)),
    (192, 128, {}, (3, 64, 2, 64, 1)),  # MLA: dK/dV's accumulators alone take 160
])
def test_backward_is_resolved_within_registers_and_shared_memory(h, hv, kw, want):
    tiles = resolve_backward(MosaicGPUConfig(64, 128, 2), h, hv, 2, **kw)
    assert (tiles.max_concurrent_steps_bwd, tiles.dq_kv, tiles.intra_wg_stages_dq,
            tiles.dkdv_q, tiles.intra_wg_stages_dkdv) == want
    assert tiles.bwd_turns == 2
    assert fits(tiles, h, hv, 2, False, ("dq", "dkdv"))
    folds = dict(lse_folded="soft_cap" not in kw, delta_folded="dropout" not in kw)
    for kernel in ("dq", "dkdv"):
        stages = getattr(tiles, f"intra_wg_stages_{kernel}")
        used = backward_registers(tiles, kernel, h, hv, stages=stages, **folds)
        assert used <= COMPUTE_REGISTERS or (kernel, h, kw) in (
            ("dkdv", 128, dict(soft_cap=True)), ("dkdv", 192, {})), (kernel, used)
    # Fields given are kept; a 128-row dQ step at head dim 128 holds 224 (serial only).
    kept = resolve_backward(MosaicGPUConfig(64, 128, 2, block_kv_dq=128, bwd_turns=1), 128, 128, 2)
    assert (kept.bwd_turns, kept.intra_wg_stages_dq) == (1, 1)
    assert backward_registers(kept, "dq", 128, 128) == 224


# --- slow: the sweeps ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("option", [
    {}, dict(is_causal=True), dict(local_window_size=40), dict(local_window_size=(0, 30)),
    dict(logits_soft_cap=3.0), dict(sinks=True),
    dict(query_seq_lengths=np.array([50, 130], np.int32),
         key_value_seq_lengths=np.array([0, 90], np.int32)),
], ids=["plain", "causal", "window", "right_window", "soft_cap", "sinks", "lengths"])
def test_each_option(dtype, option):
    option = dict(option)
    sinks = option.pop("sinks", False)
    option = {k: (jnp.asarray(v) if k in _KEYS else v) for k, v in option.items()}
    _check(10, (2, 130, 100, 4, 1, 64), dtype, sinks=sinks, **option)


@pytest.mark.slow
@pytest.mark.parametrize("bias, mask", [
    ((2, 4, 130, 100), None), ((1, 1, 1, 100), (2, 1, 130, 100)), ((2, 1, 130, 1), None),
    ((1, 4, 1, 1), (1, 4, 1, 100)), (None, (2, 4, 130, 100)), (None, (1, 1, 130, 1)),
], ids=["tile", "keys+mask_tile", "queries", "scalar+mask_keys", "mask_tile", "mask_queries"])
def test_bias_and_mask_forms(bias, mask):
    _check(15, (2, 130, 100, 4, 2, 64), jnp.bfloat16, bias=bias, mask=mask, is_causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("h, hv, grads", [(64, 64, True), (128, 128, True), (256, 256, False),
                                          (192, 128, True)])
def test_head_dims(h, hv, grads):
    _check(11, (1, 136, 136, 2, 1, h, hv), jnp.bfloat16, grads=grads, is_causal=True)


@pytest.mark.slow
def test_segment_ids_causal_and_deterministic_gradients():
    b, t = 2, 192
    kw = dict(is_causal=True, query_segment_ids=_segments(12, b, t, 4),
              key_value_segment_ids=_segments(12, b, t, 4))
    _check(12, (b, t, t, 2, 2, 64), jnp.bfloat16, **kw)
    q, k, v, do = _inputs(12, b, t, t, 2, 2, 64)
    first = _mosaic(q, k, v, do, **kw)[2]
    again = _mosaic(q, k, v, do, **kw)[2]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("config, kw", [
    # Round 2's backward: no turns, every step waits for its accumulating products.
    (MosaicGPUConfig(64, 64, 2, bwd_turns=1, intra_wg_stages_dq=1, intra_wg_stages_dkdv=1), {}),
    # Pipelined without turns, a 3-stage ring; a soft cap (the logsumexp not folded).
    (MosaicGPUConfig(64, 64, 2, bwd_turns=1, max_concurrent_steps_bwd=3, intra_wg_stages_dq=2,
                     intra_wg_stages_dkdv=2), dict(logits_soft_cap=4.0)),
    # Turns and pipelines on a 2-stage ring (the producer waits for the accumulating
    # products), 64-row steps, a bias tile (with its gradient).
    (MosaicGPUConfig(64, 64, 2, max_concurrent_steps_bwd=2, block_kv_dq=64, block_q_dkv=64,
                     intra_wg_stages_dq=2, intra_wg_stages_dkdv=2), dict(bias=(1, 4, 130, 100))),
    # Serial steps with turns, 128-row dK/dV query steps, a soft cap.
    (MosaicGPUConfig(64, 64, 3, block_q_dkv=128, intra_wg_stages_dq=1, intra_wg_stages_dkdv=1),
     dict(logits_soft_cap=4.0)),
    # One compute warpgroup (no turns), pipelined.
    (MosaicGPUConfig(64, 64, 2, compute_wgs=1, intra_wg_stages_dq=2, intra_wg_stages_dkdv=2), {}),
], ids=["serial-no-turns", "pipelined-no-turns-cap", "pipelined-turns-2stages-bias",
        "serial-turns-dkdv128-cap", "one-warpgroup"])
def test_backward_schedules_deterministic(config, kw):
    """Each backward schedule against the float64 reference (causal GQA, lengths that do
    not divide the tiles), and its gradients bit for bit the same on a second run."""
    _check(16, (2, 130, 100, 4, 2, 64), jnp.bfloat16, block_sizes=config, is_causal=True, **kw)
    q, k, v, do = _inputs(16, 2, 130, 100, 4, 2, 64)
    kw = dict(kw)
    bias = kw.pop("bias", None)
    bias = None if bias is None else jax.random.normal(jax.random.key(17), bias, jnp.float32)
    first = _mosaic(q, k, v, do, bias=bias, block_sizes=config, is_causal=True, **kw)[2]
    again = _mosaic(q, k, v, do, bias=bias, block_sizes=config, is_causal=True, **kw)[2]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dropout_with_gradients(dtype):
    _against_xla(14, (2, 100, 72, 4, 2, 64), dtype, grads=True, is_causal=True,
                 dropout_rate=0.2, dropout_rng=jax.random.key(8), logits_soft_cap=6.0)


@pytest.mark.slow
def test_matches_jax_nn():
    q, k, v, _ = _inputs(13, 1, 128, 128, 2, 1, 64)
    for causal in (False, True):
        want = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                            v.astype(jnp.float32), is_causal=causal)
        got = ops.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic_gpu")
        assert_close(got, want, for_dtype(FORWARD, jnp.bfloat16), f"causal={causal}")


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_the_gpu():
    """On an sm_90+ GPU the kernels compile and run for real; an older GPU refuses them."""
    cc = target.compute_capability(jax.devices()[0])
    q, k, v, do = _inputs(20, 2, 1000, 1000, 8, 2, 128)
    if cc is None or cc < target.MIN_COMPUTE_CAPABILITY:
        with pytest.raises(NotImplementedError, match="sm_90"):
            ops.dot_product_attention(q, k, v, implementation="mosaic_gpu")
        return
    for kw in ({}, dict(is_causal=True), dict(is_causal=True, logits_soft_cap=20.0)):
        _check(20, (2, 1000, 1000, 8, 2, 128), jnp.bfloat16, **kw)


def test_lease_queue_config_arms_reach_the_kernels(monkeypatch):
    """Each mosaic-gpu experiment's config arm (a tuning-cache entry with its variant) is
    the config the kernels are called with on its case (traced abstractly, kernels stubbed)."""
    from benchmarks import lease_queue
    seen = []

    def forward(cfg, tiles, q, k, v, *rest, **kw):
        seen.append(tiles)
        B, T, N, _ = q.shape
        return (jnp.zeros((B, T, N, v.shape[-1]), q.dtype), jnp.zeros((B, N, T, 1), jnp.float32))

    def backward(cfg, tiles, q, k, v, *rest, **kw):
        seen.append(tiles)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    monkeypatch.setattr(mosaic_gpu_forward, "forward", forward)
    monkeypatch.setattr(mosaic_gpu_backward, "backward", backward)
    experiments = [e for e in lease_queue.load_queue()
                   if e["name"].startswith("mosaic-gpu-attention")]
    assert experiments
    for experiment in experiments:
        for arm in experiment["arms"]:
            if arm["implementation"] != "mosaic_gpu":
                continue
            case = lease_queue.resolve_case(arm["case"], "gpu", quick=False)
            args = jax.eval_shape(case.make_inputs, jax.random.key(0))
            seen.clear()
            with lease_queue.arm_settings(arm, case):
                jax.eval_shape(case.implementations["mosaic_gpu"], *args)
            fields = arm.get("config", {}).get("fields")
            assert seen and all(t == seen[0] for t in seen), arm["label"]
            if fields:
                assert {k: getattr(seen[0], k) for k in fields} == fields, arm["label"]
            else:
                assert seen[0] == MosaicGPUConfig.heuristic(
                    ops._op.get("dot_product_attention").problem(
                        (case.shape[1], case.shape[2], case.shape[5]), case.dtype),
                    _op.Device("mosaic_gpu")), arm["label"]


def test_refuses_masked_calls_under_a_ptxas_that_miscompiles_them(monkeypatch):
    monkeypatch.setattr(_op.Target, "current", classmethod(lambda cls: cls("gpu", "NVIDIA H100")))
    monkeypatch.setattr(mosaic_gpu, "_why_not_device", lambda call: None)
    monkeypatch.setattr(mosaic_gpu, "_cuda_runtime_version", lambda: 12080)
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="ptxas"):
        ops.dot_product_attention(q, q, q, is_causal=True, implementation="mosaic_gpu")
    monkeypatch.setattr(mosaic_gpu, "_cuda_runtime_version", lambda: 12091)
    monkeypatch.setattr(mosaic_gpu_forward, "forward", lambda *args, **kw: (_ for _ in ()).throw(
        NotImplementedError("reached the kernels")))
    with pytest.raises(NotImplementedError, match="reached the kernels"):
        ops.dot_product_attention(q, q, q, is_causal=True, implementation="mosaic_gpu")
