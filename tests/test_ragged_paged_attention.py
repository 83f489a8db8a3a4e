"""ops.ragged_paged_attention against JAX's own ``ref_ragged_paged_attention``: mixed prefill,
decode and empty sequences over random pages and tables, GQA, sliding windows, soft caps,
int8 caches with scales, sinks; the per-token split-KV path (``block_q=1``) and the
query-blocked kernel; every kernel backend; bad input named. The op has no gradient
(serving only), so none is tested."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
    ref_ragged_paged_attention)

import ops
from ops.serving import PagedBlockSizes, kernels, prefill_kernels
from ops.serving.block_sizes import multi_page_decode, ragged_block_q
from tests.test_lowering import lower_text
from tests.op_battery import Case, OpBattery, OpSpec
from tests.tolerances import FORWARD, assert_close

F32 = jnp.float32


def make_case(seed, *, q_lens=(3, 1, 0, 5, 1), kv_lens=(20, 33, 0, 64, 16), T=12, N=4, K=2,
              H=32, page_size=16, pages_per_seq=4, total_pages=24, dtype=F32, int8=False,
              slots=None):
    """Random queries and a combined cache; sequence ``i`` has ``q_lens[i]`` new tokens at
    the end of its ``kv_lens[i]``; ``slots`` sequence slots (>= len(q_lens)), the unused
    ones holding garbage metadata."""
    rng = np.random.default_rng(seed)
    S = slots or len(q_lens)
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = 10_000
    lens = np.full(S, 999, np.int32)
    lens[:len(kv_lens)] = kv_lens
    q = jnp.asarray(rng.standard_normal((T, N, H)), dtype)
    shape = (total_pages, page_size, 2 * K, H)
    kv = (jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) if int8
          else jnp.asarray(rng.standard_normal(shape), dtype))
    tables = rng.permutation(total_pages)[:S * pages_per_seq].reshape(S, pages_per_seq)
    return (q, kv, jnp.asarray(lens), jnp.asarray(tables, jnp.int32), jnp.asarray(cu),
            jnp.asarray([len(q_lens)], jnp.int32))


def jax_reference(args, **kw):
    """JAX's reference, its rows past cu_q_lens[num_seqs] padded with 0 as ours. Jitted over
    q and the pages with the metadata concrete (numpy), which its Python loop over the
    sequences slices by: one compile instead of one per eager op."""
    scale = kw.pop("scale", 1.0)
    q, kv = args[0], args[1]
    meta = [np.asarray(x) for x in args[2:]]
    ref = jax.jit(lambda q, kv: ref_ragged_paged_attention(q, kv, *meta, sm_scale=scale, **kw))(
        q.astype(F32), kv)
    return jnp.zeros(q.shape, F32).at[:ref.shape[0]].set(ref)


KERNELS = ["interpret", "triton"]
MIXED = dict(scale=0.3)  # prefill, decode and empty sequences, GQA 2:1
WINDOWED = dict(scale=0.5, sliding_window=9, soft_cap=2.5, k_scale=0.01, v_scale=0.02)  # int8


def cases():
    return {"mixed": (make_case(0), MIXED),
            "windowed": (make_case(1, N=8, K=2, int8=True, slots=6, total_pages=24), WINDOWED)}


@pytest.mark.parametrize("case", ["mixed", "windowed"])
def test_xla_matches_jax_reference(case):
    args, kw = cases()[case]
    out = ops.ragged_paged_attention(*args, implementation="xla", **kw)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert_close(out, jax_reference(args, **dict(kw)), FORWARD[F32], case)
    assert np.all(np.asarray(out[10:]) == 0)  # past cu_q_lens[num_seqs]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("case", ["mixed", "windowed"])
def test_kernels_match_xla(impl, case):
    # The per-token path: two splits of two pages per step (the merge runs) / three splits
    # of one page.
    args, kw = cases()[case]
    bs = dict(pages_per_block=2, k_splits=2, block_q=1) if case == "mixed" else \
        dict(pages_per_block=1, k_splits=3, block_q=1)
    out = ops.ragged_paged_attention(*args, implementation=impl, block_sizes=bs, **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw),
                 FORWARD[F32], f"{impl} {case}")


@pytest.mark.slow
@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("block_q", [1, None])
@pytest.mark.parametrize("N,K,H,page_size", [(8, 8, 64, 16), (16, 2, 64, 32), (12, 4, 96, 16)])
def test_sweep_against_jax_reference(impl, block_q, N, K, H, page_size):
    args = make_case(N + K + H, N=N, K=K, H=H, page_size=page_size, q_lens=(4, 1, 1, 7, 2),
                     kv_lens=(40, 1, 64, 7, 30), T=16, pages_per_seq=64 // page_size,
                     total_pages=5 * 64 // page_size + 3)
    kw = dict(scale=H ** -0.5, sliding_window=24)
    bs = dict(pages_per_block=2, k_splits=2, block_q=block_q)
    out = ops.ragged_paged_attention(*args, implementation=impl, block_sizes=bs, **kw)
    assert_close(out, jax_reference(args, **kw), FORWARD[F32], impl)


def test_sinks_equal_an_extra_key_of_value_zero():
    # A sink is a key of logit s and value 0: the same as a cache with one extra zero
    # value whose key makes the logit s for every query (here: q . k = s via a
    # one-hot head dim holding the sink and a query component of 1).
    args = make_case(2, H=16, q_lens=(2, 1), kv_lens=(5, 9), T=4, pages_per_seq=1,
                     total_pages=4)
    q, kv = args[0], args[1]
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], F32)
    out = ops.ragged_paged_attention(*args, sinks=sinks, implementation="interpret",
                                     block_sizes=(1, 1))
    ref = ops.ragged_paged_attention(*args, sinks=sinks, implementation="xla")
    assert_close(out, ref, FORWARD[F32])
    # The xla path against the direct float64 computation.
    q64, kv64 = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    tables = np.asarray(args[3])
    for t, (seq, pos) in enumerate([(0, 3), (0, 4), (1, 8)]):
        k = kv64[tables[seq]].reshape(-1, 4, 16)[:pos + 1, 0::2]
        v = kv64[tables[seq]].reshape(-1, 4, 16)[:pos + 1, 1::2]
        for n in range(4):
            s = np.append(k[:, n // 2] @ q64[t, n], float(sinks[n]))
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(np.asarray(ref[t, n]), p[:-1] @ v[:, n // 2],
                                       rtol=2e-5, atol=2e-6)


def test_bfloat16_under_jit():
    args = make_case(3, dtype=jnp.bfloat16)
    out = jax.jit(lambda *a: ops.ragged_paged_attention(*a, scale=0.3, implementation="interpret"))(
        *args)
    assert out.dtype == jnp.bfloat16
    expected = ops.ragged_paged_attention(*(args[0].astype(F32), args[1].astype(F32)) + args[2:],
                                          scale=0.3, implementation="xla")
    assert_close(out, expected, FORWARD[jnp.bfloat16])


def test_loop_walk_and_pallas_triton_lowering(monkeypatch):
    # The in-kernel loop walk of pallas_triton on the interpreter (int8, window, cap, sinks).
    monkeypatch.setattr(kernels, "walk", lambda backend: "loop")
    args, kw = cases()["windowed"]
    kw = dict(kw, sinks=jnp.linspace(-1.0, 1.0, 8))
    out = ops.ragged_paged_attention(*args, implementation="interpret",
                                     block_sizes=dict(pages_per_block=1, k_splits=3, block_q=1), **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw), FORWARD[F32])
    bs = dict(pages_per_block=2, k_splits=2, block_q=1)
    text = lower_text(lambda *a: ops.ragged_paged_attention(*a, implementation="pallas_triton",
                                                            block_sizes=bs),
                      "pallas_triton", ((16, 16, 128), jnp.bfloat16),
                      ((64, 16, 4, 128), jnp.bfloat16), ((4,), jnp.int32), ((4, 8), jnp.int32),
                      ((5,), jnp.int32), ((1,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("block_q", [1, 8])
def test_mosaic_tpu_lowering(block_q):
    # Per token (split-KV decode) and query-blocked (the grid walk, pages concatenated).
    bs = dict(pages_per_block=2, k_splits=1, block_q=block_q)
    text = lower_text(lambda *a: ops.ragged_paged_attention(*a, implementation="mosaic_tpu",
                                                            sliding_window=20, block_sizes=bs),
                      "mosaic_tpu", ((16, 16, 128), jnp.bfloat16), ((32, 16, 4, 128), jnp.bfloat16),
                      ((4,), jnp.int32), ((4, 8), jnp.int32), ((5,), jnp.int32), ((1,), jnp.int32))
    assert "tpu_custom_call" in text


# --------------------------------------------------------------------------
# The query-blocked kernel (block_q > 1)
# --------------------------------------------------------------------------

@functools.cache
def prefill_cases():
    """A chunked prefill of 7 tokens (not a multiple of block_q) at positions 30..36 (the
    first sees keys 0..30 of the first 32-key tile: a tile one key short of whole), a decode
    token, an empty sequence (kv_len 0), a 3-token verification run, a whole 12-token
    prompt, a decode token at a full cache (4 full pages), padding tokens and a garbage
    slot; GQA 4:1. Then 8-token pages (four per key tile, gathered), GQA 2:1, a window, a
    soft cap and an int8 cache, block_q 3."""
    lens = dict(q_lens=(7, 1, 0, 3, 12, 1), kv_lens=(37, 17, 0, 48, 12, 64), T=26, slots=7)
    return {
        "chunks": (make_case(5, N=8, K=2, total_pages=28, **lens), dict(scale=0.3),
                   dict(pages_per_block=2, k_splits=1, block_q=4)),
        "small_pages": (make_case(6, N=6, K=3, page_size=8, pages_per_seq=8, total_pages=56,
                                  int8=True, **lens), WINDOWED,
                        dict(pages_per_block=4, k_splits=1, block_q=3)),
    }


@functools.cache
def prefill_expected(case):
    args, kw, _ = prefill_cases()[case]
    return jax_reference(args, **kw)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("case", ["chunks", "small_pages"])
def test_query_blocked_matches_jax_reference(impl, case):
    args, kw, bs = prefill_cases()[case]
    out = ops.ragged_paged_attention(*args, implementation=impl, block_sizes=bs, **kw)
    assert_close(out, prefill_expected(case), FORWARD[F32], f"{impl} {case}")
    assert np.all(np.asarray(out[24:]) == 0)  # padding tokens


def test_query_blocked_grid_walk_with_sinks(monkeypatch):
    # Mosaic TPU's walk (pages by index maps, three concatenated into one tile) on the
    # interpreter, sinks starting each row's softmax.
    monkeypatch.setattr(prefill_kernels, "walk_of", lambda impl: prefill_kernels.GRID)
    args, kw, _ = prefill_cases()["small_pages"]
    kw = dict(kw, sinks=jnp.linspace(-1.0, 1.0, 6))
    bs = dict(pages_per_block=3, k_splits=1, block_q=4)
    out = ops.ragged_paged_attention(*args, implementation="interpret", block_sizes=bs, **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw), FORWARD[F32])


def test_query_blocked_sinks_on_the_loop_walk():
    args = make_case(7, N=8, K=2)
    kw = dict(scale=0.3, sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0, 1.0, -3.0, 0.2, 4.0], F32))
    bs = dict(pages_per_block=1, k_splits=1, block_q=2)
    out = ops.ragged_paged_attention(*args, implementation="interpret", block_sizes=bs, **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw), FORWARD[F32])


def test_query_blocked_splits_and_merge():
    # Three programs share each item's key tiles (some get none), merged with the sinks.
    args, kw, bs = prefill_cases()["chunks"]
    kw = dict(kw, sinks=jnp.linspace(-2.0, 2.0, 8))
    out = ops.ragged_paged_attention(*args, implementation="triton",
                                     block_sizes=dict(bs, k_splits=3), **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw), FORWARD[F32])


def test_query_blocked_cache_overrun_as_the_reference():
    # Invalid metadata: kv_lens past the table's capacity (64). Not detected; the rows see
    # the cache's end, as the XLA reference clips them.
    args = make_case(8, q_lens=(3, 2), kv_lens=(70, 65), T=6, N=4, K=2, total_pages=8,
                     pages_per_seq=4)
    bs = dict(pages_per_block=1, k_splits=1, block_q=2)
    kw = dict(scale=0.5, sliding_window=20)
    out = ops.ragged_paged_attention(*args, implementation="triton", block_sizes=bs, **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw), FORWARD[F32])


def test_work_items_cover_every_token_once():
    # 13 tokens of 4 live sequences (q_lens 5, 0, 1, 7) in blocks of 4: 2 + 0 + 1 + 2
    # items of at most 16 // 4 + min(6, 16) = 10; slots past num_seqs hold garbage.
    cu = jnp.asarray([0, 5, 5, 6, 13, 99, 99], jnp.int32)
    kv_lens = jnp.asarray([9, 3, 1, 7, 50, 50], jnp.int32)
    seq, lo, hi, full_lo, full_hi, token, pos = prefill_kernels.work_items(
        cu, kv_lens, jnp.asarray([4], jnp.int32), items=10, block_q=4, capacity=64, window=3)
    token = np.asarray(token)
    assert sorted(token[token >= 0].tolist()) == list(range(13))
    np.testing.assert_array_equal(np.asarray(seq)[:5], [0, 0, 2, 3, 3])
    np.testing.assert_array_equal(np.asarray(hi), [8, 9, 1, 4, 7, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(lo), [2, 6, 0, 0, 2, 0, 0, 0, 0, 0])
    # Sequence 0's tokens sit at positions 4..8 of its 9; the first block's rows see
    # keys [2, 5) all (the first token's causal limit 5, the last one's window start 8 - 3).
    np.testing.assert_array_equal(np.asarray(pos)[0], [4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(full_lo)[:2], [5, 6])
    np.testing.assert_array_equal(np.asarray(full_hi)[:2], [5, 9])


def test_block_q_heuristic():
    assert ragged_block_q(None, 8, 8, 4) == 1  # no more tokens than slots: per token
    assert ragged_block_q(None, 2048, 4, 8) == 16  # 16 tokens x 8 heads = 128 rows
    assert ragged_block_q(None, 2048, 4, 1) == 128
    assert ragged_block_q(None, 12, 4, 1) == 16  # at most the tokens (rounded up)
    assert ragged_block_q(None, 64, 4, 6) == 16
    assert ragged_block_q(PagedBlockSizes(1, 1, block_q=3), 8, 8, 4) == 3
    assert ragged_block_q(PagedBlockSizes(1, 2), 64, 4, 4) == 1  # splits asked for: per token
    assert ragged_block_q(PagedBlockSizes(1, 1), 64, 4, 4) == 32


def test_block_q_is_ragged_only():
    from tests.test_paged_attention import make_case as paged_case
    with pytest.raises(ValueError, match="block_sizes.block_q is ragged_paged_attention's"):
        ops.paged_attention(*paged_case(0)[:5],
                            block_sizes=dict(pages_per_block=1, k_splits=1, block_q=2))


def test_query_blocked_pallas_triton_lowering():
    bs = dict(pages_per_block=2, k_splits=3, block_q=8)  # with the merge
    text = lower_text(lambda *a: ops.ragged_paged_attention(*a, implementation="pallas_triton",
                                                            sliding_window=20, block_sizes=bs,
                                                            sinks=jnp.zeros(16)),
                      "pallas_triton", ((64, 16, 128), jnp.bfloat16),
                      ((64, 16, 4, 128), jnp.bfloat16), ((4,), jnp.int32), ((4, 8), jnp.int32),
                      ((5,), jnp.int32), ((1,), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 2  # attention and merge


def _bad_inputs():
    q, kv, lens, tables, cu, n = make_case(4)
    good = dict(q=q, kv_pages=kv, kv_lens=lens, page_indices=tables, cu_q_lens=cu, num_seqs=n)
    return [
        (dict(good, q=q[0]), ValueError, "q must have rank 3"),
        (dict(good, kv_pages=kv[..., :3, :]), ValueError, "2 \\* K combined heads"),
        (dict(good, kv_pages=kv.astype(jnp.float16)), TypeError, "kv_pages has dtype float16"),
        (dict(good, q=q[:, :3]), ValueError, "multiple of the number of key/value heads"),
        (dict(good, kv_lens=lens[:2]), ValueError, "kv_lens must have shape"),
        (dict(good, cu_q_lens=cu[:-1]), ValueError, "cu_q_lens must have shape"),
        (dict(good, num_seqs=jnp.asarray(2, jnp.int32)), ValueError, "num_seqs must have shape"),
        (dict(good, page_indices=tables.astype(jnp.uint32)), TypeError, "page_indices must be int32"),
        (dict(good, sliding_window=0), ValueError, "sliding_window must be"),
        (dict(good, soft_cap=-1.0), ValueError, "soft_cap must be"),
        (dict(good, k_scale="x"), ValueError, "k_scale must be"),
        (dict(good, sinks=jnp.zeros((4, 1))), ValueError, "sinks must have shape"),
        (dict(good, block_sizes=dict(pages_per_block=1, k_splits=1, block_q=0)), ValueError,
         "block_sizes.block_q must be a positive int"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_input_named(case):
    kwargs, error, match = _bad_inputs()[case]
    with pytest.raises(error, match=match):
        ops.ragged_paged_attention(**kwargs)


# --------------------------------------------------------------------------
# Decode over small pages: the query-blocked kernel, one token per item
# --------------------------------------------------------------------------

@functools.cache
def decode_case():
    """A decode batch (every q_len 1, no more tokens than slots) over 16-token pages: an
    empty cache, a full one (4 pages), full pages (48), a one-token cache, partial pages;
    GQA 4:1, an int8 cache with scales, a window, a soft cap; a padding token, a garbage
    slot."""
    args = make_case(9, q_lens=(1,) * 6, kv_lens=(0, 64, 48, 1, 17, 33), T=7, slots=8, N=8, K=2,
                     total_pages=34, int8=True)
    return args, dict(scale=0.4, sliding_window=40, soft_cap=3.0, k_scale=0.01, v_scale=0.02)


@pytest.mark.parametrize("impl", KERNELS)
def test_decode_over_small_pages_takes_multi_page_tiles(impl, monkeypatch):
    # The default route and explicit splits (three, merged with the sinks) both run the
    # query-blocked kernel, never the per-page decode kernel.
    def per_page(*a, **k):
        raise AssertionError("the per-page decode kernel ran")
    monkeypatch.setattr(kernels, "decode", per_page)
    args, kw = decode_case()
    out = ops.ragged_paged_attention(*args, implementation=impl, **kw)
    assert_close(out, jax_reference(args, **kw), FORWARD[F32], f"{impl} default")
    assert np.all(np.asarray(out[6:]) == 0)  # the padding token
    kw = dict(kw, sinks=jnp.linspace(-1.0, 1.5, 8))
    out = ops.ragged_paged_attention(*args, implementation=impl, block_sizes=(2, 3), **kw)
    assert_close(out, ops.ragged_paged_attention(*args, implementation="xla", **kw),
                 FORWARD[F32], f"{impl} splits")


def test_decode_route():
    tile = 2 * 128 * 128 * 2  # 128 keys of head dim 128 in bfloat16, keys and values
    assert multi_page_decode(None, True, tile)
    assert multi_page_decode(PagedBlockSizes(2, 3), True, tile)  # splits kept
    assert not multi_page_decode(None, False, tile)  # the grid walk (Mosaic TPU)
    assert not multi_page_decode(None, True, 2 * tile)  # 256-key tiles, head dim 256
    assert not multi_page_decode(None, True, tile, float32_gpu=True)
    assert not multi_page_decode(PagedBlockSizes(2, 3, block_q=1), True, tile)  # asked for


# --------------------------------------------------------------------------
# The op battery (tests/op_battery.py): every implementation registered for a GPU
# --------------------------------------------------------------------------

def _battery_inputs(rng, dtype, q_lens=(3, 1, 0, 5, 1), kv_lens=(20, 33, 0, 64, 16), tokens=12,
                    n=8, k=2, h=128, page_size=16, pages_per_seq=4, slots=None, int8=False,
                    sinks=False):
    """As :func:`make_case` (prefill, decode and empty sequences, rows past the last
    sequence's tokens, unused slots with garbage metadata), from the battery's RNG; then
    sinks (or None)."""
    seed = int(rng.integers(1 << 31))
    args = make_case(seed, q_lens=q_lens, kv_lens=kv_lens, T=tokens, N=n, K=k, H=h,
                     page_size=page_size, pages_per_seq=pages_per_seq,
                     total_pages=(slots or len(q_lens)) * pages_per_seq + 4, dtype=dtype,
                     int8=int8, slots=slots)
    return (*args, jnp.asarray(rng.standard_normal(n), F32) if sinks else None)


def _battery_ragged_paged(q, kv, kv_lens, tables, cu_q_lens, num_seqs, sinks=None, *,
                          implementation, per_token=False, **kwargs):
    """``per_token``: on the kernels, every token its own row of the per-page split-KV
    decode kernel (``block_q=1``, two splits merged)."""
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if per_token and names[-1] != "xla":
        kwargs["block_sizes"] = PagedBlockSizes(2, 2, block_q=1)
    return ops.ragged_paged_attention(q, kv, kv_lens, tables, cu_q_lens, num_seqs, sinks=sinks,
                                      implementation=implementation, **kwargs)


def _battery_reference(*args, **kwargs):
    """The op's XLA path in float32 (held to JAX's reference above)."""
    return _battery_ragged_paged(*args, implementation="xla", **kwargs)


# bfloat16 only on the GPU: float32 tiles spill and the sm_90 compiles take 40-230 s
# (bfloat16: 2-8 s). On this host only XLA runs these (the kernels' CPU runs are the tests
# above). Serving only: no gradients.
RAGGED_PAGED_ATTENTION = OpSpec(
    name="ragged_paged_attention", op=_battery_ragged_paged, reference=_battery_reference,
    make_inputs=_battery_inputs, implementations=("xla",), dtypes=(jnp.bfloat16,),
    cases=[Case("mixed", options=dict(scale=0.3), grads=False),
           Case("int8_window_soft_cap", dict(int8=True, slots=6), dict(WINDOWED), grads=False),
           Case("sinks", dict(sinks=True), dict(scale=0.3, sliding_window=30), grads=False),
           Case("per_token_split_kv", options=dict(scale=0.3, per_token=True), grads=False)],
    xla_is_reference=False, unavailable=None)


class TestRaggedPagedAttentionBattery(OpBattery):
    """ragged_paged_attention against its XLA path in float32."""
    spec = RAGGED_PAGED_ATTENTION
