"""docs/pallas_core.md section 11 ("The shape of the GPU program"): loop peeling, grouped program order, persistent programs and tensor
descriptors (TMA) in our Triton code generator.

Results run in Triton's CPU interpreter and are compared with the interpret
backend (bit for bit where the arithmetic is the same sequence of float32
operations) and with XLA references; the GPU code is checked in the sm_90
PTX that Triton's own compiler produces on this host.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from pallas_core.triton import program_order
from tests.tolerances import FORWARD, assert_close

pytest.importorskip("triton")
pytest.importorskip("torch")

# A TPU-style reduction (docs/pallas_core.md section 5) over grid axis 2, on shapes that divide none of the blocks.
M, N, K = 40, 72, 100
BM, BN, BK = 16, 32, 16


def _reduction_kernel(x_ref, y_ref, o_ref, acc_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.full(acc_ref.shape, 0.5, jnp.float32)

    acc_ref[...] += x_ref[...] - y_ref[...]

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...] * 2.0


def _reduction(backend, **switches):
    """``2 * (0.5 + sum_k (x[k] - y[k]))`` blockwise, k over grid axis 2: float32 adds in one
    order and nothing XLA could fuse into an FMA, so every backend agrees bit for bit."""
    params = (pl.triton.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"), **switches)
              if backend == "triton" else pl.CompilerParams(("parallel", "parallel", "arbitrary")))
    spec = pl.BlockSpec((BM, BN), lambda i, j, k: (i, j))
    stacked = pl.BlockSpec((None, BM, BN), lambda i, j, k: (k, i, j))
    return pl.pallas_call(
        _reduction_kernel, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=(pl.cdiv(M, BM), pl.cdiv(N, BN), 3), in_specs=[stacked, stacked], out_specs=spec,
        scratch_shapes=[pl.tpu.VMEM((BM, BN), jnp.float32)], compiler_params=params, backend=backend)


def _inputs(*shapes, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _loop_body(source: str) -> str:
    """The lines of the generated kernel's (last) loop over a grid axis."""
    lines = source.splitlines()
    start = max(i for i, line in enumerate(lines) if re.match(r"\s*for i\d+ in range\(G\d+\):", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(body)


# ---------------------------------------------------------------------------------------
# Loop peeling
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("peel", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_peeling_bit_identical_to_interpret(peel):
    x, y = _inputs((3, M, N), (3, M, N))
    got = _reduction("triton", loop_peeling=peel)(x, y)
    want = _reduction("interpret")(x, y)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), 2 * (0.5 + np.sum(np.asarray(x) - np.asarray(y), 0)),
                               rtol=1e-6, atol=1e-6)


def test_peeling_moves_first_and_last_iteration_blocks_out_of_the_loop():
    x, y = _inputs((3, M, N), (3, M, N))
    peeled = pl.triton.source(_reduction("triton"), x, y)[0]
    kept = pl.triton.source(_reduction("triton", loop_peeling=False), x, y)[0]
    body = _loop_body(peeled)
    assert "if " not in body and "tl.store(" not in body, peeled
    assert _loop_body(kept).count("if ") == 2, kept
    before, after = peeled.split(body)  # the init before the loop, the store after it
    assert "tl.full((16, 32), 0.5, tl.float32)" in before and "tl.store(" in after


def _kernel_with(guard):
    """A reduction over grid axis 1 whose pl.when blocks peeling must leave in the loop."""
    def kernel(x_ref, o_ref, tmp_ref):
        k = pl.program_id(1)
        if guard == "after_a_write":
            tmp_ref[...] = x_ref[...] * 2.0  # the k == 0 block reads what this wrote

            @pl.when(k == 0)
            def _():
                o_ref[...] = tmp_ref[...]

            @pl.when(k > 0)
            def _():
                o_ref[...] += tmp_ref[...]
        elif guard == "middle_iteration":
            @pl.when(k == 1)
            def _():
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            o_ref[...] += x_ref[...]
        elif guard == "reads_a_loop_value":
            @pl.when(k == 0)
            def _():
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            total = o_ref[...] + x_ref[...]
            o_ref[...] = total

            @pl.when(k == pl.num_programs(1) - 1)
            def _():
                o_ref[...] = total * 3.0  # a value of the loop body, not a Ref
    return kernel


@pytest.mark.parametrize("guard", ["after_a_write", pytest.param("middle_iteration", marks=pytest.mark.slow),
                                   pytest.param("reads_a_loop_value", marks=pytest.mark.slow)])
def test_peeling_leaves_blocks_that_may_not_move(guard):
    (x,) = _inputs((24, 3 * 16))

    def call(backend):
        return pl.pallas_call(_kernel_with(guard), out_shape=jax.ShapeDtypeStruct((24, 16), jnp.float32),
                              grid=(3, 3), in_specs=[pl.BlockSpec((8, 16), lambda i, k: (i, k))],
                              out_specs=pl.BlockSpec((8, 16), lambda i, k: (i, 0)), backend=backend,
                              scratch_shapes=[pl.tpu.VMEM((8, 16), jnp.float32)],
                              compiler_params=pl.CompilerParams(("parallel", "arbitrary")))
    body = _loop_body(pl.triton.source(call("triton"), x)[0])
    assert body.count("if ") == (2 if guard == "after_a_write" else 1), body
    np.testing.assert_array_equal(np.asarray(call("triton")(x)), np.asarray(call("interpret")(x)))


def test_peeling_moves_blocks_past_other_buffers():
    """The attention kernels' shape: the k == 0 block's value made, and another Ref read,
    before it."""
    def kernel(x_ref, y_ref, o_ref):
        k = pl.program_id(1)
        start = jnp.full(o_ref.shape, 1.5, jnp.float32) + pl.program_id(0).astype(jnp.float32)
        y = y_ref[...]  # touches y only: the k == 0 block (o only) may go before it

        @pl.when(k == 0)
        def _():
            o_ref[...] = start  # computed again before the loop
        o_ref[...] += x_ref[...] - y

    x, y = _inputs((24, 48), (24, 16))

    def call(backend):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((24, 16), jnp.float32), grid=(3, 3),
                              in_specs=[pl.BlockSpec((8, 16), lambda i, k: (i, k)),
                                        pl.BlockSpec((8, 16), lambda i, k: (i, 0))],
                              out_specs=pl.BlockSpec((8, 16), lambda i, k: (i, 0)), backend=backend,
                              compiler_params=pl.CompilerParams(("parallel", "arbitrary")))
    assert "if " not in _loop_body(pl.triton.source(call("triton"), x, y)[0])
    np.testing.assert_array_equal(np.asarray(call("triton")(x, y)), np.asarray(call("interpret")(x, y)))


