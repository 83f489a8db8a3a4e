"""Our Triton lowering, run in Triton's CPU interpreter and compiled for sm_90
(the verification ladder, docs/design.md §7.3 and §7.4).

Every kernel is compared with the interpret backend on the same inputs.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from ops.matmul import reference
from tests.tolerances import BACKWARD, FORWARD, assert_close

pytest.importorskip("triton")
pytest.importorskip("torch")

SM90_SHARED_BYTES = 232448  # H100 / H200: 227 KiB of shared memory per block


def both(kernel, out_shape, *args, **kw):
    run = lambda backend: pl.pallas_call(kernel, out_shape=out_shape, backend=backend, **kw)(*args)
    return run("triton"), run("interpret")


def assert_same(kernel, out_shape, *args, rtol=1e-5, atol=1e-6, **kw):
    got, want = both(kernel, out_shape, *args, **kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=atol)


X = jax.random.normal(jax.random.key(0), (16, 32))
Y = jax.random.normal(jax.random.key(1), (16, 32))
SPEC = pl.BlockSpec((8, 16), lambda i, j: (i, j))
SDS = jax.ShapeDtypeStruct((16, 32), jnp.float32)

ELEMENTWISE = {
    "arith": lambda x, y: (x + y) * (x - y) / (jnp.abs(y) + 1.0) - (-x),
    "math": lambda x, y: jnp.exp(x) + jnp.exp2(y) + jnp.log(jnp.abs(x) + 1) + jnp.log1p(jnp.abs(y))
                         + jnp.sqrt(jnp.abs(x)) + jax.lax.rsqrt(jnp.abs(y) + 1),
    "transcendental": lambda x, y: jnp.tanh(x) + jax.nn.sigmoid(y) + jax.lax.erf(x) + jnp.sin(y) * jnp.cos(x),
    "rounding": lambda x, y: jnp.floor(x) + jnp.ceil(y) + jnp.sign(x) + jnp.round(y) + jnp.clip(x, -0.5, 0.5),
    "pow": lambda x, y: x ** 3 + jnp.abs(y) ** 1.5 + jax.lax.square(x) + 1.0 / (x * x + 1),
    "minmax_rem": lambda x, y: jnp.maximum(x, y) - jnp.minimum(x, y) + jnp.fmod(x, 0.7),
    "compare_select": lambda x, y: jnp.where((x > y) & ~(x < 0) | (y == 0), x, y * 2),
    "casts": lambda x, y: (x * 10).astype(jnp.int32).astype(jnp.float32) + y.astype(jnp.bfloat16).astype(jnp.float32),
    "gelu_silu": lambda x, y: jax.nn.gelu(x) + jax.nn.silu(y) + ops.ACTIVATIONS["gelu_exact"](x),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise(name):
    fn = ELEMENTWISE[name]

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = fn(x_ref[...], y_ref[...])

    assert_same(kernel, SDS, X, Y, grid=(2, 2), in_specs=[SPEC, SPEC], out_specs=SPEC)


def test_integer_and_bitwise_ops():
    a = jax.random.randint(jax.random.key(2), (16, 32), -100, 100, jnp.int32)
    b = jax.random.randint(jax.random.key(3), (16, 32), 1, 7, jnp.int32)

    def kernel(a_ref, b_ref, o_ref):
        a, b = a_ref[...], b_ref[...]
        o_ref[...] = (a // b) + jax.lax.rem(a, b) + (a & b) + (a | 3) + (a ^ b) + (b << 2) + (a >> 1)

    assert_same(kernel, jax.ShapeDtypeStruct((16, 32), jnp.int32), a, b, grid=(2, 2),
                in_specs=[SPEC, SPEC], out_specs=SPEC)


def test_iota_broadcast_reshape_transpose_reductions():
    def kernel(x_ref, o_ref, s_ref):
        x = x_ref[...]
        rows = jax.lax.broadcasted_iota(jnp.int32, (16, 32), 0)
        t = jnp.transpose(x)  # (32, 16)
        y = x + rows.astype(jnp.float32) + jnp.sum(t, axis=0)[:, None] - jnp.max(x, axis=1, keepdims=True)
        o_ref[...] = y.reshape(16, 32) + jnp.min(x)
        s_ref[...] = jnp.sum(x, axis=0, keepdims=True)

    assert_same(kernel, (SDS, jax.ShapeDtypeStruct((1, 32), jnp.float32)), X)


def test_argmax_argmin_and_cumulative_ops():
    def kernel(x_ref, i_ref, c_ref):
        x = x_ref[...]
        i_ref[...] = jnp.argmax(x, axis=1)[:, None] * 100 + jnp.argmin(x, axis=0)[None, :]
        c_ref[...] = jnp.cumsum(x, axis=1) + jax.lax.cummax(x, axis=0) - jax.lax.cummin(x, axis=1)

    x = jnp.round(X[:, :16] * 2) / 2  # ties, to check the lowest index wins
    sds = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    assert_same(kernel, (jax.ShapeDtypeStruct((16, 16), jnp.int32), sds), x)


def test_static_strided_dynamic_slices_and_at_views():
    x = jax.random.normal(jax.random.key(4), (4, 16, 64))

    def helper(view_ref, out_ref):
        out_ref[...] = view_ref[...] * 3

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[0:4, :] = x_ref.at[0][0:4, ::2]  # (JAX's discharge rejects int + strided in one indexer)
        o_ref[pl.ds(4, 4), :] = x_ref.at[1][pl.ds(i * 4, 4), pl.ds(1, 32, stride=2)]
        helper(x_ref.at[2, 8:16, 0:32], o_ref.at[8:16, :])

    assert_same(kernel, jax.ShapeDtypeStruct((2, 16, 32), jnp.float32), x, grid=(2,),
                in_specs=[pl.BlockSpec((4, 16, 64), lambda i: (0, 0, 0))],
                out_specs=pl.BlockSpec((None, 16, 32), lambda i: (i, 0, 0)))


def test_load_store_masks_and_aliasing():
    x = jax.random.normal(jax.random.key(5), (32,))

    def kernel(x_ref, o_ref):
        idx = jnp.arange(16)
        v = pl.load(x_ref, (pl.ds(0, 16),), mask=idx < 11, other=-1.0)
        pl.store(o_ref, (pl.ds(16, 16),), v * 2, mask=idx % 3 == 0)

    assert_same(kernel, jax.ShapeDtypeStruct((32,), jnp.float32), x, input_output_aliases={0: 0})


def test_control_flow_when_loop_fori_while_cond():
    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        @pl.loop(0, 4)
        def _(k):
            o_ref[...] += x_ref[...] * k

        acc = jax.lax.fori_loop(0, 3, lambda k, a: a + x_ref[...], jnp.zeros((8, 16), jnp.float32))
        n = jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5), (i, 1.0))[1]
        o_ref[...] += jax.lax.cond(i == 0, lambda: acc, lambda: -acc) * n

        @pl.when(i == 1)
        def _():
            o_ref[...] = o_ref[...] + 100.0

    assert_same(kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32), X[:, :16], grid=(2,),
                in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)))


def test_dot_general_with_transposes_and_precision():
    a = jax.random.normal(jax.random.key(6), (32, 16))
    b = jax.random.normal(jax.random.key(7), (32, 16))

    def kernel(a_ref, b_ref, o_ref, t_ref):
        hi = jax.lax.Precision.HIGHEST
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((0,), (0,)), ((), ())), precision=hi)
        t_ref[...] = jnp.dot(a_ref[...], b_ref[...].T, precision=hi)

    assert_same(kernel, (jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32)),
                a, b, rtol=1e-4, atol=1e-4)


def test_dot_over_a_padded_contraction_masks_only_unknown_padding():
    """A 24-long contraction runs on 32 lanes. Loaded tiles read their padding as 0
    (masked loads) and go to tl.dot as they are; a computed tile (exp: padding 1)
    is re-masked, so its padding cannot leak into the sum."""
    a = jax.random.normal(jax.random.key(16), (16, 24))
    b = jax.random.normal(jax.random.key(17), (24, 16))

    def kernel(a_ref, b_ref, o_ref):
        hi = jax.lax.Precision.HIGHEST
        o_ref[...] = (jnp.dot(a_ref[...], b_ref[...], precision=hi)
                      + jnp.dot(jnp.exp(a_ref[...]), b_ref[...], precision=hi))

    out = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    call = lambda a, b: pl.pallas_call(kernel, out_shape=out, backend="triton")(a, b)
    want = np.asarray(a) @ np.asarray(b) + np.exp(np.asarray(a)) @ np.asarray(b)
    np.testing.assert_allclose(call(a, b), want, rtol=1e-5, atol=1e-5)
    (src,) = pl.triton.source(call, a, b)
    dot_lines = [line for line in src.splitlines() if "tl.dot(" in line]
    assert sum("tl.where(" in line for line in dot_lines) == 1, src


@pytest.mark.parametrize("precision, expected", [
    (jax.lax.Precision.HIGHEST, 'input_precision="ieee"'),
    (jax.lax.DotAlgorithmPreset.F32_F32_F32, 'input_precision="ieee"'),
    (jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, 'input_precision="tf32x3"'),
    (jax.lax.DotAlgorithmPreset.TF32_TF32_F32, 'input_precision="tf32"'),
    (None, None),
])
def test_dot_precision_reaches_tl_dot(precision, expected):
    """A float32 dot's precision or algorithm preset picks tl.dot's input_precision."""
    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (0,)), ((), ())),
                                         precision=precision, preferred_element_type=jnp.float32)

    sds = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    (src,) = pl.triton.source(lambda a, b: pl.pallas_call(kernel, out_shape=sds, backend="triton")(a, b),
                              sds, sds)
    dots = [line for line in src.splitlines() if "tl.dot(" in line]
    assert len(dots) == 1, src
    if expected is None:
        assert "input_precision" not in dots[0]
    else:
        assert expected in dots[0]


def test_arbitrary_axis_reduction_runs_as_a_loop():
    """The TPU-style reduction (docs/pallas_core.md section 5) is correct: arbitrary axes run in
    order."""
    def sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    x = jax.random.normal(jax.random.key(8), (16, 64))
    got = pl.pallas_call(sum_kernel, out_shape=jax.ShapeDtypeStruct((16, 16), x.dtype), grid=(2, 4),
                         in_specs=[pl.BlockSpec((8, 16), lambda i, k: (i, k))],
                         out_specs=pl.BlockSpec((8, 16), lambda i, k: (i, 0)), backend="triton")(x)
    np.testing.assert_allclose(got, x.reshape(16, 4, 16).sum(1), rtol=1e-5, atol=1e-5)


def test_grids_of_rank_0_4_and_5():
    """Grids beyond three axes are flattened into the launch grid; an axis the
    output ignores still runs as an in-kernel loop, whatever the rank."""
    def ids_kernel(x_ref, o_ref):
        a, b, c, d = (pl.program_id(i) for i in range(4))
        o_ref[...] = x_ref[...] * 2 + (a * 1000 + b * 100 + c * 10 + d).astype(jnp.float32)

    x = jax.random.normal(jax.random.key(11), (2, 3, 16, 24))
    spec = pl.BlockSpec((None, None, 8, 8), lambda a, b, c, d: (a, b, c, d))
    assert_same(ids_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x, grid=(2, 3, 2, 3),
                in_specs=[spec], out_specs=spec)

    def weighted_sum_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(4) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        weight = 1 + sum(pl.program_id(a) * 2**a for a in range(5))
        o_ref[...] += x_ref[...] * weight.astype(jnp.float32)

    x = jax.random.normal(jax.random.key(12), (2, 2, 2, 8, 32))
    assert_same(weighted_sum_kernel, jax.ShapeDtypeStruct((2, 2, 2, 8, 8), x.dtype), x, grid=(2, 2, 2, 1, 4),
                in_specs=[pl.BlockSpec((None, None, None, 8, 8), lambda a, b, c, d, e: (a, b, c, d, e))],
                out_specs=pl.BlockSpec((None, None, None, 8, 8), lambda a, b, c, d, e: (a, b, c, d, 0)))

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    assert_same(add_one, SDS, X)  # no grid: one program over whole arrays


def test_jit_custom_jvp_and_custom_vjp_calls_are_inlined():
    @jax.custom_vjp
    def twice_sin(x):
        return 2 * jnp.sin(x)

    twice_sin.defvjp(lambda x: (twice_sin(x), x), lambda x, g: (2 * g * jnp.cos(x),))

    @jax.custom_jvp
    def softplus(x):
        return jnp.logaddexp(x, 0.0)

    softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

    @jax.jit
    def affine(x):
        return 3 * x - 1

    def kernel(x_ref, o_ref):
        x = x_ref[...]
        o_ref[...] = (twice_sin(x) + softplus(x) + affine(x) + jax.nn.relu(x)
                      + jax.nn.logsumexp(x, axis=1, keepdims=True))

    assert_same(kernel, SDS, X)


def test_arrays_past_2_31_elements_use_int64_offsets():
    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def f(x):
        spec = pl.BlockSpec((64, 128), lambda i, j: (i, j))
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(pl.cdiv(x.shape[0], 64), pl.cdiv(x.shape[1], 128)),
                              in_specs=[spec], out_specs=spec, backend="triton")(x)

    big = jax.ShapeDtypeStruct((2**16, 2**15 + 100), jnp.bfloat16)  # 2**31 + 6.5M elements, edge blocks
    (src,) = pl.triton.source(f, big)
    assert src.count(".to(tl.int64)") == 4  # two dims, one load and one store
    assert ".to(tl.int64)" not in pl.triton.source(f, jax.ShapeDtypeStruct((2**10, 1000), jnp.bfloat16))[0]
    (report,) = pl.triton.compile(f, big, target="sm_90")
    assert "mul.wide.s32" in report["asm"]["ptx"] or ".s64" in report["asm"]["ptx"]


def test_program_ids_with_edge_blocks_and_squeezed_dims():
    def program_ids_kernel(o_ref):
        o_ref[...] = jnp.full(o_ref.shape, 10 * pl.program_id(0) + pl.program_id(1), jnp.int32)

    got = pl.pallas_call(program_ids_kernel, out_shape=jax.ShapeDtypeStruct((7, 5), jnp.int32), grid=(4, 2),
                         out_specs=pl.BlockSpec((2, 4), lambda i, j: (i, j)), backend="triton")()
    expected = (10 * (np.arange(7)[:, None] // 2) + np.arange(5)[None, :] // 4)
    np.testing.assert_array_equal(got, expected)

    def squeezed(o_ref):
        o_ref[...] = jnp.full((2,), 10 * pl.program_id(1) + pl.program_id(0), jnp.int32)

    got = pl.pallas_call(squeezed, jax.ShapeDtypeStruct((3, 4), np.int32),
                         out_specs=pl.BlockSpec((None, 2), lambda i, j: (i, j)), grid=(3, 2), backend="triton")()
    np.testing.assert_array_equal(got, [[0, 0, 10, 10], [1, 1, 11, 11], [2, 2, 12, 12]])


def test_scratch_shapes_and_jit_vmap():
    def kernel(x_ref, o_ref, acc_ref):
        acc_ref[...] = x_ref[...] * 2
        o_ref[...] = acc_ref[...] + 1

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                              in_specs=[pl.BlockSpec((8, 32), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((8, 32), lambda i: (i, 0)),
                              scratch_shapes=[pl.tpu.VMEM((8, 32), jnp.float32)], backend="triton")(x)

    xs = jnp.stack([X, Y])
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(xs), xs * 2 + 1, rtol=1e-6)


def test_register_scratch_and_memory_scratch():
    """Whole-block scratch is a loop-carried value; scratch sliced in the kernel stays in memory."""
    def acc_kernel(x_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
        acc_ref[...] += jnp.exp(x_ref[...])

        @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
        def _():
            o_ref[...] = jnp.log(acc_ref[...])

    def sliced_kernel(x_ref, o_ref, acc_ref):
        acc_ref[:, 0:16] = x_ref[:, 16:32]
        acc_ref[:, 16:32] = x_ref[:, 0:16]
        o_ref[...] = acc_ref[...] * 2

    x = jax.random.normal(jax.random.key(21), (16, 96))
    kw = dict(grid=(2, 3), in_specs=[pl.BlockSpec((8, 32), lambda i, k: (i, k))],
              out_specs=pl.BlockSpec((8, 32), lambda i, k: (i, 0)),
              scratch_shapes=[pl.tpu.VMEM((8, 32), jnp.float32)])
    out = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    for kernel in (acc_kernel, sliced_kernel):
        (src,) = pl.triton.source(lambda x: pl.pallas_call(kernel, out, backend="triton", **kw)(x), x)
        in_memory = ", s0," in src
        assert in_memory == (kernel is sliced_kernel), src
        assert_same(kernel, out, x, **kw)
    want = jnp.log(jnp.exp(x).reshape(16, 3, 32).sum(1))
    got = pl.pallas_call(acc_kernel, out, backend="triton", **kw)(x)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_non_power_of_two_blocks_are_padded_and_masked():
    """Head dim 96 and a 48-wide row: padded lanes stay out of reductions, dots and stores."""
    k = jax.random.split(jax.random.key(22), 3)
    q = jax.random.normal(k[0], (40, 96))  # 40 rows: the last row block (16 of 48) overhangs
    kv = jax.random.normal(k[1], (24, 96))
    w = jax.random.normal(k[2], (96, 48)) / 10

    def kernel(q_ref, kv_ref, w_ref, s_ref, p_ref, stats_ref):
        q, kv = q_ref[...], kv_ref[...]
        inv = 1.0 / q  # padding lanes load 0: inf there must not reach the dots
        s = jax.lax.dot_general(q, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s_ref[...] = s + jnp.dot(inv * 0, w_ref[...], preferred_element_type=jnp.float32).sum()
        h = jnp.dot(jnp.tanh(q), w_ref[...], preferred_element_type=jnp.float32)  # (16, 48)
        p = jnp.exp(h - h.max(axis=1, keepdims=True))
        p_ref[...] = jnp.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
        # Shifted so that a padding lane (0) would win the max, the min and add exp(0) = 1 to the sum.
        stats_ref[:, 0] = jnp.argmax(q - 10, axis=1).astype(jnp.float32)
        stats_ref[:, 1] = (q + 10).min(axis=1)
        stats_ref[:, 2] = jnp.exp(q).sum(axis=1)

    out_shape = [jax.ShapeDtypeStruct((40, 24), jnp.float32), jax.ShapeDtypeStruct((40, 48), jnp.float32),
                 jax.ShapeDtypeStruct((40, 3), jnp.float32)]
    kw = dict(grid=(3,), in_specs=[pl.BlockSpec((16, 96), lambda i: (i, 0)), pl.BlockSpec((24, 96), lambda i: (0, 0)),
                                   pl.BlockSpec((96, 48), lambda i: (0, 0))],
              out_specs=[pl.BlockSpec((16, 24), lambda i: (i, 0)), pl.BlockSpec((16, 48), lambda i: (i, 0)),
                         pl.BlockSpec((16, 3), lambda i: (i, 0))])
    got = pl.pallas_call(kernel, out_shape, backend="triton", **kw)(q, kv, w)
    want = pl.pallas_call(kernel, out_shape, backend="interpret", **kw)(q, kv, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
    h = jnp.tanh(q) @ w
    np.testing.assert_allclose(got[1], jnp.cumsum(jax.nn.softmax(h, axis=1), axis=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[2][:, 0], jnp.argmax(q, axis=1))
    np.testing.assert_allclose(got[2][:, 2], jnp.exp(q).sum(axis=1), rtol=1e-5)


def test_non_power_of_two_scratch_and_edge_blocks():
    """A (8, 100) block over a (12, 150) array: both padding and the array's edge are masked."""
    x = jax.random.normal(jax.random.key(23), (12, 150))

    def kernel(x_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
        acc_ref[...] += jnp.where(jnp.isnan(x_ref[...]), 0.0, x_ref[...])
        o_ref[...] = acc_ref[...]

    kw = dict(grid=(2, 2), in_specs=[pl.BlockSpec((8, 100), lambda i, k: (i, k))],
              out_specs=pl.BlockSpec((8, 100), lambda i, k: (i, 0)),
              scratch_shapes=[pl.tpu.VMEM((8, 100), jnp.float32)])
    got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((12, 100), jnp.float32), backend="triton", **kw)(x)
    # Columns 100..149 are the second block's valid part; its padding past 150 reads as 0 on triton.
    want = x[:, :100] + jnp.pad(x[:, 100:], ((0, 0), (0, 50)))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_reshape_that_would_mix_padding_is_refused():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].reshape(4, 72)

    with pytest.raises(NotImplementedError, match=r"reshape \(8, 36\) -> \(4, 72\).*non-power-of-two"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((4, 72), jnp.float32), backend="triton",
                       in_specs=[pl.BlockSpec((8, 36), lambda: (0, 0))])(jnp.ones((8, 36)))


