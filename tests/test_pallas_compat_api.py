"""docs/pallas_core.md section 13: the rest of JAX 0.10.2's Pallas module API, with the import swapped.

Each kernel is written once against a namespace pair ``(P, T)``: JAX's
``jax.experimental.pallas`` / ``.tpu`` run with ``interpret=True`` (the
reference), or ours, ``pallas_core`` / ``pallas_core.tpu``, on our
``interpret`` backend (and ``triton`` where the feature exists there). What
JAX's interpreter cannot run (BoundedSlice, the TPU PRNG) is checked against
an XLA reference or by its properties; ``mosaic_tpu`` forwarding is checked
by lowering for a TPU from this host.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import pallas_core as pl
from pallas_core import tpu as pltpu

F32 = jnp.float32


def call(kernel, out_shape, *args, ours=True, backend="interpret", **kw):
    """``kernel(*refs, P=..., T=...)``: ours on ``backend``, or JAX's interpreter.
    Keyword values may be ``lambda P, T: ...``, built from the namespaces in use."""
    P, T = (pl, pltpu) if ours else (jpl, jpltpu)
    kw = {k: v(P, T) if callable(v) else v for k, v in kw.items()}
    if ours:
        kw["backend"] = backend
    else:
        kw["interpret"] = True
    return P.pallas_call(functools.partial(kernel, P=P, T=T), out_shape=out_shape, **kw)(*args)


def both(kernel, out_shape, *args, **kw):
    """(ours on interpret, JAX's interpret) of one kernel."""
    return (call(kernel, out_shape, *args, **kw), call(kernel, out_shape, *args, ours=False, **kw))


def normal(seed, shape):
    """Standard normal float32 values from numpy (each new shape of jax.random.normal costs
    an XLA compile of threefry, about 10 s on the CI-like host)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def lower_for_tpu(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def _copy(x_ref, o_ref, P, T):
    o_ref[...] = x_ref[...] * 2.0


# ---- block dims: Element, Squeezed, Blocked(b), BoundedSlice ------------------------------

def test_element_padding_and_squeezed_dims_like_jax():
    """Overlapping row windows at element offsets (padding reads as NaN on both), the output
    block's leading dim squeezed with pl.squeezed, the column dim given as Blocked(12)."""
    x = jax.random.normal(jax.random.key(0), (10, 12), F32)
    kw = dict(grid=(4,),
              in_specs=lambda P, T: [P.BlockSpec((P.Element(4, (1, 1)), P.Blocked(12)),
                                                 lambda i: (i * 2, 0))],
              out_specs=lambda P, T: P.BlockSpec((P.squeezed, 4, 12), lambda i: (i, 0, 0)))
    ours, want = both(_copy, jax.ShapeDtypeStruct((4, 4, 12), F32), x, **kw)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(want))
    assert np.isnan(want[0, 0]).all() and not np.isnan(want[1:]).any()  # the low padding row
    np.testing.assert_array_equal(np.nan_to_num(ours), np.nan_to_num(want))
    for i in range(1, 4):  # window i starts at padded row 2 i, array row 2 i - 1
        np.testing.assert_array_equal(ours[i], 2 * x[2 * i - 1:2 * i + 3])
    # Our triton backend: masked loads, both edges (the padding reads as 0 there).
    tri = call(_copy, jax.ShapeDtypeStruct((4, 4, 12), F32), x, backend="triton", **kw)
    inside = ~np.isnan(want)
    np.testing.assert_array_equal(tri[inside], want[inside])


def test_element_output_windows_like_jax():
    """Output blocks at element offsets into an output padded by one row before it: the
    first window's row -1 is dropped, so out[r] = 2 x[r + 1]."""
    x = jax.random.normal(jax.random.key(10), (12, 16), F32)
    out_shape = jax.ShapeDtypeStruct((8, 16), F32)
    kw = dict(grid=(3,), in_specs=lambda P, T: [P.BlockSpec((4, 16), lambda i: (i, 0))],
              out_specs=lambda P, T: P.BlockSpec((P.Element(4, (1, 0)), 16), lambda i: (4 * i, 0)))
    ours, want = both(_copy, out_shape, x, **kw)
    np.testing.assert_array_equal(ours, want)
    np.testing.assert_array_equal(ours, 2 * x[1:9])
    np.testing.assert_array_equal(call(_copy, out_shape, x, backend="triton", **kw), want)


