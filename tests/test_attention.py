"""ops.dot_product_attention: every option against the float32 XLA reference.

The verification ladder (docs/design.md §7.2, §7.3, §7.5): the op battery
(tests/op_battery.py) runs the interpret backend (every option, outputs,
logsumexp and gradients) and our Triton lowering through Triton's interpreter
(every option at least once); beside it, masking, block skipping, dropout and
lowering for ``tpu`` / ``cuda``. Shapes never divide the blocks (T = 37, S = 45 against 16-row tiles). The reference is jax.nn's XLA
path computed in float32 with the fully-masked-row convention of the op
(output 0, logsumexp -inf); where no row is fully masked, jax.nn itself is
the reference.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ops
from ops import _op, _resolve
from ops.attention import BlockSizes
from ops.attention import dropout as dropout_lib
from ops.attention.masking import (MaskSpec, block_full_visibility, block_ranges, block_visibility,
                                   masked_sides)
from ops.attention.range_table import RANGE_FIELDS, BlockRange, RangeTable, pack
from tests.op_battery import BadInput, Case, OpBattery, OpSpec
from tests.tolerances import BACKWARD, FORWARD, assert_close

B, T, S, N, K, H = 2, 37, 45, 4, 2, 32
BLOCKS = {"interpret": (16, 16), "triton": (16, 32)}


def _inputs(seed=0, b=B, t=T, s=S, n=N, k=K, h=H, dtype=jnp.float32):
    """q, k, v and an output cotangent, from NumPy's RNG."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                 for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h), (b, t, n, h)))


def _segments(b, length, sizes):
    ids = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(sizes)])[:length]
    return jnp.asarray(np.broadcast_to(ids, (b, length)).copy())


def _attend(impl, q, k, v, bias=None, **kw):
    blocks = BLOCKS.get(impl)
    return ops.dot_product_attention(q, k, v, bias, implementation=impl, block_sizes=blocks, **kw)


def _loss(impl, kw, do):
    def f(q, k, v, bias=None):
        out = _attend(impl, q, k, v, bias, **kw)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    return f


# --------------------------------------------------------------------------
# The op battery (tests/op_battery.py): every option on interpret and on triton
# --------------------------------------------------------------------------

STATIC_OPTIONS = {  # option name -> static keyword arguments
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(5, 3)),
    "window_causal": dict(local_window_size=4, is_causal=True),
    "segments": dict(is_causal=True),
    "soft_cap": dict(logits_soft_cap=2.0),
    "dropout": dict(dropout_rate=0.3),
    "scale": dict(scale=0.3),
}


