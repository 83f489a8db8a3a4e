"""pallas_call behaviour that code written for JAX's Pallas relies on: named grids,
the trace cache, kernel return values and JAX's error types for bad calls.
Each is checked against jax.experimental.pallas running the same call."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl

import pallas_core as pl

X = jax.random.normal(jax.random.key(3), (4, 20, 128))  # 20 rows: edge blocks of 8


@pytest.mark.parametrize("lib", [pl, jpl], ids=["pallas_core", "jax"])
def test_named_grid_sizes_in_the_kernel(lib):
    """Axis names bind in the kernel (lax.axis_size, lax.psum(1, name)); index maps
    still take the program ids positionally, in the grid's order."""
    seen = {}

    def kernel(x_ref, o_ref):
        seen.update(j=lax.axis_size("j"), i=lax.psum(1, "i"))
        o_ref[...] = x_ref[...] * 2

    out = lib.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype),
                          in_specs=[lib.BlockSpec((None, 8, 128), lambda a, b: (a, b, 0))],
                          out_specs=lib.BlockSpec((None, 8, 128), lambda a, b: (a, b, 0)),
                          grid=(("j", 4), ("i", 3)), interpret=True)(X)
    np.testing.assert_array_equal(out, X * 2)
    assert seen == {"j": 4, "i": 3}


def test_named_grid_bad_names():
    call = functools.partial(pl.pallas_call, lambda x, o: None, out_shape=X, interpret=True)
    with pytest.raises(ValueError, match=r"grid: name every axis"):
        call(grid=(("i", 2), 3))
    with pytest.raises(ValueError, match=r"grid: axis names must be distinct"):
        call(grid=(("i", 2), ("i", 3)))


@pytest.mark.parametrize("lib", [pl, jpl], ids=["pallas_core", "jax"])
def test_second_call_with_the_same_shapes_does_not_trace_again(lib):
    traces = []

    def add_one(x_ref, o_ref):
        traces.append(1)
        o_ref[...] = x_ref[...] + 1

    f = lib.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)
    x = jax.random.normal(jax.random.key(4), (8,))
    np.testing.assert_allclose(jax.jit(lambda v: f(f(v)))(x), x + 2, rtol=1e-6)
    assert len(traces) == 1
    f(x[:8] * 2)  # new values, same shape: still one trace
    assert len(traces) == 1
    f(jnp.zeros((8,), jnp.int32).astype(jnp.float32))
    assert len(traces) == 1


A = np.arange(256, dtype=np.int32)


def _bad_calls(lib):
    """(name, exception type, zero-argument thunk) for calls both libraries refuse."""
    spec = lambda *a: lib.BlockSpec(*a)
    two = lambda x_ref, o_ref: None

    def returns_value(x_ref, o_ref):
        return 0

    return [
        ("kernel arity", TypeError, lambda: lib.pallas_call(lambda x_ref: None, out_shape=A,
                                                            interpret=True)(A)),
        ("kernel returns", ValueError, lambda: lib.pallas_call(returns_value, out_shape=A,
                                                               interpret=True)(A)),
        ("in_specs not a sequence", ValueError, lambda: lib.pallas_call(
            two, out_shape=A, in_specs=spec((4,), lambda: 0), interpret=True)),
        ("in_specs structure", ValueError, lambda: lib.pallas_call(
            lambda x, y, o: None, out_shape=A, in_specs=[spec((4,), lambda: 0)] * 2,
            interpret=True)(A, dict(a=A))),
        ("out_specs structure", ValueError, lambda: lib.pallas_call(
            lambda x, o, p: None, out_shape=[A, A], out_specs=[spec((8,), lambda: 0)],
            interpret=True)(A)),
        ("block rank", ValueError, lambda: lib.pallas_call(
            two, out_shape=A, in_specs=[spec((1, 1), lambda: (0, 0))], interpret=True)(A)),
        ("index_map arity", TypeError, lambda: lib.pallas_call(
            two, out_shape=A, in_specs=[spec((4,), lambda i, j: 0)], interpret=True)(A)),
        ("index_map results", ValueError, lambda: lib.pallas_call(
            two, out_shape=A, in_specs=[spec((4,), lambda: (0, 0))], interpret=True)(A)),
        ("index_map float", ValueError, lambda: lib.pallas_call(
            two, out_shape=A, grid=(1,), in_specs=[spec((4,), lambda i: 5.0)], interpret=True)(A)),
        ("index_map vector", ValueError, lambda: lib.pallas_call(
            two, out_shape=A, grid=(1,), in_specs=[spec((4,), lambda i: jnp.arange(4))],
            interpret=True)(A)),
        ("alias input range", ValueError, lambda: lib.pallas_call(
            lambda x, y, o: None, out_shape=[A], input_output_aliases={2: 0}, interpret=True)(A, A)),
        ("alias output range", ValueError, lambda: lib.pallas_call(
            lambda x, y, o: None, out_shape=[A], input_output_aliases={1: 1}, interpret=True)(A, A)),
        ("alias dtype", ValueError, lambda: lib.pallas_call(
            lambda x, y, o: None, out_shape=[jax.ShapeDtypeStruct(A.shape, jnp.float32)],
            input_output_aliases={1: 0}, interpret=True)(A, A)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls(pl))),
                         ids=[name for name, _, _ in _bad_calls(pl)])
def test_bad_calls_raise_what_jax_raises(case):
    name, kind, ours = _bad_calls(pl)[case]
    _, jax_kind, theirs = _bad_calls(jpl)[case]
    assert kind is jax_kind, name
    with pytest.raises(kind) as jax_error:
        theirs()
    with pytest.raises(kind) as our_error:
        ours()
    assert jax_error.type is kind and our_error.type is kind, name


def test_bad_call_messages_name_the_operand_and_the_function():
    def my_index_map():
        return 0, 0

    with pytest.raises(ValueError, match=r"in_specs\[0\]: Index map function my_index_map at "
                                         r".*test_pallas_call_api.py:\d+ for args\[0\]\['one'\] "
                                         r"must return 1 values.*Currently returning 2"):
        pl.pallas_call(lambda x, o: None, out_shape=A,
                       in_specs=[dict(one=pl.BlockSpec((4,), my_index_map),
                                      two=pl.BlockSpec((8,), my_index_map))],
                       interpret=True)(dict(one=A, two=A))
    with pytest.raises(TypeError, match=r"missing 2 required positional arguments: 'i' and 'j'"):
        pl.pallas_call(lambda x, o: None, out_shape=A,
                       in_specs=[pl.BlockSpec((4,), lambda i, j: 0)], interpret=True)(A)
    with pytest.raises(ValueError, match=r"(?s)at \[1\], `in_specs` is a pytree leaf but `inputs` "
                                         r"is a .*dict"):
        pl.pallas_call(lambda x, y, o: None, out_shape=A,
                       in_specs=[pl.BlockSpec((4,), lambda: 0)] * 2, interpret=True)(A, dict(a=A))
    with pytest.raises(ValueError, match=r"'1:0' referring to input\[1\] with abstract value "
                                         r"int32\[512\].*output\[0\].*int32\[256\]"):
        pl.pallas_call(lambda x, y, o: None, out_shape=[A], input_output_aliases={1: 0},
                       interpret=True)(A, np.concatenate([A, A]))
    with pytest.raises(ValueError, match=r"kernel function .*returns_tuple at .* should return None"):
        def returns_tuple(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            return ()
        pl.pallas_call(returns_tuple, out_shape=A, interpret=True)(A)
