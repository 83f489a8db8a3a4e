"""Epilogue subtiles of the tiled-matmul core (``MatmulConfig.epilogue_subtile``):
results equal the XLA reference on the interpreters with the epilogue run in
pieces, the pieces reach the generated Triton source, the config field is
checked, tuned and cached, and the 128 x 256 candidates' kernels fit sm_90."""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from ops import _op, tuning
from ops.matmul import tiled
from ops.matmul.config import MatmulConfig
from tests.tolerances import BACKWARD, FORWARD, assert_close

fm = importlib.import_module("ops.matmul.fused_matmul")  # the module (the package exports the op)

RNG = np.random.default_rng(22)
# 50 rows, K = 40, N = 90: no tile below divides them (edge tiles in every dim).
X = RNG.standard_normal((50, 40)).astype(np.float32)
W = (RNG.standard_normal((40, 90)) / np.sqrt(40)).astype(np.float32)
B = RNG.standard_normal((90,)).astype(np.float32)


def _backends():
    out = ["interpret"]
    try:
        import triton  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return out
    return out + ["triton"]


def _loss(fn):
    return lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b)))


@pytest.mark.parametrize("backend, parts", [("interpret", 2)] + [("triton", 2), ("triton", 4)]
                         * ("triton" in _backends()))
def test_subtiled_forward_and_gradients_match_the_reference(backend, parts):
    """bias + gelu in pieces; the gradients go through the forward that also writes
    the pre-activation residual, then the dx / dw products (subtiled too)."""
    config = MatmulConfig(32, 64, 32, epilogue_subtile=parts)
    act = jax.nn.gelu
    run = lambda x, w, b: ops.fused_matmul(x, w, b, activation="gelu", implementation=backend,
                                           block_sizes=config)
    assert_close(run(X, W, B), fm.reference(X, W, B, act), FORWARD[jnp.float32])
    grads = jax.grad(_loss(run), (0, 1, 2))(X, W, B)
    want = jax.grad(_loss(lambda x, w, b: fm.reference(x, w, b, act)), (0, 1, 2))(X, W, B)
    for g, e in zip(grads, want):
        assert_close(g, e, BACKWARD[jnp.float32])


def test_subtiles_reach_the_triton_source_and_off_leaves_it_alone():
    pytest.importorskip("triton")
    sds = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in (X, W, B)]

    def source(parts):
        config = MatmulConfig(32, 64, 32, epilogue_subtile=parts)
        return pl.triton.source(lambda x, w, b: ops.fused_matmul(
            x, w, b, activation="gelu", implementation="triton", block_sizes=config), *sds)[0]

    whole, halves, quarters = source(None), source(2), source(4)
    assert source(1) == whole and "tl.split" not in whole
    assert halves.count("tl.split") == 1 and quarters.count("tl.split") == 3


