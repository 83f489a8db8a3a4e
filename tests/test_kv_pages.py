"""ops.update_kv_pages: tokens written into their slots in place (both cache layouts, padding
slots skipped), no copy of a donated cache under jit, the written cache read back by the
paged attention ops, bad input named."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops.serving import kv_pages
from tests.op_battery import Case, OpBattery, OpSpec
from tests.test_lowering import PLATFORM, lower_text

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


@pytest.mark.parametrize("impl", ["mosaic_tpu", "pallas_triton"])
@pytest.mark.parametrize("layout", ["combined", "heads_first"])
def test_lowering(impl, layout):
    cache = ((64, 16, 4, 128) if layout == "combined" else (2, 64, 16, 128), jnp.bfloat16)
    new = ((8, 2, 128), jnp.bfloat16)
    if layout == "combined":
        def f(kv, k, v, s):
            return ops.update_kv_pages(kv, k, v, s, implementation=impl)
        specs = (cache, new, new, ((8,), jnp.int32))
    else:
        def f(kp, vp, k, v, s):
            return ops.update_kv_pages((kp, vp), k, v, s, implementation=impl)
        specs = (cache, cache, new, new, ((8,), jnp.int32))
    text = lower_text(f, impl, *specs)
    assert PLATFORM[impl][1] in text and "update_kv_pages" in text


def test_pallas_triton_refuses_a_head_dim_not_a_power_of_two():
    kp = jnp.zeros((K, P, PS, 48), F32)
    k = jnp.zeros((5, K, 48), F32)
    with pytest.raises(NotImplementedError, match="power-of-two"):
        ops.update_kv_pages((kp, kp), k, k, jnp.zeros((5,), jnp.int32),
                            implementation="pallas_triton")


@pytest.mark.parametrize("path, layout", [("stores", "combined"), ("stores", "heads_first"),
                                          ("dma", "heads_first")])
def test_store_and_dma_kernels_on_the_interpreter(path, layout, monkeypatch):
    # pallas_triton's kernel (a program per head storing chunks of tokens at their slots) and
    # mosaic_tpu's for the [K, P, page_size, H] layout (a DMA per token) on the
    # interpreter: same cache as the scatter, in place (a donated cache is not copied).
    write = kv_pages._write_by_stores if path == "stores" else (
        lambda impl, combined, ps, *a: kv_pages._write_by_dma(impl, ps, *a))
    monkeypatch.setattr(kv_pages, "_write", write)
    rng = np.random.default_rng(11)
    shape = (P, PS, 2 * K, H) if layout == "combined" else (K, P, PS, H)
    cache = jnp.asarray(rng.standard_normal(shape), F32)
    cache = cache if layout == "combined" else (cache, cache + 1)
    k, v = new_tokens(12)
    slots = jnp.asarray([17, -1, 3, P * PS, 18], jnp.int32)
    want = ops.update_kv_pages(cache, k, v, slots, implementation="xla")
    f = jax.jit(lambda *a: ops.update_kv_pages(*a, implementation="interpret"), donate_argnums=0)
    hlo = f.lower(cache, k, v, slots).compile().as_text()
    out = f(cache, k, v, slots)
    for got, w in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, w)
    dims = ",".join(map(str, shape))
    assert not [ln for ln in hlo.splitlines() if f"f32[{dims}]" in ln and re.search(r"= \S+ copy\(", ln)]


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


# --------------------------------------------------------------------------
# The op battery (tests/op_battery.py): every implementation registered for a GPU
# --------------------------------------------------------------------------

def _battery_inputs(rng, dtype, layout="combined", total_pages=P, page_size=PS, k=K, h=H,
                    slots=(5, -1, 40, P * PS, 191, 16)):
    """A random cache (one combined array or a heads-first pair), new keys and values,
    and slots: distinct ones, two of them padding (-1 and past the cache)."""
    if layout == "combined":
        cache = jnp.asarray(rng.standard_normal((total_pages, page_size, 2 * k, h), np.float32), dtype)
    else:
        cache = tuple(jnp.asarray(rng.standard_normal((k, total_pages, page_size, h), np.float32), dtype)
                      for _ in range(2))
    new_k, new_v = (jnp.asarray(rng.standard_normal((len(slots), k, h), np.float32), dtype)
                    for _ in range(2))
    return cache, new_k, new_v, jnp.asarray(slots, jnp.int32)


def _battery_update(cache, new_k, new_v, slot_mapping, **kwargs):
    return ops.update_kv_pages(cache, new_k, new_v, slot_mapping, **kwargs)


def _scatter_reference(cache, new_k, new_v, slot_mapping):
    """The tokens scattered into their slots (jnp's ``.at[].set``, padding slots dropped):
    keys at the even and values at the odd combined heads, or into the pair's arrays."""
    pages = (cache[0] if isinstance(cache, tuple) else cache)
    total = pages.shape[1] if isinstance(cache, tuple) else pages.shape[0]
    page_size = pages.shape[2] if isinstance(cache, tuple) else pages.shape[1]
    valid = (slot_mapping >= 0) & (slot_mapping < total * page_size)
    page = jnp.where(valid, slot_mapping // page_size, total)  # out of range: dropped
    row = slot_mapping % page_size
    if isinstance(cache, tuple):
        return tuple(c.at[:, page, row].set(jnp.swapaxes(x, 0, 1), mode="drop")
                     for c, x in zip(cache, (new_k, new_v)))
    tokens, k, h = new_k.shape
    both = jnp.stack([new_k, new_v], axis=2).reshape(tokens, 2 * k, h)
    return cache.at[page, row].set(both, mode="drop")


# Copies: every implementation must give the reference's bits. On this host only XLA runs
# these (the kernels' CPU runs are the tests above); no gradients (serving only).
EXACT = {jnp.float32: 0.0, jnp.bfloat16: 0.0, jnp.float16: 0.0}
UPDATE_KV_PAGES = OpSpec(
    name="update_kv_pages", op=_battery_update, reference=_scatter_reference,
    make_inputs=_battery_inputs, implementations=("xla",), dtypes=(jnp.bfloat16, F32),
    cases=[Case(layout, dict(layout=layout), grads=False) for layout in ("combined", "pair")],
    forward=EXACT, backward=EXACT, xla_is_reference=False, unavailable=None)


class TestUpdateKvPagesBattery(OpBattery):
    """update_kv_pages against a jnp scatter, bit for bit."""
    spec = UPDATE_KV_PAGES
