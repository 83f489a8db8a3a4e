"""Grids and BlockSpecs (docs/pallas_core.md sections 2-4): the ``show_program_ids`` examples
of the Pallas grid and BlockSpec documentation, their printed arrays matched exactly, on the
interpreter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl


def show_program_ids(x_shape, block_shape, grid, index_map=lambda i, j: (i, j),
                     indexing_mode=pl.Blocked()):
    def program_ids_kernel(o_ref):
        axes = 0
        for axis in range(len(grid)):
            axes += pl.program_id(axis) * 10 ** (len(grid) - 1 - axis)
        o_ref[...] = jnp.full(o_ref.shape, axes)

    return np.asarray(pl.pallas_call(
        program_ids_kernel,
        out_shape=jax.ShapeDtypeStruct(x_shape, dtype=np.int32),
        grid=grid, in_specs=[],
        out_specs=pl.BlockSpec(block_shape, index_map, indexing_mode=indexing_mode),
        interpret=True)())


def parse(text):
    return np.array([[int(v) for v in row.strip(" []").split()] for row in text.strip().splitlines()])


CASES = {
    "blocked_8x6": (dict(x_shape=(8, 6), block_shape=(2, 3), grid=(4, 2)), """
        [[ 0 0 0 1 1 1]
         [ 0 0 0 1 1 1]
         [10 10 10 11 11 11]
         [10 10 10 11 11 11]
         [20 20 20 21 21 21]
         [20 20 20 21 21 21]
         [30 30 30 31 31 31]
         [30 30 30 31 31 31]]"""),
    "out_of_bounds_7x5": (dict(x_shape=(7, 5), block_shape=(2, 3), grid=(4, 2)), """
        [[ 0 0 0 1 1]
         [ 0 0 0 1 1]
         [10 10 10 11 11]
         [10 10 10 11 11]
         [20 20 20 21 21]
         [20 20 20 21 21]
         [30 30 30 31 31]]"""),
    "array_smaller_than_block": (dict(x_shape=(1, 2), block_shape=(2, 3), grid=(1, 1)), "[[0 0]]"),
    "revisited_3d_grid": (dict(x_shape=(8, 6), block_shape=(2, 3), grid=(4, 2, 10),
                               index_map=lambda i, j, k: (i, j)), """
        [[ 9 9 9 19 19 19]
         [ 9 9 9 19 19 19]
         [109 109 109 119 119 119]
         [109 109 109 119 119 119]
         [209 209 209 219 219 219]
         [209 209 209 219 219 219]
         [309 309 309 319 319 319]
         [309 309 309 319 319 319]]"""),
    "block_shape_none": (dict(x_shape=(4, 4), block_shape=None, grid=(2, 3), index_map=None), """
        [[12 12 12 12]
         [12 12 12 12]
         [12 12 12 12]
         [12 12 12 12]]"""),
    "index_map_none": (dict(x_shape=(4, 4), block_shape=(4, 4), grid=(2, 3), index_map=None), """
        [[12 12 12 12]
         [12 12 12 12]
         [12 12 12 12]
         [12 12 12 12]]"""),
    "unblocked": (dict(x_shape=(8, 6), block_shape=(2, 3), grid=(4, 2),
                       index_map=lambda i, j: (2 * i, 3 * j), indexing_mode=pl.Unblocked()), """
        [[ 0 0 0 1 1 1]
         [ 0 0 0 1 1 1]
         [10 10 10 11 11 11]
         [10 10 10 11 11 11]
         [20 20 20 21 21 21]
         [20 20 20 21 21 21]
         [30 30 30 31 31 31]
         [30 30 30 31 31 31]]"""),
    "unblocked_padded": (dict(x_shape=(7, 7), block_shape=(2, 3), grid=(4, 3),
                              index_map=lambda i, j: (2 * i, 3 * j),
                              indexing_mode=pl.Unblocked(((1, 0), (2, 0)))), """
        [[ 0 1 1 1 2 2 2]
         [10 11 11 11 12 12 12]
         [10 11 11 11 12 12 12]
         [20 21 21 21 22 22 22]
         [20 21 21 21 22 22 22]
         [30 31 31 31 32 32 32]
         [30 31 31 31 32 32 32]]"""),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_show_program_ids(name):
    kwargs, expected = CASES[name]
    np.testing.assert_array_equal(show_program_ids(**kwargs), parse(expected))


def test_squeezed_block_dim():
    def kernel(o_ref):
        assert o_ref.shape == (2,)
        o_ref[...] = jnp.full((2,), 10 * pl.program_id(1) + pl.program_id(0))

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((3, 4), dtype=np.int32),
                         out_specs=pl.BlockSpec((None, 2), lambda i, j: (i, j)),
                         grid=(3, 2), interpret=True)()
    np.testing.assert_array_equal(out, [[0, 0, 10, 10], [1, 1, 11, 11], [2, 2, 12, 12]])
    assert out.dtype == jnp.int32


def test_slices_for_invocation_edge_block_reads_padding():
    """An edge block reads its in-bounds part; the rest is padding (NaN here)."""
    x = jax.random.normal(jax.random.key(0), (100, 90))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    blocks = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((10 * 10, 5 * 20), x.dtype), grid=(10, 5),
        in_specs=[pl.BlockSpec((10, 20), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((10, 20), lambda i, j: (i, j)), interpret=True)(x)
    np.testing.assert_array_equal(blocks[:, :90], x)
    assert np.isnan(np.asarray(blocks[:, 90:])).all()


def test_works_under_jit_and_vmap():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + pl.program_id(0)

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(3,),
                              in_specs=[pl.BlockSpec((4,), lambda i: i)],
                              out_specs=pl.BlockSpec((4,), lambda i: i), interpret=True)(x)

    x = jax.random.normal(jax.random.key(1), (5, 10))
    expected = x * 2 + jnp.repeat(jnp.arange(3.0), 4)[:10]
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(x), expected, rtol=1e-6)
