"""ops.paged_attention against JAX's own ``paged_attention_reference`` (and JAX's GPU kernel
on its interpreter), on random pages, page tables and lengths (0, 1, partial, full pages),
GQA ratios, windows, soft caps, int8 pages with per-token scales and sinks; every
kernel backend (Triton's CPU interpreter for ``triton``); bad input named."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

import ops
from ops.serving import PagedBlockSizes, block_sizes, kernels
from tests.test_lowering import lower_text
from tests.op_battery import Case, OpBattery, OpSpec
from tests.tolerances import FORWARD, assert_close

F32 = jnp.float32


def make_case(seed, *, B=4, N=8, K=2, H=32, page_size=16, pages_per_seq=4, total_pages=20,
              dtype=F32, lengths=None, int8=False):
    """Random q, pages, tables of distinct random pages (no page shared), and lengths."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, N, H)).astype(np.float32)
    shape = (K, total_pages, page_size, H)
    if int8:
        k = rng.integers(-127, 128, shape).astype(np.int8)
        v = rng.integers(-127, 128, shape).astype(np.int8)
        ks = rng.uniform(0.002, 0.02, shape[:3]).astype(np.float32)
        vs = rng.uniform(0.002, 0.02, shape[:3]).astype(np.float32)
        scales = (jnp.asarray(ks), jnp.asarray(vs))
    else:
        k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        scales = (None, None)
    tables = rng.permutation(total_pages)[:B * pages_per_seq].reshape(B, pages_per_seq)
    if lengths is None:
        lengths = rng.integers(1, pages_per_seq * page_size + 1, B)
    cast = (lambda x: jnp.asarray(x)) if int8 else (lambda x: jnp.asarray(x, dtype))
    return (jnp.asarray(q, dtype), cast(k), cast(v), jnp.asarray(tables, jnp.int32),
            jnp.asarray(lengths, jnp.int32)) + scales


def dense(pages, tables, scales=None):
    """JAX's reference layout ``[B, S, K, H]`` float32 from pages and tables (dequantized)."""
    x = pages.astype(F32)
    if scales is not None:
        x = x * scales[..., None]
    x = x[:, tables]  # [K, B, pps, ps, H]
    K, B, n, ps, H = x.shape
    return jnp.moveaxis(x, 0, 3).reshape(B, n * ps, K, H)


def jax_reference(q, k_pages, v_pages, tables, lengths, ks=None, vs=None, *, scale=1.0,
                  soft_cap=None):
    """JAX's ``paged_attention_reference`` (float32); rows of length 0 are 0 (ours)."""
    out = jax_paged.paged_attention_reference(
        q.astype(F32) * scale, dense(k_pages, tables, ks), dense(v_pages, tables, vs), lengths,
        attn_logits_soft_cap=None if soft_cap is None else soft_cap)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)


