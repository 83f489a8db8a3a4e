"""Kernels meant for TPU / GPU lower for those platforms from this CPU host (docs/design.md §7.5)."""
import jax
import jax.numpy as jnp
import pytest

import ops
import pallas_core as pl

PLATFORM = {"mosaic_tpu": ("tpu", "tpu_custom_call"),
            "pallas_triton": ("cuda", "__gpu$xla.gpu.triton"),
            "mosaic_gpu": ("cuda", "mosaic_gpu")}


def lower_text(fn, impl, *shapes_dtypes):
    platform, _ = PLATFORM[impl]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("impl", ["mosaic_tpu", "pallas_triton"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(256, 384, 640), (200, 1000, 700)])
@pytest.mark.parametrize("act", [None, "gelu_exact"])
def test_fused_matmul_forward_and_backward_lower(impl, dtype, shape, act):
    m, k, n = shape

    def fwd(x, w, b):
        return ops.fused_matmul(x, w, b, activation=act, implementation=impl)

    def grads(x, w, b):
        return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), (0, 1, 2))(x, w, b)

    specs = [((m, k), dtype), ((k, n), dtype), ((n,), dtype)]
    marker = PLATFORM[impl][1]
    assert lower_text(fwd, impl, *specs).count(marker) >= 1
    # Backward: the dz kernel (when needed) and the dx and dw matmuls are kernels too.
    assert lower_text(grads, impl, *specs).count(marker) >= 3


@pytest.mark.parametrize("impl", ["mosaic_tpu", "pallas_triton", "mosaic_gpu"])
def test_elementwise_kernel_lowers_everywhere(impl):
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) + pl.program_id(0)

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                              in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                              backend=impl, name="tanh_plus_pid")(x)

    text = lower_text(f, impl, ((16, 128), jnp.float32))
    assert PLATFORM[impl][1] in text
    assert "tanh_plus_pid" in text


def test_tpu_reduction_with_dict_semantics_lowers():
    def sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    def f(x):
        return pl.pallas_call(sum_kernel, out_shape=jax.ShapeDtypeStruct((512, 512), x.dtype), grid=8,
                              in_specs=[pl.BlockSpec(lambda i: (i, 0, 0), (None, 512, 512))],
                              out_specs=pl.BlockSpec(lambda i: (0, 0), (512, 512)),
                              compiler_params=dict(mosaic=dict(dimension_semantics=("arbitrary",))),
                              backend="mosaic_tpu")(x)

    text = lower_text(f, "mosaic_tpu", ((8, 512, 512), jnp.float32))
    assert "tpu_custom_call" in text


def test_unblocked_with_padding_lowers_for_tpu():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def f(x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((16, 128), x.dtype), grid=(2,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (8 * i, 0),
                                   indexing_mode=pl.Unblocked(((1, 1), (0, 0))))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend="mosaic_tpu")(x)

    assert "tpu_custom_call" in lower_text(f, "mosaic_tpu", ((14, 128), jnp.float32))


def exp_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])


def exp_call(backend, debug=False):
    return pl.pallas_call(exp_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                          backend=backend, name="exp_kernel", debug=debug,
                          cost_estimate=dict(flops=0, transcendentals=2048, bytes_accessed=16384))


def test_cost_estimate_and_name_reach_mosaic():
    text = lower_text(exp_call("mosaic_tpu"), "mosaic_tpu", ((16, 128), jnp.float32))
    assert "cost_estimate" in text and "16384" in text and "2048" in text
    assert 'kernel_name = "exp_kernel"' in text


def test_debug_prints_what_the_backend_generates(capsys):
    exp_call("interpret", debug=True)(jnp.ones((16, 128)))
    assert "exp_kernel" in capsys.readouterr().out
    lower_text(exp_call("mosaic_tpu", debug=True), "mosaic_tpu", ((16, 128), jnp.float32))
    out = capsys.readouterr().out
    assert "func.func @exp_kernel" in out and "math.exp" in out
