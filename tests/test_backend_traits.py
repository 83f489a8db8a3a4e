"""Backend traits (pallas_core.traits): each backend declares them when it registers,
and each declared constraint is the one its lowering enforces."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from ops._op import Device
from pallas_core import registry
from pallas_core.backends import JAX_PALLAS_BACKENDS
from pallas_core.traits import LOOP


def test_every_backend_declares_its_traits():
    for name in pl.BACKENDS:
        traits = pl.backend_traits(name)
        assert isinstance(traits, pl.BackendTraits) and traits.name == name
        assert traits.triton == (name in pl.TRITON_BACKENDS)
        assert traits.through_jax == (name in JAX_PALLAS_BACKENDS)
        assert traits.walk == LOOP or traits.sequential_grid
    assert Device("mosaic_tpu").traits == pl.backend_traits("mosaic_tpu")
    assert Device("mosaic_tpu").traits.scalar_memory == pl.tpu.SMEM
    assert pl.backend_traits("interpret").interpreted
    assert not any(pl.backend_traits(b).interpreted for b in pl.BACKENDS if b != "interpret")


def test_unknown_backend_and_bad_traits_are_refused():
    with pytest.raises(ValueError, match="backend: unknown backend 'cuda'"):
        pl.backend_traits("cuda")
    with pytest.raises(NotImplementedError, match="no runner registered"):
        registry.traits("not_a_backend")
    with pytest.raises(ValueError, match="traits: expected BackendTraits"):
        registry.register_backend("x", lambda call, args: None, traits=pl.backend_traits("triton"))
    for bad, match in [(dict(hardware="cpu"), "hardware"), (dict(walk="scan"), "walk"),
                       (dict(tile=(8,)), "tile"), (dict(min_dot=0), "min_dot"),
                       (dict(sequential_grid=False), "runs grid points concurrently")]:
        with pytest.raises(ValueError, match=match):
            pl.BackendTraits("x", **{"hardware": "gpu", **bad})


def test_fits_tile():
    tpu, gpu = pl.backend_traits("mosaic_tpu"), pl.backend_traits("triton")
    assert tpu.fits_tile(256, 1000) and tpu.fits_tile(1000, 1000) and not tpu.fits_tile(100, 1000)
    assert tpu.fits_tile(16, 100, axis=-2) and not tpu.fits_tile(12, 100, axis=-2)
    assert gpu.fits_tile(100, 1000) and gpu.fits_tile(3, 5, axis=-2)


def _copy(block, shape, backend, grid=None):
    """A pallas_call copying ``shape`` in ``block`` blocks on ``backend``, traced only."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    grid = grid or tuple(pl.cdiv(s, b) for s, b in zip(shape, block))
    index = lambda *ij: ij[:len(shape)]  # noqa: E731
    call = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                          out_shape=x, grid=grid, in_specs=[pl.BlockSpec(block, index)],
                          out_specs=pl.BlockSpec(block, index), backend=backend,
                          interpret=False)
    return jax.eval_shape(call, x)


@pytest.mark.parametrize("backend", ["triton", "pallas_triton", "mosaic_tpu"])
def test_declared_block_rules_are_the_lowerings(backend):
    """power_of_two_blocks and tile say which blocks pallas_call refuses on ``backend``."""
    traits = pl.backend_traits(backend)
    odd = (24, 128)  # not a power of two; a multiple of 8 and 128
    if traits.power_of_two_blocks:
        with pytest.raises(ValueError, match="power of two"):
            _copy(odd, (48, 256), backend)
    else:
        _copy(odd, (48, 256), backend)
    small = (traits.tile[0] // 2 or 1, 128)
    if traits.tile != (1, 1):
        assert not traits.fits_tile(small[0], 48, axis=-2)
        with pytest.raises(ValueError, match=f"divisible by {traits.tile[0]} and {traits.tile[1]}"):
            _copy(small, (48, 256), backend)
    else:
        _copy((4, 128), (48, 256), backend)


@pytest.mark.parametrize("backend", ["interpret", "triton", "pallas_triton", "mosaic_tpu"])
def test_declared_grid_order_is_the_lowerings(backend):
    """sequential_grid says whether an output block may be revisited along a grid axis."""
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32)

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[...] += x_ref[...]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(1, 2),
                          in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
                          out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)), backend=backend,
                          interpret=False)
    if pl.backend_traits(backend).sequential_grid:
        jax.eval_shape(call, x)
    else:
        with pytest.raises(ValueError, match="concurrently"):
            jax.eval_shape(call, x)