def test_split_into_equal_power_of_two_pieces():
    """jnp.split of a value (Triton has no value slicing): halves and quarters of the
    columns with padded rows (12 of 16) beside them, halves of the rows; splits of a
    non-power-of-two dim or into unequal pieces are refused."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((12, 32)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)

    def kernel(x_ref, y_ref, o_ref, r_ref):
        v = x_ref[...]
        a, b = jnp.split(v, 2, axis=1)
        q = jnp.split(v, 4, axis=1)
        o_ref[:, 0:16] = b * 2 + a
        o_ref[:, 16:24] = q[3] - q[1]
        o_ref[:, 24:32] = q[0] * q[2]
        top, bottom = jnp.split(y_ref[...], 2, axis=0)
        r_ref[...] = top + 3 * bottom

    q = [x[:, 8 * i:8 * (i + 1)] for i in range(4)]
    want = (jnp.concatenate([x[:, 16:] * 2 + x[:, :16], q[3] - q[1], q[0] * q[2]], axis=1),
            y[:8] + 3 * y[8:])
    out = (jax.ShapeDtypeStruct((12, 32), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))
    for got in both(kernel, out, x, y):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)

    for width, pieces in ((48, 2), (32, [8])):  # a padded dim; unequal pieces
        def bad(x_ref, o_ref, pieces=pieces):
            o_ref[...] = jnp.split(x_ref[...], pieces, axis=1)[0]

        out = jax.ShapeDtypeStruct((8, 24 if width == 48 else 8), jnp.float32)
        with pytest.raises(NotImplementedError, match="equal power-of-two pieces"):
            pl.pallas_call(bad, out, backend="triton")(jnp.ones((8, width)))


def test_unsupported_primitive_names_kernel_and_line():
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.erf_inv(x_ref[...])

    with pytest.raises(NotImplementedError, match=r"'erf_inv'.*kernel kernel.*test_triton_backend.py"):
        pl.pallas_call(kernel, out_shape=SDS, backend="triton")(X)


def test_source_and_debug_print(capsys):
    def add_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    f = lambda x, y: pl.pallas_call(add_kernel, out_shape=SDS, grid=(2, 2), in_specs=[SPEC, SPEC],
                                    out_specs=SPEC, backend="triton", debug=True)(x, y)
    (src,) = pl.triton.source(f, SDS, SDS)
    assert "def add_kernel(" in src and "tl.constexpr" in src and "tl.load" in src
    assert "def add_kernel(" in capsys.readouterr().out
    assert pl.triton.source(f, SDS, SDS) == [src]  # traced before: JAX's caches must not hide it


# ---- ops through our lowering ----------------------------------------------------------

@pytest.mark.parametrize("act, dtype", [(None, jnp.float32), ("gelu_exact", jnp.float32),
                                        ("gelu_exact", jnp.bfloat16), ("gelu", jnp.bfloat16),
                                        ("softplus", jnp.float32)])
def test_fused_matmul_forward_and_gradients(act, dtype):
    k = jax.random.split(jax.random.key(9), 4)
    x = jax.random.normal(k[0], (37, 50), dtype)
    w = (jax.random.normal(k[1], (50, 70)) / 7).astype(dtype)
    b = jax.random.normal(k[2], (70,), dtype)
    fn = ops.ACTIVATIONS.get(act) if act else None
    mm = functools.partial(ops.fused_matmul, activation=act, implementation="triton", block_sizes=(16, 32, 16))
    f32 = lambda *a: [t.astype(jnp.float32) for t in a]
    assert_close(mm(x, w, b), reference(*f32(x, w, b), fn), FORWARD[dtype])
    cot = jax.random.normal(k[3], (37, 70), dtype)
    grads = jax.grad(lambda *a: jnp.sum(mm(*a).astype(jnp.float32) * cot), (0, 1, 2))(x, w, b)
    expected = jax.grad(lambda *a: jnp.sum(reference(*a, fn) * cot), (0, 1, 2))(*f32(x, w, b))
    for g, e in zip(grads, expected):
        assert_close(g, e, BACKWARD[dtype])


SHIPPED_MATMULS = [((4096, 4096, 4096), jnp.bfloat16), ((8192, 4096, 16384), jnp.bfloat16),
                   ((1000, 384, 777), jnp.float32), ((256, 512, 384), jnp.float16)]


@pytest.mark.parametrize("shape, dtype", SHIPPED_MATMULS)
def test_shipped_fused_matmul_kernels_compile_for_sm90(shape, dtype):
    m, k, n = shape

    def train_step(x, w, b):
        f = lambda x, w, b: ops.fused_matmul(x, w, b, activation="gelu_exact", implementation="triton")
        y, pullback = jax.vjp(f, x, w, b)
        return y, pullback(y)

    args = [jax.ShapeDtypeStruct(s, dtype) for s in [(m, k), (k, n), (n,)]]
    reports = pl.triton.compile(train_step, *args, target="sm_90")
    assert len(reports) == 4  # forward, dz, dx, dw
    for r in reports:
        assert r["shared_memory_bytes"] <= SM90_SHARED_BYTES, r["name"]
        assert "cubin" in r["asm"]


def test_atomics_histogram_and_cas():
    """Every program adds into one shared output block: a race unless the adds are atomic."""
    x = jax.random.normal(jax.random.key(10), (64, 16))

    def kernel(x_ref, o_ref, m_ref, c_ref):
        pl.triton.atomic_add(o_ref, (pl.ds(0, 16),), jnp.sum(x_ref[...], axis=0))
        pl.triton.atomic_max(m_ref, (pl.ds(0, 16),), jnp.max(x_ref[...], axis=0))
        pl.triton.atomic_min(m_ref, (pl.ds(16, 16),), jnp.min(x_ref[...], axis=0))
        pl.triton.atomic_cas(c_ref, (pl.ds(0, 16),), jnp.zeros(16, jnp.int32), jnp.ones(16, jnp.int32))

    zeros = jnp.zeros((16,))
    inits = (zeros, jnp.concatenate([jnp.full((16,), -jnp.inf), jnp.full((16,), jnp.inf)]),
             jnp.zeros((16,), jnp.int32))
    out_shape = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inits)
    for backend in ("triton", "interpret"):
        total, mm, flags = pl.pallas_call(
            lambda x_ref, _a, _b, _c, o_ref, m_ref, c_ref: kernel(x_ref, o_ref, m_ref, c_ref),
            out_shape=out_shape, grid=(4,),
            in_specs=[pl.BlockSpec((16, 16), lambda i: (i, 0)), None, None, None],
            out_specs=(None, None, None), input_output_aliases={1: 0, 2: 1, 3: 2},
            compiler_params=pl.CompilerParams(("parallel",)), backend=backend)(x, *inits)
        np.testing.assert_allclose(total, x.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(mm[:16], x.max(0))
        np.testing.assert_array_equal(mm[16:], x.min(0))
        np.testing.assert_array_equal(flags, np.ones(16, np.int32))
    (src,) = pl.triton.source(lambda *a: pl.pallas_call(
        lambda x_ref, _a, _b, _c, o_ref, m_ref, c_ref: kernel(x_ref, o_ref, m_ref, c_ref),
        out_shape=out_shape, grid=(4,), in_specs=[pl.BlockSpec((16, 16), lambda i: (i, 0)), None, None, None],
        out_specs=(None, None, None), input_output_aliases={1: 0, 2: 1, 3: 2},
        compiler_params=pl.CompilerParams(("parallel",)), backend="triton")(*a), x, *inits)
    assert "pid = tl.program_id(0)" in src  # the axis is launched in parallel, not looped
    for op in ("atomic_add", "atomic_max", "atomic_min", "atomic_cas"):
        assert f"tl.{op}(" in src


# ---- the row-wise ops through our lowering (multi-chunk rows, edge blocks) -------------

ROWS = jax.random.normal(jax.random.key(11), (5, 300)) * 3
ROW_CASES = {
    "layer_norm": (lambda x, **k: ops.layer_norm(x, jnp.linspace(0.5, 1.5, 300), jnp.linspace(-1, 1, 300), **k),
                   lambda x: ops.layer_norm(x, jnp.linspace(0.5, 1.5, 300), jnp.linspace(-1, 1, 300),
                                            implementation="xla")),
    "rms_norm": (lambda x, **k: ops.rms_norm(x, **k), lambda x: ops.rms_norm(x, implementation="xla")),
    "softmax": (lambda x, **k: ops.softmax(x, **k), jax.nn.softmax),
    "log_softmax": (lambda x, **k: ops.log_softmax(x, **k), jax.nn.log_softmax),
    "sum_max": (lambda x, **k: ops.sum(x, axis=-1, **k) + ops.max(x, axis=-1, **k),
                lambda x: jnp.sum(x, -1) + jnp.max(x, -1)),
    "logsumexp": (lambda x, **k: ops.logsumexp(x, axis=-1, **k), lambda x: jax.nn.logsumexp(x, axis=-1)),
    "cross_entropy": (lambda x, **k: ops.cross_entropy(x, jnp.arange(5) * 7, **k),
                      lambda x: ops.cross_entropy(x, jnp.arange(5) * 7, implementation="xla")),
}


@pytest.mark.parametrize("name", sorted(ROW_CASES))
def test_row_ops_forward_and_gradient(name):
    ours, ref = ROW_CASES[name]
    f = functools.partial(ours, implementation="triton", max_chunk=128)
    assert_close(f(ROWS), ref(ROWS), 1e-5)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(ROWS)
    assert_close(g, jax.grad(lambda x: jnp.sum(jnp.sin(ref(x))))(ROWS), 1e-4)


def test_linear_cross_entropy_forward_and_gradients():
    k = jax.random.split(jax.random.key(12), 3)
    x = jax.random.normal(k[0], (13, 32))
    w = jax.random.normal(k[1], (32, 300)) / 5
    labels = jax.random.randint(k[2], (13,), 0, 300)
    ours = lambda x, w: ops.linear_cross_entropy(x, w, labels, implementation="triton")
    ref = lambda x, w: ops.linear_cross_entropy(x, w, labels, implementation="xla")
    assert_close(ours(x, w), ref(x, w), 1e-5)
    for g, e in zip(jax.grad(lambda *a: ours(*a).sum(), (0, 1))(x, w), jax.grad(lambda *a: ref(*a).sum(), (0, 1))(x, w)):
        assert_close(g, e, 1e-4)


def test_gpu_launch_without_jax_triton_says_how_to_fix(monkeypatch):
    import sys

    from pallas_core.triton import runtime
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # makes `import jax_triton` fail
    with pytest.raises(ImportError, match=r"jax_triton.*pallas-kernels\[gpu\].*pallas_triton"):
        runtime.import_jax_triton()


def _float32_samples(n: int, seed: int = 0) -> np.ndarray:
    """``n`` float32 values: random bit patterns (every exponent, subnormals, both signs)
    and, as many, uniform in [-10, 10] where tanh and gelu change fastest; no NaN or inf."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n // 2, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = np.where(np.isfinite(bits), bits, np.float32(0.5))
    return np.concatenate([bits, rng.uniform(-10, 10, n - n // 2).astype(np.float32)])


def _ulps(got, want64):
    """|got - want| in float32 ulps of the float64 value (an ulp of 0 counts as the smallest subnormal's)."""
    spacing = np.spacing(np.abs(want64).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want64) / spacing


def test_tanh_within_two_ulps_over_the_float32_range():
    """jnp.tanh on our Triton lowering (the epilogue of tanh and gelu activations) is a
    polynomial below |x| = 1.2 and 1 - 2 / (exp2(2 log2(e) |x|) + 1) above (jit_helpers):
    within 2 ulps of float64 tanh on 2**20 sampled float32 values, as computed in
    Triton's interpreter (exact exp2 and division) and, the helper's formula in numpy,
    with the GPU's approximations at their worst errors (ex2.approx.ftz.f32: 2**-22
    relative, rcp.approx.ftz.f32: 2**-23; measured 1.79); signed zeros, infinities and
    NaN as XLA. Triton's interpreter runs under XLA's flush of subnormal operands (x * 1.5
    is 0 there for x = 2**-126): for subnormal x it is checked to give a zero of x's sign,
    the numpy formula (as the GPU, which keeps them) to give x."""
    x = _float32_samples(2**20).reshape(1024, 1024)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...])

    def run(a):
        return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float32),
                                         backend="triton")(a))

    got = run(x)
    want = np.tanh(x.astype(np.float64))
    normal = np.abs(x) >= 2.0**-126
    assert _ulps(got[normal], want[normal]).max() <= 2.0
    assert (np.abs(got[~normal]) <= np.abs(x[~normal])).all()
    np.testing.assert_array_equal(np.signbit(got), np.signbit(x))
    # The formula as the GPU computes it, every operation rounded once, at the approximations'
    # worst errors (a quotient 2**-21 off, 4 ulps, or exp2 off by 2**-21 breaks the bound).
    with np.errstate(over="ignore", invalid="ignore"):
        for e_err in (-(2.0**-22), 2.0**-22):
            exp2 = lambda v, e_err=e_err: (np.exp2(v.astype(np.float64)) * (1 + e_err)).astype(np.float32)
            for q_err in (-(2.0**-23), 2.0**-23):
                assert _ulps(_helper_in_numpy("tanh", exp2, q_err)(x), want).max() <= 2.0, (e_err, q_err)
    edges = np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 1.2, -1.2, 9.1, -9.1,
                       1e-45, -1e-45, 0.6, -0.6, 3e38]], np.float32)
    want = np.asarray(jnp.tanh(edges))
    exact_exp2 = lambda v: np.exp2(v.astype(np.float64)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        formula = _helper_in_numpy("tanh", exact_exp2)(edges)
    got = run(edges)
    for out, keep in ((got, np.abs(edges) != np.float32(1e-45)), (formula, np.ones(edges.shape, bool))):
        np.testing.assert_array_equal(np.signbit(out), np.signbit(want))
        np.testing.assert_allclose(out[keep], want[keep], rtol=2 * 2.0**-23, atol=0)
    # Triton's interpreter flushes subnormal operands: the smallest subnormals come back
    # as zeros (of x's sign, checked above), not as anything else.
    np.testing.assert_array_equal(got[np.abs(edges) == np.float32(1e-45)], 0.0)


def _sigmoid64(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


@pytest.mark.parametrize("name, fn, helper, reference, bound", [
    ("exp", jnp.exp, "_exp(", lambda x: np.exp(x.astype(np.float64)), 3.0),
    ("sigmoid", jax.nn.sigmoid, "_sigmoid(", _sigmoid64, 1.0),
    ("silu", jax.nn.silu, "_sigmoid(", lambda x: x.astype(np.float64) * _sigmoid64(x), 2.0),
])
def test_exp_sigmoid_and_silu_accuracy_over_the_float32_range(name, fn, helper, reference, bound):
    """lax.exp and lax.logistic on our Triton lowering (jit_helpers' exp and sigmoid: the
    argument reduced first, not exp2(x * log2 e), whose rounded product costs up to ~20
    ulps near |x| = 88 on a GPU), in Triton's interpreter, against float64 on 2**20 float32
    values (random bit patterns, [-10, 10], and dense on [-90, 20] where sigmoid's result
    leaves [1/2, 1] and underflows) whose result is a normal float: exp within 3 ulps (the
    interpreter's float32 exp2 is itself up to an ulp off), sigmoid within 1 (measured 0.65)
    and jax.nn.silu = x * sigmoid(x) within 2 (1.45); XLA's CPU exp, logistic and silu
    measure 1.8 (5 near |x| = 88), 2.3 and 2.6, and so do the interpret backend and
    jax.nn's / jnp's functions (checked within 6). Subnormal results (and silu where sigmoid is subnormal) are
    checked in absolute terms: at most the smallest normal float times max(1, |x|) (0 where
    the GPU flushes); edges within 4 ulps of XLA's, infinities, zeros and NaN exactly."""
    rng = np.random.default_rng(1)
    x = np.concatenate([_float32_samples(2**19, seed=1),
                        rng.uniform(-90, 20, 2**19).astype(np.float32)]).reshape(1024, 1024)

    def kernel(x_ref, o_ref):
        o_ref[...] = fn(x_ref[...])

    def run(a):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float32),
                              backend="triton")(a)

    call = lambda a: np.asarray(run(a))
    assert helper in pl.triton.source(run, x)[0]
    got = call(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want = reference(x)
    tiny = np.abs(want) < 2.0**-126
    if name == "silu":
        tiny |= _sigmoid64(x) < 2.0**-126
    normal = ~tiny & (np.abs(want) <= np.finfo(np.float32).max)
    assert _ulps(got[normal], want[normal]).max() <= bound
    assert (np.abs(got[tiny]) <= 2.0**-126 * np.maximum(1.0, np.abs(x[tiny]))).all()
    # The interpret backend (XLA's functions inside the kernel) and jax.nn / jnp themselves,
    # the public reference, on the same values: within XLA's own 6 ulps.
    interpreted = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                            backend="interpret")(x))
    for other in (interpreted, np.asarray(jax.jit(fn)(x))):
        assert _ulps(other[normal], want[normal]).max() <= 6.0
    assert np.isinf(got[want > np.finfo(np.float32).max]).all()
    edges = np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 88.7, 88.8, -87.3, 1e-30, -1e-30, 20.0, -20.0,
                       100.0, -100.0, 0.5, -0.5]], np.float32)
    np.testing.assert_allclose(call(edges), np.asarray(fn(edges)), rtol=4 * 2.0**-23, atol=0)


