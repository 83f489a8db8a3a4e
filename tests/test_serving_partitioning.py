"""The serving ops and ops.ragged_dot on a 2-device CPU mesh (ops._partitioning; the rules in
ops/serving/sharding.py, ops/serving/kv_pages.py and ops/moe/ragged_dot.py).

Explicit mesh axes (shard_map at trace time) and automatic ones (custom_partitioning): the
results equal the single-device XLA reference, keep the rule's sharding, and the compiled
HLO has no all-gather where the rule keeps every sharded dim (heads of a KV cache, its
pages in update_kv_pages, rows / groups / contraction / columns of ragged_dot), and no
copy of a donated cache.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ops
from tests import test_paged_attention as paged_tests
from tests import test_ragged_paged_attention as ragged_tests
from tests.tolerances import BACKWARD, FORWARD, assert_close

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
F32 = jnp.float32


def mesh(mode):
    return jax.make_mesh((2,), ("x",), axis_types=(mode,), devices=jax.devices()[:2])


def compiled(f, mode, args, specs, **jit):
    m = mesh(mode)
    placed = [a if s is None else jax.device_put(a, NamedSharding(m, s))
              for a, s in zip(args, specs)]
    c = jax.jit(f, **jit).lower(*placed).compile()
    return c, c(*placed), m


def no_all_gather(hlo):
    gathers = [line.strip()[:160] for line in hlo.splitlines() if "all-gather(" in line]
    assert not gathers, gathers


@pytest.mark.parametrize("mode, specs", [
    # Tensor-parallel: query heads and the caches' kv heads over the axis.
    pytest.param(EXPLICIT, (P(None, "x"), P("x"), P("x"), None, None), id="heads-explicit"),
    # Data-parallel sequences over a cache every device holds.
    pytest.param(AUTO, (P("x"), None, None, P("x"), P("x")), id="batch-auto",
                 marks=pytest.mark.slow),
])
def test_paged_attention(mode, specs):
    q, kp, vp, tables, lengths, _, _ = paged_tests.make_case(0, B=4, N=8, K=2)
    lengths = lengths.at[1].set(0)
    sinks = jnp.linspace(-1.0, 1.0, 8, dtype=F32)

    def f(impl):
        return lambda *a: ops.paged_attention(*a, scale=0.3, sinks=sinks, implementation=impl)
    want = f("xla")(q, kp, vp, tables, lengths)
    c, out, m = compiled(f("interpret"), mode, (q, kp, vp, tables, lengths), specs)
    assert_close(out, want, FORWARD[F32], "paged_attention")
    assert out.sharding.is_equivalent_to(NamedSharding(m, specs[0]), 3), out.sharding
    no_all_gather(c.as_text())


@pytest.mark.parametrize("mode", [pytest.param(EXPLICIT, marks=pytest.mark.slow), AUTO],
                         ids=["explicit", "auto"])
def test_ragged_paged_attention_heads(mode):
    args = ragged_tests.make_case(0, N=8, K=2)  # prefill, decode, empty
    sinks = jnp.linspace(-1.0, 1.0, 8, dtype=F32)

    def f(impl):
        return lambda *a: ops.ragged_paged_attention(*a, scale=0.3, sinks=sinks,
                                                     implementation=impl)
    want = f("xla")(*args)
    specs = (P(None, "x"), P(None, None, "x")) + (None,) * 4
    c, out, m = compiled(f("interpret"), mode, args, specs)
    assert_close(out, want, FORWARD[F32], "ragged_paged_attention")
    assert out.sharding.is_equivalent_to(NamedSharding(m, P(None, "x")), 3), out.sharding
    no_all_gather(c.as_text())


@pytest.mark.slow
def test_a_split_cache_without_split_heads_is_gathered_and_stays_correct():
    # Pages split over the axis: a page table holds global page numbers, so the rule
    # gathers them (the documented price), and the result is still exact.
    q, kp, vp, tables, lengths, _, _ = paged_tests.make_case(1, B=2, N=4, K=2)
    f = lambda *a: ops.paged_attention(*a, implementation="interpret")  # noqa: E731
    c, out, _ = compiled(f, EXPLICIT, (q, kp, vp, tables, lengths),
                         (None, P(None, "x"), P(None, "x"), None, None))
    assert_close(out, ops.paged_attention(q, kp, vp, tables, lengths, implementation="xla"),
                 FORWARD[F32], "paged_attention")
    assert "all-gather(" in c.as_text()  # the check above can fail


PAGES, PAGE, KV, H = 8, 16, 2, 32


def kv_case(seed, T=5):
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.standard_normal((PAGES, PAGE, 2 * KV, H)), F32)
    k, v = (jnp.asarray(rng.standard_normal((T, KV, H)), F32) for _ in range(2))
    # Slots on both halves of the pages, padding (-1, past the cache) and a page boundary.
    slots = jnp.asarray([5, -1, 70, PAGES * PAGE, 64], jnp.int32)
    return kv, k, v, slots


@pytest.mark.parametrize("mode, spec", [(EXPLICIT, P(None, None, "x")), (AUTO, P("x"))],
                         ids=["heads-explicit", "pages-auto"])
def test_update_kv_pages_in_place_on_its_devices(mode, spec):
    kv, k, v, slots = kv_case(2)
    want = ops.update_kv_pages(kv, k, v, slots, implementation="xla")
    f = lambda *a: ops.update_kv_pages(*a, implementation="interpret")  # noqa: E731
    c, out, m = compiled(f, mode, (kv, k, v, slots), (spec, None, None, None), donate_argnums=0)
    np.testing.assert_array_equal(out, want)
    assert out.sharding.is_equivalent_to(NamedSharding(m, spec), 4), out.sharding
    hlo = c.as_text()
    no_all_gather(hlo)
    local = f"f32[{PAGES // 2},{PAGE},{2 * KV},{H}]" if spec == P("x") else \
        f"f32[{PAGES},{PAGE},{KV},{H}]"
    copies = [ln for ln in hlo.splitlines() if local in ln and re.search(r"= \S+ copy\(", ln)]
    assert not copies, copies


@pytest.mark.slow
def test_update_kv_pages_split_layout_pages_and_heads():
    rng = np.random.default_rng(3)
    kp, vp = (jnp.asarray(rng.standard_normal((KV, PAGES, PAGE, H)), F32) for _ in range(2))
    _, k, v, slots = kv_case(4)
    want = ops.update_kv_pages((kp, vp), k, v, slots, implementation="xla")
    m = jax.make_mesh((2, 2), ("a", "b"), axis_types=(EXPLICIT,) * 2, devices=jax.devices()[:4])
    put = lambda x: jax.device_put(x, NamedSharding(m, P("a", "b")))  # noqa: E731
    f = jax.jit(lambda *a: ops.update_kv_pages(*a, implementation="interpret"))
    out = f((put(kp), put(vp)), k, v, slots)
    for got, w in zip(out, want):
        np.testing.assert_array_equal(got, w)
        assert got.sharding.spec == P("a", "b", None, None)


# ragged_dot: rows past the sum of group_sizes, an empty group.
M, K, N, G = 40, 24, 16, 4
SIZES = np.asarray([7, 0, 19, 9], np.int32)


def ragged_dot_case():
    rng = np.random.default_rng(5)
    return (jnp.asarray(rng.standard_normal((M, K)), F32),
            jnp.asarray(rng.standard_normal((G, K, N)), F32),
            jnp.asarray(rng.standard_normal((M, N)), F32))


@pytest.mark.parametrize("mode, specs", [
    pytest.param(EXPLICIT, (P("x"), None), id="rows-explicit"),
    pytest.param(AUTO, (None, P("x")), id="groups-auto", marks=pytest.mark.slow),
    pytest.param(AUTO, (P(None, "x"), P(None, "x")), id="contraction-auto",
                 marks=pytest.mark.slow),
    pytest.param(EXPLICIT, (None, P(None, None, "x")), id="columns-explicit",
                 marks=pytest.mark.slow),
])
def test_ragged_dot(mode, specs):
    lhs, rhs, cot = ragged_dot_case()
    sizes = jnp.asarray(SIZES)

    def f(impl):
        def value_and_grads(lhs, rhs):
            out = ops.ragged_dot(lhs, rhs, sizes, implementation=impl)
            grads = jax.grad(lambda a, b: jnp.sum(
                ops.ragged_dot(a, b, sizes, implementation=impl) * cot), (0, 1))(lhs, rhs)
            return out, grads
        return value_and_grads

    want_out, want_grads = jax.jit(f("xla"))(lhs, rhs)
    c, (out, grads), m = compiled(f("interpret"), mode, (lhs, rhs), specs)
    assert_close(out, want_out, FORWARD[F32], "ragged_dot")
    for name, got, want, spec in zip(("dlhs", "drhs"), grads, want_grads, specs):
        assert_close(got, want, BACKWARD[F32], name)
        if mode == EXPLICIT:  # a gradient keeps its primal's sharding
            assert got.sharding.is_equivalent_to(NamedSharding(m, spec or P()), got.ndim)
    hlo = c.as_text()
    no_all_gather(hlo)
    # Partial sums: drhs over split rows; out over a split contraction or groups, dlhs over
    # split groups or columns.
    assert "all-reduce(" in hlo