def reference_with(q, k_pages, v_pages, tables, lengths, *, scale, left=None, sinks=None):
    """float64 numpy: each sequence's last ``left + 1`` keys, the sink as a key of value 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, dense(k_pages, tables),
                                                   dense(v_pages, tables)))
    B, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros((B, N, H))
    for b in range(B):
        n = int(lengths[b])
        lo = 0 if left is None else max(n - 1 - left, 0)
        for h in range(N):
            s = k[b, lo:n, h // G] @ q[b, h] * scale
            if sinks is not None:
                s = np.append(s, float(sinks[h]))
            if len(s) == 0:
                continue
            p = np.exp(s - s.max())
            p /= p.sum()
            out[b, h] = p[:n - lo] @ v[b, lo:n, h // G]
    return out


KERNELS = ["interpret", "triton"]


@pytest.mark.parametrize("impl", KERNELS)
def test_matches_jax_reference_gqa_lengths_splits(impl):
    # Lengths 0, one token, a partial page and every page full; GQA 4:1; two splits of
    # two pages per step (the merge kernel runs) on the kernels.
    q, kp, vp, tables, _, _, _ = make_case(0)
    lengths = jnp.asarray([0, 1, 37, 64], jnp.int32)
    out = ops.paged_attention(q, kp, vp, tables, lengths, scale=0.2, implementation=impl,
                              block_sizes=PagedBlockSizes(2, 2))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, jax_reference(q, kp, vp, tables, lengths, scale=0.2), FORWARD[F32], impl)
    assert np.all(np.asarray(out[0]) == 0)


@pytest.fixture
def per_page_kernel(monkeypatch):
    """The per-page decode kernel (Mosaic TPU's, and where multi-page tiles do not fit) on
    the interpreters: no key tile of several pages is small enough."""
    monkeypatch.setattr(block_sizes, "MULTI_PAGE_TILE_BYTES", 0)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("per_page", [False, True])
def test_int8_pages_soft_cap_one_split(impl, per_page, monkeypatch):
    # int8 pages with per-token scales dequantized in the kernel, a soft cap, MQA (K = 1),
    # one split (no merge), one page per step (raised to 16 keys per tile on triton when
    # the tiles take several pages); on both kernels.
    if per_page:
        monkeypatch.setattr(block_sizes, "MULTI_PAGE_TILE_BYTES", 0)
    q, kp, vp, tables, lengths, ks, vs = make_case(1, N=4, K=1, int8=True)
    out = ops.paged_attention(q, kp, vp, tables, lengths, ks, vs, logits_soft_cap=2.0,
                              implementation=impl, block_sizes=(1, 1))
    assert_close(out, jax_reference(q, kp, vp, tables, lengths, ks, vs, soft_cap=2.0),
                 FORWARD[F32], impl)


@pytest.mark.parametrize("impl", ["xla"] + KERNELS)
def test_window_and_sinks(impl):
    q, kp, vp, tables, _, _, _ = make_case(2, N=16, K=2)
    lengths = jnp.asarray([64, 5, 30, 0], jnp.int32)
    sinks = jnp.asarray(np.linspace(-1.0, 2.0, 16), F32)
    out = ops.paged_attention(q, kp, vp, tables, lengths, scale=0.25, local_window_size=(20, 0),
                              sinks=sinks, implementation=impl, block_sizes=(2, 2))
    expected = reference_with(q, kp, vp, tables, lengths, scale=0.25, left=20, sinks=sinks)
    assert_close(out, expected, FORWARD[F32], impl)


@pytest.mark.slow
def test_matches_jax_gpu_kernel_on_its_interpreter():
    # JAX's own GPU kernel (interpret=True) on the same call: block_h 16 needs N / K >= 16.
    q, kp, vp, tables, lengths, _, _ = make_case(3, B=2, N=16, K=1, pages_per_seq=4)
    theirs = jax_paged.paged_attention(q, kp, vp, tables, lengths, k_splits=2,
                                       pages_per_compute_block=2, interpret=True)
    ours = ops.paged_attention(q, kp, vp, tables, lengths, implementation="interpret",
                               block_sizes=(2, 2))
    assert_close(ours, theirs, 1e-5, "jax gpu kernel")


def test_bfloat16_jit_and_heuristic_default():
    q, kp, vp, tables, lengths, _, _ = make_case(4, dtype=jnp.bfloat16)
    f = jax.jit(functools.partial(ops.paged_attention, scale=0.2, implementation="interpret"))
    out = f(q, kp, vp, tables, lengths)
    assert out.dtype == jnp.bfloat16
    assert_close(out, jax_reference(q, kp, vp, tables, lengths, scale=0.2), FORWARD[jnp.bfloat16])


def test_garbage_past_the_lengths_is_ignored_and_lengths_none_is_full():
    # NaN in a page's slots past the length and out-of-range table entries past it
    # change nothing.
    q, kp, vp, tables, _, _, _ = make_case(5)
    lengths = jnp.asarray([20, 3, 64, 33], jnp.int32)
    dirty_v = vp.at[:, tables[0, 1], 4:].set(jnp.nan).at[:, tables[1, 0], 3:].set(jnp.nan)
    dirty_tables = tables.at[0, 2:].set(10_000).at[1, 1:].set(-5)
    out = ops.paged_attention(q, kp, dirty_v, dirty_tables, lengths, implementation="interpret",
                              block_sizes=(2, 2))
    assert_close(out, jax_reference(q, kp, vp, tables, lengths), FORWARD[F32])
    full = ops.paged_attention(q, kp, vp, tables, None, implementation="xla")
    assert_close(full, jax_reference(q, kp, vp, tables, jnp.full((4,), 64, jnp.int32)),
                 FORWARD[F32])


@pytest.mark.slow
@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("N,K", [(8, 8), (16, 2), (12, 3)])
@pytest.mark.parametrize("H", [64, 96])
def test_sweep_gqa_head_dims(impl, N, K, H):
    q, kp, vp, tables, lengths, _, _ = make_case(N + K + H, N=N, K=K, H=H, pages_per_seq=6,
                                                 total_pages=30)
    out = ops.paged_attention(q, kp, vp, tables, lengths, scale=H ** -0.5, implementation=impl,
                              block_sizes=(2, 3))
    assert_close(out, jax_reference(q, kp, vp, tables, lengths, scale=H ** -0.5), FORWARD[F32])


def test_mosaic_tpu_lowering():
    # Everything at once: int8 pages with per-token scales, sinks, a window and a soft cap.
    def f(q, k, v, tables, lengths, ks, vs, sinks):
        return ops.paged_attention(q, k, v, tables, lengths, ks, vs, sinks=sinks,
                                   local_window_size=40, logits_soft_cap=5.0,
                                   implementation="mosaic_tpu", block_sizes=(2, 2))
    i8 = jnp.int8
    text = lower_text(f, "mosaic_tpu", ((2, 16, 128), jnp.bfloat16), ((2, 32, 16, 128), i8),
                      ((2, 32, 16, 128), i8), ((2, 8), jnp.int32), ((2,), jnp.int32),
                      ((2, 32, 16), F32), ((2, 32, 16), F32), ((16,), F32))
    assert text.count("tpu_custom_call") == 2  # attention and merge


@pytest.fixture
def loop_walk_on_interpret(monkeypatch, per_page_kernel):
    """The per-page kernel's in-kernel loop walk (pallas_triton's, which cannot run on a
    CPU) on the interpreter."""
    monkeypatch.setattr(kernels, "walk", lambda backend: "loop")


def test_loop_walk_matches_jax_reference(loop_walk_on_interpret):
    # Lengths 0 .. full, three splits over two blocks (an empty split; the merge's
    # power-of-two block overhangs the splits), then int8 pages with scales and sinks.
    q, kp, vp, tables, _, _, _ = make_case(0)
    lengths = jnp.asarray([0, 1, 37, 64], jnp.int32)
    out = ops.paged_attention(q, kp, vp, tables, lengths, scale=0.2, implementation="interpret",
                              block_sizes=(2, 3))
    assert_close(out, jax_reference(q, kp, vp, tables, lengths, scale=0.2), FORWARD[F32])
    q, kp, vp, tables, lengths, ks, vs = make_case(1, N=4, K=1, int8=True)
    out = ops.paged_attention(q, kp, vp, tables, lengths, ks, vs, logits_soft_cap=2.0,
                              implementation="interpret", block_sizes=(1, 1))
    assert_close(out, jax_reference(q, kp, vp, tables, lengths, ks, vs, soft_cap=2.0),
                 FORWARD[F32])


def test_pallas_triton_lowering():
    def f(q, k, v, tables, lengths, ks, vs, sinks):
        return ops.paged_attention(q, k, v, tables, lengths, ks, vs, sinks=sinks,
                                   local_window_size=40, implementation="pallas_triton")
    i8 = jnp.int8
    text = lower_text(f, "pallas_triton", ((8, 32, 128), jnp.bfloat16), ((4, 512, 16, 128), i8),
                      ((4, 512, 16, 128), i8), ((8, 64), jnp.int32), ((8,), jnp.int32),
                      ((4, 512, 16), F32), ((4, 512, 16), F32), ((32,), F32))
    assert text.count("__gpu$xla.gpu.triton") == 2  # attention and merge
    with pytest.raises(NotImplementedError, match="power-of-two head_dim"):
        lower_text(lambda *a: ops.paged_attention(*a, implementation="pallas_triton"),
                   "pallas_triton", ((2, 8, 96), F32), ((2, 8, 16, 96), F32),
                   ((2, 8, 16, 96), F32), ((2, 4), jnp.int32), ((2,), jnp.int32))


def test_no_kernel_backends_fall_through():
    q, kp, vp, tables, lengths, _, _ = make_case(7)
    with pytest.raises(NotImplementedError, match="mosaic_gpu"):
        ops.paged_attention(q, kp, vp, tables, lengths, implementation="mosaic_gpu")
    out = ops.paged_attention(q, kp, vp, tables, lengths, implementation=("mosaic_gpu", "xla"))
    assert_close(out, jax_reference(q, kp, vp, tables, lengths), FORWARD[F32])
    # 8-token pages (below tl.dot's 16 rows as a tile of their own) run on key tiles of
    # several pages.
    small = make_case(7, B=1, page_size=8, total_pages=40, pages_per_seq=8)
    assert_close(ops.paged_attention(*small[:5], implementation="triton"),
                 jax_reference(*small[:5]), FORWARD[F32])


def _bad_inputs():
    q, kp, vp, tables, lengths, _, _ = make_case(8, B=2)
    i8 = kp.astype(jnp.int8)
    s = jnp.ones(kp.shape[:3], F32)
    good = dict(q=q, k_pages=kp, v_pages=vp, block_tables=tables, lengths=lengths)
    return [
        (dict(good, q=q[0]), ValueError, "q must have rank 3"),
        (dict(good, q=q.astype(jnp.int32)), TypeError, "q has dtype int32"),
        (dict(good, v_pages=vp[:, :10]), ValueError, "k_pages and v_pages must have the same shape"),
        (dict(good, k_pages=kp.astype(jnp.bfloat16)), TypeError, "k_pages has dtype bfloat16"),
        (dict(good, q=q[:, :7]), ValueError, "multiple of the number of key/value heads"),
        (dict(good, q=q[..., :16]), ValueError, "head dim of q"),
        (dict(good, block_tables=tables.astype(jnp.int16)), TypeError, "block_tables must be int32"),
        (dict(good, block_tables=tables[:1]), ValueError, "block_tables must have shape"),
        (dict(good, lengths=lengths[:1]), ValueError, "lengths must have shape"),
        (dict(good, k_scales_pages=s, v_scales_pages=s), ValueError, "k_scales_pages is for int8"),
        (dict(good, k_pages=i8, v_pages=i8, k_scales_pages=s[:, :3], v_scales_pages=s),
         ValueError, "k_scales_pages must have shape"),
        (dict(good, k_pages=i8, v_pages=i8, k_scales_pages=s), ValueError, "both k_scales_pages"),
        (dict(good, scale=float("nan")), ValueError, "scale must be a finite"),
        (dict(good, logits_soft_cap=0.0), ValueError, "logits_soft_cap must be"),
        (dict(good, local_window_size=-1), ValueError, "local_window_size must be"),
        (dict(good, sinks=jnp.zeros((3,))), ValueError, "sinks must have shape"),
        (dict(good, block_sizes=(0, 1)), ValueError, "block_sizes.pages_per_block"),
        (dict(good, block_sizes="big"), ValueError, "block_sizes must be"),
        (dict(good, implementation="cuda"), ValueError, "implementation must be"),
    ]


@pytest.mark.parametrize("case", range(19))
def test_bad_input_named(case):
    kwargs, error, match = _bad_inputs()[case]
    with pytest.raises(error, match=match):
        ops.paged_attention(**kwargs)


@pytest.mark.parametrize("impl", KERNELS)
def test_decode_over_small_pages_takes_multi_page_tiles(impl, monkeypatch):
    # 16-token pages, GQA 4:1, int8 pages with per-token scales, a window, a soft cap,
    # sinks, lengths 0 and full: key tiles of several pages (the query-blocked kernel of
    # ragged_paged_attention), three splits merged with the sinks; never the per-page kernel.
    def per_page(*a, **k):
        raise AssertionError("the per-page decode kernel ran")
    monkeypatch.setattr(kernels, "decode", per_page)
    q, kp, vp, tables, _, ks, vs = make_case(3, N=8, K=2, int8=True)
    lengths = jnp.asarray([0, 64, 48, 21], jnp.int32)
    kw = dict(scale=0.3, logits_soft_cap=3.0, local_window_size=(24, 0),
              sinks=jnp.linspace(-1.0, 1.5, 8))
    out = ops.paged_attention(q, kp, vp, tables, lengths, ks, vs, implementation=impl,
                              block_sizes=(2, 3), **kw)
    want = ops.paged_attention(q, kp, vp, tables, lengths, ks, vs, implementation="xla", **kw)
    assert_close(out, want, FORWARD[F32], impl)



# --------------------------------------------------------------------------
# The op battery (tests/op_battery.py): every implementation registered for a GPU
# --------------------------------------------------------------------------

def _battery_inputs(rng, dtype, b=3, n=8, k=2, h=128, page_size=16, pages_per_seq=8,
                    lengths=(0, 1, 100), int8=False, sinks=False):
    """q, key and value pages (int8 with per-token scale pages), tables of distinct
    random pages, lengths (0, one token, partial pages) and sinks (or None)."""
    total = b * pages_per_seq + 3
    shape = (k, total, page_size, h)
    q = jnp.asarray(rng.standard_normal((b, n, h), np.float32), dtype)
    if int8:
        kp, vp = (jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) for _ in range(2))
        ks, vs = (jnp.asarray(rng.uniform(0.005, 0.02, shape[:3]), F32) for _ in range(2))
    else:
        kp, vp = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))
        ks = vs = None
    tables = jnp.asarray(rng.permutation(total)[:b * pages_per_seq].reshape(b, pages_per_seq),
                         jnp.int32)
    sink_logits = jnp.asarray(rng.standard_normal(n), F32) if sinks else None
    return q, kp, vp, tables, jnp.asarray(lengths, jnp.int32), ks, vs, sink_logits


def _battery_paged(q, kp, vp, tables, lengths, ks=None, vs=None, sinks=None, **kwargs):
    return ops.paged_attention(q, kp, vp, tables, lengths, ks, vs, sinks=sinks, **kwargs)


def _battery_reference(*args, **kwargs):
    """The op's XLA path in float32 (held to JAX's reference and float64 above). With int8
    pages it dequantizes in float32, the kernels in q's dtype: within q's tolerance."""
    return _battery_paged(*args, implementation="xla", **kwargs)


# bfloat16 only on the GPU: a float32 query runs the per-page kernel, whose sm_90 compile
# spills and takes 40-65 s per case (bfloat16: about 4 s). On this host only XLA runs these
# (the kernels' CPU runs are the tests above). Serving only: no gradients.
PAGED_ATTENTION = OpSpec(
    name="paged_attention", op=_battery_paged, reference=_battery_reference,
    make_inputs=_battery_inputs, implementations=("xla",), dtypes=(jnp.bfloat16,),
    cases=[Case("lengths", options=dict(scale=128 ** -0.5), grads=False),
           Case("window_soft_cap_sinks", dict(sinks=True),
                dict(scale=128 ** -0.5, local_window_size=40, logits_soft_cap=20.0), grads=False),
           Case("int8_scales", dict(int8=True), grads=False),
           # 256-token pages: key tiles too large for the multi-page kernel (the per-page one).
           Case("pages_of_256", dict(page_size=256, pages_per_seq=2, lengths=(0, 1, 300)),
                dict(scale=128 ** -0.5), grads=False)],
    xla_is_reference=False, unavailable=None)


class TestPagedAttentionBattery(OpBattery):
    """paged_attention against its XLA path in float32."""
    spec = PAGED_ATTENTION