@pytest.mark.parametrize("backend", ["interpret", "triton", "pallas_triton", "mosaic_gpu", "mosaic_tpu"])
def test_declared_dynamic_grid_and_scalar_prefetch_are_what_pallas_call_takes(backend):
    """dynamic_grid: a grid dim computed under jit traces (or is refused naming the backends
    that take one); scalar_prefetch: a PrefetchScalarGridSpec traces (or is refused likewise)."""
    traits = pl.backend_traits(backend)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    count = jax.ShapeDtypeStruct((), jnp.int32)

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def traced_grid(x, count):
        return pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              grid=(jnp.minimum(count, 8),),
                              in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                              backend=backend, interpret=False)(x)

    def prefetched(x, count):
        spec = pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, c: (c[0] % 8, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, c: (0, 0)))
        return pl.pallas_call(lambda c_ref, x_ref, o_ref: copy(x_ref, o_ref), grid_spec=spec,
                              out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              backend=backend, interpret=False)(count.reshape(1), x)

    prefetch_refusal = r"scalar prefetch is implemented on \('interpret', 'triton', 'mosaic_tpu'\)"
    for fn, declared, refusal in ((traced_grid, traits.dynamic_grid, r"computed under jit.*interpret, mosaic_tpu"),
                                  (prefetched, traits.scalar_prefetch, prefetch_refusal)):
        if declared:
            assert jax.eval_shape(fn, x, count).shape == (8, 128)
        else:
            with pytest.raises(NotImplementedError, match=refusal):
                jax.eval_shape(fn, x, count)


def test_declared_min_dot_is_the_triton_lowerings():
    """triton's min_dot (16): our lowering refuses a smaller product, takes 16."""
    def dot_call(n):
        a = np.ones((n, n), np.float32)
        call = pl.pallas_call(lambda a_ref, o_ref: o_ref.__setitem__(..., pl.dot(a_ref[...], a_ref[...])),
                              out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32), backend="triton",
                              interpret=False)
        return pl.triton.source(call, a)

    n = pl.backend_traits("triton").min_dot
    assert dot_call(n)
    with pytest.raises(Exception, match="tl.dot's minimum"):
        dot_call(n // 2)


def _jax_lowers(block, backend, body=None):
    """Whether JAX's own Pallas lowering (not ours: no pallas_core check runs) takes a
    ``block`` copy of a [48, 256] array for ``backend``'s platform, lowered from this host."""
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as pltpu, triton as pltriton
    params, platform = {"mosaic_tpu": (pltpu.CompilerParams(), "tpu"),
                        "pallas_triton": (pltriton.CompilerParams(), "cuda")}[backend]
    x = jax.ShapeDtypeStruct((48, 256), jnp.float32)
    grid = tuple(pl.cdiv(s, b) for s, b in zip(x.shape, block))
    call = jpl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1), out_shape=x,
                           grid=grid, in_specs=[jpl.BlockSpec(block, lambda i, j: (i, j))],
                           out_specs=jpl.BlockSpec(block, lambda i, j: (i, j)), compiler_params=params)
    try:
        jax.jit(call).trace(x).lower(lowering_platforms=(platform,))
    except ValueError:
        return False
    return True


def test_declared_block_rules_match_jaxs_own_lowerings():
    """mosaic_tpu's tile and pallas_triton's power_of_two_blocks are what JAX's Mosaic
    TPU and Triton lowerings themselves require (our checks bypassed)."""
    sub, lanes = pl.backend_traits("mosaic_tpu").tile
    assert _jax_lowers((sub, lanes), "mosaic_tpu") and _jax_lowers((3 * sub, lanes), "mosaic_tpu")
    assert not _jax_lowers((sub // 2, lanes), "mosaic_tpu")
    assert not _jax_lowers((sub, lanes // 2), "mosaic_tpu")
    assert pl.backend_traits("pallas_triton").power_of_two_blocks
    assert _jax_lowers((16, 128), "pallas_triton") and not _jax_lowers((24, 128), "pallas_triton")
