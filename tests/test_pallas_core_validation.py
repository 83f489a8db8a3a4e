"""Bad specs are refused before lowering, with errors naming the spec and the rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def call(x, *, in_spec, out_spec=None, grid=(1,), backend=None, interpret=None, **kw):
    out_spec = in_spec if out_spec is None else out_spec
    fn = pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                        in_specs=[in_spec], out_specs=out_spec, backend=backend,
                        interpret=bool(interpret), **kw)
    return fn(x)


X = jax.random.normal(jax.random.key(0), (16, 256))


def test_block_rank_vs_array_rank():
    with pytest.raises(ValueError, match=r"in_specs\[0\].*rank 3.*rank 2"):
        call(X, in_spec=pl.BlockSpec((8, 128, 1), lambda i: (i, 0, 0)))


def test_index_map_arity_vs_grid_rank():
    with pytest.raises(TypeError, match=r"in_specs\[0\].*grid has rank 2.*takes 1 positional argument "
                                        r"but 2 were given"):
        call(X, in_spec=pl.BlockSpec((8, 128), lambda i: (i, 0)), grid=(2, 2))


def test_index_map_return_count():
    with pytest.raises(ValueError, match=r"in_specs\[0\].*must return 2 values.*Currently returning 3"):
        call(X, in_spec=pl.BlockSpec((8, 128), lambda i: (i, 0, 0)), grid=(2,))


def test_index_map_non_integer():
    with pytest.raises(ValueError, match=r"in_specs\[0\].*must return integer scalars.*float32"):
        call(X, in_spec=pl.BlockSpec((8, 128), lambda i: (i * 0.5, 0)), grid=(2,))


def test_block_with_no_in_bounds_element():
    with pytest.raises(ValueError, match=r"in_specs\[0\].*grid point \(2,\).*at least one in-bounds"):
        call(X, in_spec=pl.BlockSpec((8, 128), lambda i: (i, 0)), grid=(3,))


def test_non_positive_block_dim():
    with pytest.raises(ValueError, match=r"in_specs\[0\].*dim <= 0"):
        call(X, in_spec=pl.BlockSpec((0, 128), lambda i: (i, 0)))


@pytest.mark.parametrize("block", [(4, 256), (16, 100)])
def test_tpu_tiling_rule(block):
    with pytest.raises(ValueError, match=r"in_specs\[0\].*TPU tiling rule.*8 and 128"):
        call(X, in_spec=pl.BlockSpec(block, lambda i: (0, 0)), backend="mosaic_tpu")


def test_tpu_tiling_rank1_bitwidth():
    x = jnp.zeros((2048,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"rank-1 block must equal the array dim or be divisible by 256"):
        call(x, in_spec=pl.BlockSpec((128,), lambda i: (i,)), grid=(16,), backend="mosaic_tpu")


def test_gpu_power_of_two_blocks():
    with pytest.raises(ValueError, match=r"in_specs\[0\].*dim 1 = 96.*not a power of two"):
        call(X, in_spec=pl.BlockSpec((8, 96), lambda i: (0, i)), grid=(2,), backend="pallas_triton")


@pytest.mark.parametrize("platform, backend, implementation",
                         [("cpu", "interpret", "xla"), ("gpu", "triton", "triton"),
                          ("tpu", "mosaic_tpu", "mosaic_tpu")])
def test_platform_defaults(monkeypatch, platform, backend, implementation):
    """GPUs default to our own Triton lowering for raw pallas_calls; platform_default (the
    None of run_implementation, which the layers use) follows it, with XLA for the
    interpreter. The ops' own default on a GPU is measured (tests/test_default_implementation.py)."""
    from ops._implementation import platform_default
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    assert pl.default_backend() == backend
    assert platform_default() == implementation


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend: unknown backend 'cuda_magic'"):
        call(X, in_spec=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend="cuda_magic")