def _option_arrays(rng, name, b, t, s, n, dtype):
    """The array arguments of one named option set: (bias or None, keyword arrays)."""
    if name == "lengths":
        return None, dict(query_seq_lengths=jnp.array([t, t * 20 // 37][:b], jnp.int32),
                          key_value_seq_lengths=jnp.array([s // 5, s][:b], jnp.int32))
    if name == "segments":
        return None, dict(query_segment_ids=_segments(b, t, [10, 20, 7]),
                          key_value_segment_ids=_segments(b, s, [12, 18, 15]))
    if name == "mask":
        return None, dict(mask=jnp.asarray(rng.random((b, 1, t, s)) < 0.7))
    if name == "bias":
        return jnp.asarray(rng.standard_normal((1, n, t, s), np.float32), dtype), {}
    if name == "full_bias":
        return jnp.asarray(rng.standard_normal((b, n, t, s), np.float32), dtype), {}
    if name == "bias_rows":
        return jnp.asarray(rng.standard_normal((b, 1, 1, s), np.float32), dtype), {}
    if name == "dropout":
        return None, dict(dropout_rng=jax.random.key(3))
    return None, {}


def _battery_inputs(rng, dtype, options=(), b=B, t=T, s=S, n=N, k=K, h=H):
    """q, k, v ([B, T, N, H], [B, S, K, H] twice), bias (or None) and the option arrays."""
    q, key, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                 for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h)))
    bias, arrays = None, {}
    for name in options:
        more_bias, more = _option_arrays(rng, name, b, t, s, n, dtype)
        bias = more_bias if more_bias is not None else bias
        arrays.update(more)
    return q, key, v, bias, arrays


def _attention(q, k, v, bias=None, arrays=None, **kwargs):
    return ops.dot_product_attention(q, k, v, bias, return_residual=True, **(arrays or {}), **kwargs)


def _reference(q, k, v, bias, arrays, **kwargs):
    return _attention(q, k, v, bias, arrays, implementation="xla", **kwargs)


def _case(*options, implementations=None, dtypes=None, **inputs):
    static = {}
    for name in options:
        static.update(STATIC_OPTIONS.get(name, {}))
    return Case("_".join(options) or "plain", dict(options=options, **inputs), static,
                dtypes=dtypes, implementations=implementations)


OPTIONS = ["plain", "causal", "window", "window_causal", "lengths", "segments", "soft_cap",
           "mask", "bias", "bias_rows", "dropout", "scale"]
TRITON = ("triton",)

CASES = [
    # Every option on the interpreter (outputs, logsumexp and every gradient, the
    # logsumexp's included): T = 37 and S = 45 divide no 16-row tile.
    *[_case(*(() if o == "plain" else (o,))) for o in OPTIONS],
    _case("causal", "full_bias", dtypes=(jnp.bfloat16, jnp.float16)),
    # Our Triton lowering in Triton's CPU interpreter: every option at least once.
    *[_case(*group, implementations=TRITON) for group in [
        ("causal", "lengths"), ("window", "soft_cap", "scale"), ("segments",), ("mask", "bias"),
        ("dropout", "bias_rows")]],
    # Head dims that are not powers of two (Triton pads them).
    *[dataclasses.replace(_case("causal", implementations=TRITON, dtypes=(jnp.bfloat16,), b=1,
                                t=20, s=33, n=2, k=1, h=h), name=f"causal_head_dim_{h}")
      for h in (80, 96)],
]


def _bad_cases():
    q, k, v, _ = _inputs()
    i32 = lambda *s: jnp.zeros(s, jnp.int32)
    none = (q, k, v, None)
    return [  # name, (q, k, v, bias), keyword arguments, error, argument[, pattern]
        ("query_rank", (q[0, 0], k, v, None), {}, ValueError, "rank"),
        ("value_shape", (q, k, v[:, :3], None), {}, ValueError, "same shape"),
        ("batch", (q, k[:1], v[:1], None), {}, ValueError, "batch"),
        ("head_dims", (q[..., :16], k, v, None), {}, ValueError, "head dims"),
        ("heads_multiple", (q[:, :, :3], k, v, None), {}, ValueError, "multiple"),
        ("key_dtype", (q, k.astype(jnp.bfloat16), v, None), {}, TypeError, "key"),
        ("int_query", (q.astype(jnp.int32), k, v, None), {}, TypeError, "query"),
        ("float_mask", none, dict(mask=jnp.ones((B, 1, T, S), jnp.float32)), TypeError, "mask"),
        ("mask_heads", none, dict(mask=jnp.ones((B, 3, T, S), bool)), ValueError, "mask"),
        ("bias_shape", (q, k, v, jnp.ones((T, S + 1))), {}, ValueError, "bias"),
        ("bias_rank", (q, k, v, jnp.ones((1, 1, 1, 1, S))), {}, ValueError, "bias"),
        ("query_lengths", none, dict(query_seq_lengths=i32(B + 1)), ValueError, "query_seq_lengths"),
        ("float_kv_lengths", none, dict(key_value_seq_lengths=jnp.zeros(B, jnp.float32)), TypeError,
         "key_value_seq_lengths"),
        ("negative_window", none, dict(local_window_size=-1), ValueError, "local_window_size"),
        ("window_triple", none, dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
        ("one_segment_ids", none, dict(query_segment_ids=i32(B, T)), ValueError, "query_segment_ids"),
        ("segment_ids_shape", none, dict(query_segment_ids=i32(B, T), key_value_segment_ids=i32(B, T)),
         ValueError, "key_value_segment_ids"),
        ("zero_soft_cap", none, dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
        ("dropout_one", none, dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
         "dropout_rate"),
        ("dropout_without_rng", none, dict(dropout_rate=0.1), ValueError, "dropout_rng"),
        ("float_dropout_rng", none, dict(dropout_rate=0.1, dropout_rng=jnp.zeros(2, jnp.float32)),
         TypeError, "dropout_rng"),
        ("one_block_size", none, dict(implementation="interpret", block_sizes=(16,)), ValueError,
         "block_sizes"),
        # These three messages say "block sizes" / "key blocks", not the argument's name.
        ("zero_block", none, dict(implementation="interpret", block_sizes=(0, 16)), ValueError,
         "block", "must be positive"),
        ("pallas_triton_blocks", none, dict(implementation="pallas_triton", block_sizes=(24, 16)),
         ValueError, "block", "powers of two"),
        ("mosaic_tpu_blocks", none, dict(implementation="mosaic_tpu", block_sizes=(16, 64)),
         ValueError, "blocks", "multiples of 128"),
        ("string_scale", none, dict(scale="1"), TypeError, "scale"),
    ]


ATTENTION = OpSpec(
    name="dot_product_attention", op=_attention, reference=_reference,
    make_inputs=_battery_inputs, cases=CASES, grad_argnums=(0, 1, 2, 3),
    implementations=("interpret",), tiles={"interpret": dict(block_sizes=BLOCKS["interpret"]),
                                           "triton": dict(block_sizes=BLOCKS["triton"])},
    bad_inputs=[BadInput(*case) for case in _bad_cases()],
    xla_is_reference=False, eager_case="causal_lengths")


def _output_only(q, k, v, bias=None, arrays=None, **kwargs):
    return ops.dot_product_attention(q, k, v, bias, **(arrays or {}), **kwargs)


def _output_only_reference(q, k, v, bias, arrays, **kwargs):
    return _output_only(q, k, v, bias, arrays, implementation="xla", **kwargs)


# The calls every GPU implementation takes, cuDNN's included (16-bit, one head dim that is a
# multiple of 8, T == S, no logsumexp returned): the plain and causal products the default
# routes to cuDNN where it measures fastest, checked against the reference on the GPU
# (test_on_gpu). On this host only XLA runs them (the options above cover the kernels).
ATTENTION_OUTPUT = OpSpec(
    name="dot_product_attention_output", op=_output_only, reference=_output_only_reference,
    make_inputs=_battery_inputs, grad_argnums=(0, 1, 2), implementations=("xla",),
    cases=[_case(*options, dtypes=(jnp.bfloat16, jnp.float16), b=2, t=130, s=130, n=4, k=2, h=64)
           for options in ((), ("causal",))],
    xla_is_reference=False, unavailable=None)


class TestDotProductAttentionOutput(OpBattery):
    """Attention's output alone on shapes every GPU implementation takes (cuDNN's too)."""
    spec = ATTENTION_OUTPUT


class TestDotProductAttention(OpBattery):
    """The reference is the op's own XLA path in float32 (jax.nn's math with the
    fully-masked-row convention); test_matches_jax_nn holds that to jax.nn."""
    spec = ATTENTION


# --------------------------------------------------------------------------
# jax.nn is the reference wherever no query row is fully masked
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {}, dict(is_causal=True), dict(local_window_size=(6, 2)),
    dict(query_seq_lengths=jnp.array([30, 37], jnp.int32),
         key_value_seq_lengths=jnp.array([20, 45], jnp.int32)),
], ids=["plain", "causal", "window", "lengths"])
def test_matches_jax_nn(kw):
    q, k, v, _ = _inputs(3)
    bias = jax.random.normal(jax.random.key(1), (B, 1, T, S))
    expected = jax.nn.dot_product_attention(q, k, v, bias, implementation="xla", **kw)
    for impl in ("xla", "interpret"):
        assert_close(_attend(impl, q, k, v, bias, **kw), expected, FORWARD[jnp.float32], impl)


def test_unbatched_tnh_layout_and_one_token_decode():
    q, k, v, _ = _inputs(4, b=1, t=1, s=45)
    lengths = jnp.array([30], jnp.int32)
    expected = jax.nn.dot_product_attention(q[0], k[0], v[0], key_value_seq_lengths=lengths)
    out = _attend("interpret", q[0], k[0], v[0], key_value_seq_lengths=lengths)
    assert out.shape == (1, N, H)
    assert_close(out, expected, FORWARD[jnp.float32], "TNH")


def test_fully_masked_rows_give_zero_output_and_gradients():
    q, k, v, do = _inputs(5)
    kw = dict(key_value_seq_lengths=jnp.array([0, 45], jnp.int32))
    out, lse = _attend("interpret", q, k, v, return_residual=True, **kw)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
    assert np.all(np.isfinite(np.asarray(lse[1])))
    grads = jax.grad(_loss("interpret", kw, do), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0][0]) == 0)  # dq of batch 0: no key was seen


