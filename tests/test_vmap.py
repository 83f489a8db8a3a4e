"""vmap of pallas_call: batch axes anywhere, unbatched operands, out_axes, nesting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl


def scale_add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + y_ref[...] + pl.program_id(0)


def scale_add(x, y, backend="interpret"):
    return pl.pallas_call(scale_add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)(x, y)


def expected(x, y):
    return x * 2 + y + jnp.repeat(jnp.arange(2.0), 8)[:, None]


KEYS = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(KEYS[0], (3, 16, 128))
Y = jax.random.normal(KEYS[1], (16, 128))


def test_in_axes_none_for_an_unbatched_operand():
    out = jax.vmap(scale_add, in_axes=(0, None))(X, Y)
    np.testing.assert_allclose(out, jax.vmap(expected, in_axes=(0, None))(X, Y), rtol=1e-6)


def test_batch_axis_other_than_zero_and_out_axes():
    xt = jnp.moveaxis(X, 0, 2)  # [16, 128, 3]
    out = jax.vmap(scale_add, in_axes=(2, None), out_axes=1)(xt, Y)
    np.testing.assert_allclose(out, jnp.moveaxis(jax.vmap(expected, in_axes=(0, None))(X, Y), 0, 1),
                               rtol=1e-6)


def test_nested_vmap_under_jit():
    xx = jax.random.normal(KEYS[2], (2, 3, 16, 128))
    f = jax.jit(jax.vmap(jax.vmap(scale_add, in_axes=(0, None)), in_axes=(0, None)))
    np.testing.assert_allclose(f(xx, Y), expected(xx, Y), rtol=1e-6)


def test_vmap_of_reduction_with_when():
    def sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    def total(x):
        return pl.pallas_call(sum_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype), grid=4,
                              in_specs=[pl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))],
                              out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)), interpret=True)(x)

    xs = jax.random.normal(KEYS[0], (5, 4, 8, 128))
    np.testing.assert_allclose(jax.vmap(total)(xs), xs.sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("pallas_triton", "cuda")])
def test_vmap_lowers(backend, platform):
    f = jax.jit(jax.vmap(lambda x, y: scale_add(x, y, backend), in_axes=(0, None)))
    args = (jax.ShapeDtypeStruct(X.shape, X.dtype), jax.ShapeDtypeStruct(Y.shape, Y.dtype))
    text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "custom_call" in text


# ---- our triton backend batches by adding a grid axis (one launch, on a GPU too) ----

def test_triton_vmap_variants_match_the_interpreter():
    pytest.importorskip("triton")
    ours = lambda x, y: scale_add(x, y, "triton")
    ref = lambda x, y: scale_add(x, y, "interpret")
    xt = jnp.moveaxis(X, 0, 2)
    for f_in_axes, args, out_axes in [((0, None), (X, Y), 0), ((2, None), (xt, Y), 1), ((None, 0), (Y, X), 0)]:
        got = jax.jit(jax.vmap(ours, in_axes=f_in_axes, out_axes=out_axes))(*args)
        want = jax.vmap(ref, in_axes=f_in_axes, out_axes=out_axes)(*args)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    xx = jax.random.normal(KEYS[2], (2, 3, 16, 128))
    nested = jax.vmap(jax.vmap(ours, in_axes=(0, None)), in_axes=(0, None))
    np.testing.assert_allclose(jax.jit(nested)(xx, Y), expected(xx, Y), rtol=1e-6)


def test_triton_vmap_is_one_launch_with_a_batch_grid_axis():
    pytest.importorskip("triton")
    sources = pl.triton.source(jax.vmap(lambda x, y: scale_add(x, y, "triton"), in_axes=(0, None)), X, Y)
    batched = sources[-1]
    assert "G1: tl.constexpr" in batched  # (batch, original) grid
    assert "i1 = pid % G1" in batched and "i0 = pid" in batched


@pytest.mark.parametrize("backend", ["interpret", "triton"])
def test_fori_loop_in_a_kernel_under_vmap_with_jax_checks(backend):
    """vmap adds a batch grid axis on our backends, so JAX never batches the kernel's own
    control flow (batching a discharged fori_loop body trips JAX's checker)."""
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, 2, lambda i, acc: acc + x_ref[...], jnp.zeros(x_ref.shape))

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), backend=backend)
    with jax.enable_checks(True):
        out = jax.vmap(call)(X)
    np.testing.assert_allclose(out, 2 * X, rtol=1e-6)