def test_erf_and_gelu_exact_accuracy_over_the_float32_range():
    """ops.activations' erf (x + x R(x^2), or 1 - exp2(Q(|x|))) and gelu_exact (relu(x) -
    a Phi(-a) with the exponent carried beyond float32 and Mills' ratio as a rational) on our
    Triton lowering, in Triton's interpreter, against float64 over sampled float32 values
    (random bit patterns, [-10, 10], and dense on [-13.2, 0], where x Phi(x) is a normal
    float down to -13.15): erf within 2 ulps everywhere, also with exp2 at the GPU's exp2f
    bound (2 ulps); gelu_exact within 4 ulps in the interpreter, which rounds every
    product (measured 3.6), and within 2.1 (measured 2.02) with products and sums contracted
    into fused multiply-adds as LLVM does on a GPU and rsqrt 2**-22.9 off either way (the
    function's own jaxpr run in float32 numpy, _float32_jaxpr_in_numpy); results below
    2**-126 within 2**-126; NaN, infinities and signed zeros as documented."""
    from scipy.special import erf as erf64, ndtr

    rng = np.random.default_rng(2)
    x = np.concatenate([_float32_samples(2**18, seed=2),
                        rng.uniform(-13.2, 0, 2**18).astype(np.float32)]).reshape(512, 1024)

    def run(fn, a):
        def kernel(x_ref, o_ref):
            o_ref[...] = fn(x_ref[...])
        return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float32),
                                         backend="triton")(a))

    xd = x.astype(np.float64)
    got = run(ops.activations.erf, x)
    assert _ulps(got, erf64(xd))[np.abs(xd) >= 2.0**-120].max() <= 2.0
    want = xd * ndtr(xd)
    normal = np.abs(want) >= 2.0**-126
    gelu_exact = ops.ACTIVATIONS["gelu_exact"]
    got = run(gelu_exact, x)
    assert _ulps(got[normal], want[normal]).max() <= 4.0
    assert np.abs(got - want)[~normal].max() <= 2.0**-126
    for error in (0.0, 2.0**-22.9, -(2.0**-22.9)):
        fused = _float32_jaxpr_in_numpy(gelu_exact, x, rsqrt_error=error)
        assert _ulps(fused[normal], want[normal]).max() <= 2.1, error
        assert np.abs(fused - want)[~normal].max() <= 2.0**-126
    edges = np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 13.2, -13.2, 20.0, -20.0, 3e38, -3e38]],
                     np.float32)
    for out in (run(gelu_exact, edges), _float32_jaxpr_in_numpy(gelu_exact, edges)):
        np.testing.assert_array_equal(out[0, :3], [0.0, 0.0, np.inf])
        assert not np.signbit(out[0, :2]).any()
        assert np.isnan(out[0, 4]) and (np.abs(out[0, [3, 6, 8, 10]]) <= 2.0**-126).all()
        np.testing.assert_array_equal(out[0, [5, 7, 9]], edges[0, [5, 7, 9]])
    # erf's formula in float32 numpy with exp2 correctly rounded, then 2 ulps off either
    # way (the GPU's exp2f bound): still within 2 ulps.
    act = ops.activations
    f32 = np.float32

    def horner(coefs, v):
        p = np.full_like(v, f32(coefs[-1]))
        for c in coefs[-2::-1]:
            p = (p * v + f32(c)).astype(f32)
        return p

    z = x.ravel()
    t = np.abs(z)
    with np.errstate(over="ignore"):  # z * z of huge z, in the branch not taken
        small = z + z * horner(act._ERF_SMALL, z * z)
    exact = np.exp2(horner(act._LOG_ERFC, np.minimum(t, f32(4))).astype(np.float64)).astype(f32)
    for off in (-2, 0, 2):
        big = f32(1) - (exact + f32(off) * np.spacing(exact))
        sim = np.where(t < 0.88, small, np.where(z < 0, -big, big))
        assert _ulps(sim, erf64(z.astype(np.float64)))[t >= 2.0**-120].max() <= 2.0