def test_squeezed_blocked_and_buffered_on_triton():
    """Squeezed() like None, Blocked(b) like b, pipeline_mode and cost_estimate accepted."""
    x = jax.random.normal(jax.random.key(1), (3, 8, 16), F32)
    out = call(_copy, x, x, backend="triton", grid=(3,),
               in_specs=[pl.BlockSpec((pl.Squeezed(), pl.Blocked(8), 16), lambda i: (i, 0, 0),
                                      pipeline_mode=pl.Buffered(1))],
               out_specs=pl.BlockSpec((None, 8, 16), lambda i: (i, 0, 0)),
               cost_estimate=pl.CostEstimate(flops=384, transcendentals=0, bytes_accessed=3072))
    np.testing.assert_array_equal(out, 2 * x)


def _add_one(x_ref, o_ref, P, T):
    o_ref[...] = x_ref[...] + 1.0


def test_bounded_slice_reads_and_writes_only_its_size():
    """Ragged row groups [0, 3), [3, 7), [7, 9) through BoundedSlice(4): row 9 is never
    written (it keeps the aliased input) and rows past a slice's size are not written back."""
    x = jax.random.normal(jax.random.key(2), (10, 16), F32)
    starts, sizes = jnp.array([0, 3, 7]), jnp.array([3, 4, 2])

    def rows(i):
        return pl.ds(starts[i], sizes[i]), 0

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    spec = pl.BlockSpec((pl.BoundedSlice(4), 16), rows)
    out = pl.pallas_call(kernel, out_shape=x, grid=(3,), in_specs=[spec], out_specs=spec,
                         input_output_aliases={0: 0}, interpret=True)(x)
    np.testing.assert_array_equal(out[:9], x[:9] + 1.0)
    np.testing.assert_array_equal(out[9], x[9])


