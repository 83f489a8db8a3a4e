"""docs/pallas_core.md section 12: JAX Pallas idioms run unchanged on pallas_core with the import swapped.

Each kernel is written once against a Pallas namespace pair ``(P, T)``:
JAX's ``jax.experimental.pallas`` / ``jax.experimental.pallas.triton`` (run
with ``interpret=True``, the reference), or ours, ``pallas_core`` /
``pallas_core.triton``, run on our ``interpret`` backend and on our
``triton`` backend (Triton's CPU interpreter).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import triton as jplt

import pallas_core as pl

pytest.importorskip("triton")
pytest.importorskip("torch")

OURS = ("interpret", "triton")


def run(kernel, out_shape, *args, backend, **kw):
    """``kernel(*refs, P=..., T=...)`` on JAX's interpreter (backend "jax") or one of ours."""
    if backend == "jax":
        return jpl.pallas_call(functools.partial(kernel, P=jpl, T=jplt), out_shape=out_shape,
                               interpret=True, **kw)(*args)
    return pl.pallas_call(functools.partial(kernel, P=pl, T=pl.triton), out_shape=out_shape,
                          backend=backend, **kw)(*args)


def assert_like_jax(kernel, out_shape, *args, rtol=1e-6, atol=1e-6, **kw):
    want = run(kernel, out_shape, *args, backend="jax", **kw)
    for backend in OURS:
        got = run(kernel, out_shape, *args, backend=backend, **kw)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                                       err_msg=f"backend {backend}")
    return want


# ---- 3. masked access past a Ref's edge -----------------------------------------------

def test_masked_load_and_store_past_the_block_edge():
    """The row softmax of GPU kernels: a 128-lane view of a 125-wide block, the tail masked."""
    x = jax.random.normal(jax.random.key(0), (4, 125))

    def softmax(x_ref, o_ref, P, T):
        col = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1)
        v = T.load(x_ref.at[P.ds(0, 1), P.ds(0, 128)], mask=col < 125, other=-jnp.inf)
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        T.store(o_ref.at[P.ds(0, 1), P.ds(0, 128)], e / jnp.sum(e, axis=1, keepdims=True),
                mask=col < 125)

    spec = pl.BlockSpec((1, 125), lambda i: (i, 0))
    jspec = jpl.BlockSpec((1, 125), lambda i: (i, 0))
    want = run(softmax, jax.ShapeDtypeStruct(x.shape, x.dtype), x, backend="jax", grid=(4,),
               in_specs=[jspec], out_specs=jspec)
    np.testing.assert_allclose(want, jax.nn.softmax(x, axis=1), rtol=1e-5, atol=1e-7)
    for backend in OURS:
        got = run(softmax, jax.ShapeDtypeStruct(x.shape, x.dtype), x, backend=backend, grid=(4,),
                  in_specs=[spec], out_specs=spec)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=backend)


def test_masked_chunks_with_traced_starts_and_the_backend_neutral_load():
    """``pl.load(ref, (pl.ds(k * 64, 64),), mask=...)`` in a loop over a 200-wide block:
    the last chunk starts at 192, so a clamping slice would shift every lane of it."""
    x = jax.random.normal(jax.random.key(1), (200,))

    def chunked(x_ref, o_ref):
        lanes = jnp.arange(64)

        @pl.loop(0, 4)
        def _(k):
            keep = k * 64 + lanes < 200
            v = pl.load(x_ref, (pl.ds(k * 64, 64),), mask=keep, other=0.0)
            pl.store(o_ref, (pl.ds(k * 64, 64),), v * 2 + 1, mask=keep)

    for backend in OURS:
        got = pl.pallas_call(chunked, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                             backend=backend)(x)
        np.testing.assert_allclose(got, x * 2 + 1, rtol=1e-6, err_msg=backend)


def test_unmasked_access_past_the_edge_raises():
    x = jnp.zeros((125,))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def load_tail(x_ref, o_ref):
        o_ref[...] = pl.load(x_ref, (pl.ds(0, 128),))[:125]

    def store_tail(x_ref, o_ref):
        pl.triton.store(o_ref.at[pl.ds(0, 128)], jnp.zeros((128,)))

    def raw_index(x_ref, o_ref):
        o_ref[pl.ds(0, 8)] = x_ref[pl.ds(0, 128)][:8]

    for backend in OURS:
        for kernel in (load_tail, store_tail):
            with pytest.raises(IndexError, match="past the Ref's edge.*mask="):
                pl.pallas_call(kernel, out_shape=out, backend=backend)(x)
    with pytest.raises(IndexError, match="past its edge, with no mask"):
        pl.pallas_call(raw_index, out_shape=out, backend="triton")(x)