# --------------------------------------------------------------------------
# Dropout: one hash for every backend and the reference
# --------------------------------------------------------------------------

def test_dropout_keeps_the_expected_fraction_and_depends_on_the_key():
    seed = dropout_lib.seed_from_rng(jax.random.key(0))
    keep = dropout_lib.keep_mask(seed, jnp.arange(8)[:, None, None], jnp.arange(256)[:, None],
                                 jnp.arange(256)[None, :], 0.3)
    assert abs(float(keep.mean()) - 0.7) < 0.005
    # neighbouring rows / columns / heads are not copies of each other
    assert float(jnp.mean(keep[:, 1:] == keep[:, :-1])) < 0.65
    assert float(jnp.mean(keep[1:] == keep[:-1])) < 0.65
    other = dropout_lib.seed_from_rng(jax.random.key(1))
    assert int(other) != int(seed)
    q, k, v, _ = _inputs(6)
    a = _attend("interpret", q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(0))
    b = _attend("interpret", q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(1))
    assert float(jnp.abs(a - b).max()) > 0.1


def test_dropout_mask_is_bit_identical_across_backends():
    """With v = identity columns the output exposes every probability: dropped entries are exact 0."""
    b, t, s, n = 1, 20, 40, 2
    q = jax.random.normal(jax.random.key(0), (b, t, n, 32))
    k = jax.random.normal(jax.random.key(1), (b, s, n, 32))
    v = jnp.broadcast_to(jnp.eye(s, 32)[None, :, None, :], (b, s, n, 32))
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.key(9))
    outs = {impl: np.asarray(ops.dot_product_attention(
        q, k, v, implementation=impl, block_sizes=(16, 16), **kw)) for impl in ("xla", "interpret", "triton")}
    dropped = outs["xla"][..., :32] == 0
    assert 0.3 < dropped.mean() < 0.7
    for impl in ("interpret", "triton"):
        assert np.array_equal(outs[impl][..., :32] == 0, dropped), impl


