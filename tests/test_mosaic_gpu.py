"""pallas_core.gpu (Mosaic GPU) on a host without a GPU: JAX's GPU interpret mode with
race detection, the cuda lowering, and the refusals (docs/pallas_core.md section 16).

Every kernel here is written with pallas_core names (``import pallas_core as pl``,
``from pallas_core import gpu as plgpu``), runs in the interpret mode against a
float64 reference on fresh random inputs, and is lowered for ``cuda`` from this
host, with the Mosaic GPU module read back (``plgpu.mosaic_modules``) to check
that the warpgroup instructions are there.
"""
import importlib.util
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import gpu as plgpu
from pallas_core.gpu import target
from tests.tolerances import FORWARD, assert_close, for_dtype


def _ref64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


# --- a TMA round trip: GMEM -> SMEM (barrier) -> registers -> SMEM -> GMEM -------------------


def _scale_rows(x, block_rows=64):
    """out[r] = 2 * x[r] + r // block_rows, one block of rows per program."""

    def body(x_gmem, o_gmem, smem, bar):
        rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows], smem, bar)
        plgpu.barrier_wait(bar)
        smem[...] = smem[...] * 2 + pl.program_id(0).astype(smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_gmem.at[rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_shapes=[plgpu.SMEM((block_rows, x.shape[1]), x.dtype),
                                        plgpu.Barrier()],
                        grid=(x.shape[0] // block_rows,), grid_names=("rows",))(x)


def test_tma_copy_and_barrier_round_trip():
    x = jax.random.normal(jax.random.key(0), (128, 64), jnp.float32)
    out = _scale_rows(x)
    (x64,) = _ref64(x)
    expected = 2 * x64 + (np.arange(128) // 64)[:, None]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(_scale_rows)(x)), expected, rtol=1e-6, atol=1e-6)
    (module,) = plgpu.mosaic_modules(_scale_rows, x)
    assert "nvvm.cp.async.bulk.tensor.shared.cluster.global" in module  # the TMA load
    assert re.search(r"cp\.async\.bulk(\.tensor)?\.global\.shared", module)  # the bulk store
    assert "nvvm.mbarrier.try_wait.parity" in module


# --- a warp-specialized matmul: 2 consumer warpgroups + a TMA producer ---------------------------


def ws_matmul(a, b, *, tile_m=64, tile_n=128, tile_k=64, steps=2):
    """``a @ b`` by a warp-specialized kernel (the test's demonstration, not an op).

    Each block computes a ``(2 * tile_m, tile_n)`` tile: warpgroups 0 and 1 each
    ``wgmma`` one ``tile_m``-row half into their own accumulator, warpgroup 2
    issues the TMA loads of ``steps`` K tiles ahead
    (``emit_pipeline_warp_specialized``); each compute warpgroup stores its tile
    through SMEM with a TMA store. Shapes need not divide the tiles (TMA loads
    past the edge read zeros, stores past it are dropped), but every array's
    rows must be a multiple of 8 and its minor dim of the 128-byte swizzle's
    width (64 bf16): the TMA tiling of the whole array (JAX's lowering raises
    ``ValueError`` otherwise).
    """
    (m, k), (_, n) = a.shape, b.shape
    dtype = a.dtype
    cta_m, bits = 2 * tile_m, jnp.dtype(dtype).itemsize * 8

    def swizzled(minor):
        swizzle = plgpu.find_swizzle(minor * bits)
        return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))

    def body(a_gmem, b_gmem, o_gmem, o_smem):
        mi, ni, wg = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("wg")

        def compute_context(run_pipeline):
            def with_acc(acc_ref):
                run_pipeline(acc_ref)
                o_smem[wg] = acc_ref[...].astype(dtype)  # a slot per warpgroup
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg],
                    o_gmem.at[pl.ds(mi * cta_m + wg * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(with_acc, plgpu.ACC((tile_m, tile_n), jnp.float32))

        def step(_, a_smem, b_smem, acc_ref):
            plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg * tile_m, tile_m)], b_smem)
            plgpu.wgmma_wait(0)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(pl.cdiv(k, tile_k),), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, tile_k), lambda kk: (0, kk), transforms=swizzled(tile_k)),
                      plgpu.BlockSpec((tile_k, tile_n), lambda kk: (kk, 0), transforms=swizzled(tile_n))],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
            compute_context=compute_context,
        )(a_gmem.at[pl.ds(mi * cta_m, cta_m), :], b_gmem.at[:, pl.ds(ni * tile_n, tile_n)])

    return plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct((m, n), dtype),
                        scratch_shapes=[plgpu.SMEM((2, tile_m, tile_n), dtype,
                                                   transforms=swizzled(tile_n))],
                        grid=(pl.cdiv(m, cta_m), pl.cdiv(n, tile_n)), grid_names=("m", "n"),
                        num_threads=3, thread_name="wg")(a, b)