def _float32_jaxpr_in_numpy(fn, x, rsqrt_error=0.0):
    """``fn``'s jaxpr evaluated in float32 numpy as LLVM compiles it for a GPU: a product
    feeding an add or subtract is contracted into one fused multiply-add (of two products,
    the one with fewer uses, else the left one, as LLVM's DAG combiner chooses; checked
    against the PTX of ops.activations.gelu_exact), every other operation rounded once;
    rsqrt is ``1/sqrt`` times ``1 + rsqrt_error`` (rsqrt.approx.f32)."""
    import collections

    from jax.extend.core import Literal

    f32 = np.float32
    unary = {"abs": np.abs, "floor": np.floor, "neg": np.negative,
             "rsqrt": lambda v: (1.0 / np.sqrt(v.astype(np.float64)) * (1.0 + rsqrt_error)).astype(f32)}
    binary = {"min": np.minimum, "max": np.maximum, "and": np.bitwise_and, "mul": np.multiply,
              "add": np.add, "sub": np.subtract, "shift_left": np.left_shift, "lt": np.less}

    def evaluate(jaxpr, consts, args):
        env, products = {}, {}  # products: a mul's exact value, by output variable
        uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal))

        def fusable(v):
            return not isinstance(v, Literal) and v in products

        def read(v):
            return np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            name, ins = eqn.primitive.name, [read(v) for v in eqn.invars]
            sub = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
            if sub is not None:
                outs = evaluate(sub.jaxpr, sub.consts, ins)
            elif name in ("add", "sub") and ins[0].dtype == f32 and any(map(fusable, eqn.invars)):
                k = min((k for k in (0, 1) if fusable(eqn.invars[k])), key=lambda k: uses[eqn.invars[k]])
                terms = [i.astype(np.float64) for i in ins]
                terms[k] = products[eqn.invars[k]]
                outs = [(terms[0] + terms[1] if name == "add" else terms[0] - terms[1]).astype(f32)]
            elif name == "bitcast_convert_type":
                outs = [ins[0].view(eqn.params["new_dtype"])]
            elif name == "broadcast_in_dim":
                outs = [np.broadcast_to(ins[0], eqn.params["shape"])]
            elif name == "convert_element_type":
                outs = [ins[0].astype(eqn.params["new_dtype"])]
            elif name in unary:
                outs = [np.asarray(unary[name](ins[0])).astype(ins[0].dtype)]
            else:
                outs = [np.asarray(binary[name](*ins)).astype(eqn.outvars[0].aval.dtype)]
            if name == "mul" and outs[0].dtype == f32:
                products[eqn.outvars[0]] = ins[0].astype(np.float64) * ins[1].astype(np.float64)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(x.shape, jnp.float32))
    with np.errstate(all="ignore"):
        return evaluate(closed.jaxpr, closed.consts, [np.asarray(x, f32)])[0]