# --------------------------------------------------------------------------
# Block skipping: blocks that cannot contribute are never read
# --------------------------------------------------------------------------

def _poison(x, rows):
    """NaN in the given sequence rows of a [B, L, heads, H] array."""
    return x.at[:, rows].set(jnp.nan)


@pytest.mark.parametrize("impl", ["interpret", "triton"])
@pytest.mark.parametrize("case", ["lengths", "causal", "window", "segments"])
def test_skipped_blocks_are_never_read(impl, case):
    """Keys in blocks no query can see hold NaN: a kernel that reads them (even
    masked, since 0 * NaN = NaN in p @ v) returns NaN. Removing the skipping
    makes every case here fail (checked once by hand)."""
    t, s, blk = 32, 96, 16
    q, k, v, do = _inputs(8, t=t, s=s)
    kw = {"lengths": dict(key_value_seq_lengths=jnp.array([40, 40], jnp.int32)),
          "causal": dict(is_causal=True),
          "window": dict(local_window_size=(0, 10)),
          "segments": dict(query_segment_ids=_segments(B, t, [t]),
                           key_value_segment_ids=_segments(B, s, [48, 48]))}[case]
    dead = slice(48, s)  # blocks 3..5 of 16 keys: beyond every query's reach
    k, v = _poison(k, dead), _poison(v, dead)
    blocks = (blk, blk) if impl == "interpret" else BlockSizes(16, 16)
    f = lambda q, k, v: ops.dot_product_attention(q, k, v, implementation=impl, block_sizes=blocks, **kw)
    out = f(q, k, v)
    assert np.all(np.isfinite(np.asarray(out)))
    ref = ops.dot_product_attention(q, k[:, :48], v[:, :48], implementation="xla",
                                    **{a: (b[:, :48] if a == "key_value_segment_ids" else b)
                                       for a, b in kw.items()})
    assert_close(out, ref, FORWARD[jnp.float32], case)
    dq, dk, dv = jax.grad(lambda *a: jnp.sum(f(*a) * do), (0, 1, 2))(q, k, v)
    for g in (dq, dk[:, :48], dv[:, :48]):
        assert np.all(np.isfinite(np.asarray(g)))