@pytest.mark.parametrize("backend", ["interpret", "triton"])
def test_bounded_slice_with_prefetched_starts_and_sizes(backend):
    """The ragged groups of the test above, their starts and sizes prefetched (a kernel cannot
    close over arrays on triton), eagerly and under jit; triton masks lanes past the size."""
    x = normal(3, (10, 16))
    spec = pl.BlockSpec((pl.BoundedSlice(4), 16), lambda i, st, sz: (pl.ds(st[i], sz[i]), 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(3,), in_specs=[spec],
                                             out_specs=spec)

    def kernel(starts, sizes, x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    run = lambda st, sz, v: pl.pallas_call(kernel, out_shape=v, grid_spec=grid_spec, backend=backend,
                                           input_output_aliases={2: 0})(st, sz, v)
    starts, sizes = jnp.array([0, 3, 7], jnp.int32), jnp.array([3, 4, 2], jnp.int32)
    for out in (run(starts, sizes, x), jax.jit(run)(starts, sizes, x)):
        np.testing.assert_array_equal(out[:9], x[:9] + 1.0)
        np.testing.assert_array_equal(out[9], x[9])
    if backend == "triton":
        (source,) = pl.triton.source(run, starts, sizes, x)
        assert "tl.store(p3 + " in source and " < (v" in source  # the size bounds the store


def test_bounded_slice_needs_a_ds():
    spec = pl.BlockSpec((pl.BoundedSlice(4), 16), lambda i: (i, 0))
    with pytest.raises(TypeError, match="BoundedSlice dim takes pl.ds"):
        call(_copy, jax.ShapeDtypeStruct((8, 16), F32), jnp.zeros((8, 16), F32), grid=(2,),
             in_specs=[spec])


def test_block_dim_errors():
    with pytest.raises(TypeError, match="Element"):
        pl.Element(0)
    with pytest.raises(ValueError, match="padding"):
        pl.Element(4, (-1, 0))
    with pytest.raises(TypeError, match="block_shape"):
        pl.BlockSpec((4.0, 8), lambda i: (i, 0))
    with pytest.raises(TypeError, match="pipeline_mode"):
        pl.BlockSpec((8, 8), lambda i: (i, 0), pipeline_mode=2)
    with pytest.raises(TypeError, match="buffer_count"):
        pl.Buffered(0)
    with pytest.raises(ValueError, match="Unblocked"):
        pl.BlockSpec((pl.Element(4), 8), lambda i: (i, 0), indexing_mode=pl.Unblocked())
    bounded = [pl.BlockSpec((pl.BoundedSlice(8), 16), lambda: (pl.ds(0, 8), 0))]
    with pytest.raises(ValueError, match="BoundedSlice"):  # nor on JAX's Triton lowering
        call(_copy, jax.ShapeDtypeStruct((8, 16), F32), jnp.zeros((8, 16), F32),
             backend="pallas_triton", in_specs=bounded)
    with pytest.raises(NotImplementedError, match="BoundedSlice"):  # nor in JAX's lowerings
        call(_copy, jax.ShapeDtypeStruct((8, 16), F32), jnp.zeros((8, 16), F32),
             backend="mosaic_tpu", in_specs=bounded)


def test_cost_estimate_errors():
    x = jnp.zeros((8, 16), F32)
    with pytest.raises(TypeError, match="flops"):
        pl.CostEstimate(flops=-1, transcendentals=0, bytes_accessed=0)
    with pytest.raises(TypeError, match="cost_estimate"):
        call(_copy, x, x, cost_estimate="cheap")
    with pytest.raises(ValueError, match="cost_estimate"):
        call(_copy, x, x, cost_estimate={"flops": 1})


# ---- ANY, no_block_spec, debug_print ------------------------------------------------------

def test_any_memory_space_and_no_block_spec_give_whole_arrays():
    x = jax.random.normal(jax.random.key(4), (8, 16), F32)
    for space in (lambda P: P.ANY, lambda P: P.MemorySpace.ANY):
        ours, want = both(_copy, x, x, in_specs=lambda P, T: [P.BlockSpec(memory_space=space(P))],
                          out_specs=lambda P, T: P.no_block_spec)
        np.testing.assert_array_equal(ours, want)


def test_debug_print_prints_like_jax(capsys):
    x = jnp.arange(4.0, dtype=F32).reshape(2, 2)

    def kernel(x_ref, o_ref, P, T):
        P.debug_print("x00 = {}", x_ref[0, 0])
        P.debug_print("sum", jnp.sum(x_ref[...]))
        o_ref[...] = x_ref[...]

    call(kernel, x, x)
    ours = capsys.readouterr().out
    call(kernel, x, x, ours=False)
    want = capsys.readouterr().out
    assert "x00 = 0.0" in ours and "sum 6.0" in ours
    assert ours.splitlines()[0] == want.splitlines()[0]
    with pytest.raises(ValueError, match="placeholder"):
        call(lambda x_ref, o_ref, P, T: P.debug_print("{} {}", 1.0), x, x)


def test_debug_print_on_triton(capfd):
    """tl.device_print in Triton's interpreter: each value after its prefix, once per program
    (an arbitrary grid axis: one launched program, the loop inside), and printf in the PTX."""
    x = jnp.arange(8.0, dtype=F32).reshape(2, 4)

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        pl.debug_print("x00 = {} at {}", x_ref[0, 0], i)
        pl.debug_print("row", x_ref[i, :].astype(jnp.bfloat16))  # 16-bit floats print as values
        pl.debug_print("done")
        o_ref[...] = x_ref[...]

    run = lambda x: pl.pallas_call(kernel, out_shape=x, grid=(2,), backend="triton")(x)
    capfd.readouterr()
    np.testing.assert_array_equal(run(x), x)
    lines = [" ".join(line.split(") ", 1)[1].split()) for line in capfd.readouterr().out.splitlines()]
    assert lines == ["x00 =: [0.]", "at: [0]", "row: [0. 1. 2. 3.]", "done",
                     "x00 =: [0.]", "at: [1]", "row: [4. 5. 6. 7.]", "done"], lines
    assert "vprintf" in pl.triton.compile(run, x)[0]["asm"]["ptx"]
    with pytest.raises(ValueError, match="after the last"):
        pl.triton.source(lambda x: pl.pallas_call(
            lambda x_ref, o_ref: pl.debug_print("{} units", x_ref[0, 0]), out_shape=x,
            backend="triton")(x), x)
    with pytest.raises(NotImplementedError, match="padding lanes"):
        pl.triton.source(lambda x: pl.pallas_call(
            lambda x_ref, o_ref: pl.debug_print("row", x_ref[0, :3]), out_shape=x,
            backend="triton")(x), x)


def test_reciprocal_align_to_and_empty_like_jax():
    x = jax.random.uniform(jax.random.key(12), (8, 128), F32, 0.5, 2.0)

    def kernel(x_ref, o_ref, i_ref, P, T):
        scratch = P.empty_like(x_ref)  # unspecified values, overwritten before use
        assert scratch.shape == x_ref.shape and scratch.dtype == x_ref.dtype
        assert P.align_to(5, 4) == 8 and P.empty((2, 3), jnp.int32).shape == (2, 3)
        scratch = jnp.where(True, P.reciprocal(x_ref[...]), scratch)
        o_ref[...] = scratch + P.reciprocal(x_ref[...], approx=True)
        i_ref[...] = P.align_to(jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1), 8)

    out_shape = (jax.ShapeDtypeStruct((8, 128), F32), jax.ShapeDtypeStruct((8, 128), jnp.int32))
    (ours, ours_i), (want, want_i) = both(kernel, out_shape, x)
    np.testing.assert_allclose(ours, 2 / x, rtol=1e-6)
    np.testing.assert_allclose(want, 2 / x, rtol=1e-2)  # JAX emulates an approximate one
    np.testing.assert_array_equal(ours_i, want_i)
    tri, tri_i = call(kernel, out_shape, x, backend="triton")
    np.testing.assert_allclose(tri, 2 / x, rtol=1e-6)
    np.testing.assert_array_equal(tri_i, want_i)
    with pytest.raises(TypeError, match="floating"):
        pl.reciprocal(jnp.arange(3))


# ---- scalar prefetch ----------------------------------------------------------------------

def _gathered_rows(pages, x_ref, o_ref, P, T):
    o_ref[...] = x_ref[...] * 2.0 + pages[P.program_id(0)].astype(F32)


def _prefetch_spec(P, T):
    """A page table picks each input block; output blocks are written in reverse order."""
    return T.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(4,),
        in_specs=[P.BlockSpec((8, 16), lambda i, pages: (pages[i], 0))],
        out_specs=P.BlockSpec((8, 16), lambda i, pages: (3 - i, 0)))