def _helper_in_numpy(name, exp2=None, division_error=0.0):
    """jit_helpers' ``_<name>`` run in float32 numpy, with ``tl.exp2`` replaced by ``exp2``
    and every quotient scaled by ``1 + division_error`` (the GPU's div.full.f32 is 2 ulps,
    rcp.approx.f32 1; a helper's PTX takes the interpreter's path, its division):
    the formula the kernel emits, every operation rounded once as on the GPU, plain products
    and sums unfused (``tl.fma`` fused)."""
    import re

    from pallas_core.triton import jit_helpers

    class tl:  # the few tl functions the helpers call, in numpy
        PropagateNan = type("PropagateNan", (), {"ALL": None})
        minimum = staticmethod(lambda a, b, propagate_nan=None: np.minimum(a, np.float32(b)))
        maximum = staticmethod(lambda a, b, propagate_nan=None: np.maximum(a, np.float32(b)))
        abs = staticmethod(np.abs)
        where = staticmethod(lambda c, a, b: np.where(c, a, b).astype(np.float32))
        fma = staticmethod(lambda a, b, c: (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32))

    tl.exp2 = staticmethod(exp2)
    namespace = {"tl": tl, "jit": lambda f: f, "np": np, jit_helpers.INTERPRETED: True,
                 "div": lambda a, b: (np.float32(a) / b * np.float32(1 + division_error)).astype(np.float32)}
    source = jit_helpers.math_source(name)
    source = source.replace(".to(tl.int32, bitcast=True)", ".view(np.int32)")
    source = source.replace(".to(tl.int32)", ".astype(np.int32)").replace(
        ".to(tl.float32, bitcast=True)", ".view(np.float32)")
    source = re.sub(r"(\d+\.\d+) / (\w+)", r"div(\1, \2)", source)
    exec(source, namespace)
    return namespace[f"_{name}"]