def test_warp_specialized_matmul_on_edge_tiles():
    # M = 136 and N = 192 do not divide the 128 x 128 block tile: the second row and
    # column of blocks run past the arrays' edges.
    a = jax.random.normal(jax.random.key(1), (136, 128), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (128, 192), jnp.bfloat16)
    out = ws_matmul(a, b)
    a64, b64 = _ref64(a, b)
    assert_close(out, a64 @ b64, for_dtype(FORWARD, jnp.bfloat16), "ws_matmul")
    (module,) = plgpu.mosaic_modules(ws_matmul, a, b)
    for op in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
               "nvvm.wgmma.wait.group.sync.aligned", "nvvm.setmaxregister",
               "nvvm.cp.async.bulk.tensor.shared.cluster.global", "nvvm.mbarrier.arrive"):
        assert op in module, op


@pytest.mark.parametrize("shape, dim", [((136, 80), "dimension 1"), ((130, 128), "dimension 0")])
def test_matmul_tma_tiling_contract(shape, dim):
    """Rows a multiple of 8, minor dims a multiple of the swizzle width: else JAX's
    lowering refuses the TMA tiling. JAX's interpreter alone would run such a
    kernel; the interpreted call lowers it for cuda first, so it fails here too,
    before anything runs."""
    a = jnp.zeros(shape, jnp.bfloat16)
    b = jnp.zeros((shape[1], 192), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"{dim} must have size smaller or a multiple of its tiling"):
        ws_matmul(a, b)
    if jax.default_backend() == "cpu":  # named as an interpreted kernel that would not lower
        with pytest.raises(ValueError, match="'body' runs in the GPU interpret mode but does not "
                                             "lower for cuda"):
            ws_matmul(a, b)


# --- the race detector must find races -------------------------------------------------------------


def _read_before_wait(x_gmem, o_gmem, smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
    early = smem[...]  # the TMA write may not have landed: not ordered by the barrier
    plgpu.barrier_wait(bar)
    smem[...] = early * 2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)


def test_race_detector_catches_read_before_barrier_wait():
    x = jax.random.normal(jax.random.key(3), (64, 64), jnp.float32)
    racy = plgpu.kernel(_read_before_wait, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_shapes=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier()],
                        interpret=True)
    with pytest.raises(plgpu.RaceError, match="'_read_before_wait'"):
        racy(x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="pallas_core.gpu.RaceError"):
        jax.block_until_ready(jax.jit(racy)(x))
    # Detection off: it runs (the interpreter's TMA is eager, so the value is even right).
    quiet = plgpu.kernel(_read_before_wait, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         scratch_shapes=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier()],
                         interpret=plgpu.InterpretGPUParams(detect_races=False))
    np.testing.assert_allclose(np.asarray(quiet(x)), 2 * np.asarray(x))


def _warpgroups_share_a_slot(x_gmem, o_gmem, smem, bar):
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
        plgpu.barrier_wait(bar)

    # Warpgroup 1 reads what warpgroup 0's TMA wrote, with no barrier between them.
    @pl.when(wg == 1)
    def _():
        smem[...] = smem[...] + 1


def test_race_detector_catches_warpgroups_without_a_barrier():
    x = jax.random.normal(jax.random.key(4), (64, 64), jnp.float32)
    racy = plgpu.kernel(_warpgroups_share_a_slot, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_shapes=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier()],
                        num_threads=2, thread_name="wg", interpret=True)
    with pytest.raises(plgpu.RaceError, match="warpgroups"):
        racy(x)
    # The simulated GPU was reset: the next kernel runs.
    np.testing.assert_allclose(np.asarray(_scale_rows(x)), 2 * np.asarray(x), rtol=1e-6)