def test_prefetch_scalar_grid_spec_like_jax():
    x = jax.random.normal(jax.random.key(5), (40, 16), F32)
    pages = jnp.array([4, 0, 2, 2], jnp.int32)
    out_shape = jax.ShapeDtypeStruct((32, 16), F32)
    ours, want = both(_gathered_rows, out_shape, pages, x, grid_spec=_prefetch_spec)
    np.testing.assert_array_equal(ours, want)
    expect = jnp.concatenate([2 * x[8 * p:8 * p + 8] + p for p in pages.tolist()][::-1])
    np.testing.assert_array_equal(ours, expect)
    # Under jit and vmap over the page tables (one batch element after another).
    tables = jnp.stack([pages, pages[::-1]])
    batched = jax.jit(jax.vmap(lambda pg: call(_gathered_rows, out_shape, pg, x,
                                               grid_spec=_prefetch_spec)))
    per_table = batched(tables)
    np.testing.assert_array_equal(per_table[0], expect)
    np.testing.assert_array_equal(per_table[1], jnp.concatenate(
        [2 * x[8 * p:8 * p + 8] + p for p in pages.tolist()]))
    # Our triton backend: the page table is a pointer argument, read by scalar loads.
    np.testing.assert_array_equal(call(_gathered_rows, out_shape, pages, x,
                                       grid_spec=_prefetch_spec, backend="triton"), want)
    on_triton = jax.jit(jax.vmap(lambda pg: call(_gathered_rows, out_shape, pg, x, backend="triton",
                                                 grid_spec=_prefetch_spec)))
    np.testing.assert_array_equal(on_triton(tables), per_table)


def _scaled_scatter_rows(dst, scale, x_ref, o_ref, P, T):
    """Adds ``scale[i] * block i`` into output block ``dst[0, i]`` (runs of equal ``dst``
    accumulate): data picks the output block, and the body reads both scalar Refs."""
    i = P.program_id(0)

    @P.when((i == 0) | (dst[0, i] != dst[0, jnp.maximum(i - 1, 0)]))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += x_ref[...] * scale[i].astype(F32)


def _scatter_spec(P, T):
    return T.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(5,),
        in_specs=[P.BlockSpec((8, 16), lambda i, dst, scale: (i, 0))],
        out_specs=P.BlockSpec((8, 16), lambda i, dst, scale: (dst[0, i], 0)))


