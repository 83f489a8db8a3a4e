"""Forward-mode autodiff of a raw pallas_call (pallas_core.autodiff): the JVP kernel
against jax.experimental.pallas running the same kernel and against jax.jvp of
an XLA reference, and the reverse-mode refusal."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import test_util as jtu
from jax.experimental import pallas as jpl

import pallas_core as pl
from tests.tolerances import BACKWARD, FORWARD, assert_close

KEYS = jax.random.split(jax.random.key(16), 6)
# 20 x 200 does not divide the 8 x 128 blocks: edge blocks in both dims.
X = jax.random.normal(KEYS[0], (20, 200))
T = jax.random.normal(KEYS[1], (20, 200))


def tanh_times_exp_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jnp.tanh(x) * jnp.exp(-x * x)


def blocked(lib, backend=None, shape=X.shape):
    extra = {"interpret": True} if backend is None else {"backend": backend}
    return lib.pallas_call(tanh_times_exp_kernel, out_shape=jax.ShapeDtypeStruct(shape, X.dtype),
                           grid=(pl.cdiv(shape[0], 8), pl.cdiv(shape[1], 128)),
                           in_specs=[lib.BlockSpec((8, 128), lambda i, j: (i, j))],
                           out_specs=lib.BlockSpec((8, 128), lambda i, j: (i, j)), **extra)


def reference(x):
    return jnp.tanh(x) * jnp.exp(-x * x)


def test_jvp_matches_jax_pallas_and_xla():
    ours = jax.jvp(blocked(pl, "interpret"), (X,), (T,))
    theirs = jax.jvp(blocked(jpl), (X,), (T,))
    want = jax.jvp(reference, (X,), (T,))
    for got, jax_pallas, xla, tol, what in zip(ours, theirs, want, (FORWARD, BACKWARD),
                                               ("primal", "tangent")):
        assert_close(got, xla, tol[jnp.float32], what)
        assert_close(got, jax_pallas, tol[jnp.float32], what + " vs jax.experimental.pallas")


def test_jvp_kernel_on_our_triton_lowering():
    """The JVP kernel is an ordinary kernel: our Triton lowering runs it (in Triton's
    CPU interpreter here), edge blocks masked as for any kernel."""
    x, t = X[:10, :130], T[:10, :130]
    got = jax.jvp(blocked(pl, "triton", shape=x.shape), (x,), (t,))
    want = jax.jvp(reference, (x,), (t,))
    assert_close(got[0], want[0], FORWARD[jnp.float32], "primal")
    assert_close(got[1], want[1], BACKWARD[jnp.float32], "tangent")


def test_second_order_forward_mode():
    """The JVP of the JVP kernel, against jax.jvp of jax.jvp of the reference."""
    x, t = X[:10, :130], T[:10, :130]  # two blocks by two, edge blocks in both dims
    second = lambda g: jax.jvp(lambda v: jax.jvp(g, (v,), (t,))[1], (x,), (t,))[1]
    assert_close(second(blocked(pl, shape=x.shape)), second(reference), BACKWARD[jnp.float32],
                 "second-order tangent")


@pytest.mark.slow
def test_forward_mode_against_finite_differences():
    x = X[:10, :130]
    jtu.check_grads(blocked(pl, shape=x.shape), (x,), modes=["fwd"], order=2, atol=2e-2, rtol=2e-2)


def accumulate_kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.sin(x_ref[...]) * x_ref[...]

    @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...]


def test_jvp_through_scratch_accumulation_under_jit_and_vmap():
    """A row reduction over an arbitrary grid axis, accumulated in scratch: the
    tangent scratch carries the tangent sum. vmap of the JVP adds a batch axis."""
    x = X[:, :192]

    def row_sums(v):
        return pl.pallas_call(accumulate_kernel, out_shape=jax.ShapeDtypeStruct((20, 64), v.dtype),
                              grid=(3, 3), in_specs=[pl.BlockSpec((8, 64), lambda i, k: (i, k))],
                              out_specs=pl.BlockSpec((8, 64), lambda i, k: (i, 0)),
                              scratch_shapes=[pl.tpu.VMEM((8, 64), jnp.float32)], interpret=True)(v)

    ref = lambda v: (jnp.sin(v) * v).reshape(20, 3, 64).sum(1)
    xs, ts = jnp.stack([x, -x]), jnp.stack([T[:, :192], 2 * T[:, :192]])
    got = jax.jit(jax.vmap(lambda a, b: jax.jvp(row_sums, (a,), (b,))))(xs, ts)
    want = jax.vmap(lambda a, b: jax.jvp(ref, (a,), (b,)))(xs, ts)
    assert_close(got[0], want[0], BACKWARD[jnp.float32], "primal")
    assert_close(got[1], want[1], BACKWARD[jnp.float32], "tangent")


def test_integer_operands_and_outputs_and_zero_tangents():
    """Integer inputs have no tangent; an integer output gets a float0 tangent; an
    input whose tangent is a symbolic zero adds no tangent operand."""
    def kernel(x_ref, n_ref, w_ref, o_ref, c_ref):
        o_ref[...] = x_ref[...] * n_ref[...].astype(jnp.float32) + w_ref[...] ** 2
        c_ref[...] = n_ref[...] + 1

    n = jax.random.randint(KEYS[2], X.shape, -3, 4)
    w = jax.random.normal(KEYS[3], X.shape)
    f = pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(X.shape, X.dtype),
                                          jax.ShapeDtypeStruct(X.shape, n.dtype)), interpret=True)
    (out, count), (t_out, t_count) = jax.jvp(lambda x: f(x, n, w), (X,), (T,))
    assert_close(t_out, T * n, FORWARD[jnp.float32], "tangent")
    np.testing.assert_array_equal(count, n + 1)
    assert t_count.dtype == jax.dtypes.float0 and t_count.shape == X.shape
    _, t_w = jax.jvp(lambda v: f(X, n, v)[0], (w,), (T,))
    assert_close(t_w, 2 * w * T, FORWARD[jnp.float32], "tangent of w")


def test_jvp_with_input_output_aliases():
    """The aliased output starts as the input; its tangent starts as the input's tangent."""
    def kernel(x_ref, y_ref, o_ref):
        o_ref[:8] = o_ref[:8] * jnp.cos(y_ref[:8])

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                       input_output_aliases={0: 0}, interpret=True)
    ref = lambda x, y: x.at[:8].multiply(jnp.cos(y[:8]))
    y, ty = jax.random.normal(KEYS[4], X.shape), jax.random.normal(KEYS[5], X.shape)
    got = jax.jvp(f, (X, y), (T, ty))
    want = jax.jvp(ref, (X, y), (T, ty))
    assert_close(got[1], want[1], FORWARD[jnp.float32], "tangent")
    got = jax.jvp(lambda v: f(X, v), (y,), (ty,))  # the aliased input's tangent is zero
    want = jax.jvp(lambda v: ref(X, v), (y,), (ty,))
    assert_close(got[1], want[1], FORWARD[jnp.float32], "tangent, aliased input constant")


@pytest.mark.parametrize("transform", [jax.grad, lambda f: (lambda x: jax.vjp(f, x))])
def test_reverse_mode_points_to_custom_vjp(transform):
    f = blocked(pl)
    with pytest.raises(TypeError, match=r"not differentiable in reverse mode.*jax\.custom_vjp"):
        transform(lambda x: f(x).sum())(X)