def _table(vis, full=None, rows=16, sides=(True, True)):
    """block_ranges' first ``rows`` rows as ``[rows, 4]``: lo, hi, full_lo, full_hi."""
    ranges = block_ranges(vis, 1, full=full, sides=sides)
    return np.stack([np.asarray(field)[0] for field in ranges], axis=1)[:rows]


def test_config_parts():
    """The call's Config is hashable by value (the custom_vjp's nondiff argument), and its
    backend part follows the backend's traits: the loop walk on the Triton backends, the
    grid elsewhere, heads before the sequence on a TPU."""
    from ops.attention.config import AttentionProblem, Backend, BlockSizes, Config, ScoreMath
    from ops.attention.masking import MaskSpec

    def make(scale=0.5):
        return Config(Backend.of("triton"), AttentionProblem(MaskSpec(T=8, S=8), 1, 4, 2, 16),
                      ScoreMath(scale), BlockSizes(16, 16, 16, 16, k_splits=1))

    assert make() == make() and hash(make()) == hash(make()) and make() != make(0.25)
    assert make().problem.group == 2 and make().problem.v_dim == 16
    assert {n: (Backend.of(n).strategy, Backend.of(n).layout)
            for n in ("interpret", "triton", "pallas_triton", "mosaic_tpu")} == {
        "interpret": ("grid", "BTNH"), "triton": ("loop", "BTNH"),
        "pallas_triton": ("loop", "BTNH"), "mosaic_tpu": ("grid", "BNTH")}


def test_range_table_layout():
    """pack writes what RangeTable reads: the seed (0 without one), then every
    program row's BlockRange, the whole zero-padded to a power-of-two length."""
    fields = np.arange(3 * 5 * RANGE_FIELDS, dtype=np.int32).reshape(RANGE_FIELDS, 3, 5) + 1
    for seed, want in ((jnp.uint32(7), 7), (None, 0)):
        flat = np.asarray(pack(seed, BlockRange(*map(jnp.asarray, fields))))
        size = flat.shape[0]
        assert flat.dtype == np.int32 and size >= 61 and size & (size - 1) == 0 and not flat[61:].any()
        table = RangeTable(flat, blocks=5)
        assert table.seed == want
        for b in range(3):
            for i in range(5):
                assert tuple(table.row(b, i).read()) == tuple(fields[:, b, i])
        assert (table.row(2, 1).full_lo, table.row(2, 1).hi) == (fields[2, 2, 1], fields[1, 2, 1])