def test_peeling_shrinks_fused_matmul_on_sm90():
    """The k == 0 / k == last blocks of fused_matmul out of the K loop: 96 KiB of shared memory
    (the three pipeline stages) instead of 128 KiB (plus the epilogue's layout conversion,
    live inside the loop), and no per-iteration select of the accumulator."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    f = lambda a, b: ops.fused_matmul(a, b, implementation="triton")
    (report,) = pl.triton.compile(f, x, x)
    assert report["shared_memory_bytes"] == 3 * (128 * 64 + 64 * 128) * 2
    assert report["spill_bytes"] == 0
    ptx = report["asm"]["ptx"]
    loop = _ptx_loop(ptx)
    assert loop.count("wgmma.mma_async") == 4
    assert len(re.findall(r"\bselp", loop)) < 8, "the accumulator is re-selected in every iteration"
    assert len(re.findall(r"\bbra", loop)) == 0


def _ptx_loop(ptx: str) -> str:
    """The PTX of the innermost loop: from its header label to its back edge."""
    (label,) = re.findall(r"^(\$L__BB\d+_\d+):\s*// .*Loop Header", ptx, re.M)[-1:]
    body = ptx[ptx.index(label + ":"):]
    return body[:body.index(f"bra \t{label};")]


# ---------------------------------------------------------------------------------------
# Grouped program order, persistent programs, tensor descriptors
# ---------------------------------------------------------------------------------------

def _decoded(parallel, sizes, group):
    """Grid indices of every flat tile id, by running the generated decoding lines."""
    lines, names = program_order.decode(parallel, group, "flat")
    env = {f"G{a}": n for a, n in zip(parallel, sizes)} | {"GROUP": group}
    env["tl"] = type("tl", (), {"minimum": staticmethod(min)})
    out = []
    for flat in range(int(np.prod(sizes))):
        scope = dict(env, flat=flat)
        exec("\n".join(lines), {}, scope)  # noqa: S102 - our own generated lines
        out.append(tuple(scope[names[a]] for a in parallel))
    return out


@pytest.mark.parametrize("sizes,group", [((5, 3), 2), ((7, 4), 3), ((2, 5, 3), 2), ((4, 6), 1)])
def test_grouped_order_is_a_permutation_walking_bands(sizes, group):
    parallel = list(range(len(sizes)))
    order = _decoded(parallel, sizes, group)
    assert sorted(order) == sorted(np.ndindex(*sizes))  # every tile exactly once
    rows, cols = sizes[-2:]
    plane = [o[-2:] for o in order[:rows * cols]]
    if group == 1:
        assert plane == list(np.ndindex(rows, cols))
        return
    for start in range(0, rows, group):  # band after band, the row index fastest inside one
        band = plane[start * cols:min(start + group, rows) * cols]
        height = min(group, rows - start)
        assert band == [(start + t % height, t // height) for t in range(height * cols)]


def _matmul_call(backend, m, n, k, dtype=jnp.bfloat16, blocks=(16, 32, 32), **switches):
    bm, bn, bk = blocks

    def kernel(x_ref, y_ref, o_ref, acc_ref):
        kk = pl.program_id(2)

        @pl.when(kk == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(kk == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)
    semantics = ("parallel", "parallel", "arbitrary")
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), dtype), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)), scratch_shapes=[pl.tpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pl.triton.CompilerParams(dimension_semantics=semantics, **switches)
        if backend == "triton" else pl.CompilerParams(semantics), backend=backend)


@pytest.mark.parametrize("n,switches", [
    (104, dict(tma=True, persistent=5, group_size=2)),
    pytest.param(100, dict(group_size=3, persistent=4), marks=pytest.mark.slow),
    pytest.param(100, dict(tma=True), marks=pytest.mark.slow)])
def test_switches_keep_results_bit_identical(n, switches, monkeypatch):
    """M and N divide no block: edge tiles are masked, or clipped by the descriptor. Rows of
    x (64 bf16) are 128 bytes, TMA-able; rows of w and the output are 200 bytes for n = 100
    (not 16-byte aligned: pointers), 208 for n = 104 (descriptors, stores clipped at the edge)."""
    from pallas_core.triton import backend
    m, k = 40, 64
    x, w = _inputs((m, k), (k, n), dtype=jnp.bfloat16)
    plain = np.asarray(_matmul_call("triton", m, n, k)(x, w), np.float32)
    grids = []
    launch = backend.runtime.launch
    monkeypatch.setattr(backend.runtime, "launch", lambda *a, **kw: grids.append(kw["grid"]) or launch(*a, **kw))
    got = np.asarray(_matmul_call("triton", m, n, k, **switches)(x, w), np.float32)
    np.testing.assert_array_equal(got, plain)
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert_close(got, want, FORWARD[jnp.bfloat16])
    tiles = pl.cdiv(m, 16) * pl.cdiv(n, 32)
    assert grids == [(min(tiles, switches.get("persistent") or tiles),)]
    source = pl.triton.source(_matmul_call("triton", m, n, k, **switches), x, w)[0]
    assert ("GROUP" in source) == ("group_size" in switches)
    assert ("range(tl.program_id(0), NUM_TILES, NUM_PROGRAMS)" in source) == ("persistent" in switches)
    described = [p for p in ("p0", "p1", "p2") if f"tl.make_tensor_descriptor({p}," in source]
    assert described == ([] if not switches.get("tma") else ["p0"] if n == 100 else ["p0", "p1", "p2"])
    assert source.count(".load([") + source.count(".store([") == len(described)


RUN = [False, pytest.param(True, marks=pytest.mark.slow)]  # results too (the source alone in CI)


@pytest.mark.parametrize("run", RUN)
def test_tma_keeps_pointers_for_strided_masked_and_misaligned_views(run):
    def kernel(x_ref, o_ref):
        every_other = x_ref[:, pl.ds(0, 16, stride=2)]  # strided: pointers
        shifted = pl.load(x_ref, (slice(None), pl.ds(0, 16)), mask=jnp.arange(16)[None, :] < 9, other=0.0)
        o_ref[...] = every_other + shifted + x_ref[:, :16]  # the last: a descriptor
    x = _inputs((16, 64))[0]
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32), grid=(2,),
                          in_specs=[pl.BlockSpec((16, 32), lambda i: (0, i))],
                          out_specs=pl.BlockSpec((16, 16), lambda i: (0, i)), backend="triton",
                          compiler_params=pl.triton.CompilerParams(tma=True))
    source = pl.triton.source(call, x)[0]
    assert source.count(".load([") == 1 and source.count("tl.load(") == 2
    if not run:
        return
    got = call(x)
    want = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32), grid=(2,),
                          in_specs=[pl.BlockSpec((16, 32), lambda i: (0, i))],
                          out_specs=pl.BlockSpec((16, 16), lambda i: (0, i)), backend="interpret")(x)
    np.testing.assert_array_equal(np.asarray(got)[:, :32], np.asarray(want)[:, :32])


def test_tma_moves_column_pieces_of_a_block():
    """Views of a block's columns at static offsets that keep 16-byte alignment (an
    epilogue's halves) move through one descriptor; an unaligned offset keeps pointers.
    N = 80 runs the second block past the array: its stores are clipped."""
    def kernel(x_ref, o_ref):
        for p in range(2):
            cols = pl.ds(16 * p, 16)
            o_ref.at[:, cols][...] = x_ref.at[:, cols][...] * (p + 2)
        o_ref[:, pl.ds(2, 8)] = x_ref[:, pl.ds(2, 8)]  # 8 bytes past the origin: pointers

    x = _inputs((16, 80))[0]
    call = lambda backend: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 80), jnp.float32), grid=(3,),
        in_specs=[pl.BlockSpec((16, 32), lambda i: (0, i))],
        out_specs=pl.BlockSpec((16, 32), lambda i: (0, i)), backend=backend,
        compiler_params=pl.triton.CompilerParams(tma=True) if backend == "triton" else None)
    source = pl.triton.source(call("triton"), x)[0]
    assert source.count(".load([") == 2 and source.count(".store([") == 2
    assert source.count("tl.make_tensor_descriptor(") == 2  # one box per operand
    assert source.count("tl.load(") == 1 and source.count("tl.store(") == 1
    np.testing.assert_array_equal(np.asarray(call("triton")(x)), np.asarray(call("interpret")(x)))


def test_tma_becomes_bulk_tensor_copies_on_sm90():
    """cp.async.bulk.tensor (the tensor-memory accelerator) with tma=True, cp.async without;
    wgmma either way."""
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    reports = {tma: pl.triton.compile(_matmul_call("triton", 512, 512, 512, blocks=(128, 128, 64), tma=tma,
                                                   num_warps=8, num_stages=3), x, x)[0]
               for tma in (False, True)}
    on, off = reports[True]["asm"]["ptx"], reports[False]["asm"]["ptx"]
    assert "cp.async.bulk.tensor" in on and "cp.async.bulk.tensor" not in off
    assert "cp.async.cg" in off and "wgmma.mma_async" in on and "wgmma.mma_async" in off
    assert reports[True]["global_scratch_bytes"] > 0 and reports[False]["global_scratch_bytes"] == 0
    assert reports[True]["spill_bytes"] == 0


@pytest.mark.parametrize("bad,match", [(dict(group_size=0), "group_size"), (dict(persistent=True), "persistent"),
                                       (dict(persistent=2.0), "persistent"), (dict(tma="yes"), "tma"),
                                       (dict(loop_peeling=None), "loop_peeling")])
def test_bad_switches_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        pl.triton.CompilerParams(**bad)
    x = _inputs((8, 128))[0]
    call = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                          out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), backend="triton",
                          compiler_params=dict(triton=bad))
    with pytest.raises(ValueError, match=match):
        call(x)


def test_fused_matmul_defaults():
    """Grouped order (fused_matmul asks for it) and peeling on; pointers, not descriptors, and
    one program per tile (the tma and persistent defaults)."""
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    (source,) = pl.triton.source(lambda a, b: ops.fused_matmul(a, b, implementation="triton"), x, x)
    assert "GROUP" in source and "band_rows" in source
    assert "if " not in _loop_body(source)
    assert "make_tensor_descriptor" not in source and "NUM_PROGRAMS" not in source


@pytest.mark.parametrize("run", RUN)
def test_tma_keeps_pointers_for_outputs_read_back(run):
    """An output block accumulated across grid axis 1 (loaded after being stored) keeps
    pointers: a TMA store completes asynchronously and is not ordered with later loads.
    The input, only read, still goes through a descriptor."""
    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        o_ref[...] += x_ref[...]

    x = _inputs((16, 96))[0]

    def call(backend, **params):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32), grid=(2, 3),
                              in_specs=[pl.BlockSpec((8, 32), lambda i, k: (i, k))],
                              out_specs=pl.BlockSpec((8, 32), lambda i, k: (i, 0)), backend=backend,
                              compiler_params=params or None)
    source = pl.triton.source(call("triton", triton=dict(tma=True)), x)[0]
    assert "tl.make_tensor_descriptor(p0," in source and "tl.make_tensor_descriptor(p1," not in source
    if run:
        np.testing.assert_array_equal(np.asarray(call("triton", triton=dict(tma=True))(x)),
                                      np.asarray(call("interpret")(x)))