def test_a_failing_warpgroup_fails_the_kernel_instead_of_hanging():
    def body(x_gmem, o_gmem, smem, bar):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(bar)  # nothing ever arrives: warpgroup 1 fails first

        @pl.when(wg == 1)
        def _():
            rows = smem[pl.ds(wg * 48, 32), :]  # rows 48..79 of 64: past the buffer
            smem[pl.ds(0, 32), :] = rows + 1

    f = plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                     scratch_shapes=[plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier()],
                     num_threads=2, thread_name="wg", interpret=True)
    with pytest.raises(Exception, match="[Oo]ut-of-bounds"):
        jax.block_until_ready(f(jnp.ones((64, 64), jnp.float32)))


# --- pallas_core names in Mosaic GPU kernels; run_state, wgmma from registers --------------------


def test_backend_neutral_names_inside_a_kernel():
    """pl.program_id / num_programs / ds / when / loop, lax.fori_loop, pl.run_scoped with
    named scratch and collective_axes, all in a 2-warpgroup kernel."""
    x = jax.random.normal(jax.random.key(5), (2, 64, 64), jnp.float32)

    def body(x_gmem, o_gmem, bar):
        wg = lax.axis_index("wg")
        blk = pl.program_id(0)

        def scoped(*, buf, done):
            @pl.when(wg == 0)
            def _():
                plgpu.copy_gmem_to_smem(x_gmem.at[blk], buf, bar)
                plgpu.barrier_wait(bar)
                tile = buf[...]
                total = lax.fori_loop(0, 3, lambda i, acc: acc + tile, tile * 0)  # one layout
                buf[...] = total

                @pl.loop(0, 64, step=32)
                def _(r):
                    buf[pl.ds(r, 32), :] = buf[pl.ds(r, 32), :] * pl.num_programs(0)
                plgpu.commit_smem()
                plgpu.barrier_arrive(done)

            @pl.when(wg == 1)
            def _():
                plgpu.barrier_wait(done)  # the tile is ready: warpgroup 1 stores it
                plgpu.copy_smem_to_gmem(buf, o_gmem.at[blk])
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, buf=plgpu.SMEM((64, 64), jnp.float32), done=plgpu.Barrier(),
                      collective_axes="wg")

    f = plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                     scratch_shapes=[plgpu.Barrier()], grid=(2,), grid_names=("b",),
                     num_threads=2, thread_name="wg")
    np.testing.assert_allclose(np.asarray(f(x)), 6 * np.asarray(x, np.float64), rtol=1e-6)


def _attention_like_block(q, k, v):
    """One block of softmax(q k^T) v the way FA3-style kernels write it: QK^T by a
    wgmma with a transposed K view, P in registers (layouts cast), PV accumulated
    into an ``ACC.init`` accumulator by ``pl.run_state``."""
    (t, d), dtype = q.shape, q.dtype
    swizzle = plgpu.find_swizzle(d * jnp.dtype(dtype).itemsize * 8)
    tiles = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def body(q_gmem, k_gmem, v_gmem, o_gmem, q_smem, k_smem, v_smem, o_smem, bars):
        for i, (src, dst) in enumerate(((q_gmem, q_smem), (k_gmem, k_smem), (v_gmem, v_smem))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
            plgpu.barrier_wait(bars.at[i])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((t, t), jnp.float32))
        row = plgpu.broadcasted_iota(jnp.int32, (t, t), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (t, t), 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where(col <= row, s, -jnp.inf)  # causal
        m = plgpu.layout_cast(s.max(axis=1), plgpu.Layout.WGMMA.reduce(1))
        p = jnp.exp(s - lax.broadcast_in_dim(m, s.shape, [0]))
        l = p.sum(axis=1)
        acc0 = plgpu.layout_cast(jnp.zeros((t, d), jnp.float32), plgpu.Layout.WGMMA)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(dtype), v_smem)  # a register left operand

        acc = pl.run_state(pv)(plgpu.ACC.init(acc0))
        o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    smem = lambda: plgpu.SMEM((t, d), dtype, transforms=tiles)
    return plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct((t, d), dtype),
                        scratch_shapes=[smem(), smem(), smem(), smem(), plgpu.Barrier(num_barriers=3)],
                        compiler_params=plgpu.CompilerParams(approx_math=True))(q, k, v)