def test_exp_formula_with_an_exact_exp2():
    """The exp helper's formula with exp2 correctly rounded (numpy's float64 exp2 rounded to
    float32; Triton's interpreter's float32 exp2 is itself up to an ulp off): within 1 ulp
    of float64; with exp2 one ulp off either way at non-integers (powers of two exact),
    within 2. Sampled float32 values with normal results."""
    x = np.concatenate([_float32_samples(2**18, seed=3),
                        np.linspace(-88, 89, 2**18, dtype=np.float32)])

    def exp2(off):  # off ulps away at non-integers; powers of two exact
        def f(v):
            v = np.asarray(v)
            e = np.exp2(v.astype(np.float64)).astype(np.float32)
            return np.where(v == np.floor(v), e, e + np.float32(off) * np.spacing(e))
        return f

    with np.errstate(over="ignore", invalid="ignore"):
        want = np.exp(x.astype(np.float64))
        normal = (want >= 2.0**-126) & (want <= np.finfo(np.float32).max)
        exp = _helper_in_numpy("exp", exp2(0))
        assert _ulps(exp(x)[normal], want[normal]).max() <= 1.0
        for off in (-1, 1):
            got = _helper_in_numpy("exp", exp2(off))(x)
            assert _ulps(got[normal], want[normal]).max() <= 2.0