def test_parallel_axis_with_a_kept_output_block_warns_and_runs_as_jax():
    """An output block that stays put along a 'parallel' axis is accepted, as JAX accepts it,
    with a warning naming the spec and the axis; the last program's write wins."""
    from jax.experimental import pallas as jpl

    def last_block(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    kw = dict(out_shape=jax.ShapeDtypeStruct((8, 128), X.dtype), grid=(2,))
    with pytest.warns(UserWarning, match=r"out_specs\[0\].*grid axis 0.*'parallel'"):
        got = pl.pallas_call(last_block, **kw, in_specs=[pl.BlockSpec((8, 128), lambda i: (0, i))],
                             out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                             compiler_params=pl.CompilerParams(("parallel",)), interpret=True)(X)
    want = jpl.pallas_call(last_block, **kw, in_specs=[jpl.BlockSpec((8, 128), lambda i: (0, i))],
                           out_specs=jpl.BlockSpec((8, 128), lambda i: (0, 0)), interpret=True)(X)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, X[:8, 128:] * 2.0)


def test_output_revisited_after_being_left():
    with pytest.raises(ValueError, match=r"out_specs\[0\].*revisited.*minor-most"):
        pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct((8, 256), X.dtype), grid=(2, 2),
                       in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
                       out_specs=pl.BlockSpec((8, 128), lambda i, j: (0, j)), interpret=True)(X)


def test_dimension_semantics_length_and_values():
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    with pytest.raises(ValueError, match=r"dimension_semantics.*1 entries.*rank 2|has 1 entries"):
        call(X, in_spec=pl.BlockSpec((8, 128), lambda i, j: (i, j)), grid=(2, 2),
             compiler_params=pl.CompilerParams(("parallel",)))
    with pytest.raises(ValueError, match=r"'sideways' is not one of"):
        call(X, in_spec=spec, compiler_params=pl.CompilerParams(("sideways",)))


def test_alias_shape_mismatch():
    with pytest.raises(ValueError, match=r"input_output_aliases.*same shape and dtype"):
        pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32),
                       input_output_aliases={0: 0}, interpret=True)(X)


def test_out_shape_not_array_like():
    with pytest.raises(TypeError, match=r"out_shape.*ShapeDtypeStruct"):
        pl.pallas_call(copy_kernel, out_shape=[(16, 256)], interpret=True)


def test_kernel_arity():
    with pytest.raises(TypeError, match=r"copy_kernel.*takes 2 positional arguments but 3 were given"):
        pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                       scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)], interpret=True)(X)


def test_scratch_on_backend_without_it():
    with pytest.raises(ValueError, match=r"scratch_shapes.*pallas_triton.*no scratch"):
        pl.pallas_call(lambda x, o, s: None, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                       scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)],
                       backend="pallas_triton")(X)


def test_raw_pallas_call_is_not_differentiable():
    f = pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype), interpret=True)
    with pytest.raises(TypeError, match=r"not differentiable.*jax.custom_vjp"):
        jax.grad(lambda x: f(x).sum())(X)


def test_program_id_outside_a_kernel():
    with pytest.raises(RuntimeError, match=r"only be used inside a kernel"):
        pl.program_id(0)


def test_semantics_are_inferred_from_revisits():
    """A kernel that revisits along the last axis runs sequentially and accumulates."""
    def acc_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    x = jax.random.normal(jax.random.key(1), (16, 512))
    out = pl.pallas_call(acc_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), x.dtype), grid=(2, 4),
                         in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
                         out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)), interpret=True)(x)
    np.testing.assert_allclose(out, x.reshape(16, 4, 128).sum(1), rtol=1e-5, atol=1e-5)


def test_unblocked_only_on_interpret_and_mosaic_tpu():
    spec = pl.BlockSpec((8, 128), lambda i: (8 * i, 0), indexing_mode=pl.Unblocked(((1, 1), (0, 0))))
    with pytest.raises(ValueError, match=r"in_specs\[0\].*Unblocked.*interpret and mosaic_tpu"):
        call(X, in_spec=spec, out_spec=pl.BlockSpec((8, 128), lambda i: (i, 0)), grid=(2,),
             backend="pallas_triton")