def test_run_state_accumulator_and_register_wgmma():
    q, k, v = jax.random.normal(jax.random.key(6), (3, 64, 64), jnp.float16)
    out = _attention_like_block(q, k, v)
    q64, k64, v64 = _ref64(q, k, v)
    s = np.where(np.tril(np.ones((64, 64), bool)), q64 @ k64.T, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    assert_close(out, (p / p.sum(axis=1, keepdims=True)) @ v64, 4e-3, "attention block")
    (module,) = plgpu.mosaic_modules(_attention_like_block, q, k, v)
    assert module.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16") == 8  # 2 x (K / 16)


# --- the grid form: pallas_call(backend="mosaic_gpu") ----------------------------------------------


def _column_sums(x, **params):
    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        o_ref[...] += x_ref[...] * (pl.program_id(0) + 1).astype(x_ref.dtype)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], 128), x.dtype),
                          grid=(pl.cdiv(x.shape[0], 16), pl.cdiv(x.shape[1], 128)),
                          in_specs=[pl.BlockSpec((16, 128), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((16, 128), lambda i, j: (i, 0)),
                          compiler_params=plgpu.CompilerParams(("parallel", "arbitrary"), **params),
                          backend="mosaic_gpu")(x)


def test_grid_form_pallas_call_runs_in_the_interpret_mode():
    # 40 x 300 on 16 x 128 blocks: edge blocks in both dims; the arbitrary axis
    # accumulates into a resident output block (one pipeline slot: mosaic_gpu_steps).
    x = jax.random.normal(jax.random.key(7), (40, 300), jnp.float32)
    out = _column_sums(x)
    (x64,) = _ref64(x)
    padded = np.pad(x64, ((0, 8), (0, 84))).reshape(48, 3, 128).sum(1)[:40]
    scale = (np.arange(40) // 16 + 1)[:, None]
    np.testing.assert_allclose(np.asarray(out), padded * scale, rtol=1e-5, atol=1e-5)
    text = jax.jit(_column_sums).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="max_concurrent_steps=1"):
        _column_sums(x, max_concurrent_steps=2)


def _grid_matmul(a, b):
    """One 64 x 64 output tile per grid point, the whole K in one wgmma: operands tiled and
    swizzled by pallas_core.gpu.BlockSpec transforms, which JAX's pipeline applies."""
    (m, k), (_, n) = a.shape, b.shape
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(a_ref, b_ref, o_ref):
        def with_acc(acc_ref):
            plgpu.wgmma(acc_ref, a_ref, b_ref)
            plgpu.wgmma_wait(0)
            o_ref[...] = acc_ref[...]

        pl.run_scoped(with_acc, plgpu.ACC((64, 64), jnp.float32))

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                          grid=(pl.cdiv(m, 64), pl.cdiv(n, 64)),
                          in_specs=[plgpu.BlockSpec((64, k), lambda i, j: (i, 0), transforms=swizzled),
                                    plgpu.BlockSpec((k, 64), lambda i, j: (0, j), transforms=swizzled)],
                          out_specs=pl.BlockSpec((64, 64), lambda i, j: (i, j)),
                          backend="mosaic_gpu")(a, b)


def test_grid_form_with_swizzled_blocks_and_wgmma():
    a = jax.random.normal(jax.random.key(15), (136, 128), jnp.bfloat16)  # a last row block of 8
    b = jax.random.normal(jax.random.key(16), (128, 192), jnp.bfloat16)
    a64, b64 = _ref64(a, b)
    assert_close(_grid_matmul(a, b), a64 @ b64, for_dtype(FORWARD, jnp.float32) * 10, "grid wgmma")
    (module,) = plgpu.mosaic_modules(_grid_matmul, a, b)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in module


# --- refusals and bad arguments, all before tracing --------------------------------------------


class _Device:
    platform = "gpu"

    def __init__(self, kind, cc):
        self.device_kind, self.compute_capability = kind, cc


