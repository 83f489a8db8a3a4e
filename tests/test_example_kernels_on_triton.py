"""The example kernels of tests/test_example_kernels.py on our triton backend, wherever
Triton can express them.

Each runs in Triton's CPU interpreter and is compared with the interpret
backend. Not here: run_scoped (the triton backend raises a clear error for
it); Unblocked / Element indexing on triton is tested in
tests/test_pallas_compat_api.py.
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from tests.test_example_kernels import add_kernel, add_matrices_kernel, matmul_kernel

pytest.importorskip("triton")
pytest.importorskip("torch")


def on_both(fn):
    got, want = fn("triton"), fn("interpret")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)


def test_add_whole_and_blocked():
    x, y = jnp.arange(8), jnp.arange(8, 16)
    out = jax.ShapeDtypeStruct((8,), jnp.int32)
    on_both(lambda b: pl.pallas_call(add_kernel, out_shape=out, backend=b)(x, y))
    on_both(lambda b: pl.pallas_call(
        add_kernel, out_shape=out, in_specs=[pl.BlockSpec((2,), lambda i: i)] * 2,
        out_specs=pl.BlockSpec((2,), lambda i: i), grid=(4,), backend=b)(x, y))


def test_templated_matmul_with_activation():
    kx, ky = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(kx, (128, 64)), jax.random.normal(ky, (64, 128))
    on_both(lambda b: pl.pallas_call(
        partial(matmul_kernel, block_k=32, activation=jax.nn.gelu),
        out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32),
        in_specs=[pl.BlockSpec((64, 64), lambda i, j: (i, 0)), pl.BlockSpec((64, 64), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((64, 64), lambda i, j: (i, j)), grid=(2, 2), backend=b)(x, y))


def test_make_kernel_scalars():
    def make_kernel(eltwise_kernel):
        def add(x_ref, y_ref, o_ref):
            pl.store(o_ref, (), eltwise_kernel(pl.load(x_ref, ()) + pl.load(y_ref, ())))
        return add

    x = jnp.float32(1.0)
    on_both(lambda b: pl.pallas_call(make_kernel(jnp.exp), out_shape=x, grid=1, backend=b)(x, x))


def test_pipelined_and_megacore_dict():
    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (128, 256)), jax.random.normal(ky, (128, 256))
    spec = pl.BlockSpec(lambda i, j: (i, j), (64, 128))
    on_both(lambda b: pl.pallas_call(
        add_matrices_kernel, out_shape=x, in_specs=[spec, spec], out_specs=spec, grid=(2, 2),
        compiler_params=dict(mosaic=dict(dimension_semantics=("parallel", "parallel"))), backend=b)(x, y))


def test_sum_with_when_over_an_arbitrary_axis():
    def sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(axis=0) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    x = jax.random.normal(jax.random.key(2), (8, 64, 128))
    on_both(lambda b: pl.pallas_call(
        sum_kernel, grid=8, in_specs=[pl.BlockSpec(lambda i: (i, 0, 0), (None, 64, 128))],
        out_specs=pl.BlockSpec(lambda i: (0, 0), (64, 128)),
        out_shape=jax.ShapeDtypeStruct((64, 128), x.dtype), backend=b)(x))


def test_ref_at_gridspec_scratch_when_loop():
    def double_rows(ref_view, out_view):
        out_view[...] = ref_view[...] * 2

    def kernel(x_ref, o_ref, acc_ref):
        double_rows(x_ref.at[0:2], o_ref.at[0:2])
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

        @pl.loop(2, 8)
        def _(r):
            acc_ref[...] += x_ref[pl.ds(r, 1), :]
            o_ref[pl.ds(r, 1), :] = acc_ref[...]

        @pl.when(pl.program_id(0) == 1)
        def _():
            o_ref[...] = -o_ref[...]

    x = jax.random.normal(jax.random.key(3), (16, 128))
    spec = pl.GridSpec(grid=2, in_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       scratch_shapes=[pl.tpu.VMEM((1, 128), jnp.float32)])
    on_both(lambda b: pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                     backend=b)(x))


def test_run_scoped_is_refused_clearly():
    def kernel(x_ref, o_ref):
        pl.run_scoped(lambda t: None, pl.tpu.VMEM((8, 128), jnp.float32))

    with pytest.raises(NotImplementedError, match=r"run_scoped.*triton"):
        pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       backend="triton")(jnp.zeros((8, 128)))