def test_subtiled_epilogue_sees_narrowed_refs_and_its_column_offset():
    """matmul_call's epilogue per piece: the COLS operand and the outputs narrowed to
    the piece, the ROWS operand whole, col_offset the piece's first column."""
    m, n, k, blocks = 40, 56, 24, (16, 32, 16)
    a, b = X[:m, :k], W[:k, :n]
    scale = RNG.standard_normal((m, 1)).astype(np.float32)
    offsets = []

    def epilogue(acc, refs):
        bias_ref, scale_ref = refs.extras
        out_ref, col_ref = refs.outs
        offsets.append(refs.col_offset)
        out_ref[...] = (acc + bias_ref[...]) * scale_ref[...]
        j = pl.program_id(1)
        col_ref[...] = (j * blocks[1] + refs.col_offset
                        + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1))

    for parts in (2, 4):
        offsets.clear()
        out, cols = tiled.matmul_call(
            a, b, ca=1, cb=0, blocks=blocks, backend="interpret",
            out_shape=[jax.ShapeDtypeStruct((m, n), jnp.float32),
                       jax.ShapeDtypeStruct((m, n), jnp.int32)],
            epilogue=epilogue, extras=[(B[None, :n], tiled.COLS), (scale, tiled.ROWS)],
            epilogue_subtile=parts)
        assert sorted(set(offsets)) == list(range(0, blocks[1], blocks[1] // parts))
        np.testing.assert_allclose(out, (a @ b + B[:n]) * scale, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(cols, np.broadcast_to(np.arange(n), (m, n)))


def test_subtile_parts_falls_back_to_whole_tiles_where_pieces_do_not_fit():
    assert tiled.subtile_parts(None, 256, "triton") == 1
    assert tiled.subtile_parts(2, 256, "triton") == 2
    assert tiled.subtile_parts(4, 256, "pallas_triton") == 4
    assert tiled.subtile_parts(2, 96, "triton") == 1  # a padded (non-power-of-two) tile
    assert tiled.subtile_parts(4, 6, "interpret") == 1  # does not divide
    assert tiled.subtile_parts(2, 512, "mosaic_tpu") == 2
    assert tiled.subtile_parts(2, 128, "mosaic_tpu") == 1  # 64-lane pieces


def test_config_field_checked_hashed_tuned_and_cached():
    config = MatmulConfig(128, 256, 64, 8, 3, 8, epilogue_subtile=2)
    assert hash(config) != hash(dataclasses.replace(config, epilogue_subtile=4))
    assert config.tuned()["epilogue_subtile"] == 2
    assert "epilogue_subtile" not in MatmulConfig(128, 128, 64).tuned()
    assert tuning.CACHE_VERSION == 2  # a new optional field: old entries keep their meaning
    entry = tuning.make_entry("fused_matmul", "interpret", jax.devices()[0].device_kind,
                              "float32", (50, 90, 40), config.tuned())
    with tuning.override([entry]):
        tiles = fm.select_tiles(50, 90, 40, jnp.float32, "interpret")
        assert (tiles.blocks, tiles.epilogue_subtile) == ((128, 256, 64), 2)
        assert_close(ops.fused_matmul(X, W, B, activation="relu", implementation="interpret"),
                     fm.reference(X, W, B, jax.nn.relu), FORWARD[jnp.float32], "cached subtile")
    for bad in (3, 8, 0, True):
        with pytest.raises(ValueError, match="block_sizes.epilogue_subtile"):
            ops.fused_matmul(X, W, implementation="interpret",
                             block_sizes=MatmulConfig(32, 64, 32, epilogue_subtile=bad))
    with pytest.raises(ValueError, match="dividing block_n = 2"):
        MatmulConfig(32, 2, 32, epilogue_subtile=4).check("fused_matmul")


def test_candidates_have_subtiled_128x256_tiles():
    problem = _op.get("fused_matmul").problem((8192,) * 3, "bfloat16")
    found = {(c.blocks, c.num_stages, c.epilogue_subtile)
             for c in MatmulConfig.candidates(problem, _op.Device("triton"))}
    assert {((128, 256, 64), 3, 2), ((128, 256, 64), 4, 2), ((128, 256, 64), 3, 4),
            ((64, 256, 64), 4, 4)} <= found
    # Whole, these spill in the training forward (bias + gelu, the pre-activation stored).
    assert not {((128, 256, 64), 3, None), ((64, 256, 64), 4, None)} & found
    narrow = _op.get("fused_matmul").problem((512, 100, 512), "bfloat16")
    assert all(c.epilogue_subtile is None
               for c in MatmulConfig.candidates(narrow, _op.Device("triton")))


def test_backward_steps_of_wide_tiles_fit_shared_memory():
    from pallas_core.triton import backend
    with backend.capturing():  # the GPU's tiles, not the CPU interpreter's
        # 128 x 256 forward tiles: dx (128 x 64 tiles) steps N by 128, dw (64 x 256) M by 64.
        assert fm.backward_step(128, 64, 256, "triton") == 128
        assert fm.backward_step(64, 256, 128, "pallas_triton") == 64
        # The default 128 x 128 x 64 tiles (bf16) keep their steps; float32's 128 x 128 x 32
        # halves them (4-byte operands: 128 deep, dw spilled on sm_90).
        assert fm.backward_step(128, 64, 128, "triton") == 128
        assert fm.backward_step(64, 128, 128, "triton") == 128
        assert fm.backward_step(128, 32, 128, "triton") == 128
        assert fm.backward_step(128, 32, 128, "triton", itemsize=4) == 64
        assert fm.backward_step(32, 128, 128, "pallas_triton", itemsize=4) == 64
    assert fm.backward_step(512, 512, 512, "mosaic_tpu") == 512
    assert fm.backward_step(512, 512, 512, "interpret") == 512


def test_grouped_matmul_stores_its_rows_in_pieces():
    """ops.ragged_dot's grouped matmul on the core: each visit stores its group's rows of
    every column piece (groups of 5, 0 and 45 rows; N = 90 in 64-wide tiles), forward and
    gradients on triton (Triton's interpreter, the loop walk's masked stores), forward on
    interpret (the grid walk)."""
    pytest.importorskip("triton")
    from ops.moe.config import RaggedDotConfig
    lhs = X
    rhs = np.stack([W, W[::-1], -W]).astype(np.float32)
    sizes = jnp.asarray([5, 0, 45], jnp.int32)
    config = RaggedDotConfig(16, 64, 32, epilogue_subtile=2)
    run = lambda lhs, rhs: ops.ragged_dot(lhs, rhs, sizes, implementation="triton",
                                          block_sizes=config)
    ref = lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, sizes,
                                              precision=jax.lax.Precision.HIGHEST)
    assert_close(run(lhs, rhs), ref(lhs, rhs), FORWARD[jnp.float32])
    loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))
    for g, e in zip(jax.grad(loss(run), (0, 1))(lhs, rhs), jax.grad(loss(ref), (0, 1))(lhs, rhs)):
        assert_close(g, e, BACKWARD[jnp.float32])
    assert "tl.split" in pl.triton.source(run, lhs, rhs)[0]
    # The interpreter's grid walk: visits of one tile store their rows over what is there.
    got = ops.ragged_dot(lhs, rhs, sizes, implementation="interpret", block_sizes=config)
    assert_close(got, ref(lhs, rhs), FORWARD[jnp.float32])


@pytest.mark.parametrize("backend, platform, config", [
    ("mosaic_tpu", "tpu", MatmulConfig(256, 512, 512, epilogue_subtile=4)),  # 128-lane pieces
    ("pallas_triton", "cuda", MatmulConfig(64, 128, 32, epilogue_subtile=2))])
def test_subtiled_kernels_lower_through_jax(backend, platform, config):
    """Mosaic TPU and JAX's Triton lowering take the split accumulator and the narrowed
    Refs (lowered from this host; compiled only on the device); the pieces change the
    kernel."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    args = (sds(300, 768), sds(768, 1100), sds(1100))

    def lowered(config):
        fn = lambda x, w, b: ops.fused_matmul(x, w, b, activation="gelu", implementation=backend,
                                              block_sizes=config)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    assert lowered(config) != lowered(dataclasses.replace(config, epilogue_subtile=None))