def test_causal_visits_about_half_the_blocks():
    spec = MaskSpec(T=1024, S=1024, causal=True)
    ranges = _table(block_visibility(spec, 64, 64))
    visited = int(np.sum(ranges[:, 1] - ranges[:, 0]))
    assert visited == 16 * 17 // 2  # the lower triangle of the 16 x 16 block grid
    window = MaskSpec(T=1024, S=1024, left=64, right=0)
    ranges = _table(block_visibility(window, 64, 64))
    assert np.all(ranges[1:, 1] - ranges[1:, 0] == 2)  # a band of two blocks


def test_fully_visible_block_ranges():
    """Causal: every block left of the diagonal is fully visible, the diagonal one is not."""
    spec = MaskSpec(T=1024, S=1000, causal=True)  # the last key block overhangs S
    table = _table(block_visibility(spec, 64, 64), block_full_visibility(spec, 64, 64))
    i = np.arange(16)
    np.testing.assert_array_equal(table[:, 0], 0)
    np.testing.assert_array_equal(table[:, 1], i + 1)
    assert tuple(table[0, 2:]) == (1, 1)  # only the diagonal block: nothing to skip (full_lo = hi)
    np.testing.assert_array_equal(table[1:15, 2:], np.stack([0 * i, i], 1)[1:15])
    assert tuple(table[15, 2:]) == (0, 15)  # block 15 overhangs S: masked
    # The forward walks causal rows as FlashAttention-2 does: fully visible blocks, then
    # the masked diagonal; a row without full blocks is all "trailing" (full range lo, lo).
    sides = masked_sides(spec, 64, 64)
    assert sides == (False, True)
    table = _table(block_visibility(spec, 64, 64), block_full_visibility(spec, 64, 64), sides=sides)
    assert tuple(table[0]) == (0, 1, 0, 0) and tuple(table[7]) == (0, 8, 0, 7)
    # Walking query blocks per key block (dK/dV), the diagonal comes first.
    assert masked_sides(MaskSpec(T=1024, S=1024, causal=True), 64, 64, transpose=True,
                        bound_q=True) == (True, False)
    # A causal window reaching 200 back: queries 320..383 see keys from 120 (block 1)
    # on; keys 192..319 (blocks 3, 4) are seen by every one of them.
    window = MaskSpec(T=1024, S=1024, left=200, right=0)
    table = _table(block_visibility(window, 64, 64), block_full_visibility(window, 64, 64))
    assert tuple(table[5]) == (1, 6, 3, 5)


def test_full_ranges_with_gaps_are_not_split():
    """Segments whose fully visible blocks are not contiguous: no unmasked sub-range."""
    spec = MaskSpec(T=16, S=48, segments=True)
    q_seg = jnp.zeros((1, 16), jnp.int32)
    kv_seg = jnp.asarray(np.repeat([0, 1, 0], 16)[None], jnp.int32)
    table = _table(block_visibility(spec, 16, 16, q_seg, kv_seg),
                   block_full_visibility(spec, 16, 16, q_seg, kv_seg), rows=1)
    assert tuple(table[0]) == (0, 3, 3, 3)


@pytest.mark.parametrize("option", [pytest.param("causal", marks=pytest.mark.slow),
                                    pytest.param("window", marks=pytest.mark.slow),
                                    "window_causal", "lengths", "segments", "mask"])