def test_prefetch_scalar_grid_spec_on_triton_like_jax():
    """Two prefetched arrays (one 2-D) on our triton backend, eagerly and under jit (where
    the data-chosen output blocks make the grid axis a loop), against JAX's interpreter."""
    x = normal(14, (40, 16))
    dst, scale = jnp.array([[0, 0, 2, 2, 1]], jnp.int32), jnp.array([1, 2, 3, 4, 5], jnp.int32)
    out_shape = jax.ShapeDtypeStruct((24, 16), F32)
    want = call(_scaled_scatter_rows, out_shape, dst, scale, x, ours=False, grid_spec=_scatter_spec)
    run = lambda d, s, v: call(_scaled_scatter_rows, out_shape, d, s, v, backend="triton",
                               grid_spec=_scatter_spec)
    np.testing.assert_allclose(run(dst, scale, x), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(run)(dst, scale, x), want, rtol=1e-6)
    (source,) = pl.triton.source(jax.jit(run), dst, scale, x)
    assert "for i0 in range(G0):" in source  # arbitrary: data may revisit any block
    assert "tl.load(p0 + " in source and "tl.load(p1 + " in source  # scalar loads
    (report,) = pl.triton.compile(jax.jit(run), jax.ShapeDtypeStruct(dst.shape, dst.dtype),
                                  jax.ShapeDtypeStruct(scale.shape, scale.dtype), x)
    assert report["spill_bytes"] == 0 and "ld.global" in report["asm"]["ptx"]


def test_prefetch_scalar_grid_spec_errors():
    x = jnp.zeros((32, 16), F32)
    pages = jnp.array([0, 1, 2, 3], jnp.int32)
    bad_arity = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(4,), in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 16), lambda i, p: (i, 0)))
    with pytest.raises((TypeError, ValueError), match="index_map"):  # one arg short
        call(_gathered_rows, x, pages, x, grid_spec=bad_arity)
    with pytest.raises(TypeError, match="integer array"):
        call(_gathered_rows, x, pages.astype(F32), x, grid_spec=_prefetch_spec)
    with pytest.raises(NotImplementedError, match="pallas_triton"):  # as in JAX's lowering
        call(_gathered_rows, x, pages, x, grid_spec=_prefetch_spec, backend="pallas_triton")
    with pytest.raises(TypeError, match="integer array"):
        call(_gathered_rows, x, pages.astype(F32), x, grid_spec=_prefetch_spec, backend="triton")
    with pytest.raises(TypeError, match="num_scalar_prefetch"):
        pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=-1)


# ---- lax.axis_index of a named grid axis ---------------------------------------------------

def _named_ids(x_ref, o_ref, P, T, index):
    """Uses ``index("i", 0)`` / ``index("j", 1)`` at the top level, under pl.when and in a loop."""
    i, j = index("i", 0), index("j", 1)
    v = x_ref[...] + (i * 10 + j).astype(F32)

    @P.when(index("j", 1) == 1)
    def _():
        o_ref[...] = v + index("i", 0).astype(F32) * 100

    @P.when(j != 1)
    def _():
        o_ref[...] = v

    o_ref[0, 0] += jax.lax.fori_loop(0, 3, lambda t, c: c + index("j", 1), 0).astype(F32)


