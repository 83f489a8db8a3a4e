"""Edge masks for JAX's Pallas Triton lowering, checked on the interpreter.

On pallas_triton, Refs of operands whose blocks overhang the array are
MaskedRefs (its lowering has no bounds checks). Here the same wrapping runs
under the interpreter, whose padding is NaN: masked reads of the overhang
give 0 and masked writes there are dropped, so block sums stay finite.
"""
import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl
from pallas_core.backends import edge_masks
from pallas_core.specs import resolve_block_mapping

X = jax.random.normal(jax.random.key(0), (13, 30))
SPEC = pl.BlockSpec((8, 16), lambda i, j: (i, j))
OUT_SPEC = pl.BlockSpec((None, None, 8, 16), lambda i, j: (i, j, 0, 0))


def block_sums(x, masked: bool):
    maps = [resolve_block_mapping(SPEC, "in_specs[0]", x.shape, x.dtype, 2)]

    def kernel(x_ref, o_ref):
        if masked:
            (x_ref,) = edge_masks.wrap([x_ref], maps, 2, program_id=pl.program_id)
        tile = x_ref[...]
        view = x_ref.at[4:8][:, pl.ds(8, 8)]  # a view reaching past both edges
        o_ref[...] = jnp.full((8, 16), jnp.sum(tile) + jnp.sum(view[...]))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2, 2, 8, 16), x.dtype), grid=(2, 2),
                         in_specs=[SPEC], out_specs=OUT_SPEC, interpret=True)(x)
    return np.asarray(out[:, :, 0, 0])


def test_masked_reads_of_the_overhang_give_zero():
    padded = np.zeros((16, 32), np.float32)
    padded[:13, :30] = np.asarray(X)
    blocks = padded.reshape(2, 8, 2, 16).transpose(0, 2, 1, 3)
    expected = blocks.sum((2, 3)) + blocks[:, :, 4:8, 8:16].sum((2, 3))
    np.testing.assert_allclose(block_sums(X, masked=True), expected, rtol=1e-5, atol=1e-5)
    assert np.isnan(block_sums(X, masked=False)[1]).all()  # unmasked: the overhang is garbage


def test_masked_writes_past_the_end_are_dropped():
    maps = [resolve_block_mapping(SPEC, "out_specs[0]", X.shape, X.dtype, 2)]

    def kernel(x_ref, o_ref):
        (o_ref,) = edge_masks.wrap([o_ref], maps, 2, program_id=pl.program_id)
        o_ref[...] = x_ref[...] * 2
        o_ref[0:1, :] = jnp.full((1, 16), 7.0)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype), grid=(2, 2),
                         in_specs=[SPEC], out_specs=SPEC, interpret=True)(X)
    expected = np.asarray(X) * 2
    expected[[0, 8], :] = 7.0
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_only_overhanging_operands_are_wrapped():
    dividing = resolve_block_mapping(pl.BlockSpec((8, 16), lambda i: (i, 0)), "x", (16, 16), jnp.float32, 1)
    assert not edge_masks.needs_masks(dividing)
    assert edge_masks.needs_masks(resolve_block_mapping(SPEC, "x", (13, 30), jnp.float32, 2))
