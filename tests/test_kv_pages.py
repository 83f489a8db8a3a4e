"""ops.update_kv_pages: tokens written into their slots in place (both cache layouts, padding
slots skipped), no copy of a donated cache under jit, the written cache read back by the
paged attention ops, bad input named."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from tests.test_lowering import lower_text

F32 = jnp.float32
P, PS, K, H = 12, 16, 2, 32


def expected_combined(kv, k, v, slots):
    out = np.array(kv)
    for t, s in enumerate(np.asarray(slots)):
        if 0 <= s < P * PS:
            out[s // PS, s % PS, 0::2] = k[t]
            out[s // PS, s % PS, 1::2] = v[t]
    return out


def new_tokens(seed, T=5):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((T, K, H)), F32),
            jnp.asarray(rng.standard_normal((T, K, H)), F32))


@pytest.mark.parametrize("impl", ["xla", "interpret", "triton"])
def test_combined_layout(impl):
    kv = jnp.asarray(np.random.default_rng(0).standard_normal((P, PS, 2 * K, H)), F32)
    k, v = new_tokens(1)
    slots = jnp.asarray([5, -1, 40, P * PS, 191], jnp.int32)  # padding: -1 and past the cache
    out = ops.update_kv_pages(kv, k, v, slots, implementation=impl)
    np.testing.assert_array_equal(out, expected_combined(kv, k, v, slots))


@pytest.mark.parametrize("impl", ["xla", "interpret", "triton"])
def test_heads_first_pair(impl):
    rng = np.random.default_rng(2)
    kp, vp = (jnp.asarray(rng.standard_normal((K, P, PS, H)), F32) for _ in range(2))
    k, v = new_tokens(3)
    slots = jnp.asarray([17, 3, -1, 100, 18], jnp.int32)
    out_k, out_v = ops.update_kv_pages((kp, vp), k, v, slots, implementation=impl)
    for out, pages, new in ((out_k, kp, k), (out_v, vp, v)):
        want = np.array(pages)
        for t, s in enumerate(np.asarray(slots)):
            if s >= 0:
                want[:, s // PS, s % PS] = new[t]
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_all_padding_leaves_the_cache(impl):
    kv = jnp.asarray(np.random.default_rng(4).standard_normal((P, PS, 2 * K, H)), F32)
    k, v = new_tokens(5, T=3)
    out = ops.update_kv_pages(kv, k, v, jnp.full((3,), -1, jnp.int32), implementation=impl)
    np.testing.assert_array_equal(out, kv)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_donated_cache_is_not_copied(impl):
    kv = jnp.zeros((P, PS, 2 * K, H), F32)
    k, v = new_tokens(6)
    slots = jnp.asarray([1, 2, 3, -1, 40], jnp.int32)
    f = jax.jit(lambda *a: ops.update_kv_pages(*a, implementation=impl), donate_argnums=0)
    hlo = f.lower(kv, k, v, slots).compile().as_text()
    cache = f"f32[{P},{PS},{2 * K},{H}]"
    copies = [line for line in hlo.splitlines() if cache in line and re.search(r"= \S+ copy\(", line)]
    assert not copies, copies
    assert "input_output_alias" in hlo
    # Without donation XLA must copy (the check can fail).
    plain = jax.jit(lambda *a: ops.update_kv_pages(*a, implementation=impl))
    hlo = plain.lower(kv, k, v, slots).compile().as_text()
    assert any(cache in line and re.search(r"= \S+ copy\(", line) for line in hlo.splitlines())


def test_write_then_attend():
    # Decode step: append one token per sequence, then ragged attention sees it.
    rng = np.random.default_rng(7)
    kv = jnp.asarray(rng.standard_normal((P, PS, 2 * K, H)), F32)
    tables = jnp.asarray(rng.permutation(P)[:8].reshape(2, 4), jnp.int32)
    kv_lens = jnp.asarray([17, 33], jnp.int32)  # after the append
    slots = jnp.asarray([tables[0, 1] * PS + 0, tables[1, 2] * PS + 0], jnp.int32)
    k, v = new_tokens(8, T=2)
    kv = ops.update_kv_pages(kv, k, v, slots, implementation="interpret")
    meta = (kv_lens, tables, jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([2], jnp.int32))
    # The new key dominates when q is its key scaled up: output -> its value.
    q_hot = jnp.repeat(k, 2, axis=1) * 50.0
    out = ops.ragged_paged_attention(q_hot, kv, *meta, implementation="xla")
    np.testing.assert_allclose(out, jnp.repeat(v, 2, axis=1), atol=1e-3)


def test_mosaic_tpu_lowering_and_heads_first_refused():
    text = lower_text(lambda kv, k, v, s: ops.update_kv_pages(kv, k, v, s, implementation="mosaic_tpu"),
                      "mosaic_tpu", ((64, 16, 4, 128), jnp.bfloat16), ((8, 2, 128), jnp.bfloat16),
                      ((8, 2, 128), jnp.bfloat16), ((8,), jnp.int32))
    assert "tpu_custom_call" in text
    kp = jnp.zeros((K, P, PS, H), F32)
    k, v = new_tokens(9)
    with pytest.raises(NotImplementedError, match="combined layout only"):
        ops.update_kv_pages((kp, kp), k, v, jnp.zeros((5,), jnp.int32), implementation="mosaic_tpu")


@pytest.mark.parametrize("case", range(7))
def test_bad_input_named(case):
    kv = jnp.zeros((P, PS, 2 * K, H), F32)
    k, v = new_tokens(10)
    s = jnp.zeros((5,), jnp.int32)
    kwargs, error, match = [
        (dict(kv_pages=kv[0]), ValueError, "kv_pages must have rank 4"),
        (dict(kv_pages=kv[:, :, :3]), ValueError, "2 \\* K combined heads"),
        (dict(kv_pages=(kv, kv, kv)), ValueError, "one array or a pair"),
        (dict(new_k=k[:4]), ValueError, "new_k must have shape"),
        (dict(new_v=v.astype(jnp.bfloat16)), TypeError, "new_v has dtype bfloat16"),
        (dict(slot_mapping=s.astype(jnp.int64) if jax.config.x64_enabled else s.astype(F32)),
         TypeError, "slot_mapping must be int32"),
        (dict(implementation="gpu"), ValueError, "implementation must be"),
    ][case]
    args = dict(kv_pages=kv, new_k=k, new_v=v, slot_mapping=s) | kwargs
    with pytest.raises(error, match=match):
        ops.update_kv_pages(**args)