def test_sigmoid_formula_with_the_gpus_division():
    """The sigmoid helper's formula (no exp2: a polynomial exp carried in two parts, the sum
    1 + e and the quotient corrected), every operation rounded once and the quotient exact or
    2 ulps off either way (the GPU takes rcp.approx.f32, 1 ulp): within 0.8 ulps of float64
    on 2**20 sampled float32 values with normal results (dense on [-88, 17], where the result
    leaves [1/2, 1]), and x * sigmoid(x) (jax.nn.silu) within 2 (measured 1.5); 0 below
    x = -87.5 (subnormal results)."""
    rng = np.random.default_rng(4)
    x = np.concatenate([_float32_samples(2**19, seed=4), rng.uniform(-88, 17, 2**19).astype(np.float32)])
    want = _sigmoid64(x)
    normal = want >= 2.0**-126
    with np.errstate(over="ignore", invalid="ignore"):
        for error in (0.0, -(2.0**-22), 2.0**-22):
            got = _helper_in_numpy("sigmoid", division_error=error)(x)
            assert _ulps(got[normal], want[normal]).max() <= 0.8, error
            assert (got[~normal] <= 2.0**-126).all() and (got[x < -87.5] == 0).all()
            silu = x.astype(np.float64) * want  # jax.nn.silu: x * sigmoid(x), rounded once more
            keep = normal & (np.abs(silu) >= 2.0**-126)
            assert _ulps((x * got)[keep], silu[keep]).max() <= 2.0, error