def test_loop_strategy_on_interpret(option, monkeypatch):
    """The Triton backends' loop strategy (masked / fully visible / masked sub-loops)
    run by the interpreter, forward and gradients: the same kernels as on triton,
    at the interpreter's speed. T = 70 and S = 90 give each query block fully
    visible key blocks as well as ones a boundary crosses."""
    from ops.attention.config import Backend
    monkeypatch.setattr(Backend, "strategy", property(lambda self: "loop"))
    q, k, v, do = _inputs(11, t=70, s=90)
    kw = {"causal": dict(is_causal=True), "window": dict(local_window_size=(20, 10)),
          "window_causal": dict(local_window_size=30, is_causal=True),
          "lengths": dict(query_seq_lengths=jnp.array([70, 33], jnp.int32),
                          key_value_seq_lengths=jnp.array([50, 90], jnp.int32)),
          "segments": dict(query_segment_ids=_segments(B, 70, [40, 30]),
                           key_value_segment_ids=_segments(B, 90, [50, 40]), is_causal=True),
          "mask": dict(mask=jax.random.bernoulli(jax.random.key(2), 0.8, (B, 1, 70, 90)),
                       is_causal=True)}[option]
    f = lambda q, k, v: ops.dot_product_attention(q, k, v, implementation="interpret",
                                                  block_sizes=(16, 16), **kw)
    ref = lambda q, k, v: ops.dot_product_attention(q, k, v, implementation="xla", **kw)
    assert_close(f(q, k, v), ref(q, k, v), FORWARD[jnp.float32], option)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * do), (0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(ref(*a) * do), (0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", grads, want):
        assert_close(g, w, BACKWARD[jnp.float32], f"{option} d{name}")


# --------------------------------------------------------------------------
# jit / vmap
# --------------------------------------------------------------------------

def test_jit_and_vmap():
    q, k, v, _ = _inputs(11)
    f = jax.jit(lambda q, k, v: _attend("interpret", q, k, v, is_causal=True))
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    out = jax.vmap(f)(*stacked)
    for i in range(2):
        ref = _attend("xla", *(x[i] for x in stacked), is_causal=True)
        assert_close(out[i], ref, FORWARD[jnp.float32], f"vmap {i}")


# --------------------------------------------------------------------------
# Property test: shapes, head dims, GQA ratios, masks and dtypes
# --------------------------------------------------------------------------

_PROPERTY = dict(t=st.integers(1, 40), s=st.integers(1, 40), kv_heads=st.sampled_from([1, 2]),
                 group=st.sampled_from([1, 2, 3]), h=st.sampled_from([16, 32, 40]),
                 causal=st.booleans(), window=st.sampled_from([None, 3, (0, 5)]),
                 dtype=st.sampled_from(["float32", "bfloat16"]), bq=st.sampled_from([8, 16]),
                 bk=st.sampled_from([8, 16]))


@settings(max_examples=3, deadline=None)
@given(**_PROPERTY)
def test_property_interpret(t, s, kv_heads, group, h, causal, window, dtype, bq, bk):
    _property_case(t, s, kv_heads, group, h, causal, window, dtype, bq, bk)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(**_PROPERTY)
def test_property_interpret_sweep(t, s, kv_heads, group, h, causal, window, dtype, bq, bk):
    _property_case(t, s, kv_heads, group, h, causal, window, dtype, bq, bk)


def _property_case(t, s, kv_heads, group, h, causal, window, dtype, bq, bk):
    dtype = jnp.dtype(dtype)
    q, k, v, do = _inputs(12, b=1, t=t, s=s, n=kv_heads * group, k=kv_heads, h=h, dtype=dtype)
    kw = dict(is_causal=causal, local_window_size=window)
    f = lambda impl: (lambda q, k, v: jnp.sum(ops.dot_product_attention(
        q, k, v, implementation=impl, block_sizes=(bq, bk), **kw).astype(jnp.float32)
        * do.astype(jnp.float32)))
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    out = ops.dot_product_attention(q, k, v, implementation="interpret", block_sizes=(bq, bk), **kw)
    ref = ops.dot_product_attention(*up, implementation="xla", **kw)
    assert_close(out, ref, FORWARD[dtype.type], "out")
    grads = jax.grad(f("interpret"), (0, 1, 2))(q, k, v)
    refs = jax.grad(f("xla"), (0, 1, 2))(*up)
    for g, r in zip(grads, refs):
        assert_close(g, r, BACKWARD[dtype.type], "grad")


# --------------------------------------------------------------------------
# Lowering for TPU and CUDA from this host (docs/design.md §7.5)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("impl,platform,marker", [("mosaic_tpu", "tpu", "tpu_custom_call"),
                                                  ("pallas_triton", "cuda", "__gpu$xla.gpu.triton")])
