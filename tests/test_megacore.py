"""Megacore semantics: dimension_semantics forms, and the interpreter's core simulation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

X = jax.random.normal(jax.random.key(0), (4 * 8, 128))


def running_sum_kernel(x_ref, o_ref, acc_ref):
    """Wrong on purpose: carries scratch across the parallel axis 0."""
    @pl.when(pl.program_id(0) == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]


def running_sum(interpret):
    return pl.pallas_call(running_sum_kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype), grid=(4,),
                          in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                          scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)], interpret=interpret)(X)


def test_scratch_carried_across_parallel_axis_fails_under_megacore_simulation():
    expected = jnp.cumsum(X.reshape(4, 8, 128), axis=0).reshape(X.shape)
    # Sequential single-core execution happens to give the running sum...
    np.testing.assert_allclose(running_sum(pl.InterpretParams(num_cores=1)), expected, rtol=1e-5)
    # ...but the second simulated core starts with garbage scratch, as on hardware.
    out = np.asarray(running_sum(True))
    assert np.isfinite(out[:16]).all() and np.isnan(out[16:]).all()


def test_shuffle_exposes_order_dependence():
    out = np.asarray(running_sum(pl.InterpretParams(num_cores=1, shuffle_seed=3)))
    expected = np.asarray(jnp.cumsum(X.reshape(4, 8, 128), axis=0).reshape(X.shape))
    assert not np.allclose(out, expected, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correct_kernels_are_order_independent(seed):
    """A reduction over the arbitrary axis is unaffected by cores and shuffling."""
    def sum_kernel(x_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
        acc_ref[...] += x_ref[...]

        @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
        def _():
            o_ref[...] = acc_ref[...]

    x = jax.random.normal(jax.random.key(seed), (32, 512))
    out = pl.pallas_call(sum_kernel, out_shape=jax.ShapeDtypeStruct((32, 128), x.dtype), grid=(4, 4),
                         in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
                         out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
                         scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)],
                         compiler_params=pl.tpu.CompilerParams(("parallel", "arbitrary")),
                         interpret=pl.InterpretParams(num_cores=2, shuffle_seed=seed))(x)
    np.testing.assert_allclose(out, x.reshape(32, 4, 128).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [
    pl.CompilerParams(("parallel", "arbitrary")),
    pl.tpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    dict(mosaic=dict(dimension_semantics=("parallel", "arbitrary"))),
])
def test_semantics_forms_reach_mosaic(params):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), x.dtype), grid=(2, 1),
                              in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
                              out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
                              compiler_params=params, backend="mosaic_tpu")(x)

    text = jax.jit(f).trace(jax.ShapeDtypeStruct((16, 128), jnp.float32)).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