# ---- 4. gathers and scatters with index arrays ---------------------------------------

X = jax.random.normal(jax.random.key(2), (16, 32))
ROWS = jnp.array([3, 0, 7, 15, 2, 100, 9, 1], jnp.int32)  # 100: out of range, masked


def test_gathers_rows_and_elements_with_masks():
    def gather(i_ref, x_ref, rows_ref, elems_ref, P, T):
        i = i_ref[...]
        cols = jnp.arange(32)[None, :]
        inside = (i < 16)[:, None] & (cols < 32)
        rows_ref[...] = T.load(x_ref.at[i[:, None], cols], mask=inside, other=-1.0)
        j = (i * 5) % 32
        elems_ref[...] = T.load(x_ref.at[i, j], mask=i < 16, other=0.0)

    out = (jax.ShapeDtypeStruct((8, 32), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    rows, elems = assert_like_jax(gather, out, ROWS, X)
    ok = np.asarray(ROWS) < 16
    np.testing.assert_array_equal(rows[ok], np.asarray(X)[np.asarray(ROWS)[ok]])
    assert np.all(rows[~ok] == -1.0) and np.all(elems[~ok] == 0.0)


def test_unmasked_gathers_by_indexing_and_by_the_backend_neutral_load():
    idx = jnp.array([5, 1, 1, 12], jnp.int32)

    def gather(i_ref, x_ref, o_ref, P, T):
        o_ref[...] = x_ref[i_ref[...], :] * 2

    assert_like_jax(gather, jax.ShapeDtypeStruct((4, 32), jnp.float32), idx, X)

    def ours(i_ref, x_ref, o_ref):  # pl.load with (index array, slice), no mask
        o_ref[...] = pl.load(x_ref, (i_ref[...], slice(None))) * 2

    for backend in OURS:
        got = pl.pallas_call(ours, out_shape=jax.ShapeDtypeStruct((4, 32), jnp.float32),
                             backend=backend)(idx, X)
        np.testing.assert_allclose(got, X[idx] * 2, err_msg=backend)


def test_masked_scatter_store():
    rows = jnp.array([3, 0, 7, 15, 2, 10, 11, 1], jnp.int32)

    def scatter(i_ref, x_ref, o_ref, P, T):
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        i = i_ref[...]
        cols = jnp.arange(32)[None, :]
        T.store(o_ref.at[i[:, None], cols], x_ref[P.ds(0, 8), :], mask=(i < 9)[:, None] & (cols < 32))

    got = assert_like_jax(scatter, jax.ShapeDtypeStruct((16, 32), jnp.float32), rows, X)
    want = np.zeros((16, 32), np.float32)
    for k, r in enumerate(np.asarray(rows)):
        if r < 9:
            want[r] = np.asarray(X)[k]
    np.testing.assert_array_equal(got, want)


# ---- 2. None operands and pytrees of operands ------------------------------------------

def _affine(x_ref, b_ref, s_ref, o_ref, P=None, T=None):
    y = x_ref[...]
    if b_ref is not None:
        y = y + b_ref[...]
    if s_ref is not None:
        y = y * s_ref[...]
    o_ref[...] = y


def test_none_operands_line_up_as_in_jax():
    x = jax.random.normal(jax.random.key(3), (16, 128))
    s = jax.random.normal(jax.random.key(4), (1, 128))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    row = lambda P: P.BlockSpec((8, 128), lambda i: (i, 0))
    one = lambda P: P.BlockSpec((1, 128), lambda i: (0, 0))
    want = jpl.pallas_call(_affine, out_shape=out, grid=(2,), in_specs=[row(jpl), None, one(jpl)],
                           out_specs=row(jpl), interpret=True)(x, None, s)
    np.testing.assert_allclose(want, x * s, rtol=1e-6)
    for backend in OURS:
        got = pl.pallas_call(_affine, out_shape=out, grid=(2,), in_specs=[row(pl), None, one(pl)],
                             out_specs=row(pl), backend=backend)(x, None, s)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=backend)
    # Our extension kept: a None spec for an array is a whole-array block.
    got = pl.pallas_call(_affine, out_shape=out, in_specs=[None, None, None])(x, s, None)
    np.testing.assert_allclose(got, x + s, rtol=1e-6)
    with pytest.raises(ValueError, match=r"in_specs\[1\]: operand 1 is None, so its spec must be None"):
        pl.pallas_call(_affine, out_shape=out, grid=(2,), in_specs=[row(pl), one(pl), one(pl)],
                       out_specs=row(pl))(x, None, s)
    with pytest.raises(ValueError, match=r"(?s)`in_specs` and `inputs` do not match.*`in_specs` is a tuple of "
                                         r"length 2 but `inputs` is a tuple of length 3"):
        pl.pallas_call(_affine, out_shape=out, in_specs=[None, None])(x, None, s)


def test_pytree_operands_and_none_outputs_reach_the_kernel_as_in_jax():
    x = jnp.arange(8.0)
    seen = {}

    def kernel(d, y_ref, o_ref, none_out, P, T):
        seen[P.__name__] = (sorted(d), none_out)
        o_ref[...] = d["a"][...] + d["b"][...] * y_ref[...]

    out = (jax.ShapeDtypeStruct((8,), jnp.float32), None)
    got = assert_like_jax(kernel, out, {"a": x, "b": x + 1}, x)
    assert got[1] is None and all(v == (["a", "b"], None) for v in seen.values())
    assert set(seen) == {"jax.experimental.pallas", "pallas_core"}


# ---- 1. pallas.triton names and hints -------------------------------------------------

def _hinted(x_ref, o_ref, P, T):
    jax_ref = T is jplt  # JAX's interpreter runs neither the barrier nor PTX's tanh

    @P.loop(0, 2)
    def _(k):
        start = P.multiple_of(k * 128, 128)
        cols = T.max_contiguous(P.multiple_of(jnp.arange(128), 16), 128)
        at = (P.ds(0, 4), P.ds(start, 128))
        v = (T.load(x_ref.at[at], cache_modifier=".cg")
             + T.load(x_ref.at[at], eviction_policy="evict_last")
             + T.load(x_ref.at[at], volatile=True)) / 3
        if not jax_ref:
            T.debug_barrier()
        t = jnp.tanh(v) if jax_ref else T.approx_tanh(v)
        T.store(o_ref.at[at], t + (cols % 1).astype(jnp.float32)[None, :],
                eviction_policy="evict_first")


def test_triton_hints_run_everywhere_and_reach_the_generated_source():
    x = jax.random.normal(jax.random.key(5), (4, 256))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    want = assert_like_jax(_hinted, out, x, atol=2e-6)
    np.testing.assert_allclose(want, jnp.tanh(x), atol=2e-6)
    f = lambda x: run(_hinted, out, x, backend="triton")
    (source,) = pl.triton.source(f, x)
    for text in ("tl.multiple_of(", ", [128])", "tl.max_contiguous(", "cache_modifier='.cg'",
                 "eviction_policy='evict_last'", "volatile=True", "eviction_policy='evict_first'",
                 "tl.debug_barrier()", "_approx_tanh(", "tanh.approx.f32"):
        assert text in source, text


def test_triton_hints_compile_to_ptx_for_sm90():
    """On a GPU approx_tanh is PTX's tanh.approx.f32 and the hints reach the loads."""
    x = jax.ShapeDtypeStruct((4, 256), jnp.float32)
    (report,) = pl.triton.compile(lambda x: run(_hinted, x, x, backend="triton"), x)
    ptx = report["asm"]["ptx"]
    for text in ("tanh.approx.f32", "ld.global.cg", "L2::evict_last", "ld.volatile", "L2::evict_first",
                 "bar.sync"):
        assert text in ptx, text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_dot_transposes_and_precision(dtype):
    ka, kb = jax.random.split(jax.random.key(6))
    if dtype == jnp.int8:
        a = jax.random.randint(ka, (32, 16), -8, 8, jnp.int8)
        b = jax.random.randint(kb, (16, 32), -8, 8, jnp.int8)
    else:
        a = jax.random.normal(ka, (32, 16), dtype)
        b = jax.random.normal(kb, (16, 32), dtype)
    out_dtype = jnp.int32 if dtype == jnp.int8 else jnp.float32

    def kernel(a_ref, b_ref, o1, o2, o3, P, T):
        a, b = a_ref[...], b_ref[...]
        o1[...] = T.dot(a, b, allow_tf32=False)  # (32, 32)
        o2[...] = T.dot(a, b, trans_a=True, trans_b=True, precision=jax.lax.Precision.HIGHEST)
        o3[...] = T.dot(a.T, b, trans_a=True)

    out = (jax.ShapeDtypeStruct((32, 32), out_dtype), jax.ShapeDtypeStruct((16, 16), out_dtype),
           jax.ShapeDtypeStruct((32, 32), out_dtype))
    got = assert_like_jax(kernel, out, a, b, rtol=1e-5, atol=1e-4)
    assert all(g.dtype == out_dtype for g in got)
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(got[1], a32.T @ b32.T, rtol=1e-5, atol=1e-4)


def test_bitwise_atomics():
    """Each program sets, clears and flips bit ``i`` of shared words (JAX's interpreter
    has no rule for these atomics: checked against the arithmetic)."""
    init = jnp.array([0, -1, 0], jnp.int32)

    def kernel(x_ref, o_ref, old_ref):
        i = pl.program_id(0)
        bit = jnp.left_shift(jnp.int32(1), i)
        pl.triton.atomic_or(o_ref, 0, bit)
        pl.triton.atomic_and(o_ref, 1, ~bit, mask=i % 2 == 0)
        old_ref[pl.ds(i, 1)] = pl.triton.atomic_xor(o_ref, (pl.ds(2, 1),), jnp.full((1,), bit))

    for backend in OURS:
        words, olds = pl.pallas_call(
            kernel, grid=(8,), out_shape=(jax.ShapeDtypeStruct((3,), jnp.int32),
                                          jax.ShapeDtypeStruct((8,), jnp.int32)),
            in_specs=[None], out_specs=(None, None), input_output_aliases={0: 0},
            compiler_params=pl.CompilerParams(("parallel",)), backend=backend)(init)
        assert list(np.asarray(words)) == [0xFF, ~0x55, 0xFF], backend
        # Only program i flips bit i, so the word it saw before its flip has bit i clear.
        assert not np.any((np.asarray(olds) >> np.arange(8)) & 1), backend


def test_bad_input_names_the_argument():
    x = jnp.zeros((8, 128))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def call(body):
        def kernel(x_ref, o_ref):
            body(x_ref, o_ref)
            o_ref[...] = x_ref[...]
        return pl.pallas_call(kernel, out_shape=out, backend="interpret")(x)

    cases = [
        (TypeError, "approx_tanh: x must be a float", lambda x, o: pl.triton.approx_tanh(jnp.int32(1))),
        (ValueError, "dot: a must be a 2-D array", lambda x, o: pl.triton.dot(x[...][0], x[...])),
        (ValueError, "allow_tf32 or precision", lambda x, o: pl.triton.dot(x[...], x[...].T, allow_tf32=True,
                                                                          precision="highest")),
        (ValueError, "multiple_of: 3 value", lambda x, o: pl.multiple_of(x[...], (8, 8, 8))),
        (ValueError, "max_contiguous: x must be an array", lambda x, o: pl.triton.max_contiguous(1, 8)),
        (ValueError, "cache_modifier must be one of", lambda x, o: pl.triton.load(x, cache_modifier=".xx")),
        (ValueError, "eviction_policy must be one of", lambda x, o: pl.triton.store(o, x[...], eviction_policy="x")),
        (ValueError, "at most one of cache_modifier", lambda x, o: pl.load(x, (), cache_modifier=".cg",
                                                                          volatile=True)),
        (ValueError, "load: mask of shape", lambda x, o: pl.triton.load(x, mask=jnp.ones((3,), bool))),
        (TypeError, "load: mask must be a boolean", lambda x, o: pl.triton.load(x, mask=jnp.ones((128,)))),
        (TypeError, "store: value has dtype int32", lambda x, o: pl.store(o, (), jnp.ones((8, 128), jnp.int32),
                                                                         mask=jnp.ones((8, 128), bool))),
        (TypeError, "atomic_or: the Ref must hold integers", lambda x, o: pl.triton.atomic_or(o, (0, 0), 1.0)),
    ]
    for error, message, body in cases:
        with pytest.raises(error, match=message):
            call(body)


def test_the_same_kernels_lower_on_jax_pallas_triton():
    """On ``pallas_triton`` our names are JAX's own: masked loads and stores (edge masks
    folded in), hints, the barrier and approx_tanh lower for CUDA from this host."""
    def masked(x_ref, o_ref):
        col = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1)
        v = pl.triton.load(x_ref.at[pl.ds(0, 1), pl.ds(0, 128)], mask=col < 100, other=-jnp.inf)
        pl.triton.store(o_ref.at[pl.ds(0, 1), pl.ds(0, 128)], v, mask=col < 100)

    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))  # overhangs the 100 columns: edge-masked
    calls = [
        (lambda x: run(_hinted, x, x, backend="pallas_triton"), (4, 256)),
        (lambda x: pl.pallas_call(masked, out_shape=x, grid=(4,), in_specs=[spec], out_specs=spec,
                                  backend="pallas_triton")(x), (4, 100)),
    ]
    for fn, shape in calls:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