def test_axis_index_of_a_named_grid_axis():
    """lax.axis_index("i") is the program id along the named axis, on interpret and triton (and
    under vmap), equal to JAX's interpreter running the kernel with program_id (JAX's own
    interpreter refuses lax.axis_index: NameError)."""
    x = normal(15, (2, 3, 8, 16))
    kw = dict(grid=(("i", 2), ("j", 3)),
              in_specs=lambda P, T: [P.BlockSpec((None, None, 8, 16), lambda i, j: (i, j, 0, 0))],
              out_specs=lambda P, T: P.BlockSpec((None, None, 8, 16), lambda i, j: (i, j, 0, 0)))
    by_name = functools.partial(_named_ids, index=lambda name, axis: jax.lax.axis_index(name))

    def with_program_ids(x_ref, o_ref, P, T):  # (JAX's interpreter: program_id at the top level)
        ids = (P.program_id(0), P.program_id(1))
        _named_ids(x_ref, o_ref, P, T, index=lambda name, axis: ids[axis])

    want = call(with_program_ids, x, x, ours=False, **kw)
    for backend in ("interpret", "triton"):
        np.testing.assert_array_equal(call(by_name, x, x, backend=backend, **kw), want)
    batched = jax.jit(jax.vmap(lambda v: call(by_name, x, v, backend="triton", **kw)))
    both_ = batched(jnp.stack([x, x + 1]))
    np.testing.assert_array_equal(both_[0], want)
    np.testing.assert_allclose(both_[1], want + 1, rtol=1e-6)
    with pytest.raises(NameError):
        call(functools.partial(_named_ids, index=lambda name, axis: jax.lax.axis_index("k")), x, x,
             **kw)

    def scaled(x_ref, o_ref, P, T):  # the JVP kernel keeps lax.axis_index too
        o_ref[...] = x_ref[...] * (jax.lax.axis_index("j") + 1).astype(F32)

    _, tangent = jax.jvp(lambda v: call(scaled, x, v, **kw), (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(tangent[:, :, 0, 0], [[1, 2, 3], [1, 2, 3]])


# ---- pltpu.roll and the PRNG --------------------------------------------------------------

def _rolls(s_ref, x_ref, o_ref, P, T):
    v = x_ref[...]
    o_ref[0] = T.roll(v, 5, 1)
    o_ref[1] = T.roll(v, s_ref[0], 0)
    o_ref[2] = T.roll(v, 3, 1, stride=2, stride_axis=0)
    o_ref[3] = T.roll(v, s_ref[0], 1, stride=7, stride_axis=0)


@pytest.mark.parametrize("shape", [(8, 128), (6, 100)])
def test_roll_like_jax(shape):
    """On interpret and on triton (tl.gather; the (6, 100) value is a padded (8, 128) tensor)."""
    x = normal(6, shape)
    shift = jnp.array([37], jnp.int32)
    out_shape = jax.ShapeDtypeStruct((4, *shape), F32)
    kw = dict(in_specs=lambda P, T: [P.BlockSpec(memory_space=T.SMEM), P.BlockSpec()])
    ours, want = both(_rolls, out_shape, shift, x, **kw)
    np.testing.assert_array_equal(ours, want)
    np.testing.assert_array_equal(ours[1], jnp.roll(x, 37, 0))
    np.testing.assert_array_equal(call(_rolls, out_shape, shift, x, backend="triton", **kw), want)
    if shape == (8, 128):
        run = lambda s, v: call(_rolls, out_shape, s, v, backend="triton", **kw)
        (report,) = pl.triton.compile(run, shift, x)
        assert report["spill_bytes"] == 0
    with pytest.raises(ValueError, match="stride_axis"):
        pltpu.roll(x, 1, 0, stride=1, stride_axis=0)
    with pytest.raises(NotImplementedError, match="interpret"):
        pltpu.roll(x, 1, 0)  # outside a kernel


def _random_bits_kernel(o_ref, P, T):
    T.prng_seed(11, P.program_id(0))
    first = T.prng_random_bits((8, 128))

    @P.when(P.program_id(0) == 1)
    def _():
        T.prng_seed(11, 0)  # reseeded inside a branch: program 1 repeats program 0's bits

    o_ref[0] = first
    o_ref[1] = T.prng_random_bits((8, 128))


def test_prng_bits_are_seeded_advancing_and_uniform():
    out_shape = jax.ShapeDtypeStruct((2, 2, 8, 128), jnp.int32)
    spec = pl.BlockSpec((None, 2, 8, 128), lambda i: (i, 0, 0, 0))
    bits = np.asarray(call(_random_bits_kernel, out_shape, grid=(2,), out_specs=spec))
    again = np.asarray(call(_random_bits_kernel, out_shape, grid=(2,), out_specs=spec))
    np.testing.assert_array_equal(bits, again)  # deterministic
    assert not np.array_equal(bits[0, 0], bits[1, 0])  # the program id is part of the seed
    assert not np.array_equal(bits[0, 0], bits[0, 1])  # each draw advances
    np.testing.assert_array_equal(bits[1, 1], bits[0, 0])  # reseeding restarts the stream
    ones = np.unpackbits(bits.view(np.uint8)).mean()
    assert abs(ones - 0.5) < 0.01  # 131072 bits: 0.5 +- 0.0014 (1 sigma)
    with pytest.raises(NotImplementedError, match="triton"):
        call(_random_bits_kernel, out_shape, grid=(2,), out_specs=spec, backend="triton")


# ---- manual DMA and semaphores ------------------------------------------------------------

def _double_buffered_sum(x_ref, o_ref, buf, sems, P, T):
    """Sum of 4 row chunks of an HBM (ANY) operand, the next chunk copied while one is used."""
    def copy(c):
        return T.make_async_copy(x_ref.at[P.ds(c * 8, 8)], buf.at[c % 2], sems.at[c % 2])

    copy(0).start()
    acc = jnp.zeros((8, 128), F32)
    for c in range(4):
        if c + 1 < 4:
            copy(c + 1).start()
        copy(c).wait()
        acc = acc + buf[c % 2] * (c + 1)
    o_ref[...] = acc


def test_make_async_copy_double_buffering_like_jax():
    x = jax.random.normal(jax.random.key(7), (32, 128), F32)
    kw = dict(in_specs=lambda P, T: [P.BlockSpec(memory_space=P.ANY)],
              scratch_shapes=lambda P, T: [T.VMEM((2, 8, 128), F32), T.SemaphoreType.DMA((2,))])
    ours, want = both(_double_buffered_sum, jax.ShapeDtypeStruct((8, 128), F32), x, **kw)
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    expect = sum((c + 1) * x[8 * c:8 * c + 8] for c in range(4))
    np.testing.assert_allclose(ours, expect, rtol=1e-6, atol=1e-6)


def test_sync_copy_and_semaphores():
    x = jax.random.normal(jax.random.key(8), (8, 128), F32)

    def kernel(x_ref, o_ref, count_ref, buf, sem, P, T):
        T.sync_copy(x_ref, buf)
        P.semaphore_signal(sem, 3)
        P.semaphore_wait(sem, 2)
        count_ref[0] = P.semaphore_read(sem)
        P.semaphore_wait(sem, 1)
        o_ref[...] = buf[...]

    out_shape = (jax.ShapeDtypeStruct((8, 128), F32), jax.ShapeDtypeStruct((1,), jnp.int32))
    kw = dict(in_specs=lambda P, T: [P.BlockSpec(memory_space=P.ANY)],
              out_specs=lambda P, T: (P.BlockSpec(), P.BlockSpec(memory_space=T.SMEM)),
              scratch_shapes=lambda P, T: [T.VMEM((8, 128), F32), T.SemaphoreType.REGULAR(())])
    (out, count), (want, want_count) = both(kernel, out_shape, x, **kw)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out, x)
    assert int(count[0]) == int(want_count[0]) == 1


def test_bare_semaphore_type_is_one_semaphore_like_jax():
    """``scratch_shapes=[T.SemaphoreType.DMA]`` and ``run_scoped(body, T.SemaphoreType.DMA)``."""
    x = jax.random.normal(jax.random.key(11), (8, 128), F32)

    def kernel(x_ref, o_ref, sem, P, T):
        copy = T.make_async_copy(x_ref, o_ref, sem)
        copy.start()
        copy.wait()

        def scoped(inner):
            again = T.make_async_copy(x_ref, o_ref, inner)
            again.start(add=False)
            again.wait()
        P.run_scoped(scoped, T.SemaphoreType.DMA)

    ours, want = both(kernel, x, x, in_specs=lambda P, T: [P.BlockSpec(memory_space=P.ANY)],
                      out_specs=lambda P, T: P.BlockSpec(memory_space=P.ANY),
                      scratch_shapes=lambda P, T: [T.SemaphoreType.DMA])
    np.testing.assert_array_equal(ours, want)
    np.testing.assert_array_equal(ours, x)


def test_sync_copy_add():  # JAX's interpreter cannot discharge add=True: checked against x + x
    x = jax.random.normal(jax.random.key(9), (8, 128), F32)

    def kernel(x_ref, o_ref, P, T):
        T.sync_copy(x_ref, o_ref)
        T.sync_copy(x_ref, o_ref, add=True)

    out = call(kernel, x, x, in_specs=[pl.BlockSpec(memory_space=pl.ANY)])
    np.testing.assert_array_equal(out, x + x)


def test_dma_errors():
    x = jnp.zeros((16, 128), F32)

    def mismatched(x_ref, o_ref, buf, sems, P, T):
        T.make_async_copy(x_ref, buf, sems.at[0]).start()

    kw = dict(in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
              scratch_shapes=[pltpu.VMEM((8, 128), F32), pltpu.SemaphoreType.DMA((1,))])
    with pytest.raises(ValueError, match="same shape"):
        call(mismatched, jax.ShapeDtypeStruct((8, 128), F32), x, **kw)
    with pytest.raises(NotImplementedError, match="triton"):
        call(_double_buffered_sum, jax.ShapeDtypeStruct((8, 128), F32), x, backend="triton",
             in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
             scratch_shapes=[pltpu.VMEM((2, 8, 128), F32), pltpu.SemaphoreType.DMA((2,))])


# ---- forwarded to JAX's Mosaic TPU lowering -----------------------------------------------

def test_tpu_names_lower_for_tpu():
    """DMA, semaphores, roll, the PRNG, Buffered, CostEstimate, Element blocks and scalar
    prefetch reach
    jax.experimental.pallas.tpu on mosaic_tpu (lowered for a TPU from this host)."""
    def dma_roll_prng(x):
        def kernel(x_ref, o_ref, buf, sems):
            pltpu.prng_seed(3, pl.program_id(0))
            copy = pltpu.make_async_copy(x_ref.at[pl.ds(0, 8)], buf, sems.at[0])
            copy.start()
            copy.wait()
            bits = pltpu.prng_random_bits((8, 128)).astype(F32)
            o_ref[...] = pltpu.roll(buf[...], 1, 1) + bits
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((16, 128), F32), grid=(2,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0), pipeline_mode=pl.Buffered(1)),
            scratch_shapes=[pltpu.VMEM((8, 128), F32), pltpu.SemaphoreType.DMA((1,))],
            backend="mosaic_tpu",
            cost_estimate=pl.CostEstimate(flops=10, transcendentals=0, bytes_accessed=40961))(x)

    text = lower_for_tpu(dma_roll_prng, jax.ShapeDtypeStruct((16, 128), F32))
    assert "tpu_custom_call" in text and "40961" in text  # the cost estimate rides along

    def element_windows(x):
        return pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1.0),
            out_shape=jax.ShapeDtypeStruct((4, 8, 128), F32), grid=(4,),
            in_specs=[pl.BlockSpec((pl.Element(8, (0, 8)), pl.Element(128)),
                                   lambda i: (i * 4, 0))],
            out_specs=pl.BlockSpec((pl.squeezed, 8, 128), lambda i: (i, 0, 0)),
            backend="mosaic_tpu")(x)

    assert "tpu_custom_call" in lower_for_tpu(element_windows, jax.ShapeDtypeStruct((24, 128), F32))

    def paged(pages, x):  # index maps read the page table: JAX's PrefetchScalarGridSpec
        return call(_gathered_rows, jax.ShapeDtypeStruct((32, 16), F32), pages, x,
                    grid_spec=_prefetch_spec, backend="mosaic_tpu")

    assert "tpu_custom_call" in lower_for_tpu(paged, jax.ShapeDtypeStruct((4,), jnp.int32),
                                              jax.ShapeDtypeStruct((40, 16), F32))


