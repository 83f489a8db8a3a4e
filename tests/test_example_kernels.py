"""The programming model's example kernels (add, templated matmul, masked load/store, a
pipelined TPU-style reduction, scratch with Ref.at and pl.loop), run on the interpreter
against plain JAX."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl


def add_kernel(x_ref, y_ref, o_ref):
    x = x_ref[:]
    y = y_ref[:]
    o_ref[:] = x + y


def test_add_whole_arrays():
    x, y = jnp.arange(8), jnp.arange(8, 16)
    out = pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32),
                         interpret=True)(x, y)
    np.testing.assert_array_equal(out, x + y)


def test_add_with_blockspecs_scalar_index_map():
    x, y = jnp.arange(8), jnp.arange(8, 16)
    add = pl.pallas_call(
        add_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32),
        in_specs=[pl.BlockSpec((2,), lambda i: i), pl.BlockSpec((2,), lambda i: i)],
        out_specs=pl.BlockSpec((2,), lambda i: i), grid=(4,), interpret=True)
    np.testing.assert_array_equal(add(x, y), x + y)


def matmul_kernel(x_ref, y_ref, o_ref, *, activation, block_k):
    acc = jnp.zeros((x_ref.shape[0], y_ref.shape[1]), jnp.float32)
    for k in range(x_ref.shape[1] // block_k):
        x = x_ref[:, k * block_k:(k + 1) * block_k]
        y = y_ref[k * block_k:(k + 1) * block_k, :]
        acc += x @ y
    o_ref[:, :] = activation(acc).astype(o_ref.dtype)


@partial(jax.jit, static_argnames=["block_shape", "activation"])
def templated_matmul(x, y, *, block_shape, activation):
    block_m, block_n, block_k = block_shape
    fused = pl.pallas_call(
        partial(matmul_kernel, block_k=block_k, activation=activation),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), jnp.float32),
        in_specs=[pl.BlockSpec((block_m, x.shape[1]), lambda i, j: (i, 0)),
                  pl.BlockSpec((y.shape[0], block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        grid=(4, 4), interpret=True)
    return fused(x, y)


def test_templated_matmul_ones():
    x, y = jnp.ones((512, 256)), jnp.ones((256, 1024))
    z = templated_matmul(x, y, block_shape=(128, 256, 128), activation=jax.nn.gelu)
    np.testing.assert_allclose(z, jax.nn.gelu(jnp.full((512, 1024), 256.0)), rtol=1e-6)


def test_templated_matmul_random():
    kx, ky = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(kx, (512, 256)), jax.random.normal(ky, (256, 1024))
    z = templated_matmul(x, y, block_shape=(128, 256, 128), activation=jax.nn.gelu)
    ref = jax.nn.gelu(jnp.dot(x, y, precision="highest"))
    np.testing.assert_allclose(z, ref, rtol=1e-4, atol=1e-4)


def test_load_store_with_mask_and_ds():
    def kernel(x_ref, o_ref):
        idx = jnp.arange(8)
        x = pl.load(x_ref, (idx,), mask=idx < 5, other=float("-inf"))
        pl.store(o_ref, (pl.ds(0, 8),), x)
        pl.store(o_ref, (pl.ds(8, 8),), x * 2, mask=idx % 2 == 0)

    x = jax.random.normal(jax.random.key(3), (16,))
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                         input_output_aliases={0: 0}, interpret=True)(x)
    expected_head = jnp.where(jnp.arange(8) < 5, x[:8], -jnp.inf)
    expected_tail = jnp.where(jnp.arange(8) % 2 == 0, expected_head * 2, x[8:])
    np.testing.assert_array_equal(out, jnp.concatenate([expected_head, expected_tail]))


def test_make_kernel_higher_order():
    def make_kernel(eltwise_kernel):
        def add(x_ref, y_ref, o_ref):
            x = pl.load(x_ref, ())
            y = pl.load(y_ref, ())
            pl.store(o_ref, (), eltwise_kernel(x + y))
        return add

    x = jnp.float32(1.0)
    out1 = pl.pallas_call(make_kernel(lambda v: v * 2), out_shape=x, grid=1, interpret=True)(x, x)
    out2 = pl.pallas_call(make_kernel(jnp.exp), out_shape=x, grid=1, interpret=True)(x, x)
    assert float(out1) == 4.0
    np.testing.assert_allclose(out2, np.exp(2.0), rtol=1e-6)


def add_matrices_kernel(x_vmem_ref, y_vmem_ref, z_vmem_ref):
    z_vmem_ref[:, :] = x_vmem_ref[:, :] + y_vmem_ref[:, :]


def test_pipelined_legacy_blockspec_order_and_megacore_dict():
    kx, ky = jax.random.split(jax.random.key(4))
    x, y = jax.random.normal(kx, (512, 512)), jax.random.normal(ky, (512, 512))
    block_spec = pl.BlockSpec(lambda i: (i, 0), (256, 512))
    out = pl.pallas_call(add_matrices_kernel, out_shape=x, in_specs=[block_spec, block_spec],
                         out_specs=block_spec, grid=(2,), interpret=True,
                         compiler_params=dict(mosaic=dict(dimension_semantics=("parallel",))))(x, y)
    np.testing.assert_array_equal(out, x + y)
    for bm, bn in ((256, 256), (128, 128), (512, 512)):
        spec = pl.BlockSpec(lambda i, j: (i, j), (bm, bn))
        out = pl.pallas_call(add_matrices_kernel, out_shape=x, in_specs=[spec, spec],
                             out_specs=spec, grid=(512 // bm, 512 // bn), interpret=True)(x, y)
        np.testing.assert_array_equal(out, x + y)


def _sum(kernel, x):
    grid, *out_shape = x.shape
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[pl.BlockSpec(lambda i: (i, 0, 0), (None, *out_shape))],
        out_specs=pl.BlockSpec(lambda i: (0, 0), out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype), interpret=True)(x)


def test_sum_needs_initialisation():
    def naive_sum_kernel(x_ref, o_ref):
        o_ref[...] += x_ref[...]

    def sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(axis=0) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        o_ref[...] += x_ref[...]

    x = jax.random.normal(jax.random.key(5), (8, 64, 128))
    # The output starts as garbage (NaN in the interpreter), so the naive kernel is wrong.
    assert np.isnan(np.asarray(_sum(naive_sum_kernel, x))).all()
    np.testing.assert_allclose(_sum(sum_kernel, x), x.sum(0), rtol=1e-5, atol=1e-5)


def test_ref_at_scratch_gridspec_when_loop():
    def double_rows(ref_view, out_view):  # a helper that only sees sub-Refs
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
            def scoped(tmp_ref):
                tmp_ref[...] = -o_ref[...]
                o_ref[...] = tmp_ref[...]
            pl.run_scoped(scoped, pl.tpu.VMEM((8, 128), jnp.float32))

    x = jax.random.normal(jax.random.key(6), (16, 128))
    spec = pl.GridSpec(grid=2, in_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       scratch_shapes=[pl.tpu.VMEM((1, 128), jnp.float32)])
    out = pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         interpret=True)(x)
    blocks = x.reshape(2, 8, 128)
    expected = jnp.concatenate([blocks[:, :2] * 2, jnp.cumsum(blocks[:, 2:], axis=1)], axis=1)
    expected = expected.at[1].multiply(-1).reshape(16, 128)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# ---- the example kernels whose blocks suit a TPU, lowered for it from this host ----

def _lower_tpu(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_kernels_lower_for_tpu():
    spec = pl.BlockSpec(lambda i, j: (i, j), (256, 256))
    add = lambda x, y: pl.pallas_call(add_matrices_kernel, out_shape=x, in_specs=[spec, spec],
                                      out_specs=spec, grid=(2, 2), backend="mosaic_tpu",
                                      compiler_params=dict(mosaic=dict(
                                          dimension_semantics=("parallel", "parallel"))))(x, y)
    assert "tpu_custom_call" in _lower_tpu(add, (512, 512), (512, 512))

    def sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(axis=0) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    total = lambda x: pl.pallas_call(
        sum_kernel, grid=8, in_specs=[pl.BlockSpec(lambda i: (i, 0, 0), (None, 512, 512))],
        out_specs=pl.BlockSpec(lambda i: (0, 0), (512, 512)),
        out_shape=jax.ShapeDtypeStruct((512, 512), x.dtype), backend="mosaic_tpu")(x)
    assert "tpu_custom_call" in _lower_tpu(total, (8, 512, 512))


def test_scratch_and_run_scoped_lower_for_tpu():
    def kernel(x_ref, o_ref, acc_ref):
        acc_ref[...] = x_ref[...] * 2

        def scoped(tmp_ref):
            tmp_ref[...] = acc_ref[...] + 1
            o_ref[...] = tmp_ref[...]
        pl.run_scoped(scoped, pl.tpu.VMEM((8, 128), jnp.float32))

    spec = pl.GridSpec(grid=2, in_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)])
    f = lambda x: pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 backend="mosaic_tpu")(x)
    assert "tpu_custom_call" in _lower_tpu(f, (16, 128))
    x = jax.random.normal(jax.random.key(7), (16, 128))
    interp = pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                            interpret=True)(x)
    np.testing.assert_allclose(interp, x * 2 + 1, rtol=1e-6)