@pytest.mark.parametrize("kind, cc", [("Tesla V100-SXM2-16GB", "7.0"), ("NVIDIA A100-SXM4-80GB", "8.0"),
                                      ("AMD Instinct MI300X", "gfx942")])
def test_refuses_gpus_older_than_sm90_before_tracing(monkeypatch, kind, cc):
    monkeypatch.setattr(target, "default_device", lambda: _Device(kind, cc))
    traced = []

    def body(x_gmem, o_gmem):
        traced.append(True)

    f = plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with pytest.raises(NotImplementedError, match=f"sm_90.*{kind}|{kind}.*sm_90"):
        f(jnp.zeros((8, 128), jnp.float32))
    with pytest.raises(NotImplementedError, match="sm_90"):
        _column_sums(jnp.zeros((16, 128), jnp.float32))
    assert not traced
    monkeypatch.setattr(target, "default_device", lambda: _Device("NVIDIA H100 80GB HBM3", "9.0"))
    assert target.choose(None, "k").kind == target.MOSAIC


def _noop(*refs):
    pass


@pytest.mark.parametrize("make, error, words", [
    (lambda: plgpu.kernel(_noop, grid=(2,)), ValueError, "grid_names"),
    (lambda: plgpu.kernel(_noop, grid=(0,), grid_names=("x",)), ValueError, "grid must be ints >= 1"),
    (lambda: plgpu.kernel(_noop, num_threads=3), ValueError, "thread_name"),
    (lambda: plgpu.kernel(_noop, num_threads=17, thread_name="wg"), ValueError, "num_threads"),
    (lambda: plgpu.kernel(_noop, cluster=(2, 1, 1, 1), cluster_names=tuple("abcd")), ValueError,
     "cluster has at most 3 dims"),
    (lambda: plgpu.kernel(_noop, grid=(2,), grid_names=("wg",), num_threads=2, thread_name="wg"),
     ValueError, "distinct"),
    (lambda: plgpu.kernel(_noop, scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)]), TypeError,
     "not a Mosaic GPU memory space"),
    (lambda: plgpu.kernel(_noop, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                          out_type=jax.ShapeDtypeStruct((8,), jnp.float32)), ValueError, "not both"),
    (lambda: plgpu.kernel(_noop, compiler_params=pl.tpu.CompilerParams()), TypeError, "compiler_params"),
    (lambda: plgpu.kernel(_noop, interpret="yes"), TypeError, "interpret"),
    (lambda: plgpu.SMEM((64, 60), jnp.bfloat16, transforms=(plgpu.TilingTransform((8, 64)),)),
     ValueError, r"multiples of \(8, 64\)"),
    (lambda: plgpu.SMEM((64, 64), jnp.float32, transforms=(plgpu.TilingTransform((8, 64)),
                                                          plgpu.SwizzleTransform(128))),
     ValueError, "span 128 bytes"),
    (lambda: plgpu.ACC((100, 64)), ValueError, "multiple of 64"),
    (lambda: plgpu.ACC((64, 64), jnp.bfloat16), ValueError, "float32, float16 or int32"),
    (lambda: plgpu.Barrier(num_arrivals=0), ValueError, "num_arrivals"),
    (lambda: plgpu.BlockSpec((64, 64), lambda i: (i, 0), delay_release=-1), ValueError, "delay_release"),
    (lambda: plgpu.BlockSpec((64, 60), lambda i: (i, 0), transforms=(plgpu.TilingTransform((8, 64)),)),
     ValueError, "multiples of"),
    (lambda: plgpu.CompilerParams(("parallel", "diagonal")), ValueError, "dimension_semantics"),
    (lambda: plgpu.CompilerParams(max_concurrent_steps=0), ValueError, "max_concurrent_steps"),
    (lambda: plgpu.emit_pipeline_warp_specialized(_noop, grid=(4,), memory_registers=42, wg_axis="wg",
                                                  num_compute_wgs=2), ValueError, "memory_registers"),
    (lambda: plgpu.emit_pipeline(_noop, grid=(0,)), ValueError, "grid dims"),
])
def test_bad_arguments_are_named(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_body_arity_is_checked_when_called():
    f = plgpu.kernel(lambda x_gmem, o_gmem: None, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                     scratch_shapes=[plgpu.Barrier()])
    with pytest.raises(TypeError, match=r"called with 3 Refs \(1 operand"):
        f(jnp.zeros((8,), jnp.float32))


# --- on a GPU: the same kernels through JAX's Mosaic GPU lowering ----------------------------------


@pytest.mark.gpu
def test_kernels_run_on_the_gpu():
    """On an sm_90+ GPU the kernels above compile and run for real; an older GPU refuses them."""
    x = jax.random.normal(jax.random.key(10), (128, 64), jnp.float32)
    cc = target.compute_capability(jax.devices()[0])
    if cc is None or cc < target.MIN_COMPUTE_CAPABILITY:
        with pytest.raises(NotImplementedError, match="sm_90"):
            _scale_rows(x)
        return
    (x64,) = _ref64(x)
    np.testing.assert_allclose(np.asarray(_scale_rows(x)),
                               2 * x64 + (np.arange(128) // 64)[:, None], rtol=1e-6, atol=1e-6)
    a = jax.random.normal(jax.random.key(11), (136, 128), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(12), (128, 192), jnp.bfloat16)
    a64, b64 = _ref64(a, b)
    assert_close(ws_matmul(a, b), a64 @ b64, for_dtype(FORWARD, jnp.bfloat16), "ws_matmul on GPU")
    q, k, v = jax.random.normal(jax.random.key(13), (3, 64, 64), jnp.float16)
    q64, k64, v64 = _ref64(q, k, v)
    s = np.where(np.tril(np.ones((64, 64), bool)), q64 @ k64.T, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    assert_close(_attention_like_block(q, k, v), (p / p.sum(axis=1, keepdims=True)) @ v64, 4e-3,
                 "attention block on GPU")
    y = jax.random.normal(jax.random.key(14), (40, 300), jnp.float32)
    (y64,) = _ref64(y)
    expected = np.pad(y64, ((0, 8), (0, 84))).reshape(48, 3, 128).sum(1)[:40]
    np.testing.assert_allclose(np.asarray(_column_sums(y)), expected * (np.arange(40) // 16 + 1)[:, None],
                               rtol=1e-5, atol=1e-5)


# --- JAX's own Mosaic GPU example kernels, imports swapped to pallas_core -----------------------


def _on_pallas_core(module_name):
    """JAX's module ``module_name`` with ``pl`` / ``plgpu`` imported from pallas_core."""
    from benchmarks.jax_pallas_tests import to_pallas_core
    spec = importlib.util.find_spec(module_name)
    source = to_pallas_core(open(spec.origin).read())
    source = source.replace("import jax.experimental.pallas as pl\n", "import pallas_core as pl\n")
    source = source.replace("import jax.experimental.pallas.mosaic_gpu as plgpu\n",
                            "from pallas_core import gpu as plgpu\n")
    assert "jax.experimental.pallas import mosaic_gpu" not in source
    module = types.ModuleType(module_name.rsplit(".", 1)[-1] + "_on_pallas_core")
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    return module


@pytest.mark.slow
def test_jax_hopper_matmul_example_runs_on_pallas_core():
    hm = _on_pallas_core("jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu")
    hm.get_num_sms = lambda: 4  # a CPU has no SM count
    config = hm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
    a, b = jax.random.normal(jax.random.key(8), (2, 256, 256), jnp.bfloat16)
    a64, b64 = _ref64(a, b)
    assert_close(hm.matmul(a, b, None, config), a64 @ b64, for_dtype(FORWARD, jnp.bfloat16), "hopper")


@pytest.mark.slow
def test_jax_attention_example_with_run_state_runs_on_pallas_core():
    am = _on_pallas_core("jax.experimental.pallas.ops.gpu.attention_mgpu")
    am.cuda_versions = types.SimpleNamespace(cuda_runtime_get_version=lambda: 12092)
    q, k, v = jax.random.normal(jax.random.key(9), (3, 1, 256, 1, 64), jnp.float16)
    for causal in (False, True):
        config = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal)
        out = am.attention(q, k, v, config)
        assert_close(out, am.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                 causal=causal), 4e-3, f"attention causal={causal}")