@pytest.mark.parametrize("options", [("causal", "lengths"), ("segments", "soft_cap", "dropout"),
                                     ("window", "mask", "bias")])
def test_lowers_forward_and_backward(impl, platform, marker, options):
    b, t, s = 2, 200, 300
    kw = dict(implementation=impl)
    for o in options:
        kw.update({"causal": dict(is_causal=True),
                   "lengths": dict(key_value_seq_lengths=jnp.array([7, 300], jnp.int32)),
                   "segments": dict(query_segment_ids=_segments(b, t, [100, 100]),
                                    key_value_segment_ids=_segments(b, s, [150, 150])),
                   "soft_cap": dict(logits_soft_cap=30.0),
                   "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
                   "window": dict(local_window_size=(64, 0)),
                   "mask": dict(mask=jnp.ones((b, 1, t, s), bool)),
                   "bias": {}}[o])
    with_bias = "bias" in options

    def loss(q, k, v, bias):
        out = ops.dot_product_attention(q, k, v, bias if with_bias else None, **kw)
        return jnp.sum(out.astype(jnp.float32))

    grads = lambda *a: jax.grad(loss, (0, 1, 2, 3))(*a)
    args = [jax.ShapeDtypeStruct((b, t, 4, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, 2, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, 2, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 4, t, s), jnp.float32)]
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 3  # forward, dQ, dK/dV


CUDA_CONTRACT_OPTIONS = {
    "causal_gqa": lambda b, t, s: dict(is_causal=True),
    "lengths_window_soft_cap": lambda b, t, s: dict(
        key_value_seq_lengths=jnp.array([s // 3, s], jnp.int32)[:b], local_window_size=(200, 17),
        logits_soft_cap=20.0),
    "bias_mask_dropout": lambda b, t, s: dict(
        bias=jax.ShapeDtypeStruct((1, 8, t, s), jnp.float32),
        mask=jnp.asarray(np.random.default_rng(1).random((b, 1, t, s)) < 0.8),
        dropout_rate=0.2, dropout_rng=jax.random.key(4)),
}


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("option", sorted(CUDA_CONTRACT_OPTIONS))
def test_pallas_triton_contract_holds_when_lowered_for_cuda(head_dim, option):
    """No GPU needed: what pallas_triton's registered ``supported`` says of a call on a GPU
    (by which test_on_gpu skips a case) is what the op does. JAX's Triton lowering has no
    padded blocks, so the contract is power-of-two head dims: there the forward and the
    gradients (q, k, v and bias) lower for cuda through it (the forward kernel, dQ, dK/dV);
    at head dim 96 the op refuses the call with that NotImplementedError before building a
    kernel. T = 1000 and S = 1537 divide no block."""
    b, t, s = 2, 1000, 1537
    kw = CUDA_CONTRACT_OPTIONS[option](b, t, s)
    bias = kw.pop("bias", None)
    args = [jax.ShapeDtypeStruct((b, t, 8, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, 2, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, 2, head_dim), jnp.bfloat16)] + ([bias] if bias else [])

    def loss(*a):
        out = ops.dot_product_attention(*a, implementation="pallas_triton", **kw)
        return jnp.sum(out.astype(jnp.float32))

    call = _resolve.capture_call(loss, args, differentiated=True)
    call = dataclasses.replace(call, target=_op.Target.of_kind("NVIDIA H200"))
    why = call.op.implementations["pallas_triton"].why_not(call)
    assert (why is None) == (head_dim & (head_dim - 1) == 0), why
    grads = jax.grad(loss, tuple(range(len(args))))
    if why is not None:
        with pytest.raises(NotImplementedError, match="power-of-two head dims"):
            jax.eval_shape(grads, *args)
        return
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dQ, dK/dV