# ---- pltriton.elementwise_inline_asm ------------------------------------------------------

def _rotate_left_7(x_ref, o_ref):
    x = x_ref[...]
    (y,) = pl.triton.elementwise_inline_asm(
        "shf.l.wrap.b32 $0, $1, $1, 7;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.uint32)])
    o_ref[...] = y


def _sum_and_difference(a_ref, b_ref, s_ref, d_ref):
    s, d = pl.triton.elementwise_inline_asm(
        "add.f32 $0, $2, $3; sub.f32 $1, $2, $3;", args=[a_ref[...], b_ref[...]],
        constraints="=f,=f,f,f", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct((8, 16), F32)] * 2)
    s_ref[...], d_ref[...] = s, d


def test_elementwise_inline_asm_reaches_ptx_for_sm90():
    """Our triton backend emits tl.inline_asm_elementwise (one and two results); ptxas
    for sm_90 accepts it. Assembly cannot run on this host: the interpreters refuse it."""
    x = jax.ShapeDtypeStruct((8, 16), jnp.uint32)
    rotate = lambda x: pl.pallas_call(_rotate_left_7, out_shape=x, backend="triton")(x)
    (source,) = pl.triton.source(rotate, x)
    assert "tl.inline_asm_elementwise('shf.l.wrap.b32 $0, $1, $1, 7;', '=r,r'" in source
    assert "shf.l.wrap.b32" in pl.triton.compile(rotate, x)[0]["asm"]["ptx"]
    a = jax.ShapeDtypeStruct((8, 16), F32)
    both_ = lambda a, b: pl.pallas_call(_sum_and_difference, out_shape=(a, a), backend="triton")(a, b)
    ptx = pl.triton.compile(both_, a, a)[0]["asm"]["ptx"]
    assert "add.f32" in ptx and "sub.f32" in ptx
    lowered = jax.jit(lambda x: pl.pallas_call(_rotate_left_7, out_shape=x, backend="pallas_triton")(x))
    assert "triton" in lowered.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    data = jnp.arange(128, dtype=jnp.uint32).reshape(8, 16)
    with pytest.raises(NotImplementedError, match="CPU interpreter"):
        rotate(data)
    with pytest.raises(NotImplementedError, match="'interpret' backend"):
        pl.pallas_call(_rotate_left_7, out_shape=data, interpret=True)(data)
    with pytest.raises(ValueError, match="broadcast shape"):
        pl.triton.elementwise_inline_asm("mov.b32 $0, $1;", args=[data], constraints="=r,r",
                                         pack=1, result_shape_dtypes=[x, a.update(shape=(4,))])