def _gelu_tanh64(x):
    """jax.nn.gelu's tanh form in float64 with its constants in float64, evaluated as the
    equal ``x / (1 + exp(-2y))``: ``0.5 x (1 + tanh(y))`` cancels below x = -1 even in float64."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _softplus64(x):
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _on_triton(fn, a):
    """``fn`` of the float32 array ``a`` in a kernel on our Triton lowering (Triton's
    interpreter), and the generated source."""
    def kernel(x_ref, o_ref):
        o_ref[...] = fn(x_ref[...])

    call = lambda v: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(v.shape, jnp.float32),
                                    backend="triton")(v)
    return np.asarray(call(a)), pl.triton.source(call, a)[0]


def _assert_accurate(got, want, bound):
    """Within ``bound`` ulps where the float64 value is a normal float, within 2**-126 below."""
    normal = np.abs(want) >= 2.0**-126
    assert _ulps(got[normal], want[normal]).max() <= bound
    assert np.abs(got[~normal] - want[~normal]).max() <= 2.0**-126


@pytest.mark.parametrize("name, helper, reference, low", [
    ("gelu", "gelu_tanh", _gelu_tanh64, -10.2),  # normal results down to x = -10.1006
    ("softplus", "softplus", _softplus64, -90.0),  # normal results down to x = -87.3
])
def test_gelu_and_softplus_within_two_ulps_over_the_float32_range(name, helper, reference, low):
    """ops.ACTIVATIONS' gelu (jax.nn.gelu's tanh form, as x sigmoid(2y) with 2y carried as
    two floats) and softplus (relu(x) + 2 atanh(e / (2 + e)), e = exp(-|x|) carried as two
    floats) on our Triton lowering, jit_helpers' gelu_tanh and softplus: within 2 ulps of
    float64 on 2**18 float32 values (random bit patterns, and dense from where the results
    become normal floats to 1) whose result is a normal float, within 2**-126 below (measured
    1.34 and 1.03 in Triton's interpreter, which flushes subnormal operands: no intermediate
    may be subnormal where the result is not); the same formulas in float32 numpy with the
    GPU's rcp.approx 1 ulp off either way (1.34, 1.09). jax.nn.gelu lowered here has no
    correct digit below -3, jax.nn.softplus 4.4 ulps."""
    rng = np.random.default_rng(7)
    x = np.concatenate([_float32_samples(2**17, seed=7),
                        rng.uniform(low, 1.0, 2**17).astype(np.float32)]).reshape(512, 512)
    got, source = _on_triton(ops.ACTIVATIONS[name], x)
    assert f"_{helper}(" in source
    want = reference(x)
    _assert_accurate(got, want, 2.0)
    with np.errstate(over="ignore", invalid="ignore"):
        for error in (0.0, -(2.0**-23), 2.0**-23):
            _assert_accurate(_helper_in_numpy(helper, division_error=error)(x), want, 2.0)


def test_gelu_and_softplus_edges():
    """Signed zeros, infinities, NaN, huge |x|, the last normal results: as jax.nn.gelu /
    jax.nn.softplus in float64 where those are defined; gelu(-inf), NaN there (inf * 0), is
    the limit 0 within 2**-126; on our Triton lowering and on the portable path (XLA)."""
    x = np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 3e38, -3e38, 2.0**-125,
                   -(2.0**-125), -10.1, -10.2, 10.2, 88.0, -87.0, -88.0, 0.5, -0.5]], np.float32)
    for name, reference in (("gelu", _gelu_tanh64), ("softplus", _softplus64)):
        fn = ops.ACTIVATIONS[name]
        with np.errstate(invalid="ignore"):
            want = reference(x)
        for got in (_on_triton(fn, x)[0], np.asarray(jax.jit(fn)(x))):
            np.testing.assert_array_equal(np.isnan(got), np.isnan(x))
            finite = ~np.isnan(want)
            # (XLA flushes gelu(-10.1)'s subnormal sigmoid: 1.2e-38 is 2**-125 absolute)
            np.testing.assert_allclose(got[finite], want[finite], rtol=4 * 2.0**-23, atol=2.0**-125)
            if name == "gelu":
                np.testing.assert_array_equal(np.signbit(got[:, :2]), [[False, True]])
                assert abs(got[0, 3]) <= 2.0**-126 and got[0, 2] == np.inf


def test_gelu_and_softplus_derivatives_are_jax_nns():
    """The custom JVPs equal jax.grad(jax.nn.gelu) and jax.grad(jax.nn.softplus) (sigmoid)
    on random float32 inputs, and stay finite at +-inf (1 and 0, where jax.nn.gelu's is NaN)."""
    x = (np.random.default_rng(8).standard_normal(4096) * 4).astype(np.float32)
    xd = x.astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (xd + 0.044715 * xd**3)))
    exact = {"gelu": s + xd * s * (1.0 - s) * 2.0 * np.sqrt(2.0 / np.pi) * (1.0 + 3 * 0.044715 * xd**2),
             "softplus": 1.0 / (1.0 + np.exp(-xd))}
    for name, public in (("gelu", jax.nn.gelu), ("softplus", jax.nn.softplus)):
        grad = jax.jit(jax.vmap(jax.grad(ops.ACTIVATIONS[name])))
        # Both formulas cancel in 1 + tanh below x = -2: one float32 ulp of tanh next to -1
        # (6e-8) times x * (0.798 + 0.107 x^2) / 2 (up to ~140 at the clip, |x| = 11) is up
        # to 1e-5 absolute. Which side of the ulp XLA's tanh lands on depends on how LLVM
        # compiles it (tests/conftest.py turns its optimizations off on a CPU: 8.5e-6 seen,
        # 3.5e-6 with them); elsewhere the formulas agree to float32 rounding.
        np.testing.assert_allclose(grad(x), jax.vmap(jax.grad(public))(x), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(grad(x), exact[name], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(grad(np.array([np.inf, -np.inf], np.float32)), [1.0, 0.0])
    # bfloat16 in, bfloat16 out, computed in float32
    xb = jnp.asarray(x[:64], jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(ops.ACTIVATIONS["gelu"](xb), np.float32),
                               np.asarray(jax.nn.gelu(xb.astype(jnp.float32)).astype(jnp.bfloat16),
                                          np.float32), rtol=2**-7, atol=1e-3)


def test_gelu_and_softplus_take_jax_nns_arguments():
    """jax.nn.gelu's ``approximate`` (False: the erf form, ops.activations.gelu_exact) and
    integer inputs promoted to a float, as jax.nn does; a complex x is refused, naming x."""
    gelu, softplus = ops.ACTIVATIONS["gelu"], ops.ACTIVATIONS["softplus"]
    x = jnp.arange(-3, 4)
    for ours, public in ((gelu, jax.nn.gelu), (softplus, jax.nn.softplus),
                         (lambda v: gelu(v, approximate=False),
                          lambda v: jax.nn.gelu(v, approximate=False))):
        got, want = ours(x), public(x)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for fn in (gelu, softplus):
        with pytest.raises(TypeError, match="x must be a real array"):
            fn(jnp.ones(2, jnp.complex64))
